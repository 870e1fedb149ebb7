"""A GPU pod takes client calls only once its models are warm (serve/triton_pod/warmup.py), on a
gateway stack of its own with two simulated pods: `first_slow` takes 3 s on each instance's
first execution and is warmed; `first_slow_cold` is the same model with the warm-up turned off
for it (the defect the warm-up guards against, seen); `picky` answers only an index in [0, 4),
so its warm-up with random data fails, and the pod joins by the shipped rule (`on_failure:
join`), said in the replica's log and counted in the metric."""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from local_stack.harness import RunningStack, running_stack, serve_config_with
from local_stack.polling import until
from local_stack.triton_inputs import tensor
from tests.stack.test_gateway import AUTOSCALING
from tests.stack.test_zero import _listed

MODELS = Path(__file__).resolve().parents[1] / "warmup_models"
FIRST_S = 3.0  # tests/warmup_models/first_slow/config.pbtxt, FIRST_EXECUTION_S
WARM_CALL_S = 1.0
WARMUP = {"rounds": 2, "models": {"first_slow_cold": {"enabled": False}}}


def _config(directory: Path, min_replicas: int) -> Path:
    return serve_config_with(directory, autoscaling={**AUTOSCALING, "min_replicas": min_replicas,
                                                     "max_replicas": 2},
                             args={"warmup": WARMUP})


@pytest.fixture(scope="module")
def warm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    models = tmp_path_factory.mktemp("models")
    shutil.copytree(MODELS / "first_slow", models / "first_slow")
    shutil.copytree(MODELS / "first_slow", models / "first_slow_cold")
    config = models / "first_slow_cold" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "first_slow"',
                                                 'name: "first_slow_cold"'))
    shutil.copytree(MODELS / "picky", models / "picky")
    with running_stack({"TRITONS": "2", "MODEL_REPOSITORY": str(models), "OBSERVE": "1",
                        "SERVE_CONFIG": str(_config(tmp_path_factory.mktemp("serve"), 1))}
                       ) as running:
        yield running


@dataclass
class Call:
    at_s: float
    took_s: float
    error: str | None


def _call(client: tc.InferenceServerClient, model: str) -> Call:
    started = time.monotonic()
    try:
        client.infer(model, [tensor("INPUT0", np.ones((1, 4), np.float32), "FP32")],
                     client_timeout=30)
        return Call(started, time.monotonic() - started, None)
    except InferenceServerException as error:
        return Call(started, time.monotonic() - started, f"{error.status()}: {error.message()}")


def _executed(stack: RunningStack, pod: int, model: str) -> tuple[int, float]:
    """Requests pod `pod`'s Triton ran of `model`, and their compute seconds in all."""
    client = tc.InferenceServerClient(stack.triton_url(pod))
    try:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    finally:
        client.close()
    success = stats["inference_stats"]["success"]
    compute = float(stats["inference_stats"]["compute_infer"].get("ns", 0)) / 1e9
    return int(success.get("count", 0)), compute


def test_no_call_waits_for_a_cold_model_after_the_ready_line_nor_at_a_scale_up(
        warm_stack: RunningStack, tmp_path: Path) -> None:
    url = warm_stack.url("GRPC_PORT")
    first = _listed(warm_stack)
    assert len(first) == 1, f"min_replicas 1: one pod in the rotation, not {first}"
    new = 1 - first[0]
    calls: list[Call] = []
    stop = threading.Event()

    def load() -> None:
        client = tc.InferenceServerClient(url)
        try:
            while not stop.is_set():
                calls.append(_call(client, "first_slow"))
        finally:
            client.close()

    workers = [threading.Thread(target=load) for _ in range(4)]
    for worker in workers:
        worker.start()
    try:
        until("calls through the first pod", lambda: len(calls) >= 40 or len(calls), 60)
        warm_stack.redeploy(_config(tmp_path, 2))  # one pod to two, under load
        until("both pods in the gateway's rotation",
              lambda: _listed(warm_stack) == [0, 1] or _listed(warm_stack), 180)
        warmed, _ = _executed(warm_stack, new, "first_slow")
        until("the new pod to take 40 calls",
              lambda: _executed(warm_stack, new, "first_slow")[0] >= warmed + 40
              or _executed(warm_stack, new, "first_slow"), 60)
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=60)
    errors = [c for c in calls if c.error]
    assert errors == [], errors[:5]
    slow = [round(c.took_s, 2) for c in calls if c.took_s >= WARM_CALL_S]
    print(f"{len(calls)} calls, slowest {max(c.took_s for c in calls):.3f} s")
    assert slow == [], f"{len(slow)} of {len(calls)} calls took {WARM_CALL_S} s or more: {slow}"


def test_with_the_warm_up_off_the_first_call_to_each_pod_is_slow(
        warm_stack: RunningStack) -> None:
    until("both pods in the gateway's rotation",
          lambda: _listed(warm_stack) == [0, 1] or _listed(warm_stack), 240)
    client = tc.InferenceServerClient(warm_stack.url("GRPC_PORT"))
    calls: list[Call] = []


    def one_more() -> object:
        calls.append(_call(client, "first_slow_cold"))
        ran = [_executed(warm_stack, pod, "first_slow_cold")[0] for pod in (0, 1)]
        return all(ran) or f"requests run per pod: {ran}"

    try:
        until("first_slow_cold run on both pods", one_more, 120, every_s=0)
    finally:
        client.close()
    assert [c for c in calls if c.error] == []
    for pod in (0, 1):
        _, compute_s = _executed(warm_stack, pod, "first_slow_cold")
        assert compute_s >= FIRST_S - 0.5, f"pod {pod}'s first execution took {compute_s:.1f} s"
    slow = [c for c in calls if c.took_s >= FIRST_S - 0.5]
    assert len(slow) >= 2, f"no first call to each pod took about {FIRST_S} s: {calls}"


def _prometheus(stack: RunningStack, query: str) -> dict[str, float]:
    encoded = urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(f"http://{stack.url('PROMETHEUS_PORT')}/api/v1/query?{encoded}",
                                timeout=10) as response:
        result = json.load(response)["data"]["result"]
    return {r["metric"].get("model", ""): float(r["value"][1]) for r in result}


def test_a_failed_warm_up_is_said_and_counted_and_the_pod_joins(
        warm_stack: RunningStack) -> None:
    until("both pods in the gateway's rotation",
          lambda: _listed(warm_stack) == [0, 1] or _listed(warm_stack), 240)
    logs = list(warm_stack.process.workdir().glob("ray/session_*/logs/serve/replica_*.log"))
    text = "\n".join(log.read_text(errors="replace") for log in logs)
    assert text.count("warm-up: picky failed") >= 2, f"no failure said in {logs}"
    assert "INDEX must lie in [0, 4)" in text
    assert "warm-up: first_slow_cold skipped: turned off by the site" in text
    until("the failures counted, per pod",
          lambda: _prometheus(warm_stack, "sum by (model) "
                              "(ray_sonic_ray_warmup_failures_total)").get("picky", 0) >= 2
          or _prometheus(warm_stack, "ray_sonic_ray_warmup_failures_total"), 90)
    until("the warm-up's seconds per model",
          lambda: _prometheus(warm_stack, "min by (model) (ray_sonic_ray_warmup_seconds)")
          .get("first_slow", 0) >= FIRST_S - 0.5
          or _prometheus(warm_stack, "ray_sonic_ray_warmup_seconds"), 90)
    # The pod joined by the rule: picky answers what it can, from either pod.
    client = tc.InferenceServerClient(warm_stack.url("GRPC_PORT"))
    try:
        result = client.infer("picky", [tensor("INDEX", np.array([2], np.int32), "INT32")])
        assert result.as_numpy("OUT").tolist() == [2]
    finally:
        client.close()
