"""Every overlay and component builds with real kustomize and passes every check; each
invariant refuses its known-bad fixture, naming the object and field, and passes its
known-good one (gatekeeper-library style: tests/fixtures/invariants/<invariant>/)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from schema.check import DEFAULT_KUBERNETES_VERSION, check_stream, rayservice_violations
from tests.support.kustomize import (
    KUBECTLS,
    OVERLAYS,
    PINNED_KUBECTL,
    ROOT,
    build,
    checked,
    objects,
    stream,
)

FIXTURES = ROOT / "tests" / "fixtures" / "invariants"
INVARIANTS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())


@pytest.fixture(scope="module", autouse=True)
def _builds_in_parallel() -> None:
    """Every build this module asks for, made up front two at a time (kubectl is CPU-bound, the
    machine has two cores); `build` keeps them."""
    dirs = [*OVERLAYS, *(d for invariant in INVARIANTS
                         for d in (FIXTURES / invariant / "allowed", FIXTURES / invariant / "disallowed")),
            *sorted((ROOT / "tests" / "fixtures" / "components").iterdir())]
    jobs = [(d, PINNED_KUBECTL) for d in dirs] + [(o, k) for o in OVERLAYS for k in KUBECTLS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda job: build(*job), jobs))


def rayservice(built: str | list[dict[str, Any]]) -> dict[str, Any]:
    """The build's one RayService, from its text or its objects."""
    (found,) = [o for o in (objects(built) if isinstance(built, str) else built)
                if o["kind"] == "RayService"]
    return found


@pytest.mark.parametrize("kubectl", KUBECTLS, ids=[str(k) for k in KUBECTLS])
@pytest.mark.parametrize("overlay", OVERLAYS, ids=[o.name for o in OVERLAYS])
def test_overlay_builds_and_passes_every_check(overlay: Path, kubectl: Path) -> None:
    built = build(overlay, kubectl)
    problems, rayservices = checked(built)
    assert problems == []
    assert rayservices == 1


@pytest.mark.skipif(len(KUBECTLS) < 2, reason="the machine has no /usr/bin/kubectl")
@pytest.mark.parametrize("overlay", OVERLAYS, ids=[o.name for o in OVERLAYS])
def test_kustomize_5_5_and_5_8_build_the_same(overlay: Path) -> None:
    assert build(overlay, KUBECTLS[0]) == build(overlay, KUBECTLS[1])


def test_the_real_sites_and_local_are_all_there() -> None:
    assert {o.name for o in OVERLAYS} >= {"purdue-af", "nautilus", "local"}


@pytest.mark.parametrize("overlay", ["purdue-af", "nautilus", "local"])
def test_overlays_embed_the_serve_config_of_serve_dir(overlay: str) -> None:
    spec = rayservice(build(ROOT / "overlays" / overlay))["spec"]
    assert spec["serveConfigV2"] == (ROOT / "serve" / "serve-config.yaml").read_text()


@pytest.mark.parametrize("overlay", ["purdue-af", "nautilus", "local"])
def test_gateway_mounts_the_envoy_config_of_gateway_dir(overlay: str) -> None:
    built = objects(build(ROOT / "overlays" / overlay))
    (config,) = [o for o in built if o["kind"] == "ConfigMap"
                 and o["metadata"]["name"].startswith("gateway-envoy-")]
    assert config["data"]["envoy.yaml"] == (ROOT / "gateway" / "envoy.yaml").read_text()
    (gateway,) = [o for o in built if o["kind"] == "Deployment"]
    volumes = gateway["spec"]["template"]["spec"]["volumes"]
    assert {"name": "config", "configMap": {"name": config["metadata"]["name"]}} in volumes
    (client,) = [o for o in built if o["kind"] == "Service" and o["metadata"]["name"] == "triton-grpc"]
    assert client["spec"]["selector"] == gateway["spec"]["selector"]["matchLabels"]
    # What Envoy resolves is KubeRay's headless serve Service (invariant
    # gateway-follows-active-cluster), not the clients' Service.
    assert rayservice(built)["spec"]["serveService"]["metadata"]["name"] == (
        "triton-pods")


def test_forwarder_code_is_mounted_from_a_generated_configmap() -> None:
    built = objects(build(ROOT / "overlays" / "purdue-af"))
    (code,) = [o for o in built if o["kind"] == "ConfigMap"
               and o["metadata"]["name"].startswith("triton-pod-code-")]
    for module in ("__init__.py", "access.py", "rpcs.py", "servicer.py", "pod.py", "grpc_forwarding.py"):
        assert code["data"][module] == (ROOT / "serve" / "triton_pod" / module).read_text()
    cluster = rayservice(built)["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["triton-pod-code"]["configMap"]["name"] == code["metadata"]["name"]
        ray = pod["containers"][0]
        assert {"name": "PYTHONPATH", "value": "/opt/sonic-ray"} in ray["env"]
        assert any(m["mountPath"] == "/opt/sonic-ray/triton_pod" for m in ray["volumeMounts"])
    assert not any(o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("serve-config")
                   for o in built)


def test_purdue_overlay_is_the_site() -> None:
    built = objects(build(ROOT / "overlays" / "purdue-af"))
    assert {o["metadata"].get("namespace") for o in built} == {"cms"}
    service = rayservice(built)["spec"]
    worker = service["rayClusterConfig"]["workerGroupSpecs"][0]
    pod = worker["template"]["spec"]
    triton = pod["containers"][1]
    loads = [a.split("=", 1)[1] for a in triton["args"] if a.startswith("--load-model=")]
    assert len(loads) == 10 and "--model-control-mode=explicit" in triton["args"]
    assert len([a for a in triton["args"] if a.startswith("--model-repository=/cvmfs/")]) == 4
    assert pod["nodeSelector"] == {"cms-af-prod": "true"}
    assert pod["tolerations"][0]["value"] == "cms-af"
    (client,) = [o for o in built if o["kind"] == "Service" and o["metadata"]["name"] == "triton-grpc"]
    assert client["spec"]["type"] == "LoadBalancer"
    assert client["metadata"]["annotations"] == {
        "metallb.universe.tf/address-pool": "geddes-private-pool"}
    assert pod["containers"][0]["image"].startswith(
        "geddes-registry.rcac.purdue.edu/docker-hub-cache/rayproject/ray:2.60.0")
    metrics = [o for o in built if o["kind"] == "Service" and "metrics" in o["metadata"]["name"]]
    assert len(metrics) == 3 and all(o["metadata"]["labels"]["scrape_metrics"] == "true" for o in metrics)
    # Only the metrics Services: a scrape of the clients' ports would fail every interval.
    assert [o["metadata"]["name"] for o in built
            if (o["metadata"].get("labels") or {}).get("scrape_metrics")] == [
        o["metadata"]["name"] for o in metrics]
    # No operator there: the dashboard and the rule file as ConfigMaps, no operator objects.
    assert not [o for o in built if o["apiVersion"].startswith("monitoring.coreos.com/")]
    config_maps = {o["metadata"]["name"]: o for o in built if o["kind"] == "ConfigMap"}
    assert config_maps["sonic-ray-dashboard"]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "sonic-ray.rules.yaml" in config_maps["sonic-ray-alert-rules"]["data"]
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    assert models["persistentVolumeClaim"]["claimName"] == "cvmfs"
    mount = next(m for m in triton["volumeMounts"] if m["name"] == "models")
    assert mount == {"name": "models", "mountPath": "/cvmfs", "readOnly": True,
                     "mountPropagation": "HostToContainer"}


def test_nautilus_overlay_is_the_site() -> None:
    built = objects(build(ROOT / "overlays" / "nautilus"))
    assert any(o["kind"] == "ConfigMap" and o["metadata"]["name"] == "sonic-ray-dashboard"
               and o["metadata"]["labels"].get("grafana_dashboard") == "1" for o in built)
    (ingress,) = [o for o in built if o["kind"] == "Ingress" and o["metadata"]["name"] == "triton-grpc"]
    assert ingress["spec"]["ingressClassName"] == "haproxy"
    assert ingress["metadata"]["annotations"]["haproxy-ingress.github.io/backend-protocol"] == "h2"
    assert ingress["spec"]["rules"][0]["host"] == "sonic-cms.nrp-nautilus.io"
    pod = rayservice(built)["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    spec = pod["template"]["spec"]
    assert spec["nodeSelector"] == {"topology.kubernetes.io/zone": "ucsd"}
    triton = spec["containers"][1]
    assert "--backend-config=onnxruntime,enable-global-threadpool=1" in triton["args"]
    assert not any("RecoEgamma" in a for a in triton["args"])
    assert all("CMSSW_14_1_0_pre7" in a for a in triton["args"] if "model-repository" in a)
    assert triton["resources"]["limits"] == {"cpu": "1", "memory": "3G", "nvidia.com/gpu": 1}
    (ray,) = [c for c in spec["containers"] if c["name"] == "ray-worker"]
    assert ray["resources"]["requests"]["cpu"] == ray["resources"]["limits"]["cpu"] == "1"
    # The head and the gateway in the GPU nodes' zone.
    zone = {"topology.kubernetes.io/zone": "ucsd"}
    head = rayservice(built)["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["template"]["spec"]["nodeSelector"] == zone
    (gateway,) = [o for o in built if o["kind"] == "Deployment"]
    assert gateway["spec"]["template"]["spec"]["nodeSelector"] == zone


def test_optional_components_build_together() -> None:
    built = build(ROOT / "tests" / "fixtures" / "components" / "all-optional")
    problems, _ = checked(built)
    assert problems == []
    triton = rayservice(built)["spec"]["rayClusterConfig"]["workerGroupSpecs"][0][
        "template"]["spec"]["containers"][1]
    assert triton["resources"]["limits"] == {"memory": "16Gi", "nvidia.com/mig-1g.10gb": 1}
    assert triton["resources"]["requests"]["nvidia.com/mig-1g.10gb"] == 1
    assert triton["envFrom"] == [{"secretRef": {"name": "triton-s3-models"}}]
    assert triton["args"] == ["--model-repository=$(MODEL_REPOSITORY_URL)"]
    monitors = {o["metadata"]["name"]: o for o in objects(built) if o["kind"] == "ServiceMonitor"}
    assert sorted(monitors) == ["gateway-metrics", "ray-metrics", "triton-metrics"]
    assert monitors["gateway-metrics"]["spec"]["endpoints"][0]["path"] == "/stats/prometheus"
    (rule,) = [o for o in objects(built) if o["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"] == yaml.safe_load(
        (ROOT / "observability" / "alerts.yaml").read_text())["groups"]


def test_mig_on_a_site_overlay_claims_one_slice_in_requests_and_limits() -> None:
    built = build(ROOT / "tests" / "fixtures" / "components" / "nautilus-mig")
    problems, _ = checked(built)
    assert problems == []
    pod = rayservice(built)["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    (triton,) = [c for c in pod["containers"] if c["name"] == "triton"]
    for kind in ("requests", "limits"):
        claims = {k: v for k, v in triton["resources"][kind].items() if k.startswith("nvidia.com/")}
        assert claims == {"nvidia.com/mig-1g.10gb": 1}, (kind, triton["resources"])
    assert triton["resources"]["limits"]["cpu"] == "1"  # the site's own size stays


def test_a_site_with_an_ingress_switched_to_the_serve_path_passes_every_check() -> None:
    # Seen refused (ingress-backends-resolve): the Ingress named the gateway Service's ports,
    # grpc and http, which KubeRay's serveService calls serve-grpc and serve-http.
    built = build(ROOT / "tests" / "fixtures" / "components" / "nautilus-serve-path")
    problems, _ = checked(built)
    assert problems == []
    backends = [path["backend"]["service"] for o in objects(built) if o["kind"] == "Ingress"
                for rule in o["spec"]["rules"] for path in rule["http"]["paths"]]
    assert backends == [{"name": "triton-grpc", "port": {"number": 8001}},
                        {"name": "triton-grpc", "port": {"number": 8000}}]


def test_the_injected_autoscaler_container_is_checked_for_hardening() -> None:
    """KubeRay adds the autoscaler container from autoscalerOptions; the build has no such
    container, so the check reads autoscalerOptions.securityContext instead."""
    service = rayservice(build(ROOT / "overlays" / "purdue-af"))
    options = service["spec"]["rayClusterConfig"]["autoscalerOptions"]
    assert options["securityContext"]["readOnlyRootFilesystem"] is True
    options["securityContext"]["allowPrivilegeEscalation"] = True
    problems = list(rayservice_violations(service))
    assert any(p.startswith("containers-hardened: ") and
               "autoscalerOptions.securityContext" in p for p in problems), problems


def test_the_gateway_pods_are_checked_for_hardening() -> None:
    built = objects(build(ROOT / "overlays" / "purdue-af"))
    (gateway,) = [o for o in built if o["kind"] == "Deployment"]
    gateway["spec"]["template"]["spec"]["containers"][0]["securityContext"][
        "readOnlyRootFilesystem"] = False
    problems, _ = check_stream(stream(built), DEFAULT_KUBERNETES_VERSION)
    assert any(p.startswith("containers-hardened: ") and "Deployment triton-gateway" in p
               for p in problems), problems


@pytest.mark.parametrize("invariant", INVARIANTS)
def test_known_good_fixture_passes(invariant: str) -> None:
    problems, _ = checked(build(FIXTURES / invariant / "allowed"))
    assert problems == []


@pytest.mark.parametrize("invariant", INVARIANTS)
def test_known_bad_fixture_is_refused_naming_object_and_field(invariant: str) -> None:
    name, field = (FIXTURES / invariant / "disallowed" / "expected").read_text().split("\n")[:2]
    assert name == invariant
    problems, _ = checked(build(FIXTURES / invariant / "disallowed"))
    mine = [p for p in problems if p.startswith(f"{invariant}: ")]
    assert mine, problems
    assert any(field in p and ("RayService " in p or "Service " in p) for p in mine), mine
    assert all("\n" not in p for p in problems)


def test_a_liveness_probe_asking_the_warm_check_is_refused_however_long() -> None:
    # restart-probes-outlast-warmup's other half: no window makes a liveness probe on the warm
    # check safe (a Triton that reloads its models would be restarted).
    built = objects(build(FIXTURES / "restart-probes-outlast-warmup" / "allowed"))
    (service,) = [o for o in built if o["kind"] == "RayService"]
    triton = next(c for c in service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0][
        "template"]["spec"]["containers"] if c["name"] == "triton")
    triton["livenessProbe"] = {**triton.pop("startupProbe"), "failureThreshold": 100000}
    problems, _ = check_stream(stream(built), DEFAULT_KUBERNETES_VERSION)
    mine = [p for p in problems if p.startswith("restart-probes-outlast-warmup: ")]
    assert len(mine) == 1 and "containers[triton].livenessProbe" in mine[0], problems


def test_check_command_prints_a_line_per_violation_and_fails() -> None:
    bad = build(FIXTURES / "ports-separate" / "disallowed")
    result = subprocess.run([sys.executable, "-m", "schema.check", "-"], input=bad, text=True,
                            capture_output=True, cwd=ROOT, timeout=120)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    # Triton's HTTP on Serve's port also leaves the gateway and forwarder dialing 8100.
    assert f"{len(lines)} violation(s)" in result.stderr
    assert all(" RayService cms/triton " in line for line in lines), lines
    assert any(line.startswith("ports-separate: RayService cms/triton ") for line in lines)
    good = build(ROOT / "overlays" / "nautilus")
    result = subprocess.run([sys.executable, "-m", "schema.check", "-"], input=good, text=True,
                            capture_output=True, cwd=ROOT, timeout=120)
    assert (result.returncode, result.stdout) == (0, "")


def test_a_manifest_without_rayservice_is_refused() -> None:
    problems, _ = check_stream("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n",
                               DEFAULT_KUBERNETES_VERSION)
    assert problems == ["rayservice-present: the manifest holds no RayService"]


def test_pinned_kubectl_is_the_one_asked_for() -> None:
    version = subprocess.run([str(PINNED_KUBECTL), "version", "--client"], capture_output=True,
                             text=True, check=True).stdout
    assert "v1.37.1" in version and "v5.8.1" in version


def test_committed_rayservice_schema_is_what_the_generator_makes(tmp_path: Path) -> None:
    committed = (ROOT / "schema" / "generated" / "kuberay-v1.7.0-rayservice.json").read_text()
    out = tmp_path / "schema.json"
    subprocess.run([sys.executable, "-m", "schema.crd_to_jsonschema",
                    "schema/crd/ray.io_rayservices.yaml", "--out", str(out)],
                   cwd=ROOT, check=True, timeout=120)
    assert out.read_text() == committed


def test_committed_kustomize_openapi_is_what_the_generator_makes() -> None:
    from tools.kustomize_openapi import OUT, generate, render

    assert OUT.read_text() == render(generate())


def test_the_gateway_config_is_what_make_gateway_config_writes() -> None:
    from gateway.routes import (
        ENVOY_CONFIG,
        SERVE_CONFIG,
        allowed_admin_rpcs,
        render,
        sequence_retries,
        tries_per_priority,
    )

    text = ENVOY_CONFIG.read_text()
    serve_config = yaml.safe_load(SERVE_CONFIG.read_text())
    assert render(text, allowed_admin_rpcs(serve_config), sequence_retries(serve_config),
                  tries_per_priority(serve_config)) == text


@pytest.mark.parametrize(("max_replicas", "retries"), [(1, 5), (2, 11), (4, 23), (5, 29),
                                                     (17, 101)])
def test_the_gateway_retries_as_often_as_pods_allow_and_no_more(max_replicas: int,
                                                                retries: int) -> None:
    """make gateway-config writes the retries and the retry priority's update frequency from
    Serve's max_replicas: a sequence's call tries twice as many ready pods as there may be,
    then as many pods holding live sequences (in an upgrade, both clusters' pods), with one
    round more at the ready pods for a call whose first round met both priorities
    (tests/gateway/test_sequences.py), and a call every Triton refuses is tried no more often
    than that."""
    from gateway.routes import (
        ENVOY_CONFIG,
        render,
        retry_holders,
        sequence_retries,
        sequence_tries,
        tries_per_priority,
    )

    serve_config = yaml.safe_load((ROOT / "serve" / "serve-config.yaml").read_text())
    serve_config["applications"][0]["deployments"][0]["autoscaling_config"][
        "max_replicas"] = max_replicas
    assert sequence_retries(serve_config) == retries
    written = yaml.safe_load(render(ENVOY_CONFIG.read_text(), [], retries,
                                    tries_per_priority(serve_config)))
    assert set(sequence_tries(written).values()) == {retries + 1}
    frequencies = {holder["retry_policy"]["retry_priority"]["typed_config"]["update_frequency"]
                   for holder in retry_holders(written) if "retry_priority" in
                   holder.get("retry_policy", {})}
    assert frequencies == {2 * max_replicas}


def test_the_tls_secrets_documents_are_what_make_gateway_config_writes() -> None:
    from gateway import tls

    assert tls.main(["--check"]) == 0


@pytest.mark.parametrize("components", [(), ("tls",), ("tls", "mtls")],
                         ids=["clear", "tls", "mtls"])
def test_the_tls_components_pick_a_chain_that_speaks_only_tls(components: tuple[str, ...],
                                                              tmp_path: Path) -> None:
    """As built with the components: the envoy container's SONIC_RAY_TLS picks, on both client
    listeners, a chain with TLS 1.2 at least and h2 for gRPC (in clear without them); only
    with mtls a client certificate is required and verified against the site's CA, and only the
    secrets of the chain in use are asked for."""
    from gateway import tls

    def here(path: Path) -> str:  # Kustomize takes no absolute path to another root
        return os.path.relpath(path, tmp_path)

    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [here(ROOT / "overlays" / "purdue-af")],
        "components": [here(ROOT / "components" / c) for c in components]}))
    built = objects(build(tmp_path))
    (gateway,) = [o for o in built if o["kind"] == "Deployment"
                  and o["metadata"]["name"] == "triton-gateway"]
    (container,) = [c for c in gateway["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "envoy"]
    mode = next((e["value"] for e in container.get("env", []) if e["name"] == tls.TLS_ENV), "")
    assert mode == (tls.MODE_BY_COMPONENT[components[-1]] if components else "")
    (files,) = [o["data"] for o in built if o["kind"] == "ConfigMap"
                and "envoy.yaml" in o.get("data", {})]
    config = yaml.safe_load(files["envoy.yaml"])
    client_certificates = "mtls" in components
    for listener, alpn in tls.ALPN.items():
        chain = tls.selected_chain(config, listener, mode)
        assert chain is not None, (listener, mode)
        if not components:
            assert "transport_socket" not in chain
            continue
        socket = chain["transport_socket"]["typed_config"]
        context = socket["common_tls_context"]
        assert context["tls_params"]["tls_minimum_protocol_version"] == "TLSv1_2"
        assert context["alpn_protocols"] == alpn
        assert socket.get("require_client_certificate", False) is client_certificates
        assert ("validation_context_sds_secret_config" in context) is client_certificates
    chain_name = tls.CHAIN_BY_MODE[mode]
    assert sorted(tls.sds_paths(config, (chain_name,))) == sorted(
        ([tls.SERVER_CERTIFICATE] if components else [])
        + ([tls.CLIENT_CA] if client_certificates else []))


def test_a_site_with_token_checks_ships_its_config_and_settings_to_the_gateway() -> None:
    """Token checks as a site turns them on (tests/fixtures/components/jwt-site): the overlay's
    jwt-authn.yaml in the gateway's ConfigMap, its settings in the envoy container's env."""
    from gateway.jwt import ISSUER_ENV, JWT_AUTHN_FILE, PROVIDER

    site = ROOT / "tests" / "fixtures" / "components" / "jwt-site"
    built = build(site)
    problems, _ = checked(built)
    assert problems == []
    (gateway,) = [o for o in objects(built) if o["kind"] == "Deployment"]
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    config_maps = {o["metadata"]["name"]: o["data"] for o in objects(built)
                   if o["kind"] == "ConfigMap"}
    sources = [s["configMapRef"]["name"] for s in container["envFrom"]]
    assert "https://cms-auth.web.cern.ch/" in [config_maps[s].get(ISSUER_ENV) for s in sources]
    (envoy_files,) = [d for d in config_maps.values() if "envoy.yaml" in d]
    discovered = yaml.safe_load(envoy_files[JWT_AUTHN_FILE])
    assert PROVIDER in discovered["resources"][0]["typed_config"]["providers"]


def test_the_gateway_refuses_a_missing_token_in_the_forwarders_words() -> None:
    from gateway.local import HERE
    from triton_pod.access import UNAUTHENTICATED

    lua = (HERE / "client-checks.lua").read_text()
    assert f'local UNAUTHENTICATED = "{UNAUTHENTICATED}"' in lua


def test_the_envoy_binary_accepts_the_gateway_config() -> None:
    # The shipped config, its mounted files (/etc/envoy) read from gateway/.
    result = subprocess.run([sys.executable, "-m", "gateway.local"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OK" in result.stdout


def test_generator_makes_a_crd_strict_where_it_lists_properties(tmp_path: Path) -> None:
    from schema.crd_to_jsonschema import generate

    crd = {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "things.example.org"},
        "spec": {"group": "example.org", "names": {"kind": "Thing"}, "versions": [{
            "name": "v1", "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                "spec": {"type": "object", "description": "dropped", "properties": {
                    "port": {"x-kubernetes-int-or-string": True},
                    "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                             "properties": {"a": {"type": "string"}}},
                }}}}}}]},
    }
    path = tmp_path / "crd.yaml"
    path.write_text(yaml.safe_dump(crd))
    schema = generate(str(path), "v1")
    spec = schema["properties"]["spec"]
    assert spec["additionalProperties"] is False and "description" not in spec
    assert "additionalProperties" not in spec["properties"]["free"]
    assert spec["properties"]["port"]["anyOf"] == [{"type": "integer"}, {"type": "string"}]
    assert schema["properties"]["kind"] == {"const": "Thing"}
    assert len(schema["x-sha256"]) == 64


def test_triton_prestop_waits_for_discovery_then_while_serve_grpc_listens() -> None:
    import socket
    import time

    pod = rayservice(build(ROOT / "overlays" / "local"))["spec"]["rayClusterConfig"][
        "workerGroupSpecs"][0]["template"]["spec"]
    command = pod["containers"][1]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "/bin/sh"  # exec form, with a shell the Triton image has
    # First a fixed 35 s for the gateway to drop the pod (endpoints, the cluster DNS's TTL,
    # Envoy's refresh); the loop after it is run here as it is, on a port of the test's own.
    script = command[2]
    assert script.startswith("sleep 35; i=35; while [ $i -lt 50 ]")
    listener = socket.socket(socket.AF_INET6)
    listener.bind(("::", 0))
    listener.listen()
    port = listener.getsockname()[1]
    loop = script.removeprefix("sleep 35; ").replace(":2328 ", f":{port:04X} ").replace("i=35", "i=0")
    waiting = subprocess.Popen([command[0], command[1], loop])
    try:
        time.sleep(1.5)
        assert waiting.poll() is None, "the preStop did not wait while the port listened"
    finally:
        listener.close()
    assert waiting.wait(timeout=5) == 0
    started = time.monotonic()
    subprocess.run([command[0], command[1], loop], check=True, timeout=40)
    assert time.monotonic() - started < 1.5


def test_gateway_pods_spread_over_nodes_at_the_sites_and_share_one_on_kind() -> None:
    for overlay, rule in (("purdue-af", "DoNotSchedule"), ("nautilus", "DoNotSchedule"),
                          ("local", "ScheduleAnyway")):
        (gateway,) = [o for o in objects(build(ROOT / "overlays" / overlay))
                      if o["kind"] == "Deployment" and o["metadata"]["name"] == "triton-gateway"]
        (spread,) = gateway["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert (spread["topologyKey"], spread["whenUnsatisfiable"]) == (
            "kubernetes.io/hostname", rule), overlay


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """Every container of a Deployment's or a RayService's pod templates."""
    if obj["kind"] == "Deployment":
        return list(obj["spec"]["template"]["spec"]["containers"])
    if obj["kind"] == "RayService":
        cluster = obj["spec"]["rayClusterConfig"]
        groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
        return [c for g in groups for c in g["template"]["spec"]["containers"]]
    return []


def test_purdue_pulls_every_docker_hub_image_through_its_cache() -> None:
    built = objects(build(ROOT / "overlays" / "purdue-af"))
    images = {c["image"] for o in built for c in _containers(o)}
    hub = [i for i in images if i.split("/")[0] in ("rayproject", "envoyproxy")]
    assert not hub, f"past the registry cache: {hub}"


def test_nautilus_ingress_keeps_long_channels_and_large_messages_and_serves_http() -> None:
    built = objects(build(ROOT / "overlays" / "nautilus"))
    ingresses = {o["metadata"]["name"]: o for o in built if o["kind"] == "Ingress"}
    grpc, http = ingresses["triton-grpc"], ingresses["triton-http"]
    notes = grpc["metadata"]["annotations"]
    assert notes["haproxy-ingress.github.io/proxy-body-size"] == "2g"
    assert all(notes[f"haproxy-ingress.github.io/timeout-{k}"] == "24h"
               for k in ("client", "server", "tunnel"))
    (path,) = http["spec"]["rules"][0]["http"]["paths"]
    (service,) = [o for o in built if o["kind"] == "Service"
                  and o["metadata"]["name"] == path["backend"]["service"]["name"]]
    (port,) = [p for p in service["spec"]["ports"]
               if p["port"] == path["backend"]["service"]["port"]["number"]]
    assert (path["path"], port["name"]) == ("/v2", "http")


def test_purdue_clients_keep_their_address() -> None:
    (service,) = [o for o in objects(build(ROOT / "overlays" / "purdue-af"))
                  if o["kind"] == "Service" and o["metadata"]["name"] == "triton-grpc"]
    assert service["spec"]["externalTrafficPolicy"] == "Local"


def test_gateway_protects_itself_from_overload_below_its_memory_limit() -> None:
    built = objects(build(ROOT / "overlays" / "purdue-af"))
    (gateway,) = [o for o in built if o["kind"] == "Deployment"
                  and o["metadata"]["name"] == "triton-gateway"]
    (envoy_container,) = gateway["spec"]["template"]["spec"]["containers"]
    limit = envoy_container["resources"]["limits"]["memory"]
    assert limit.endswith("Gi")
    (config_map,) = [o for o in built if o["kind"] == "ConfigMap"
                     and o["metadata"]["name"].startswith("gateway-envoy")]
    overload = yaml.safe_load(config_map["data"]["envoy.yaml"])["overload_manager"]
    monitors = {m["name"]: m["typed_config"] for m in overload["resource_monitors"]}
    heap = monitors["envoy.resource_monitors.fixed_heap"]["max_heap_size_bytes"]
    assert heap < int(limit.removesuffix("Gi")) << 30
    connections = monitors["envoy.resource_monitors.global_downstream_max_connections"]
    assert connections["max_active_downstream_connections"] >= 2000  # many jobs' channels
    actions = {a["name"] for a in overload["actions"]}
    assert {"envoy.overload_actions.reset_high_memory_stream",
            "envoy.overload_actions.stop_accepting_requests"} <= actions


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
