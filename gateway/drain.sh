#!/bin/bash
# The gateway pod's preStop (gateway/gateway.yaml): Envoy exits at once on SIGTERM, so first
# it drains. POST /drain_listeners?graceful on the admin interface (loopback, 9901) starts
# Envoy's graceful drain (--drain-strategy immediate: every HTTP/2 client gets GOAWAY and opens
# its next calls elsewhere, HTTP/1.1 answers carry `connection: close`) while the listeners stay
# open for --drain-time-s. Then it waits DRAIN_MIN_S for the clients' Service to drop this pod,
# and until no call is in flight on the client listeners, DRAIN_MAX_S at most; the kubelet
# sends SIGTERM when this script ends.
set -u
. "$(dirname "$0")/envoy-admin.sh"
DRAIN_MIN_S=${DRAIN_MIN_S:-5}
DRAIN_MAX_S=${DRAIN_MAX_S:-45}

in_flight() {  # calls open on the gRPC and HTTP listeners
  # ^http\.triton_(grpc|http)\.downstream_rq_active$, percent-encoded
  admin GET '/stats?filter=%5Ehttp%5C.triton_%28grpc%7Chttp%29%5C.downstream_rq_active%24' |
    awk -F': ' '{sum += $2} END {print sum + 0}'
}

admin POST '/drain_listeners?graceful' >/dev/null || exit 0
waited=0
while [ "$waited" -lt "$DRAIN_MAX_S" ]; do
  if [ "$waited" -ge "$DRAIN_MIN_S" ] && [ "$(in_flight)" = 0 ]; then
    break
  fi
  sleep 1
  waited=$((waited + 1))
done
