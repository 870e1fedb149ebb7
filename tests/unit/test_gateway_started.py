"""The gateway pod's startupProbe (gateway/started.sh) against an admin interface that answers
as Envoy's /stats does: it passes only while each Triton cluster lists no host or a healthy
one, and says which cluster holds it back. A stand-in Envoy: the thing tested is the script."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.stand_in_http import serving

STARTED = Path(__file__).resolve().parents[2] / "gateway" / "started.sh"


@contextmanager
def _admin(stats: dict[str, int], hosts: str = "") -> Iterator[int]:
    """Envoy's /stats (the lines of `stats`) and /clusters (`hosts`, its text format)."""
    text = "".join(f"{name}: {value}\n" for name, value in stats.items()).encode()

    def body(_: str, path: str) -> bytes:
        if path == "/clusters":
            return hosts.encode()
        assert path.startswith("/stats?filter="), path
        return text

    with serving(body) as port:
        yield port


def _run(port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/bash", str(STARTED)], env={"ADMIN_PORT": str(port)},
                          capture_output=True, text=True, timeout=10, check=False)


def _hosts(cluster: str, listed: int, healthy: int, priority: int = 0) -> str:
    """/clusters' lines of `listed` hosts, `healthy` of them passing their checks, as Envoy
    writes them: each host's stats, its health flags, then its priority."""
    port = 8001 if cluster == "triton" else 8100
    lines = []
    for i in range(listed):
        host = f"{cluster}::10.1.0.{i + 1}:{port}"
        flags = "healthy" if i < healthy else "/failed_active_hc"
        lines += [f"{host}::cx_active::0", f"{host}::rq_total::0",
                  f"{host}::health_flags::{flags}", f"{host}::weight::1",
                  f"{host}::priority::{priority}", f"{host}::success_rate::-1"]
    return "".join(f"{line}\n" for line in lines)


@contextmanager
def _gateway(grpc: tuple[int, int], http: tuple[int, int], answers: int = 1,
             every_pod: tuple[int, int] = (0, 0)) -> Iterator[int]:
    """(listed, healthy) at priority 0 per cluster, `every_pod` (listed, healthy) at priority 1
    in both; `answers`: DNS answers Envoy had (update_success)."""
    stats = {"cluster.triton.update_success": answers,
             "cluster.triton-http.update_success": answers}
    hosts = "".join([_hosts("triton", *grpc), _hosts("triton", *every_pod, priority=1),
                     _hosts("triton-http", *http), _hosts("triton-http", *every_pod, priority=1)])
    with _admin(stats, hosts) as port:
        yield port


@pytest.mark.parametrize(("grpc", "http"), [((3, 3), (3, 3)), ((3, 1), (3, 2)), ((0, 0), (0, 0))],
                         ids=["all-healthy", "some-healthy", "none-listed"])
def test_it_passes_with_a_healthy_triton_or_none_listed(grpc: tuple[int, int],
                                                        http: tuple[int, int]) -> None:
    with _gateway(grpc, http) as port:
        done = _run(port)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("grpc", "http", "says"), [
    ((3, 0), (3, 3), "triton: 3 listed, none healthy"),
    ((3, 3), (2, 0), "triton-http: 2 listed, none healthy"),
], ids=["grpc-none-healthy", "http-none-healthy"])
def test_it_fails_while_the_listed_tritons_are_all_unhealthy(grpc: tuple[int, int],
                                                             http: tuple[int, int],
                                                             says: str) -> None:
    with _gateway(grpc, http) as port:
        done = _run(port)
    assert done.returncode == 1 and says in done.stdout, done.stdout + done.stderr


def test_it_fails_until_the_cluster_dns_answered() -> None:
    """No host listed because the first DNS query timed out is not "no Triton is ready"."""
    with _gateway((0, 0), (0, 0), answers=0) as port:
        done = _run(port)
    assert done.returncode == 1 and "triton: no DNS answer yet" in done.stdout, done.stdout


def test_it_fails_without_the_clusters_stats() -> None:
    with _admin({"cluster.triton.update_success": 1}, _hosts("triton", 3, 3)) as port:
        done = _run(port)
    assert done.returncode == 1 and "triton-http: no stats" in done.stdout, done.stdout


def test_it_fails_while_envoy_does_not_answer() -> None:
    with _admin({}) as port:
        pass
    done = _run(port)
    assert done.returncode != 0, done.stdout


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes


@pytest.mark.parametrize(("ready", "every_pod", "passes"), [
    ((0, 0), (3, 0), True), ((2, 2), (3, 1), True), ((2, 0), (3, 1), False)],
    ids=["none-ready-three-warming", "ready-and-one-leaving", "ready-unhealthy-one-leaving"])
def test_only_the_ready_tritons_count(ready: tuple[int, int], every_pod: tuple[int, int],
                                      passes: bool) -> None:
    """Priority 1 (every pod again, healthy only while its Triton holds live sequences) neither
    holds the start back nor lets it pass: no Triton ready is "none listed" with pods warming,
    and a leaving pod's health is not a ready Triton's."""
    with _gateway(ready, ready, every_pod=every_pod) as port:
        done = _run(port)
    assert (done.returncode == 0) is passes, done.stdout + done.stderr
