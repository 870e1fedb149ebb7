"""`make cluster` for the tests: started once per session, followed through its ready line and
its control files, and mixed load through its Service IP (gRPC unary, HTTP, streams), each
client on a connection of its own, as many jobs' channels are."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import tritonclient.grpc.aio as tc_aio
import tritonclient.http.aio as http_aio
from tritonclient.utils import InferenceServerException

from local_stack.cluster.network import BRIDGE_IP
from local_stack.cluster.stack import READY, SAID
from local_stack.harness import StackProcess
from local_stack.polling import until
from local_stack.triton_inputs import simple_inputs, tensor

READY_LINE = (rf"^{re.escape(SAID)} {re.escape(READY)} grpc (\S+):8001 http (\S+):8000 "
              r"pods (\S+)$")
# Every channel its own TCP connection: grpc shares subchannels between channels otherwise.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
DEADLINE_S = 60.0


@dataclass
class Cluster:
    process: StackProcess
    ip: str
    pods_dir: Path

    @property
    def built_dns_ttl(self) -> int:
        """The DNS TTL the cluster runs with (it says so as it starts)."""
        return int(self.process.wait_for_line(r"DNS TTL (\d+)s", 1).group(1))

    @property
    def grpc_url(self) -> str:
        return f"{self.ip}:8001"

    @property
    def http_url(self) -> str:
        return f"{self.ip}:8000"

    def pods(self, kind: str) -> list[str]:
        return sorted((p.name for p in self.pods_dir.iterdir() if p.name.startswith(f"{kind}-")),
                      key=lambda name: int(name.rsplit("-", 1)[1]))

    def pod_ip(self, pod: str) -> str:
        found = self.process.wait_for_line(rf"{re.escape(SAID)} {re.escape(pod)}: created at "
                                           r"(\S+) ", 1)
        return found.group(1)

    def pid(self, pod: str, container: str) -> int:
        pids = self.process.pids(rf"{re.escape(pod)}/{container} started \(pid (\d+)\)")
        return pids[-1]

    def delete(self, pod: str) -> None:
        (self.pods_dir / pod / "delete").touch()

    def cut(self, pod: str) -> None:
        (self.pods_dir / pod / "cut").touch()

    def line_index(self) -> int:
        return len(self.process.lines)

    def wait_for(self, pattern: str, timeout_s: float, after: int = 0) -> re.Match[str]:
        return self.process.wait_for_line(pattern, timeout_s, after)

    def wait_gone(self, pod: str, timeout_s: float = 200) -> None:
        self.wait_for(rf"{re.escape(SAID)} {re.escape(pod)}: gone$", timeout_s)

    def _envoy_host_statuses(self, gateway: str, cluster_name: str,
                             priority: int | None = 0) -> list[dict[str, Any]]:
        """One gateway pod's Envoy's hosts of `cluster_name` at `priority` (0: the ready
        pods; 1: every pod again, for a leaving one's sequences; None: both), its admin
        interface answering on the pod's loopback only."""
        done = subprocess.run(["ip", "netns", "exec", f"srk-{gateway}", "wget", "-q", "-O-",
                               "http://127.0.0.1:9901/clusters?format=json"],
                              capture_output=True, text=True, timeout=10, check=True)
        return [host for cluster in json.loads(done.stdout).get("cluster_statuses", [])
                if cluster.get("name") == cluster_name
                for host in cluster.get("host_statuses", [])
                if priority is None or int(host.get("priority", 0)) == priority]

    def envoy_hosts(self, gateway: str, cluster_name: str = "triton",
                    priority: int = 0) -> dict[str, list[str]]:
        """What one gateway pod's Envoy thinks of each Triton at `priority` (0: the ready
        ones): address -> health flags."""
        return {host["address"]["socket_address"]["address"]:
                sorted(k for k, v in host.get("health_status", {}).items() if v is True)
                for host in self._envoy_host_statuses(gateway, cluster_name, priority)}

    def calls_under_way(self, pod_ip: str, cluster_name: str = "triton") -> int:
        """The calls the ready gateway pods' Envoys have under way on the Triton at `pod_ip`."""
        return sum(int(stat.get("value", 0)) for gateway in self.ready_pods("gateway")
                   for host in self._envoy_host_statuses(gateway, cluster_name, None)
                   if host["address"]["socket_address"]["address"] == pod_ip
                   for stat in host.get("stats", []) if stat.get("name") == "rq_active")

    def connection_counters(self, gateway: str) -> str:
        """Why a gateway pod's client connections ended, for a failing test's message: its
        Envoy's non-zero downstream, HTTP/2 and overload counters and its namespace's TCP
        resets and aborts (whatever sent a reset leaves a trace in one of them)."""
        namespace = ["ip", "netns", "exec", f"srk-{gateway}"]
        stats = subprocess.run([*namespace, "wget", "-q", "-O-", "http://127.0.0.1:9901/stats"],
                               capture_output=True, text=True, timeout=10, check=False).stdout
        envoy = [line for line in stats.splitlines()
                 if re.search(r"downstream_cx_destroy|downstream_cx_overflow|http2\.|overload\.|"
                              r"keepalive|downstream_rq_rx_reset|cx_protocol_error", line)
                 and not line.endswith(": 0") and "refresh_interval_delay" not in line]
        return f"{gateway}: " + ", ".join(envoy + tcp_counters(namespace))

    def settled(self, tritons: int, timeout_s: float = 300) -> list[str]:
        """Waits until `tritons` GPU pods are ready and every ready gateway pod's Envoy has
        each of them, healthy (the DNS cache can take its TTL); returns the GPU pods."""

        def check() -> object:
            pods = self.ready_pods("triton")
            if len(pods) != tritons:
                return f"ready GPU pods {pods}"
            ips = {self.pod_ip(p) for p in pods}
            for gateway in self.ready_pods("gateway"):
                hosts = self.envoy_hosts(gateway)
                healthy = {ip for ip, flags in hosts.items() if not flags}
                if healthy != ips:
                    return f"{gateway} has {hosts}, wants {sorted(ips)} healthy"
            return True

        until("the cluster to settle", check, timeout_s, every_s=1)
        return self.ready_pods("triton")

    def dns_ttl_left(self, service: str = "triton-pods", namespace: str = "sonic-ray") -> int:
        """How long the cluster DNS's cache still answers for a Service's name: the TTL of
        its answer (the cache counts it down), 0 when it holds no answer."""
        name = f"{service}.{namespace}.svc.cluster.local"
        query = struct.pack(">HHHHHH", 0x5352, 0x0100, 1, 0, 0, 0) + b"".join(
            bytes([len(part)]) + part.encode() for part in name.split(".")) + b"\0\0\1\0\1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.settimeout(2)
            udp.sendto(query, (str(BRIDGE_IP), 53))
            answer = udp.recv(4096)
        if struct.unpack(">H", answer[6:8])[0] == 0:
            return 0
        offset = len(query)  # the question, echoed; then the first answer's name pointer
        return int(struct.unpack(">I", answer[offset + 6:offset + 10])[0])

    def ready_pods(self, kind: str) -> list[str]:
        """Pods whose last readiness line says ready."""
        state: dict[str, bool] = {}
        for line in self.process.lines:
            match = re.match(rf"{re.escape(SAID)} ({kind}-\d+): (ready|not ready|gone)", line)
            if match:
                state[match.group(1)] = match.group(2) == "ready"
        return sorted(p for p, ready in state.items() if ready)


def tcp_counters(namespace: list[str] | None = None) -> list[str]:
    """A network namespace's non-zero TCP reset and abort counters (this machine's: None)."""
    done = subprocess.run([*(namespace or []), "nstat", "-az", "TcpEstabResets", "TcpOutRsts",
                           "TcpExtTCPAbort*", "TcpExtListen*"],
                          capture_output=True, text=True, timeout=10, check=False)
    return [" ".join(line.split()[:2]) for line in done.stdout.splitlines()
            if line[:1].isalpha() and line.split()[1:2] != ["0"]]


@contextmanager
def running_cluster(env: dict[str, str], timeout_s: float = 900) -> Iterator[Cluster]:
    process = StackProcess(env, module="local_stack.cluster")
    try:
        found = process.wait_for_line(READY_LINE, timeout_s=timeout_s)
        yield Cluster(process, found.group(1), Path(found.group(3)))
    finally:
        process.stop(timeout_s=120)


@dataclass
class Calls:
    """What a load run saw: per kind, each call's (start, status, seconds)."""

    by_kind: dict[str, list[tuple[float, str, float]]] = field(default_factory=dict)

    def add(self, kind: str, started: float, status: str) -> None:
        self.by_kind.setdefault(kind, []).append((started, status, time.monotonic() - started))

    def failed(self) -> list[tuple[str, float, str, float]]:
        return [(kind, *call) for kind, calls in self.by_kind.items() for call in calls
                if call[1] != "OK"]

    def count(self, kind: str | None = None) -> int:
        return sum(len(c) for k, c in self.by_kind.items() if kind in (None, k))

    def summary(self) -> str:
        return "; ".join(f"{kind}: {len(calls)} calls, "
                         f"{sum(1 for c in calls if c[1] != 'OK')} failed"
                         for kind, calls in sorted(self.by_kind.items()))


def _simple() -> list[object]:
    ones = np.ones((1, 16), dtype=np.int32)
    return list(simple_inputs(ones, ones))


async def mixed_load(cluster: Cluster, stop: asyncio.Event, calls: Calls, grpc_clients: int = 4,
                     http_clients: int = 2, stream_clients: int = 2, model: str = "simple",
                     slow_s: float = 0.0, deadline_s: float = DEADLINE_S,
                     pause_s: float = 0.0) -> None:
    """Callers in a loop until `stop`: gRPC unary, HTTP (JSON), ModelStreamInfer streams of a
    few responses; each client on a connection of its own through the Service IP, pausing
    `pause_s` after each unary call (0: back to back, as much as 2 cores carry)."""

    async def unary_loop(kind: str, call: Callable[[], Awaitable[object]],
                         failures: tuple[type[Exception], ...],
                         describe: Callable[[Exception], str]) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                await call()
                calls.add(kind, started, "OK")
            except failures as error:
                calls.add(kind, started, describe(error))
                await asyncio.sleep(0.05)
            if pause_s:
                await asyncio.sleep(pause_s)

    def grpc_status(error: Exception) -> str:
        assert isinstance(error, InferenceServerException)
        return f"{error.status()}: {error.message()}"

    async def grpc_caller() -> None:
        client = tc_aio.InferenceServerClient(cluster.grpc_url, channel_args=OWN_CONNECTION)

        async def infer() -> None:
            inputs = ([tensor("SECONDS", np.array([slow_s], dtype=np.float32), "FP32")]
                      if model == "slow" else _simple())
            await client.infer(model, inputs, client_timeout=deadline_s)

        try:
            await unary_loop("grpc", infer, (InferenceServerException,), grpc_status)
        finally:
            await client.close()

    async def http_caller() -> None:
        client = http_aio.InferenceServerClient(cluster.http_url, conn_limit=1)

        async def infer() -> None:
            ones = np.ones((1, 16), dtype=np.int32)
            inputs = [http_aio.InferInput("INPUT0", [1, 16], "INT32"),
                      http_aio.InferInput("INPUT1", [1, 16], "INT32")]
            for item in inputs:
                item.set_data_from_numpy(ones, binary_data=False)
            await client.infer("simple", inputs, timeout=int(deadline_s))

        try:
            await unary_loop("http", infer,
                             (InferenceServerException, aiohttp.ClientError, OSError),
                             lambda error: f"{type(error).__name__}: {error}")
        finally:
            await client.close()

    async def stream_caller() -> None:
        client = tc_aio.InferenceServerClient(cluster.grpc_url, channel_args=OWN_CONNECTION)
        try:
            while not stop.is_set():
                started = time.monotonic()
                values = np.arange(4, dtype=np.int32)
                inputs = [tensor("IN", values, "INT32"),
                          tensor("DELAY", np.full(4, 200, dtype=np.uint32), "UINT32"),
                          tensor("WAIT", np.array([0], dtype=np.uint32), "UINT32")]

                async def requests(inputs: list[object] = inputs) -> object:
                    yield {"model_name": "repeat_int32", "inputs": inputs}

                status, got = "OK", 0
                try:
                    async for _result, error in client.stream_infer(requests(),
                                                                   stream_timeout=deadline_s):
                        if error is not None:
                            status = f"{error.status()}: {error.message()}"
                            break
                        got += 1
                        if got == len(values):
                            break
                except InferenceServerException as error:
                    status = f"{error.status()}: {error.message()}"
                except grpc.aio.AioRpcError as error:
                    status = f"{error.code().name}: {error.details()}"
                if status == "OK" and got != len(values):
                    status = f"stream ended after {got} of {len(values)} responses"
                calls.add("stream", started, status)
        finally:
            await client.close()

    await asyncio.gather(*(grpc_caller() for _ in range(grpc_clients)),
                         *(http_caller() for _ in range(http_clients)),
                         *(stream_caller() for _ in range(stream_clients)))


def under_load(cluster: Cluster, during: object, **options: object) -> Calls:
    """Runs `during()` (a blocking function) in a thread while mixed load flows, then stops."""
    calls = Calls()

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.ensure_future(mixed_load(cluster, stop, calls, **options))  # type: ignore[arg-type]
        await asyncio.sleep(2)
        try:
            await asyncio.to_thread(during)  # type: ignore[arg-type]
        finally:
            stop.set()
            await task

    asyncio.run(main())
    return calls


__all__ = ["Calls", "Cluster", "mixed_load", "running_cluster", "under_load", "until"]
