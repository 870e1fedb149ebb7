"""A pod's holding of live sequences (serve/triton_pod/holding.py, and the replica's watch and
stop in pod.py): which sequences count as live from Triton's statistics, what the holding ports
answer Envoy's checks, ready or leaving, and how long a stopping replica stays. Stand-ins for Triton's HTTP
endpoint; the thing tested is our code."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from typing import Any

import grpc
import pytest

from local_stack.ports import free_ports
from tests.unit.test_triton_pod import _http_triton, _running_fake_triton
from triton_pod import pod as pod_module
from triton_pod.holding import (
    HEALTH_CHECK_PATH,
    NOT_SERVING,
    SERVING,
    Holding,
    HoldingAnswers,
    live_sequence_models,
    sequence_idle_s,
)
from triton_pod.pod import TritonPod, TritonPodArgs
from triton_pod.warmup import WarmupArgs

SEQUENCE_CONFIG = {"name": "seq", "sequence_batching": {"max_sequence_idle_microseconds": 2000000}}


def test_a_models_idle_time_is_its_sequence_batchers_or_tritons_default() -> None:
    assert sequence_idle_s(SEQUENCE_CONFIG) == 2.0
    assert sequence_idle_s({"name": "s", "sequence_batching": {}}) == 1.0
    assert sequence_idle_s({"name": "plain", "max_batch_size": 8}) is None


def test_a_sequence_is_live_while_its_model_ran_within_its_idle_time() -> None:
    now = 1_000_000.0
    stats = {"model_stats": [
        {"name": "seq", "version": "1", "last_inference": int((now - 1.5) * 1000)},
        {"name": "old", "version": "1", "last_inference": int((now - 3.0) * 1000)},
        {"name": "never", "version": "1", "last_inference": 0},
        {"name": "plain", "version": "1", "last_inference": int(now * 1000)},
    ]}
    idle = {"seq": 2.0, "old": 2.0, "never": 2.0}
    assert live_sequence_models(stats, idle, now) == ["seq"]
    assert live_sequence_models(stats, idle, now + 1.0) == []


def test_a_pod_whose_triton_holds_a_live_sequence_is_held_ready_or_leaving() -> None:
    assert Holding().verdict() is not None
    assert Holding(leaving=True).verdict() is not None
    assert Holding(leaving=False, live=["seq"]).verdict() is None
    assert Holding(leaving=True, live=["seq"]).verdict() is None


def test_a_ready_pod_a_gateway_checks_is_held_while_its_sequences_live(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A ready pod whose Triton holds a live sequence answers healthy on its holding ports
    (the gateway's priority 1) before anything tells it that it left the ready ones: in a
    NewCluster upgrade the gateway may learn of KubeRay's switch of the ready pods' Service
    before the old cluster's pods can (seen: tests/cluster/test_upgrade.py's held sequences
    refused for a round when only a pod the Service no longer listed answered healthy).
    Not once that sequence is idle; and no statistics are read while no gateway checks."""
    monkeypatch.setattr(pod_module, "HOLDING_POLL_S", 0.1)
    stats: dict[str, Any] = {"model_stats": []}
    asked: list[str] = []

    async def scenario() -> list[tuple[str, int]]:
        async with _running_fake_triton([]) as port:
            ready_port, http_port, holding, holding_grpc = free_ports(4)
            await _http_triton(http_port, {("GET", "/v2/models/stats"): stats,
                                           ("GET", "/v2/models/seq/config"): SEQUENCE_CONFIG},
                               asked=asked)
            replica = TritonPod.__new__(TritonPod)
            await TritonPod.__init__(replica, TritonPodArgs(
                triton_address=f"127.0.0.1:{port}", triton_http_address=f"127.0.0.1:{http_port}",
                ready_port=ready_port, holding_port=holding, holding_grpc_port=holding_grpc,
                warmup=WarmupArgs(enabled=False)))
            live = int(time.time() * 1000)
            stats["model_stats"] = [{"name": "seq", "version": "1", "last_inference": live}]
            await asyncio.sleep(0.5)
            unasked = len(asked)
            seen = []

            async def until_answer(step: str, status: int) -> None:
                deadline = time.monotonic() + 10
                got = await asyncio.to_thread(_http_status, holding)
                while got != status and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    got = await asyncio.to_thread(_http_status, holding)
                seen.append((step, got))

            await until_answer("ready, live", 200)
            stats["model_stats"] = [{"name": "seq", "version": "1", "last_inference": live - 5000}]
            await until_answer("ready, idle", 503)
            stats["model_stats"] = [{"name": "seq", "version": "1",
                                     "last_inference": int(time.time() * 1000)}]
            await until_answer("ready, live again", 200)
            assert await replica._readiness.verdict() is None, "the pod stopped being ready"
            assert unasked == 0, f"Triton's statistics read {unasked} times with no gateway"
            return seen

    assert asyncio.run(scenario()) == [("ready, live", 200), ("ready, idle", 503),
                                       ("ready, live again", 200)]


def _http_status(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready",
                                    timeout=1) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, TimeoutError, ConnectionError):
        return 0  # closed, or closing: the replica has gone


def _grpc_check(port: int) -> bytes:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply: bytes = channel.unary_unary(HEALTH_CHECK_PATH)(b"", timeout=5)
        return reply


def test_the_holding_ports_answer_envoys_checks_healthy_only_while_held() -> None:
    """Envoy's HTTP check (any path, 200 or 503) and gRPC check (grpc.health.v1 Check)."""
    http_port, grpc_port = free_ports(2)
    holding = Holding()

    async def scenario() -> list[tuple[int, bytes]]:
        answers = HoldingAnswers(holding)
        await answers.start(http_port, grpc_port)
        seen = []
        try:
            for leaving, live in ((False, []), (True, []), (True, ["seq"]), (False, ["seq"])):
                holding.leaving, holding.live = leaving, live
                seen.append((await asyncio.to_thread(_http_status, http_port),
                             await asyncio.to_thread(_grpc_check, grpc_port)))
        finally:
            await answers.stop()
        return seen

    assert asyncio.run(scenario()) == [(503, NOT_SERVING), (503, NOT_SERVING), (200, SERVING),
                                       (200, SERVING)]


@pytest.mark.parametrize(("idle_ago_s", "leave_wait_s", "checked", "stays_s"), [
    # Bounds far from what the others stay: a busy machine's seconds never blur them.
    (100.0, 30.0, True, (0.0, 5.0)),   # nothing live: it leaves at once, ready no longer
    (0.0, 30.0, True, (1.8, 10.0)),    # live for 2 s (the model's idle time): held that long
    (0.0, 0.5, True, (0.5, 5.0)),      # live longer than it may wait (60 s): it leaves after
    (0.0, 30.0, False, (0.0, 5.0)),    # live, but no gateway checks it (the Serve path)
], ids=["nothing-live", "live-until-idle", "live-past-the-wait", "live-unchecked"])
def test_a_stopping_replica_stays_while_its_triton_holds_a_live_sequence(
        monkeypatch: pytest.MonkeyPatch, idle_ago_s: float, leave_wait_s: float, checked: bool,
        stays_s: tuple[float, float]) -> None:
    """Serve's stop (the replica's __del__): the pod stops being ready, and while a sequence
    model ran a call within its idle time the replica answers healthy on its holding ports,
    up to leave_wait_s, where a gateway checks them; then the ports close."""
    monkeypatch.setattr(pod_module, "HANDOVER_S", 0.0)
    # The stand-in's answer, its times set when the stop begins.
    stats: dict[str, Any] = {"model_stats": []}

    async def scenario() -> tuple[float, list[int], str | None]:
        async with _running_fake_triton([]) as port:
            ready_port, http_port, holding, holding_grpc = free_ports(4)
            await _http_triton(http_port, {("GET", "/v2/models/stats"): stats,
                                           ("GET", "/v2/models/seq/config"): SEQUENCE_CONFIG,
                                           ("GET", "/v2/models/plain/config"): {"name": "p"}})
            replica = TritonPod.__new__(TritonPod)
            await TritonPod.__init__(replica, TritonPodArgs(
                triton_address=f"127.0.0.1:{port}", triton_http_address=f"127.0.0.1:{http_port}",
                ready_port=ready_port, holding_port=holding, holding_grpc_port=holding_grpc,
                leave_wait_s=leave_wait_s, warmup=WarmupArgs(enabled=False)))
            assert await replica._readiness.verdict() is None
            if checked:  # as the gateway's Envoy checks every pod every second
                assert await asyncio.to_thread(_http_status, holding) == 503
            # Live for the whole test where the replica must give up waiting.
            last = int((time.time() + (60 if leave_wait_s < 1 else -idle_ago_s)) * 1000)
            stats["model_stats"] = [{"name": "seq", "version": "1", "last_inference": last},
                                    {"name": "plain", "version": "1", "last_inference": last}]
            started = time.monotonic()
            leaving = replica.__del__()
            assert leaving is not None
            stop = asyncio.ensure_future(leaving)
            answers = []
            while checked and not stop.done():  # asking would be a check
                answers.append(await asyncio.to_thread(_http_status, holding))
                await asyncio.sleep(0.2)
            await stop
            took = time.monotonic() - started
            return took, answers, await replica._readiness.verdict()

    took, answers, readiness = asyncio.run(scenario())
    assert stays_s[0] <= took <= stays_s[1], f"the replica stayed {took:.1f} s"
    assert readiness is not None, "a stopping replica's pod still answered ready"
    if idle_ago_s < 1 and checked:
        assert 200 in answers, f"the holding port never answered healthy: {answers}"
    else:
        assert 200 not in answers, f"a replica holding nothing answered healthy: {answers}"
