"""A leaving pod's holding of live sequences (serve/triton_pod/holding.py, and the replica's stop
in pod.py): which sequences count as live from Triton's statistics, what the holding ports
answer Envoy's checks, and how long a stopping replica stays. Stand-ins for Triton's HTTP
endpoint; the thing tested is our code."""

from __future__ import annotations

import asyncio
import socket
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
    listed,
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


def test_only_a_pod_out_of_the_ready_ones_with_a_live_sequence_is_held() -> None:
    assert Holding().verdict() is not None
    assert Holding(leaving=False, live=["seq"]).verdict() is not None
    assert Holding(leaving=True).verdict() is not None
    assert Holding(leaving=True, live=["seq"]).verdict() is None
    # An upgrade's old cluster: ready, but no longer listed by the ready pods' Service.
    assert Holding(unlisted=True).verdict() is not None
    assert Holding(unlisted=True, live=["seq"]).verdict() is None


@pytest.mark.parametrize(("answer", "expected"), [
    (["127.0.0.1"], True),                # this host's address: listed
    (["192.0.2.7", "127.0.0.1"], True),   # one of several
    (["192.0.2.7", "198.51.100.9"], False),  # other pods' addresses only (TEST-NETs)
    (None, None),                         # the name does not resolve: unknown
], ids=["own", "among-others", "others-only", "unresolved"])
def test_a_pod_is_listed_when_the_service_resolves_to_an_address_of_its_own(
        monkeypatch: pytest.MonkeyPatch, answer: list[str] | None, expected: bool | None) -> None:
    def resolve(name: str, *args: object) -> list[tuple[Any, ...]]:
        assert name == "triton-pods"
        if answer is None:
            raise socket.gaierror(-2, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in answer]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert listed("triton-pods") is expected


def test_a_ready_pod_the_service_stops_listing_is_held_while_its_sequences_live(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A NewCluster upgrade's old cluster: KubeRay switched the ready pods' Service, the replica
    still runs. Once the Service no longer lists the pod, its holding ports answer healthy
    while its Triton holds a live sequence, and not once that sequence is idle; listed again,
    not at all."""
    monkeypatch.setattr(pod_module, "LISTING_POLL_S", 0.1)
    answers: dict[str, bool | None] = {"listed": True}
    monkeypatch.setattr(pod_module, "listed", lambda service: answers["listed"])
    stats: dict[str, Any] = {"model_stats": []}

    async def scenario() -> list[tuple[str, int]]:
        async with _running_fake_triton([]) as port:
            ready_port, http_port, holding, holding_grpc = free_ports(4)
            await _http_triton(http_port, {("GET", "/v2/models/stats"): stats,
                                           ("GET", "/v2/models/seq/config"): SEQUENCE_CONFIG})
            replica = TritonPod.__new__(TritonPod)
            await TritonPod.__init__(replica, TritonPodArgs(
                triton_address=f"127.0.0.1:{port}", triton_http_address=f"127.0.0.1:{http_port}",
                ready_port=ready_port, holding_port=holding, holding_grpc_port=holding_grpc,
                ready_pods_service="triton-pods", warmup=WarmupArgs(enabled=False)))
            seen = []

            async def until_answer(step: str, status: int) -> None:
                deadline = time.monotonic() + 10
                got = await asyncio.to_thread(_http_status, holding)
                while got != status and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    got = await asyncio.to_thread(_http_status, holding)
                seen.append((step, got))

            live = int(time.time() * 1000)
            stats["model_stats"] = [{"name": "seq", "version": "1", "last_inference": live}]
            await until_answer("listed, live", 503)
            answers["listed"] = False
            await until_answer("unlisted, live", 200)
            stats["model_stats"] = [{"name": "seq", "version": "1", "last_inference": live - 5000}]
            await until_answer("unlisted, idle", 503)
            stats["model_stats"] = [{"name": "seq", "version": "1",
                                     "last_inference": int(time.time() * 1000)}]
            await until_answer("unlisted, live again", 200)
            answers["listed"] = None  # DNS gone: counts as listed
            await until_answer("unresolved", 503)
            assert await replica._readiness.verdict() is None, "the pod stopped being ready"
            return seen

    assert asyncio.run(scenario()) == [("listed, live", 503), ("unlisted, live", 200),
                                       ("unlisted, idle", 503), ("unlisted, live again", 200),
                                       ("unresolved", 503)]


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
                                       (503, NOT_SERVING)]


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
