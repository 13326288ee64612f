"""Backends without Kubernetes: `--backend MODEL=URL`, `--standby MODEL=URL`, `--adapter MODEL=NAME`, and a
YAML file re-read when it changes:

    endpoints:
      - model: smollm2                # the name clients send
        name: default/smollm2         # optional: the endpoint key KEDA's `endpoint` metadata names
        serving: [http://127.0.0.1:8001, http://127.0.0.1:8002]
        standby: [http://127.0.0.1:8003]
        adapters: [sql, support]      # optional: LoRA adapters the backends serve (`sluice serve --lora-modules`)
        objectives: [{name: critical, priority: 10}]   # optional: as spec.routing.objectives
    models:                           # optional: split models (versions by weight), as a ServedModel's spec
      - model: chat                   # the name clients send
        versions:                     # each an endpoint above, by its key (`name`, else its model)
          - {endpoint: chat-v1, weight: 90}
          - {endpoint: chat-v2, weight: 10}
        aliases: {chat-canary: chat-v2}   # optional: a name that leads to one version always
        sessionHeader: x-session-id       # optional (the default): requests with one stick to a version

Locally an endpoint's key is its model name unless the file names it, and an adapter answers to its own name.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from .registry import EndpointSpec
from .versions import DEFAULT_SESSION_HEADER, SplitSpec, Version

log = logging.getLogger("sluice.gateway")
FILE_POLL_S = 0.5


def parse_pair(text: str, flag: str) -> tuple[str, str]:
    model, sep, url = text.partition("=")
    if not sep or not model or not url.startswith(("http://", "https://")):
        raise ValueError(f"{flag} takes MODEL=URL with an http(s) URL, got {text!r}")
    return model, url.rstrip("/")


def _urls(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(u, str) and u.startswith(("http://", "https://"))
                                              for u in value):
        raise ValueError(f"{where}: expected a list of http(s) URLs")
    return [u.rstrip("/") for u in value]


def _adapters(value: Any, model: str, where: str) -> list[str]:
    """Adapter names: a list of strings, or of {name: ...} as in an InferenceEndpoint's spec.adapters."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list of adapter names")
    names = [a.get("name") if isinstance(a, dict) else a for a in value]
    for a in names:
        if not isinstance(a, str) or not a:
            raise ValueError(f"{where}: expected a list of adapter names (strings, or {{name: ...}})")
        if a == model:
            raise ValueError(f"{where}: adapter {a!r} is the model's own name; clients tell them apart by name")
    return list(dict.fromkeys(names))


def _objectives(value: Any, where: str) -> dict[str, int]:
    """[{name, priority}] as an InferenceEndpoint's spec.routing.objectives."""
    if value is None:
        return {}
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list of {{name, priority}}")
    out: dict[str, int] = {}
    for o in value:
        if not (isinstance(o, dict) and isinstance(o.get("name"), str) and o["name"]
                and isinstance(o.get("priority"), int) and not isinstance(o["priority"], bool)):
            raise ValueError(f"{where}: expected {{name: <string>, priority: <integer>}}, got {o!r}")
        out[o["name"]] = o["priority"]
    return out


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One endpoint of a backends file."""

    key: str
    model: str
    serving: list[str]
    standby: list[str]
    adapters: list[str]
    priorities: dict[str, int] = field(default_factory=dict)


def parse_backends_file(text: str) -> list[FileEntry]:
    """One entry per endpoint in a backends file."""
    doc = yaml.safe_load(text) or {}
    if not isinstance(doc, dict) or not isinstance(doc.get("endpoints", []), list):
        raise ValueError("a backends file holds `endpoints:`, a list of {model, name?, serving, standby, adapters?}")
    out = []
    for i, e in enumerate(doc.get("endpoints") or []):
        if not isinstance(e, dict) or not isinstance(e.get("model"), str) or not e["model"]:
            raise ValueError(f"endpoints[{i}]: `model` (a string) is required")
        key = e.get("name") or e["model"]
        out.append(FileEntry(str(key), e["model"], _urls(e.get("serving"), f"endpoints[{i}].serving"),
                             _urls(e.get("standby"), f"endpoints[{i}].standby"),
                             _adapters(e.get("adapters"), e["model"], f"endpoints[{i}].adapters"),
                             _objectives(e.get("objectives"), f"endpoints[{i}].objectives")))
    return out


def parse_split(e: Any, where: str) -> SplitSpec:
    """One `models:` entry (a ServedModel's spec: model, versions, aliases?, sessionHeader?) as a SplitSpec keyed
    by its model name. The rules are the CRD's: at least one version, endpoints unique, weights integers >= 0
    with a positive sum, every alias naming one of the versions."""
    if not isinstance(e, dict) or not isinstance(e.get("model"), str) or not e["model"]:
        raise ValueError(f"{where}: `model` (a string) is required")
    unknown = set(e) - {"model", "versions", "aliases", "sessionHeader", "name"}
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
    versions = e.get("versions")
    if not isinstance(versions, list) or not versions:
        raise ValueError(f"{where}.versions: at least one {{endpoint, weight}} is required")
    out: list[Version] = []
    for i, v in enumerate(versions):
        if not (isinstance(v, dict) and isinstance(v.get("endpoint"), str) and v["endpoint"]
                and isinstance(v.get("weight"), int) and not isinstance(v["weight"], bool) and v["weight"] >= 0):
            raise ValueError(f"{where}.versions[{i}]: expected {{endpoint: <string>, weight: <integer >= 0>}}, "
                             f"got {v!r}")
        out.append(Version(v["endpoint"], v["weight"]))
    if len({v.endpoint for v in out}) != len(out):
        raise ValueError(f"{where}.versions: each endpoint may be listed once")
    if sum(v.weight for v in out) <= 0:
        raise ValueError(f"{where}.versions: the weights must add up to more than 0")
    aliases = e.get("aliases") or {}
    if not isinstance(aliases, dict) or not all(isinstance(a, str) and a and isinstance(t, str)
                                                for a, t in aliases.items()):
        raise ValueError(f"{where}.aliases: expected a map of alias name -> endpoint")
    for a, target in aliases.items():
        if target not in {v.endpoint for v in out}:
            raise ValueError(f"{where}.aliases.{a}: {target!r} is not one of the versions")
        if a == e["model"]:
            raise ValueError(f"{where}.aliases.{a}: the alias is the model's own name")
    header = e.get("sessionHeader", DEFAULT_SESSION_HEADER)
    if not isinstance(header, str) or not header:
        raise ValueError(f"{where}.sessionHeader: expected a header name")
    return SplitSpec(str(e.get("name") or e["model"]), e["model"], tuple(out), aliases=dict(aliases),
                     session_header=header.lower())


def parse_models(text: str) -> list[SplitSpec]:
    """The `models:` of a backends file (split models)."""
    doc = yaml.safe_load(text) or {}
    models = doc.get("models") if isinstance(doc, dict) else None
    if models is None:
        return []
    if not isinstance(models, list):
        raise ValueError("`models:` is a list of {model, versions, aliases?, sessionHeader?}")
    return [parse_split(m, f"models[{i}]") for i, m in enumerate(models)]


def build_specs(backends: list[str], standby: list[str], file_entries: Sequence[FileEntry],
                adapters: Sequence[str] = ()) -> list[EndpointSpec]:
    """Flags and file merged, one spec per endpoint key. `adapters`: --adapter MODEL=NAME, for endpoints the
    flags declare."""
    merged: dict[str, tuple[str, dict[str, bool], dict[str, bool], dict[str, None]]] = {}
    priorities: dict[str, dict[str, int]] = {}

    def add(key: str, model: str, serving: list[str], warm: list[str], loras: list[str]) -> None:
        _, s, w, a = merged.setdefault(key, (model, {}, {}, {}))
        s.update(dict.fromkeys(serving, True))
        w.update(dict.fromkeys(warm, True))
        a.update(dict.fromkeys(loras))

    for text in backends:
        model, url = parse_pair(text, "--backend")
        add(model, model, [url], [], [])
    for text in standby:
        model, url = parse_pair(text, "--standby")
        add(model, model, [], [url], [])
    for text in adapters:
        model, sep, name = text.partition("=")
        if not sep or not model or not name:
            raise ValueError(f"--adapter takes MODEL=NAME (a LoRA adapter the backends of MODEL serve), got {text!r}")
        if model not in merged:
            raise ValueError(f"--adapter {text}: no --backend or --standby serves {model!r} (an endpoint of "
                             "--backends-file lists its own `adapters`)")
        if name == model:
            raise ValueError(f"--adapter {text}: the adapter's name is the model's; clients tell them apart by name")
        add(model, model, [], [], [name])
    for e in file_entries:
        add(e.key, e.model, e.serving, e.standby, e.adapters)
        priorities.setdefault(e.key, {}).update(e.priorities)
    return [EndpointSpec(k, m, s, w, adapters=dict.fromkeys(a, ()), priorities=priorities.get(k, {}))
            for k, (m, s, w, a) in sorted(merged.items())]


class StaticDiscovery:
    def __init__(self, backends: list[str], standby: list[str], path: str | None,
                 apply: Callable[[list[EndpointSpec | SplitSpec]], None], adapters: Sequence[str] = ()):
        self.backends, self.standby, self.path, self._apply = backends, standby, path, apply
        self.adapters = adapters
        self._file_entries: list[FileEntry] = []
        self._file_models: list[SplitSpec] = []
        self._stamp: tuple[int, int, int] | None = None
        self._task: asyncio.Task | None = None
        build_specs(backends, standby, [], adapters)  # flag errors surface before anything starts

    def _read_file(self) -> bool:
        """Re-read the file if it changed; True when the entries changed. A broken file keeps the last."""
        assert self.path is not None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            stamp = None
        else:
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)  # a ConfigMap mount swaps a symlink: new inode
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            with open(self.path) as f:
                text = f.read()
            entries, models = parse_backends_file(text), parse_models(text)
        except FileNotFoundError:
            entries, models = [], []
        except (OSError, ValueError, yaml.YAMLError) as e:
            log.error("backends file %s: %s; keeping the previous backends", self.path, e)
            return False
        changed = (entries, models) != (self._file_entries, self._file_models)
        self._file_entries, self._file_models = entries, models
        return changed

    def specs(self) -> list[EndpointSpec | SplitSpec]:
        """The endpoints, then the split models."""
        return [*build_specs(self.backends, self.standby, self._file_entries, self.adapters), *self._file_models]

    async def start(self) -> None:
        if self.path:
            if not os.path.exists(self.path):
                log.warning("backends file %s does not exist yet; watching for it", self.path)
            self._read_file()
            self._task = asyncio.get_running_loop().create_task(self._watch())
        self._apply(self.specs())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(FILE_POLL_S)
            if self._read_file():
                log.info("backends file %s changed", self.path)
                self._apply(self.specs())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
