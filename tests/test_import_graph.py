"""The import graph (issue 25): no module of the engine, the operator or the gateway imports, directly or
through others, a module that imports it back. TYPE_CHECKING imports count too (they are the same coupling,
and a refactor that makes one real would be a circular import at run time). Which way imports may go between
parts is [tool.importlinter] in pyproject.toml, checked by `lint-imports` in scripts/test.sh."""

from __future__ import annotations

import grimp
import pytest


def _cycles(package: str) -> list[tuple[str, str]]:
    """Every direct import `a -> b` whose imported module imports the importer back, directly or not."""
    graph = grimp.build_graph(package)
    return sorted((m, i) for m in graph.modules for i in graph.find_modules_directly_imported_by(m)
                  if i in graph.modules and graph.chain_exists(importer=i, imported=m))


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
    assert _cycles("cyclic") == [("cyclic.a", "cyclic.b"), ("cyclic.b", "cyclic.a")]


# -- one writer per request field (issue 25): the scheduler owns the request's progress ------------------------
SCHEDULER_OWNED = ("num_computed_tokens", "num_in_flight_tokens", "num_output_placeholders", "spec_token_ids", "status",
                   "num_preemptions")


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
    assert _writers(field) <= {"core/scheduler.py"}, _writers(field)
