"""Server-side apply's field ownership, as the API server keeps it, for the kmock emulator (kube_emulator.py).

kmock merges every PATCH into the stored object; a real API server tracks which field manager owns each field
(`metadata.managedFields`) and, on an apply, removes the fields the manager applied before and no longer
applies, unless another manager owns them too. The operator's lifecycle guarantees (an autoscaled Deployment
keeps its replica count across a switch from `replicas` to `scaling`) rest on exactly these rules, so the
loop's tests need them. Rules, from https://kubernetes.io/docs/reference/using-api/server-side-apply/:

- An apply by manager M owns every field of its configuration. A field set to a different value than another
  manager's is a conflict (HTTP 409), unless the apply is forced: then M takes it over.
- A field M applied before and leaves out now is released; it is removed from the object when no other
  manager owns it (and then defaulted again, e.g. a Deployment's spec.replicas becomes 1).
- A non-apply write (update, merge patch) takes over every field it changes, from every other manager.

Simplifications, none of which the operator's tests depend on: lists are atomic (one field each; the real
server merges the keyed lists of built-in types item by item), fieldsV1 has no `.` or `k:` entries, and
status and the server's own metadata are never tracked.
"""

from __future__ import annotations

import copy
from typing import Any

Path = tuple[str, ...]
Owners = dict[tuple[str, str], set[Path]]  # (manager, operation) -> the fields it owns

UNTRACKED_METADATA = frozenset({"name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
                                "deletionTimestamp", "managedFields", "selfLink"})
# What the API server defaults when a field is missing, per kind: removing spec.replicas resets it to 1.
DEFAULTS: dict[str, dict[Path, Any]] = {
    "Deployment": {("spec", "replicas"): 1},
    "LeaderWorkerSet": {("spec", "replicas"): 1},
}


class Conflict(Exception):
    """An apply without force that would change fields another manager owns (the API server's 409)."""

    def __init__(self, conflicts: list[tuple[Path, str]]):
        self.conflicts = conflicts
        listed = "; ".join(f'conflict with "{m}": .{".".join(p)}' for p, m in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflict{'s' if len(conflicts) != 1 else ''}: {listed}")


def _tracked(path: Path) -> bool:
    if not path or path[0] in ("apiVersion", "kind", "status"):
        return False
    return not (path[0] == "metadata" and len(path) > 1 and path[1] in UNTRACKED_METADATA)


def leaves(obj: Any, prefix: Path = ()) -> dict[Path, Any]:
    """Every field of `obj` that can be owned, with its value: scalars, lists and empty maps."""
    if isinstance(obj, dict) and obj:
        out: dict[Path, Any] = {}
        for key, value in obj.items():
            out.update(leaves(value, (*prefix, key)))
        return out
    return {prefix: obj} if _tracked(prefix) else {}


_MISSING = object()


def get(obj: Any, path: Path) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return _MISSING
        obj = obj[key]
    return obj


def _set(obj: dict[str, Any], path: Path, value: Any) -> None:
    for key in path[:-1]:
        if not isinstance(obj.get(key), dict):
            obj[key] = {}
        obj = obj[key]
    obj[path[-1]] = copy.deepcopy(value)


def _remove(obj: dict[str, Any], path: Path) -> None:
    """Remove the field, and the maps it leaves empty."""
    parents = [obj]
    for key in path[:-1]:
        nxt = parents[-1].get(key)
        if not isinstance(nxt, dict):
            return
        parents.append(nxt)
    parents[-1].pop(path[-1], None)
    for depth in range(len(path) - 1, 0, -1):
        if parents[depth]:
            break
        parents[depth - 1].pop(path[depth - 1], None)


# -- managedFields -------------------------------------------------------------------------------------
def _fields_v1(paths: set[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return tree


def _paths(tree: dict[str, Any], prefix: Path = ()) -> set[Path]:
    if not tree:
        return {prefix}
    out: set[Path] = set()
    for key, sub in tree.items():
        out |= _paths(sub, (*prefix, key.removeprefix("f:")))
    return out


def owners(obj: dict[str, Any] | None) -> Owners:
    out: Owners = {}
    for entry in ((obj or {}).get("metadata") or {}).get("managedFields") or []:
        out[entry["manager"], entry["operation"]] = _paths(entry.get("fieldsV1") or {})
    return out


def _write_owners(obj: dict[str, Any], owned: Owners, api_version: str) -> None:
    obj.setdefault("metadata", {})["managedFields"] = [
        {"manager": m, "operation": op, "apiVersion": api_version, "fieldsType": "FieldsV1",
         "fieldsV1": _fields_v1(paths)}
        for (m, op), paths in owned.items() if paths]  # a manager that owns nothing is dropped


# -- the two kinds of write -------------------------------------------------------------------------------
def apply(live: dict[str, Any] | None, config: dict[str, Any], manager: str, force: bool) -> dict[str, Any]:
    """The object after `manager` applies `config` to `live` (None: the object does not exist yet)."""
    new = copy.deepcopy(live) if live is not None else {}
    owned = owners(live)
    applied = leaves(config)
    conflicts = [(path, m) for path, value in applied.items() for (m, op), paths in owned.items()
                 if m != manager and path in paths and get(new, path) != value]
    if conflicts and not force:
        raise Conflict(conflicts)
    for path, m in conflicts:  # forced: the field changes hands
        for (other, _), paths in owned.items():
            if other == m:
                paths.discard(path)
    before = owned.pop((manager, "Apply"), set())
    for path in before - set(applied):
        if not any(path in paths for paths in owned.values()):
            _remove(new, path)
    for path, value in applied.items():
        _set(new, path, value)
    for key in ("apiVersion", "kind"):
        new[key] = config.get(key, new.get(key))
    for key in ("name", "namespace"):
        new.setdefault("metadata", {})[key] = config["metadata"].get(key, new.get("metadata", {}).get(key))
    owned[manager, "Apply"] = set(applied)
    _default(new)
    _write_owners(new, owned, new["apiVersion"])
    return new


def update(old: dict[str, Any], new: dict[str, Any], manager: str) -> dict[str, Any]:
    """`new` (the object after a non-apply write by `manager`) with the ownership the write leaves."""
    new = copy.deepcopy(new)
    owned = owners(old)
    before, after = leaves(old), leaves(new)
    changed = {p for p in before.keys() | after.keys() if before.get(p, _MISSING) != after.get(p, _MISSING)}
    for paths in owned.values():
        paths -= changed
        paths -= {p for p in paths if p not in after}
    owned.setdefault((manager, "Update"), set()).update(p for p in changed if p in after)
    _default(new)
    _write_owners(new, owned, new.get("apiVersion", "v1"))
    return new


def _default(obj: dict[str, Any]) -> None:
    for path, value in DEFAULTS.get(obj.get("kind", ""), {}).items():
        if get(obj, path) is _MISSING:
            _set(obj, path, value)


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`: what kmock's stored object takes."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return copy.deepcopy(new)
    out: dict[str, Any] = {k: None for k in old if k not in new}
    for key, value in new.items():
        if key not in old:
            out[key] = copy.deepcopy(value)
        elif old[key] != value:
            out[key] = merge_patch(old[key], value)
    return out
