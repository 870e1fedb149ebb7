"""Inputs of tritonclient calls, written once for every test and the bench."""

from __future__ import annotations

from typing import Any

import numpy.typing as npt
import tritonclient.grpc as tc


def tensor(name: str, data: npt.NDArray[Any], datatype: str) -> tc.InferInput:
    one = tc.InferInput(name, list(data.shape), datatype)
    one.set_data_from_numpy(data)
    return one


def simple_inputs(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> list[tc.InferInput]:
    """The example model `simple` (triton/models): OUTPUT0 = a + b, OUTPUT1 = a - b, INT32."""
    return [tensor("INPUT0", a, "INT32"), tensor("INPUT1", b, "INT32")]
