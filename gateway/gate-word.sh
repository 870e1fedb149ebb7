#!/bin/bash
# The control plane's word on the GPUs (serve/triton_pod/admission.py), pushed to the Lua
# filters rather than asked from a request: once a second this asks it through Envoy (the
# metrics listener's /admission route to the cluster `control-plane`, gateway/envoy.yaml) and
# writes the answer, after the second it was fetched at, to the file SONIC_RAY_GATE_WORD, which
# gateway/gate.lua reads on a job start or an error answer. No call waits on the control plane;
# a word that stops coming ages in the file, and the Lua's stale rule applies to it.
# Started by gateway/start.sh beside Envoy (process $1); ends when Envoy ends.
set -u
envoy_pid=$1
word=${SONIC_RAY_GATE_WORD:?SONIC_RAY_GATE_WORD names the file of the control plane word}
# The metrics listener's port: 9902 in the pod (gateway/envoy.yaml), another where a local
# stack sets it (local_stack/gateway_config.py, gateway_env).
port=${GATEWAY_METRICS_PORT:-9902}
# How often (seconds): a job start hears a word at most this much older than the policy's.
every_s=1
trap 'rm -f "$word" "$word.new"' EXIT

fetch() {  # the control plane's answer, or nothing: Envoy answers within its route's timeout
  local status body
  { exec 3<>"/dev/tcp/127.0.0.1/${port}"; } 2>/dev/null || return 1
  printf 'GET /admission HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n' >&3
  IFS= read -r -t 2 status <&3 || { exec 3<&-; return 1; }
  IFS= read -r -d '' -t 2 body <&3
  exec 3<&-
  case "$status" in "HTTP/1."?" 200 "*) ;; *) echo "${status%$'\r'}"; return 1 ;; esac
  printf '%s' "${body#*$'\r\n\r\n'}"
}

# Said once each time the word stops or starts coming (nothing is lost silently).
coming=unknown
while kill -0 "$envoy_pid" 2>/dev/null; do
  printf -v fetched_at '%(%s)T' -1
  if answer=$(fetch); then
    printf '%s\n%s\n' "$fetched_at" "$answer" > "$word.new" && mv -f "$word.new" "$word"
    if [ "$coming" != yes ]; then
      echo "[gateway] the control plane's word on the GPUs comes (its /admission answers)" >&2
    fi
    coming=yes
  else
    if [ "$coming" = yes ]; then
      echo "[gateway] the control plane's word stopped coming (${answer:-no answer});" \
        "the gate's stale rule applies once the last is older than SONIC_RAY_GATE_STALE_S" >&2
    fi
    coming=no
  fi
  sleep "$every_s"
done
