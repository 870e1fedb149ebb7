"""The GPU pods behind the gateway on the cluster's mechanics: deleted under load with the
stock 30 s DNS TTL, deleted while holding live sequences, unhealthy (stopped), slow, refusing
connections, and vanished."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from local_stack.cluster import manifests
from local_stack.triton_inputs import simple_inputs
from tests.gateway.test_sequences import _call as _sequence_call
from tests.support.cluster import OWN_CONNECTION, Cluster, under_load, until

# The gateway's answer when no Triton is ready (gateway/envoy.yaml's local reply, in the words
# of gateway/client-checks.lua).
NO_TRITON = "no Triton is ready behind this endpoint"


def _tritons(cluster: Cluster) -> list[str]:
    """The three GPU pods, once every gateway pod balances over all of them."""
    return cluster.settled(3)


# Envoy's two clusters of the same pods, each with its own health checks (gateway/envoy.yaml):
# a Triton goes out of (or back into) the gRPC and the HTTP rotation each at its own moment.
CLUSTERS = ("triton", "triton-http")


# A Triton the DNS no longer lists (its pod's readiness failed before Envoy's third missed
# check, as on a busy machine) is out of rotation too.
NOT_LISTED = "(not listed)"


def _host_flags(cluster: Cluster, pod_ip: str) -> list[list[str]]:
    """The health flags each ready gateway pod's Envoy has on the Triton at `pod_ip`, in each
    of its Triton clusters."""
    return [cluster.envoy_hosts(gateway, name).get(pod_ip, [NOT_LISTED])
            for gateway in cluster.ready_pods("gateway") for name in CLUSTERS]


def _healthy_everywhere(cluster: Cluster, ips: list[str]) -> object:
    flags = {ip: _host_flags(cluster, ip) for ip in ips}
    return all(f == [] for per_gateway in flags.values() for f in per_gateway) or flags


@contextmanager
def _stopped(cluster: Cluster, pods: list[str]) -> Iterator[None]:
    """The pods' Tritons frozen (SIGSTOP): connections open, nothing answers."""
    pids = [cluster.pid(pod, "triton") for pod in pods]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        ips = [cluster.pod_ip(pod) for pod in pods]
        until("the Tritons to be healthy again", lambda: _healthy_everywhere(cluster, ips), 60,
              every_s=0.5)
        # And until calls pass again, as the next test expects.
        until("calls to pass again", lambda: set(_quick_calls(cluster, 4)) == {"OK"} or "not yet",
              30, every_s=0.2)


def _unhealthy_everywhere(cluster: Cluster, ips: list[str]) -> object:
    flags = {ip: _host_flags(cluster, ip) for ip in ips}
    return all("failed_active_health_check" in f or f == [NOT_LISTED]
               for per_gateway in flags.values() for f in per_gateway) or flags


def _quick_calls(cluster: Cluster, count: int = 8) -> list[str]:
    """`count` calls, each on a connection of its own, with a 1 s deadline: how they end."""
    ones = np.ones((1, 16), dtype=np.int32)
    outcomes = []
    for _ in range(count):
        client = tc.InferenceServerClient(cluster.grpc_url, channel_args=OWN_CONNECTION)

        def call(client: tc.InferenceServerClient = client) -> object:
            return client.infer("simple", simple_inputs(ones, ones), client_timeout=1)

        try:
            outcomes.append(_timed(call)[1])
        finally:
            client.close()
    return outcomes


def _until_the_gateways_act(cluster: Cluster, ips: list[str], expect: str) -> None:
    """Polls until the flags are there in both clusters and calls on new connections all end
    as `expect`."""
    until("the gateways to see the Tritons unhealthy",
          lambda: _unhealthy_everywhere(cluster, ips), 30, every_s=0.3)

    def acting() -> object:
        outcomes = _quick_calls(cluster)
        return all(o.startswith(expect) for o in outcomes) or outcomes

    until(f"every call to end as {expect!r}", acting, 30, every_s=0.2)


def _timed(call: Callable[[], object]) -> tuple[float, str]:
    started = time.monotonic()
    try:
        call()
        outcome = "OK"
    except InferenceServerException as error:
        outcome = f"{error.status()}: {error.message()}"
    except urllib.error.HTTPError as error:
        outcome = f"HTTP {error.code}: {error.read().decode(errors='replace')}"
    return time.monotonic() - started, outcome


def test_a_gateway_pod_starting_while_no_triton_passes_its_checks_is_not_ready(
        cluster: Cluster) -> None:
    """A new gateway pod (a rollout, a node drain) whose Envoy's first checks of the listed
    Tritons all fail (here frozen; on a busy node a first check can time out) stays out of the
    clients' Service until one passes (its startupProbe, gateway/started.sh): Ready at once, as
    its readiness probe alone would have it, it answers "no Triton is ready" to the calls it
    gets while the other gateway pod serves them."""
    pods = _tritons(cluster)
    ips = {cluster.pod_ip(p) for p in pods}
    readiness = manifests.read(manifests.build()).gateway.containers["envoy"].readiness
    assert readiness is not None
    old = cluster.ready_pods("gateway")[0]
    mark = cluster.line_index()
    with _stopped(cluster, pods):
        cluster.delete(old)
        new = cluster.wait_for(r"\[cluster\] (gateway-\d+): created at ", 60, after=mark).group(1)

        def listed_none_healthy() -> object:
            try:
                hosts = cluster.envoy_hosts(new)
            except subprocess.SubprocessError as error:
                return f"no answer from its admin interface: {error}"
            return (set(hosts) == ips and all(hosts.values())) or hosts

        until(f"{new}'s Envoy to list every Triton, none healthy", listed_none_healthy, 60,
              every_s=0.3)
        # Two readiness periods: the readiness probe alone passes within one.
        try:
            until(f"{new} to be ready", lambda: new in cluster.ready_pods("gateway"),
                  2 * readiness.period_s + 1, every_s=0.2)
            ready_with = cluster.envoy_hosts(new)
        except TimeoutError:
            ready_with = None
    assert ready_with is None, f"{new} became ready while its Envoy had {ready_with}"
    until(f"{new} to be ready", lambda: new in cluster.ready_pods("gateway"), 60, every_s=0.2)
    hosts = cluster.envoy_hosts(new)
    assert {ip for ip, flags in hosts.items() if not flags}, hosts
    cluster.wait_gone(old)


def test_two_of_three_unhealthy_get_no_call(cluster: Cluster) -> None:
    pods = _tritons(cluster)
    stopped = pods[:2]
    with _stopped(cluster, stopped):
        _until_the_gateways_act(cluster, [cluster.pod_ip(p) for p in stopped], "OK")
        calls = under_load(cluster, lambda: time.sleep(6), stream_clients=0, deadline_s=5)
    print(f"with {stopped} stopped: {calls.summary()}")
    assert calls.count() > 50
    assert calls.failed() == [], calls.failed()[:10]


def test_all_unhealthy_every_call_ends_at_once_saying_why(cluster: Cluster) -> None:
    pods = _tritons(cluster)
    ones = np.ones((1, 16), dtype=np.int32)
    client = tc.InferenceServerClient(cluster.grpc_url)
    with _stopped(cluster, pods):
        _until_the_gateways_act(cluster, [cluster.pod_ip(p) for p in pods],
                                "StatusCode.UNAVAILABLE")
        grpc_s, grpc_outcome = _timed(lambda: client.infer(
            "simple", simple_inputs(ones, ones), client_timeout=20))
        http_s, http_outcome = _timed(lambda: urllib.request.urlopen(
            f"http://{cluster.http_url}/v2/health/ready", timeout=20))
        # A job start gets the start-of-job gate's answer instead (docs/admission.md).
        job_s, job_outcome = _timed(lambda: client.get_model_repository_index(
            client_timeout=20))
    print(f"gRPC: {grpc_outcome!r} in {grpc_s:.3f}s; HTTP: {http_outcome!r} in {http_s:.3f}s; "
          f"RepositoryIndex: {job_outcome!r} in {job_s:.3f}s")
    assert grpc_outcome.startswith("StatusCode.UNAVAILABLE") and NO_TRITON in grpc_outcome
    assert http_outcome.startswith("HTTP 503") and NO_TRITON in http_outcome
    assert job_outcome.startswith("StatusCode.CANCELLED") and "no new jobs" in job_outcome
    assert grpc_s < 1 and http_s < 1 and job_s < 1


def test_the_gateways_ask_the_active_clusters_head_whether_to_admit(cluster: Cluster) -> None:
    """The gate's signal comes from KubeRay's head Service, which resolves to the head of the
    active Ray cluster: every gateway pod lists exactly that address, and a job start passes."""
    head = cluster.process.wait_for_line(r"ray-head: Ray head of cluster \S+ at (\S+) ",
                                         1).group(1)

    def asking_the_head() -> object:
        listed = {g: sorted(cluster.envoy_hosts(g, "control-plane"))
                  for g in cluster.ready_pods("gateway")}
        return all(hosts == [head] for hosts in listed.values()) or listed

    until("the gateways to resolve the head's Service", asking_the_head, 30)
    client = tc.InferenceServerClient(cluster.grpc_url)
    assert client.get_model_repository_index().models


def test_a_slow_triton_stays_in_rotation(cluster: Cluster) -> None:
    pod = _tritons(cluster)[0]
    ip = cluster.pod_ip(pod)
    pid = cluster.pid(pod, "triton")
    seen: list[list[list[str]]] = []
    os.kill(pid, signal.SIGSTOP)  # a busy Triton: 1.5 s without an answer
    try:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            seen.append(_host_flags(cluster, ip))
            time.sleep(0.1)
    finally:
        os.kill(pid, signal.SIGCONT)
    end = time.monotonic() + 4
    while time.monotonic() < end:
        seen.append(_host_flags(cluster, ip))
        time.sleep(0.2)
    flagged = [flags for flags in seen if any(f for f in flags)]
    assert not flagged, f"{pod} left rotation for a 1.5 s stall: {flagged[:3]}"


def test_a_triton_refusing_connections_leaves_rotation(cluster: Cluster) -> None:
    pod = _tritons(cluster)[1]
    ip = cluster.pod_ip(pod)
    killed_at: list[float] = []
    seen: list[list[str]] = []
    out: list[float] = []

    def gone_from_rotation() -> object:
        flags = _host_flags(cluster, ip)
        seen.extend(flags)
        return all({"failed_outlier_check", "failed_active_health_check"} & set(f)
                   for f in flags) or flags

    def kill() -> None:
        os.kill(cluster.pid(pod, "triton"), signal.SIGKILL)  # the port refuses until restarted
        killed_at.append(time.monotonic())
        until(f"the gateways to take {pod} out", gone_from_rotation, 10, every_s=0.05)
        out.append(time.monotonic() - killed_at[0])
        time.sleep(3)  # calls flow while it is out

    calls = under_load(cluster, kill, stream_clients=0)
    ejected = any("failed_outlier_check" in flags for flags in seen)
    print(f"{pod} out of rotation {out[0]:.1f}s after its Triton died (ejected by outlier "
          f"detection: {ejected}); {calls.summary()}")
    late = [c for c in calls.failed() if c[1] > killed_at[0] + 0.5]
    assert late == [], late[:10]
    # Refused connections eject it (outlier detection enforced), before health checks would.
    assert ejected, seen
    until(f"{pod} to be ready again", lambda: pod in cluster.ready_pods("triton") or
          cluster.ready_pods("triton"), 180, every_s=1)
    until("it to be healthy again", lambda: _healthy_everywhere(cluster, [ip]), 120, every_s=1)


def _successes(pod_ip: str, model: str | None = None) -> float:
    """Inferences this Triton has answered (its own metrics), of `model` or of every model."""
    with urllib.request.urlopen(f"http://{pod_ip}:8002/metrics", timeout=5) as response:
        text = response.read().decode()
    prefix = "nv_inference_request_success{" + ("" if model is None else f'model="{model}"')
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


def test_a_triton_pod_deleted_under_load_fails_no_call(cluster: Cluster) -> None:
    pods = _tritons(cluster)
    victim = pods[-1]
    mark = cluster.line_index()
    timings: dict[str, float] = {}

    def delete_and_replace() -> None:
        # The worst moment: the DNS cache has just taken its answer, and will give the
        # deleted pod's address for a whole TTL.
        ttl = cluster.built_dns_ttl
        until("a fresh DNS answer", lambda: cluster.dns_ttl_left() >= ttl - 1 or
              cluster.dns_ttl_left(), ttl + 5, every_s=0.05)
        cluster.delete(victim)
        created = cluster.wait_for(r"\[cluster\] (triton-\d+): created at (\S+) ", 60, after=mark)
        new_pod, new_ip = created.group(1), created.group(2)
        cluster.wait_for(rf"\[cluster\] {new_pod}: ready$", 300, after=mark)
        ready_at = time.monotonic()
        before = _successes(new_ip)
        until(f"{new_pod} to get calls", lambda: _successes(new_ip) > before, 120, every_s=0.5)
        timings["first calls after ready"] = time.monotonic() - ready_at
        cluster.wait_gone(victim, timeout_s=200)

    calls = under_load(cluster, delete_and_replace)
    print(f"deleted {victim}: {calls.summary()}; {timings}")
    assert calls.failed() == [], calls.failed()[:10]
    # The DNS TTL (the build's), Envoy's 2 s refresh and a health check.
    assert timings["first calls after ready"] < cluster.built_dns_ttl + 2 + 3


def test_a_gpu_pod_deleted_keeps_serving_its_live_sequences_while_it_drains(
        cluster: Cluster) -> None:
    """kubectl delete pod (a drain) while sequences run through the Service IP: the pod leaves
    triton-pods at once, its Ray node drains (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S), Serve
    stops its replica, which stays while its Triton holds live sequences and says so on its
    holding ports (serve/triton_pod/holding.py); triton-all-pods lists a terminating pod too
    (publishNotReadyAddresses), and Triton's preStop keeps it up. Once every gateway has the
    pod out of its ready Tritons (its DNS cache's TTL) and healthy at priority 1, the held
    sequences' calls still sum right, and end. Without the retry priority: Triton's START
    refusal once the TTL had passed."""
    pods = _tritons(cluster)
    victim = pods[-1]
    victim_ip = cluster.pod_ip(victim)
    mark = cluster.line_index()
    client = tc.InferenceServerClient(cluster.grpc_url)
    sums: dict[int, int] = {}
    on_victim: list[int] = []
    wrong: list[str] = []

    def step(sequence: int, start: bool = False, end: bool = False) -> None:
        sums[sequence] = sums.get(sequence, 0) + 1
        try:
            got = _sequence_call(client, sequence, 1, start, end)
        except InferenceServerException as error:
            wrong.append(f"sequence {sequence}: {error}")
            return
        if got != sums[sequence]:
            wrong.append(f"sequence {sequence}: {got}, not {sums[sequence]}")

    try:
        sequence = 4000
        while len(on_victim) < 3:
            assert sequence < 4060, "60 STARTs and none on the pod to delete"
            before = _successes(victim_ip, "sequence_sum")
            step(sequence, start=True)
            if _successes(victim_ip, "sequence_sum") > before:
                on_victim.append(sequence)
            sequence += 1
        cluster.delete(victim)
        cluster.wait_for(rf"\[cluster\] {victim}: deleted", 30, after=mark)
        rounds = 0

        def gone_from_the_ready(then_rounds: int) -> object:
            """Rounds of the held sequences' calls until no gateway lists the pod as ready
            (the DNS cache's TTL, Envoy's refresh), while every one lists it healthy at
            priority 1; then `then_rounds` more."""
            nonlocal rounds
            for held in on_victim:
                step(held)
            rounds += 1
            if wrong:
                raise AssertionError(f"after {rounds} rounds: {wrong[:3]}")
            views = {g: (cluster.envoy_hosts(g, "triton", 0).get(victim_ip),
                         cluster.envoy_hosts(g, "triton", 1).get(victim_ip))
                     for g in cluster.ready_pods("gateway")}
            if any(ready is not None for ready, _ in views.values()):
                return f"still ready in {views}"
            if any(leaving != [] for _, leaving in views.values()):
                return f"not healthy as leaving in {views}"
            return then_rounds <= 0 or gone_from_the_ready(then_rounds - 1)

        until(f"every gateway to list {victim} as leaving only", lambda: gone_from_the_ready(5),
              60, every_s=0.05)
        for held in on_victim:
            step(held, end=True)
    finally:
        client.close()
    print(f"{victim} deleted holding sequences {on_victim}: {rounds} rounds after, {wrong[:3]}")
    assert not wrong, wrong[:5]


# Last in this file (its pod is gone for good until its owner replaces it).
def test_a_vanished_pod_ends_its_calls_within_the_keepalive_time(cluster: Cluster) -> None:
    pod = _tritons(cluster)[0]
    ip = cluster.pod_ip(pod)
    cut_at: list[float] = []
    out_at: list[float] = []

    def vanish() -> None:
        until(f"calls under way on {pod}", lambda: cluster.calls_under_way(ip) > 0 or "none",
              30, every_s=0.1)
        cluster.cut(pod)
        cut_at.append(time.monotonic())
        until(f"the gateways to see {pod} unhealthy",
              lambda: _unhealthy_everywhere(cluster, [ip]), 30, every_s=0.2)
        out_at.append(time.monotonic())
        # The calls it held end by the keepalive (10 s + 5 s), well before their deadline.
        until(f"the calls the gateways had under way on {pod} to end",
              lambda: (held := cluster.calls_under_way(ip)) == 0 or held, 25, every_s=0.5)

    calls = under_load(cluster, vanish, grpc_clients=6, http_clients=0, stream_clients=0,
                       model="slow", slow_s=3.0)
    hit = calls.failed()
    print(f"{pod} cut, out of rotation {out_at[0] - cut_at[0]:.1f}s later: {calls.summary()}; "
          f"failed calls' durations {sorted(round(c[3], 1) for c in hit)}")
    # The calls it held, and those sent to it before its health checks failed, end
    # (UNAVAILABLE) within the keepalive time (10 s + 5 s), not at their 60 s deadline.
    assert hit, "no call failed: none was under way on the vanished pod, nothing was tested"
    assert all(c[3] < 25 for c in hit), hit
    assert all(c[1] < out_at[0] + 1 for c in hit), "a call started after it was out failed"
    assert calls.count() > len(hit)
    cluster.delete(pod)
