"""`make local`: real Tritons, Ray Serve and (on the default gateway path) Envoy on this
machine, run with the same Serve and Envoy configs as the cluster, until Ctrl-C or SIGTERM.

Environment: DATA_PATH (gateway | serve), TRITONS (simulated pods, 1), MODEL_REPOSITORY,
GRPC_PORT / HTTP_PORT (8001 / 8000, the clients' endpoints), TRITON_HTTP_PORT / TRITON_GRPC_PORT /
TRITON_METRICS_PORT / POD_READY_PORT (8100 / 8101 / 8102 / 8103, plus 10 per further pod),
SERVE_GRPC_PORT (9000,
gateway path), SERVE_HTTP_PORT (9080, gateway path), GATEWAY_METRICS_PORT (9902), GATEWAY_ADMIN_PORT
(9901, loopback), OBSERVE (1: a Prometheus scraping the stack, make observe) and
PROMETHEUS_PORT (9090), RAY_GCS_PORT (6379), RAY_DASHBOARD_PORT (8265), SERVE_CONFIG, TRITON_ARGS,
SONIC_RAY_ADMIN_KEY (random when unset), SONIC_RAY_AUTH_TOKENS_FILE, RAY_AUTH_TOKEN (Ray runs
with token authentication as in the cluster; random when unset), PREWARM_DIR (where the
policy reads a pre-warm request, `make prewarm DIR=`; the stack's own when unset), POD_IDLE_S
(min_replicas 0: how long a pod holds no replica before it goes).

A simulated pod is a Ray node with one `triton` resource beside its own Triton. On the
gateway path a pod is in discovery (the list Envoy balances over) while its Triton is ready
and Serve holds a replica on its node, as the headless Service lists a ready worker pod.
`touch <workdir>/pods/<i>/delete` does to pod i's Triton what deleting the pod does: out of
discovery, the preStop wait until Envoy has dropped it, SIGTERM (Triton completes its calls);
then the pod's new Triton starts. With `min_replicas: 0` no pod runs at first: pods start and
stop as Serve wants replicas (local_stack/autoscaler.py), up to TRITONS, idle ones going after
POD_IDLE_S.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import yaml

from gateway import jwt, tenant_shares
from gateway import local as gateway
from gateway.routes import HTTP_CLUSTER
from local_stack import gateway_config, ports, prometheus, ray_cluster, triton
from local_stack.autoscaler import PodOwner
from local_stack.gateway_config import gateway_env
from local_stack.polling import until
from local_stack.processes import (
    Supervisor,
    free_orphaned_regions,
    run_until_signalled,
    say_line,
    set_parent_death_signal,
    terminate,
)
from local_stack.settings import Settings
from tools import certificates
from triton_pod.access import ADMIN_KEY_ENV, TokenCheck
from triton_pod.pod_ready import READY_PATH
from triton_pod.rpcs import SERVICE

READY_TIMEOUT_S = 600.0
# The Triton container's readinessProbe timeoutSeconds (base/rayservice.yaml).
POD_READY_TIMEOUT_S = 2.0


# Every line the stack prints starts so; the `ready` line (READY) is the contract that `make
# local`'s users and the test harness wait for.
SAID = "[local]"
READY = "ready:"


# make local stops within this many seconds of Ctrl-C or SIGTERM, whatever it runs (the tests
# hold every stack they start to it: local_stack/harness.py); the graces below fit in it.
STOP_LIMIT_S = 20
# What each process of a pod, Envoy and Prometheus get between SIGTERM and SIGKILL, all at
# once; then the head's.
STOP_GRACE_S = 8
HEAD_GRACE_S = 5


def say(message: str) -> None:
    say_line(f"{SAID} {message}")


def _wait(what: str, check: Callable[[], Any], timeout_s: float,
          alive: Callable[[], None]) -> None:
    def checked() -> Any:
        alive()  # a process of the stack that died ends the wait at once
        return check()

    try:
        until(what, checked, timeout_s, every_s=0.5, note=say)
    except TimeoutError as error:
        raise SystemExit(str(error)) from None


def server_ready(port: int, metadata: tuple[tuple[str, str], ...] = (),
                 channel: grpc.Channel | None = None) -> Any:
    """True once Triton (or the clients' endpoint) at `port` answers ready, else why not."""
    if channel is None:
        with grpc.insecure_channel(f"localhost:{port}") as own:
            return server_ready(port, metadata, own)
    try:
        # No progress line may contain the word the final line is known by.
        answer = channel.unary_unary(f"/{SERVICE}/ServerReady")(b"", timeout=2,
                                                               metadata=metadata)
        return True if answer == b"\x08\x01" else "models still loading"
    except grpc.RpcError as error:
        return f"{error.code().name}: {error.details()}"


def tls_channel(port: int, files: certificates.Files, host: str = "localhost") -> grpc.Channel:
    """A channel as a client of `make local TLS=1` opens one: trusting the stack's CA and
    presenting its client certificate (which only MTLS=1 asks for)."""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=files.ca.read_bytes(), private_key=files.client_key.read_bytes(),
        certificate_chain=files.client_cert.read_bytes())
    return grpc.secure_channel(f"{host}:{port}", credentials)


def tls_context(files: certificates.Files) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(files.ca))
    context.load_cert_chain(str(files.client_cert), str(files.client_key))
    return context


def http_ready(port: int, headers: tuple[tuple[str, str], ...] = (), host: str = "localhost",
               context: ssl.SSLContext | None = None, path: str = "/v2/health/ready",
               timeout: float = 2.0) -> Any:
    """True once the HTTP endpoint at `port` answers `path` (Triton's readiness unless told)
    with 200, else why not: the answer's own words where it gives some (over TLS with
    `context`)."""
    scheme = "https" if context is not None else "http"
    request = urllib.request.Request(f"{scheme}://{host}:{port}{path}", headers=dict(headers))
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return True if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as error:
        words = error.read().decode(errors="replace").strip()
        return f"HTTP {error.code} on {port}" + (f": {words}" if words else "")
    except (urllib.error.URLError, OSError) as error:
        return f"HTTP on {port}: {error}"


class JwksFollower:
    """The gateway's token checks (gateway/jwt.py) as JWKS_FILE, JWT_ISSUER and JWT_AUDIENCE
    set them, off without them; the file rewritten when JWKS_FILE changes, as an identity
    provider rotates its keys."""

    def __init__(self, settings: Settings, folder: Path) -> None:
        self.settings = settings
        self.path = folder / jwt.JWT_AUTHN_FILE
        folder.mkdir(parents=True, exist_ok=True)
        self._seen: str | None = None

    def write(self) -> None:
        self._seen = gateway_config.write_token_checks(self.settings, self.path)

    def follow(self) -> None:
        s = self.settings
        if s.jwks_file is None:
            return
        try:
            text = s.jwks_file.read_text()
        except OSError as error:
            text = f"unreadable: {error}"
        if text == self._seen:
            return
        self._seen = text
        try:
            jwt.check_jwks(text)
        except ValueError as error:
            say(f"gateway: JWKS_FILE unusable ({error}); the last good keys stay")
            return
        jwt.write(self.path, s.jwt, text)
        say("gateway: JWKS_FILE changed; the token checks use its keys now")


def write_gateway_config(s: Settings, endpoints_file: Path, http_endpoints_file: Path,
                         tls_folder: Path, access_log: Path | None,
                         ) -> tuple[Path, JwksFollower]:
    """Envoy's config for these settings beside the endpoints files (which discovery writes),
    with the token checks' and tenant shares' configs it discovers from their folder: the
    config's path, and what follows JWKS_FILE."""
    jwks = JwksFollower(s, gateway_config.jwt_folder(endpoints_file))
    jwks.write()
    tenant_shares.write(gateway_config.jwt_folder(endpoints_file) / tenant_shares.SHARES_FILE,
                        s.tenant_shares())
    config_path = endpoints_file.parent / "envoy.yaml"
    config_path.write_text(yaml.safe_dump(gateway_config.local_config(
        s, endpoints_file, http_endpoints_file, tls_folder, access_log)))
    return config_path, jwks


class Discovery:
    """Gateway path: which Tritons Envoy may call, rewritten as pods become ready or go.
    A pod is listed while its replica says it is ready (its Triton ready, its models warm), Serve
    runs that replica and the pod is not being deleted: what the headless Service `triton-pods`
    lists in the cluster; every pod, at priority 1, as `triton-all-pods` does."""

    def __init__(self, stack: LocalStack) -> None:
        self._stack = stack
        self.path = stack.workdir / "gateway" / "endpoints.json"
        self.http_path = stack.workdir / "gateway" / "endpoints-http.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.listed: set[int] = set()
        # Polled twice a second: each replica process's Triton read from its environment once.
        self._pod_of_pid: dict[int, int | None] = {}
        self._replica_pods: set[int] = set()
        self._unanswered = False
        self._write([])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="discovery", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _write(self, ready: list[int]) -> None:
        """The ready pods at priority 0; every pod, with its holding ports for Envoy's checks,
        at priority 1 (what `triton-all-pods` lists: publishNotReadyAddresses)."""
        s = self._stack.settings
        every = range(s.tritons)
        gateway.write_endpoints(self.path, [s.triton(i).grpc for i in ready], every_pod=[
            (s.triton(i).grpc, s.pod_holding_ports(i)[1]) for i in every])
        gateway.write_endpoints(self.http_path, [s.triton(i).http for i in ready], HTTP_CLUSTER,
                                every_pod=[(s.triton(i).http, s.pod_holding_ports(i)[0])
                                           for i in every])

    def replica_pods(self) -> set[int]:
        """The pods where Serve runs a replica now, or stops one: a stopping replica's pod
        stays Ready until its readiness says otherwise, as the kubelet's probe of it sees it
        (a replica leaving with live sequences answers ready for a moment more:
        serve/triton_pod/pod.py HANDOVER_S). While the
        dashboard does not answer, the last answer: in the cluster a pod's readiness comes from
        its node's Serve proxy (KubeRay's readiness probe), so a slow dashboard changes nothing
        that the Service lists."""
        s = self._stack.settings
        try:
            found = ray_cluster.replicas(self._stack.dashboard, s.ray_token)
        except (urllib.error.URLError, OSError, ValueError) as error:
            if not self._unanswered:
                say(f"gateway discovery: Ray's dashboard did not answer ({error}); "
                    f"pods {sorted(self._replica_pods)} stay as they were")
            self._unanswered = True
            return set(self._replica_pods)
        self._unanswered = False
        by_address = {f"localhost:{s.triton(i).grpc}": i for i in range(s.tritons)}
        pods = set()
        for replica in found:
            if replica.get("state") in ("RUNNING", "STOPPING"):
                pid = int(replica.get("pid") or 0)
                if self._pod_of_pid.get(pid) is None:
                    address = ray_cluster.replica_triton_address(pid)
                    self._pod_of_pid[pid] = by_address.get(address or "")
                pod = self._pod_of_pid[pid]
                if pod is not None:
                    pods.add(pod)
        self._replica_pods = pods
        return pods

    def _run(self) -> None:
        s = self._stack.settings
        while not self._stop.wait(0.5):
            self._stack.check_deletions()
            if self._stack.jwks is not None:
                self._stack.jwks.follow()
            with_replica = self.replica_pods()
            ready = {i for i in with_replica
                     if not self._stack.tritons[i].retiring
                     and http_ready(s.pod_ready_port(i), host="127.0.0.1", path=READY_PATH,
                                    timeout=POD_READY_TIMEOUT_S) is True}
            if ready != self.listed:
                self._write(sorted(ready))
                say(f"gateway discovery: pods {sorted(ready)} "
                    f"(Triton gRPC ports {[s.triton(i).grpc for i in sorted(ready)]})")
                self.listed = ready


class LocalStack:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # The Ray nodes' ports are drawn before the Tritons bind theirs: never one of those.
        ports.reserve(settings.ports_in_use())
        self.workdir = Path(tempfile.mkdtemp(prefix="sonic-ray-"))
        if settings.prewarm_dir is None:
            self.settings = settings = dataclasses.replace(
                settings, prewarm_dir=self.workdir / "prewarm")
        self.dashboard = f"http://127.0.0.1:{settings.dashboard_port}"
        # Opens Triton's restricted RPCs; only Triton, the forwarder and Envoy ever see it.
        self.admin_key = os.environ.get(ADMIN_KEY_ENV) or secrets.token_hex(16)
        self._backends = triton.prepare_backends(self.workdir / "backends")
        free_orphaned_regions()  # what an earlier run killed as a whole left behind
        # Pod i's Triton; with pods on demand, a new one each time the pod starts.
        self.tritons = [self._new_triton(i) for i in range(settings.tritons)]
        for i in range(settings.tritons):
            (self.workdir / "pods" / str(i)).mkdir(parents=True)
        self.ray: subprocess.Popen[bytes] | None = None
        # Pod i's Ray node, while it runs.
        self.pod_nodes: dict[int, subprocess.Popen[bytes]] = {}
        self.autoscaler: PodOwner | None = None
        self._stopping = threading.Event()
        self.envoy: Supervisor | None = None
        # The gateway's access log, apart from Envoy's own messages (envoy.log).
        self.access_log = self.workdir / "gateway-access.log"
        self.prometheus: subprocess.Popen[bytes] | None = None
        self.discovery: Discovery | None = None
        self.jwks: JwksFollower | None = None
        # With TLS=1: the CA, client certificate and key a client of this stack uses.
        self.client_tls: certificates.Files | None = None

    def _new_triton(self, index: int) -> triton.TritonSupervisor:
        s = self.settings
        return triton.TritonSupervisor(
            index, triton.command(s.model_repository, self._backends, s.triton(index),
                                  self.admin_key, s.triton_args),
            self.workdir / f"triton-{index}.log", say)

    def alive(self) -> None:
        for name, process in [("Ray", self.ray), ("Prometheus", self.prometheus),
                              *((f"pod {i}'s Ray node", p)
                                for i, p in list(self.pod_nodes.items()))]:
            if process is not None and process.poll() is not None:
                raise SystemExit(f"{name} exited with status {process.returncode}; "
                                 f"see the logs in {self.workdir}")

    def start(self) -> None:
        s = self.settings
        say(f"data path: {s.data_path}; {s.tritons} simulated pod(s); "
            f"model repository: {s.model_repository}")
        self._start_ray()
        if not s.on_demand:
            # After Ray: a raylet has 30 s to register, which Tritons loading on two cores can
            # eat.
            for supervisor in self.tritons:
                supervisor.start()
        if s.data_path == "gateway":
            self._start_gateway()
        self._deploy_serve()
        if s.on_demand:
            self._wait_for_control_plane()
            self._start_autoscaler()
        else:
            _wait("the Tritons to load their models",
                  lambda: all(server_ready(s.triton(i).grpc) is True for i in range(s.tritons))
                  or "not every Triton is ready", READY_TIMEOUT_S, self.alive)
            say(f"Triton has loaded its models; waiting for {s.client_port_owner} to answer")
            self._wait_for_clients_endpoint()
        if s.observe:
            self._start_prometheus()
        self._print_endpoints()
        if self.client_tls is not None:
            f = self.client_tls
            say(f"tls: ca {f.ca} client-cert {f.client_cert} client-key {f.client_key}")
            say(f"tls: call with -u localhost:{s.grpc_port} --ssl --root-certificates {f.ca}"
                + (f" --private-key {f.client_key} --certificate-chain {f.client_cert}"
                   if s.mtls else "")
                + " (gRPC), or https://localhost:" + str(s.http_port)
                + (" (the client certificate required)" if s.mtls else ""))
        if s.jwt is not None:
            say(f"jwt: calls need `authorization: Bearer <JWT>` signed by a key of "
                f"{s.jwt.jwks_uri or s.jwks_file}, "
                f"iss {s.jwt.issuer}, aud {','.join(s.jwt.audiences)}")
        say(f"pre-warm: make prewarm PODS=<n> UNTIL=<time> DIR={s.prewarm_dir}")
        if s.on_demand:
            say(f"{READY} the gateway answers at localhost:{s.grpc_port} (gRPC) and "
                f"localhost:{s.http_port} (HTTP); no Triton runs (min_replicas 0): the first "
                f"call starts a simulated GPU pod (up to {s.tritons}, TRITONS), its Triton "
                "answering once ready; until then the gateway answers each call at once")
        else:
            say(f"{READY} Triton answers ServerReady through {s.client_port_owner} "
                f"at localhost:{s.grpc_port}, and HTTP at localhost:{s.http_port}")

    def _start_ray(self) -> None:
        s = self.settings
        self.ray = ray_cluster.start_head(s, self.workdir, self.admin_key)
        say(f"starting Ray (pid {self.ray.pid}, GCS {s.gcs_port}, dashboard "
            f"{s.dashboard_port}), log: {self.workdir / 'ray.log'}")

        _wait("Ray to start", lambda: ray_cluster.dashboard_answers(self.dashboard, s.ray_token),
              180, self.alive)
        if not s.on_demand:
            for i in range(s.tritons):
                self.pod_nodes[i] = self._start_pod_node(i)

    def _start_pod_node(self, index: int) -> subprocess.Popen[bytes]:
        """One at a time, and again if it timed out registering on a busy machine."""
        s = self.settings
        log = self.workdir / f"ray-pod-{index}.log"
        for attempt in range(3):
            # The log is appended to: a pod started again must not read its last start's line.
            offset = log.stat().st_size if log.exists() else 0
            node = ray_cluster.start_pod_node(s, index, self.workdir, self.admin_key)
            deadline = time.monotonic() + 120
            while node.poll() is None and time.monotonic() < deadline:
                if self._stopping.is_set():
                    terminate(node, grace_s=10)
                    raise SystemExit("the stack is stopping")
                with open(log, "rb") as text:
                    text.seek(offset)
                    started = b"Ray runtime started." in text.read()
                if started:
                    say(f"pod {index}: Ray node started (pid {node.pid}) beside Triton {index} "
                        f"(gRPC {s.triton(index).grpc})")
                    return node
                time.sleep(0.5)
            terminate(node, grace_s=10)
            say(f"pod {index}: Ray node did not start (attempt {attempt + 1}); see {log}")
        raise SystemExit(f"pod {index}'s Ray node never started; see {log}")

    def _start_autoscaler(self) -> None:
        """Pods on demand (min_replicas 0): started and stopped as Serve wants replicas."""
        s = self.settings
        discovery = self.discovery
        assert discovery is not None  # on_demand is the gateway path's (Settings)

        def wanted() -> int | None:
            try:
                deployment = ray_cluster.deployment_of(
                    ray_cluster.application(self.dashboard, s.ray_token))
            except (urllib.error.URLError, OSError, ValueError):
                return None
            target = deployment.get("target_num_replicas")
            return int(target) if target is not None else None

        owner = self.autoscaler = PodOwner(
            slots=s.tritons, idle_s=s.pod_idle_s, wanted=wanted,
            holding=discovery.replica_pods, start_pod=self._start_pod,
            stop_pod=self._stop_pod, say=say)

        def run() -> None:
            while not self._stopping.wait(1.0):
                owner.step()

        threading.Thread(target=run, name="autoscaler", daemon=True).start()

    def _start_pod(self, index: int) -> Callable[[], object]:
        """A GPU pod the autoscaler adds: its Ray node, then its Triton (a new container)."""
        node = self._start_pod_node(index)
        self.pod_nodes[index] = node
        self._metrics_targets_changed()
        supervisor = self.tritons[index] = self._new_triton(index)
        supervisor.start()
        return node.wait

    def _stop_pod(self, index: int) -> None:
        """A GPU pod the autoscaler removes, holding no replica (so out of discovery): its
        containers told at once, as the kubelet does."""
        node = self.pod_nodes.pop(index, None)
        self._metrics_targets_changed()
        stoppers = [self.tritons[index].stop]
        if node is not None:
            stoppers.append(functools.partial(terminate, node, grace_s=20))
        threads = [threading.Thread(target=stopper, name="stopping") for stopper in stoppers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _start_gateway(self) -> None:
        s = self.settings
        self.discovery = Discovery(self)
        if s.tls:
            self.client_tls, _ = certificates.write_local(self.workdir / "tls")
        config_path, self.jwks = write_gateway_config(
            s, self.discovery.path, self.discovery.http_path, self.workdir / "tls",
            self.access_log)
        # Supervised: the gateway's Deployment has the kubelet restart a crashed Envoy, and
        # Envoy 1.40 has been seen to abort once at start (gRPC's epoll poller, EBADF).
        self.envoy = Supervisor("gateway: Envoy", gateway.command(config_path),
                                self.workdir / "envoy.log",
                                lambda: gateway_env(s, self.admin_key), say)
        self.envoy.start()
        say(f"gateway: Envoy listens on {s.grpc_port} (gRPC) and {s.http_port} (HTTP); "
            f"access log (a JSON line per call): {self.access_log}")
        self.discovery.start()

    def metrics_targets(self) -> dict[str, list[int]]:
        """Every exporter's port, by the name of the cluster's metrics Service."""
        s = self.settings
        nodes = [n for n in [self.ray, *self.pod_nodes.values()] if n is not None]
        return {
            "triton-metrics": [s.triton(i).metrics for i in range(s.tritons)],
            "gateway-metrics": [s.gateway_metrics_port] if s.data_path == "gateway" else [],
            "ray-metrics": [ray_cluster.metrics_export_port(node) for node in nodes],
        }

    def _metrics_targets_changed(self) -> None:
        """A pod started or stopped: Prometheus follows (with make observe)."""
        if self.prometheus is not None and self.prometheus.poll() is None:
            prometheus.write_targets(self.workdir / "prometheus", self.metrics_targets())

    def _start_prometheus(self) -> None:
        s = self.settings
        self.prometheus = prometheus.start(self.metrics_targets(), s.prometheus_port,
                                           self.workdir)
        say(f"prometheus: started (pid {self.prometheus.pid}) on {s.prometheus_port}, "
            f"log: {self.workdir / 'prometheus.log'}")

    def _deploy_serve(self) -> None:
        say("Ray is up; deploying the Serve config")
        try:
            ray_cluster.deploy(self.settings)
        except urllib.error.HTTPError as error:
            raise SystemExit(f"Ray refused the Serve config: {error.read().decode()}") from None
        except (urllib.error.URLError, OSError) as error:
            raise SystemExit(f"could not deploy the Serve config: {error}") from None

    def _wait_for_control_plane(self) -> None:
        """With no GPU pod (min_replicas 0): ready once Envoy is, Serve runs the application
        and the policy answers the gateway's start-of-job gate. Never a call on the clients'
        ports: the gateway would count it as demand and start a GPU pod."""
        s = self.settings
        admin = f"http://127.0.0.1:{s.gateway_admin_port}/ready"

        def control_plane() -> Any:
            try:
                with urllib.request.urlopen(admin, timeout=2) as response:
                    if response.status != 200:
                        return f"Envoy's /ready: HTTP {response.status}"
            except (urllib.error.URLError, OSError) as error:
                return f"Envoy's /ready: {error}"
            running = ray_cluster.applications_running(self.dashboard, s.ray_token)
            if running is not True:
                return running
            return ray_cluster.policy_answers("127.0.0.1", s.admission_port)

        _wait("the gateway and the control plane (no Triton at min_replicas 0)", control_plane,
              READY_TIMEOUT_S, self.alive)

    def _wait_for_clients_endpoint(self) -> None:
        s = self.settings
        # With token authentication on, the stack's own call needs a token like any client's.
        try:
            tokens = TokenCheck.from_env()
        except RuntimeError as error:
            raise SystemExit(str(error)) from None
        credentials = tokens.credentials() if tokens is not None else ()

        files = self.client_tls
        # With only JWTs accepted the stack holds no credential (it has the keys' public
        # half): the gateway refusing it for want of a token, with a Triton in its rotation,
        # is the answer that says calls with a token pass.
        refused_only = s.jwt is not None and not credentials
        unauthenticated = f"{grpc.StatusCode.UNAUTHENTICATED.name}: "

        def clients_endpoint_ready() -> Any:
            if files is None:
                answer = server_ready(s.grpc_port, credentials)
            else:
                with tls_channel(s.grpc_port, files) as channel:
                    answer = server_ready(s.grpc_port, credentials, channel)
            if refused_only and str(answer).startswith(unauthenticated):
                answer = (True if gateway.upstream_ports(s.gateway_admin_port, healthy_only=True)
                          else "no Triton in the gateway's rotation yet")
            elif answer is True:
                answer = http_ready(s.http_port, credentials,
                                    context=tls_context(files) if files is not None else None)
            if answer is True:
                return True
            try:
                apps = ray_cluster.http("GET", f"{self.dashboard}/api/serve/applications/",
                                        s.ray_token)
                for app in apps["applications"].values():
                    if app.get("status") == "DEPLOY_FAILED":
                        raise SystemExit(f"Serve could not deploy: {app.get('message')}")
                states = {name: app.get("status") for name, app in apps["applications"].items()}
                return f"{answer}; applications: {states}"
            except (urllib.error.URLError, OSError, KeyError) as error:
                return f"{answer}; {error}"

        _wait(f"the Triton protocol through {s.client_port_owner}", clients_endpoint_ready,
              READY_TIMEOUT_S, self.alive)

    def _print_endpoints(self) -> None:
        s = self.settings
        lines = [f"  Triton protocol, the clients' endpoints: gRPC localhost:{s.grpc_port} "
                 f"({s.client_port_owner}), HTTP localhost:{s.http_port} ({s.http_port_owner})"]
        for i in range(s.tritons):
            t = s.triton(i)
            lines.append(f"  pod {i} Triton: gRPC localhost:{t.grpc}, HTTP localhost:{t.http}, "
                         f"metrics http://localhost:{t.metrics}/metrics")
        if s.data_path == "gateway":
            lines.append(f"  gateway metrics: http://localhost:{s.gateway_metrics_port}"
                         "/stats/prometheus; Envoy admin (loopback): "
                         f"http://127.0.0.1:{s.gateway_admin_port}")
        if s.data_path == "gateway":
            lines.append(f"  Serve's HTTP proxy (no client calls): localhost:{s.serve_http_port}")
        targets = self.metrics_targets()
        lines.append("  metrics for Prometheus: " + "; ".join(
            f"{job} " + ", ".join(f"localhost:{p}" for p in ports)
            for job, ports in targets.items() if ports))
        if s.observe:
            lines.append(f"  Prometheus (scraping those, with the alerts loaded): "
                         f"http://localhost:{s.prometheus_port}")
        lines.append(f"  Ray dashboard: http://127.0.0.1:{s.dashboard_port}")
        print("endpoints:\n" + "\n".join(lines), flush=True)

    def check_deletions(self) -> None:
        for supervisor in self.tritons:
            marker = self.workdir / "pods" / str(supervisor.index) / "delete"
            if marker.exists() and not supervisor.retiring:
                marker.unlink()
                threading.Thread(target=supervisor.retire, args=(
                    lambda index=supervisor.index: self._until_gateway_dropped(index),),
                    daemon=True).start()

    def _until_gateway_dropped(self, index: int) -> None:
        """The preStop's wait: until Envoy no longer balances over this Triton."""
        port = self.settings.triton(index).grpc
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if port not in gateway.upstream_ports(self.settings.gateway_admin_port):
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        say(f"triton {index}: still in Envoy's list after 30 s; stopping it anyway")

    def run_until_stopped(self, stop: threading.Event) -> None:
        while not stop.wait(1.0):
            self.alive()

    def stop(self) -> None:
        """Within STOP_LIMIT_S of the signal: every pod's processes, Envoy and Prometheus told
        at once and waited for together, as a node's containers stop, and the head once the
        pods' Ray nodes are gone (a pod's Ray node stopped with the head gone waits out its
        whole grace period); one after the other the stop took the sum of their graces, up to
        41 s (tests/unit/test_local_stop.py)."""
        say("stopping")
        began = time.monotonic()
        self._stopping.set()
        stoppers: list[tuple[str, Callable[[], None]]] = []
        if self.discovery is not None:
            stoppers.append(("the gateway's discovery", self.discovery.stop))
        if self.prometheus is not None and self.prometheus.poll() is None:
            stoppers.append(("Prometheus", functools.partial(terminate, self.prometheus,
                                                             grace_s=STOP_GRACE_S)))
        if self.envoy is not None:
            stoppers.append(("Envoy", functools.partial(self.envoy.stop, grace_s=STOP_GRACE_S)))
        nodes = {f"pod {i}'s Ray node": node for i, node in list(self.pod_nodes.items())
                 if node.poll() is None}
        stoppers += [(name, functools.partial(terminate, node, grace_s=STOP_GRACE_S))
                     for name, node in nodes.items()]
        stoppers += [(f"Triton {i}", functools.partial(supervisor.stop, grace_s=STOP_GRACE_S))
                     for i, supervisor in enumerate(self.tritons)]
        took: dict[str, float] = {}

        def timed(name: str, stopper: Callable[[], None]) -> None:
            start = time.monotonic()
            stopper()
            took[name] = time.monotonic() - start

        threads = {name: threading.Thread(target=timed, args=(name, stopper), name="stopping")
                   for name, stopper in stoppers}
        for thread in threads.values():
            thread.start()
        # The head once the pods' Ray nodes are gone, while the Tritons may still finish.
        for name, thread in threads.items():
            if name in nodes:
                thread.join()
        if self.ray is not None and self.ray.poll() is None:
            # The head's GCS, raylet and Serve's actors outlive SIGTERM by more than 20 s
            # (measured: none had exited after 5 s); nothing of them is kept.
            timed("the Ray head", functools.partial(terminate, self.ray, grace_s=HEAD_GRACE_S))
        for thread in threads.values():
            thread.join()
        haproxy = self.workdir / "haproxy"
        if haproxy.is_symlink():
            shutil.rmtree(haproxy.resolve(), ignore_errors=True)
        slowest = sorted(took.items(), key=lambda item: -item[1])[:3]
        say(f"stopped in {time.monotonic() - began:.1f} s (slowest: "
            + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in slowest) + ")")


def main() -> int:
    # `make local` killed by SIGTERM does not pass the signal on: the kernel does.
    set_parent_death_signal()
    stack = LocalStack(Settings.from_env())

    def run(stop: threading.Event) -> None:
        stack.start()
        stack.run_until_stopped(stop)

    return run_until_signalled(run, stack.stop, say)


if __name__ == "__main__":
    sys.exit(main())
