"""What the API server or the kubelet refuses in a container's spec, caught by `make check`
before a cluster sees it (schema/facts.py: requests-within-limits, named-ports-resolve,
models-read-only). The fixtures in tests/fixtures/invariants/ hold each rule to one built site;
these hold the rules' edges: quantities, extended resources, hooks, the gateway's Services."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from schema.check import DEFAULT_KUBERNETES_VERSION, check_stream
from schema.facts import _quantity, resources_over_limits, unresolved_port_names
from tests.support.kustomize import ROOT, build, objects, stream


@pytest.mark.parametrize(("text", "value"), [
    (4, 4.0), ("500m", 0.5), ("16Gi", 16 * 2.0 ** 30), ("3G", 3e9), ("1e3", 1000.0),
    ("1.5", 1.5), (".5Ki", 512.0)])
def test_quantities_read_as_kubernetes_reads_them(text: Any, value: float) -> None:
    assert _quantity(text) == value


@pytest.mark.parametrize("text", ["four", "16GB", "", "1 Gi", True])
def test_what_is_no_quantity_is_said(text: Any) -> None:
    assert _quantity(text) is None
    assert resources_over_limits({"resources": {"requests": {"memory": text}}}) == [
        f"requests.memory {text!r} is not a quantity"]


@pytest.mark.parametrize(("resources", "refused"), [
    ({"requests": {"cpu": "500m"}, "limits": {"cpu": "1"}}, []),
    ({"requests": {"cpu": "1500m"}, "limits": {"cpu": "1"}},
     ["cpu: requests 1500m above limits 1"]),
    ({"requests": {"memory": "1Gi"}, "limits": {"memory": "1G"}},
     ["memory: requests 1Gi above limits 1G"]),
    ({"limits": {"nvidia.com/gpu": 1}}, []),
    ({"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}, []),
    ({"requests": {"nvidia.com/gpu": 1}},
     ["nvidia.com/gpu: requests 1 but limits none (an extended resource is requested as much "
      "as its limit, or only limited)"]),
    ({"requests": {"nvidia.com/mig-1g.10gb": 1}, "limits": {"nvidia.com/mig-1g.10gb": 2}},
     ["nvidia.com/mig-1g.10gb: requests 1 but limits 2 (an extended resource is requested as "
      "much as its limit, or only limited)"]),
])
def test_requests_within_limits(resources: dict[str, Any], refused: list[str]) -> None:
    assert resources_over_limits({"resources": resources}) == refused


def test_hooks_and_probes_name_their_own_containers_ports() -> None:
    container = {
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"port": "http", "path": "/"}},
        "livenessProbe": {"tcpSocket": {"port": "8000"}},  # a number in a string: a number
        "startupProbe": {"tcpSocket": {"port": "grpc"}},
        "lifecycle": {"preStop": {"httpGet": {"port": "admin"}}},
    }
    assert unresolved_port_names(container) == [
        "startupProbe.tcpSocket.port 'grpc'", "lifecycle.preStop.httpGet.port 'admin'"]


@pytest.mark.processes  # kubectl builds the site
def test_a_gateway_service_naming_no_port_of_the_gateway_is_refused() -> None:
    built = objects(build(ROOT / "overlays" / "nautilus"))
    assert check_stream(stream(built), DEFAULT_KUBERNETES_VERSION)[0] == []
    broken = copy.deepcopy(built)
    (service,) = [o for o in broken if o["kind"] == "Service"
                  and o["metadata"]["name"] == "triton-grpc"]
    service["spec"]["ports"][0]["targetPort"] = "grpcs"
    problems, _ = check_stream(stream(broken), DEFAULT_KUBERNETES_VERSION)
    refused = [p for p in problems if p.startswith("named-ports-resolve: ")]
    assert len(refused) == 1, problems
    assert "Service triton-grpc spec" in refused[0] and "'grpcs'" in refused[0], problems
