"""The local stack's ports: never from the kernel's ephemeral range, where Ray's own outgoing
connections take ports at random, and never handed out twice."""

from __future__ import annotations

import random
import re
import socket
import time
from pathlib import Path

import pytest

from local_stack import ports
from local_stack.harness import READY_LINE, serve_config_with
from local_stack.settings import ROOT, Settings, base_idle_timeout_s


def test_ports_lie_between_rays_worker_ports_and_the_ephemeral_range() -> None:
    ephemeral_low = int(ports._EPHEMERAL.read_text().split()[0])
    drawn = ports.free_ports(200)
    assert all(19999 < port < ephemeral_low for port in drawn), drawn


def test_no_port_is_handed_out_twice() -> None:
    singles = ports.free_ports(300)
    first = ports.free_port_range(40)
    block = set(range(first, first + 40))
    assert len(set(singles)) == len(singles)
    assert block.isdisjoint(singles)
    assert block.isdisjoint(ports.free_ports(300))


def test_a_bound_port_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    busy = ports.free_port_range(2)
    ports.release({busy, busy + 1})
    monkeypatch.setattr(ports, "_rng", _Scripted([busy]))
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", busy))
        taken.listen()
        assert ports.free_port_range(1) == busy + 1


class _Scripted:
    """Draws in a given order, so the test knows which port comes first."""

    def __init__(self, draws: list[int]) -> None:
        self.draws = draws

    def randrange(self, low: int, high: int) -> int:
        return self.draws.pop(0)


def test_the_ready_line_is_the_stacks_own_not_a_traceback_naming_ready() -> None:
    assert re.search(READY_LINE, "[local] ready: Triton answers ServerReady through Envoy")
    assert not re.search(READY_LINE, "[local] error: ray::ProxyActor.ready() (pid=1) failed")
    assert not re.search(READY_LINE, "    raise RuntimeError('ProxyActor.ready')")


def test_the_port_table_of_docs_local_md_is_the_settings() -> None:
    """One home for the ports: the table says what Settings uses, every variable once."""
    table: dict[str, int] = {}
    for line in (ROOT / "docs" / "local.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 3 or not cells[2].startswith("`"):
            continue
        variables = re.findall(r"`([A-Z_]+)`", cells[2])
        numbers = [int(re.match(r"\d+", part).group()) for part in cells[1].split(" / ")]  # type: ignore[union-attr]
        assert len(variables) == len(numbers), line
        for variable, number in zip(variables, numbers, strict=True):
            assert variable not in table, f"{variable} twice in docs/local.md"
            table[variable] = number
    settings = Settings.from_env({}).port_variables()
    wrong = {name: (table.get(name), settings.get(name)) for name in {*table, *settings}
             if table.get(name) != settings.get(name)}
    assert wrong == {}, f"docs/local.md's port table vs Settings, (table, settings): {wrong}"


@pytest.mark.parametrize(("env", "tls", "mtls"), [
    ({}, False, False), ({"TLS": "0"}, False, False), ({"TLS": "1"}, True, False),
    ({"TLS": "1", "MTLS": "1"}, True, True)])
def test_tls_switches(env: dict[str, str], tls: bool, mtls: bool) -> None:
    settings = Settings.from_env(env)
    assert (settings.tls, settings.mtls) == (tls, mtls)


@pytest.mark.parametrize(("env", "says"), [
    ({"TLS": "yes"}, "TLS='yes': 1 turns it on"),
    ({"MTLS": "1"}, "MTLS=1 asks clients for certificates over TLS: add TLS=1"),
    ({"TLS": "1", "DATA_PATH": "serve"}, "the Serve path has none"),
    ({"JWKS_FILE": "/tmp/jwks.json"}, "JWKS_FILE without JWT_ISSUER, JWT_AUDIENCE"),
    ({"JWKS_FILE": "/nonexistent/jwks.json", "JWT_ISSUER": "i", "JWT_AUDIENCE": "a"},
     "JWKS_FILE=/nonexistent/jwks.json: No such file"),
    ({"JWKS_FILE": "/etc/hostname", "JWT_ISSUER": "i", "JWT_AUDIENCE": "a"}, "not JSON"),
    ({"JWT_ISSUER": "i", "JWT_AUDIENCE": "a"}, "without JWKS_FILE or JWKS_URI"),
    ({"JWKS_FILE": "/etc/hostname", "JWKS_URI": "https://idp/keys", "JWT_ISSUER": "i",
      "JWT_AUDIENCE": "a"}, "JWKS_FILE and JWKS_URI: the keys come from one of them"),
    ({"JWKS_URI": "http://idp/keys", "JWT_ISSUER": "i", "JWT_AUDIENCE": "a"},
     "JWKS_URI='http://idp/keys': an https:// address"),
    ({"JWKS_URI": "https://idp/keys", "JWKS_CA_FILE": "/nonexistent/ca.pem",
      "JWT_ISSUER": "i", "JWT_AUDIENCE": "a"}, "JWKS_CA_FILE=/nonexistent/ca.pem is not a file"),
    ({"JWKS_CA_FILE": "/etc/hostname"}, "JWKS_CA_FILE without JWKS_URI"),
    ({"JWKS_URI": "https://idp/keys", "SONIC_RAY_JWKS_CACHE_S": "0", "JWT_ISSUER": "i",
      "JWT_AUDIENCE": "a"}, "SONIC_RAY_JWKS_CACHE_S='0': whole seconds, 1 to 86400"),
    ({"SONIC_RAY_JWKS_URI": "https://idp/keys"}, "on this machine JWT_ISSUER, JWT_AUDIENCE"),
    # Admission's settings: what the gateway's Lua would refuse to load with.
    ({"SONIC_RAY_HOLD_S": "-1"}, "SONIC_RAY_HOLD_S is -1.0, not a number of seconds, 0 or more"),
    ({"SONIC_RAY_GATE_STATUS": "SKIP"},
     'SONIC_RAY_GATE_STATUS is "SKIP", not a gRPC status name other than OK'),
])
def test_tls_settings_that_cannot_work_are_refused_saying_why(env: dict[str, str],
                                                              says: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(says)):
        Settings.from_env(env)


def test_ports_the_settings_name_are_never_handed_to_the_stacks_own_processes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The stack picks its Ray nodes' ports before its Tritons bind theirs: CI saw a pod's
    raylet take Triton 1's HTTP port (free until then), and Triton 1 fail to start. The draw
    is made to hit that port first; it must be skipped."""
    triton_http = ports.free_port_range(3 * 10 * 2)
    settings = Settings.from_env({"TRITONS": "2", "TRITON_HTTP_PORT": str(triton_http),
                                  "TRITON_GRPC_PORT": str(triton_http + 1),
                                  "TRITON_METRICS_PORT": str(triton_http + 2)})
    pod_1_http = settings.triton(1).http

    class FirstTheTritonsPort:
        drawn = 0

        def randrange(self, low: int, high: int) -> int:
            self.drawn += 1
            return pod_1_http if self.drawn == 1 else random.randrange(low, high)

    monkeypatch.setattr(ports, "_rng", FirstTheTritonsPort())
    ports.reserve(settings.ports_in_use())
    assert ports.free_ports(1) != [pod_1_http]


def test_a_block_is_found_while_one_gap_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long test session scatters handed-out ports: CI saw a 60-port block refused with gaps
    left. Here every port but one gap of 60 is handed out; the block must be that gap."""
    gap = ports.LOW + (ports.HIGH - ports.LOW) // 2
    monkeypatch.setattr(ports, "_handed_out", dict.fromkeys(
        set(range(ports.LOW, ports.HIGH)) - set(range(gap, gap + 60)), time.monotonic()))
    monkeypatch.setattr(ports, "_bindable", lambda port: True)
    assert ports.free_port_range(60) == gap
    with pytest.raises(RuntimeError, match="no 1 consecutive free ports"):
        ports.free_port_range(1)


def test_ports_drawn_long_ago_make_room_once_no_block_is_left(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A long session's single ports, scattered, left no 60-port block late in a rehearsal of
    `make test` (this file's draw refused). Ports drawn over STALE_S ago and free now are
    drawn again once no block is left otherwise; ports drawn lately, or reserved for a running
    stack, never."""
    long_ago = time.monotonic() - ports.STALE_S - 1
    every_30th = range(ports.LOW, ports.HIGH, 30)
    monkeypatch.setattr(ports, "_bindable", lambda port: True)
    monkeypatch.setattr(ports, "_handed_out", dict.fromkeys(every_30th, long_ago))
    first = ports.free_port_range(60)
    assert all((ports._handed_out[p] or 0) > long_ago for p in range(first, first + 60))
    for lately in (time.monotonic(), None):
        monkeypatch.setattr(ports, "_handed_out", dict.fromkeys(every_30th, lately))
        with pytest.raises(RuntimeError, match="no 60 consecutive free ports"):
            ports.free_port_range(60)


def test_a_serve_path_that_could_never_scale_from_zero_is_refused(tmp_path: Path) -> None:
    config = serve_config_with(tmp_path, autoscaling={"min_replicas": 0, "max_replicas": 2})
    with pytest.raises(SystemExit, match=re.escape("min_replicas 0 on the Serve path")):
        Settings.from_env({"DATA_PATH": "serve", "SERVE_CONFIG": str(config)})
    # The gateway path sees the calls and starts a replica for the first one.
    assert Settings.from_env({"SERVE_CONFIG": str(config)}).serve_config == config
    broken = tmp_path / "broken.yaml"
    broken.write_text("applications: [\n")
    with pytest.raises(SystemExit, match="is not YAML"):
        Settings.from_env({"SERVE_CONFIG": str(broken)})


def test_pods_start_on_demand_at_min_replicas_0_idle_ones_going_after_pod_idle_s(
        tmp_path: Path) -> None:
    zero = serve_config_with(tmp_path, autoscaling={"min_replicas": 0, "max_replicas": 2})
    settings = Settings.from_env({"SERVE_CONFIG": str(zero)})
    assert settings.on_demand and settings.pod_idle_s == base_idle_timeout_s() == 60
    assert not Settings.from_env({}).on_demand, "the shipped config (min_replicas 1) runs its pods"
    assert Settings.from_env({"SERVE_CONFIG": str(zero), "POD_IDLE_S": "5"}).pod_idle_s == 5
    for bad, says in (("0", "POD_IDLE_S=0: between 1 and 3600"),
                      ("soon", "POD_IDLE_S='soon' is not a whole number")):
        with pytest.raises(SystemExit, match=re.escape(says)):
            Settings.from_env({"SERVE_CONFIG": str(zero), "POD_IDLE_S": bad})


def test_keys_from_an_identity_providers_address() -> None:
    settings = Settings.from_env({"JWKS_URI": "https://localhost:8443/keys",
                                  "JWKS_CA_FILE": "/etc/hostname", "JWT_ISSUER": "i",
                                  "JWT_AUDIENCE": "a", "SONIC_RAY_JWKS_CACHE_S": "5"})
    assert settings.jwt is not None and settings.jwks_file is None
    assert (settings.jwt.jwks_uri, settings.jwt.jwks_cache_s) == ("https://localhost:8443/keys", 5)
    assert settings.jwks_ca_file == Path("/etc/hostname")
