"""Backends without Kubernetes: `--backend MODEL=URL`, `--standby MODEL=URL`, and a YAML file re-read when
it changes:

    endpoints:
      - model: smollm2                # the name clients send
        name: default/smollm2         # optional: the endpoint key KEDA's `endpoint` metadata names
        serving: [http://127.0.0.1:8001, http://127.0.0.1:8002]
        standby: [http://127.0.0.1:8003]

Locally an endpoint's key is its model name unless the file names it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

import yaml

from .registry import EndpointSpec

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


def parse_backends_file(text: str) -> list[tuple[str, str, list[str], list[str]]]:
    """(key, model, serving urls, standby urls) per endpoint in a backends file."""
    doc = yaml.safe_load(text) or {}
    if not isinstance(doc, dict) or not isinstance(doc.get("endpoints", []), list):
        raise ValueError("a backends file holds `endpoints:`, a list of {model, name?, serving, standby}")
    out = []
    for i, e in enumerate(doc.get("endpoints") or []):
        if not isinstance(e, dict) or not isinstance(e.get("model"), str) or not e["model"]:
            raise ValueError(f"endpoints[{i}]: `model` (a string) is required")
        key = e.get("name") or e["model"]
        out.append((str(key), e["model"], _urls(e.get("serving"), f"endpoints[{i}].serving"),
                    _urls(e.get("standby"), f"endpoints[{i}].standby")))
    return out


def build_specs(backends: list[str], standby: list[str], file_entries: list) -> list[EndpointSpec]:
    """Flags and file merged, one spec per endpoint key."""
    merged: dict[str, tuple[str, dict[str, bool], dict[str, bool]]] = {}

    def add(key: str, model: str, serving: list[str], warm: list[str]) -> None:
        _, s, w = merged.setdefault(key, (model, {}, {}))
        s.update(dict.fromkeys(serving, True))
        w.update(dict.fromkeys(warm, True))

    for text in backends:
        model, url = parse_pair(text, "--backend")
        add(model, model, [url], [])
    for text in standby:
        model, url = parse_pair(text, "--standby")
        add(model, model, [], [url])
    for key, model, serving, warm in file_entries:
        add(key, model, serving, warm)
    return [EndpointSpec(k, m, s, w) for k, (m, s, w) in sorted(merged.items())]


class StaticDiscovery:
    def __init__(self, backends: list[str], standby: list[str], path: str | None,
                 apply: Callable[[list[EndpointSpec]], None]):
        self.backends, self.standby, self.path, self._apply = backends, standby, path, apply
        self._file_entries: list = []
        self._stamp: tuple[int, int, int] | None = None
        self._task: asyncio.Task | None = None
        build_specs(backends, standby, [])  # flag errors surface before anything starts

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
                entries = parse_backends_file(f.read())
        except FileNotFoundError:
            entries = []
        except (OSError, ValueError, yaml.YAMLError) as e:
            log.error("backends file %s: %s; keeping the previous backends", self.path, e)
            return False
        changed = entries != self._file_entries
        self._file_entries = entries
        return changed

    def specs(self) -> list[EndpointSpec]:
        return build_specs(self.backends, self.standby, self._file_entries)

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
