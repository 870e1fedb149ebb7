"""Imports go one way: what ships to the pods (serve/triton_pod) imports none of the project's
other packages; the generators and the checks (gateway/, schema/, tools/, observability/)
never import the development harness (local_stack/), the tests or the benches; local_stack/
imports neither tests nor benches, and tests and benches not each other (but for a bench's own
test, named test_bench_<name>.py, which imports what it tests: tests/unit/test_bench_node.py).
Every import counts, those inside functions too (they hid a cycle: gateway/jwt.py ->
local_stack.settings -> gateway/jwt.py). `make lint` runs this file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.kustomize import ROOT

# Package -> (its folder, the project packages it must never import).
HARNESS = {"local_stack", "tests", "bench"}
LAYERS: dict[str, tuple[str, set[str]]] = {
    "triton_pod": ("serve/triton_pod", {"gateway", "schema", "tools", "observability"} | HARNESS),
    "gateway": ("gateway", HARNESS),
    "schema": ("schema", HARNESS),
    "tools": ("tools", HARNESS),
    "observability": ("observability", HARNESS),
    "local_stack": ("local_stack", {"tests", "bench"}),
    "bench": ("bench", {"tests"}),
    "tests": ("tests", {"bench"}),
}
# Code that runs inside Triton's Python backend or is Triton's own, unchanged.
NOT_OURS = {"models", "triton_examples"}
# A bench's own test imports the bench it tests.
BENCH_TEST = "test_bench_"


def imports_of(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def wrong_way(root: Path, package: str) -> list[str]:
    folder, forbidden = LAYERS[package]
    return [f"{path.relative_to(root)}:{line} imports {name} ({package} must not import "
            f"{name.split('.')[0]})"
            for path in sorted((root / folder).rglob("*.py"))
            if not NOT_OURS & set(path.relative_to(root).parts)
            for line, name in imports_of(path) if name.split(".")[0] in forbidden
            and not (name.split(".")[0] == "bench" and path.name.startswith(BENCH_TEST))]


@pytest.mark.parametrize("package", LAYERS)
def test_imports_go_one_way(package: str) -> None:
    assert wrong_way(ROOT, package) == []


def test_a_generator_importing_the_harness_inside_a_function_is_caught(tmp_path: Path) -> None:
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "jwt.py").write_text(
        "def render_site():\n    from local_stack.settings import env_file\n")
    assert wrong_way(tmp_path, "gateway") == [
        "gateway/jwt.py:2 imports local_stack.settings (gateway must not import local_stack)"]
