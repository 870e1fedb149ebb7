"""What the stacks say while a Serve application is not RUNNING (local_stack/ray_cluster.py,
applications_running): Serve's own words on the application and on each deployment, its
target and running replicas, so that a wait that times out (an upgrade's pending cluster in
tests/cluster/test_upgrade.py, a stack's start) says what Serve was doing."""

from __future__ import annotations

from typing import Any

import pytest

from local_stack import ray_cluster


def _answer(apps: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_cluster, "http", lambda *args, **kwargs: {"applications": apps})


def test_an_application_not_running_is_said_with_serves_words(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _answer({"triton": {"status": "DEPLOYING", "message": "", "deployments": {"TritonPod": {
        "status": "UPSCALING", "target_num_replicas": 3, "message": "Upscaling from 2 to 3.",
        "replicas": [{"state": "RUNNING"}, {"state": "RUNNING"}, {"state": "STARTING"}]}}}},
        monkeypatch)
    said = ray_cluster.applications_running("http://ray", "token")
    assert said == ("triton DEPLOYING: TritonPod UPSCALING (target 3, running 2) "
                    "Upscaling from 2 to 3."), said


def test_every_application_running_is_true_and_none_is_said(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _answer({"triton": {"status": "RUNNING"}}, monkeypatch)
    assert ray_cluster.applications_running("http://ray", "token") is True
    _answer({}, monkeypatch)
    assert ray_cluster.applications_running("http://ray", "token") == "no application"
