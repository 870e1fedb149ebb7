"""Fair share per tenant (gateway/tenant_shares.py) on a gateway of its own (tests/support/
lone_gateway.py: the shipped config as `make local` writes it with bearer tokens whose names are
the tenants and SONIC_RAY_TENANT_SHARES, before a stand-in Triton that answers at once): a
tenant over its share is refused at once, over gRPC and HTTP, in the words and with the retry
hint a client reads, and counted; the other tenants' calls pass meanwhile; a tenant without a
share is never limited; the bucket refills. What a flood costs the others' latency on busy
Tritons crosses components and stays in tests/stack/test_fair_share.py."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.tenant_shares import MAX_FILLS_PER_S
from local_stack.polling import until
from tests.support.callers import counters_after, failures_by_flags, tenant_counters
from tests.support.lone_gateway import LoneGateway, lone_gateway

pytestmark = pytest.mark.processes

TOKENS = {"flood": "tok-flood-41d2", "steady": "tok-steady-8a07", "free": "tok-free-c5e9"}
SHARES = {"flood": 5, "steady": 200}
RETRY_AFTER_S = 3
BURST = 40


@pytest.fixture(scope="module")
def shares(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoneGateway]:
    folder = tmp_path_factory.mktemp("shares")
    tokens = folder / "tokens"
    tokens.write_text("".join(f"{tenant} {token}\n" for tenant, token in TOKENS.items()))
    with lone_gateway(folder / "gateway", {
        "SONIC_RAY_AUTH_TOKENS_FILE": str(tokens),
        "SONIC_RAY_TENANT_SHARES": ";".join(f"{t}={n}" for t, n in SHARES.items()),
        "SONIC_RAY_RETRY_AFTER_S": str(RETRY_AFTER_S),
    }, ready_headers={"authorization": f"Bearer {TOKENS['free']}"}) as lone:
        yield lone


@dataclass
class Ended:
    status: str  # OK or the gRPC status's name
    message: str = ""
    trailers: dict[str, str] | None = None


async def _burst(url: str, tenants: dict[str, int]) -> dict[str, list[Ended]]:
    """Each tenant's calls all at once, each tenant on a channel of its own."""

    async def one(stub: service_pb2_grpc.GRPCInferenceServiceStub, tenant: str) -> Ended:
        try:
            await stub.ModelInfer(service_pb2.ModelInferRequest(model_name="any"), timeout=10,
                                  metadata=(("authorization", f"Bearer {TOKENS[tenant]}"),))
            return Ended("OK")
        except grpc.aio.AioRpcError as error:
            return Ended(error.code().name, error.details() or "",
                         {k: str(v) for k, v in error.trailing_metadata() or ()})

    async def tenant_calls(tenant: str, count: int) -> list[Ended]:
        async with grpc.aio.insecure_channel(url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            await channel.channel_ready()
            return list(await asyncio.gather(*(one(stub, tenant) for _ in range(count))))

    names = list(tenants)
    ended = await asyncio.gather(*(tenant_calls(n, tenants[n]) for n in names))
    return dict(zip(names, ended, strict=True))


def _refilled(shares: LoneGateway) -> object:
    """The flood tenant's bucket full again: a second's worth of its calls all pass."""
    ended = asyncio.run(_burst(shares.grpc, {"flood": 1}))["flood"]
    return ended[0].status == "OK" or ended[0].status


def test_a_tenant_over_its_share_is_refused_at_once_and_the_others_pass(
        shares: LoneGateway) -> None:
    metrics = str(shares.settings.gateway_metrics_port)
    until("the flood tenant's bucket to refill", lambda: _refilled(shares), 10, every_s=0.2)
    before, refused_before = tenant_counters(metrics), failures_by_flags(metrics)
    started = time.monotonic()
    ended = asyncio.run(_burst(shares.grpc, {"flood": BURST, "steady": BURST, "free": BURST}))
    elapsed = time.monotonic() - started
    flood = ended["flood"]
    admitted = [e for e in flood if e.status == "OK"]
    refused = [e for e in flood if e.status != "OK"]
    # A second's worth at once, then a token each 1 / share s (at most every 50 ms).
    refills = math.ceil(elapsed * max(SHARES["flood"], MAX_FILLS_PER_S))
    assert 1 <= len(admitted) <= SHARES["flood"] + refills, (len(admitted), elapsed)
    assert {e.status for e in refused} == {"RESOURCE_EXHAUSTED"}, refused[:3]
    said = f"tenant flood is over its share of {SHARES['flood']} calls/s"
    assert all(said in e.message for e in refused), refused[0].message
    assert {(e.trailers or {}).get("grpc-retry-pushback-ms") for e in refused} == {
        str(RETRY_AFTER_S * 1000)}
    # The others, in the same moment: within a share, or without one.
    assert {e.status for e in ended["steady"] + ended["free"]} == {"OK"}
    calls = {("calls", t, "grpc"): BURST for t in TOKENS} | {
        ("failures", "flood", "grpc"): len(refused)}
    counted = counters_after(metrics, before, calls)
    assert {k: v for k, v in counted.items() if k[0] in ("calls", "failures")} == calls
    refused_now = failures_by_flags(metrics)
    refused_now.subtract(refused_before)
    assert refused_now["flood", "RL"] == len(refused), refused_now


def test_over_http_the_refusal_is_429_in_tritons_error_shape(shares: LoneGateway) -> None:
    until("the flood tenant's bucket to refill", lambda: _refilled(shares), 10, every_s=0.2)
    headers = {"authorization": f"Bearer {TOKENS['flood']}", "content-type": "application/json"}
    answers = [shares.http("/v2/models/any/infer", b"{}", headers) for _ in range(BURST)]
    statuses = [status for status, _, _ in answers]
    assert 200 in statuses and 429 in statuses, statuses
    for status, answer_headers, body in answers:
        if status == 429:
            assert {k.lower(): v for k, v in answer_headers.items()}.get("retry-after") == str(
                RETRY_AFTER_S), answer_headers
            assert "over its share of 5 calls/s" in json.loads(body)["error"], body


def test_an_emptied_bucket_refills(shares: LoneGateway) -> None:
    ended = asyncio.run(_burst(shares.grpc, {"flood": BURST}))["flood"]
    assert "RESOURCE_EXHAUSTED" in {e.status for e in ended}, ended[:3]
    until("a flood call to pass again", lambda: _refilled(shares), 10, every_s=0.05)
