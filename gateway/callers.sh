#!/bin/bash
# Who may call and who called, checked by Envoy's own filters instead of a Lua on every call:
# writes the config of the filter `sonic-ray.callers` (gateway/envoy.yaml), which Envoy reads by
# discovery from the file SONIC_RAY_CALLERS_FILE (the pod's /tmp, an emptyDir) and re-reads when
# it is replaced. gateway/start.sh runs this where the site checks what a call's headers say:
# bearer tokens (components/token-auth), tenants (SONIC_RAY_TENANTS) and tenant shares
# (SONIC_RAY_TENANT_SHARES), and JWTs beside them; not certificate subjects, which
# gateway/client-checks.lua checks on every call.
#
#   callers.sh native [ENVOY_PID]      the checks of these settings; with ENVOY_PID, again
#                                      every 2 s while that process runs, re-reading the
#                                      tokens file
#   callers.sh native-jwt [ENVOY_PID]  the same beside a JWT issuer (start.sh decides which)
#   callers.sh off                     a config that does nothing (the Lua, or nothing, checks)
#
# What Envoy does with it, per call, as client-checks.lua does it:
# * With SONIC_RAY_AUTH_TOKENS_FILE (one token a line, `<token>` or `<name> <token>`, #
#   comments; a line of more fields is no token), a call whose `authorization` header is
#   `Bearer <token>` (the scheme in any case, RFC 6750) with one of the tokens is recorded in
#   the call's metadata (`sonic-ray`: identity `token:<name>`, tenant, share); any other call
#   is refused by Envoy's fault filter: 401, which gRPC clients read as UNAUTHENTICATED, its
#   words and WWW-Authenticate added by the listeners' local_reply_config. The routes remove
#   the header before the call goes on. A rotated Secret is read within 2 s; a file that is
#   unreadable or has no token keeps the last good tokens (none at start: every call refused).
#   A token or name of other than printable ASCII (which no header carries) is left out, said
#   by line number; nothing here writes a token anywhere but the config file.
# * Without tokens, every call's caller is anonymous and its tenant the one the tenant map
#   gives `anonymous`.
# * native-jwt (beside SONIC_RAY_JWT_ISSUER): a call without a static token (a JWT, none, or one not known)
#   goes to the client checks' Lua instead of the refusal, inside this filter: the Lua checks
#   and names it, or refuses it in its words, as where it runs on every call.
# The tenant of `token:<name>`: the first SONIC_RAY_TENANTS entry (";"-separated
# `tenant=pattern`, "*" any run of characters) whose pattern matches it, else the name; a share
# of SONIC_RAY_TENANT_SHARES (`tenant=calls/s`) is recorded for the refusal's words
# (gateway/tenant_shares.py writes the buckets). A malformed entry stops the start, saying why.
set -u
export LC_ALL=C
out=${SONIC_RAY_CALLERS_FILE:-/tmp/sonic-ray-callers/callers.yaml}
mode=${1:?usage: callers.sh native|native-jwt [ENVOY_PID] | off}
envoy_pid=${2:-}
tokens_file=${SONIC_RAY_AUTH_TOKENS_FILE:-}
here=$(cd "$(dirname "$0")" && pwd)
recheck_s=2

say() { echo "[gateway] callers: $*" >&2; }
trim() { local s=$1; s=${s#"${s%%[![:space:]]*}"}; printf '%s' "${s%"${s##*[![:space:]]}"}"; }
# A JSON string's contents: the text has no control character (printable() said so).
json() { local s=${1//\\/\\\\}; printf '%s' "${s//\"/\\\"}"; }
printable() { [[ $1 =~ ^[[:print:]]+$ ]]; }

# A site's glob ("*" any run of characters) as an anchored POSIX regular expression.
glob_regex() {
  local glob=$1 re="^" c i
  for ((i = 0; i < ${#glob}; i++)); do
    c=${glob:i:1}
    case $c in
      '*') re+=".*" ;;
      [][.\\^\$\|?+\(\)\{\}]) re+="\\$c" ;;
      *) re+=$c ;;
    esac
  done
  printf '%s$' "$re"
}

# A token as RE2 matches it literally: ASCII punctuation escaped.
re2_literal() {
  local text=$1 re="" c i
  for ((i = 0; i < ${#text}; i++)); do
    c=${text:i:1}
    if [[ $c == [[:alnum:]_] ]]; then re+=$c; else re+="\\$c"; fi
  done
  printf '%s' "$re"
}

# SONIC_RAY_TENANTS and SONIC_RAY_TENANT_SHARES, as client-checks.lua reads them.
tenant_names=() tenant_regexes=()
declare -A shares=()
IFS=';' read -r -a entries <<< "${SONIC_RAY_TENANTS:-}"
for entry in "${entries[@]}"; do
  entry=$(trim "$entry")
  [ -z "$entry" ] && continue
  if [[ ! $entry =~ ^([A-Za-z0-9._-]+)[[:space:]]*=[[:space:]]*(.+)$ ]]; then
    say "SONIC_RAY_TENANTS: \"$entry\" is not tenant=pattern (a tenant is letters, digits, - . _)"
    exit 2
  fi
  tenant_names+=("${BASH_REMATCH[1]}")
  tenant_regexes+=("$(glob_regex "${BASH_REMATCH[2]}")")
done
IFS=';' read -r -a entries <<< "${SONIC_RAY_TENANT_SHARES:-}"
for entry in "${entries[@]}"; do
  entry=$(trim "$entry")
  [ -z "$entry" ] && continue
  if [[ ! $entry =~ ^([A-Za-z0-9._/-]+)[[:space:]]*=[[:space:]]*([0-9]+)$ ]]; then
    say "SONIC_RAY_TENANT_SHARES: \"$entry\" is not tenant=calls/s"
    exit 2
  fi
  shares[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}
done

# The metadata a caller's calls are recorded with: identity, tenant and the tenant's share.
caller_metadata() {
  local identity=$1 name=$2 tenant="" i
  for i in "${!tenant_names[@]}"; do
    if [[ $identity =~ ${tenant_regexes[i]} ]]; then tenant=${tenant_names[i]}; break; fi
  done
  if [ -z "$tenant" ]; then
    if [ -n "$name" ]; then tenant=$name
    elif [ "$identity" = anonymous ]; then tenant=anonymous
    else tenant=other
    fi
  fi
  printf '{"metadata_namespace": "sonic-ray", "allow_overwrite": true, "value": {"identity": "%s", "tenant": "%s"' \
    "$(json "$identity")" "$(json "$tenant")"
  if [ -n "${shares[$tenant]:-}" ]; then printf ', "share": "%s"' "${shares[$tenant]}"; fi
  printf '}}'
}

EXTENSION='"@type": type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig'
HEADER='{"name": "authorization", "typed_config": {"@type": "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput", "header_name": "authorization"}}'
SET_METADATA='"@type": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config'
EXECUTE='"@type": type.googleapis.com/envoy.extensions.filters.http.composite.v3.ExecuteFilterAction'
FAULT='{"@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault", "abort": {"http_status": 401, "percentage": {"numerator": 100}}}'
# The client checks' Lua (as gateway/envoy.yaml runs it on job starts, counted alike).
LUA="{\"@type\": \"type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua\", \"stat_prefix\": \"client_checks\", \"default_source_code\": {\"filename\": \"$(json "$here/client-checks.lua")\"}}"
# What a call without a known static token meets: the refusal, or with a JWT issuer the Lua.
OTHERWISE=$FAULT OTHERWISE_SAID="every call is refused"
if [ "$mode" = native-jwt ]; then
  OTHERWISE=$LUA OTHERWISE_SAID="every call goes to the client checks' Lua (JWTs)"
fi

# The config, replaced whole by a rename (what Envoy's directory watch reacts to).
publish() {
  mkdir -p "$(dirname "$out")"
  printf '%s\n' "$1" > "$out.$$.new" && mv -f "$out.$$.new" "$out"
}

# One resource whose typed_config is $1.
resource() {
  printf '# Written by gateway/callers.sh: %s\nresources:\n  - %s\n    name: sonic-ray.callers\n    typed_config: %s' \
    "$2" "$EXTENSION" "$1"
}

if [ "$mode" = off ]; then
  publish "$(resource "{$SET_METADATA, \"metadata\": []}" "nothing to check here")"
  exit 0
elif [ "$mode" != native ] && [ "$mode" != native-jwt ]; then
  say "the mode is native, native-jwt or off, not \"$mode\""
  exit 2
fi

if [ -z "$tokens_file" ] && [ "$mode" = native-jwt ]; then
  publish "$(resource "$LUA" "no static tokens: the client checks' Lua checks every call")"
  say "no static tokens: the client checks' Lua checks every call (JWTs)"
  exit 0
elif [ -z "$tokens_file" ]; then
  publish "$(resource "{$SET_METADATA, \"metadata\": [$(caller_metadata anonymous "")]}" \
    "no tokens: every caller anonymous")"
  say "no tokens: every caller is anonymous, its tenant recorded by Envoy's own filters"
  exit 0
fi

loaded=""
UNREADABLE=$'\x01unreadable'
written=no
# Before any good tokens: every call refused, said once.
refuse_all() {
  [ "$written" = no ] || return 0
  publish "$(resource "$OTHERWISE" "no token yet: $OTHERWISE_SAID")"
  written=refusing
  say "the tokens file $tokens_file $1 yet: $OTHERWISE_SAID"
}
# The tokens file as the filter's matcher; nothing written while it has none.
load() {
  local text line trimmed name token number=0 count=0 matchers=""
  declare -A seen=()
  if ! text=$(cat -- "$tokens_file" 2>/dev/null); then
    refuse_all "cannot be read"
    if [ "$written" = yes ] && [ "$loaded" != "$UNREADABLE" ]; then
      say "the tokens file $tokens_file cannot be read now: the last good tokens stay"
      loaded=$UNREADABLE
    fi
    return 0
  fi
  [ "$text" = "$loaded" ] && return 0
  local -a names=() tokens=()
  while IFS= read -r line || [ -n "$line" ]; do
    number=$((number + 1))
    trimmed=$(trim "${line%$'\r'}")
    [ -z "$trimmed" ] || [ "${trimmed:0:1}" = "#" ] && continue
    if [[ $trimmed =~ ^([^[:space:]]+)[[:space:]]+([^[:space:]]+)$ ]]; then
      name=${BASH_REMATCH[1]} token=${BASH_REMATCH[2]}
    elif [[ $trimmed =~ ^[^[:space:]]+$ ]]; then
      name=unnamed token=$trimmed
    else
      continue  # more fields: no token (serve/triton_pod/access.py refuses the file)
    fi
    if ! printable "$name" || ! printable "$token"; then
      say "line $number of the tokens file is left out: a token or name of other than printable ASCII"
      continue
    fi
    # The same token twice: its last line names it, as in client-checks.lua.
    if [ -n "${seen[$token]:-}" ]; then names[${seen[$token]}]=$name; continue; fi
    seen[$token]=${#tokens[@]}
    tokens+=("$token") names+=("$name")
  done <<< "$text"
  if [ ${#tokens[@]} = 0 ]; then
    refuse_all "has no token"
    if [ "$written" = yes ]; then
      say "the tokens file $tokens_file has no token now: the last good tokens stay"
    fi
    loaded=$text
    return 0
  fi
  local action exact=""
  for count in "${!tokens[@]}"; do
    action="{\"action\": {\"name\": \"caller\", \"typed_config\": {$EXECUTE, \"typed_config\": {\"name\": \"caller\", \"typed_config\": {$SET_METADATA, \"metadata\": [$(caller_metadata "token:${names[count]}" "${names[count]}")]}}}}}"
    exact+="
              \"Bearer $(json "${tokens[count]}")\": $action"
    matchers+="
                  - {\"predicate\": {\"single_predicate\": {\"input\": $HEADER, \"value_match\": {\"safe_regex\": {\"google_re2\": {}, \"regex\": \"$(json "(?i)bearer\s+$(re2_literal "${tokens[count]}")\s*")\"}}}}, \"on_match\": $action}"
  done
  # The header as RFC 6750 writes it, looked up at once; any other spelling (the scheme's
  # case, more spaces) tried against each token's pattern in turn.
  publish "$(resource "
      \"@type\": type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher
      extension_config:
        name: composite
        typed_config: {\"@type\": type.googleapis.com/envoy.extensions.filters.http.composite.v3.Composite}
      xds_matcher:
        matcher_tree:
          input: $HEADER
          exact_match_map:
            map:$exact
        on_no_match:
          matcher:
            matcher_list:
              matchers:$matchers
            on_no_match: {\"action\": {\"name\": \"otherwise\", \"typed_config\": {$EXECUTE, \"typed_config\": {\"name\": \"otherwise\", \"typed_config\": $OTHERWISE}}}}" \
    "${#tokens[@]} token(s) from the tokens file")"
  loaded=$text
  written=yes
  say "${#tokens[@]} token(s) from $tokens_file, checked by Envoy's own filters"
}

load
[ -z "$envoy_pid" ] && exit 0
while kill -0 "$envoy_pid" 2>/dev/null; do
  sleep "$recheck_s"
  load
done
