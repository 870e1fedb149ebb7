"""The gateway pod's readinessProbe, read from the built manifests and run as the kubelet runs
it (local_stack/cluster/pods.py probe_once), against a real Envoy with the shipped config whose
admin interface does not answer: what the admin's main thread looks like to a probe while it is
busy (a CI rehearsal beside other CPU work saw both gateway pods unready at once, 1,747 calls at
their deadline, with the probe reading the whole /stats/prometheus there). The probe must not
depend on the admin, and must still fail once the admin says the pod is failing
(/healthcheck/fail)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import yaml

from gateway import local as gateway
from gateway.routes import named
from local_stack.cluster import manifests
from local_stack.cluster.pods import probe_once
from local_stack.gateway_config import gateway_env, write_lone_config
from local_stack.harness import stack_ports_env
from local_stack.polling import until
from local_stack.processes import spawn, terminate
from local_stack.settings import Settings


@dataclass
class Loopback:
    """probe_once's view of a pod: its address."""

    ip: str = "127.0.0.1"


@pytest.fixture(scope="module")
def readiness() -> manifests.Probe:
    probe = manifests.read(manifests.build()).gateway.containers["envoy"].readiness
    assert probe is not None, "the gateway's envoy container has no readinessProbe"
    return probe


@pytest.fixture(scope="module")
def gateway_with_a_silent_admin(tmp_path_factory: pytest.TempPathFactory,
                                ) -> Iterator[tuple[Settings, int]]:
    """Envoy with the shipped config, its metrics listener's admin cluster pointed at a socket
    that takes connections and never answers."""
    tmp_path = tmp_path_factory.mktemp("readiness")
    settings = Settings.from_env(stack_ports_env())
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    config_path = write_lone_config(settings, tmp_path / "gateway", [], [])
    config = yaml.safe_load(config_path.read_text())
    admin = named(config, "clusters", "envoy-admin")["load_assignment"]["endpoints"][0][
        "lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    admin["port_value"] = silent.getsockname()[1]
    config_path.write_text(yaml.safe_dump(config))
    log = tmp_path / "envoy.log"
    envoy: subprocess.Popen[bytes] = spawn(gateway.command(config_path), log,
                                           gateway_env(settings, "admin-key"))
    try:
        def listening() -> object:
            if envoy.poll() is not None:
                raise RuntimeError(f"Envoy exited ({envoy.returncode}): {log.read_text()[-2000:]}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", settings.gateway_metrics_port)) == 0
        until("Envoy's metrics listener", listening, 30)
        yield settings, settings.gateway_metrics_port
    finally:
        terminate(envoy, grace_s=5)
        silent.close()


def _on(probe: manifests.Probe, port: int) -> manifests.Probe:
    """The manifest's probe at the port this machine's Envoy serves its metrics listener on."""
    return manifests.Probe(probe.kind, port, probe.path, timeout_s=probe.timeout_s)


def test_the_probe_is_on_the_metrics_port_and_not_served_by_the_admin(
        readiness: manifests.Probe,
        gateway_with_a_silent_admin: tuple[Settings, int]) -> None:
    _, port = gateway_with_a_silent_admin
    assert readiness.kind == "http"
    built = manifests.read(manifests.build()).gateway.containers["envoy"]
    assert readiness.port == built.ports["gateway-metrics"], readiness
    probe = _on(readiness, port)
    # Every run of the probe passes while the admin interface answers nothing, beside CPU
    # work on every core (what a busy node does to the admin's main thread).
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(2 * (os.cpu_count() or 1))]
    try:
        results = [probe_once(probe, Loopback()) for _ in range(5)]  # type: ignore[arg-type]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert results == [True] * 5, (
        f"the gateway's readinessProbe GET {readiness.path} on the metrics port failed while "
        "Envoy's admin interface was silent: it waits on the admin's main thread")


def test_the_probe_fails_once_the_admin_fails_the_pod(
        readiness: manifests.Probe,
        gateway_with_a_silent_admin: tuple[Settings, int]) -> None:
    settings, port = gateway_with_a_silent_admin
    probe = _on(readiness, port)
    admin = f"http://127.0.0.1:{settings.gateway_admin_port}"
    request = urllib.request.Request(f"{admin}/healthcheck/fail", method="POST")
    urllib.request.urlopen(request, timeout=5).close()
    try:
        until("the probe to fail", lambda: not probe_once(probe, Loopback()),  # type: ignore[arg-type]
              10)
    finally:
        ok = urllib.request.Request(f"{admin}/healthcheck/ok", method="POST")
        urllib.request.urlopen(ok, timeout=5).close()
    until("the probe to pass again", lambda: probe_once(probe, Loopback()), 10)  # type: ignore[arg-type]


def test_one_slow_moment_takes_no_pod_out(readiness: manifests.Probe) -> None:
    """The kubelet marks a pod unready after failureThreshold failures in a row, a period
    apart: a pause shorter than that window is no reason to leave the Service."""
    assert readiness.timeout_s >= 2, readiness
    assert readiness.failure_threshold * readiness.period_s >= 15, readiness




# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
