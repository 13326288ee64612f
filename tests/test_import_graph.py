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
