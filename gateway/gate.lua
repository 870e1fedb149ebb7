-- What the gateway's two Lua filters share (required by gateway/client-checks.lua, which
-- runs on job starts and, where a site checks callers, on every call, and by
-- gateway/error-answers.lua, which runs only on error answers): the admission settings of
-- the `admission` ConfigMap (gateway/admission.env), the control plane's word on the GPUs
-- (serve/triton_pod/admission.py, as gateway/gate-word.sh last wrote it) and
-- the words of the gateway's own answers. gateway/start.sh puts this folder on LUA_PATH.
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
local GPU_POD_START_S = number_setting("SONIC_RAY_GPU_POD_START_S", "300")
local HOLD_S = tonumber(setting("SONIC_RAY_HOLD_S", "0"))
if HOLD_S == nil or HOLD_S < 0 then
  error("SONIC_RAY_HOLD_S=" .. tostring(os.getenv("SONIC_RAY_HOLD_S")) ..
        " must be a number of seconds, 0 or more")
end
local JOB_START_GRPC = "/inference.GRPCInferenceService/RepositoryIndex"
local JOB_START_HTTP = "/v2/repository/index"
-- What a job asks when it starts, besides RepositoryIndex: whether the server and its model
-- are ready.
local READY_GRPC = {["/inference.GRPCInferenceService/ServerReady"] = true,
                    ["/inference.GRPCInferenceService/ModelReady"] = true}
local function is_ready_http(request_path)
  return request_path == "/v2/health/ready" or
         (request_path:match("^/v2/models/[^/?]+/ready$") ~= nil) or
         (request_path:match("^/v2/models/[^/?]+/versions/[^/?]+/ready$") ~= nil)
end
-- Triton's words when a model's queue policy refuses a call; the gateway's own when it has no
-- Triton to send a call to (envoy.yaml, local_reply_config).
local QUEUE_FULL = "Exceeds maximum queue size"
local NO_TRITON = "no Triton is ready"
-- The control plane's last word: its state, its reason, when it was made (os.time()) and for
-- how long GPU pods had then been on their way (nil: none was missing). gateway/gate-word.sh
-- beside Envoy writes it to this file once a second (gateway/start.sh names the file): its
-- first line the second it was fetched at, then the control plane's answer. Read on each job
-- start and error answer, never asked for from a request; Envoy started without start.sh has
-- none, and the stale rule applies.
local WORD_FILE = os.getenv("SONIC_RAY_GATE_WORD")
local gate = {state = nil, reason = "", made_at = nil, starting_for_s = nil}

local function read_word()
  if WORD_FILE == nil or WORD_FILE == "" then return end
  local file = io.open(WORD_FILE, "r")
  if file == nil then return end
  local text = file:read("*a") or ""
  file:close()
  local fetched_at = tonumber(text:match("^(%d+)\n") or "")
  local state = text:match('"state": *"(%a+)"')
  local age = tonumber(text:match('"age_s": *([%d%.]+)') or "")
  if fetched_at ~= nil and (state == "open" or state == "closed") and age ~= nil then
    gate.state, gate.made_at = state, fetched_at - age
    gate.reason = text:match('"reason": *"([^"]*)"') or ""
    gate.starting_for_s = tonumber(text:match('"starting_for_s": *([%d%.]+)') or "")
  end
end

-- Why a job should not start here now, or nil.
local function gate_closed()
  local now = os.time()
  read_word()
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

local function job_start_refusal(reason, retry_s)
  return "no new jobs here now: " .. reason .. " (use another server, or retry in " ..
         (retry_s or RETRY_AFTER_S) .. " s)"
end

-- With no Triton ready: whether a GPU pod is on its way, and in how many seconds to retry.
local function no_triton_now()
  local now = os.time()
  read_word()
  if gate.made_at ~= nil and now - gate.made_at <= STALE_S and gate.starting_for_s ~= nil then
    local waited = math.floor(gate.starting_for_s + now - gate.made_at)
    local left = math.max(RETRY_AFTER_S, math.ceil(GPU_POD_START_S - waited))
    return "no Triton is ready behind this endpoint: a GPU pod is starting (asked for " ..
           waited .. " s ago; one takes about " .. GPU_POD_START_S .. " s here)", left
  end
  return "no Triton is ready behind this endpoint, and no GPU pod is starting (each is " ..
         "draining or failing its health check, or the control plane has not yet seen " ..
         "these calls)", RETRY_AFTER_S
end


return {
  GRPC_CODES = GRPC_CODES,
  setting = setting,
  number_setting = number_setting,
  GATE_STATUS = GATE_STATUS,
  RETRY_AFTER_S = RETRY_AFTER_S,
  HOLD_S = HOLD_S,
  JOB_START_GRPC = JOB_START_GRPC,
  JOB_START_HTTP = JOB_START_HTTP,
  READY_GRPC = READY_GRPC,
  is_ready_http = is_ready_http,
  QUEUE_FULL = QUEUE_FULL,
  NO_TRITON = NO_TRITON,
  gate_closed = gate_closed,
  job_start_refusal = job_start_refusal,
  no_triton_now = no_triton_now,
}
