"""Every file path, make target, environment variable and invariant name that the README, docs/
or a comment quotes exists: a reader who follows one never lands on nothing (the first column
of a Renames table in docs/ names what is gone)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP = ("base", "gateway", "triton", "serve", "components", "overlays", "clusters", "schema",
       "tools", "local_stack", "observability", "bench", "docs", "tests", ".ci")
# A path of ours: it starts at one of the top-level folders (or is a top-level file).
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP)
                  + r")/[\w./-]*|Makefile|pyproject\.toml|requirements\.(?:in|txt))")
MAKE = re.compile(r"\bmake ([a-z][a-z-]+)\b")
ENV_VAR = re.compile(r"(?<![\w$.-])([A-Z][A-Z0-9]*_[A-Z0-9_]*[A-Z0-9])(?![\w-])")
INVARIANT = re.compile(r"\binvariants? `?([a-z0-9]+(?:-[a-z0-9*]+)+)`?")
# Words after "make" in prose, not targets.
NOT_TARGETS = {"sure", "it", "them", "the", "a", "one", "up", "target"}
# Quoted as other projects' names (Kubernetes, Ray, Triton, Envoy, Prometheus, Flux...), not
# ours: only our own variables must be set somewhere in this repository.
FOREIGN_VARIABLE_PREFIXES = ("RAY_", "KUBERNETES_", "NVIDIA_", "CUDA_", "LD_", "XDG_", "PR_",
                             "SC_", "HTTP_", "SSL_", "GRPC_", "PYTHON", "KIND_")


def _tracked() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in listed.splitlines() if (ROOT / line).is_file()]


def _vendored(path: Path) -> bool:
    rel = path.relative_to(ROOT).parts
    return rel[:2] == ("tests", "triton_examples") or rel[:2] == ("schema", "crd") or (
        rel[:2] == ("schema", "generated")) or path.suffix == ".json"


def _comments(path: Path) -> Iterator[tuple[int, str]]:
    """The prose of a file: all of a Markdown file, comments and docstrings elsewhere."""
    text = path.read_text(errors="replace")
    if path.suffix == ".md" or path.name == "SOURCE":
        heading = ""
        for number, line in enumerate(text.splitlines(), 1):
            if line.startswith("#"):
                heading = line.lstrip("# ").strip()
            if heading == "Renames" and line.startswith("|"):
                # A rename table's first column names what is gone.
                line = "|".join(line.split("|")[2:])
            yield number, line
        return
    marker = "--" if path.suffix == ".lua" else "#"
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith(marker):
            yield number, stripped
        elif f" {marker} " in line and path.suffix in (".py", ".yaml", ".env", ".lua", ""):
            yield number, line.split(f" {marker} ", 1)[1]
    if path.suffix == ".py":
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    at: int = getattr(node, "lineno", 1)
                    yield from ((at, part) for part in doc.splitlines())


def _prose_files() -> list[Path]:
    return [p for p in _tracked() if not _vendored(p)
            and (p.suffix in (".md", ".py", ".yaml", ".env", ".lua", ".pbtxt", ".toml")
                 or p.name in ("Makefile", "SOURCE", "run"))]


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, re.MULTILINE))


def _invariants() -> set[str]:
    schema = json.loads((ROOT / "schema" / "invariants.schema.json").read_text())
    titles: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("title"), str):
                titles.add(node["title"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    fixtures = ROOT / "tests" / "fixtures" / "invariants"
    return titles | {p.name for p in fixtures.iterdir() if p.is_dir()}


def _code_text() -> str:
    """Where a variable is read or set: code, manifests, the Makefile (not the prose)."""
    return "\n".join(p.read_text(errors="replace") for p in _tracked()
                     if p.suffix in (".py", ".yaml", ".env", ".lua", ".toml") or p.name == "Makefile")


def references_to_nothing(files: list[Path]) -> list[str]:
    targets, invariants, code = _make_targets(), _invariants(), _code_text()
    problems = []
    for path in files:
        where = path.relative_to(ROOT)
        for number, line in _comments(path):
            if "://" in line:
                continue  # a URL's path is another site's
            for match in PATH.finditer(line):
                ref = match.group(1).rstrip(".,:;)'`\"")
                if any(c in ref for c in "<*") or re.match(r"\s+of\b", line[match.end():]):
                    continue  # a pattern, or another repository's file
                candidates = [ROOT / ref, path.parent / ref]
                if not any(c.exists() for c in candidates):
                    problems.append(f"{where}:{number}: path {ref} does not exist")
            for target in MAKE.findall(line):
                if target not in targets and target not in NOT_TARGETS:
                    problems.append(f"{where}:{number}: make target {target!r} does not exist")
            for name in INVARIANT.findall(line):
                if "*" not in name and name not in invariants:
                    problems.append(f"{where}:{number}: invariant {name!r} does not exist")
            if path.suffix == ".md":
                for name in ENV_VAR.findall(line):
                    if not name.startswith(FOREIGN_VARIABLE_PREFIXES) and name not in code:
                        problems.append(f"{where}:{number}: variable {name} is read nowhere")
    return problems


def test_no_reference_points_at_nothing() -> None:
    problems = references_to_nothing(_prose_files())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text, found", [
    ("# see base/no-such-file.yaml for why", "path base/no-such-file.yaml"),
    ("# run `make no-such-target` first", "make target 'no-such-target'"),
    ("# checked by the invariant no-such-invariant", "invariant 'no-such-invariant'"),
    # Spelt in two parts here: this file is code, where a variable counts as read.
    ("set `SONIC_RAY_" + "ABSENT_VARIABLE` to change it", "variable SONIC_RAY_" + "ABSENT_VARIABLE"),
])
def test_a_reference_to_nothing_is_found(tmp_path: Path, text: str, found: str) -> None:
    bad = ROOT / "docs" / f".reference-test-{tmp_path.name}.md"
    bad.write_text(text + "\n")
    try:
        problems = references_to_nothing([bad])
    finally:
        bad.unlink()
    assert any(found in p for p in problems), problems


def test_references_that_exist_are_not_flagged(tmp_path: Path) -> None:
    good = ROOT / "docs" / f".reference-test-{tmp_path.name}.md"
    good.write_text("base/rayservice.yaml, `make check`, `SONIC_RAY_ADMIN_KEY`, "
                    "the invariant one-gpu-per-triton, docs/user_guide/metrics.md of "
                    "triton-inference-server/server\n")
    try:
        assert references_to_nothing([good]) == []
    finally:
        good.unlink()


# Every test here starts processes (make unit leaves them out: tests/conftest.py).
pytestmark = pytest.mark.processes
