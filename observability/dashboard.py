"""The Grafana dashboard, built with Grafana's own grafana-foundation-sdk from the panel table
below, and the PrometheusRule copied from alerts.yaml: `make observability` writes both
(observability/dashboard.json, components/prometheus-monitors/prometheus-rule.yaml); `make
validate` and the tests refuse committed files that differ.

    python -m observability.dashboard [--check]
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.builders import timeseries as gt
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

from gateway.routes import GRPC_CLUSTER, HTTP_CLUSTER
from tools.generated import write_or_check

HERE = Path(__file__).resolve().parent
DASHBOARD_JSON = HERE / "dashboard.json"
ALERTS = HERE / "alerts.yaml"
PROMETHEUS_RULE = HERE.parent / "components" / "prometheus-monitors" / "prometheus-rule.yaml"
UID = "sonic-ray"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
# Grafana's template variables as the panels use them; the tests substitute these.
TRITON = 'model=~"$model", instance=~"$pod"'
RATE = "[$__rate_interval]"
FORWARDER = 'deployment="TritonPod"'
TRITON_CLUSTERS = f'envoy_cluster_name=~"{GRPC_CLUSTER}|{HTTP_CLUSTER}"'
# The gateway's per-tenant counters (gateway/envoy.yaml, access_log: the stats logger's scope).
TENANT = "envoy_sonic_ray_tenant"


@dataclass(frozen=True)
class Panel:
    row: str
    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str
    # Where the data comes from: "any" data path, "gateway" or "serve" only, or "gpu" (Triton
    # exports these only on a GPU).
    needs: str = "any"


def _per_request(counter: str) -> str:
    return (f"sum by (model) (rate({counter}{{{TRITON}}}{RATE})) / "
            f"sum by (model) (rate(nv_inference_request_success{{{TRITON}}}{RATE})) / 1000")


PANELS: tuple[Panel, ...] = (
    Panel("Calls", "Requests/s per model", "reqps", (
        (f"sum by (model) (rate(nv_inference_request_success{{{TRITON}}}{RATE}))", "{{model}}"),),
        "Successful inferences per second in the selected Tritons."),
    Panel("Calls", "Failures/s by reason", "reqps", (
        (f"sum by (model, reason) (rate(nv_inference_request_failure{{{TRITON}}}{RATE}))",
         "{{model}} {{reason}}"),),
        "Failed inferences: BACKEND (the model raised), REJECTED, CANCELED, OTHER."),
    Panel("Latency", "Time per request by stage", "ms", tuple(
        (_per_request(f"nv_inference_{stage}_duration_us"), "{{model}} " + name)
        for stage, name in (("queue", "queue"), ("compute_input", "input"),
                            ("compute_infer", "infer"), ("compute_output", "output"))),
        "Triton's cumulative duration counters per successful request: waiting in the queue, "
        "copying inputs, running the model, copying outputs."),
    Panel("Batching and queue", "Batch size achieved", "short", (
        (f"sum by (model) (rate(nv_inference_count{{{TRITON}}}{RATE})) / "
         f"sum by (model) (rate(nv_inference_exec_count{{{TRITON}}}{RATE}))", "{{model}}"),),
        "Inferences per model execution: what the dynamic batcher groups."),
    Panel("Batching and queue", "Queue time per execution (the autoscaling signal)", "ms", (
        (f"sum by (instance) (rate(nv_inference_queue_duration_us{{{TRITON}}}{RATE})) / "
         f"sum by (instance) (rate(nv_inference_exec_count{{{TRITON}}}{RATE})) / 1000",
         "{{instance}}"),),
        "What each replica reports to Serve's autoscaler (target_queue_ms_per_exec)."),
    Panel("GPU", "GPU utilisation", "percentunit", (
        ('avg by (instance, gpu_uuid) (nv_gpu_utilization{instance=~"$pod"})',
         "{{instance}} {{gpu_uuid}}"),),
        "Triton's GPU metrics (--allow-gpu-metrics, on by default on a GPU).", needs="gpu"),
    Panel("GPU", "GPU memory used", "percentunit", (
        ('sum by (instance) (nv_gpu_memory_used_bytes{instance=~"$pod"}) / '
         'sum by (instance) (nv_gpu_memory_total_bytes{instance=~"$pod"})', "{{instance}}"),),
        "Share of each GPU's memory in use.", needs="gpu"),
    Panel("Scaling", "Replicas: wanted, target, running", "short", (
        (f"max (ray_serve_autoscaling_desired_replicas{{{FORWARDER}}})", "wanted by the policy"),
        (f"max (ray_serve_autoscaling_target_replicas{{{FORWARDER}}})", "target (min/max bounds)"),
        (f"sum (ray_serve_deployment_replica_healthy{{{FORWARDER}}})", "running and healthy"),
        ("max (ray_sonic_ray_prewarm_pods)", "pre-warm floor (make prewarm)")),
        "One replica per GPU pod: wanted above target means max_replicas holds it back; the "
        "pre-warm floor is an operator's request of at least that many until its time "
        "(docs/operations.md, Pre-warming)."),
    Panel("Scaling", "Warm-up before a pod joins", "s", (
        ("max by (instance) (ray_sonic_ray_warmup_pod_seconds)", "{{instance}} all models"),
        ("max by (model) (ray_sonic_ray_warmup_seconds)", "{{model}} (slowest pod)"),
        ("sum by (model) (ray_sonic_ray_warmup_failures_total)", "{{model}} failed (count)")),
        "Seconds each pod spent warming its models after Triton was ready, before it joined "
        "the rotation, and warm-ups that failed (docs/operations.md, Warm-up)."),
    Panel("Scaling", "GPU pods in the Ray cluster", "short", (
        ('sum (ray_resources{Name="triton"})', "pods with a triton resource"),),
        "Worker pods that joined the Ray cluster (each advertises one `triton` resource)."),
    Panel("Gateway", "Gateway requests/s by protocol", "reqps", (
        (f"sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_total{{{TRITON_CLUSTERS}}}"
         f"{RATE}))", "{{envoy_cluster_name}}"),),
        "Calls Envoy sent to the Tritons: cluster triton is gRPC, triton-http is HTTP/REST.",
        needs="gateway"),
    Panel("Gateway", "Gateway upstream errors/s", "reqps", (
        (f'sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_xx{{{TRITON_CLUSTERS}, '
         f'envoy_response_code_class="5"}}{RATE}))', "{{envoy_cluster_name}} 5xx"),
        (f"sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_cx_connect_fail"
         f"{{{TRITON_CLUSTERS}}}{RATE}))", "{{envoy_cluster_name}} refused connections"),
        (f"sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_cx_none_healthy"
         f"{{{TRITON_CLUSTERS}}}{RATE}))", "{{envoy_cluster_name}} no ready Triton")),
        "Calls that failed between Envoy and the Tritons.", needs="gateway"),
    Panel("Gateway", "Per-Triton balance", "reqps", (
        (f'sum by (instance) (rate(nv_inference_request_success{{instance=~"$pod"}}{RATE}))',
         "{{instance}}"),),
        "Requests each Triton served: an even spread means the balancing works."),
    Panel("Per tenant", "Calls/s per tenant", "reqps", (
        (f"sum by (tenant) (rate({TENANT}_calls{RATE}))", "{{tenant}}"),),
        "Calls through the gateway by the caller's tenant (docs/front-door.md, who called): "
        "refused calls included.", needs="gateway"),
    Panel("Per tenant", "Failures/s per tenant, by Envoy's flags", "reqps", (
        (f"sum by (tenant, flags) (rate({TENANT}_failures{RATE}))", "{{tenant}} {{flags}}"),),
        "Calls that ended with any gRPC status but OK (HTTP: an error status). Flags: RL "
        "refused over the tenant's share (gateway/tenant_shares.py), UH no Triton ready, - "
        "Triton's own answer (a full queue, a bad request); bad credentials show as "
        "anonymous.", needs="gateway"),
    Panel("Per tenant", "Bytes/s per tenant", "Bps", tuple(
        (f"sum by (tenant) (rate({TENANT}_{counter}{RATE}))", "{{tenant}} " + legend)
        for counter, legend in (("bytes_received", "in"), ("bytes_sent", "out"))),
        "Request and response bytes (tensors) through the gateway.", needs="gateway"),
    Panel("Per tenant", "Time per call p50 / p99 per tenant", "ms", tuple(
        (f"histogram_quantile({q}, sum by (tenant, le) (rate({TENANT}_duration_ms_bucket"
         f"{RATE})))", "{{tenant}} p" + str(int(q * 100)))
        for q in (0.5, 0.99)),
        "From the first byte in to the last byte out at the gateway.", needs="gateway"),
    Panel("Serve path", "Serve path requests/s", "reqps", (
        (f"sum by (method) (rate(ray_serve_num_grpc_requests_total{RATE}))", "gRPC {{method}}"),
        (f"sum by (method) (rate(ray_serve_num_http_requests_total{RATE}))", "HTTP {{method}}")),
        "Calls through Serve's proxies (components/serve-path).", needs="serve"),
    Panel("Serve path", "Serve path latency p50 / p99", "ms", tuple(
        (f"histogram_quantile({q}, sum by (le) (rate(ray_serve_{p}_request_latency_ms_bucket"
         f"{RATE})))", f"{p} p{int(q * 100)}")
        for p in ("grpc", "http") for q in (0.5, 0.99)),
        "Latency through Serve's proxies, the forwarder and Triton.", needs="serve"),
)


def _variable(name: str, label: str, query: str) -> gd.QueryVariable:
    return (gd.QueryVariable(name).label(label).datasource(DATASOURCE)
            .query(query).refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True).include_all(True).all_value(".*"))


def build() -> dict[str, Any]:
    board = (gd.Dashboard("sonic-ray: Triton on Ray").uid(UID).tags(["sonic-ray", "triton"])
             .refresh("30s").time("now-1h", "now").editable()
             .with_variable(gd.DatasourceVariable("datasource").label("Prometheus")
                            .type("prometheus"))
             .with_variable(_variable("model", "model",
                                      "label_values(nv_inference_request_success, model)"))
             .with_variable(_variable("pod", "Triton pod",
                                      "label_values(nv_inference_request_success, instance)")))
    row = None
    ids = iter(range(1, 1000))
    for panel in PANELS:
        if panel.row != row:
            row = panel.row
            board = board.with_row(gd.Row(row).id(next(ids)))
        built = (gt.Panel().id(next(ids)).title(panel.title).description(panel.description)
                 .unit(panel.unit).datasource(DATASOURCE).span(12).height(8))
        for index, (expr, legend) in enumerate(panel.queries):
            built = built.with_target(gp.Dataquery().expr(expr).legend_format(legend)
                                      .ref_id(chr(ord("A") + index)))
        board = board.with_panel(built)
    result: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return result


def prometheus_rule() -> dict[str, Any]:
    """The operator's form of alerts.yaml: the same groups, untouched."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "sonic-ray", "labels": {"app.kubernetes.io/name": "sonic-ray"}},
        "spec": {"groups": yaml.safe_load(ALERTS.read_text())["groups"]},
    }


def main(argv: list[str] | None = None) -> int:
    dashboard_text = json.dumps(build(), indent=1, sort_keys=True) + "\n"
    rule_text = ("# Written by `make observability` from observability/alerts.yaml; edit that.\n"
                 "# yamllint disable rule:line-length\n"
                 + yaml.safe_dump(prometheus_rule(), sort_keys=False, width=100))
    code = write_or_check(DASHBOARD_JSON, dashboard_text, argv, __doc__, "make observability")
    return code or write_or_check(PROMETHEUS_RULE, rule_text, argv, __doc__,
                                  "make observability")


if __name__ == "__main__":
    sys.exit(main())
