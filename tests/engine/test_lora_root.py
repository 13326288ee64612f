"""--lora-root (issue 39): a run-time adapter path resolves (symlinks followed) to the root or under it, or is
refused with one message whatever is on disk; the engine core checks it again where it loads."""

from __future__ import annotations

import types

import pytest

from sluice_engine.engine.core_loop import EngineLoop
from sluice_engine.engine.messages import LoadLoRA, UnloadLoRA
from sluice_engine.lora.paths import NO_ROOT, OUTSIDE_ROOT, LoRAPathRefused, resolve_under_root


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "adapters"
    (root / "sql").mkdir(parents=True)
    (root / "escape").symlink_to("/etc")
    (root / "inside").symlink_to(root / "sql")
    return root


def test_paths_under_the_root_resolve(root):
    real = str((root / "sql").resolve())
    assert resolve_under_root(str(root / "sql"), str(root)) == real
    assert resolve_under_root("sql", str(root)) == real  # relative: under the root
    assert resolve_under_root(str(root / "inside"), str(root)) == real  # a symlink that stays inside
    assert resolve_under_root(str(root / "x" / ".." / "sql"), str(root)) == real
    assert resolve_under_root(str(root / "not-yet"), str(root)).endswith("not-yet")  # the loader says it is missing


@pytest.mark.parametrize("path", ["/etc", "/nonexistent-xyz", "/", "..", "../adapters-sibling", "escape",
                                  "escape/passwd", "/etc/../etc", "a\x00b"])
def test_paths_outside_the_root_are_refused_with_one_message(root, path):
    with pytest.raises(LoRAPathRefused) as e:
        resolve_under_root(path, str(root))
    assert str(e.value) == OUTSIDE_ROOT and e.value.param == "lora_path"


def test_a_root_given_through_a_symlink_is_the_directory_it_names(root, tmp_path):
    link = tmp_path / "root-link"
    link.symlink_to(root)
    assert resolve_under_root(str(root / "sql"), str(link)) == str((root / "sql").resolve())
    with pytest.raises(LoRAPathRefused):
        resolve_under_root(str(link / "escape"), str(link))


def test_no_root_refuses_every_run_time_load():
    with pytest.raises(LoRAPathRefused, match="--lora-root"):
        resolve_under_root("/anything", None)
    assert "--lora-root" in NO_ROOT


class _Outbox:
    def lora_updated(self, msg) -> None: ...


def _loop(lora_root):
    """An EngineLoop over a stand-in engine that records the loads reaching it."""
    loaded = []
    engine = types.SimpleNamespace(cfg=types.SimpleNamespace(lora_root=lora_root), loras={},
                                   load_lora=lambda name, path: loaded.append((name, path)),
                                   unload_lora=lambda name: 0)
    return EngineLoop(engine, inbox=None, outbox=_Outbox(), clock=None), loaded


def test_the_core_refuses_loads_outside_the_root_before_the_engine_reads_them(root):
    loop, loaded = _loop(str(root))
    for path in ("/etc", "/nonexistent-xyz", str(root / "escape")):
        msg = loop._lora_call(LoadLoRA("1", "a", path))
        assert (msg.error, msg.error_kind, msg.error_param) == (OUTSIDE_ROOT, "invalid", "lora_path")
    assert loaded == []
    assert loop._lora_call(LoadLoRA("2", "a", str(root / "inside"))).error is None
    assert loaded == [("a", str((root / "sql").resolve()))]  # the resolved path: the symlink is not read again
    assert loop._lora_call(UnloadLoRA("3", "a")).error is None


def test_the_core_refuses_run_time_loads_without_a_root(root):
    loop, loaded = _loop(None)
    msg = loop._lora_call(LoadLoRA("1", "a", str(root / "sql")))
    assert msg.error == NO_ROOT and msg.error_kind == "invalid" and loaded == []
