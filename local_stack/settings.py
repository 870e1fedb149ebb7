"""What `make local` is told through its environment, checked before anything starts."""

from __future__ import annotations

import dataclasses
import os
import secrets
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.jwt import (
    AUDIENCES_ENV,
    CLOCK_SKEW_ENV,
    ISSUER_ENV,
    JWKS_CACHE_ENV,
    JWKS_URI_ENV,
    JwtSettings,
    check_jwks,
    check_jwks_uri,
)
from gateway.tenant_shares import SHARES_ENV, TENANTS_ENV, parse_shares, parse_tenant_map
from schema.serve_app import NoTritonAppError, replica_bounds
from tools.env_file import env_file
from triton_pod.admission import PORT_ENV as ADMISSION_PORT_ENV

ROOT = Path(__file__).resolve().parent.parent
SERVE_DIR = ROOT / "serve"
DEFAULT_CONFIG = SERVE_DIR / "serve-config.yaml"
DEFAULT_MODELS = ROOT / "triton" / "models"
DATA_PATHS = ("gateway", "serve")
# Triton i of TRITONS=N listens on each base port + POD_PORT_STEP * i.
POD_PORT_STEP = 10


def min_replicas(serve_config: dict[str, Any]) -> int:
    """The GPU pods' min_replicas; a config without their application is refused."""
    try:
        return replica_bounds(serve_config)[0]
    except NoTritonAppError as error:
        raise SystemExit(f"SERVE_CONFIG: {error}") from None


# The RayService whose autoscaler removes idle GPU pods (autoscalerOptions.idleTimeoutSeconds).
BASE_RAYSERVICE = ROOT / "base" / "rayservice.yaml"


def base_idle_timeout_s() -> int:
    """How long the Ray autoscaler leaves a GPU pod without a replica in the base's RayService."""
    service = yaml.safe_load(BASE_RAYSERVICE.read_text())
    options = service["spec"]["rayClusterConfig"].get("autoscalerOptions") or {}
    if "idleTimeoutSeconds" not in options:
        raise SystemExit(f"{BASE_RAYSERVICE}: spec.rayClusterConfig.autoscalerOptions has no "
                         "idleTimeoutSeconds")
    return int(options["idleTimeoutSeconds"])


def int_env(env: Mapping[str, str], name: str, default: int, low: int | None = None,
            high: int | None = None) -> int:
    """A whole-number variable (its default when unset), within [low, high] where given."""
    raw = env.get(name, "")
    try:
        value = int(raw) if raw else default
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not a whole number") from None
    if (low is not None and value < low) or (high is not None and value > high):
        raise SystemExit(f"{name}={value}: between {low} and {high}")
    return value


def switch_env(env: Mapping[str, str], name: str) -> bool:
    """An on/off variable: unset, empty or 0 is off, 1 is on, anything else an error."""
    raw = env.get(name, "")
    if raw not in ("", "0", "1"):
        raise SystemExit(f"{name}={raw!r}: 1 turns it on, 0 or nothing leaves it off")
    return raw == "1"


JWT_VARIABLES = ("JWT_ISSUER", "JWT_AUDIENCE")
# Where the keys come from: a JWKS file, or an identity provider's https address (with the CA
# that signed its certificate, JWKS_CA_FILE, when this machine's bundle does not hold it).
JWKS_SOURCES = ("JWKS_FILE", "JWKS_URI")


def _jwt_settings(env: Mapping[str, str], data_path: str) -> dict[str, Any]:
    """JWT_ISSUER, JWT_AUDIENCE and one of JWKS_FILE or JWKS_URI: all or none."""
    for name in (ISSUER_ENV, AUDIENCES_ENV, JWKS_URI_ENV):
        if env.get(name):
            raise SystemExit(f"{name}: on this machine JWT_ISSUER, JWT_AUDIENCE and JWKS_FILE "
                             "or JWKS_URI say it")
    given = [name for name in (*JWKS_SOURCES, *JWT_VARIABLES) if env.get(name)]
    if not given:
        if env.get("JWKS_CA_FILE"):
            raise SystemExit("JWKS_CA_FILE without JWKS_URI: it names the CA of the identity "
                             "provider's certificate")
        return {}
    sources = [name for name in JWKS_SOURCES if env.get(name)]
    missing = [name for name in JWT_VARIABLES if not env.get(name)] + (
        [] if sources else ["JWKS_FILE or JWKS_URI"])
    if missing:
        raise SystemExit(f"{', '.join(given)} without {', '.join(missing)}: token checks need "
                         "the keys (a JWKS file or address), the issuer and the audience")
    if len(sources) > 1:
        raise SystemExit("JWKS_FILE and JWKS_URI: the keys come from one of them")
    if data_path != "gateway":
        raise SystemExit(f"{sources[0]}: token checks are the gateway's (DATA_PATH=gateway)")
    common = {ISSUER_ENV: env["JWT_ISSUER"], AUDIENCES_ENV: env["JWT_AUDIENCE"],
              CLOCK_SKEW_ENV: env.get(CLOCK_SKEW_ENV, ""),
              JWKS_CACHE_ENV: env.get(JWKS_CACHE_ENV, "")}
    if sources == ["JWKS_URI"]:
        ca = Path(env["JWKS_CA_FILE"]).resolve() if env.get("JWKS_CA_FILE") else None
        if ca is not None and not ca.is_file():
            raise SystemExit(f"JWKS_CA_FILE={ca} is not a file")
        try:
            uri = check_jwks_uri(env["JWKS_URI"], "JWKS_URI")
            jwt = JwtSettings.from_env({**common, JWKS_URI_ENV: uri})
        except ValueError as error:
            raise SystemExit(str(error)) from None
        return {"jwt": jwt, "jwks_ca_file": ca}
    jwks_file = Path(env["JWKS_FILE"]).resolve()
    try:
        check_jwks(jwks_file.read_text())
        jwt = JwtSettings.from_env(common)
    except OSError as error:
        raise SystemExit(f"JWKS_FILE={jwks_file}: {error.strerror}") from None
    except ValueError as error:
        raise SystemExit(f"JWKS_FILE={jwks_file}: {error}") from None
    return {"jwt": jwt, "jwks_file": jwks_file}


# Admission's settings, the `admission` ConfigMap's source (gateway and Ray head).
ADMISSION_ENV_FILE = ROOT / "gateway" / "admission.env"
# Who may call, the `front-door` ConfigMap's source (the gateway).
FRONT_DOOR_ENV_FILE = ROOT / "gateway" / "front-door.env"


@dataclass(frozen=True)
class TritonPorts:
    http: int
    grpc: int
    metrics: int


@dataclass(frozen=True)
class Settings:
    data_path: str
    tritons: int
    model_repository: Path
    grpc_port: int
    http_port: int
    serve_grpc_port: int
    serve_http_port: int
    gateway_metrics_port: int
    gateway_admin_port: int
    # The control plane's answer to the gateway's start-of-job gate (serve/triton_pod/admission.py).
    admission_port: int
    # OBSERVE=1 (make observe): a Prometheus scraping the stack on prometheus_port.
    observe: bool
    prometheus_port: int
    triton_base: TritonPorts
    # Where pod i's replica answers the pod's readiness (Triton ready, models warm), as the
    # Triton container's readinessProbe asks it in the cluster: + POD_PORT_STEP * i.
    pod_ready_base: int
    gcs_port: int
    dashboard_port: int
    serve_config: Path
    triton_args: tuple[str, ...]
    # Ray's token authentication (RAY_AUTH_MODE=token), as KubeRay's authOptions turns on:
    # every call to the dashboard and GCS needs it.
    ray_token: str
    # TLS on the gateway's client listeners (components/tls); with mtls a client certificate
    # signed by the stack's CA too (components/mtls).
    tls: bool = False
    mtls: bool = False
    # Token checks against a JWKS file (JWKS_FILE, JWT_ISSUER, JWT_AUDIENCE): None when off.
    jwt: JwtSettings | None = None
    jwks_file: Path | None = None
    # JWKS_URI's provider's CA (None: this machine's bundle).
    jwks_ca_file: Path | None = None
    # Where the autoscaling policy reads an operator's pre-warm request (PREWARM_DIR; the
    # cluster's ConfigMap `prewarm`, serve/triton_pod/prewarm.py): the stack's own when unset.
    prewarm_dir: Path | None = None
    # min_replicas 0 (gateway path): the simulated pods start and stop as Serve wants them
    # (local_stack/autoscaler.py), a pod idle for pod_idle_s (POD_IDLE_S) going.
    on_demand: bool = False
    pod_idle_s: float = 60.0

    def triton(self, index: int) -> TritonPorts:
        """The ports of the Triton of simulated pod `index`."""
        step = POD_PORT_STEP * index
        base = self.triton_base
        return TritonPorts(base.http + step, base.grpc + step, base.metrics + step)

    def pod_ready_port(self, index: int) -> int:
        """Where simulated pod `index`'s replica answers the pod's readiness."""
        return self.pod_ready_base + POD_PORT_STEP * index

    def pod_holding_ports(self, index: int) -> tuple[int, int]:
        """Where simulated pod `index`'s replica answers whether it holds live sequences while
        leaving (HTTP, gRPC health): the two ports after its readiness's, in the pod's block."""
        ready = self.pod_ready_port(index)
        return ready + 1, ready + 2

    @property
    def client_port_owner(self) -> str:
        return "Envoy (the gateway)" if self.data_path == "gateway" else "Serve's gRPC proxy"

    @property
    def http_port_owner(self) -> str:
        return "Envoy (the gateway)" if self.data_path == "gateway" else "Serve's HTTP proxy"

    @property
    def serve_http_proxy_port(self) -> int:
        """Serve's HTTP proxy is the clients' HTTP endpoint on the Serve path; on the gateway
        path Envoy holds HTTP_PORT and Serve's proxy (which serves no client) moves aside."""
        return self.http_port if self.data_path == "serve" else self.serve_http_port

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        data_path = env.get("DATA_PATH") or "gateway"
        if data_path not in DATA_PATHS:
            raise SystemExit(f"DATA_PATH={data_path!r}: choose one of {', '.join(DATA_PATHS)}")
        tritons = int_env(env, "TRITONS", 1)
        if not 1 <= tritons <= 8:
            raise SystemExit(f"TRITONS={tritons}: between 1 and 8 simulated pods")
        repo = Path(env.get("MODEL_REPOSITORY") or DEFAULT_MODELS).resolve()
        if not repo.is_dir():
            raise SystemExit(f"MODEL_REPOSITORY={repo} is not a directory")
        config = Path(env.get("SERVE_CONFIG") or DEFAULT_CONFIG).resolve()
        if not config.is_file():
            raise SystemExit(f"SERVE_CONFIG={config} is not a file")
        try:
            parsed = yaml.safe_load(config.read_text()) or {}
        except yaml.YAMLError as error:
            raise SystemExit(f"SERVE_CONFIG={config} is not YAML: {error}") from None
        if data_path == "serve" and min_replicas(parsed) == 0:
            # Nothing would ever start a replica: no gateway sees the calls (invariant
            # serve-min-replicas refuses the same in a build).
            raise SystemExit(f"SERVE_CONFIG={config}: min_replicas 0 on the Serve path, where "
                             "nothing sees a call while no replica runs; set min_replicas to 1 "
                             "or more, or use the gateway path (DATA_PATH=gateway)")
        settings = cls(
            data_path=data_path,
            tritons=tritons,
            model_repository=repo,
            grpc_port=int_env(env, "GRPC_PORT", 8001),
            http_port=int_env(env, "HTTP_PORT", 8000),
            serve_grpc_port=int_env(env, "SERVE_GRPC_PORT", 9000),
            serve_http_port=int_env(env, "SERVE_HTTP_PORT", 9080),
            gateway_metrics_port=int_env(env, "GATEWAY_METRICS_PORT", 9902),
            gateway_admin_port=int_env(env, "GATEWAY_ADMIN_PORT", 9901),
            admission_port=int_env(env, "ADMISSION_PORT", 8003),
            observe=env.get("OBSERVE", "") not in ("", "0"),
            prometheus_port=int_env(env, "PROMETHEUS_PORT", 9090),
            triton_base=TritonPorts(
                http=int_env(env, "TRITON_HTTP_PORT", 8100),
                grpc=int_env(env, "TRITON_GRPC_PORT", 8101),
                metrics=int_env(env, "TRITON_METRICS_PORT", 8102),
            ),
            pod_ready_base=int_env(env, "POD_READY_PORT", 8103),
            gcs_port=int_env(env, "RAY_GCS_PORT", 6379),
            dashboard_port=int_env(env, "RAY_DASHBOARD_PORT", 8265),
            serve_config=config,
            triton_args=tuple(shlex.split(env.get("TRITON_ARGS", ""))),
            ray_token=env.get("RAY_AUTH_TOKEN") or secrets.token_hex(32),
            tls=switch_env(env, "TLS"),
            mtls=switch_env(env, "MTLS"),
            prewarm_dir=Path(env["PREWARM_DIR"]).resolve() if env.get("PREWARM_DIR") else None,
            on_demand=min_replicas(parsed) == 0,
            pod_idle_s=int_env(env, "POD_IDLE_S", base_idle_timeout_s(), low=1, high=3600),
        )
        if settings.mtls and not settings.tls:
            raise SystemExit("MTLS=1 asks clients for certificates over TLS: add TLS=1")
        if settings.tls and data_path != "gateway":
            raise SystemExit("TLS=1 is the gateway's front door: the Serve path has none "
                             "(DATA_PATH=gateway)")
        settings = dataclasses.replace(settings, **_jwt_settings(env, data_path))
        settings.check_ports()
        settings.check_admission(env)
        settings.tenant_shares(env)
        try:
            parse_tenant_map(settings.front_door_env(env).get(TENANTS_ENV, ""))
        except ValueError as error:
            raise SystemExit(str(error)) from None
        return settings

    def admission_env(self, env: Mapping[str, str] = os.environ) -> dict[str, str]:
        """The `admission` ConfigMap as this machine's gateway and Ray head get it: the
        shipped defaults, each overridden by the caller's environment, on this stack's port."""
        defaults = env_file(ADMISSION_ENV_FILE)
        return {**defaults, **{k: env[k] for k in defaults if k in env},
                ADMISSION_PORT_ENV: str(self.admission_port)}

    def check_admission(self, env: Mapping[str, str] = os.environ) -> None:
        """The settings the gateway's Lua refuses to load with, refused here first, in the words
        of invariant admission-settings-valid (Envoy would exit and restart until a timeout)."""
        from schema.check import admission_problems

        problems = admission_problems(self.admission_env(env))
        if problems:
            raise SystemExit("; ".join(problems) + f" ({ADMISSION_ENV_FILE.name}, "
                             "docs/admission.md)")

    def tenant_shares(self, env: Mapping[str, str] = os.environ) -> dict[str, int]:
        """SONIC_RAY_TENANT_SHARES as the gateway's filter gets it (gateway/tenant_shares.py)."""
        try:
            return parse_shares(self.admission_env(env).get(SHARES_ENV, ""))
        except ValueError as error:
            raise SystemExit(str(error)) from None

    def front_door_env(self, env: Mapping[str, str] = os.environ) -> dict[str, str]:
        """The `front-door` ConfigMap as this machine's gateway gets it: the shipped defaults,
        each overridden by the caller's environment, the token checks' issuer, audiences and
        skew as JWT_ISSUER, JWT_AUDIENCE and JWKS_FILE set them."""
        defaults = env_file(FRONT_DOOR_ENV_FILE)
        found = {**defaults, **{k: env[k] for k in defaults if k in env}}
        found.update({ISSUER_ENV: "", AUDIENCES_ENV: ""})
        if self.jwt is not None:
            found.update({ISSUER_ENV: self.jwt.issuer,
                          AUDIENCES_ENV: ",".join(self.jwt.audiences),
                          CLOCK_SKEW_ENV: str(self.jwt.clock_skew_s)})
        return found

    def port_variables(self) -> dict[str, int]:
        """Every port variable and its value (Triton's for pod 0): docs/local.md's table is
        checked against these (tests/unit/test_local_ports.py)."""
        return {
            "GRPC_PORT": self.grpc_port,
            "HTTP_PORT": self.http_port,
            "TRITON_HTTP_PORT": self.triton_base.http,
            "TRITON_GRPC_PORT": self.triton_base.grpc,
            "TRITON_METRICS_PORT": self.triton_base.metrics,
            "POD_READY_PORT": self.pod_ready_base,
            "GATEWAY_METRICS_PORT": self.gateway_metrics_port,
            "GATEWAY_ADMIN_PORT": self.gateway_admin_port,
            "ADMISSION_PORT": self.admission_port,
            "SERVE_GRPC_PORT": self.serve_grpc_port,
            "SERVE_HTTP_PORT": self.serve_http_port,
            "RAY_GCS_PORT": self.gcs_port,
            "RAY_DASHBOARD_PORT": self.dashboard_port,
            "PROMETHEUS_PORT": self.prometheus_port,
        }

    def ports_in_use(self, env: Mapping[str, str] = os.environ) -> set[int]:
        """Every port this stack's servers will bind, some long after it starts (its Tritons
        after its Ray nodes): its variables, each pod's Triton ports, and the ranges and ports
        Serve is told in the environment (RAY_SERVE_*_PORT)."""
        found = set(self.port_variables().values())
        for i in range(self.tritons):
            t = self.triton(i)
            found |= {t.http, t.grpc, t.metrics, self.pod_ready_port(i),
                      *self.pod_holding_ports(i)}
        for protocol in ("HTTP", "GRPC"):
            low = env.get(f"RAY_SERVE_DIRECT_INGRESS_MIN_{protocol}_PORT", "")
            high = env.get(f"RAY_SERVE_DIRECT_INGRESS_MAX_{protocol}_PORT", "")
            if low.isdigit() and high.isdigit():
                found |= set(range(int(low), int(high) + 1))
        found |= {int(v) for k, v in env.items()
                  if k.startswith("RAY_SERVE_") and k.endswith("_PORT") and v.isdigit()}
        return found

    def check_ports(self) -> None:
        every = self.port_variables()
        used = ["GRPC_PORT", "HTTP_PORT", "RAY_GCS_PORT", "RAY_DASHBOARD_PORT", "ADMISSION_PORT"]
        if self.data_path == "gateway":
            used += ["SERVE_GRPC_PORT", "SERVE_HTTP_PORT", "GATEWAY_METRICS_PORT",
                     "GATEWAY_ADMIN_PORT"]
        if self.observe:
            used.append("PROMETHEUS_PORT")
        ports = {name: every[name] for name in used}
        for index in range(self.tritons):
            triton = self.triton(index)
            ports |= {f"TRITON_HTTP_PORT (pod {index})": triton.http,
                      f"TRITON_GRPC_PORT (pod {index})": triton.grpc,
                      f"TRITON_METRICS_PORT (pod {index})": triton.metrics,
                      f"POD_READY_PORT (pod {index})": self.pod_ready_port(index),
                      f"holding port (pod {index})": self.pod_holding_ports(index)[0],
                      f"holding gRPC port (pod {index})": self.pod_holding_ports(index)[1]}
        seen: dict[int, str] = {}
        for name, port in ports.items():
            if port in seen:
                raise SystemExit(f"{name} and {seen[port]} are both {port}: ports must differ")
            seen[port] = name
