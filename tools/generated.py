"""The command line every generator of a committed file shares."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def write_or_check(path: Path, text: str, argv: list[str] | None, doc: str | None,
                   remedy: str) -> int:
    """The command line of a generated file: writes it, or with --check exits 1 when the
    committed one differs from what would be written."""
    import argparse

    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 if {path.name} is not what would be written")
    if parser.parse_args(argv).check:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is stale: run {remedy}")
            return 1
        return 0
    path.write_text(text)
    return 0


ROOT = Path(__file__).resolve().parents[1]


def site_folders(source: str) -> list[Path]:
    """Every overlay (and test fixture) holding a site's `source` file."""
    return sorted(p.parent for base in (ROOT / "overlays", ROOT / "tests" / "fixtures")
                  for p in base.rglob(source))


def write_or_check_sites(shipped: Path, render_shipped: Callable[[], str], source: str,
                         written: str, render_site: Callable[[Path], str],
                         argv: list[str] | None, doc: str | None) -> int:
    """`make gateway-config` for a file shipped in the base and one written beside each site's
    `source` (its name `written`): every one written, or with --check every stale one named."""
    failed = write_or_check(shipped, render_shipped(), argv, doc, "make gateway-config")
    for folder in site_folders(source):
        failed |= write_or_check(folder / written, render_site(folder), argv, doc,
                                 "make gateway-config")
    return failed
