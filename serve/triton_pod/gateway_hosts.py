"""How many Tritons the gateway balances over now, read from its own Prometheus stats (the
headless Service `gateway-metrics`, gateway/gateway.yaml). During a KubeRay upgrade those are
the old Ray cluster's GPU pods, and the new cluster's autoscaling policy holds that many as its
floor until it runs them (autoscaling.py): KubeRay switches to the new cluster only once it
does, so the load never finds fewer GPU pods after the switch than served it before."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

HEALTHY_METRIC = "envoy_cluster_membership_healthy"
# The gateway's gRPC cluster of Tritons (gateway/envoy.yaml, gateway.routes.GRPC_CLUSTER).
TRITON_CLUSTER = "triton"


def healthy_hosts(text: str, cluster: str = TRITON_CLUSTER) -> int | None:
    """The healthy hosts of one Envoy cluster in Envoy's Prometheus text; None if absent."""
    label = f'envoy_cluster_name="{cluster}"'
    for line in text.splitlines():
        if line.startswith(HEALTHY_METRIC + "{") and label in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return None


class GatewayHosts:
    """Polls the gateway's stats in a thread of its own: the policy runs in Serve's control
    loop and must never wait on the network. `count` is None until an answer came, and again
    when the last one is older than three polls."""

    def __init__(self, url: str, every_s: float = 5.0, timeout_s: float = 2.0) -> None:
        self.url = url
        self.every_s = every_s
        self.timeout_s = timeout_s
        self.error = "no answer yet"
        self._count: int | None = None
        self._at = 0.0
        threading.Thread(target=self._poll, name="gateway hosts", daemon=True).start()

    @property
    def count(self) -> int | None:
        if time.monotonic() - self._at > 3 * self.every_s:
            return None
        return self._count

    def _poll(self) -> None:
        while True:
            try:
                with urllib.request.urlopen(self.url, timeout=self.timeout_s) as response:
                    found = healthy_hosts(response.read().decode())
                if found is None:
                    self.error = f"{self.url} has no {HEALTHY_METRIC} of {TRITON_CLUSTER}"
                else:
                    self._count, self._at = found, time.monotonic()
            except (urllib.error.URLError, OSError, ValueError) as error:
                self.error = f"{self.url}: {error}"
            time.sleep(self.every_s)


_SHARED: dict[str, GatewayHosts] = {}
_SHARED_LOCK = threading.Lock()


def gateway_hosts(url: str) -> GatewayHosts:
    """One poller per URL in a process: Serve makes a new policy object at every config
    update, and each must not start a thread of its own."""
    with _SHARED_LOCK:
        if url not in _SHARED:
            _SHARED[url] = GatewayHosts(url)
        return _SHARED[url]
