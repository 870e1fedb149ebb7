-- Bearer tokens for the gateway, as the forwarder checks them (serve/triton_pod/access.py):
-- when SONIC_RAY_AUTH_TOKENS_FILE names a file (components/token-auth mounts the Secret there),
-- every call must carry `authorization: Bearer <token>` with one of its tokens (one a line, #
-- comments). The file is re-read when it changes, so a rotated Secret takes effect without a
-- restart; an unreadable or emptied file keeps the last good tokens. The header is removed
-- before the call goes on, so Triton never sees it; nothing here logs a token. A gRPC call is
-- refused as gRPC refuses (UNAUTHENTICATED), an HTTP request with 401 and Triton's error shape.
--
-- Admission (docs/admission.md), with the settings of the `admission` ConfigMap
-- (gateway/admission.env):
-- * The start-of-job gate: a RepositoryIndex (what SonicTriton calls when a job starts, and
--   treats a failed answer as "skip this server") is refused with SONIC_RAY_GATE_STATUS while
--   no Triton is ready, or while the control plane says the GPUs are saturated
--   (serve/triton_pod/admission.py, asked at most once a second per worker; an answer older
--   than SONIC_RAY_GATE_STALE_S, or none, counts as SONIC_RAY_GATE_WHEN_STALE says).
-- * Backpressure: Triton's own refusal of a call its queue cannot hold (a model's
--   dynamic_batching.default_queue_policy with max_queue_size and timeout_action REJECT) goes
--   to the client as RESOURCE_EXHAUSTED / 429 with a retry hint (grpc-retry-pushback-ms,
--   Retry-After) instead of UNAVAILABLE / 503, which clients read as "this server is down".
--
-- Client certificates (components/mtls): Envoy's handshake has checked that the CA signed the
-- certificate; when SONIC_RAY_CLIENT_SUBJECTS lists patterns (";"-separated, "*" any run of
-- characters), the certificate's subject must match one, or the call is refused
-- (PERMISSION_DENIED, 403) naming the subject.
local GRPC_CODES = {CANCELLED = 1, UNKNOWN = 2, INVALID_ARGUMENT = 3, DEADLINE_EXCEEDED = 4,
                    NOT_FOUND = 5, ALREADY_EXISTS = 6, PERMISSION_DENIED = 7,
                    RESOURCE_EXHAUSTED = 8, FAILED_PRECONDITION = 9, ABORTED = 10,
                    OUT_OF_RANGE = 11, UNIMPLEMENTED = 12, INTERNAL = 13, UNAVAILABLE = 14,
                    DATA_LOSS = 15, UNAUTHENTICATED = 16}

local function setting(name, default)
  local value = os.getenv(name)
  if value == nil or value == "" then return default end
  return value
end

local function number_setting(name, default)
  local value = tonumber(setting(name, default))
  if value == nil or value <= 0 then
    error(name .. "=" .. tostring(os.getenv(name)) .. " must be a positive number")
  end
  return value
end

local GATE_STATUS_NAME = setting("SONIC_RAY_GATE_STATUS", "CANCELLED")
local GATE_STATUS = GRPC_CODES[GATE_STATUS_NAME]
if GATE_STATUS == nil then
  error("SONIC_RAY_GATE_STATUS=" .. GATE_STATUS_NAME .. " is not a gRPC status name (OK excluded)")
end
local WHEN_STALE = setting("SONIC_RAY_GATE_WHEN_STALE", "open")
if WHEN_STALE ~= "open" and WHEN_STALE ~= "closed" then
  error("SONIC_RAY_GATE_WHEN_STALE=" .. WHEN_STALE .. " must be open or closed")
end
local STALE_S = number_setting("SONIC_RAY_GATE_STALE_S", "10")
local RETRY_AFTER_S = number_setting("SONIC_RAY_RETRY_AFTER_S", "2")
local JOB_START_GRPC = "/inference.GRPCInferenceService/RepositoryIndex"
local JOB_START_HTTP = "/v2/repository/index"
-- Triton's words when a model's queue policy refuses a call; the gateway's own when it has no
-- Triton to send a call to (envoy.yaml, local_reply_config).
local QUEUE_FULL = "Exceeds maximum queue size"
local NO_TRITON = "no Triton is ready"
local REFRESH_S = 1
-- The control plane's last answer: its state, its reason and when it was made (os.time()).
local gate = {state = nil, reason = "", made_at = nil}
local asked_at = -REFRESH_S
local asking_since = nil

local function ask_control_plane(handle, now)
  -- One question at a time per worker; a stream reset while waiting never resumes, so an
  -- old question stops counting after two refresh periods.
  if now - asked_at < REFRESH_S then return end
  if asking_since ~= nil and now - asking_since < 2 * REFRESH_S then return end
  asked_at, asking_since = now, now
  local headers, body = handle:httpCall("control-plane", {
    [":method"] = "GET", [":path"] = "/admission", [":authority"] = "control-plane"
  }, nil, 100)
  asking_since = nil
  if headers == nil or headers[":status"] ~= "200" or body == nil then return end
  local state = body:match('"state": *"(%a+)"')
  local age = tonumber(body:match('"age_s": *([%d%.]+)') or "")
  if (state == "open" or state == "closed") and age ~= nil then
    gate.state, gate.made_at = state, now - age
    gate.reason = body:match('"reason": *"([^"]*)"') or ""
  end
end

-- Why a job should not start here now, or nil.
local function gate_closed(handle)
  local now = os.time()
  ask_control_plane(handle, now)
  if gate.made_at ~= nil and now - gate.made_at <= STALE_S then
    if gate.state == "closed" then return gate.reason end
    return nil
  end
  if WHEN_STALE == "closed" then
    return "the control plane's word on the GPUs' load is missing or older than " ..
           STALE_S .. " s, and this site closes the gate then"
  end
  return nil
end

local function job_start_refusal(reason)
  return "no new jobs here now: " .. reason .. " (use another server, or retry in " ..
         RETRY_AFTER_S .. " s)"
end

local function refuse_job_start(handle, grpc, reason)
  local message = job_start_refusal(reason)
  if grpc then
    handle:respond({[":status"] = "200", ["content-type"] = "application/grpc",
                    ["grpc-status"] = tostring(GATE_STATUS), ["grpc-message"] = message}, "")
  else
    handle:respond({[":status"] = "503", ["retry-after"] = tostring(RETRY_AFTER_S)}, message)
  end
end

-- The allowed subjects as anchored Lua patterns; nil: any certificate the CA signed.
local function subject_patterns(text)
  if text == nil or text:match("^%s*$") then return nil end
  local found = {}
  for glob in text:gmatch("[^;]+") do
    glob = glob:match("^%s*(.-)%s*$")
    if glob ~= "" then
      local escaped = glob:gsub("[%^%$%(%)%%%.%[%]%+%-%?]", "%%%0"):gsub("%*", ".*")
      found[#found + 1] = "^" .. escaped .. "$"
    end
  end
  return found
end

local SUBJECTS = subject_patterns(os.getenv("SONIC_RAY_CLIENT_SUBJECTS"))

-- A refusal as a Triton client reads it: a gRPC trailers-only answer with the status, or the
-- HTTP status with the message in Triton's error shape (the listener's local_reply_config);
-- `challenge`, when given, is the WWW-Authenticate header (RFC 6750).
local function refuse(handle, grpc_code, http_status, message, challenge)
  local content_type = handle:headers():get("content-type") or ""
  if content_type:sub(1, 16) == "application/grpc" then
    handle:respond({[":status"] = "200", ["content-type"] = "application/grpc",
                    ["grpc-status"] = tostring(grpc_code), ["grpc-message"] = message,
                    ["www-authenticate"] = challenge}, "")
  else
    handle:respond({[":status"] = tostring(http_status), ["www-authenticate"] = challenge},
                   message)
  end
end

-- True when the caller's certificate subject is allowed (or no list is set).
local function check_subject(handle)
  if SUBJECTS == nil then return true end
  local ssl = handle:streamInfo():downstreamSslConnection()
  local subject = ssl and ssl:peerCertificatePresented() and ssl:subjectPeerCertificate()
  if subject then
    for _, pattern in ipairs(SUBJECTS) do
      if subject:match(pattern) then return true end
    end
  end
  refuse(handle, GRPC_CODES.PERMISSION_DENIED, 403, "the client certificate's subject " ..
         (subject and ("\"" .. subject .. "\"") or "(none presented)") ..
         " is not allowed at this endpoint (SONIC_RAY_CLIENT_SUBJECTS)")
  return false
end

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

-- OIDC / WLCG tokens (gateway/jwt.py): jwt_authn, before this filter, has checked the
-- signature, exp, nbf, issuer and audience of a bearer JWT; it leaves the claims, or why the
-- token failed, in the call's metadata. On while SONIC_RAY_JWT_ISSUER is set; a required scope
-- (SONIC_RAY_JWT_SCOPE, in the space-separated `scope` claim) or group (SONIC_RAY_JWT_GROUP,
-- in `wlcg.groups`) is checked here. A static token suffices beside a JWT.
local JWT_ISSUER = setting("SONIC_RAY_JWT_ISSUER", nil)
local JWT_SCOPE = setting("SONIC_RAY_JWT_SCOPE", nil)
local JWT_GROUP = setting("SONIC_RAY_JWT_GROUP", nil)
local JWT_METADATA = "envoy.filters.http.jwt_authn"

-- What the verified claims lack of the site's requirements, or nil.
local function claims_lacking(payload)
  if JWT_SCOPE ~= nil then
    local found = false
    for scope in tostring(payload["scope"] or ""):gmatch("%S+") do
      if scope == JWT_SCOPE then found = true end
    end
    if not found then return "the scope " .. JWT_SCOPE end
  end
  if JWT_GROUP ~= nil then
    local found = false
    local groups = payload["wlcg.groups"]
    if type(groups) == "table" then
      for _, group in pairs(groups) do
        if group == JWT_GROUP then found = true end
      end
    end
    if not found then return "the group " .. JWT_GROUP end
  end
  return nil
end

local function check_credentials(handle)
  local headers = handle:headers()
  local presented = headers:get("authorization")
  headers:remove("authorization")
  local token = presented and presented:match("^[Bb][Ee][Aa][Rr][Ee][Rr]%s+(.-)%s*$")
  local failure = nil
  if JWT_ISSUER ~= nil then
    local verified = handle:streamInfo():dynamicMetadata():get(JWT_METADATA) or {}
    local payload = verified["payload"]
    if payload ~= nil then
      local lacking = claims_lacking(payload)
      if lacking == nil then return true end
      refuse(handle, GRPC_CODES.PERMISSION_DENIED, 403,
             "the token lacks " .. lacking .. " this endpoint requires",
             'Bearer error="insufficient_scope"')
      return false
    end
    local status = verified["failure"]
    if token ~= nil and token ~= "" and type(status) == "table" then
      failure = tostring(status["message"] or "the token failed its checks")
    end
  end
  if path ~= nil then
    local now = os.time()
    if now - checked_at >= RECHECK_S then
      checked_at = now
      load()
    end
    if tokens ~= nil and token ~= nil and token ~= "" and tokens[token] then return true end
  end
  if failure ~= nil then
    local message = "invalid token: " .. failure
    refuse(handle, GRPC_CODES.UNAUTHENTICATED, 401, message,
           'Bearer error="invalid_token", error_description="' ..
           failure:gsub('["\\]', "") .. '"')
  else
    refuse(handle, GRPC_CODES.UNAUTHENTICATED, 401, UNAUTHENTICATED, "Bearer")
  end
  return false
end

function envoy_on_request(handle)
  local headers = handle:headers()
  -- Only the gateway's own routes may send Triton's admin key.
  headers:remove("triton-grpc-protocol-sonic-ray-admin")
  headers:remove("sonic-ray-admin")
  if not check_subject(handle) then return end
  if (path ~= nil or JWT_ISSUER ~= nil) and not check_credentials(handle) then return end
  local request_path = headers:get(":path")
  local grpc = request_path == JOB_START_GRPC
  if grpc or request_path == JOB_START_HTTP then
    local reason = gate_closed(handle)
    if reason ~= nil then
      refuse_job_start(handle, grpc, reason)
      return
    end
    -- No Triton ready shows only in the answer (envoy.yaml's local reply): marked for it.
    handle:streamInfo():dynamicMetadata():set("sonic-ray", "job-start", grpc and "grpc" or "http")
  end
end

function envoy_on_response(handle)
  local headers = handle:headers()
  local grpc_status = headers:get("grpc-status")
  if grpc_status == "14" then
    local message = headers:get("grpc-message") or ""
    if message:find(QUEUE_FULL, 1, true) then
      headers:replace("grpc-status", "8")
      headers:replace("grpc-message", message .. "; retry in " .. RETRY_AFTER_S .. " s")
      headers:add("grpc-retry-pushback-ms", tostring(math.floor(RETRY_AFTER_S * 1000)))
    elseif message:find(NO_TRITON, 1, true) then
      local meta = handle:streamInfo():dynamicMetadata():get("sonic-ray")
      if meta ~= nil and meta["job-start"] == "grpc" then
        headers:replace("grpc-status", tostring(GATE_STATUS))
        headers:replace("grpc-message", job_start_refusal((message:gsub("; retry later$", ""))))
      end
    end
  elseif grpc_status == nil and headers:get(":status") == "503" then
    if (headers:get("content-type") or ""):sub(1, 16) == "application/grpc" then return end
    -- Waiting for the body ends the headers object's scope: ask for them again after.
    local body = handle:body()
    if body ~= nil and body:length() < 4096 and
       body:getBytes(0, body:length()):find(QUEUE_FULL, 1, true) then
      local answered = handle:headers()
      answered:replace(":status", "429")
      answered:add("retry-after", tostring(math.ceil(RETRY_AFTER_S)))
    end
  end
end
