-- The gateway's answers to calls that fail, rewritten where a client would misread them
-- (docs/admission.md). gateway/envoy.yaml runs this only on error answers (an HTTP status
-- other than 200, or a gRPC status in the headers: a trailers-only answer); a call that
-- succeeds never reaches it.
-- * Backpressure: Triton's own refusal of a call its queue cannot hold (a model's
--   dynamic_batching.default_queue_policy with max_queue_size and timeout_action REJECT) goes
--   to the client as RESOURCE_EXHAUSTED / 429 with a retry hint (grpc-retry-pushback-ms,
--   Retry-After) instead of UNAVAILABLE / 503, which clients read as "this server is down".
-- * No Triton ready (scaling from zero, every GPU pod failing): a job start (marked by
--   gateway/client-checks.lua) gets the gate's status, so that the job skips this server;
--   any other call UNAVAILABLE / 503 with a retry hint and words saying whether a GPU pod is
--   on its way: from the control plane's answer (how long the deployment has wanted more
--   pods than run) and the site's SONIC_RAY_GPU_POD_START_S, roughly when it will be ready.
-- * Over a tenant's share (gateway/tenant_shares.py): a retry hint beside the refusal.
local gate = require("gate")
local GATE_STATUS = gate.GATE_STATUS
local RETRY_AFTER_S = gate.RETRY_AFTER_S
local QUEUE_FULL = gate.QUEUE_FULL
local NO_TRITON = gate.NO_TRITON
local job_start_refusal = gate.job_start_refusal
local no_triton_now = gate.no_triton_now
local OVER_SHARE = "is over its share of"

function envoy_on_response(handle)
  local headers = handle:headers()
  local grpc_status = headers:get("grpc-status")
  if grpc_status == "8" and (headers:get("grpc-message") or ""):find(OVER_SHARE, 1, true) then
    headers:replace("grpc-message", headers:get("grpc-message") .. "; retry in " ..
                    RETRY_AFTER_S .. " s")
    headers:add("grpc-retry-pushback-ms", tostring(math.floor(RETRY_AFTER_S * 1000)))
  elseif grpc_status == nil and headers:get(":status") == "429" then
    -- Over a tenant's share (the gateway's only 429 of its own).
    headers:replace("retry-after", tostring(math.ceil(RETRY_AFTER_S)))
  elseif grpc_status == "14" then
    local message = headers:get("grpc-message") or ""
    if message:find(QUEUE_FULL, 1, true) then
      headers:replace("grpc-status", "8")
      headers:replace("grpc-message", message .. "; retry in " .. RETRY_AFTER_S .. " s")
      headers:add("grpc-retry-pushback-ms", tostring(math.floor(RETRY_AFTER_S * 1000)))
    elseif message:find(NO_TRITON, 1, true) then
      local why, retry_s = no_triton_now()
      local answered = headers
      local meta = handle:streamInfo():dynamicMetadata():get("sonic-ray")
      if meta ~= nil and meta["job-start"] == "grpc" then
        answered:replace("grpc-status", tostring(GATE_STATUS))
        answered:replace("grpc-message", job_start_refusal(why, retry_s))
      else
        answered:replace("grpc-message", why .. "; retry in about " .. retry_s .. " s")
      end
      answered:add("grpc-retry-pushback-ms", tostring(math.floor(retry_s * 1000)))
    end
  elseif grpc_status == nil and headers:get(":status") == "503" then
    if (headers:get("content-type") or ""):sub(1, 16) == "application/grpc" then return end
    local meta = handle:streamInfo():dynamicMetadata():get("sonic-ray")
    local job_start = meta ~= nil and meta["job-start"] or nil
    if job_start == "answered" then return end
    -- Waiting for the body ends the headers object's scope: ask for them again after.
    local body = handle:body()
    local text = body ~= nil and body:length() < 4096 and body:getBytes(0, body:length()) or ""
    if text:find(QUEUE_FULL, 1, true) then
      local answered = handle:headers()
      answered:replace(":status", "429")
      answered:add("retry-after", tostring(math.ceil(RETRY_AFTER_S)))
    elseif text:find(NO_TRITON, 1, true) then
      local why, retry_s = no_triton_now()
      local message = why .. "; retry in about " .. retry_s .. " s"
      if job_start == "http" then
        message = job_start_refusal(why, retry_s)
      end
      -- Triton's error shape, as envoy.yaml's local reply writes it (no quote in the words).
      local error_body = '{"error":"' .. message .. '"}'
      handle:body():setBytes(error_body)
      local answered = handle:headers()
      answered:replace("content-length", tostring(#error_body))
      answered:replace("retry-after", tostring(math.ceil(retry_s)))
    end
  end
end
