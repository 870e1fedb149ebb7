"""`make observe` and the observability tests: a real Prometheus (Debian's package) scraping
every exporter of the local stack with the jobs named like the cluster's metrics Services (as a
ServiceMonitor names them), and loading the alerts (observability/alerts.yaml)."""

from __future__ import annotations

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


def config(targets: dict[str, list[int]]) -> dict[str, Any]:
    """Scrape jobs by Service name: triton-metrics, gateway-metrics, ray-metrics."""
    paths = {"gateway-metrics": "/stats/prometheus"}
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {"job_name": job, "metrics_path": paths.get(job, "/metrics"),
             "static_configs": [{"targets": [f"localhost:{port}" for port in ports]}]}
            for job, ports in targets.items() if ports
        ],
    }


def start(targets: dict[str, list[int]], port: int, workdir: Path) -> subprocess.Popen[bytes]:
    home = workdir / "prometheus"
    home.mkdir(parents=True, exist_ok=True)
    config_path = home / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config(targets)))
    return spawn([binary(), f"--config.file={config_path}", f"--storage.tsdb.path={home / 'data'}",
                  f"--web.listen-address=0.0.0.0:{port}", "--log.level=warn"],
                 workdir / "prometheus.log", dict(os.environ))
