"""make observe's Prometheus (local_stack/prometheus.py) follows the pods: a real Prometheus
(Debian's package) scrapes an exporter listed after it started, as a ServiceMonitor follows a
Service's endpoints, and stops scraping one taken off; the stack rewrites the list when the
autoscaler starts or stops a pod (LocalStack._start_pod, _stop_pod). Before, the targets were
fixed at Prometheus's start: pods started on demand were never scraped."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from local_stack import prometheus
from local_stack.polling import until
from local_stack.ports import free_ports
from local_stack.processes import terminate
from local_stack.stack import LocalStack
from tests.support.stand_in_http import serving


def _scraped(port: int) -> dict[str, str]:
    """Each target Prometheus knows now, with its health."""
    url = f"http://127.0.0.1:{port}/api/v1/targets"
    with urllib.request.urlopen(url, timeout=5) as answer:
        active = json.load(answer)["data"]["activeTargets"]
    return {t["labels"]["instance"]: t["health"] for t in active}


@pytest.mark.processes
def test_a_target_listed_later_is_scraped_and_one_taken_off_is_dropped(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    with serving(lambda _, path: b"stand_in_up 1\n") as first, \
            serving(lambda _, path: b"stand_in_up 1\n") as later:
        server: subprocess.Popen[bytes] = prometheus.start(
            {"ray-metrics": [first]}, port, tmp_path)
        try:
            def scraped(wanted: dict[str, str]) -> object:
                if server.poll() is not None:
                    raise RuntimeError(f"Prometheus exited: {(tmp_path / 'prometheus.log').read_text()}")
                try:
                    now = _scraped(port)
                except OSError as error:
                    return error
                return now == wanted or now

            until("the first exporter scraped", lambda: scraped({f"localhost:{first}": "up"}),
                  60)
            prometheus.write_targets(tmp_path / "prometheus", {"ray-metrics": [first, later]})
            until("the exporter listed later scraped", lambda: scraped(
                {f"localhost:{first}": "up", f"localhost:{later}": "up"}), 60)
            prometheus.write_targets(tmp_path / "prometheus", {"ray-metrics": [later]})
            until("the exporter taken off dropped",
                  lambda: scraped({f"localhost:{later}": "up"}), 60)
        finally:
            terminate(server, grace_s=5)


def test_an_unknown_job_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no scrape job"):
        prometheus.write_targets(tmp_path, {"ray-metric": [1]})


class _Running:
    def __init__(self, port: int) -> None:
        self.args = ["ray", "start", f"--metrics-export-port={port}"]

    def poll(self) -> None:
        return None

    def wait(self) -> int:
        return 0


def test_the_stack_lists_a_pod_the_autoscaler_starts_and_drops_one_it_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stack's wiring alone: its pods' processes stood in."""
    home = tmp_path / "prometheus"
    home.mkdir()
    stopped: list[object] = []
    monkeypatch.setattr("local_stack.stack.terminate", lambda node, grace_s: stopped.append(node))
    settings = SimpleNamespace(tritons=2, data_path="gateway", gateway_metrics_port=9902,
                               triton=lambda i: SimpleNamespace(metrics=8002 + 10 * i))
    stack: Any = SimpleNamespace(
        settings=settings, workdir=tmp_path, ray=_Running(8080), prometheus=_Running(0),
        pod_nodes={}, tritons={}, _start_pod_node=lambda i: _Running(9000 + i),
        _new_triton=lambda i: SimpleNamespace(start=lambda: None,
                                              stop=lambda: stopped.append(f"triton {i}")))
    stack.metrics_targets = lambda: LocalStack.metrics_targets(stack)
    stack._metrics_targets_changed = lambda: LocalStack._metrics_targets_changed(stack)

    def listed() -> list[str]:
        text = prometheus.targets_file(home, "ray-metrics").read_text()
        return [t for group in json.loads(text) for t in group["targets"]]

    LocalStack._start_pod(stack, 1)
    assert listed() == ["localhost:8080", "localhost:9001"]
    node = stack.pod_nodes[1]
    LocalStack._stop_pod(stack, 1)
    assert listed() == ["localhost:8080"]
    assert sorted(map(str, stopped)) == sorted(map(str, ["triton 1", node]))
