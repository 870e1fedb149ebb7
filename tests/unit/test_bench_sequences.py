"""make bench-sequences (bench/sequences.py): a short run carries sequences and plain calls
through the gateway and directly with no error, counts the tries a sequence's calls take on two
Tritons (more than one: a call reaching the Triton not holding its sequence is tried on the
other) and none for plain calls, and writes its figures. What the figures are is the bench's
to say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import sequences


@pytest.mark.processes
def test_a_short_run_carries_sequences_and_plain_calls(tmp_path: Path) -> None:
    lines: list[str] = []
    assert sequences.main(["--seconds", "0.5", "--repeats", "1", "--concurrency", "4",
                           "--out", str(tmp_path)], out=lines.append) == 0
    (figures,) = tmp_path.glob("sequences-*.json")
    rows = {(r["kind"], r["path"]): r for r in json.loads(figures.read_text())["rows"]}
    assert set(rows) == {(k, p) for k in sequences.KINDS for p in ("direct", "gateway")}
    assert all(r["rps"] > 0 and r["errors"] == 0 for r in rows.values()), rows
    # Sequences of CALLS calls spread over two Tritons: some calls met the other Triton first.
    assert rows[("sequence", "gateway")]["tries_per_call"] > 1, rows
    assert rows[("plain", "gateway")]["tries_per_call"] == 1, rows
    assert any(line.startswith("c4: Envoy CPU per sequence call") for line in lines), lines


def test_callers_in_flight_must_be_one_or_more() -> None:
    with pytest.raises(SystemExit):
        sequences.main(["--concurrency", "0"])
