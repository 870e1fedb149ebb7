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

# The ready pods are priority 0 of each cluster; priority 1 lists every pod again, healthy
# only while its Triton holds live sequences (gateway/envoy.yaml), so counts are of priority
# 0, read per host from /clusters (each host's health_flags line comes before its priority
# line). Whether DNS answered: update_success in /stats.
# ^cluster\.triton(-http)?\.update_success$, percent-encoded
{ admin GET '/stats?filter=%5Ecluster%5C.triton%28-http%29%3F%5C.update_success%24'
  admin GET '/clusters'; } |
  awk '
    / *: */ && /^cluster\./ { split($1, name, "."); answered[name[2]] = $2 + 0; next }
    {
      n = split($0, part, "::")
      if (n < 4 || (part[1] != "triton" && part[1] != "triton-http")) next
      if (part[3] == "health_flags") flags = part[4]
      if (part[3] == "priority" && part[4] == 0) {
        total[part[1]]++
        if (flags == "healthy") healthy[part[1]]++
      }
    }
    END {
      n = split("triton triton-http", clusters, " ")
      for (i = 1; i <= n; i++) {
        c = clusters[i]
        if (!(c in answered)) { print c ": no stats"; exit 1 }
        if (answered[c] == 0) { print c ": no DNS answer yet"; exit 1 }
        if (total[c] > 0 && healthy[c] + 0 == 0) { print c ": " total[c] " listed, none healthy"; exit 1 }
      }
    }'
