"""What keeps a local cluster pod from ready, as `make cluster` says it when an upgrade's new
cluster does not come up (local_stack/cluster/pods.py, Pod.waiting_on): each probe not passed,
its failures in a row and its container's last log line; a passed probe is not named."""

from __future__ import annotations

from pathlib import Path

from local_stack.cluster.manifests import Probe
from local_stack.cluster.network import PodNetwork
from local_stack.cluster.pods import ContainerSpec, Pod, last_line

REFUSED = Probe("tcp", port=1, timeout_s=1)


def _pod(tmp_path: Path) -> Pod:
    specs = [ContainerSpec(name, ["true"], {}, REFUSED, None, None)
             for name in ("triton", "ray-worker")]
    return Pod("triton-7", PodNetwork("ns-triton-7", "127.0.0.1", "veth-7"), specs, 1.0,
               tmp_path, print, lambda: None)


def test_a_pod_names_the_probe_that_keeps_it_from_ready_and_its_last_log_line(
        tmp_path: Path) -> None:
    pod = _pod(tmp_path)
    (tmp_path / "triton-7.ray-worker.log").write_text(
        "Ray runtime started.\n[raylet] the dashboard agent did not start in 15 s\n\n")
    for _ in range(3):
        pod._probe("ray-worker", pod._readiness["ray-worker"], startup=False)
    pod._readiness["triton"].passed = True
    said = pod.waiting_on()
    assert said == ("ray-worker's readiness probe not passed (3 failures in a row), its log "
                    "ends: '[raylet] the dashboard agent did not start in 15 s'"), said
    pod._readiness["ray-worker"].passed = True
    assert pod.waiting_on() == "every probe passed"


def test_an_empty_or_missing_log_says_so(tmp_path: Path) -> None:
    (tmp_path / "empty.log").write_text("\n")
    assert last_line(tmp_path / "empty.log") == "(empty)"
    assert last_line(tmp_path / "missing.log").startswith("(unreadable: ")
    (tmp_path / "long.log").write_text("x" * 10_000)
    assert last_line(tmp_path / "long.log") == "x" * 200
