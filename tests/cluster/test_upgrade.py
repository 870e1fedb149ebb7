"""KubeRay's NewCluster upgrade under load, with a changed model set and a Serve config whose
min_replicas is below what serves the load: the gateway sends calls to the old cluster's
Tritons until KubeRay switches its Services, then to the new cluster's; never to a Triton that
does not serve the model, no call is lost on the way, and the new cluster runs as many Tritons
at the switch as the old one did. Sequences started on the old cluster before the switch keep
reaching the Triton that holds them after it (a pod whose Triton holds live sequences answers
healthy on its holding ports, ready or not: serve/triton_pod/holding.py), and sum right to
their END."""

from __future__ import annotations

import asyncio
import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
from tritonclient.utils import InferenceServerException

from local_stack.harness import (
    serve_config_with,
)
from local_stack.triton import (
    EXAMPLE_MODELS,
    SEQUENCE_MODELS,
    TEST_MODELS,
    merged_model_repository,
)
from local_stack.triton_inputs import simple_inputs, tensor
from tests.gateway.test_sequences import _call as _sequence_call
from tests.support.cluster import OWN_CONNECTION, Calls, Cluster, mixed_load, until

# In the running cluster's model set only; the upgrade drops it.
OLD_ONLY = "simple_identity"
# In the new set only: `simple` under a new name, as a new model version would come.
NEW_ONLY = "simple_new"
SWITCHED = (r"\[cluster\] upgrade: KubeRay's Services select (\S+); Serve replicas running: "
            r"(\d+) there, (\d+) in ")
DONE = r"\[cluster\] upgrade: done; cluster (\S+) deleted$"
# What the stack says while the pending cluster is not yet serving (local_stack/cluster/
# stack.py, _upgrade): the first line a failed switch shows.
UPGRADE_WORD = re.compile(r"\[cluster\] (upgrade: |still waiting for every Serve application)")
# The switch takes 60-120 s here, and KubeRay waits as long as the new cluster needs; a test
# that waits longer fails saying why, before its own limit (TEST_LIMIT_S) ends it unsaid.
SWITCH_WITHIN_S = 600
# The switch, the old cluster's deletion (DONE, 300 s at most) and the checks after it.
TEST_LIMIT_S = SWITCH_WITHIN_S + 400
# The gateway's answer when no Triton is healthy (gateway/envoy.yaml's local reply, in the words
# of gateway/client-checks.lua).
NO_TRITON = "no Triton is ready behind this endpoint"
AIO_STREAM_END = "INTERNAL: Internal error from Core"
# Each caller's pause after a unary call. Both clusters' pods share this machine's 2 cores,
# where on a cluster every pod has CPU of its own: callers back to back starve the new pods'
# Ray dashboard agents, which their raylets give a fixed 15 s to start before aborting (Ray
# issue 65983), so the new cluster would never join. Paced, the load still spans every phase.
PAUSE_S = 0.1
# Sequences started on the old cluster before the upgrade, each called once a round (within
# sequence_sum's 60 s idle time) until every gateway has moved to the new cluster's pods and
# sends their calls to the old ones at priority 1, then ROUNDS_AFTER more, then ended.
HELD_SEQUENCES = 3
ROUNDS_AFTER = 5


def _new_model_set() -> Path:
    repo = merged_model_repository([EXAMPLE_MODELS, TEST_MODELS, SEQUENCE_MODELS])
    shutil.rmtree(repo / OLD_ONLY)
    shutil.copytree(repo / "simple", repo / NEW_ONLY)
    config = repo / NEW_ONLY / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "simple"', f'name: "{NEW_ONLY}"'))
    return repo


async def _caller(cluster: Cluster, model: str, stop: threading.Event, calls: Calls) -> None:
    """Calls `model` in a loop on a connection of its own until `stop`."""
    client = tc_aio.InferenceServerClient(cluster.grpc_url, channel_args=OWN_CONNECTION)
    try:
        while not stop.is_set():
            if model == OLD_ONLY:
                inputs = [tensor("INPUT0", np.array([[b"old"]], dtype=np.object_), "BYTES")]
            else:
                ones = np.ones((1, 16), dtype=np.int32)
                inputs = list(simple_inputs(ones, ones))
            started = time.monotonic()
            try:
                await client.infer(model, inputs, client_timeout=60)
                calls.add(model, started, "OK")
            except InferenceServerException as error:
                calls.add(model, started, f"{error.status()}: {error.message()}")
                await asyncio.sleep(0.05)
            await asyncio.sleep(PAUSE_S)
    finally:
        await client.close()


def _the_gap(kind: str, status: str) -> bool:
    """The gateway's "no Triton is ready": grpc's asyncio client reports it on a stream whose
    requests are still open as INTERNAL "Internal error from Core" (its synchronous client
    shows the UNAVAILABLE Envoy sends)."""
    return NO_TRITON in status or (kind == "stream" and status == AIO_STREAM_END)


class _HeldSequences:
    """Sequences of sequence_sum started before the upgrade (on the old cluster, the only one
    then), called once a round until `moved` and ROUNDS_AFTER rounds more, then ended; every
    running sum checked. A call the gateway answered "no Triton is ready" (the moment a
    gateway pod's whole list is replaced) ran nowhere, and is made again."""

    def __init__(self, cluster: Cluster, stop: threading.Event) -> None:
        self.client = tc.InferenceServerClient(cluster.grpc_url)
        self.stop = stop
        self.moved = threading.Event()
        self.sums: dict[int, int] = {}
        self.wrong: list[str] = []
        self.rounds_after = 0
        self.calls = 0

    def step(self, sequence: int, start: bool = False, end: bool = False) -> None:
        self.sums[sequence] = self.sums.get(sequence, 0) + 1
        for _ in range(50):
            try:
                got = _sequence_call(self.client, sequence, 1, start, end)
            except InferenceServerException as error:
                if NO_TRITON in str(error):
                    time.sleep(0.1)
                    continue
                self.wrong.append(f"sequence {sequence} call {self.sums[sequence]}: {error}")
                return
            self.calls += 1
            if got != self.sums[sequence]:
                self.wrong.append(f"sequence {sequence}: {got}, not {self.sums[sequence]}")
            return
        self.wrong.append(f"sequence {sequence}: no Triton ready for 5 s")

    def run(self) -> None:
        sequences = range(7000, 7000 + HELD_SEQUENCES)
        try:
            for sequence in sequences:
                self.step(sequence, start=True)
            while self.rounds_after < ROUNDS_AFTER and not self.stop.is_set():
                time.sleep(0.3)
                for sequence in sequences:
                    self.step(sequence)
                if self.moved.is_set():
                    self.rounds_after += 1
            for sequence in sequences:
                self.step(sequence, end=True)
        finally:
            self.client.close()


def _held_at_priority_1(cluster: Cluster, old_ips: set[str]) -> object:
    """True once every ready gateway pod's Envoy counts an old cluster's pod healthy at
    priority 1 (holding live sequences: their calls can reach it)."""
    for gateway in cluster.ready_pods("gateway"):
        hosts = cluster.envoy_hosts(gateway, "triton", 1)
        if not any(hosts.get(ip) == [] for ip in old_ips):
            return f"{gateway} lists at priority 1 {hosts}, none of {sorted(old_ips)} healthy"
    return True


def _lists_only(cluster: Cluster, ips: set[str]) -> object:
    """True once every ready gateway pod's Envoy has exactly `ips`, all healthy."""
    for gateway in cluster.ready_pods("gateway"):
        hosts = cluster.envoy_hosts(gateway)
        if {ip for ip, flags in hosts.items() if not flags} != ips or set(hosts) != ips:
            return f"{gateway} has {hosts}, wants {sorted(ips)} healthy"
    return True


@pytest.mark.timeout(TEST_LIMIT_S)
def test_an_upgrade_changing_the_model_set_sends_no_call_to_a_triton_without_the_model(
        cluster: Cluster, tmp_path: Path) -> None:
    old_pods = cluster.settled(3)
    new_repo = _new_model_set()
    # The new cluster may scale down to 1 GPU pod, later, when its queue time says so.
    new_config = serve_config_with(tmp_path, autoscaling={"min_replicas": 1, "max_replicas": 3})
    mark = cluster.line_index()
    common, old_only, new_only = Calls(), Calls(), Calls()
    stop_old, stop_new, stop_all = threading.Event(), threading.Event(), threading.Event()
    timings: dict[str, float] = {}
    problems: list[str] = []
    replicas_at_switch: list[int] = []
    held = _HeldSequences(cluster, stop_all)
    old_ips = {cluster.pod_ip(pod) for pod in old_pods}

    def upgrade() -> list[str]:
        (cluster.pods_dir / "upgrade").write_text(f"MODEL_REPOSITORY={new_repo}\n"
                                                  f"SERVE_CONFIG={new_config}\n")
        try:
            switch = cluster.wait_for(SWITCHED, SWITCH_WITHIN_S, after=mark)
        except TimeoutError:
            said = [line for line in cluster.process.lines[mark:] if UPGRADE_WORD.search(line)]
            pytest.fail(f"KubeRay's Services did not switch within {SWITCH_WITHIN_S}s of the "
                        f"upgrade; the stack's last word on it: {said[-2:]}", pytrace=False)
        timings["switched at"] = time.monotonic()
        replicas_at_switch.extend([int(switch.group(2)), int(switch.group(3))])
        switched_at = time.monotonic()
        stop_old.set()
        new_pods = [m.group(1) for m in (re.match(r"\[cluster\] (triton-\d+): created at ",
                                                  line) for line in cluster.process.lines[mark:])
                    if m]
        ips = {cluster.pod_ip(pod) for pod in new_pods}
        try:
            until("the gateways to list the new cluster's pods only",
                  lambda: _lists_only(cluster, ips), cluster.built_dns_ttl + 30, every_s=0.5)
            timings["switch to new pods only"] = time.monotonic() - switched_at
            until("the old cluster's pods holding sequences to be healthy at priority 1",
                  lambda: _held_at_priority_1(cluster, old_ips), 30, every_s=0.5)
            held.moved.set()
        except TimeoutError as error:
            problems.append(str(error))
        return new_pods

    async def main() -> list[str]:
        stop = asyncio.Event()
        load = asyncio.ensure_future(mixed_load(cluster, stop, common, grpc_clients=2,
                                                 http_clients=1, stream_clients=1,
                                                 pause_s=PAUSE_S))
        old = [asyncio.ensure_future(_caller(cluster, OLD_ONLY, stop_old, old_only))
               for _ in range(2)]
        sequences = asyncio.ensure_future(asyncio.to_thread(held.run))
        await asyncio.sleep(2)
        try:
            new_pods = await asyncio.to_thread(upgrade)
            new = [asyncio.ensure_future(_caller(cluster, NEW_ONLY, stop_new, new_only))
                   for _ in range(2)]
            await asyncio.to_thread(cluster.wait_for, DONE, 300, mark)
            stop_new.set()
            await asyncio.gather(*new)
            return new_pods
        finally:
            stop_old.set()
            stop_new.set()
            stop_all.set()
            stop.set()
            await asyncio.gather(load, *old, sequences)

    new_pods = asyncio.run(main())
    print(f"held sequences: {held.calls} calls, {held.rounds_after} rounds after the move, "
          f"{held.wrong[:3]}")
    switched = timings.pop("switched at", 0.0)
    failed_at = sorted(round(c[1] - switched, 1) for c in common.failed() + new_only.failed())
    print(f"upgrade {old_pods} -> {new_pods}: {common.summary()}; {old_only.summary()}; "
          f"{new_only.summary()}; {timings}; replicas at the switch (new, old) "
          f"{replicas_at_switch}; {len(failed_at)} failed calls, started "
          f"{failed_at[:1]}..{failed_at[-1:]} s after the switch")
    # Capacity: KubeRay switched only once the new cluster ran as many as the old one.
    assert replicas_at_switch[0] >= replicas_at_switch[1] == 3, replicas_at_switch
    # The models of both sets: every call answered through the switch and the deletion, but
    # for the moment each gateway pod's whole list of Tritons is replaced: Envoy takes a new
    # host as unhealthy until its first health check passes (docs/operations.md, Upgrades).
    # Those calls end at once with the gateway's retryable "no Triton is ready"; none hangs,
    # is reset, or reaches a Triton without its model.
    assert common.count("grpc") > 100 and common.count("stream") > 20, common.summary()
    other = [c for c in common.failed() + new_only.failed()
             if not _the_gap(c[0], c[2]) or c[3] > 1.0]
    assert other == [], other[:10]
    # The old set's model until the switch: only the old cluster's Tritons got its calls.
    assert old_only.count() > 50, old_only.summary()
    assert old_only.failed() == [], old_only.failed()[:10]
    # The gateways follow the new cluster within the DNS TTL of the switch.
    assert problems == []
    # The old cluster's sequences, started before the switch: every call right through the
    # switch and after the gateways moved, then ended.
    assert held.wrong == [], held.wrong[:5]
    assert held.rounds_after == ROUNDS_AFTER, held.rounds_after
    # The new set's model once the gateways follow the new cluster: only its Tritons.
    assert new_only.count() > 50, new_only.summary()
    assert set(cluster.ready_pods("triton")) == set(new_pods)
