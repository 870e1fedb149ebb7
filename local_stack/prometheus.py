"""`make observe` and the observability tests: a real Prometheus (Debian's package) scraping
every exporter of the local stack with the jobs named like the cluster's metrics Services (as a
ServiceMonitor names them), and loading the alerts (observability/alerts.yaml)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from local_stack.processes import spawn
from local_stack.settings import ROOT

ALERTS = ROOT / "observability" / "alerts.yaml"
# Fast enough that a test sees rates within seconds; the dashboards use $__rate_interval.
SCRAPE_INTERVAL = "2s"


def binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        raise SystemExit("prometheus is not installed: run `make prometheus` (Debian's package)")
    return found


JOBS = ("triton-metrics", "gateway-metrics", "ray-metrics")


def targets_file(home: Path, job: str) -> Path:
    return home / f"targets-{job}.json"


def config(home: Path) -> dict[str, Any]:
    """Scrape jobs by Service name (triton-metrics, gateway-metrics, ray-metrics), each from a
    file of targets the stack rewrites as pods come and go (Prometheus re-reads it on a change,
    as a ServiceMonitor follows a Service's endpoints)."""
    paths = {"gateway-metrics": "/stats/prometheus"}
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {"job_name": job, "metrics_path": paths.get(job, "/metrics"),
             "file_sd_configs": [{"files": [str(targets_file(home, job))],
                                  "refresh_interval": "5s"}]}
            for job in JOBS
        ],
    }


def write_targets(home: Path, targets: dict[str, list[int]]) -> None:
    """Each job's targets now (a job not given: none), each file replaced by a rename."""
    unknown = set(targets) - set(JOBS)
    if unknown:
        raise ValueError(f"no scrape job {sorted(unknown)}: the jobs are {JOBS}")
    for job in JOBS:
        path = targets_file(home, job)
        staged = path.with_name(path.name + ".new")
        listed = [f"localhost:{port}" for port in sorted(targets.get(job, []))]
        staged.write_text(json.dumps([{"targets": listed}] if listed else []))
        os.replace(staged, path)


def start(targets: dict[str, list[int]], port: int, workdir: Path) -> subprocess.Popen[bytes]:
    home = workdir / "prometheus"
    home.mkdir(parents=True, exist_ok=True)
    write_targets(home, targets)
    config_path = home / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config(home)))
    return spawn([binary(), f"--config.file={config_path}", f"--storage.tsdb.path={home / 'data'}",
                  f"--web.listen-address=0.0.0.0:{port}", "--log.level=warn"],
                 workdir / "prometheus.log", dict(os.environ))
