"""What the gateway sees, read from every gateway pod's metrics listener (the headless Service
`gateway-metrics`, gateway/gateway.yaml, resolves to each pod): how many Tritons it balances
over (its admin interface's /clusters: the ready pods, priority 0 of its Triton cluster; the
pods holding live sequences are listed again at priority 1, so the cluster's own healthy
count would count those twice), and whether calls come (its Prometheus stats).

- The healthy Tritons: during a KubeRay upgrade those are the old Ray cluster's GPU pods, and
  the new cluster's autoscaling policy holds that many as its floor until it runs them
  (autoscaling.py): KubeRay switches to the new cluster only once it does, so the load never
  finds fewer GPU pods after the switch than served it before.
- The demand: calls that arrived on the clients' listeners since the last poll, and calls in
  flight. With no Triton running no replica reports anything, so this is the only sign that
  jobs want a GPU pod (scale from zero), and its absence the sign of an idle facility (scale
  to zero after the site's `downscale_to_zero_delay_s`).
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

# The admin interface's host list, which the metrics listener passes (gateway/envoy.yaml's
# `metrics` routes): per host its health_flags line, then its priority line.
CLUSTERS_PATH = "/clusters"
# The gateway's gRPC cluster of Tritons (gateway/envoy.yaml, gateway.routes.GRPC_CLUSTER).
TRITON_CLUSTER = "triton"
REQUESTS_METRIC = "envoy_http_downstream_rq_total"
ACTIVE_METRIC = "envoy_http_downstream_rq_active"
# The clients' listeners' stat prefixes (gateway/envoy.yaml, stat_prefix): gRPC and HTTP.
CLIENT_LISTENERS = ("triton_grpc", "triton_http")


@dataclass(frozen=True)
class PodStats:
    healthy: int | None
    requests: float
    active: float


def _value(line: str) -> float:
    return float(line.rsplit(" ", 1)[1])


def pod_stats(text: str, healthy: int | None = None) -> PodStats:
    """One Envoy's requests received and in flight on the clients' listeners, from its
    Prometheus text, with its `healthy` Tritons (ready_tritons)."""
    requests = active = 0.0
    labels = {f'envoy_http_conn_manager_prefix="{name}"' for name in CLIENT_LISTENERS}
    for line in text.splitlines():
        if line.startswith((REQUESTS_METRIC + "{", ACTIVE_METRIC + "{")) and any(
                label in line for label in labels):
            if line.startswith(REQUESTS_METRIC):
                requests += _value(line)
            else:
                active += _value(line)
    return PodStats(healthy, requests, active)


def ready_tritons(text: str, cluster: str = TRITON_CLUSTER) -> int | None:
    """The healthy hosts at priority 0 of one Envoy cluster (the ready pods) in the admin
    interface's /clusters text; None if the cluster is absent. A host's two copies (priority
    0 and 1) share their address, so each health_flags line counts with the priority line
    that follows it."""
    present = False
    flags = ""
    healthy = 0
    for line in text.splitlines():
        parts = line.split("::")
        if parts[0] != cluster:
            continue
        present = True
        if len(parts) == 4 and parts[2] == "health_flags":
            flags = parts[3].strip()
        elif len(parts) == 4 and parts[2] == "priority":
            healthy += parts[3].strip() == "0" and flags == "healthy"
    return healthy if present else None


@dataclass(frozen=True)
class Demand:
    arrived: float  # calls received by all gateway pods since the previous poll
    in_flight: float

    @property
    def calls(self) -> bool:
        return self.arrived > 0 or self.in_flight > 0


def demand_between(before: dict[str, PodStats], now: dict[str, PodStats]) -> Demand:
    """Calls that arrived between two polls, summed over the pods (a pod new since the first
    poll, or whose counters went back because its Envoy restarted, counts from zero)."""
    arrived = 0.0
    for address, stats in now.items():
        last = before.get(address)
        arrived += stats.requests - (last.requests if last and last.requests <= stats.requests
                                     else 0.0)
    return Demand(arrived, sum(s.active for s in now.values()))


class GatewayView:
    """Polls each gateway pod's stats in a thread of its own: the policy runs in Serve's
    control loop and must never wait on the network. `count` and `demand` are None until a
    poll answered, and again when the last answer is older than three polls."""

    def __init__(self, url: str, every_s: float = 5.0, timeout_s: float = 2.0) -> None:
        self.url = url
        self.every_s = every_s
        self.timeout_s = timeout_s
        self.error = "no answer yet"
        self._count: int | None = None
        self._demand: Demand | None = None
        self._pods: dict[str, PodStats] | None = None
        self._at = 0.0
        threading.Thread(target=self._poll, name="gateway view", daemon=True).start()

    @property
    def count(self) -> int | None:
        return None if self._stale() else self._count

    @property
    def demand(self) -> Demand | None:
        return None if self._stale() else self._demand

    def _stale(self) -> bool:
        return time.monotonic() - self._at > 3 * self.every_s

    def _addresses(self) -> list[str]:
        """Every address of the URL's host (the headless Service lists each gateway pod)."""
        host = urllib.parse.urlsplit(self.url).hostname or "localhost"
        found = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
        return sorted({str(info[4][0]) for info in found})

    def _poll_once(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        pods: dict[str, PodStats] = {}
        for address in self._addresses():
            netloc = f"{address}:{parts.port}" if parts.port else address
            url = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
            hosts = urllib.parse.urlunsplit(parts._replace(netloc=netloc, path=CLUSTERS_PATH,
                                                           query=""))
            with urllib.request.urlopen(hosts, timeout=self.timeout_s) as response:
                healthy = ready_tritons(response.read().decode())
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                pods[address] = pod_stats(response.read().decode(), healthy)
        counts = [s.healthy for s in pods.values() if s.healthy is not None]
        if not counts:
            self.error = f"{self.url}: its {CLUSTERS_PATH} lists no cluster {TRITON_CLUSTER}"
            return
        before, self._pods = self._pods, pods
        # The first poll has no interval: what is in flight is all it knows.
        self._demand = demand_between(before if before is not None else pods, pods)
        self._count, self._at = max(counts), time.monotonic()

    def _poll(self) -> None:
        while True:
            try:
                self._poll_once()
            except (urllib.error.URLError, OSError, ValueError) as error:
                self.error = f"{self.url}: {error}"
            time.sleep(self.every_s)


_SHARED: dict[str, GatewayView] = {}
_SHARED_LOCK = threading.Lock()


def gateway_view(url: str) -> GatewayView:
    """One poller per URL in a process: Serve makes a new policy object at every config
    update, and each must not start a thread of its own."""
    with _SHARED_LOCK:
        if url not in _SHARED:
            _SHARED[url] = GatewayView(url)
        return _SHARED[url]
