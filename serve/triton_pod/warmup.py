"""Warm-up: a GPU pod takes client calls only once its models are warm.

The first executions of a model on a GPU are slow (TensorRT engines, ONNX Runtime's CUDA
provider, cuDNN's algorithm choice per shape, PyTorch's kernels); Triton's own `model_warmup`
needs the model's config, which a site reading CMSSW's models from CVMFS does not own. So after
its Triton is ready, each replica sends every ready model inferences built from the model's
config as Triton reports it, before the pod is in any rotation (docs/operations.md, "Warm-up"):

- each input of its datatype and shape, a variable dimension (-1) at the site's `variable_dim`,
  with random data in the datatype's range (floats in [0, 1], integers over the whole type,
  strings of random letters), never zeros;
- for a batching model at each batch size its dynamic batcher forms: 1, every
  `preferred_batch_size` and `max_batch_size`;
- `rounds` times per model instance (the calls of a round go at once, so each instance gets one);
- a sequence model's calls each start and end a sequence of their own (an ID of its own).

Skipped, and said: a model whose config has `model_warmup` (Triton warmed it at load), an
ensemble (its composing models are warmed themselves), a decoupled model (Triton's HTTP infer
does not carry it). A site turns the warm-up off per model, sets its rounds, or gives a sample
request (Triton's JSON inference request) for a model that random data cannot satisfy.

A warm-up that fails or hangs: each model's error is logged and counted
(`sonic_ray_warmup_failures`), each call has `call_timeout_s` and the whole warm-up `timeout_s`;
then `on_failure` decides: `join` (the pod joins, the failed models cold) or `fail` (the
replica's start fails with the error, Serve starts another, the pod never takes a call).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger("ray.serve")

# Triton's datatypes (the config's TYPE_* names) as numpy types; BF16 has none (see _tensor).
_NUMPY = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
    "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
    "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
}
STRING_BYTES = 8
_sequence_ids = itertools.count(1 << 40)


class ModelWarmup(BaseModel):
    """One model's warm-up, under `warmup.models.<name>` in the application's args."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="false: this model is not warmed")
    rounds: int | None = Field(None, ge=1, le=100,
                               description="rounds per model instance (default: warmup.rounds)")
    sample_request: dict[str, Any] | None = Field(
        None, description="Triton's JSON inference request (KServe v2: {\"inputs\": [...]}) "
                          "sent in place of random data, rounds x instances times")


class WarmupArgs(BaseModel):
    """`warmup` in the application's args (serve/serve-config.yaml)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="false: no model is warmed (a pod joins cold)")
    rounds: int = Field(2, ge=1, le=100, description="calls per model instance and batch size")
    variable_dim: int = Field(16, ge=1, description="the size given to a variable dimension")
    call_timeout_s: float = Field(60.0, gt=0, description="deadline of one warm-up call")
    timeout_s: float = Field(240.0, gt=0, description="the whole warm-up of one pod")
    on_failure: Literal["join", "fail"] = Field(
        "join", description="a model whose warm-up failed: the pod joins (join) or the "
                            "replica's start fails (fail)")
    models: dict[str, ModelWarmup] = Field(default_factory=dict)

    def of(self, model: str) -> ModelWarmup:
        return self.models.get(model) or ModelWarmup()


class WarmupError(RuntimeError):
    """A warm-up that failed under `on_failure: fail`: the replica does not start."""


@dataclass(frozen=True)
class Request:
    """One warm-up request: a binary-tensor request's JSON header and tensors, or (header
    None) a JSON request as it is."""

    header: dict[str, Any] | None
    payload: bytes

    def body(self) -> tuple[bytes, int | None]:
        """The bytes sent and the JSON header's length (None: all JSON); a sequence model's
        call gets a sequence ID of its own."""
        if self.header is None:
            return self.payload, None
        header = self.header
        if "sequence_id" in header.get("parameters", {}):
            header = {**header, "parameters": {**header["parameters"],
                                               "sequence_id": next(_sequence_ids)}}
        text = json.dumps(header).encode()
        return text + self.payload, len(text)


@dataclass(frozen=True)
class Plan:
    """The calls that warm one model: each of `requests` sent `rounds x instances` times, the
    calls of a round at once; or `skip`, why not."""

    model: str
    requests: tuple[Request, ...] = ()
    instances: int = 1
    rounds: int = 1
    skip: str | None = None


def _datatype(config_type: str) -> str:
    return config_type.removeprefix("TYPE_").replace("STRING", "BYTES")


def _tensor(datatype: str, shape: list[int], rng: np.random.Generator) -> bytes:
    """Random data of `datatype` and `shape` as Triton's binary tensor encoding."""
    count = int(np.prod(shape)) if shape else 1
    if datatype == "BYTES":
        letters = rng.integers(ord("a"), ord("z") + 1, size=(count, STRING_BYTES), dtype=np.uint8)
        return b"".join(STRING_BYTES.to_bytes(4, "little") + row.tobytes() for row in letters)
    if datatype == "BF16":  # the upper half of an FP32 in [0, 1)
        floats = rng.random(count, dtype=np.float32)
        return (floats.view(np.uint32) >> 16).astype("<u2").tobytes()
    kind = _NUMPY.get(datatype)
    if kind is None:
        raise ValueError(f"datatype {datatype} has no random data here; give a sample_request")
    if kind is np.bool_:
        return rng.integers(0, 2, size=count, dtype=np.uint8).tobytes()
    dtype: Any = np.dtype(kind)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        values = rng.integers(info.min, info.max, size=count, dtype=dtype.type, endpoint=True)
        return values.astype(dtype.newbyteorder("<")).tobytes()
    return rng.random(count).astype(dtype.newbyteorder("<")).tobytes()


def batch_sizes(config: dict[str, Any]) -> list[int | None]:
    """The batch sizes a warm-up sends: None for a model that does not batch."""
    most = int(config.get("max_batch_size") or 0)
    if most <= 0:
        return [None]
    preferred = (config.get("dynamic_batching") or {}).get("preferred_batch_size") or []
    return [*sorted({1, most, *(int(size) for size in preferred if 0 < int(size) <= most)})]


def instances(config: dict[str, Any]) -> int:
    """The model's instances, as Triton reports its instance groups (count per GPU listed)."""
    total = 0
    for group in config.get("instance_group") or []:
        count = int(group.get("count") or 1)
        gpus = group.get("gpus") or []
        total += count * (len(gpus) if group.get("kind") == "KIND_GPU" and gpus else 1)
    return max(total, 1)


def random_request(config: dict[str, Any], batch: int | None, variable_dim: int,
                   rng: np.random.Generator) -> Request:
    """One binary-tensor inference request of random data; outputs come back binary too."""
    inputs, blobs = [], []
    for spec in config.get("input") or []:
        if spec.get("optional"):
            continue
        if spec.get("is_shape_tensor"):
            raise ValueError(f"input {spec.get('name')} is a shape tensor: give a sample_request")
        dims = [variable_dim if int(d) < 0 else int(d) for d in spec.get("dims") or []]
        shape = ([batch] if batch is not None else []) + dims
        datatype = _datatype(str(spec.get("data_type", "")))
        blob = _tensor(datatype, shape, rng)
        blobs.append(blob)
        inputs.append({"name": spec["name"], "shape": shape, "datatype": datatype,
                       "parameters": {"binary_data_size": len(blob)}})
    header: dict[str, Any] = {"inputs": inputs,
                              "parameters": {"binary_data_output": True}}
    if config.get("sequence_batching") is not None:
        header["parameters"].update(sequence_id=0, sequence_start=True, sequence_end=True)
    return Request(header, b"".join(blobs))


def plan(config: dict[str, Any], args: WarmupArgs, seed: int = 0) -> Plan:
    """What warms the model whose config Triton reports as `config`."""
    name = str(config.get("name", ""))
    site = args.of(name)
    rounds = site.rounds or args.rounds
    if not args.enabled or not site.enabled:
        return Plan(name, skip="turned off by the site")
    if config.get("model_warmup"):
        return Plan(name, skip="its config has model_warmup: Triton warmed it at load")
    if config.get("platform") == "ensemble":
        return Plan(name, skip="an ensemble: its composing models are warmed themselves")
    if (config.get("model_transaction_policy") or {}).get("decoupled"):
        return Plan(name, skip="decoupled: Triton's HTTP infer does not carry it")
    count = instances(config)
    if site.sample_request is not None:
        sample = json.dumps(site.sample_request).encode()
        return Plan(name, (Request(None, sample),), count, rounds)
    rng = np.random.default_rng(seed)
    requests = tuple(random_request(config, batch, args.variable_dim, rng)
                     for batch in batch_sizes(config))
    return Plan(name, requests, count, rounds)


# (path, body, JSON header length or None, timeout) -> (status, body)
Post = Callable[[str, bytes, int | None, float], Awaitable[tuple[int, bytes]]]


async def run_plan(warm: Plan, post: Post, call_timeout_s: float) -> None:
    """Sends a plan's calls; raises on the first call Triton does not answer 200."""
    path = f"/v2/models/{warm.model}/infer"
    for request in warm.requests:
        for _ in range(warm.rounds):
            bodies = [request.body() for _ in range(warm.instances)]
            answers = await asyncio.gather(*(post(path, body, header_length, call_timeout_s)
                                             for body, header_length in bodies))
            for status, text in answers:
                if status != 200:
                    raise RuntimeError(f"Triton answered {status}: "
                                       f"{text[:300].decode(errors='replace')}")


@dataclass
class Outcome:
    """A pod's warm-up: seconds per model warmed, errors per model, models skipped and why."""

    seconds: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    total_s: float = 0.0
    timed_out: bool = False

    def line(self) -> str:
        parts = [f"{m} {s:.1f} s" for m, s in sorted(self.seconds.items())]
        parts += [f"{m} FAILED ({e})" for m, e in sorted(self.failed.items())]
        parts += [f"{m} skipped ({why})" for m, why in sorted(self.skipped.items())]
        limit = " (time limit reached)" if self.timed_out else ""
        return (f"warm-up: {len(self.seconds)} models warm in {self.total_s:.1f} s{limit}"
                + (f": {'; '.join(parts)}" if parts else ""))


async def warm_up(models: list[str], config_of: Callable[[str], Awaitable[dict[str, Any]]],
                  post: Post, args: WarmupArgs,
                  report: Callable[[str, float | None, str | None], None]) -> Outcome:
    """Warms `models` one after another within `args.timeout_s`; `report(model, seconds,
    error)` as each ends. Raises WarmupError under `on_failure: fail`."""
    outcome = Outcome()
    started = time.monotonic()

    async def each() -> None:
        for model in models:
            began = time.monotonic()
            try:
                warm = plan(await config_of(model), args)
                if warm.skip is not None:
                    outcome.skipped[model] = warm.skip
                    logger.info("warm-up: %s skipped: %s", model, warm.skip)
                    continue
                await run_plan(warm, post, args.call_timeout_s)
            except Exception as error:  # every failure is the rule's to judge
                message = str(error) or type(error).__name__
                outcome.failed[model] = message
                logger.error("warm-up: %s failed after %.1f s: %s", model,
                             time.monotonic() - began, message)
                report(model, None, message)
                continue
            outcome.seconds[model] = time.monotonic() - began
            logger.info("warm-up: %s warm in %.1f s (%d calls)", model, outcome.seconds[model],
                        len(warm.requests) * warm.rounds * warm.instances)
            report(model, outcome.seconds[model], None)

    try:
        await asyncio.wait_for(each(), args.timeout_s)
    except TimeoutError:
        outcome.timed_out = True
        cold = [m for m in models if m not in outcome.seconds and m not in outcome.skipped
                and m not in outcome.failed]
        for model in cold:
            outcome.failed[model] = f"not warm within the warm-up's timeout_s {args.timeout_s:g}"
            report(model, None, outcome.failed[model])
    outcome.total_s = time.monotonic() - started
    logger.info("%s", outcome.line())
    if outcome.failed and args.on_failure == "fail":
        raise WarmupError(f"{outcome.line()}; on_failure is fail: this replica does not start")
    return outcome
