"""The tenant shares' setting and the filter config written from it (gateway/tenant_shares.py):
what a site writes is refused clearly when it cannot work, and read back as written."""

from __future__ import annotations

import re

import pytest
import yaml

from gateway import tenant_shares
from local_stack.settings import Settings


def test_shares_are_read_as_written_and_come_back_from_the_filters_config() -> None:
    shares = tenant_shares.parse_shares(" cms=40; /atlas/prod = 7 ;")
    assert shares == {"cms": 40, "/atlas/prod": 7}
    assert tenant_shares.shares_of(tenant_shares.render_shipped()) == {}
    assert tenant_shares.shares_of(yaml.safe_dump(tenant_shares.document(shares))) == shares


@pytest.mark.parametrize(("text", "says"), [
    ("cms", "'cms' is not tenant=calls/s"),
    ("cms=0", "'cms=0' is not tenant=calls/s"),
    ("cms=2.5", "'cms=2.5' is not tenant=calls/s"),
    ("c ms=4", "'c ms=4' is not tenant=calls/s"),
    ("cms=4;cms=5", "cms has two shares"),
])
def test_a_share_that_cannot_work_is_refused_naming_it(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        tenant_shares.parse_shares(text)


def test_make_local_refuses_bad_shares_before_starting() -> None:
    with pytest.raises(SystemExit, match="'cms=x' is not tenant=calls/s"):
        Settings.from_env({"SONIC_RAY_TENANT_SHARES": "cms=x"})


@pytest.mark.parametrize("rate", [1, 4, 7, 20, 30, 41, 1000])
def test_a_bucket_gives_the_share_per_second_refilled_at_most_every_50_ms(rate: int) -> None:
    bucket = tenant_shares.token_bucket(rate)
    interval_s = float(bucket["fill_interval"].rstrip("s"))
    assert interval_s >= 0.05
    assert bucket["tokens_per_fill"] / interval_s == pytest.approx(rate, rel=1e-4)
    assert bucket["max_tokens"] == rate  # a burst of one second's worth


def test_the_tenant_map_is_read_as_the_lua_reads_it() -> None:
    assert tenant_shares.parse_tenant_map("cms=cert:CN=*,O=CMS; atlas = token:atlas-*;") == [
        ("cms", "cert:CN=*,O=CMS"), ("atlas", "token:atlas-*")]


@pytest.mark.parametrize("text", ["atlas", "=token:x", "at las=token:x", "cms/prod=jwt:*"])
def test_a_tenant_map_entry_the_lua_would_refuse_is_refused_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"'{text}' is not tenant=pattern")):
        tenant_shares.parse_tenant_map(text)


def test_make_local_refuses_a_bad_tenant_map_before_starting() -> None:
    with pytest.raises(SystemExit, match="'atlas' is not tenant=pattern"):
        Settings.from_env({"SONIC_RAY_TENANTS": "cms=token:*;atlas"})
