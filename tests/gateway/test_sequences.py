"""Stateful (sequence) models through the gateway with two GPU pods: every call of a sequence
reaches the Triton that holds it (gateway/envoy.yaml, the retry policies; docs/data-paths.md,
"Sequences"). Two real Tritons serve tests/sequence_models (`simple_sequence`, the contract of
Triton's example; `sequence_sum`, whose answer is the sequence's running sum, kept in the Triton
that got its START) and a model without sequences; one gateway Envoy with the shipped config
is in front of both, as the headless Service lists two ready pods. Triton's own sequence
example clients run unchanged."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from gateway import local as gateway
from gateway.routes import HTTP_CLUSTER
from local_stack import triton
from local_stack.polling import until
from local_stack.ports import free_ports
from local_stack.processes import end_session, free_orphaned_regions, spawn, terminate
from local_stack.settings import Settings, TritonPorts
from tests.support.examples import SEQUENCE_EXAMPLES, sequence_example_passed
from tests.support.lone_gateway import envoy_before
from triton_pod.gateway_view import CLUSTERS_PATH, ready_tritons
from triton_pod.holding import Holding, HoldingAnswers
from triton_pod.sequences import SEQUENCE_NOT_HELD

pytestmark = pytest.mark.processes

TESTS = Path(__file__).resolve().parents[1]
# A model without sequences beside them: its calls are balanced per call as before.
PLAIN = "identity_fp32"


@dataclass
class Pod:
    """One GPU pod's Triton, started on ports that stay its own across a restart."""

    index: int
    repository: Path
    backends: Path
    log: Path
    ports: TritonPorts = field(init=False)
    process: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        http, grpc, metrics = free_ports(3)
        self.ports = TritonPorts(http=http, grpc=grpc, metrics=metrics)

    @property
    def url(self) -> str:
        return f"localhost:{self.ports.grpc}"

    def start(self) -> None:
        self.process = spawn(triton.command(self.repository, self.backends, self.ports,
                                            "a-key-nobody-uses"), self.log, triton.environment())

    def ready(self) -> object:
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"Triton {self.index} exited: "
                               + self.log.read_text(errors="replace")[-2000:])
        client = tc.InferenceServerClient(self.url)
        try:
            return client.is_server_ready() or "not ready"
        except InferenceServerException as error:
            return str(error)
        finally:
            client.close()

    def die(self) -> None:
        """What a node's loss does to the pod: Triton and its stubs killed at once; the pod's
        shared memory goes with it."""
        assert self.process is not None
        end_session(self.process.pid)
        self.process.wait()
        free_orphaned_regions()

    def executions(self, model: str) -> int:
        client = tc.InferenceServerClient(self.url)
        try:
            stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
            return int(stats["inference_stats"]["success"].get("count", 0))
        finally:
            client.close()


@dataclass
class TwoPods:
    pods: list[Pod]
    settings: Settings
    admin_port: int
    # The gateway's folder: its discovery files (endpoints.json, endpoints-http.json).
    folder: Path

    def list_pods(self, pods: list[Pod],
                  every: list[tuple[Pod, tuple[int, int]]] | None = None) -> None:
        """The pods the headless Service lists now (the gateway's discovery), and `every` pod
        with its holding ports (HTTP, gRPC) as `triton-all-pods` lists them (none: not
        listed)."""
        every = every or []
        gateway.write_endpoints(self.folder / "endpoints.json", [p.ports.grpc for p in pods],
                                every_pod=[(p.ports.grpc, ports[1]) for p, ports in every])
        gateway.write_endpoints(self.folder / "endpoints-http.json", [p.ports.http for p in pods],
                                HTTP_CLUSTER,
                                every_pod=[(p.ports.http, ports[0]) for p, ports in every])

    def healthy_ports(self, priority: int) -> tuple[set[int], set[int]]:
        """The Triton ports (gRPC, HTTP) the gateway counts healthy at `priority` now."""
        return (gateway.upstream_ports(self.admin_port, True, priority),
                gateway.upstream_ports(self.admin_port, True, priority, HTTP_CLUSTER))

    @property
    def grpc(self) -> str:
        return f"localhost:{self.settings.grpc_port}"

    @property
    def http(self) -> str:
        return f"localhost:{self.settings.http_port}"

    def healthy(self) -> int:
        """Tritons the gateway counts healthy now (its admin interface)."""
        url = f"http://127.0.0.1:{self.admin_port}/clusters"
        with urllib.request.urlopen(url, timeout=5) as response:
            lines = response.read().decode().splitlines()
        return sum(1 for line in lines
                   if line.startswith("triton::") and line.endswith("::health_flags::healthy"))

    def executions(self, model: str) -> list[int]:
        return [pod.executions(model) for pod in self.pods]

    def another_pod(self, index: int) -> Pod:
        """A further GPU pod's Triton, with the same models, not yet started."""
        first = self.pods[0]
        return Pod(index, first.repository, first.backends,
                   first.log.with_name(f"triton-{index}.log"))

    def relist(self) -> None:
        """Both pods ready again, none listed at priority 1, as each test found them."""
        self.list_pods(self.pods)
        until("the gateway to count both Tritons healthy again",
              lambda: self.healthy() == 2 or f"{self.healthy()} healthy", 30)


@pytest.fixture(scope="module")
def two_pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoPods]:
    work = tmp_path_factory.mktemp("sequences")
    repository = triton.merged_model_repository([triton.SEQUENCE_MODELS])
    shutil.copytree(TESTS / "models" / PLAIN, repository / PLAIN)
    backends = triton.prepare_backends(work / "backends")
    pods = [Pod(i, repository, backends, work / f"triton-{i}.log") for i in range(2)]
    try:
        for pod in pods:
            pod.start()
        for pod in pods:
            until(f"Triton {pod.index} ready", pod.ready, 120, every_s=0.5)
        with envoy_before(work / "gateway", {}, [p.ports.grpc for p in pods],
                          [p.ports.http for p in pods]) as (settings, log, envoy, _):
            running = TwoPods(pods, settings, settings.gateway_admin_port, work / "gateway")

            def both_healthy() -> object:
                if envoy.poll() is not None:
                    raise RuntimeError(f"Envoy exited: {log.read_text()[-2000:]}")
                try:
                    return running.healthy() == 2 or f"{running.healthy()} healthy"
                except OSError as error:
                    return str(error)

            until("the gateway to count both Tritons healthy", both_healthy, 30)
            yield running
    finally:
        # Gone at once: a Triton the tests left a sequence's call queued in (every slot held)
        # would wait out its exit timeout for it, and its shutdown is no test of this tier.
        for pod in pods:
            if pod.process is not None and pod.process.poll() is None:
                pod.die()
        shutil.rmtree(repository, ignore_errors=True)


@pytest.mark.parametrize("example", SEQUENCE_EXAMPLES)
def test_tritons_sequence_examples_pass_unchanged_with_two_pods(two_pods: TwoPods,
                                                                  example: str) -> None:
    failed = sequence_example_passed(example, two_pods.grpc, two_pods.http)
    assert failed is None, f"through the gateway (2 Tritons): {failed}"


SEQUENCES, CALLS = 8, 10
# New sequences started at most while waiting for one to start on a newly added pod.
FRESH_AT_MOST = 64


def _call(client: tc.InferenceServerClient | th.InferenceServerClient, sequence: int,
          value: int, start: bool, end: bool) -> int:
    """One call of a sequence_sum sequence over either protocol: the running sum."""
    protocol = tc if isinstance(client, tc.InferenceServerClient) else th
    tensor = protocol.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], np.int32))
    result = client.infer("sequence_sum", [tensor], sequence_id=sequence, sequence_start=start,
                          sequence_end=end)
    return int(result.as_numpy("OUTPUT")[0][0])


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_interleaved_sequences_are_each_summed_by_the_triton_holding_them(
        two_pods: TwoPods, protocol: str) -> None:
    """8 sequences of 10 calls, interleaved (each call of one sequence follows a call of every
    other): every running sum right, and the sequences were held by both Tritons."""
    before = two_pods.executions("sequence_sum")
    grpc_client = tc.InferenceServerClient(two_pods.grpc)
    http_client = th.InferenceServerClient(two_pods.http)
    base = 5000 if protocol == "grpc" else 6000
    wrong = []
    sums = [0] * SEQUENCES
    try:
        for step in range(CALLS):
            for s in range(SEQUENCES):
                value = 1 + s * 100 + step
                sums[s] += value
                got = _call(grpc_client if protocol == "grpc" else http_client, base + s,
                            value, step == 0, step == CALLS - 1)
                if got != sums[s]:
                    wrong.append(f"sequence {base + s} call {step}: {got}, not {sums[s]}")
    finally:
        grpc_client.close()
        http_client.close()
    assert not wrong, f"{protocol}: {len(wrong)} of {SEQUENCES * CALLS} wrong: {wrong[:5]}"
    ran = [after - earlier for after, earlier in
           zip(two_pods.executions("sequence_sum"), before, strict=True)]
    assert sum(ran) == SEQUENCES * CALLS and min(ran) > 0, (
        f"each call run once, by both Tritons: {ran}")


def _plain_calls(url: str, pods: list[Pod], count: int, errors: list[str]) -> list[int]:
    """`count` calls without a sequence from 4 callers at once through the gateway at `url`:
    how many each of `pods` ran; each call's error in `errors`."""
    before = [pod.executions(PLAIN) for pod in pods]
    tensor = tc.InferInput("INPUT", [4], "FP32")
    tensor.set_data_from_numpy(np.ones(4, np.float32))

    def some(n: int) -> None:
        mine = tc.InferenceServerClient(url)
        try:
            for _ in range(n):
                mine.infer(PLAIN, [tensor])
        except InferenceServerException as error:
            errors.append(f"a call without a sequence: {error}")
        finally:
            mine.close()

    workers = [threading.Thread(target=some, args=(count // 4,)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    return [pod.executions(PLAIN) - earlier for pod, earlier in zip(pods, before, strict=True)]


def test_calls_without_a_sequence_are_still_balanced_per_call(two_pods: TwoPods) -> None:
    """The retries that find a sequence's Triton leave other calls as they were: balanced per
    call, every pod taking at least a quarter, none run twice."""
    calls = 200
    errors: list[str] = []
    ran = _plain_calls(two_pods.grpc, two_pods.pods, calls, errors)
    assert not errors, errors[:3]
    assert sum(ran) == calls and min(ran) >= calls // 4, f"calls per Triton: {ran}"


def test_a_pod_added_under_sequence_load_takes_no_live_sequence_over(two_pods: TwoPods) -> None:
    """A scale-up while sequences run (a hash ring would remap some to the new pod, the defect
    again): every live sequence's sums stay right, new sequences and plain calls reach the new
    pod too."""
    client = tc.InferenceServerClient(two_pods.grpc)
    third = two_pods.another_pod(2)
    live = {8000 + s: 0 for s in range(SEQUENCES)}
    wrong: list[str] = []

    def step(sequences: dict[int, int], start: bool = False, end: bool = False) -> None:
        for sequence in sequences:
            sequences[sequence] += sequence % 100 + 1
            got = _call(client, sequence, sequence % 100 + 1, start, end)
            if got != sequences[sequence]:
                wrong.append(f"sequence {sequence}: {got}, not {sequences[sequence]}")

    try:
        step(live, start=True)
        step(live)
        third.start()
        until("Triton 2 ready", third.ready, 120, every_s=0.5)
        two_pods.list_pods([*two_pods.pods, third])
        until("the gateway to count three Tritons healthy",
              lambda: two_pods.healthy() == 3 or f"{two_pods.healthy()} healthy", 30)
        before = third.executions("sequence_sum"), third.executions(PLAIN)
        for _ in range(4):
            step(live)
        # New sequences, one at a time, until one starts on the new pod: each START goes
        # to one of three Tritons, so a fixed handful could all miss it (8: 4% of runs).
        fresh: dict[int, int] = {}
        for s in range(FRESH_AT_MOST):
            sequence = {9000 + s: 0}
            step(sequence, start=True)
            fresh.update(sequence)
            if third.executions("sequence_sum") > before[0]:
                break
        step(live, end=True)
        step(fresh, end=True)
        tensor = tc.InferInput("INPUT", [4], "FP32")
        tensor.set_data_from_numpy(np.ones(4, np.float32))
        for _ in range(60):
            client.infer(PLAIN, [tensor])
        taken = (third.executions("sequence_sum") - before[0],
                 third.executions(PLAIN) - before[1])
    finally:
        client.close()
        two_pods.list_pods(two_pods.pods)
        if third.process is not None:
            terminate(third.process, 15)
    assert not wrong, f"{len(wrong)} wrong after a pod joined: {wrong[:5]}"
    # The new pod ran calls of the new sequences (START and END of some) and of the plain model
    # (LEAST_REQUEST over three: about a third), none of the live sequences'.
    assert taken[0] > 0 and taken[1] >= 60 // 6, f"the new pod's share: {taken}"


class _Replicas:
    """Each pod's replica's holding ports (serve/triton_pod/holding.py), run here on an event
    loop of their own as in the replica; the test says when a replica leaves and what its
    Triton holds."""

    def __init__(self, count: int) -> None:
        self.holdings = [Holding() for _ in range(count)]
        self.ports = [(http, grpc) for http, grpc in (free_ports(2) for _ in range(count))]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._answers = [HoldingAnswers(h) for h in self.holdings]

    def __enter__(self) -> _Replicas:
        self._thread.start()
        for answers, (http_port, grpc_port) in zip(self._answers, self.ports, strict=True):
            asyncio.run_coroutine_threadsafe(answers.start(http_port, grpc_port),
                                             self._loop).result(10)
        return self

    def __exit__(self, *_: object) -> None:
        for answers in self._answers:
            asyncio.run_coroutine_threadsafe(answers.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


class _Sums:
    """Sequences of sequence_sum through the gateway over both protocols: each call adds its
    sequence's value (sequence % 100 + 1) and must answer the running sum; a wrong sum or a
    refusal goes to `wrong`."""

    def __init__(self, two_pods: TwoPods) -> None:
        self.clients: dict[str, tc.InferenceServerClient | th.InferenceServerClient] = {
            "grpc": tc.InferenceServerClient(two_pods.grpc),
            "http": th.InferenceServerClient(two_pods.http)}
        self.sums: dict[tuple[str, int], int] = {}
        self.wrong: list[str] = []

    def step(self, protocol: str, sequence: int, start: bool = False, end: bool = False) -> None:
        value = sequence % 100 + 1
        expected = self.sums[protocol, sequence] = self.sums.get((protocol, sequence), 0) + value
        try:
            got = _call(self.clients[protocol], sequence, value, start, end)
        except InferenceServerException as error:
            self.wrong.append(f"{protocol} sequence {sequence} call: {error}")
            return
        if got != expected:
            self.wrong.append(f"{protocol} sequence {sequence}: {got}, not {expected}")

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def test_a_leaving_pod_gets_the_calls_of_the_sequences_it_holds_and_no_other(
        two_pods: TwoPods) -> None:
    """A scale-down stops pod 1's replica while its Triton holds live sequences: pod 1 leaves
    the ready pods (priority 0) and, while its replica says it holds them, the gateway lists it
    healthy at priority 1 (every pod, checked on its holding ports). Every later call of those
    sequences reaches it over both protocols and sums right; plain calls and new sequences go
    to the ready pod only; once it holds nothing, a call of its sequence gets Triton's refusal."""
    kept, leaving = two_pods.pods
    sums = _Sums(two_pods)
    step, wrong, grpc_client = sums.step, sums.wrong, sums.clients["grpc"]
    held = [("grpc", 9500 + s) for s in range(5)] + [("http", 9600 + s) for s in range(5)]
    plain = tc.InferInput("INPUT", [4], "FP32")
    plain.set_data_from_numpy(np.ones(4, np.float32))
    try:
        with _Replicas(2) as replicas:
            every = list(zip(two_pods.pods, replicas.ports, strict=True))
            # The sequences start while pod 1 is the only ready one.
            two_pods.list_pods([leaving], every)
            until("the gateway to list pod 1 alone as ready, none as leaving",
                  lambda: (two_pods.healthy_ports(0) == ({leaving.ports.grpc},
                                                        {leaving.ports.http})
                  and two_pods.healthy_ports(1) == (set(), set()))
                  or f"{two_pods.healthy_ports(0)} ready, {two_pods.healthy_ports(1)} leaving",
                  30)
            for protocol, sequence in held:
                step(protocol, sequence, start=True)
            # Serve stops pod 1's replica: it holds live sequences, then it is not ready.
            replicas.holdings[1].leaving = True
            replicas.holdings[1].live = ["sequence_sum"]
            until("the gateway to count pod 1 healthy as leaving",
                  lambda: two_pods.healthy_ports(1) == ({leaving.ports.grpc},
                                                        {leaving.ports.http})
                  or f"{two_pods.healthy_ports(1)} leaving", 30)
            two_pods.list_pods([kept], every)
            until("the gateway to list pod 0 alone as ready",
                  lambda: two_pods.healthy_ports(0) == ({kept.ports.grpc}, {kept.ports.http})
                  or f"{two_pods.healthy_ports(0)} ready", 30)
            before = kept.executions("sequence_sum"), leaving.executions("sequence_sum")
            plain_before = leaving.executions(PLAIN)
            for call in range(3):
                for protocol, sequence in held:
                    step(protocol, sequence, end=call == 2)
                    grpc_client.infer(PLAIN, [plain])
            for fresh in range(9700, 9705):
                step("grpc", fresh, start=True)
                step("grpc", fresh, end=True)
            ran = (kept.executions("sequence_sum") - before[0],
                   leaving.executions("sequence_sum") - before[1])
            plain_on_leaving = leaving.executions(PLAIN) - plain_before
            # The sequences ended: pod 1 holds nothing, and leaves priority 1 too.
            step("grpc", 9510, start=True)  # a sequence left live on pod 0, the ready one
            replicas.holdings[1].live = []
            until("the gateway to count pod 1 out as leaving",
                  lambda: two_pods.healthy_ports(1) == (set(), set())
                  or f"{two_pods.healthy_ports(1)} leaving", 30)
            with pytest.raises(InferenceServerException) as refused:
                _call(grpc_client, 9500, 1, False, True)  # ended on pod 1: unknown anywhere
            two_pods.list_pods(two_pods.pods)
    finally:
        sums.close()
        two_pods.relist()
    assert not wrong, f"{len(wrong)} wrong while pod 1 was leaving: {wrong[:5]}"
    # Pod 1 ran each held sequence's three calls; pod 0 the new sequences' two calls each (and
    # the refusals, which Triton does not count as executions).
    assert ran == (10, 30), f"sequence calls run by (the ready pod, the leaving one): {ran}"
    assert plain_on_leaving == 0, f"the leaving pod ran {plain_on_leaving} plain calls"
    assert SEQUENCE_NOT_HELD in str(refused.value), str(refused.value)


def test_a_ready_pods_sequences_reach_it_from_the_moment_the_gateway_drops_it(
        two_pods: TwoPods) -> None:
    """A NewCluster upgrade's switch: the gateway's DNS answer drops pod 1 from the ready pods
    while nothing has told pod 1 (its replica cannot learn it before the gateway does). Its
    Triton holds live sequences, so its holding ports already answer healthy while it is
    ready (priority 1, beside its ready copy), and every call of its sequences made right
    after the drop reaches it and sums right. The control plane's count of the gateway's
    Tritons (the metrics listener's /clusters, gateway_view.ready_tritons) stays the ready
    pods, though Envoy's own healthy count has each pod holding sequences twice."""
    kept, dropped = two_pods.pods
    client = tc.InferenceServerClient(two_pods.grpc)
    sums: dict[int, int] = {}
    wrong: list[str] = []

    def step(sequence: int, start: bool = False, end: bool = False) -> None:
        sums[sequence] = sums.get(sequence, 0) + 1
        got = _call(client, sequence, 1, start, end)
        if got != sums[sequence]:
            wrong.append(f"sequence {sequence}: {got}, not {sums[sequence]}")

    def counted() -> tuple[int | None, int]:
        metrics = f"http://127.0.0.1:{two_pods.settings.gateway_metrics_port}"
        with urllib.request.urlopen(f"{metrics}{CLUSTERS_PATH}", timeout=5) as response:
            ready = ready_tritons(response.read().decode())
        with urllib.request.urlopen(f"{metrics}/stats/prometheus", timeout=5) as response:
            envoys = [line for line in response.read().decode().splitlines()
                      if line.startswith('envoy_cluster_membership_healthy{envoy_cluster_name='
                                         '"triton"}')]
        return ready, int(envoys[0].rsplit(" ", 1)[1])

    sequences = range(9800, 9808)
    try:
        with _Replicas(2) as replicas:
            every = list(zip(two_pods.pods, replicas.ports, strict=True))
            two_pods.list_pods(two_pods.pods, every)
            started_before = dropped.executions("sequence_sum")
            for sequence in sequences:
                step(sequence, start=True)
            assert dropped.executions("sequence_sum") > started_before, "none started on pod 1"
            # What each replica's watch reads from its Triton's statistics (pod.py).
            for holding in replicas.holdings:
                holding.live = ["sequence_sum"]
            until("the gateway to count both pods healthy at priority 1 too",
                  lambda: two_pods.healthy_ports(1) == ({p.ports.grpc for p in two_pods.pods},
                                                        {p.ports.http for p in two_pods.pods})
                  or f"{two_pods.healthy_ports(1)} at priority 1", 30)
            assert counted() == (2, 4), counted()
            two_pods.list_pods([kept], every)
            until("the gateway to list pod 0 alone as ready",
                  lambda: two_pods.healthy_ports(0) == ({kept.ports.grpc}, {kept.ports.http})
                  or f"{two_pods.healthy_ports(0)} ready", 30, every_s=0.02)
            before = dropped.executions("sequence_sum")
            for call in range(3):
                for sequence in sequences:
                    step(sequence, end=call == 2)
            ran_on_dropped = dropped.executions("sequence_sum") - before
            assert counted() == (1, 3), counted()
    finally:
        client.close()
        two_pods.relist()
    assert not wrong, f"{len(wrong)} wrong after pod 1 was dropped: {wrong[:5]}"
    assert ran_on_dropped > 0, "no call of pod 1's sequences reached it"


def test_sequences_live_through_a_pod_added_one_scaled_down_and_one_drained(
        two_pods: TwoPods) -> None:
    """Under sequence load over both protocols, the membership changes of a day: a third pod
    added, then pod 0 removed by a scale-down (its replica leaves first, saying it holds live
    sequences) and pod 1 by a drain (its pod deleted: dropped from the ready ones before its
    replica hears of it; its watch has read its sequences as live). Every call of every
    sequence sums right to its END; calls without a sequence go to every ready pod, each
    taking at least a quarter of them while three are ready, and none to a pod once it left."""
    third = two_pods.another_pod(2)
    pods = [*two_pods.pods, third]
    sums = _Sums(two_pods)
    step, wrong = sums.step, sums.wrong

    def round_of(live: list[tuple[str, int]], end: bool = False) -> None:
        for protocol, sequence in live:
            step(protocol, sequence, end=end)

    live = ([("grpc", 10000 + s) for s in range(6)] + [("http", 11000 + s) for s in range(4)])
    try:
        with _Replicas(3) as replicas:
            every = list(zip(pods, replicas.ports, strict=True))
            two_pods.list_pods(two_pods.pods, every)
            for protocol, sequence in live:
                step(protocol, sequence, start=True)
            round_of(live)
            # Scale-up: a third pod, ready, while the sequences go on; more start.
            third.start()
            until("Triton 2 ready", third.ready, 120, every_s=0.5)
            two_pods.list_pods(pods, every)
            until("the gateway to count three Tritons ready",
                  lambda: two_pods.healthy_ports(0)[0] == {p.ports.grpc for p in pods}
                  or f"{two_pods.healthy_ports(0)} ready", 30)
            fresh = [("grpc", 10100 + s) for s in range(6)]
            for protocol, sequence in fresh:
                step(protocol, sequence, start=True)
            live += fresh
            round_of(live)
            with_three = _plain_calls(two_pods.grpc, pods, 360, wrong)
            # What each replica's watch reads from its Triton (pod.py _watch_live): every pod
            # ran calls of sequence_sum lately.
            for holding in replicas.holdings:
                holding.live = ["sequence_sum"]
            until("the gateway to count all three healthy at priority 1 too",
                  lambda: two_pods.healthy_ports(1)[0] == {p.ports.grpc for p in pods}
                  or f"{two_pods.healthy_ports(1)} at priority 1", 30)
            # Scale-down: pod 0's replica leaves (it says so first), then the Service drops it.
            replicas.holdings[0].leaving = True
            two_pods.list_pods(pods[1:], every)
            until("the gateway to list pods 1 and 2 as ready",
                  lambda: two_pods.healthy_ports(0)[0] == {p.ports.grpc for p in pods[1:]}
                  or f"{two_pods.healthy_ports(0)} ready", 30)
            round_of(live)
            after_scale_down = _plain_calls(two_pods.grpc, pods, 40, wrong)
            # Drain: pod 1 deleted; the endpoints drop it before its replica hears of it.
            two_pods.list_pods(pods[2:], every)
            until("the gateway to list pod 2 alone as ready",
                  lambda: two_pods.healthy_ports(0)[0] == {third.ports.grpc}
                  or f"{two_pods.healthy_ports(0)} ready", 30)
            round_of(live)
            after_drain = _plain_calls(two_pods.grpc, pods, 40, wrong)
            round_of(live, end=True)
    finally:
        sums.close()
        if third.process is not None:
            terminate(third.process, 15)
        two_pods.relist()
    assert not wrong, f"{len(wrong)} wrong: {wrong[:5]}"
    assert min(with_three) >= sum(with_three) // 4, f"calls per pod, three ready: {with_three}"
    assert after_scale_down[0] == 0 and min(after_scale_down[1:]) > 0, (
        f"calls per pod after pod 0's scale-down: {after_scale_down}")
    assert after_drain[:2] == [0, 0], f"calls per pod after pod 1's drain: {after_drain}"


class _SlowRefuser:
    """A Triton holding some other sequence (a stand-in: only the timing of its answer
    matters): it refuses every ModelInfer in Triton's words, but only once the test lets it."""

    def __init__(self) -> None:
        (self.port,) = free_ports(1)
        self.asked = threading.Event()
        self.answer = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                   options=[("grpc.so_reuseport", 0)])

    def _infer(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.asked.set()
        self.answer.wait(60)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"inference request for sequence 1 to model 'sequence_sum' "
                      f"{SEQUENCE_NOT_HELD} on the first request of the sequence")
        raise AssertionError("grpc's abort raises; its type does not say so")

    def __enter__(self) -> _SlowRefuser:
        self._server.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {
                "ModelInfer": grpc.unary_unary_rpc_method_handler(self._infer)}),))
        self._server.add_insecure_port(f"0.0.0.0:{self.port}")
        self._server.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.answer.set()
        self._server.stop(grace=None).wait(10)


def test_a_sequence_call_that_met_a_holding_pod_before_the_ready_ones_came_still_reaches_it(
        two_pods: TwoPods) -> None:
    """An upgrade's switch as the gateway may see it: the old ready pods gone from priority 0
    and the new ones not yet through their first health check, so a call of a sequence goes to
    the pods holding live sequences (priority 1) and meets one not holding it; by its next try
    a new ready pod is healthy, so its tries meet both priorities before the retry priority
    first moves on (previous_priorities then starts again from the ready pods). The call
    still reaches the Triton holding its sequence, and sums right (seen failing with the
    retries of 4 x max_replicas: every later try went to the ready pod, which refused it)."""
    holder, new = two_pods.pods
    direct = tc.InferenceServerClient(holder.url)
    client = tc.InferenceServerClient(two_pods.grpc)
    sequence = 9900
    outcome: list[int | str] = []
    try:
        with _Replicas(2) as replicas, _SlowRefuser() as other:
            # Started on the holder itself, whose replica has not yet read it as live; the
            # other's replica holds its own live sequences.
            assert _call(direct, sequence, 1, True, False) == 1
            replicas.holdings[1].live = ["sequence_sum"]
            every = [(holder.ports.grpc, replicas.ports[0][1]),
                     (other.port, replicas.ports[1][1])]
            gateway.write_endpoints(two_pods.folder / "endpoints.json", [], every_pod=every)
            gateway.write_endpoints(two_pods.folder / "endpoints-http.json", [], HTTP_CLUSTER,
                                    every_pod=[(holder.ports.http, replicas.ports[0][0])])
            until("the gateway to list no ready pod and only the other holder at priority 1",
                  lambda: (two_pods.healthy_ports(0) == (set(), set())
                           and two_pods.healthy_ports(1)[0] == {other.port})
                  or f"{two_pods.healthy_ports(0)} ready, {two_pods.healthy_ports(1)} holding",
                  30)

            def call() -> None:
                try:
                    outcome.append(_call(client, sequence, 1, False, False))
                except InferenceServerException as error:
                    outcome.append(str(error))

            caller = threading.Thread(target=call)
            caller.start()
            assert other.asked.wait(30), "the call did not reach the only holding pod"
            # Meanwhile the new ready pod passes its first check, and the holder's replica
            # reads its sequence as live.
            replicas.holdings[0].live = ["sequence_sum"]
            gateway.write_endpoints(two_pods.folder / "endpoints.json", [new.ports.grpc],
                                    every_pod=every)
            until("the gateway to count the new pod ready and the holder at priority 1",
                  lambda: (two_pods.healthy_ports(0)[0] == {new.ports.grpc}
                           and two_pods.healthy_ports(1)[0] == {other.port, holder.ports.grpc})
                  or f"{two_pods.healthy_ports(0)} ready, {two_pods.healthy_ports(1)} holding",
                  30)
            other.answer.set()
            caller.join(60)
            assert outcome == [2], f"the call that met both priorities: {outcome}"
            assert _call(client, sequence, 1, False, True) == 3
    finally:
        direct.close()
        client.close()
        two_pods.relist()


def test_a_sequence_whose_triton_died_fails_with_tritons_own_refusal(two_pods: TwoPods) -> None:
    """A pod lost mid-sequence: its sequences' next calls end in Triton's own refusal (the
    START flag missing), never a sum from a fresh state; the other pod's go on right."""
    client = tc.InferenceServerClient(two_pods.grpc)
    held: dict[int, list[int]] = {0: [], 1: []}
    sums: dict[int, int] = {}
    sequence = 7000
    try:
        # Sequences started until each Triton holds one; where each START ran says which.
        while not (held[0] and held[1]):
            assert sequence < 7040, f"40 STARTs all reached one Triton: {held}"
            before = two_pods.executions("sequence_sum")
            sums[sequence] = _call(client, sequence, 3, True, False)
            after = two_pods.executions("sequence_sum")
            held[next(i for i in (0, 1) if after[i] > before[i])].append(sequence)
            sequence += 1
        lost, kept = two_pods.pods[1], two_pods.pods[0]
        lost.die()
        until("the gateway to count the lost Triton out", lambda: two_pods.healthy() == 1
              or f"{two_pods.healthy()} healthy", 30)
        for kept_sequence in held[kept.index]:
            assert _call(client, kept_sequence, 4, False, True) == sums[kept_sequence] + 4
        for lost_sequence in held[lost.index]:
            with pytest.raises(InferenceServerException) as refused:
                _call(client, lost_sequence, 4, False, True)
            assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and \
                SEQUENCE_NOT_HELD in str(refused.value), str(refused.value)
    finally:
        client.close()
        if two_pods.pods[1].process is not None and two_pods.pods[1].process.poll() is not None:
            two_pods.pods[1].start()
            until("Triton 1 ready again", two_pods.pods[1].ready, 120, every_s=0.5)
            until("the gateway to count both Tritons healthy again",
                  lambda: two_pods.healthy() == 2 or f"{two_pods.healthy()} healthy", 30)
