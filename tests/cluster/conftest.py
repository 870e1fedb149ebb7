"""One simulated cluster for every test of this folder (3 GPU pods, 2 gateway pods, the stock
Corefile's 30 s DNS TTL), torn down after the last of them; tests that replace pods leave the
cluster with as many ready pods as they found."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from local_stack.cluster import network, service
from local_stack.cluster.network import PREFIX
from local_stack.harness import serve_config_with
from local_stack.triton import (
    EXAMPLE_MODELS,
    SEQUENCE_MODELS,
    TEST_MODELS,
    merged_model_repository,
)
from tests.support.cluster import Cluster, running_cluster

TRITONS = 3


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.fail("the cluster tests need root (make cluster: network namespaces, iptables)")
    config = serve_config_with(tmp_path_factory.mktemp("serve-config"),
                               autoscaling={"min_replicas": TRITONS, "max_replicas": TRITONS})
    repo = merged_model_repository([EXAMPLE_MODELS, TEST_MODELS, SEQUENCE_MODELS])
    with running_cluster({"TRITONS": str(TRITONS), "GATEWAYS": "2", "SERVE_CONFIG": str(config),
                          "MODEL_REPOSITORY": str(repo)}) as running:
        running.process.wait_for_line(r"service \S+: endpoints \['[\d.]+', '[\d.]+'\]", 60)
        yield running
    assert running.process.process.returncode == 0, "make cluster did not stop cleanly"
    assert leftovers() == [], "make cluster left these behind after SIGTERM"
    # What a killed run leaves, made by hand, is removed by the next run's first step.
    subprocess.run(["ip", "netns", "add", f"{PREFIX}-left-by-a-killed-run"], check=True)
    subprocess.run(["ip", "link", "add", f"{PREFIX}v99", "type", "veth", "peer", "name",
                    f"{PREFIX}v98"], check=True)
    subprocess.run(["iptables", "-w", "-t", "nat", "-N", service.NAT_CHAIN], check=True)
    subprocess.run(["iptables", "-w", "-t", "nat", "-A", "OUTPUT", "-j", service.NAT_CHAIN],
                   check=True)
    assert len(leftovers()) == 4, leftovers()
    network.remove_leftovers()
    service.remove_leftovers()
    assert leftovers() == []


def leftovers() -> list[str]:
    """This simulation's namespaces, links and iptables chains that exist now."""
    found = [f"netns {line.split()[0]}" for line in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.splitlines()
        if line.startswith(f"{PREFIX}-")]
    found += [f"link {name}" for name in subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout.split()
        if name.rstrip(":").split("@")[0].startswith(PREFIX)]
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True).stdout
    found += [f"iptables {line}" for line in rules.splitlines()
              if line.startswith(f":{PREFIX.upper()}-")]
    return found
