"""What the dashboard's and the alerts' tests share: the rules, which metrics an expression
needs, and the values put in for Grafana's variables."""

from __future__ import annotations

import re

import yaml

from observability import dashboard

ALERTS = yaml.safe_load(dashboard.ALERTS.read_text())["groups"][0]["rules"]
# Exported by Triton only on a GPU (docs/user_guide/metrics.md of triton-inference-server/server,
# "GPU Metrics"): the panels that use them cannot return data here.
TRITON_GPU_METRICS = {"nv_gpu_utilization", "nv_gpu_memory_total_bytes",
                      "nv_gpu_memory_used_bytes", "nv_gpu_power_usage", "nv_gpu_power_limit",
                      "nv_energy_consumption"}
# Only in a cluster: kube-state-metrics' (docs/metrics/workload/pod-metrics.md of
# kubernetes/kube-state-metrics).
CLUSTER_METRICS = {"kube_pod_status_phase", "kube_pod_container_resource_requests",
                   "kube_pod_container_status_ready"}
# Grafana's own variables, and what the tests put in for them and for the dashboard's.
SUBSTITUTIONS = {"$__rate_interval": "1m", "$model": ".*", "$pod": ".*"}
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range"}
_COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)(\s*)(?=[0-9(]|max|sum)")


def _metrics(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:nv|ray|envoy|kube)_[a-z_]+)\b", expr))


def _needs(expr: str) -> str:
    metrics = _metrics(expr)
    if metrics & TRITON_GPU_METRICS:
        return "gpu"
    if metrics & CLUSTER_METRICS:
        return "cluster"
    if any(m.startswith("envoy_") for m in metrics):
        return "gateway"
    return "any"
