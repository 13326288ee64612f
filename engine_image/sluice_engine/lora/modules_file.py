"""`--lora-modules-file PATH`: the adapters to serve, re-read while the engine runs (issue 26).

The file is a JSON object `{"adapters": [{"name": "sql", "path": "/cache/adapters/sql"}, ...]}`. The operator
writes it into the endpoint's ConfigMap from `spec.adapters` (the kubelet swaps the mounted file in place when
the ConfigMap changes), so adding an adapter to an endpoint loads it on running pods, and removing one
unloads it, without a restart. The engine core polls it (engine/core_loop.py) and reconciles:

- an adapter listed and not served is loaded once its directory holds `adapter_config.json` and
  `adapter_model.safetensors` (whatever fetches it writes them whole: a download renames into place), and is
  looked for again at every poll until then;
- an adapter that fails to load (rank over --max-lora-rank, shapes of another model) is logged and not tried
  again until its entry changes; the engine serves on;
- an adapter the file served and no longer lists is unloaded (requests on it finish first); one whose path
  changed is unloaded, then loaded from its new path.

Adapters given with --lora-modules or loaded through the API are not the file's: it never unloads them, and
an entry with the name of one is refused.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from ..core.lora_slots import LoRABusy

log = logging.getLogger("sluice.engine")

# An OpenAI model id that is also a file name: what the operator's CRD allows for spec.adapters[].name.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def parse_modules_file(text: str) -> dict[str, str]:
    """name -> path of each adapter the file lists; ValueError names what is wrong."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or set(doc) - {"adapters"}:
        raise ValueError('expected a JSON object {"adapters": [{"name": ..., "path": ...}, ...]}')
    entries = doc.get("adapters") or []
    if not isinstance(entries, list):
        raise ValueError("adapters must be a list")
    out: dict[str, str] = {}
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not isinstance(e.get("path"), str):
            raise ValueError(f"adapters[{i}] must be an object with string name and path")
        name = e["name"]
        if not NAME.match(name):
            raise ValueError(f"adapters[{i}].name {name!r} is not a valid adapter name ({NAME.pattern})")
        if name in out:
            raise ValueError(f"adapters[{i}].name {name!r} is listed twice")
        out[name] = e["path"]
    return out


def is_complete(path: str) -> bool:
    p = Path(path)
    return (p / "adapter_config.json").is_file() and (p / "adapter_model.safetensors").is_file()


class LoRAModulesFile:
    """The file's adapters, re-read when its identity, size or mtime moved (a ConfigMap update swaps a
    symlink, which changes the inode). A file that is missing or invalid leaves the last good list standing."""

    def __init__(self, path: str):
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self.wanted: dict[str, str] = {}

    def read(self) -> dict[str, str]:
        try:
            st = os.stat(self.path)
        except OSError:
            return self.wanted
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            self._seen = seen
            try:
                with open(self.path, encoding="utf-8") as f:
                    self.wanted = parse_modules_file(f.read())
            except (OSError, ValueError) as e:
                log.warning("ignoring %s (the adapters it listed before stand): %s", self.path, e)
        return self.wanted


class LoRAModulesSync:
    """Brings the engine's adapters to what the file lists (called by the engine loop, a poll at a time)."""

    def __init__(self, path: str):
        self.file = LoRAModulesFile(path)
        self.served: dict[str, str] = {}  # the adapters this file loaded: name -> path
        self.failed: dict[str, tuple[str, str]] = {}  # name -> (path, why): not tried again at this path

    def sync(self, engine) -> bool:
        """Load and unload to match the file; whether the served adapters changed."""
        wanted = self.file.read()
        changed = False
        for name, path in list(self.served.items()):
            if wanted.get(name) != path and name in engine.loras:
                engine.unload_lora(name)
                del self.served[name]
                changed = True
            elif name not in engine.loras:  # unloaded through the API meanwhile
                del self.served[name]
        for name, path in wanted.items():
            if name in self.served or self.failed.get(name, ("",))[0] == path or not is_complete(path):
                continue
            if name in engine.loras:
                self._refuse(name, path, "an adapter of that name is already served (--lora-modules or the API)")
                continue
            try:
                engine.load_lora(name, path)
            except LoRABusy:
                continue  # requests on its previous path are finishing: the next poll
            except ValueError as e:
                self._refuse(name, path, str(e))
                continue
            self.served[name] = path
            self.failed.pop(name, None)
            changed = True
            log.info("LoRA adapter %r loaded from %s (%s)", name, path, self.file.path)
        for name in [n for n in self.failed if n not in wanted]:
            del self.failed[name]
        return changed

    def _refuse(self, name: str, path: str, why: str) -> None:
        self.failed[name] = (path, why)
        log.warning("LoRA adapter %r in %s is not served: %s", name, self.file.path, why)
