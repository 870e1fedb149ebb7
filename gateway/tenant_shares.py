"""Fair share per tenant at the gateway: Envoy's local_ratelimit filter with a token bucket per
tenant, its config by extension config discovery from a file beside envoy.yaml (SHARES_FILE),
as the token checks' (gateway/jwt.py), so that a site's shares change that file alone and a
rewritten file takes effect without a restart.

A call's tenant is what client-checks.lua recorded in its metadata (`sonic-ray`: tenant;
docs/front-door.md); a tenant with a share gets that many calls per second at each gateway pod
(the bucket is shared by Envoy's workers, not by the pods), a burst of one second's worth, and
a call beyond it ends at once with RESOURCE_EXHAUSTED (HTTP 429), a message naming the tenant
and its share (envoy.yaml, local_reply_config) and a retry hint (client-checks.lua). A tenant
without a share is not limited here; Triton's queue policy and the start-of-job gate still
hold (docs/admission.md).

The setting, one home for the Lua (its messages), this file and the invariants
(schema/invariants.schema.json: tenant-shares-agree, tenant-shares-within-capacity):
SONIC_RAY_TENANT_SHARES in the `admission` ConfigMap (gateway/admission.env), `tenant=calls/s`
entries separated by ";". A site sets it in its overlay's tenant-shares.env (merged into
`admission`); `make gateway-config` writes the overlay's tenant-shares.yaml from it
(SITE_SOURCE), which the overlay merges into the gateway's ConfigMap.

    python -m gateway.tenant_shares [--check]  # gateway/tenant-shares.yaml, every site's
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from gateway.routes import ROOT
from tools.env_file import env_file
from tools.generated import write_or_check_sites

FILTER_NAME = "sonic-ray.tenant-shares"
SHARES_FILE = "tenant-shares.yaml"
SHIPPED = ROOT / "gateway" / SHARES_FILE
SHARES_ENV = "SONIC_RAY_TENANT_SHARES"
# What the site's GPUs serve, in calls per second at one gateway pod: declared, the shares must
# not add up to more (tenant-shares-within-capacity).
CAPACITY_ENV = "SONIC_RAY_CAPACITY_CALLS_S"
LOCAL_RATELIMIT_TYPE = ("type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3."
                        "LocalRateLimit")
EXTENSION_TYPE = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"
# Where client-checks.lua leaves the tenant; the descriptor's key.
METADATA_NAMESPACE, TENANT_KEY = "sonic-ray", "tenant"
# A tenant as client-checks.lua writes one (a claim's "/" kept).
TENANT = re.compile(r"^[A-Za-z0-9._/-]+$")
SITE_SOURCE = "tenant-shares.env"
# Who is which tenant (the `front-door` ConfigMap, gateway/front-door.env): `tenant=pattern`
# entries separated by ";", as client-checks.lua reads them; a tenant named here is letters,
# digits, . _ - (a claim's value may carry "/" too).
TENANTS_ENV = "SONIC_RAY_TENANTS"
MAPPED_TENANT = re.compile(r"^([A-Za-z0-9._-]+)\s*=\s*(.+)$")
# local_ratelimit refills a bucket every 50 ms at the most often.
MAX_FILLS_PER_S = 20


def parse_shares(text: str) -> dict[str, int]:
    """`tenant=calls/s;...` as {tenant: calls/s}; ValueError naming the entry that is wrong."""
    shares: dict[str, int] = {}
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        tenant, equals, rate = (part.strip() for part in entry.partition("="))
        if not equals or not TENANT.match(tenant) or not rate.isdigit() or int(rate) < 1:
            raise ValueError(f"{SHARES_ENV}: {entry!r} is not tenant=calls/s (a tenant is "
                             "letters, digits, . _ / -; calls/s a whole number from 1)")
        if tenant in shares:
            raise ValueError(f"{SHARES_ENV}: {tenant} has two shares")
        shares[tenant] = int(rate)
    return shares


def parse_tenant_map(text: str) -> list[tuple[str, str]]:
    """SONIC_RAY_TENANTS as (tenant, pattern) pairs; ValueError naming the entry the gateway's
    Lua would refuse to start with."""
    found = []
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        matched = MAPPED_TENANT.match(entry)
        if not matched:
            raise ValueError(f"{TENANTS_ENV}: {entry!r} is not tenant=pattern (a tenant is "
                             "letters, digits, - . _)")
        found.append((matched.group(1), matched.group(2)))
    return found


def filter_config(shares: dict[str, int]) -> dict[str, Any]:
    """local_ratelimit's config: a bucket per tenant with a share; none, every call passes."""
    config: dict[str, Any] = {"@type": LOCAL_RATELIMIT_TYPE, "stat_prefix": "tenant_shares"}
    if not shares:
        return config

    def always(key: str) -> dict[str, Any]:
        return {"default_value": {"numerator": 100, "denominator": "HUNDRED"},
                "runtime_key": f"sonic_ray.tenant_shares.{key}"}

    return {
        **config,
        "filter_enabled": always("enabled"),
        "filter_enforced": always("enforced"),
        # RESOURCE_EXHAUSTED, not UNAVAILABLE: "this server is down" would send a job away.
        "rate_limited_as_resource_exhausted": True,
        # A tenant without a share takes nothing from any bucket.
        "always_consume_default_token_bucket": False,
        "rate_limits": [{"actions": [{"metadata": {
            "descriptor_key": TENANT_KEY, "source": "DYNAMIC",
            "metadata_key": {"key": METADATA_NAMESPACE, "path": [{"key": TENANT_KEY}]}}}]}],
        "descriptors": [{"entries": [{"key": TENANT_KEY, "value": tenant}],
                         "token_bucket": token_bucket(rate)}
                        for tenant, rate in sorted(shares.items())],
    }


def token_bucket(rate: int) -> dict[str, Any]:
    """`rate` calls/s, a burst of one second's worth, refilled smoothly: a token at a time
    where Envoy allows (every 50 ms at the most often), so that a flooding tenant's admitted
    calls arrive spread out, not as one batch a second in front of everyone else's."""
    per_fill = -(-rate // MAX_FILLS_PER_S)
    return {"max_tokens": rate, "tokens_per_fill": per_fill,
            "fill_interval": f"{per_fill / rate:.6f}s"}


def document(shares: dict[str, int]) -> dict[str, Any]:
    """The discovery response Envoy reads from SHARES_FILE."""
    return {"resources": [{"@type": EXTENSION_TYPE, "name": FILTER_NAME,
                           "typed_config": filter_config(shares)}]}


def shares_of(document_text: str) -> dict[str, int]:
    """The shares a SHARES_FILE holds (what the invariants compare with the setting)."""
    found = yaml.safe_load(document_text or "{}") or {}
    return {str(d["entries"][0]["value"]): int(d["token_bucket"]["max_tokens"])
            for r in found.get("resources") or []
            for d in (r.get("typed_config") or {}).get("descriptors") or []}


def write(path: Path, shares: dict[str, int]) -> None:
    """Replaced by a rename, the move Envoy's watch on the folder reloads on."""
    staged = path.with_name(path.name + ".new")
    staged.write_text(json.dumps(document(shares)))
    staged.replace(path)


def render_shipped() -> str:
    return ("# No tenant has a share: local_ratelimit with no bucket lets every call pass\n"
            "# (gateway/tenant_shares.py writes it with `make gateway-config`; a site's own\n"
            "# replaces it).\n" + yaml.safe_dump(document({}), sort_keys=False))


def render_site(folder: Path) -> str:
    try:
        shares = parse_shares(env_file(folder / SITE_SOURCE).get(SHARES_ENV, ""))
    except (OSError, ValueError) as error:
        raise SystemExit(f"{folder}: {error}") from None
    if not shares:
        raise SystemExit(f"{folder}: {SITE_SOURCE} gives no {SHARES_ENV}")
    return (f"# This site's tenant shares: written by `make gateway-config`\n"
            f"# (gateway/tenant_shares.py) from {SITE_SOURCE} here; edit that, not this file.\n"
            + yaml.safe_dump(document(shares), sort_keys=False, width=100))


def main(argv: list[str] | None = None) -> int:
    return write_or_check_sites(SHIPPED, render_shipped, SITE_SOURCE, SHARES_FILE, render_site,
                                argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
