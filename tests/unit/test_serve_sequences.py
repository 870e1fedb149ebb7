"""Sequences on the Serve path (serve/triton_pod/sequences.py): a ModelInfer that a pod's
Triton refuses as a call of a sequence it does not hold is asked of the other replicas, each
once, through Serve's router, and the holder's answer reaches the client; the refusal stands
when no Triton holds it. Here Serve's router and replica context are stand-ins and each pod's
Triton an in-process gRPC server (the thing tested is the forwarder's code); through real Serve
and real Tritons: tests/stack/test_serve_two_pods.py."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from ray import serve

import triton_pod.pod as pod_module
from tests.unit.test_triton_pod import FakeContext, started_forwarder
from triton_pod.http_forwarding import _Copy
from triton_pod.pod import REPLICAS_AGAIN_S, TritonPod, TritonPodArgs
from triton_pod.routing import ASKED, SequenceRouter, asked_of
from triton_pod.rpcs import BY_NAME
from triton_pod.sequences import (
    KEPT_BYTES,
    PICKS_PER_REPLICA,
    SEQUENCE_NOT_HELD,
    Answer,
    held_elsewhere,
)

READY = b"\x08\x01"
REFUSAL = f"inference request for sequence 7 to model 'acc' must specify the {SEQUENCE_NOT_HELD}"


async def _triton(holds: bool, calls: list[str], name: str) -> tuple[grpc.aio.Server, int]:
    """A stand-in Triton that holds sequence 7, or refuses it in Triton's words."""

    async def ready(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return READY

    async def infer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        calls.append(name)
        if not holds:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, REFUSAL)
        context.set_trailing_metadata((("held-by", name),))
        return b"ran:" + request

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService", {
            "ServerReady": grpc.unary_unary_rpc_method_handler(ready),
            "ServerLive": grpc.unary_unary_rpc_method_handler(ready),
            "ModelInfer": grpc.unary_unary_rpc_method_handler(infer)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


class Router:
    """Serve's router as a replica's handle to its own deployment sees it: each question to a
    replica not asked yet, picked at random (as routing.py's SequenceRouter picks), with that
    replica's context current while it answers."""

    def __init__(self, replicas: dict[str, TritonPod]) -> None:
        self.replicas = replicas
        self.current = ""
        self.picks = 0
        # How often Serve's controller was asked how many replicas run.
        self.counted = 0
        self.infer_if_held = SimpleNamespace(remote=self._remote)

    async def _remote(self, *args: Any, **kwargs: Any) -> Answer:
        self.picks += 1
        others = sorted(set(self.replicas) - set(kwargs[ASKED])) or sorted(self.replicas)
        self.current = random.choice(others)
        return await self.replicas[self.current].infer_if_held(*args, **kwargs)

    def context(self) -> SimpleNamespace:
        return SimpleNamespace(replica_tag=self.current, app_name="triton",
                               deployment="TritonPod")


def _on_pods(holder: str | None, scenario: Callable[[Router, list[str]], Awaitable[None]],
             monkeypatch: pytest.MonkeyPatch) -> None:
    """Three pods a, b, c (`holder`'s Triton holds sequence 7), their replicas' handles the
    stand-in router; runs `scenario` with the router and the Tritons' calls in order."""

    async def run() -> None:
        calls: list[str] = []
        servers, replicas = [], {}
        for name in ("a", "b", "c"):
            server, port = await _triton(name == holder, calls, name)
            servers.append(server)
            replicas[name] = await started_forwarder(TritonPodArgs(
                triton_address=f"127.0.0.1:{port}"))
        router = Router(replicas)
        monkeypatch.setattr(serve, "get_replica_context", router.context)
        def running_replicas(app: str, deployment: str) -> int:
            router.counted += 1
            return 3

        monkeypatch.setattr(pod_module, "running_replicas", running_replicas)
        for replica in replicas.values():
            replica._peers = router
        try:
            await scenario(router, calls)
        finally:
            for server in servers:
                await server.stop(None)

    asyncio.run(run())


def test_a_call_of_a_sequence_held_elsewhere_gets_the_holders_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(router: Router, calls: list[str]) -> None:
        router.current = "a"
        context = FakeContext([("x-job", "1")])
        reply = await router.replicas["a"].forward_unary(BY_NAME["ModelInfer"], b"seq", context)
        assert reply.SerializeToString() == b"ran:seq"
        assert context.code is None and context.trailing == [("held-by", "c")]
        # Each Triton ran or refused the call once: never twice, never after the holder.
        assert calls[0] == "a" and calls[-1] == "c" and sorted(calls) == sorted(set(calls))

    _on_pods("c", scenario, monkeypatch)


def test_serves_controller_counts_the_replicas_once_for_many_such_calls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(router: Router, calls: list[str]) -> None:
        for _ in range(5):
            router.current = "a"
            context = FakeContext([])
            reply = await router.replicas["a"].forward_unary(BY_NAME["ModelInfer"], b"seq",
                                                             context)
            assert reply.SerializeToString() == b"ran:seq"
        assert router.counted == 1, f"{router.counted} counts for 5 calls within {REPLICAS_AGAIN_S} s"

    _on_pods("c", scenario, monkeypatch)


def test_a_sequence_no_triton_holds_gets_tritons_refusal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(router: Router, calls: list[str]) -> None:
        router.current = "b"
        context = FakeContext([])
        await router.replicas["b"].forward_unary(BY_NAME["ModelInfer"], b"seq", context)
        assert (context.code, context.details) == (grpc.StatusCode.INVALID_ARGUMENT, REFUSAL)
        assert sorted(calls) == ["a", "b", "c"]

    _on_pods(None, scenario, monkeypatch)


def test_a_call_its_own_triton_runs_asks_no_other_replica(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(router: Router, calls: list[str]) -> None:
        router.current = "a"
        context = FakeContext([])
        reply = await router.replicas["a"].forward_unary(BY_NAME["ModelInfer"], b"x", context)
        assert reply.SerializeToString() == b"ran:x" and calls == ["a"] and router.picks == 0

    _on_pods("a", scenario, monkeypatch)


def test_a_question_goes_to_a_replica_not_asked_yet_and_other_calls_as_serve_routes_them(
        ) -> None:
    """routing.py: Serve's power-of-two-choices router, but a question about a sequence goes
    to a replica not in `asked` (any, when none is left); other requests as Serve sends them."""
    replicas = {name: SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))
                for name in ("a", "b", "c")}
    router = SequenceRouter.__new__(SequenceRouter)
    candidates: Any = list(replicas.values())

    def pending(**kwargs: Any) -> Any:
        return SimpleNamespace(kwargs=kwargs, metadata=SimpleNamespace(multiplexed_model_id=""))

    def chosen(request: Any) -> list[list[str]]:
        ranks = asyncio.run(router.choose_replicas(candidates, request))
        return [[r.replica_id.unique_id for r in rank] for rank in ranks]

    assert chosen(pending(**{ASKED: ["a", "c"]})) == [["b"]]
    assert chosen(pending(**{ASKED: ["a"]})) == [["b", "c"]]
    assert chosen(pending(**{ASKED: ["a", "b", "c"]})) == [["a", "b", "c"]]
    assert asked_of(pending(x=1)) is None and asked_of(None) is None


def test_picks_that_keep_landing_on_asked_replicas_end_with_the_refusal() -> None:
    """Answers that keep saying "asked before" (replicas that went away): the refusal stands
    after a bounded number of questions, never a hang."""
    picks: list[list[str]] = []

    async def ask(asked: list[str]) -> Answer:
        picks.append(asked)
        if len(picks) == 1:
            return Answer("b", code="INVALID_ARGUMENT", details=REFUSAL)
        return Answer("b", asked_before=True)

    assert asyncio.run(held_elsewhere(ask, "a", 3)) is None
    assert len(picks) == PICKS_PER_REPLICA * 3 and picks[-1] == ["a", "b"]


@pytest.mark.parametrize(("chunks", "header_bytes", "kept"), [
    # Triton's JSON request: its parameters name the sequence, or do not.
    ([b'{"parameters": {"sequence_id": 7}, "inputs": []}'], None, True),
    ([b'{"inputs": [{"name": "x", "data": [1]}]}'], None, False),
    # The key split across two chunks of the body.
    ([b'{"parameters": {"sequ', b'ence_id": 7}}'], None, True),
    # Binary tensors: only the JSON header (its length given) is read for the key.
    ([b'{"parameters":{"sequence_id":7}}', b"\x00" * 64], 32, True),
    ([b'{"inputs":[]}', b'"sequence_id"'], 13, False),
    # Past KEPT_BYTES nothing is kept, whatever the header says.
    ([b'{"parameters": {"sequence_id": 7}}', b"\x00" * KEPT_BYTES], None, False),
])
def test_an_http_infer_keeps_its_body_past_its_end_only_when_it_names_a_sequence(
        chunks: list[bytes], header_bytes: int | None, kept: bool) -> None:
    """http_forwarding.py's copy of a body: a plain call keeps nothing while Triton runs it."""
    copy = _Copy(header_bytes)
    for chunk in chunks:
        copy.add(chunk)
    copy.end()
    assert copy.whole is kept
    assert copy.body() == (b"".join(chunks) if kept else b""), "the copy kept the wrong bytes"
