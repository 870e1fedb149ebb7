"""The docs say what the code does where that can be generated or checked: the invariant list
is written from the schema (docs/invariants.md, schema/invariants_doc.py), and no command block
in the README or docs/ gives the same command twice (docs/local.md once gave one HTTP client
twice where the gRPC one was meant)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schema import invariants_doc

ROOT = Path(__file__).resolve().parents[2]
SHELLS = {"sh", "bash", "shell"}
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_invariant_list_is_the_schemas() -> None:
    assert invariants_doc.main(["--check"]) == 0, "docs/invariants.md is stale: make generate"


def test_every_invariant_with_fixtures_is_listed() -> None:
    listed = invariants_doc.rules(json.loads(invariants_doc.SCHEMA.read_text()), {})
    fixtures = {p.name for p in (ROOT / invariants_doc.FIXTURES).iterdir() if p.is_dir()}
    assert fixtures - set(listed) - set(invariants_doc.CHECKS_BESIDE) == set()


def repeated_commands(text: str) -> list[str]:
    """The commands a shell block (```sh, ```bash) gives more than once."""
    repeated: list[str] = []
    block, shell, seen = False, False, set[str]()
    for line in text.splitlines():
        if line.startswith("```"):
            block, seen = not block, set()
            shell = block and line[3:].strip() in SHELLS
            continue
        command = line.split("#")[0].strip()
        if shell and command:
            if command in seen:
                repeated.append(command)
            seen.add(command)
    return repeated


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_no_command_block_gives_a_command_twice(page: Path) -> None:
    assert repeated_commands(page.read_text()) == []


def test_a_repeated_command_is_caught() -> None:
    assert repeated_commands("```sh\nmake local\nmake test\nmake local  # again\n```\n") == [
        "make local"]
