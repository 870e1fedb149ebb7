"""make bench-node (bench/node.py): the bare Envoy it compares the gateway with is the
gateway's own config reduced to the router (same clusters, no access log, no Lua, no token or
share filters), and a short run carries calls on every path with no error and writes its
figures. What the figures are is the bench's to say, not a test's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench import node
from gateway import local as gateway
from gateway.routes import GRPC_LISTENER, HTTP_LISTENER, named, sequence_tries


def test_the_bare_envoy_is_the_gateways_config_with_the_router_alone() -> None:
    shipped = yaml.safe_load(gateway.CONFIG.read_text())
    floor = node.bare(shipped)
    (listener,) = floor["static_resources"]["listeners"]
    # One chain, in clear: no TLS chains beside it, no matcher choosing among them.
    (chain,) = listener["filter_chains"]
    assert "transport_socket" not in chain and "filter_chain_matcher" not in listener
    manager = chain["filters"][0]["typed_config"]
    assert [f["name"] for f in manager["http_filters"]] == ["envoy.filters.http.router"]
    assert "access_log" not in manager
    assert manager["http2_protocol_options"] == named(shipped, "listeners", GRPC_LISTENER)[
        "filter_chains"][0]["filters"][0]["typed_config"]["http2_protocol_options"]
    assert floor["static_resources"]["clusters"] == shipped["static_resources"]["clusters"]
    # The shipped config is left as it was.
    assert len(shipped["static_resources"]["listeners"]) > 1


def test_the_gateway_without_sequences_differs_only_in_its_retries() -> None:
    shipped = yaml.safe_load(gateway.CONFIG.read_text())
    assert all(sequence_tries(shipped).values()), sequence_tries(shipped)
    plain = node.without_sequence_retries(shipped)
    assert set(sequence_tries(plain).values()) == {None}
    # Only the retry conditions change: the rest of the config is the shipped one.
    for config in (shipped, plain):
        for listener in (GRPC_LISTENER, HTTP_LISTENER):
            for chain in named(config, "listeners", listener)["filter_chains"]:
                for host in chain["filters"][0]["typed_config"]["route_config"]["virtual_hosts"]:
                    for route in host["routes"]:
                        (route.get("route") or {}).pop("retry_policy", None)
                    host.pop("retry_policy", None)
    assert plain == shipped
    assert node.without_retries(yaml.safe_load(gateway.CONFIG.read_text())) == plain


def test_cores_apart_only_where_there_are_enough() -> None:
    assert node.Cores.plan(2) == node.Cores(None, None, None)
    assert node.Cores.plan(16) == node.Cores("0-7", "8-9", list(range(10, 16)))


@pytest.mark.processes
def test_a_short_run_carries_calls_on_every_path(tmp_path: Path) -> None:
    assert node.main(["--seconds", "0.3", "--repeats", "1", "--cells", "small:1", "1MiB:2",
                      "--paths", *node.PATHS, *node.OPTIONAL_PATHS, "--out", str(tmp_path)]) == 0
    (figures,) = tmp_path.glob("node-*.json")
    found = json.loads(figures.read_text())
    cells = {(c["path"], c["size"]): c for c in found["cells"]}
    assert {p for p, _ in cells} == {*node.PATHS, *node.OPTIONAL_PATHS}
    assert all(c["rps"] > 0 and c["errors"] == 0 for c in cells.values()), cells
    assert list(tmp_path.glob("node-*.png"))


def test_a_cell_that_cannot_be_read_is_refused() -> None:
    with pytest.raises(SystemExit):
        node.main(["--cells", "small:0"])
