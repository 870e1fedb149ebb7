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
def _admin(stats: dict[str, int]) -> Iterator[int]:
    text = "".join(f"{name}: {value}\n" for name, value in stats.items()).encode()

    def body(_: str, path: str) -> bytes:
        assert path.startswith("/stats?filter="), path
        return text

    with serving(body) as port:
        yield port


def _run(port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/bash", str(STARTED)], env={"ADMIN_PORT": str(port)},
                          capture_output=True, text=True, timeout=10, check=False)


def _stats(grpc: tuple[int, int], http: tuple[int, int], answers: int = 1) -> dict[str, int]:
    """(listed, healthy) per cluster; `answers`: DNS answers Envoy had (update_success)."""
    return {"cluster.triton.membership_healthy": grpc[1],
            "cluster.triton.membership_total": grpc[0],
            "cluster.triton.update_success": answers,
            "cluster.triton-http.membership_healthy": http[1],
            "cluster.triton-http.membership_total": http[0],
            "cluster.triton-http.update_success": answers}


@pytest.mark.parametrize(("grpc", "http"), [((3, 3), (3, 3)), ((3, 1), (3, 2)), ((0, 0), (0, 0))],
                         ids=["all-healthy", "some-healthy", "none-listed"])
def test_it_passes_with_a_healthy_triton_or_none_listed(grpc: tuple[int, int],
                                                        http: tuple[int, int]) -> None:
    with _admin(_stats(grpc, http)) as port:
        done = _run(port)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("grpc", "http", "says"), [
    ((3, 0), (3, 3), "triton: 3 listed, none healthy"),
    ((3, 3), (2, 0), "triton-http: 2 listed, none healthy"),
], ids=["grpc-none-healthy", "http-none-healthy"])
def test_it_fails_while_the_listed_tritons_are_all_unhealthy(grpc: tuple[int, int],
                                                             http: tuple[int, int],
                                                             says: str) -> None:
    with _admin(_stats(grpc, http)) as port:
        done = _run(port)
    assert done.returncode == 1 and says in done.stdout, done.stdout + done.stderr


def test_it_fails_until_the_cluster_dns_answered() -> None:
    """No host listed because the first DNS query timed out is not "no Triton is ready"."""
    with _admin(_stats((0, 0), (0, 0), answers=0)) as port:
        done = _run(port)
    assert done.returncode == 1 and "triton: no DNS answer yet" in done.stdout, done.stdout


def test_it_fails_without_the_clusters_stats() -> None:
    with _admin({"cluster.triton.membership_total": 3, "cluster.triton.membership_healthy": 3,
                 "cluster.triton.update_success": 1}) as port:
        done = _run(port)
    assert done.returncode == 1 and "triton-http: no stats" in done.stdout, done.stdout


def test_it_fails_while_envoy_does_not_answer() -> None:
    with _admin({}) as port:
        pass
    done = _run(port)
    assert done.returncode != 0, done.stdout


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
