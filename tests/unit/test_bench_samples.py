"""make bench (bench/data_paths.py) gives no figure measured across a restart: a sample during
which the stack says a process it supervises ended (an Envoy SIGKILLed and started again
counted 0 CPU for every later cell of that run, silently) is said and measured again, and the
bench stops after SAMPLE_TRIES such samples. The stack here is its printed lines: the thing
tested is the bench's rule alone."""

from __future__ import annotations

import pytest

from bench import data_paths
from bench.data_paths import Sample, whole_sample

ENDED = "[local] gateway: Envoy exited with status -9; restarting in 1s"


def _sample(rps: float) -> Sample:
    return Sample(rps, [0.001], 0, 0.1, 0.1, 0.1, 0.1, 0.5)


def test_a_sample_across_a_restart_is_measured_again(capsys: pytest.CaptureFixture[str]) -> None:
    lines = ["[local] ready"]
    taken: list[float] = []

    def sample() -> Sample:
        rps = 100.0 + len(taken)
        taken.append(rps)
        if len(taken) == 1:
            lines.append(ENDED)  # the first sample meets a restart
        return _sample(rps)

    assert whole_sample(lines, sample, "gateway grpc small c=8 through").rps == 101.0
    assert taken == [100.0, 101.0]
    said = capsys.readouterr().out
    assert "ended during the sample" in said and "Envoy exited with status -9" in said


def test_restarts_in_every_sample_stop_the_bench() -> None:
    lines: list[str] = []

    def sample() -> Sample:
        lines.append(ENDED)
        return _sample(1.0)

    with pytest.raises(RuntimeError, match="ended during each of 3 samples"):
        whole_sample(lines, sample, "gateway grpc 16MiB c=8 through")
    assert len(lines) == data_paths.SAMPLE_TRIES


def test_a_quiet_sample_is_taken_once() -> None:
    calls: list[int] = []

    def sample() -> Sample:
        calls.append(1)
        return _sample(5.0)

    assert whole_sample(["[local] ready"], sample, "x").rps == 5.0
    assert calls == [1]
