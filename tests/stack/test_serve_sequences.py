"""Stateful models on the Serve path (`make local DATA_PATH=serve TRITONS=2`): Serve's router
balances each call on its own, and a ModelInfer that reaches a Triton not holding its sequence
is asked of the other replica (serve/triton_pod/sequences.py), so every call of a sequence
runs in the Triton that got its START; calls without a sequence stay balanced. Real Serve, real
Tritons serving tests/sequence_models; Triton's gRPC sequence example clients unchanged.
(HTTP sequences on this path: one pod, or the gateway path; docs/data-paths.md.)"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as tc

from local_stack.harness import RunningStack, processes_left_behind, running_stack, serve_config_with
from local_stack.triton import EXAMPLE_MODELS, merged_model_repository
from local_stack.triton_inputs import simple_inputs
from tests.gateway.test_sequences import CALLS, SEQUENCES, _call
from tests.stack.test_gateway import SEQUENCE_MODELS
from tests.support.examples import SEQUENCE_EXAMPLES, sequence_example_passed

GRPC_EXAMPLES = [example for example in SEQUENCE_EXAMPLES if "_grpc_" in example]


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


@pytest.mark.parametrize("example", GRPC_EXAMPLES)
def test_tritons_grpc_sequence_examples_pass_with_two_pods(serve_two: RunningStack,
                                                             example: str) -> None:
    failed = sequence_example_passed(example, serve_two.url("GRPC_PORT"),
                                     serve_two.url("HTTP_PORT"))
    assert failed is None, f"through Serve (2 pods): {failed}"


def test_interleaved_sequences_are_each_summed_by_the_triton_holding_them(
        serve_two: RunningStack) -> None:
    before = _executions(serve_two, "sequence_sum")
    client = tc.InferenceServerClient(serve_two.url("GRPC_PORT"))
    wrong, sums = [], [0] * SEQUENCES
    try:
        for step in range(CALLS):
            for s in range(SEQUENCES):
                value = 1 + s * 100 + step
                sums[s] += value
                got = _call(client, 7000 + s, value, step == 0, step == CALLS - 1)
                if got != sums[s]:
                    wrong.append(f"sequence {7000 + s} call {step}: {got}, not {sums[s]}")
    finally:
        client.close()
    assert not wrong, f"{len(wrong)} of {SEQUENCES * CALLS} wrong: {wrong[:5]}"
    ran = [after - earlier for after, earlier in
           zip(_executions(serve_two, "sequence_sum"), before, strict=True)]
    assert sum(ran) == SEQUENCES * CALLS and min(ran) > 0, (
        f"each call run once, by both Tritons: {ran}")


def test_calls_without_a_sequence_are_still_balanced_per_call(serve_two: RunningStack) -> None:
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
    assert sum(ran) == calls and min(ran) >= calls // 4, f"calls per Triton: {ran}"
