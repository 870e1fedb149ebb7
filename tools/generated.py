"""The command line every generator of a committed file shares."""

from __future__ import annotations

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
