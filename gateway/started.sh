#!/bin/bash
# The gateway pod's startupProbe (gateway/gateway.yaml): passes once Envoy's view of the
# Tritons is health-checked, in each of its Triton clusters (triton, triton-http): the cluster
# DNS answered (an empty answer too), and it listed no host (no Triton is ready, which is what
# Envoy then answers) or at least one that passed its check. Envoy opens its listeners once
# its first DNS query ended, answered or not, and every listed host had its first check; but
# a query that timed out leaves it with no host, and a first check that timed out on a busy
# node leaves the host unhealthy: a pod Ready then answers its calls "no Triton is ready"
# until the next query or check, while the other gateway pods serve them. Only the start
# waits: later, with every Triton failing, a Ready gateway pod stays Ready and says so.
set -u
. "$(dirname "$0")/envoy-admin.sh"

# ^cluster\.triton(-http)?\.(membership_(total|healthy)|update_success)$, percent-encoded
admin GET '/stats?filter=%5Ecluster%5C.triton%28-http%29%3F%5C.%28membership_%28total%7Chealthy%29%7Cupdate_success%29%24' |
  awk -F': ' '
    { split($1, name, "."); value[name[2] " " name[3]] = $2 + 0 }
    END {
      n = split("triton triton-http", clusters, " ")
      for (i = 1; i <= n; i++) {
        c = clusters[i]
        if (!((c " membership_total") in value)) { print c ": no stats"; exit 1 }
        if (value[c " update_success"] == 0) { print c ": no DNS answer yet"; exit 1 }
        total = value[c " membership_total"]; healthy = value[c " membership_healthy"]
        if (total > 0 && healthy == 0) { print c ": " total " listed, none healthy"; exit 1 }
      }
    }'
