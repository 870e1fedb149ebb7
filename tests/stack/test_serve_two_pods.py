"""The Serve path with two simulated pods (`make local DATA_PATH=serve TRITONS=2`), on one
stack that the tests redeploy as KubeRay applies a changed Serve config:

- Stateful models: Serve's router balances each call on its own, and a ModelInfer or HTTP
  infer that reaches a Triton not holding its sequence is asked of the other replica
  (serve/triton_pod/sequences.py, routed by serve/triton_pod/routing.py), so every call of a
  sequence runs in the Triton that got its START, under concurrent load too; calls without a
  sequence run once each, where Serve sent them. Real Tritons serving tests/sequence_models;
  Triton's sequence example clients unchanged.
- Back-pressure and autoscaling: small limits refuse an overload quickly, and replicas follow
  Triton's queue time up and down without losing a call (the same policy as the gateway's,
  test_gateway.py; its pre-warm request is tested from zero pods in test_zero.py)."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from local_stack.harness import RunningStack, processes_left_behind, running_stack, serve_config_with
from local_stack.triton import EXAMPLE_MODELS, SEQUENCE_MODELS, TEST_MODELS, merged_model_repository
from local_stack.triton_inputs import simple_inputs, tensor
from tests.gateway.test_sequences import CALLS, SEQUENCES, _call
from tests.stack.test_gateway import AUTOSCALING
from tests.support.examples import SEQUENCE_EXAMPLES, sequence_example_passed
from tests.support.load import scale_cycle


@pytest.fixture(scope="module")
def serve_two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    # Both pods holding a replica for the sequence tests, first in this file; the tests after
    # them deploy their own limits.
    config = serve_config_with(tmp_path_factory.mktemp("serve-config"),
                               autoscaling={"min_replicas": 2, "max_replicas": 2})
    models = merged_model_repository([EXAMPLE_MODELS, TEST_MODELS, SEQUENCE_MODELS])
    try:
        with running_stack({"DATA_PATH": "serve", "TRITONS": "2", "SERVE_CONFIG": str(config),
                            "MODEL_REPOSITORY": str(models)}) as running:
            yield running
    finally:
        shutil.rmtree(models, ignore_errors=True)
    assert running.process.process.returncode == 0
    assert not processes_left_behind(running.process)


def _executions(running: RunningStack, model: str) -> list[int]:
    """Each pod's Triton's count of `model`'s successful executions."""
    counts = []
    for pod in (0, 1):
        client = tc.InferenceServerClient(running.triton_url(pod))
        try:
            stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
            counts.append(int(stats["inference_stats"]["success"].get("count", 0)))
        finally:
            client.close()
    return counts


@pytest.mark.parametrize("example", SEQUENCE_EXAMPLES)
def test_tritons_sequence_examples_pass_with_two_pods(serve_two: RunningStack,
                                                        example: str) -> None:
    failed = sequence_example_passed(example, serve_two.url("GRPC_PORT"),
                                     serve_two.url("HTTP_PORT"))
    assert failed is None, f"through Serve (2 pods): {failed}"


# Serve's router places each START by the queues it sees, so now and then a round's
# sequences all start on one Triton (CI, once in a few hundred rounds: [0, 80]); such a round
# leaves one direction of asking untried, and another round is run, this many at most.
ROUNDS = 3


def _concurrent_round(running: RunningStack, protocol: str,
                      first_id: int) -> tuple[list[str], list[int]]:
    """SEQUENCES sequences of CALLS calls from `first_id` on, each on a client of its own, all
    at once: the wrong answers, and the calls each Triton ran."""
    before = _executions(running, "sequence_sum")
    wrong: list[str] = []

    def sequence(s: int) -> None:
        client: tc.InferenceServerClient | th.InferenceServerClient = (
            tc.InferenceServerClient(running.url("GRPC_PORT")) if protocol == "grpc"
            else th.InferenceServerClient(running.url("HTTP_PORT")))
        total = 0
        try:
            for step in range(CALLS):
                value = 1 + s * 100 + step
                total += value
                got = _call(client, first_id + s, value, step == 0, step == CALLS - 1)
                if got != total:
                    wrong.append(f"sequence {first_id + s} call {step}: {got}, not {total}")
        except InferenceServerException as error:
            wrong.append(f"sequence {first_id + s}: {error}")
        finally:
            client.close()

    workers = [threading.Thread(target=sequence, args=(s,)) for s in range(SEQUENCES)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    ran = [after - earlier for after, earlier in
           zip(_executions(running, "sequence_sum"), before, strict=True)]
    return wrong, ran


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_concurrent_sequences_are_each_summed_by_the_triton_holding_them(
        serve_two: RunningStack, protocol: str) -> None:
    """8 sequences of 10 calls, each on a client of its own, all at once: Serve's router
    spreads the calls by the queues it sees, so the sequences start on both Tritons, and each
    later call that meets the other Triton is asked of its holder, which is busy then. Every
    round's calls are each run once and summed right; a round whose sequences all started on
    one Triton is run again with new sequences, until one has both Tritons holding some."""
    base = 7000 if protocol == "grpc" else 8000
    rounds: list[list[int]] = []
    for round_ in range(ROUNDS):
        wrong, ran = _concurrent_round(serve_two, protocol, base + round_ * 100)
        assert not wrong, (f"{protocol}, round {round_ + 1}: {len(wrong)} of "
                           f"{SEQUENCES * CALLS} wrong: {wrong[:5]}")
        assert sum(ran) == SEQUENCES * CALLS, f"each call run once: {ran} per Triton"
        rounds.append(ran)
        if min(ran) > 0:
            break
    assert min(rounds[-1]) > 0, f"sequences on both Tritons in one of {ROUNDS} rounds: {rounds}"


def test_calls_without_a_sequence_each_run_once_where_serve_sent_them(
        serve_two: RunningStack) -> None:
    """Nothing here changes Serve's routing of other calls (which replica is Serve's choice:
    its router favours the replica whose queue it last saw shorter, so sequential calls may
    all go to one); each runs once, in the Triton of the replica Serve picked."""
    before = _executions(serve_two, "simple")
    client = tc.InferenceServerClient(serve_two.url("GRPC_PORT"))
    ones = np.ones((1, 16), dtype=np.int32)
    calls = 200
    try:
        for _ in range(calls):
            client.infer("simple", simple_inputs(ones, ones))
    finally:
        client.close()
    ran = [after - earlier for after, earlier in
           zip(_executions(serve_two, "simple"), before, strict=True)]
    assert sum(ran) == calls, f"calls per Triton: {ran}"


def _slow(seconds: float) -> list[tc.InferInput]:
    return [tensor("SECONDS", np.array([seconds], dtype=np.float32), "FP32")]


def test_overload_is_refused_quickly_not_queued_forever(serve_two: RunningStack,
                                                      tmp_path: Path) -> None:
    serve_two.redeploy(serve_config_with(
        tmp_path, deployment={"max_ongoing_requests": 2, "max_queued_requests": 8,
                              "graceful_shutdown_timeout_s": 20, "health_check_period_s": 2},
        autoscaling={**AUTOSCALING, "min_replicas": 1, "max_replicas": 2}))
    url = serve_two.url("GRPC_PORT")

    async def burst() -> list[tuple[str, float]]:
        client = tc_aio.InferenceServerClient(url)

        async def one() -> tuple[str, float]:
            started = time.monotonic()
            try:
                await client.infer("slow", _slow(3.0), client_timeout=60)
                return "OK", time.monotonic() - started
            except InferenceServerException as error:
                return str(error.status()), time.monotonic() - started

        try:
            return await asyncio.gather(*(one() for _ in range(40)))
        finally:
            await client.close()

    outcomes = asyncio.run(burst())
    refused = [elapsed for status, elapsed in outcomes if status == "StatusCode.RESOURCE_EXHAUSTED"]
    assert refused, outcomes
    assert max(refused) < 3.0, "a refusal waited as long as a call: it was queued"
    assert {status for status, _ in outcomes} <= {"OK", "StatusCode.RESOURCE_EXHAUSTED"}
    assert any(status == "OK" for status, _ in outcomes)


def test_replicas_follow_tritons_queue_time_up_and_down(
    serve_two: RunningStack, tmp_path: Path
) -> None:
    # Room in each replica for more calls than Triton runs at once, so they queue in Triton.
    serve_two.redeploy(serve_config_with(
        tmp_path, deployment={"max_ongoing_requests": 16, "graceful_shutdown_timeout_s": 20,
                              "health_check_period_s": 2},
        autoscaling={**AUTOSCALING, "min_replicas": 1, "max_replicas": 2},
        policy_kwargs={"target_queue_ms_per_exec": 50}))
    timeline, outcomes = scale_cycle(serve_two)
    counts = [count for _, count in timeline]
    assert [s for _, s, _ in outcomes if s != "OK"] == []
    assert counts[0] == 1 and max(counts) == 2, timeline
    assert counts[-1] == 1, f"never scaled back down: {timeline}"


def test_scaled_stack_still_answers(serve_two: RunningStack) -> None:
    assert tc.InferenceServerClient(serve_two.url("GRPC_PORT")).is_server_ready()
