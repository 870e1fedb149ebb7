"""The dashboard's own model and the rules' promtool tests, without a stack."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml
from grafana_foundation_sdk.models.dashboard import Dashboard

from observability import dashboard
from tests.support.promql import ALERTS, GRAFANA_VARIABLES


def test_committed_dashboard_and_rule_are_what_make_observability_writes() -> None:
    assert dashboard.main(["--check"]) == 0


def test_dashboard_loads_with_the_sdk_model_and_everything_resolves() -> None:
    raw = json.loads(dashboard.DASHBOARD_JSON.read_text())
    model = Dashboard.from_json(raw)
    assert model.uid == dashboard.UID and model.templating.list_val is not None
    variables = {v.name: v for v in model.templating.list_val}
    assert variables["datasource"].type_val == "datasource"
    assert variables["datasource"].query == "prometheus"
    panels = [p for p in raw["panels"] if p["type"] != "row"]
    assert len(panels) == len(dashboard.PANELS)
    assert len({p["id"] for p in raw["panels"]}) == len(raw["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"]))
            assert used <= set(variables) | GRAFANA_VARIABLES, (panel["title"], used)
    for name in ("model", "pod"):
        source = variables[name].datasource
        assert source is not None and source.uid == "${datasource}"


@pytest.mark.processes
def test_promtool_checks_the_rules_and_each_alert_fires_only_where_it_should() -> None:
    for args in (["check", "rules", str(dashboard.ALERTS)],
                 ["test", "rules", str(dashboard.ALERTS.with_name("alerts_test.yaml"))]):
        done = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    tested = yaml.safe_load(dashboard.ALERTS.with_name("alerts_test.yaml").read_text())
    fired = {t["alertname"] for group in tested["tests"] for t in group["alert_rule_test"]
             if t["exp_alerts"]}
    assert fired == {rule["alert"] for rule in ALERTS}


def test_every_alert_says_what_it_is_and_what_to_look_at() -> None:
    for rule in ALERTS:
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 80
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule.get("for"), rule["alert"]
