"""The warm-up's calls built from a model's config as Triton reports it, its rules for models it
skips, fails or outwaits, and the pod's readiness endpoint (serve/triton_pod/warmup.py,
pod_ready.py): our code alone, so Triton's answers are stand-ins here; tests/stack/test_warmup.py
runs it against real Tritons."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from local_stack.ports import free_ports
from triton_pod.pod import TritonPodArgs
from triton_pod.pod_ready import READY_PATH, PodReadiness
from triton_pod.warmup import (
    ModelWarmup,
    WarmupArgs,
    WarmupError,
    batch_sizes,
    instances,
    plan,
    warm_up,
)

BATCHING = {
    "name": "jets", "backend": "onnxruntime", "max_batch_size": 32,
    "input": [
        {"name": "points", "data_type": "TYPE_FP32", "dims": [-1, 3]},
        {"name": "mask", "data_type": "TYPE_BOOL", "dims": [-1]},
        {"name": "flavour", "data_type": "TYPE_INT8", "dims": [4]},
        {"name": "label", "data_type": "TYPE_STRING", "dims": [1]},
        {"name": "extra", "data_type": "TYPE_FP32", "dims": [2], "optional": True},
    ],
    "dynamic_batching": {"preferred_batch_size": [8, 16, 64]},
    "instance_group": [{"count": 2, "kind": "KIND_GPU", "gpus": [0]},
                       {"count": 1, "kind": "KIND_CPU"}],
}


def _split(body: bytes, header_length: int | None) -> tuple[dict[str, Any], dict[str, bytes]]:
    assert header_length is not None
    header = json.loads(body[:header_length])
    blobs, at = {}, header_length
    for tensor in header["inputs"]:
        size = tensor["parameters"]["binary_data_size"]
        blobs[tensor["name"]] = body[at:at + size]
        at += size
    assert at == len(body), "the body's length is not the header's and the tensors'"
    return header, blobs


def test_a_batching_model_is_warmed_at_each_batch_size_its_batcher_forms() -> None:
    assert batch_sizes(BATCHING) == [1, 8, 16, 32]  # 64 is above max_batch_size
    assert batch_sizes({"max_batch_size": 0}) == [None]
    assert instances(BATCHING) == 3
    warm = plan(BATCHING, WarmupArgs(rounds=3, variable_dim=5))
    assert warm.skip is None and warm.rounds == 3 and warm.instances == 3
    shapes = []
    for request in warm.requests:
        header, blobs = _split(*request.body())
        by_name = {t["name"]: t for t in header["inputs"]}
        assert "extra" not in by_name, "an optional input was sent"
        assert header["parameters"] == {"binary_data_output": True}
        batch = by_name["points"]["shape"][0]
        shapes.append(batch)
        assert by_name["points"]["shape"] == [batch, 5, 3]
        assert by_name["points"]["datatype"] == "FP32"
        assert by_name["label"]["datatype"] == "BYTES"
        assert len(blobs["points"]) == batch * 5 * 3 * 4
        assert len(blobs["mask"]) == batch * 5
        assert len(blobs["label"]) == batch * (4 + 8)
    assert shapes == [1, 8, 16, 32]


def test_random_data_fills_each_datatypes_range_never_zeros() -> None:
    config = {"name": "m", "max_batch_size": 0, "input": [
        {"name": name, "data_type": f"TYPE_{name}", "dims": [4096]}
        for name in ("INT8", "UINT16", "INT64", "FP16", "FP64", "BF16", "BOOL")]}
    _, blobs = _split(*plan(config, WarmupArgs()).requests[0].body())
    int8 = np.frombuffer(blobs["INT8"], "<i1")
    assert int8.min() < -100 and int8.max() > 100, "INT8 does not span its range"
    assert np.frombuffer(blobs["UINT16"], "<u2").max() > 60000
    int64 = np.frombuffer(blobs["INT64"], "<i8")
    assert int64.min() < -(1 << 60) and int64.max() > 1 << 60
    for name, kind in (("FP16", "<f2"), ("FP64", "<f8")):
        values = np.frombuffer(blobs[name], kind)
        assert values.min() >= 0 and values.max() <= 1 and np.count_nonzero(values) > 4000, name
    bf16 = np.frombuffer(blobs["BF16"], "<u2").astype(np.uint32) << 16
    assert 0 < bf16.view(np.float32).max() < 1
    assert set(np.frombuffer(blobs["BOOL"], np.uint8)) == {0, 1}


def test_a_sequence_model_starts_and_ends_a_sequence_of_its_own_per_call() -> None:
    config = {"name": "rnn", "max_batch_size": 4, "sequence_batching": {},
              "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}]}
    ids = set()
    warm = plan(config, WarmupArgs())
    assert len(warm.requests) == 2  # batch sizes 1 and 4
    for request in warm.requests:
        for _ in range(3):  # the same request sent again, as to each instance
            header, _ = _split(*request.body())
            assert header["parameters"]["sequence_start"] is True
            assert header["parameters"]["sequence_end"] is True
            ids.add(header["parameters"]["sequence_id"])
    assert len(ids) == 6, ids


@pytest.mark.parametrize(("config", "args", "why"), [
    ({"name": "m", "model_warmup": [{"name": "w"}]}, WarmupArgs(), "model_warmup"),
    ({"name": "m", "platform": "ensemble"}, WarmupArgs(), "ensemble"),
    ({"name": "m", "model_transaction_policy": {"decoupled": True}}, WarmupArgs(), "decoupled"),
    ({"name": "m"}, WarmupArgs(models={"m": ModelWarmup(enabled=False)}), "turned off"),
    ({"name": "m"}, WarmupArgs(enabled=False), "turned off"),
])
def test_what_is_not_warmed_says_why(config: dict[str, Any], args: WarmupArgs,
                                     why: str) -> None:
    warm = plan(config, args)
    assert warm.skip is not None and why in warm.skip and warm.requests == ()


def test_a_sites_sample_request_is_sent_in_place_of_random_data() -> None:
    sample = {"inputs": [{"name": "INDEX", "shape": [1], "datatype": "INT32", "data": [2]}]}
    warm = plan({"name": "picky", "input": [{"name": "INDEX", "data_type": "TYPE_INT32",
                                             "dims": [1]}],
                 "instance_group": [{"count": 4, "kind": "KIND_CPU"}]},
                WarmupArgs(models={"picky": ModelWarmup(rounds=5, sample_request=sample)}))
    assert [r.body() for r in warm.requests] == [(json.dumps(sample).encode(), None)]
    assert (warm.rounds, warm.instances) == (5, 4)


def test_a_shape_tensor_needs_a_sample_request() -> None:
    with pytest.raises(ValueError, match="shape tensor: give a sample_request"):
        plan({"name": "m", "input": [{"name": "s", "data_type": "TYPE_INT32", "dims": [2],
                                      "is_shape_tensor": True}]}, WarmupArgs())


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="on_failure"):
        TritonPodArgs.model_validate({"warmup": {"on_failure": "ignore"}})
    with pytest.raises(ValidationError, match="rounds"):
        TritonPodArgs.model_validate({"warmup": {"models": {"m": {"rounds": 0}}}})
    with pytest.raises(ValidationError, match="extra_forbidden"):
        TritonPodArgs.model_validate({"warmup": {"round": 2}})


CONFIGS: dict[str, dict[str, Any]] = {
    "fine": {"name": "fine", "max_batch_size": 0, "instance_group": [{"count": 2}],
             "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}]},
    "picky": {"name": "picky", "max_batch_size": 0,
              "input": [{"name": "x", "data_type": "TYPE_INT32", "dims": [1]}]},
    "hangs": {"name": "hangs", "max_batch_size": 0,
              "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}]},
    "ensemble": {"name": "ensemble", "platform": "ensemble"},
}


def _run(models: list[str], args: WarmupArgs) -> tuple[Any, list[tuple[str, Any, Any]],
                                                       list[str]]:
    reports: list[tuple[str, Any, Any]] = []
    posted: list[str] = []

    async def config_of(model: str) -> dict[str, Any]:
        return CONFIGS[model]

    async def post(path: str, body: bytes, length: int | None,
                   timeout_s: float) -> tuple[int, bytes]:
        posted.append(path)
        if "hangs" in path:
            await asyncio.sleep(3600)
        if "picky" in path:
            return 400, b'{"error": "INDEX must lie in [0, 4)"}'
        return 200, b""

    outcome = asyncio.run(warm_up(models, config_of, post, args,
                                  lambda m, s, e: reports.append((m, s, e))))
    return outcome, reports, posted


def test_a_failed_model_is_said_and_counted_and_the_pod_joins_by_default() -> None:
    outcome, reports, posted = _run(["ensemble", "fine", "picky"], WarmupArgs())
    assert set(outcome.seconds) == {"fine"}
    assert "INDEX must lie in [0, 4)" in outcome.failed["picky"]
    assert "ensemble" in outcome.skipped
    assert posted.count("/v2/models/fine/infer") == 2 * 2  # rounds x instances
    assert [(m, e is not None) for m, _, e in reports] == [("fine", False), ("picky", True)]
    assert "picky FAILED" in outcome.line() and "1 models warm" in outcome.line()


def test_on_failure_fail_refuses_to_start_the_replica() -> None:
    with pytest.raises(WarmupError, match=r"picky FAILED.*on_failure is fail"):
        _run(["fine", "picky"], WarmupArgs(on_failure="fail"))


def test_a_hanging_warm_up_ends_at_its_time_limit() -> None:
    outcome, reports, _ = _run(["fine", "hangs", "picky"], WarmupArgs(timeout_s=0.5))
    assert outcome.timed_out and "fine" in outcome.seconds
    assert "timeout_s" in outcome.failed["hangs"] and "timeout_s" in outcome.failed["picky"]
    assert {m for m, _, e in reports if e} == {"hangs", "picky"}
    assert "time limit reached" in outcome.line()


def _get(port: int, path: str = READY_PATH) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_the_pods_readiness_is_ready_only_while_warm_and_triton_ready() -> None:
    (port,) = free_ports(1)
    triton: list[str | None] = [None]

    async def triton_ready() -> str | None:
        return triton[0]

    async def scenario() -> list[tuple[int, str]]:
        readiness = PodReadiness(triton_ready)
        await readiness.start(port)
        seen = [await asyncio.to_thread(_get, port)]
        readiness.warm = True
        seen.append(await asyncio.to_thread(_get, port))
        triton[0] = "Triton: UNAVAILABLE: connection refused"
        seen.append(await asyncio.to_thread(_get, port))
        seen.append(await asyncio.to_thread(_get, port, "/v2/health/ready"))
        await readiness.stop()
        return seen

    cold, warm, gone, other = asyncio.run(scenario())
    assert cold == (503, "not ready: its models are not warm yet\n")
    assert warm == (200, "ready\n")
    assert gone == (503, "not ready: Triton: UNAVAILABLE: connection refused\n")
    assert other[0] == 404
    with pytest.raises(urllib.error.URLError):
        _get(port)  # nothing answers once the replica has gone
