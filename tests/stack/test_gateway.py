"""The gateway path with two simulated pods (TRITONS=2), each a Ray node with one `triton`
resource beside its own Triton, Envoy in front: per-call balancing, Triton's sequence example
clients (tests/sequence_models beside the example and test models, warmed at start like the
others), a Triton killed under load, a pod removed as a scale-down does it, many large calls
on one connection, Envoy's metrics and admin ports, and autoscaling on Triton's queue time, up
and down."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from gateway import local as gateway
from local_stack.harness import (
    RunningStack,
    processes_left_behind,
    running_stack,
    serve_config_with,
)
from local_stack.polling import until
from local_stack.triton import (
    EXAMPLE_MODELS,
    SEQUENCE_MODELS,
    TEST_MODELS,
    merged_model_repository,
)
from local_stack.triton_inputs import simple_inputs, tensor
from tests.gateway.test_sequences import _call as _sequence_call
from tests.support.examples import SEQUENCE_EXAMPLES, sequence_example_passed
from tests.support.load import DEADLINE_S, Outcome, load, scale_cycle
from triton_pod.gateway_view import CLUSTERS_PATH, ready_tritons

# Quick autoscaling for a test: Triton's metrics every half second, short delays, and a low
# queue-time target that the slow model's queue crosses with a handful of callers.
AUTOSCALING = {"metrics_interval_s": 0.5, "look_back_period_s": 2, "upscale_delay_s": 1,
               "downscale_delay_s": 4}


# How long a replica stopped while its Triton holds live sequences waits for them (below the
# stack's graceful_shutdown_timeout_s of 20 s, as the invariant leaving-pods-reachable wants).
LEAVING = {"leave_wait_s": 10}


def _two_pods_config(directory: Path, replicas: tuple[int, int] = (2, 2)) -> Path:
    return serve_config_with(
        directory, deployment={"graceful_shutdown_timeout_s": 20, "health_check_period_s": 2},
        autoscaling={**AUTOSCALING, "min_replicas": replicas[0], "max_replicas": replicas[1]},
        policy_kwargs={"target_queue_ms_per_exec": 50}, args=LEAVING)


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    config = _two_pods_config(tmp_path_factory.mktemp("serve-config"))
    models = merged_model_repository([EXAMPLE_MODELS, TEST_MODELS, SEQUENCE_MODELS])
    try:
        with running_stack({"DATA_PATH": "gateway", "TRITONS": "2", "SERVE_CONFIG": str(config),
                            "MODEL_REPOSITORY": str(models)},
                           ready_pattern=r"gateway discovery: pods \[0, 1\]") as running:
            yield running
    finally:
        shutil.rmtree(models, ignore_errors=True)
    assert running.process.process.returncode == 0
    assert not processes_left_behind(running.process)


def _execution_counts(running: RunningStack, model: str = "simple") -> list[int]:
    counts = []
    for pod in (0, 1):
        with urllib.request.urlopen(running.triton_metrics_url(pod), timeout=10) as response:
            text = response.read().decode()
        counts.append(sum(int(float(line.split()[-1])) for line in text.splitlines()
                          if line.startswith(f'nv_inference_count{{model="{model}"')))
    return counts


@pytest.mark.parametrize("example", SEQUENCE_EXAMPLES)
def test_tritons_sequence_examples_pass_with_two_pods(pods: RunningStack, example: str) -> None:
    failed = sequence_example_passed(example, pods.url("GRPC_PORT"), pods.url("HTTP_PORT"))
    assert failed is None, f"through make local TRITONS=2: {failed}"


def test_calls_spread_over_both_tritons(pods: RunningStack) -> None:
    before = _execution_counts(pods)
    outcomes = asyncio.run(load(pods.url("GRPC_PORT"), 3, 8))
    after = _execution_counts(pods)
    served = [a - b for a, b in zip(after, before, strict=True)]
    print(f"{len(outcomes)} calls through the gateway; Triton 0 served {served[0]}, "
          f"Triton 1 {served[1]}")
    assert all(status == "OK" for _, status, _ in outcomes)
    assert sum(served) == len(outcomes)
    assert min(served) > len(outcomes) / 4, f"unbalanced: {served}"


def test_the_autoscaling_policy_sees_the_calls_the_gateway_gets(
        pods: RunningStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy's view of the gateway (serve/triton_pod/gateway_view.py) read from this real
    Envoy's stats: the healthy Tritons, and exactly the calls made on the clients' ports
    between two polls (its demand, which scales from and to zero)."""
    from triton_pod.gateway_view import GatewayView

    monkeypatch.setattr(GatewayView, "_poll", lambda self: None)  # polled by hand below
    view = GatewayView(f"http://localhost:{pods.ports['GATEWAY_METRICS_PORT']}"
                       "/stats/prometheus")
    view._poll_once()
    assert view.count == 2, view.error
    ones = np.ones((1, 16), dtype=np.int32)
    client = tc.InferenceServerClient(pods.url("GRPC_PORT"))
    try:
        for _ in range(20):
            client.infer("simple", simple_inputs(ones, ones))
    finally:
        client.close()
    for _ in range(5):
        with urllib.request.urlopen(f"http://{pods.url('HTTP_PORT')}/v2/health/ready",
                                    timeout=10) as response:
            assert response.status == 200
    view._poll_once()
    assert view.demand is not None and view.demand.arrived == 25, view.demand


def test_many_large_calls_on_one_connection_never_stall(pods: RunningStack) -> None:
    data = np.arange(4 << 20, dtype=np.float32)  # 16 MiB each way

    async def run() -> list[tuple[str, float]]:
        client = tc_aio.InferenceServerClient(pods.url("GRPC_PORT"))
        end = time.monotonic() + 10
        outcomes: list[tuple[str, float]] = []

        async def caller() -> None:
            while time.monotonic() < end:
                started = time.monotonic()
                try:
                    result = await client.infer("identity_fp32", [tensor("INPUT", data, "FP32")],
                                                client_timeout=60)
                    ok = bool(np.array_equal(result.as_numpy("OUTPUT"), data))
                    outcomes.append(("OK" if ok else "WRONG", time.monotonic() - started))
                except InferenceServerException as error:
                    outcomes.append((str(error.status()), time.monotonic() - started))

        try:
            await asyncio.gather(*(caller() for _ in range(32)))
        finally:
            await client.close()
        return outcomes

    for attempt in range(3):
        outcomes = asyncio.run(run())
        longest = max(seconds for _, seconds in outcomes)
        print(f"16 MiB x 32 on one channel, run {attempt + 1}: {len(outcomes)} calls, "
              f"longest {longest:.1f}s")
        assert outcomes and {status for status, _ in outcomes} == {"OK"}
        assert longest < 30, f"a call took {longest:.1f}s: the connection stalled"


def test_metrics_port_serves_prometheus_and_the_tritons_and_nothing_else(
        pods: RunningStack) -> None:
    """Of the admin interface only what reads: the stats for Prometheus and the host list the
    control plane counts the ready Tritons from (serve/triton_pod/gateway_view.py)."""
    base = f"http://localhost:{pods.ports['GATEWAY_METRICS_PORT']}"
    with urllib.request.urlopen(f"{base}/stats/prometheus", timeout=10) as response:
        text = response.read().decode()
    assert 'envoy_cluster_upstream_rq_total{envoy_cluster_name="triton"}' in text
    with urllib.request.urlopen(f"{base}{CLUSTERS_PATH}", timeout=10) as response:
        hosts = response.read().decode()
    assert ready_tritons(hosts) is not None and "::priority::1" in hosts, hosts[:500]
    for path in ("/quitquitquit", "/healthcheck/fail", "/config_dump", "/stats", "/runtime"):
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(f"{base}{path}", timeout=10)
        assert caught.value.code == 404, path


@pytest.mark.disruptive
def test_triton_killed_costs_only_its_calls(pods: RunningStack) -> None:
    seen = len(pods.process.lines)
    killed_at = 0.0

    async def kill_underload() -> list[Outcome]:
        nonlocal killed_at
        task = asyncio.ensure_future(load(pods.url("GRPC_PORT"), 12, 8, "slow", 0.2))
        await asyncio.sleep(3)
        killed_at = time.monotonic()
        os.kill(pods.process.triton_pid(1), signal.SIGKILL)
        return await task

    outcomes = asyncio.run(kill_underload())
    pods.process.wait_for_line(r"triton 1 exited with status -9", 30, after=seen)
    failed = [(t - killed_at, s) for t, s, _ in outcomes if s != "OK"]
    after_kill = [s for t, s, _ in outcomes if t > killed_at + 2]
    longest = max(seconds for _, _, seconds in outcomes)
    print(f"Triton 1 killed under load: {len(outcomes)} calls, {len(failed)} failed "
          f"({sorted({s for _, s in failed})}), longest {longest:.1f}s; "
          f"{after_kill.count('OK')} of {len(after_kill)} calls from 2 s after the kill on OK")
    assert longest < DEADLINE_S + 2, "a call hung"
    assert {s for _, s in failed} <= {"StatusCode.UNAVAILABLE"}
    # Only the calls Triton 1 held when it died: at most its 8 callers' calls in flight.
    assert len(failed) <= 8, failed
    assert after_kill and set(after_kill) == {"OK"}, "calls did not go to the other Triton"
    pods.process.wait_for_line(r"gateway discovery: pods \[0, 1\]", 120, after=seen)


@pytest.mark.disruptive
def test_pod_removed_as_a_scale_down_loses_no_call(pods: RunningStack) -> None:
    seen = len(pods.process.lines)

    async def remove_underload() -> list[Outcome]:
        task = asyncio.ensure_future(load(pods.url("GRPC_PORT"), 12, 8, "slow", 0.5))
        await asyncio.sleep(3)
        pods.process.delete_pod(1)
        return await task

    outcomes = asyncio.run(remove_underload())
    pods.process.wait_for_line(r"triton 1: out of discovery; SIGTERM", 30, after=seen)
    exited = pods.process.wait_for_line(r"triton 1 exited with status (-?\d+) after its drain",
                                        60, after=seen)
    statuses = [s for _, s, _ in outcomes]
    print(f"pod 1 removed under load: {len(outcomes)} calls, "
          f"{len(statuses) - statuses.count('OK')} failed; Triton 1 exited with "
          f"{exited.group(1)}")
    assert statuses and set(statuses) == {"OK"}
    assert exited.group(1) == "0", "Triton did not exit cleanly after draining"
    pods.process.wait_for_line(r"gateway discovery: pods \[0, 1\]", 120, after=seen)


@pytest.mark.disruptive
def test_a_scale_down_keeps_the_sequences_of_the_pod_it_removes(pods: RunningStack,
                                                                 tmp_path: Path) -> None:
    """Serve scales the deployment from two replicas to one while 16 sequences (8 over gRPC, 8
    over HTTP) run on both pods, as the autoscaler does when the load falls: the stopped
    replica's pod leaves the ready ones, but while its Triton holds live sequences the replica
    stays and says so on its holding ports (serve/triton_pod/holding.py), and the gateway sends
    the calls of those sequences there (gateway/envoy.yaml, priority 1). Every sum is right,
    and the leaving pod's Triton ran calls after it had left the ready ones."""
    seen = len(pods.process.lines)
    sequences = [("grpc", 9100 + s) for s in range(8)] + [("http", 9200 + s) for s in range(8)]
    sums: dict[int, int] = {}
    wrong: list[str] = []
    rounds = [0]
    stop = threading.Event()

    def run() -> None:
        clients: dict[str, Any] = {"grpc": tc.InferenceServerClient(pods.url("GRPC_PORT")),
                                   "http": th.InferenceServerClient(pods.url("HTTP_PORT"))}

        def step(protocol: str, sequence: int, start: bool = False, end: bool = False) -> None:
            value = sequence % 100 + 1
            sums[sequence] = sums.get(sequence, 0) + value
            got = _sequence_call(clients[protocol], sequence, value, start, end)
            if got != sums[sequence]:
                wrong.append(f"{protocol} sequence {sequence}: {got}, not {sums[sequence]}")

        try:
            for protocol, sequence in sequences:
                step(protocol, sequence, start=True)
            while not stop.is_set():
                for protocol, sequence in sequences:
                    step(protocol, sequence)
                rounds[0] += 1
            for protocol, sequence in sequences:
                step(protocol, sequence, end=True)
        except InferenceServerException as error:
            wrong.append(f"after {rounds[0]} rounds: {error}")
        finally:
            for client in clients.values():
                client.close()

    caller = threading.Thread(target=run, name="sequences")
    caller.start()
    try:
        def rounds_since(first: int, wanted: int) -> object:
            if wrong or not caller.is_alive():
                raise AssertionError(f"{len(wrong)} wrong: {wrong[:5]}")
            calls = _execution_counts(pods, "sequence_sum")
            return (rounds[0] >= first + wanted and min(calls) > 0) or (
                f"{rounds[0] - first} rounds, {calls} calls per pod")

        until("the sequences to run on both pods", lambda: rounds_since(0, 2), 60)
        pods.redeploy(_two_pods_config(tmp_path, (1, 1)))
        left = pods.process.wait_for_line(r"gateway discovery: pods \[(\d)\]", 60, after=seen)
        leaving = 1 - int(left.group(1))
        at_leave, at_round = _execution_counts(pods, "sequence_sum"), rounds[0]
        until("three more rounds of every sequence", lambda: rounds_since(at_round, 3), 60)
    finally:
        stop.set()
        caller.join(timeout=60)
    ran_after = [a - b for a, b in
                 zip(_execution_counts(pods, "sequence_sum"), at_leave, strict=True)]
    restored = len(pods.process.lines)
    pods.redeploy(_two_pods_config(tmp_path))
    pods.process.wait_for_line(r"gateway discovery: pods \[0, 1\]", 120, after=restored)
    assert not wrong, f"{len(wrong)} wrong while pod {leaving} was leaving: {wrong[:5]}"
    assert ran_after[leaving] > 0, (
        f"the leaving pod ran none of its sequences' calls after it left: {ran_after}")


@pytest.mark.disruptive
def test_tritons_that_join_when_none_is_healthy_get_calls_once_envoy_lists_them_healthy(
        pods: RunningStack) -> None:
    """As when the first GPU pod joins (scale from zero, every Triton back after an outage): the
    discovery adds Tritons while none is healthy, their first check passes, and from the moment
    Envoy's admin interface (what the gateway's startupProbe, the stacks' ready lines and the
    tests read) lists one healthy, calls reach it. Envoy merges a health change that follows
    another within `update_merge_window` (1 s unless set) before its workers see it: they
    answered "no Triton is ready" for up to a second while the admin said healthy."""
    listed = pods.process.workdir() / "gateway" / "endpoints.json"
    shipped = listed.read_bytes()
    admin = int(pods.ports["GATEWAY_ADMIN_PORT"])
    client = tc.InferenceServerClient(pods.url("GRPC_PORT"))
    answers: list[str] = []
    try:
        gateway.write_endpoints(listed, [])
        until("Envoy to list no Triton", lambda: gateway.upstream_ports(admin) == set(), 30,
              every_s=0.05)
        staged = listed.with_name(listed.name + ".new")
        staged.write_bytes(shipped)
        os.replace(staged, listed)
        until("Envoy to list a Triton healthy",
              lambda: bool(gateway.upstream_ports(admin, healthy_only=True)), 30, every_s=0.005)
        for _ in range(5):
            try:
                answers.append(str(client.is_server_ready()))
            except InferenceServerException as error:
                answers.append(str(error))
    finally:
        client.close()
        if listed.read_bytes() != shipped:
            staged = listed.with_name(listed.name + ".new")
            staged.write_bytes(shipped)
            os.replace(staged, listed)
    assert answers == ["True"] * 5, answers


@pytest.mark.disruptive
def test_envoy_killed_is_restarted_with_both_tritons(pods: RunningStack) -> None:
    """As the kubelet restarts the gateway's container: the new Envoy reads the current
    discovery and serves both Tritons again."""
    seen = len(pods.process.lines)
    os.kill(pods.process.pids(r"Envoy started \(pid (\d+)\)")[-1], signal.SIGKILL)
    pods.process.wait_for_line(r"gateway: Envoy exited with status -9; restarting", 30,
                               after=seen)
    pods.process.wait_for_line(r"gateway: Envoy started \(pid \d+\)", 30, after=seen)
    tritons = {int(pods.triton_url(pod).rsplit(":", 1)[1]) for pod in (0, 1)}

    def both_healthy() -> object:
        try:
            healthy = gateway.upstream_ports(int(pods.ports["GATEWAY_ADMIN_PORT"]),
                                             healthy_only=True)
        except OSError as error:
            return error
        return healthy == tritons or f"healthy: {sorted(healthy)}"

    until("the restarted Envoy to have both Tritons healthy", both_healthy, 60)
    before = _execution_counts(pods)
    outcomes = asyncio.run(load(pods.url("GRPC_PORT"), 2, 4))
    served = [a - b for a, b in zip(_execution_counts(pods), before, strict=True)]
    print(f"Envoy killed and restarted: {len(outcomes)} calls after, served {served}")
    assert outcomes and {status for _, status, _ in outcomes} == {"OK"}
    assert min(served) > 0, f"the restarted Envoy used one Triton only: {served}"


@pytest.mark.disruptive
def test_replicas_follow_tritons_queue_time_up_and_down(
    pods: RunningStack, tmp_path: Path
) -> None:
    config = _two_pods_config(tmp_path, (1, 2))
    # An in-place Serve update, as KubeRay applies a changed serveConfigV2.
    pods.redeploy(config)
    timeline, outcomes = scale_cycle(pods)
    assert [s for _, s, _ in outcomes if s != "OK"] == []
    counts = [count for _, count in timeline]
    assert counts[0] == 1 and max(counts) == 2, timeline
    assert counts[-1] == 1, f"never scaled back down: {timeline}"
