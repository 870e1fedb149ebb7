"""Pre-warming (serve/triton_pod/prewarm.py, tools/prewarm.py): a request of at least N GPU
pods until a time is read from the ConfigMap's files, held by the autoscaling policy until the
time passes, refused with a clear message when it cannot work, and `make prewarm` checks it
against the deployment's bounds before it writes anything."""

from __future__ import annotations

import logging
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tools import prewarm as command
from triton_pod import prewarm
from triton_pod.autoscaling import TritonQueueTimePolicy
from triton_pod.prewarm import PrewarmError, PrewarmReader, parse, read

REPO = Path(command.__file__).resolve().parent.parent
NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def _request(directory: Path, pods: str, until: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / prewarm.PODS_KEY).write_text(pods)
    (directory / prewarm.UNTIL_KEY).write_text(until)
    return directory


def test_a_request_holds_its_pods_until_its_time_then_nothing() -> None:
    request = parse("2\n", "2026-12-02T13:00:00Z")
    assert request.floor(NOW) == 2
    assert request.floor(NOW + timedelta(hours=1)) == 0
    # Any zone, held in UTC.
    assert parse("1", "2026-12-02T14:00:00+01:00").until == datetime(2026, 12, 2, 13, 0,
                                                                     tzinfo=UTC)


@pytest.mark.parametrize(("pods", "until", "words"), [
    ("0", "2026-12-02T13:00:00Z", "pods='0' is not a whole number of GPU pods of 1 or more"),
    ("two", "2026-12-02T13:00:00Z", "pods='two' is not a whole number"),
    ("-1", "2026-12-02T13:00:00Z", "pods='-1' is not a whole number"),
    ("2", "tomorrow", "until='tomorrow' is not an ISO 8601 time"),
    ("2", "2026-12-02T13:00:00", "until='2026-12-02T13:00:00' has no time zone"),
])
def test_a_request_that_cannot_work_is_refused_naming_the_key(pods: str, until: str,
                                                              words: str) -> None:
    with pytest.raises(PrewarmError, match=words):
        parse(pods, until)


def test_no_configmap_is_no_request_and_half_of_one_is_an_error(tmp_path: Path) -> None:
    assert read(tmp_path / "absent") is None
    assert read(tmp_path) is None
    (tmp_path / prewarm.PODS_KEY).write_text("2")
    with pytest.raises(PrewarmError, match="the ConfigMap has no `until`"):
        read(tmp_path)


def _context(current: int) -> Any:
    return SimpleNamespace(current_num_replicas=current, target_num_replicas=current,
                           aggregated_metrics={}, policy_state={}, current_time=0.0,
                           capacity_adjusted_max_replicas=4)


def test_the_policy_holds_the_request_as_a_floor_and_lets_go_when_it_passes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prewarm, "READ_EVERY_S", 0.0)
    policy = TritonQueueTimePolicy(prewarm_dir=str(tmp_path))
    assert policy(_context(1))[0] == 1  # no request: Serve's decision
    soon = datetime.now(UTC) + timedelta(minutes=2)
    _request(tmp_path, "3", soon.isoformat())
    assert policy(_context(1))[0] == 3
    assert policy.prewarm is not None
    assert policy.prewarm.floor(soon + timedelta(seconds=1)) == 0
    _request(tmp_path, "3", (datetime.now(UTC) - timedelta(seconds=1)).isoformat())
    assert policy(_context(1))[0] == 1  # its time passed: undone without anyone's step


def test_a_bad_request_is_ignored_with_one_error_in_the_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(prewarm, "READ_EVERY_S", 0.0)
    reader = PrewarmReader(_request(tmp_path, "lots", "2026-12-02T13:00:00Z"))
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        for _ in range(3):
            assert reader.floor(NOW) == 0
        assert reader.error is not None
        _request(tmp_path, "2", "2026-12-02T13:00:00Z")
        assert reader.floor(NOW) == 2
    assert caplog.text.count("pre-warm request in") == 1
    assert "pods='lots' is not a whole number" in caplog.text
    assert "pre-warm: at least 2 GPU pod(s) until 2026-12-02T13:00:00+00:00" in caplog.text
    assert reader.error is None


def _make(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-s", "prewarm", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_make_prewarm_writes_a_local_stacks_request(tmp_path: Path) -> None:
    until = (datetime.now(UTC) + timedelta(hours=1)).replace(microsecond=0)
    done = _make("PODS=2", f"UNTIL={until.isoformat()}", f"DIR={tmp_path}")
    assert done.returncode == 0, done.stderr
    assert read(tmp_path) == parse("2", until.isoformat())
    assert "at least 2 GPU pod(s) until" in done.stdout


def test_make_prewarm_prints_the_sites_configmap(tmp_path: Path) -> None:
    until = (datetime.now(UTC) + timedelta(hours=1)).replace(microsecond=0)
    done = _make("PODS=4", f"UNTIL={until.isoformat()}", "OVERLAY=overlays/purdue-af",
                 "DRY_RUN=1")
    assert done.returncode == 0, done.stderr
    config_map = yaml.safe_load(done.stdout)
    assert (config_map["kind"], config_map["metadata"]["name"]) == ("ConfigMap", "prewarm")
    assert config_map["metadata"]["namespace"] == "cms"
    assert parse(config_map["data"]["pods"], config_map["data"]["until"]).pods == 4


@pytest.mark.parametrize(("args", "words"), [
    (("PODS=5", "UNTIL=+1h", "OVERLAY=overlays/purdue-af"), "UNTIL='+1h' is not an ISO 8601"),
    (("PODS=5", "UNTIL=2099-01-01T00:00Z", "OVERLAY=overlays/purdue-af"),
     "PODS=5 is above max_replicas (4)"),
    (("PODS=2", "UNTIL=2020-01-01T00:00Z", "DIR=x"), "UNTIL=2020-01-01T00:00Z is not in the future"),
    (("PODS=0", "UNTIL=2099-01-01T00:00Z", "DIR=x"), "PODS='0' is not a whole number"),
    (("PODS=2", "UNTIL=2099-01-01T00:00Z"), "usage: make prewarm"),
    (("PODS=2", "UNTIL=2099-01-01T00:00Z", "OVERLAY=overlays/nowhere"),
     "OVERLAY=overlays/nowhere is not a directory"),
])
def test_make_prewarm_refuses_what_cannot_work_and_writes_nothing(
        tmp_path: Path, args: tuple[str, ...], words: str) -> None:
    args = tuple(a.replace("DIR=x", f"DIR={tmp_path / 'x'}") for a in args)
    done = _make(*args)
    assert done.returncode != 0
    assert words in done.stdout + done.stderr
    assert not (tmp_path / "x").exists()


def test_the_command_reads_the_bounds_of_the_config_it_is_given(tmp_path: Path) -> None:
    config = yaml.safe_load(command.DEFAULT_SERVE_CONFIG.read_text())
    assert command.bounds(config, "serve-config")[1] == 4
    config["applications"][0]["deployments"][0]["autoscaling_config"]["max_replicas"] = 2
    path = tmp_path / "serve-config.yaml"
    path.write_text(yaml.safe_dump(config))
    done = _make("PODS=3", "UNTIL=2099-01-01T00:00Z", f"DIR={tmp_path / 'x'}",
                 f"SERVE_CONFIG={path}")
    assert "PODS=3 is above max_replicas (2)" in done.stderr


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
