#!/bin/sh
# Starts the gateway's Envoy: the container's command (gateway/gateway.yaml), and how `make
# local` starts it too (ENVOY naming the binary). What it adds to Envoy's arguments, decided
# once from the site's settings (the `admission` and `front-door` ConfigMaps):
# * What checks calls other than job starts: nothing where the site neither checks nor names
#   its callers (the runtime key sonic_ray.calls_unchecked of gateway/envoy.yaml routes them
#   past every check, and Envoy's own filters record an anonymous caller); Envoy's own filters
#   where the site checks what a call's headers say (bearer tokens, tenants, tenant shares:
#   sonic_ray.callers_native, their config written by gateway/callers.sh, which re-reads the
#   tokens file beside Envoy); with a JWT issuer too, the same for calls with a static token,
#   and the client checks' Lua (gateway/client-checks.lua) for the others
#   (sonic_ray.callers_native_jwt); the Lua on every call where the site checks certificate
#   subjects or runs components/mtls. Envoy started without this script finds no config for
#   the callers filter and does not start.
# * The client listeners' transport (gateway/envoy.yaml, filter_chain_matcher): SONIC_RAY_TLS
#   unset or empty in clear, `server` TLS (components/tls), `mutual` TLS with client
#   certificates (components/mtls), which name every caller, so the checks run on every call;
#   any other value stops the start.
# * LUA_PATH: both Lua filters require gateway/gate.lua, which lies beside this file.
# * The control plane's word for the gate, fetched beside Envoy (gateway/gate-word.sh).
# * The access log written out every second (Envoy's default is every 10 s): a call's line is
#   in `kubectl logs` a second after it ended, not ten.
set -eu
here=$(dirname "$0")
unchecked=100
native=0
native_jwt=0
callers=""
tls_server=0
tls_mutual=0
case "${SONIC_RAY_TLS:-}" in
  "") transport="in clear (SONIC_RAY_TLS unset): Envoy may warn once that the TLS chains'\
 certificate folder is absent" ;;
  server) tls_server=100 ;;
  mutual) tls_mutual=100; unchecked=0 ;;
  *) echo "[gateway] SONIC_RAY_TLS=${SONIC_RAY_TLS} is not server, mutual or empty" >&2
     exit 2 ;;
esac
# A value of blanks and ";" only names nothing, as client-checks.lua reads it.
named() { [ -n "$(printf '%s' "$1" | tr -d ' \t;')" ]; }
for value in "${SONIC_RAY_AUTH_TOKENS_FILE:-}" "${SONIC_RAY_JWT_ISSUER:-}" \
    "${SONIC_RAY_CLIENT_SUBJECTS:-}" "${SONIC_RAY_TENANTS:-}" "${SONIC_RAY_TENANT_CLAIM:-}" \
    "${SONIC_RAY_TENANT_SHARES:-}"; do
  if named "$value"; then unchecked=0; fi
done
if [ "$unchecked" = 0 ] && [ "$tls_mutual" = 0 ] && ! named "${SONIC_RAY_CLIENT_SUBJECTS:-}"; then
  # What only the Lua checks on every call: a certificate's subject (mutual TLS).
  if named "${SONIC_RAY_JWT_ISSUER:-}"; then native_jwt=100; else native=100; fi
fi
export LUA_PATH="$here/?.lua;;"
if [ "$native" = 100 ]; then
  callers=native
  echo "[gateway] the callers are checked and named on every call by Envoy's own filters" \
    "(tokens, tenants, shares: gateway/callers.sh); the client checks run on job starts" >&2
elif [ "$native_jwt" = 100 ]; then
  callers=native-jwt
  echo "[gateway] calls with a static token are checked and named by Envoy's own filters" \
    "(gateway/callers.sh); the client checks run on the others (JWTs) and on job starts" >&2
fi
if [ -n "$callers" ]; then
  bash "$here/callers.sh" "$callers" || exit 2
  bash "$here/callers.sh" "$callers" "$$" &
elif [ "$unchecked" = 0 ]; then
  bash "$here/callers.sh" off || exit 2
  echo "[gateway] the client checks run on every call: the site checks or names its callers" >&2
else
  bash "$here/callers.sh" off || exit 2
  echo "[gateway] the client checks run on job starts only: nothing checks or names callers" \
    "(components/mtls runs them on every call)" >&2
fi
echo "[gateway] client listeners ${transport:-speak TLS only (SONIC_RAY_TLS=${SONIC_RAY_TLS:-})}" >&2
# The control plane's word on the GPUs, for the gate (gateway/gate.lua): gateway/gate-word.sh
# fetches it once a second while Envoy ($$ after the exec below) runs, into a file of this
# process's own.
export SONIC_RAY_GATE_WORD="${TMPDIR:-/tmp}/sonic-ray-gate-word.$$"
bash "$here/gate-word.sh" "$$" &
exec "${ENVOY:-envoy}" "$@" --file-flush-interval-msec 1000 --config-yaml \
  "{layered_runtime: {layers: [{name: site, static_layer: {sonic_ray.calls_unchecked: $unchecked, sonic_ray.callers_native: $native, sonic_ray.callers_native_jwt: $native_jwt, sonic_ray.tls_server: $tls_server, sonic_ray.tls_mutual: $tls_mutual}}]}}"
