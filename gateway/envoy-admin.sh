# Sourced by the gateway pod's probe and preStop (started.sh, drain.sh): Envoy's admin
# interface on loopback. The official image has bash but no curl: /dev/tcp.
ADMIN_PORT=${ADMIN_PORT:-9901}

admin() {  # method path: the body of Envoy's answer
  exec 3<>"/dev/tcp/127.0.0.1/${ADMIN_PORT}" || return 1
  printf '%s %s HTTP/1.1\r\nHost: envoy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n' \
    "$1" "$2" >&3
  sed '1,/^\r$/d' <&3
  exec 3<&-
}
