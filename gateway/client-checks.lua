-- Bearer tokens for the gateway, as the forwarder checks them (serve/triton_pod/access.py):
-- when SONIC_RAY_AUTH_TOKENS_FILE names a file (components/token-auth mounts the Secret there),
-- every call must carry `authorization: Bearer <token>` with one of its tokens (one a line,
-- `<token>` or `<name> <token>`, # comments). The file is re-read when it changes, so a
-- rotated Secret takes effect without a restart; an unreadable or emptied file keeps the last
-- good tokens. The header is removed before the call goes on, so Triton never sees it; nothing
-- here logs a token. A gRPC call is refused as gRPC refuses (UNAUTHENTICATED), an HTTP request
-- with 401 and Triton's error shape.
--
-- Admission (docs/admission.md), with the settings of the `admission` ConfigMap
-- (gateway/admission.env; read in gateway/gate.lua):
-- * The start-of-job gate: a RepositoryIndex (what SonicTriton calls when a job starts, and
--   treats a failed answer as "skip this server") is refused with SONIC_RAY_GATE_STATUS while
--   no Triton is ready, or while the control plane says the GPUs are saturated (an answer
--   older than SONIC_RAY_GATE_STALE_S, or none, counts as SONIC_RAY_GATE_WHEN_STALE says).
-- * Job starts (RepositoryIndex, ServerReady, ModelReady) are marked in the call's metadata,
--   so that gateway/error-answers.lua answers them with the gate's status while no Triton is
--   ready. With SONIC_RAY_HOLD_S above 0, a job start is held instead until a Triton answers
--   ready (then it passes, to a ready Triton) or that many seconds pass (then the gate's
--   answer).
--
-- Where this runs (gateway/envoy.yaml): on the job-start routes always; on every other call
-- where a site checks certificate subjects (gateway/start.sh decides from the same settings).
-- Where it checks tokens, tenants and shares, Envoy's own filters check and name such calls
-- (gateway/callers.sh writes their config from the same settings and file, in the same
-- words); beside a JWT issuer they do so for calls with a static token and run this Lua, as
-- their fallback, for the others. Where a site checks nothing, Envoy's own filters strip the
-- admin headers and record an anonymous caller. No Lua runs on a call they handle.
--
-- Client certificates (components/mtls): Envoy's handshake has checked that the CA signed the
-- certificate; when SONIC_RAY_CLIENT_SUBJECTS lists patterns (";"-separated, "*" any run of
-- characters), the certificate's subject must match one, or the call is refused
-- (PERMISSION_DENIED, 403) naming the subject.
--
-- Who called (docs/front-door.md): each call's identity (`token:<name>`, `jwt:<sub>`,
-- `cert:<subject>` or `anonymous`) and tenant go into its metadata (`sonic-ray`: identity,
-- tenant, protocol; the model Envoy's own header_to_metadata), which the access log and the per-tenant counters of envoy.yaml
-- read; nothing of it is passed to Triton. The tenant: the JWT claim SONIC_RAY_TENANT_CLAIM names, else the
-- first SONIC_RAY_TENANTS entry (";"-separated `tenant=pattern`, "*" any run of characters)
-- whose pattern matches the identity, else a static token's name, else "other" ("anonymous"
-- without a credential).
local gate = require("gate")
local GRPC_CODES = gate.GRPC_CODES
local setting = gate.setting
local GATE_STATUS = gate.GATE_STATUS
local RETRY_AFTER_S = gate.RETRY_AFTER_S
local HOLD_S = gate.HOLD_S
local JOB_START_GRPC = gate.JOB_START_GRPC
local JOB_START_HTTP = gate.JOB_START_HTTP
local READY_GRPC = gate.READY_GRPC
local is_ready_http = gate.is_ready_http
local gate_closed = gate.gate_closed
local job_start_refusal = gate.job_start_refusal
local no_triton_now = gate.no_triton_now

local function refuse_job_start(handle, grpc, reason)
  local message = job_start_refusal(reason)
  if grpc then
    handle:respond({[":status"] = "200", ["content-type"] = "application/grpc",
                    ["grpc-status"] = tostring(GATE_STATUS), ["grpc-message"] = message}, "")
  else
    handle:respond({[":status"] = "503", ["retry-after"] = tostring(RETRY_AFTER_S)}, message)
  end
end

-- Whether a Triton behind the gateway answers ready now: Triton's own readiness call through
-- the cluster the job's call would take, which sends it to a healthy Triton or answers at
-- once that none is (a gRPC ServerReady answers ready=true as the message 08 01).
local SERVER_READY_GRPC = "/inference.GRPCInferenceService/ServerReady"
local READY_MESSAGE = "\0\0\0\0\2\8\1"
local function triton_answers_ready(handle, grpc)
  if grpc then
    local headers, body = handle:httpCall("triton", {
      [":method"] = "POST", [":path"] = SERVER_READY_GRPC, [":authority"] = "triton",
      ["content-type"] = "application/grpc", ["te"] = "trailers"
    }, "\0\0\0\0\0", 2000)
    return headers ~= nil and headers[":status"] == "200" and body == READY_MESSAGE
  end
  local headers = handle:httpCall("triton-http", {
    [":method"] = "GET", [":path"] = "/v2/health/ready", [":authority"] = "triton"
  }, nil, 2000)
  return headers ~= nil and headers[":status"] == "200"
end

-- SONIC_RAY_HOLD_S: a job start waits while no Triton answers ready, a second at a time
-- (envoy.yaml's hold-timer); true when one does, false when the hold ran out.
local function held_until_ready(handle, grpc)
  local deadline = os.time() + HOLD_S
  while not triton_answers_ready(handle, grpc) do
    if os.time() >= deadline then return false end
    handle:httpCall("hold-timer", {
      [":method"] = "GET", [":path"] = "/", [":authority"] = "hold-timer"
    }, nil, 5000)
  end
  return true
end

-- A site's glob ("*" any run of characters) as an anchored Lua pattern.
local function glob_pattern(glob)
  local escaped = glob:gsub("[%^%$%(%)%%%.%[%]%+%-%?]", "%%%0"):gsub("%*", ".*")
  return "^" .. escaped .. "$"
end

-- The allowed subjects as anchored Lua patterns; nil: any certificate the CA signed.
local function subject_patterns(text)
  if text == nil or text:match("^%s*$") then return nil end
  local found = {}
  for glob in text:gmatch("[^;]+") do
    glob = glob:match("^%s*(.-)%s*$")
    if glob ~= "" then found[#found + 1] = glob_pattern(glob) end
  end
  return found
end

local SUBJECTS = subject_patterns(os.getenv("SONIC_RAY_CLIENT_SUBJECTS"))

-- A setting's ";"-separated `key=value` entries as {key, value} pairs, in order; an entry
-- `pattern` (a Lua pattern of two captures) does not match stops the gateway, saying why.
local function entries(name, pattern, shape)
  local found = {}
  for entry in (os.getenv(name) or ""):gmatch("[^;]+") do
    entry = entry:match("^%s*(.-)%s*$")
    if entry ~= "" then
      local key, value = entry:match(pattern)
      if key == nil then error(name .. ": \"" .. entry .. "\" is not " .. shape) end
      found[#found + 1] = {key, value}
    end
  end
  return found
end

-- SONIC_RAY_TENANTS as {tenant, pattern} pairs, in order.
local TENANTS = {}
for _, entry in ipairs(entries("SONIC_RAY_TENANTS", "^([%w%-%._]+)%s*=%s*(.+)$",
                               "tenant=pattern (a tenant is letters, digits, - . _)")) do
  TENANTS[#TENANTS + 1] = {entry[1], glob_pattern(entry[2])}
end
local TENANT_CLAIM = setting("SONIC_RAY_TENANT_CLAIM", nil)

-- A claim's value as a tenant: a string, or a list's first string ("wlcg.groups": ["/cms"]);
-- characters a metric label or log reader would trip on become "_".
local function claimed_tenant(payload)
  if TENANT_CLAIM == nil or payload == nil then return nil end
  local value = payload[TENANT_CLAIM]
  if type(value) == "table" then value = value[1] end
  if type(value) ~= "string" or value == "" then return nil end
  return (value:gsub("[^%w%-%._/]", "_"):sub(1, 64))
end

-- The call's tenant, from its identity (and verified JWT claims, a static token's name).
local function tenant_of(identity, payload, token_name)
  local claimed = claimed_tenant(payload)
  if claimed ~= nil then return claimed end
  for _, entry in ipairs(TENANTS) do
    if identity:match(entry[2]) then return entry[1] end
  end
  if token_name ~= nil then return token_name end
  if identity == "anonymous" then return "anonymous" end
  return "other"
end

-- Fair share per tenant (gateway/tenant_shares.py: Envoy's local_ratelimit enforces it from
-- the tenant recorded here): SONIC_RAY_TENANT_SHARES of the `admission` ConfigMap, read here
-- for the refusal's message (envoy.yaml, local_reply_config) and its retry hint.
local SHARES = {}
for _, entry in ipairs(entries("SONIC_RAY_TENANT_SHARES", "^([%w%-%._/]+)%s*=%s*(%d+)$",
                               "tenant=calls/s")) do
  SHARES[entry[1]] = entry[2]
end

-- Records who called, for the access log, the per-tenant counters and shares (envoy.yaml).
local function record(handle, identity, payload, token_name)
  local meta = handle:streamInfo():dynamicMetadata()
  local content_type = handle:headers():get("content-type") or ""
  meta:set("sonic-ray", "protocol",
           content_type:sub(1, 16) == "application/grpc" and "grpc" or "http")
  meta:set("sonic-ray", "identity", identity)
  local tenant = tenant_of(identity, payload, token_name)
  meta:set("sonic-ray", "tenant", tenant)
  if SHARES[tenant] ~= nil then meta:set("sonic-ray", "share", SHARES[tenant]) end
end

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

-- A refusal, to be answered once the call's caller is recorded.
local function refusal(grpc_code, http_status, message, challenge)
  return {grpc_code = grpc_code, http_status = http_status, message = message,
          challenge = challenge}
end

-- The subject of the client certificate the handshake verified, or nil.
local function peer_subject(handle)
  local ssl = handle:streamInfo():downstreamSslConnection()
  if ssl and ssl:peerCertificatePresented() then return ssl:subjectPeerCertificate() end
  return nil
end

-- Why the certificate's subject may not call (a list is set and none matches), or nil.
local function subject_refusal(subject)
  if SUBJECTS == nil then return nil end
  if subject then
    for _, pattern in ipairs(SUBJECTS) do
      if subject:match(pattern) then return nil end
    end
  end
  return refusal(GRPC_CODES.PERMISSION_DENIED, 403, "the client certificate's subject " ..
                 (subject and ("\"" .. subject .. "\"") or "(none presented)") ..
                 " is not allowed at this endpoint (SONIC_RAY_CLIENT_SUBJECTS)")
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
    local trimmed = line:match("^%s*(.-)%s*$")
    if trimmed ~= "" and trimmed:sub(1, 1) ~= "#" then
      local name, token = trimmed:match("^(%S+)%s+(%S+)$")
      if name == nil and trimmed:match("^%S+$") then name, token = "unnamed", trimmed end
      -- A line of more fields is no token (serve/triton_pod/access.py refuses the file).
      if token ~= nil then
        found[token] = name
        count = count + 1
      end
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
-- jwt_authn's own words for a bearer credential that is not a JWT.
local NOT_A_JWT = "Jwt is not in the form of Header.Payload.Signature with two dots and 3 sections"

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

-- The bearer credential's caller ({identity, payload, token_name}) as far as it is known, and
-- the refusal when it does not pass.
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
      local subject = payload["sub"] or payload["client_id"] or payload["azp"] or "unknown"
      local caller = {identity = "jwt:" .. tostring(subject), payload = payload}
      local lacking = claims_lacking(payload)
      if lacking == nil then return caller, nil end
      return caller, refusal(GRPC_CODES.PERMISSION_DENIED, 403,
                             "the token lacks " .. lacking .. " this endpoint requires",
                             'Bearer error="insufficient_scope"')
    end
    local status = verified["failure"]
    if token ~= nil and token ~= "" and type(status) == "table" then
      failure = tostring(status["message"] or "the token failed its checks")
    elseif token ~= nil and token ~= "" and next(verified) == nil then
      -- jwt_authn skips a credential that cannot be a JWT (its rule, gateway/jwt.py): it
      -- is one unless it is a static token, checked below.
      failure = NOT_A_JWT
    end
  end
  if path ~= nil then
    local now = os.time()
    if now - checked_at >= RECHECK_S then
      checked_at = now
      load()
    end
    local name = tokens ~= nil and token ~= nil and token ~= "" and tokens[token]
    if name then return {identity = "token:" .. name, token_name = name}, nil end
  end
  if failure ~= nil then
    return nil, refusal(GRPC_CODES.UNAUTHENTICATED, 401, "invalid token: " .. failure,
                        'Bearer error="invalid_token", error_description="' ..
                        failure:gsub('["\\]', "") .. '"')
  end
  return nil, refusal(GRPC_CODES.UNAUTHENTICATED, 401, UNAUTHENTICATED, "Bearer")
end

function envoy_on_request(handle)
  -- The admin headers are removed, and an HTTP call's model recorded, by Envoy's own
  -- filters before this one (gateway/envoy.yaml), on every call.
  local request_path = handle:headers():get(":path")
  -- Who calls: the certificate's subject, unless a bearer credential names someone.
  local subject = peer_subject(handle)
  local caller = {identity = subject and ("cert:" .. subject) or "anonymous"}
  local refused = subject_refusal(subject)
  if refused == nil and (path ~= nil or JWT_ISSUER ~= nil) then
    local bearer
    bearer, refused = check_credentials(handle)
    if bearer ~= nil then caller = bearer end
  end
  record(handle, caller.identity, caller.payload, caller.token_name)
  if refused ~= nil then
    refuse(handle, refused.grpc_code, refused.http_status, refused.message, refused.challenge)
    return
  end
  local grpc = request_path == JOB_START_GRPC
  if grpc or request_path == JOB_START_HTTP then
    local reason = gate_closed()
    if reason ~= nil then
      refuse_job_start(handle, grpc, reason)
      return
    end
  end
  -- No Triton ready shows only in the answer (envoy.yaml's local reply): job starts are
  -- marked for it.
  local job_start = nil
  if grpc or READY_GRPC[request_path] then
    job_start = "grpc"
  elseif request_path == JOB_START_HTTP or is_ready_http(request_path or "") then
    job_start = "http"
  end
  if job_start == nil then return end
  handle:streamInfo():dynamicMetadata():set("sonic-ray", "job-start", job_start)
  if HOLD_S > 0 and not held_until_ready(handle, job_start == "grpc") then
    -- Answered here, whole: envoy_on_response leaves this answer as it is.
    handle:streamInfo():dynamicMetadata():set("sonic-ray", "job-start", "answered")
    local why, retry_s = no_triton_now()
    why = why .. "; held " .. HOLD_S .. " s (SONIC_RAY_HOLD_S)"
    local message = job_start_refusal(why, retry_s)
    if job_start == "grpc" then
      handle:respond({[":status"] = "200", ["content-type"] = "application/grpc",
                      ["grpc-status"] = tostring(GATE_STATUS), ["grpc-message"] = message,
                      ["grpc-retry-pushback-ms"] = tostring(math.floor(retry_s * 1000))}, "")
    else
      -- envoy.yaml's local reply puts the words in Triton's error shape.
      handle:respond({[":status"] = "503", ["retry-after"] = tostring(math.ceil(retry_s))},
                     message)
    end
  end
end
