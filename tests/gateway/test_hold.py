"""SONIC_RAY_HOLD_S (docs/admission.md) on a gateway of its own (tests/support/lone_gateway.py:
the shipped config as `make local` writes it with the hold on, before a stand-in Triton the
test lists and unlists as the headless Service would): while no Triton is ready a job start
(gRPC RepositoryIndex and ServerReady, HTTP /v2/health/ready) is held, a second at a time;
once a Triton is listed it passes to it; when the hold runs out it gets the gate's answer
saying so, with when to retry. Inference calls are never held. The same through a whole stack,
with pods starting on demand: tests/stack/test_zero.py."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from local_stack.polling import until
from tests.support.lone_gateway import LoneGateway, lone_gateway

pytestmark = pytest.mark.processes

HOLD_S = 6
RETRY_AFTER_S = 5
# The gateway's words when the hold ran out (gateway/client-checks.lua).
HELD = f"held {HOLD_S} s (SONIC_RAY_HOLD_S)"
# The cluster whose calls time the hold, a second each (gateway/envoy.yaml, hold-timer).
TIMER = "cluster.hold-timer.upstream_rq_total"


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoneGateway]:
    with lone_gateway(tmp_path_factory.mktemp("hold") / "gateway", {
        "SONIC_RAY_HOLD_S": str(HOLD_S), "SONIC_RAY_RETRY_AFTER_S": str(RETRY_AFTER_S),
    }) as lone:
        yield lone


@dataclass
class Ended:
    status: str
    message: str = ""
    trailers: dict[str, str] | None = None
    took_s: float = 0.0


def _grpc(lone: LoneGateway, rpc: str) -> Ended:
    started = time.monotonic()
    with grpc.insecure_channel(lone.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = {"RepositoryIndex": service_pb2.RepositoryIndexRequest,
                   "ServerReady": service_pb2.ServerReadyRequest,
                   "ModelInfer": lambda: service_pb2.ModelInferRequest(model_name="any")}[rpc]()
        try:
            getattr(stub, rpc)(request, timeout=HOLD_S + 20)
            return Ended("OK", took_s=time.monotonic() - started)
        except grpc.RpcError as error:
            return Ended(error.code().name, error.details() or "",  # type: ignore[attr-defined]
                         {k: str(v) for k, v in error.trailing_metadata() or ()},  # type: ignore[attr-defined]
                         time.monotonic() - started)


def _timer_calls(lone: LoneGateway) -> int:
    url = f"http://127.0.0.1:{lone.settings.gateway_admin_port}/stats?filter=^{TIMER}$"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return int(text.split(":")[1]) if ":" in text else 0


def _unlisted(lone: LoneGateway) -> None:
    lone.list_triton(False)
    until("the gateway to list no Triton",
          lambda: _grpc(lone, "ModelInfer").status == "UNAVAILABLE" or "still listed", 30,
          every_s=0.2)


def _in_background(call: Callable[[], Ended]) -> tuple[threading.Thread, list[Ended]]:
    ended: list[Ended] = []
    thread = threading.Thread(target=lambda: ended.append(call()), daemon=True)
    thread.start()
    return thread, ended


@pytest.mark.parametrize("rpc", ["RepositoryIndex", "ServerReady"])
def test_a_job_start_held_while_no_triton_is_ready_passes_once_one_is(held: LoneGateway,
                                                                      rpc: str) -> None:
    _unlisted(held)
    timed = _timer_calls(held)
    thread, ended = _in_background(lambda: _grpc(held, rpc))
    until("the job start to be held a second", lambda: _timer_calls(held) > timed or ended, 10,
          every_s=0.1)
    assert not ended, f"answered without a hold: {ended}"
    held.list_triton(True)
    thread.join(HOLD_S + 20)
    assert ended and ended[0].status == "OK", ended
    if rpc == "RepositoryIndex":  # (the hold's own checks ask ServerReady)
        assert held.seen.headers_of(f"/{rpc}"), f"the held {rpc} never reached the Triton"


@pytest.mark.parametrize("rpc", ["RepositoryIndex", "ServerReady"])
def test_a_job_start_held_until_the_hold_runs_out_gets_the_gates_answer(held: LoneGateway,
                                                                        rpc: str) -> None:
    _unlisted(held)
    timed = _timer_calls(held)
    ended = _grpc(held, rpc)
    assert ended.status == "CANCELLED" and HELD in ended.message, ended
    assert (ended.trailers or {}).get("grpc-retry-pushback-ms") == str(RETRY_AFTER_S * 1000), \
        ended
    # Held a second at a time for the whole hold, not answered at once.
    assert _timer_calls(held) - timed >= HOLD_S - 1, (_timer_calls(held) - timed, ended)


def test_over_http_the_hold_ends_in_503_with_when_to_retry(held: LoneGateway) -> None:
    _unlisted(held)
    status, headers, body = held.http("/v2/health/ready")
    assert status == 503 and HELD in body, (status, body)
    assert {k.lower(): v for k, v in headers.items()}["retry-after"] == str(RETRY_AFTER_S), \
        headers


def test_inference_is_never_held(held: LoneGateway) -> None:
    _unlisted(held)
    timed = _timer_calls(held)
    ended = _grpc(held, "ModelInfer")
    assert ended.status == "UNAVAILABLE" and "no Triton is ready" in ended.message, ended
    assert _timer_calls(held) == timed, "an inference call waited on the hold's timer"
