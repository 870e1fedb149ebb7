"""Checks of what we deploy; see schema/check.py."""

import sys
from pathlib import Path

# The Serve config's application args are checked with the forwarder's own model.
_SERVE = str(Path(__file__).resolve().parent.parent / "serve")
if _SERVE not in sys.path:
    sys.path.append(_SERVE)


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
