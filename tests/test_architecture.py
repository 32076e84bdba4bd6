"""The style rules the project holds itself to, checked on the source (docs/architecture.md):

- every setting is read in freetoken/config.py: no environment reads anywhere else;
- no model family is named outside the model files (freetoken/models/), the per-family chat
  formats (freetoken/chat/formats/) and the example-checkpoint writers (freetoken/tools/):
  generic code that branches on a family is how one family's fix breaks another's;
- no import cycles between packages at import time (an import inside a function, such as
  the composition root `server.serve` building the API, is a deliberate late binding);
- no file over 500 lines and no function over 60, as `ruff format` lays them out (the test
  command checks the layout itself).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from freetoken import models

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("freetoken",)
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 60
FAMILY_PLACES = ("freetoken/models/", "freetoken/chat/formats/", "freetoken/tools/")


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _tree(p: Path) -> ast.Module:
    return ast.parse(p.read_text(), filename=str(p))


def test_settings_are_read_only_in_config():
    found = []
    for p in _sources():
        if _rel(p) == "freetoken/config.py":
            continue
        for node in ast.walk(_tree(p)):
            env = isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
            env |= (
                isinstance(node, ast.ImportFrom)
                and node.module == "os"
                and any(a.name in ("environ", "getenv") for a in node.names)
            )
            if env:
                found.append(f"{_rel(p)}:{node.lineno}")
    assert not found, f"environment read outside freetoken/config.py: {found}"


def _family_names() -> set[str]:
    names = set()
    for a in models.ARCHITECTURES.values():
        names |= {a.model_type, a.gguf_arch, a.family}
    return names


# GGUF's own vocabulary that a family's name happens to spell: `tokenizer.ggml.model` is
# "llama" for every SentencePiece file (Mixtral's, ERNIE's), not the llama family
NOT_FAMILIES = {"freetoken/weights/gguf_tokenizer.py": {"llama"}}


def test_model_families_are_named_only_in_their_own_places():
    names, found = _family_names(), []
    for p in _sources():
        if _rel(p).startswith(FAMILY_PLACES):
            continue
        allowed = NOT_FAMILIES.get(_rel(p), set())
        for node in ast.walk(_tree(p)):
            if isinstance(node, ast.Constant) and node.value in names - allowed:
                found.append(f"{_rel(p)}:{node.lineno} {node.value!r}")
    assert not found, f"model families named in generic code: {found}"


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _module_of(p: Path) -> str:
    return ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _import_time_imports(tree: ast.Module) -> list[str]:
    """Modules imported when the module is imported: not inside functions, and not under
    `if TYPE_CHECKING:` (annotations only)."""
    out: list[str] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                out.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.append(node.module)
                out.extend(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.If | ast.Try | ast.With | ast.ClassDef):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, field, []):
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])

    visit(tree.body)
    return out


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for p in _sources():
        if not _rel(p).startswith("freetoken/"):
            continue
        here = _package(_module_of(p))
        for name in _import_time_imports(_tree(p)):
            if name.startswith("freetoken.") and _package(name) != here:
                graph[here].add(_package(name))
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_cycles_between_packages():
    graph = _package_graph()
    cycles = sorted(f"{a} -> {b}" for a in graph for b in graph[a] if a in _reachable(graph, b))
    assert not cycles, f"packages that import each other (directly or around a loop): {cycles}"


def _function_lengths(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("package", PACKAGES)
def test_files_and_functions_stay_small(package):
    long_files, long_functions = [], []
    for p in (ROOT / package).rglob("*.py"):
        lines = p.read_text().count("\n")
        if lines > MAX_FILE_LINES:
            long_files.append(f"{_rel(p)} ({lines} lines)")
        for name, line, length in _function_lengths(_tree(p)):
            if length > MAX_FUNCTION_LINES:
                long_functions.append(f"{_rel(p)}:{line} {name} ({length} lines)")
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def test_the_checks_see_what_they_check():
    """The rules above would pass vacuously on an empty tree or a broken walk."""
    assert len(_sources()) > 100 and "qwen3_moe" in _family_names()
    graph = _package_graph()
    assert (
        "freetoken.moe" in graph["freetoken.runtime"]
        and "freetoken.layers" in graph["freetoken.moe"]
    )
    tc = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import freetoken.x\n")
    assert _import_time_imports(tc) == ["typing", "typing.TYPE_CHECKING"]
