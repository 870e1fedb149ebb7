-- Bearer tokens for the gateway, as the forwarder checks them (serve/triton_pod/access.py):
-- when SONIC_RAY_AUTH_TOKENS_FILE names a file (components/token-auth mounts the Secret there),
-- every call must carry `authorization: Bearer <token>` with one of its tokens (one a line, #
-- comments). The file is re-read when it changes, so a rotated Secret takes effect without a
-- restart; an unreadable or emptied file keeps the last good tokens. The header is removed
-- before the call goes on, so Triton never sees it; nothing here logs a token. A gRPC call is
-- refused as gRPC refuses (UNAUTHENTICATED), an HTTP request with 401 and Triton's error shape.
local path = os.getenv("SONIC_RAY_AUTH_TOKENS_FILE")
if path == "" then path = nil end
local RECHECK_S = 2
local tokens = nil
local loaded_text = nil
local checked_at = -RECHECK_S
local UNAUTHENTICATED = "missing or invalid bearer token (send `authorization: Bearer <token>`)"

local function load()
  local file = io.open(path, "r")
  if file == nil then return end
  local text = file:read("*a")
  file:close()
  if text == nil or text == loaded_text then return end
  local found, count = {}, 0
  for line in text:gmatch("[^\r\n]+") do
    local token = line:match("^%s*(.-)%s*$")
    if token ~= "" and token:sub(1, 1) ~= "#" then
      found[token] = true
      count = count + 1
    end
  end
  if count > 0 then
    tokens, loaded_text = found, text
  end
end

function envoy_on_request(handle)
  -- Only the gateway's own routes may send Triton's admin key.
  handle:headers():remove("triton-grpc-protocol-sonic-ray-admin")
  handle:headers():remove("sonic-ray-admin")
  if path == nil then return end
  local now = os.time()
  if now - checked_at >= RECHECK_S then
    checked_at = now
    load()
  end
  local headers = handle:headers()
  local presented = headers:get("authorization")
  headers:remove("authorization")
  local token = presented and presented:match("^[Bb][Ee][Aa][Rr][Ee][Rr]%s+(.-)%s*$")
  if tokens ~= nil and token ~= nil and token ~= "" and tokens[token] then return end
  local content_type = headers:get("content-type") or ""
  if content_type:sub(1, 16) == "application/grpc" then
    -- A gRPC trailers-only answer: what a Triton client reads as UNAUTHENTICATED.
    handle:respond({[":status"] = "200", ["content-type"] = "application/grpc",
                    ["grpc-status"] = "16", ["grpc-message"] = UNAUTHENTICATED}, "")
  else
    -- The HTTP listener's local_reply_config gives it Triton's error shape.
    handle:respond({[":status"] = "401", ["www-authenticate"] = "Bearer"}, UNAUTHENTICATED)
  end
end
