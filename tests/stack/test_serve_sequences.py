"""Stateful models on the Serve path (`make local DATA_PATH=serve TRITONS=2`): Serve's router
balances each call on its own, and a ModelInfer or HTTP infer that reaches a Triton not holding
its sequence is asked of the other replica (serve/triton_pod/sequences.py, routed by
serve/triton_pod/routing.py), so every call of a sequence runs in the Triton that got its
START, under concurrent load too; calls without a sequence run once each, where Serve sent
them. Real Serve, real Tritons serving tests/sequence_models; Triton's sequence example clients
unchanged."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from local_stack.harness import RunningStack, processes_left_behind, running_stack, serve_config_with
from local_stack.triton import EXAMPLE_MODELS, SEQUENCE_MODELS, merged_model_repository
from local_stack.triton_inputs import simple_inputs
from tests.gateway.test_sequences import CALLS, SEQUENCES, _call
from tests.support.examples import SEQUENCE_EXAMPLES, sequence_example_passed


@pytest.fixture(scope="module")
def serve_two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    config = serve_config_with(tmp_path_factory.mktemp("serve-config"),
                               autoscaling={"min_replicas": 2, "max_replicas": 2})
    models = merged_model_repository([EXAMPLE_MODELS, SEQUENCE_MODELS])
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


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_concurrent_sequences_are_each_summed_by_the_triton_holding_them(
        serve_two: RunningStack, protocol: str) -> None:
    """8 sequences of 10 calls, each on a client of its own, all at once: Serve's router
    spreads the calls by the queues it sees, so the sequences start on both Tritons, and each
    later call that meets the other Triton is asked of its holder, which is busy then."""
    before = _executions(serve_two, "sequence_sum")
    base = 7000 if protocol == "grpc" else 8000
    wrong: list[str] = []

    def sequence(s: int) -> None:
        client: tc.InferenceServerClient | th.InferenceServerClient = (
            tc.InferenceServerClient(serve_two.url("GRPC_PORT")) if protocol == "grpc"
            else th.InferenceServerClient(serve_two.url("HTTP_PORT")))
        total = 0
        try:
            for step in range(CALLS):
                value = 1 + s * 100 + step
                total += value
                got = _call(client, base + s, value, step == 0, step == CALLS - 1)
                if got != total:
                    wrong.append(f"sequence {base + s} call {step}: {got}, not {total}")
        except InferenceServerException as error:
            wrong.append(f"sequence {base + s}: {error}")
        finally:
            client.close()

    workers = [threading.Thread(target=sequence, args=(s,)) for s in range(SEQUENCES)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert not wrong, f"{protocol}: {len(wrong)} of {SEQUENCES * CALLS} wrong: {wrong[:5]}"
    ran = [after - earlier for after, earlier in
           zip(_executions(serve_two, "sequence_sum"), before, strict=True)]
    assert sum(ran) == SEQUENCES * CALLS and min(ran) > 0, (
        f"each call run once, by both Tritons: {ran}")


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
