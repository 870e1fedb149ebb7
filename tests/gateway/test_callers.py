"""gateway/callers.sh, which writes the config of Envoy's own checks of a call's caller (the
filter `sonic-ray.callers` of gateway/envoy.yaml): what it writes for a site's tokens, tenants
and shares, read back as Envoy reads it; what it refuses. The config's effect on calls, in a
real Envoy, is tests/gateway/test_token_auth.py's and test_hot_path.py's."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway import local
from local_stack.polling import until

pytestmark = pytest.mark.processes

SCRIPT = local.HERE / "callers.sh"
TOKENS_ENV = "SONIC_RAY_AUTH_TOKENS_FILE"
FAULT = "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault"
SET_METADATA = "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config"


def _run(folder: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, local.CALLERS_FILE_ENV:
                                           str(folder / "callers.yaml"), **env})


def _config(folder: Path) -> dict[str, Any]:
    (resource,) = yaml.safe_load((folder / "callers.yaml").read_text())["resources"]
    assert resource["name"] == local.CALLERS_FILTER, resource
    typed: dict[str, Any] = resource["typed_config"]
    return typed


def _recorded(on_match: dict[str, Any]) -> dict[str, str]:
    action = on_match["action"]["typed_config"]["typed_config"]["typed_config"]
    (entry,) = action["metadata"]
    assert entry["metadata_namespace"] == "sonic-ray" and entry["allow_overwrite"]
    value: dict[str, str] = entry["value"]
    return value


def _callers(config: dict[str, Any]) -> list[tuple[str, dict[str, str]]]:
    """Each token's header regex and the metadata it records; the same token's header as RFC
    6750 writes it, looked up first, records the same."""
    tree = config["xds_matcher"]["matcher_tree"]
    assert tree["input"]["typed_config"]["header_name"] == "authorization"
    exact = {header: _recorded(on_match)
             for header, on_match in tree["exact_match_map"]["map"].items()}
    found = []
    for matcher in config["xds_matcher"]["on_no_match"]["matcher"]["matcher_list"]["matchers"]:
        predicate = matcher["predicate"]["single_predicate"]
        assert predicate["input"]["typed_config"]["header_name"] == "authorization"
        found.append((predicate["value_match"]["safe_regex"]["regex"],
                      _recorded(matcher["on_match"])))
    assert [value for _, value in found] == list(exact.values()), (found, exact)
    for (regex, _), header in zip(found, exact, strict=True):
        assert header.startswith("Bearer ") and re.fullmatch(regex, header), (regex, header)
    return found


def _otherwise(config: dict[str, Any]) -> dict[str, Any]:
    """What a call without a known token meets."""
    action: dict[str, Any] = config["xds_matcher"]["on_no_match"]["matcher"]["on_no_match"][
        "action"]["typed_config"]["typed_config"]["typed_config"]
    return action


def _refuses_all(config: dict[str, Any]) -> bool:
    return bool(config["@type"] == FAULT and config["abort"]["http_status"] == 401)


def test_the_default_file_is_the_one_the_shipped_config_reads() -> None:
    shipped = yaml.safe_load(local.CONFIG.read_text())
    default = re.search(r"SONIC_RAY_CALLERS_FILE:-([^}]+)}", SCRIPT.read_text())
    assert default is not None
    assert Path(default.group(1)) == local.callers_file(shipped)


def test_each_token_is_a_matcher_recording_the_caller_the_lua_would(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# one a line\n  tok-first  \nalice tok.second+9\nbob x\"y\\z\r\n"
                      "three fields here\nbob2 tok-first\n")
    done = _run(tmp_path, "native", **{TOKENS_ENV: str(tokens),
                                       "SONIC_RAY_TENANTS": "cms=token:ali*; ops = *b.b",
                                       "SONIC_RAY_TENANT_SHARES": "cms=10; nobody=3"})
    assert done.returncode == 0, done.stderr
    assert "3 token(s)" in done.stderr and "tok-" not in done.stderr, done.stderr
    config = _config(tmp_path)
    callers = _callers(config)
    # A token named twice: its last line names it; a line of three fields is no token.
    assert [meta for _, meta in callers] == [
        {"identity": "token:bob2", "tenant": "bob2"},
        {"identity": "token:alice", "tenant": "cms", "share": "10"},
        {"identity": "token:bob", "tenant": "ops"}]
    regexes = [regex for regex, _ in callers]
    for header, index in (("Bearer tok-first", 0), ("bEaReR   tok-first  ", 0),
                          ("bearer tok.second+9", 1), ('Bearer x"y\\z', 2)):
        assert [i for i, r in enumerate(regexes) if re.fullmatch(r, header)] == [index], header
    for header in ("Bearer tok-firstx", "tok-first", "Bearer tokXsecond+9", "Basic tok-first",
                   "Bearer tok.second9", "Bearer"):
        assert not any(re.fullmatch(r, header) for r in regexes), header
    assert _refuses_all(_otherwise(config))


@pytest.mark.parametrize(("setting", "value", "said"), [
    ("SONIC_RAY_TENANTS", "cms", 'SONIC_RAY_TENANTS: "cms" is not tenant=pattern'),
    ("SONIC_RAY_TENANTS", "c m=*", 'SONIC_RAY_TENANTS: "c m=*" is not tenant=pattern'),
    ("SONIC_RAY_TENANT_SHARES", "cms=lots", 'SONIC_RAY_TENANT_SHARES: "cms=lots" is not '
     "tenant=calls/s"),
])
def test_a_malformed_setting_stops_it_naming_the_entry(tmp_path: Path, setting: str, value: str,
                                                       said: str) -> None:
    done = _run(tmp_path, "native", **{setting: value})
    assert done.returncode == 2 and said in done.stderr, done
    assert not (tmp_path / "callers.yaml").exists()


def test_an_unknown_mode_stops_it(tmp_path: Path) -> None:
    done = _run(tmp_path, "checked")
    assert done.returncode == 2 and 'not "checked"' in done.stderr, done


def test_a_token_no_header_can_carry_is_left_out_by_line_number(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_bytes(b"good-token\nbad\x01token\nname caf\xc3\xa9\n")
    done = _run(tmp_path, "native", **{TOKENS_ENV: str(tokens)})
    assert done.returncode == 0, done.stderr
    assert "line 2 of the tokens file is left out" in done.stderr
    assert "line 3 of the tokens file is left out" in done.stderr
    assert "bad" not in done.stderr and "caf" not in done.stderr, done.stderr
    assert [meta["identity"] for _, meta in _callers(_config(tmp_path))] == ["token:unnamed"]


def test_without_tokens_every_caller_is_anonymous_in_its_mapped_tenant(tmp_path: Path) -> None:
    done = _run(tmp_path, "native", SONIC_RAY_TENANTS="ops=token:*;public=anon*",
                SONIC_RAY_TENANT_SHARES="public=5")
    assert done.returncode == 0, done.stderr
    config = _config(tmp_path)
    assert config["@type"] == SET_METADATA, config
    assert config["metadata"][0]["value"] == {"identity": "anonymous", "tenant": "public",
                                              "share": "5"}


def test_off_it_records_nothing(tmp_path: Path) -> None:
    done = _run(tmp_path, "off", SONIC_RAY_TENANTS="cms=*")
    assert done.returncode == 0, done.stderr
    assert _config(tmp_path) == {"@type": SET_METADATA, "metadata": []}


@pytest.fixture
def sleeper() -> Iterator[int]:
    """A process standing in for Envoy, whose life the re-reading follows."""
    process = subprocess.Popen(["sleep", "120"])
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait()


def test_no_token_yet_refuses_every_call_then_a_good_file_is_read_and_kept(
        tmp_path: Path, sleeper: int) -> None:
    tokens = tmp_path / "tokens"
    log = tmp_path / "said"
    with log.open("w") as said:
        rereading = subprocess.Popen(
            ["bash", str(SCRIPT), "native", str(sleeper)], stderr=said, env={
                **os.environ, local.CALLERS_FILE_ENV: str(tmp_path / "callers.yaml"),
                TOKENS_ENV: str(tokens)})
    try:
        until("the refusing config", lambda: (tmp_path / "callers.yaml").exists(), 10)
        assert _refuses_all(_config(tmp_path))
        assert "cannot be read yet: every call is refused" in log.read_text()
        # Kubelet swaps a Secret volume's files by renaming; so does this.
        staged = tmp_path / "tokens.new"
        staged.write_text("alice tok-a\n")
        staged.replace(tokens)
        until("the token read", lambda: "1 token(s)" in log.read_text(), 10)
        assert [meta for _, meta in _callers(_config(tmp_path))] == [
            {"identity": "token:alice", "tenant": "alice"}]
        written = (tmp_path / "callers.yaml").read_text()
        staged.write_text("# emptied\n")
        staged.replace(tokens)
        until("the emptied file seen", lambda: "no token now" in log.read_text(), 10)
        tokens.unlink()
        until("the missing file seen", lambda: "cannot be read now" in log.read_text(), 10)
        assert (tmp_path / "callers.yaml").read_text() == written
    finally:
        rereading.kill()
        rereading.wait()


LUA = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"


def _is_client_checks(config: dict[str, Any]) -> bool:
    return bool(config["@type"] == LUA and config["stat_prefix"] == "client_checks" and
                config["default_source_code"]["filename"] == str(local.HERE /
                                                                 "client-checks.lua"))


def test_beside_a_jwt_issuer_calls_without_a_static_token_go_to_the_lua(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice tok-a\n")
    done = _run(tmp_path, "native-jwt", **{TOKENS_ENV: str(tokens)})
    assert done.returncode == 0, done.stderr
    config = _config(tmp_path)
    assert [meta for _, meta in _callers(config)] == [{"identity": "token:alice",
                                                       "tenant": "alice"}]
    assert _is_client_checks(_otherwise(config))
    # No tokens file, or none readable yet: the Lua checks every call (JWTs), none refused here.
    for env in ({}, {TOKENS_ENV: str(tmp_path / "absent")}):
        done = _run(tmp_path, "native-jwt", **env)
        assert done.returncode == 0 and "client checks' Lua" in done.stderr, done.stderr
        assert _is_client_checks(_config(tmp_path))
