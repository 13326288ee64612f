"""The import graph (issue 25): no module of the engine, the operator or the gateway imports, directly or
through others, a module that imports it back. TYPE_CHECKING imports count too (they are the same coupling,
and a refactor that makes one real would be a circular import at run time). Which way imports may go between
parts is [tool.importlinter] in pyproject.toml, checked by `lint-imports` in scripts/test.sh."""

from __future__ import annotations

import grimp
import pytest


def _cycles(package: str) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph = grimp.build_graph(package)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & graph.modules) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return out


@pytest.mark.parametrize("package", ["sluice_engine", "sluice_operator", "sluice_autoscaler"])
def test_no_import_cycles(package: str) -> None:
    assert _cycles(package) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch) -> None:
    pkg = tmp_path / "cyclic"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    (pkg / "c.py").write_text("from . import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cycles("cyclic") == [["cyclic.a", "cyclic.b"]]


# -- one writer per request field (issue 25): the scheduler owns the request's progress ------------------------
SCHEDULER_OWNED = ("num_computed_tokens", "spec_token_ids", "status", "num_preemptions")


def _writers(field: str) -> set[str]:
    """Modules of the engine that assign the field of a Request (`x.field = ...`, `x.field += ...`), or mutate
    its list in place. The draft model's own shadow requests (spec_decode/draft_model.py) are its objects."""
    import ast
    from pathlib import Path

    import sluice_engine

    root = Path(sluice_engine.__file__).parent
    out = set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("append", "extend", "clear", "pop", "insert"):
                targets = [node.func.value]
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == field and not (
                        isinstance(t.value, ast.Name) and t.value.id in ("self", "shadow")):
                    out.add(str(path.relative_to(root)))
    return out


@pytest.mark.parametrize("field", SCHEDULER_OWNED)
def test_the_scheduler_is_the_only_writer_of_request_progress(field: str) -> None:
    assert _writers(field) <= {"scheduler.py"}, _writers(field)
