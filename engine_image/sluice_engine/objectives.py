"""The endpoint's latency objectives and GPU price, re-read from a file while the engine runs.

`--objectives-file PATH` names a JSON object with the keys "slo-ttft-ms", "slo-tpot-ms" and "gpu-hour-usd"
(each a number, or null for unset). The values replace --slo-ttft-ms, --slo-tpot-ms and --gpu-hour-usd.
The operator writes the file into the endpoint's ConfigMap, mounted as a directory: when the ConfigMap
changes, the kubelet swaps the file in place (usually within a minute or two), and the engine picks the new
values up at its next metrics scrape. So editing an endpoint's `slo` or `cost` changes what the goodput
counters count and what the gauges export without restarting a pod (and reloading its model).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

KEYS = ("slo-ttft-ms", "slo-tpot-ms", "gpu-hour-usd")


@dataclass(frozen=True, slots=True)
class Objectives:
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    gpu_hour_usd: float | None = None


def parse_objectives(text: str) -> Objectives:
    """The file's contents; ValueError names what is wrong."""
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ValueError("expected a JSON object")
    unknown = sorted(set(doc) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown keys {unknown}; known: {', '.join(KEYS)}")
    values: dict[str, float | None] = {}
    for key in KEYS:
        value = doc.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"{key} must be a number or null, got {value!r}")
        if value is not None and key.startswith("slo-") and not value > 0:
            raise ValueError(f"{key} must be > 0, got {value}")
        if value is not None and not value >= 0:
            raise ValueError(f"{key} must be >= 0, got {value}")
        values[key.replace("-", "_")] = None if value is None else float(value)
    return Objectives(**values)


class ObjectivesFile:
    """Polled, not watched: `changed()` reads the file again only when its identity or size or mtime moved
    (a ConfigMap update replaces it through a symlink swap, which changes the inode)."""

    def __init__(self, path: str):
        self.path = path
        self._seen: tuple[int, int, int] | None = None

    def changed(self) -> Objectives | None:
        """The objectives, when the file changed since the last call and is valid; else None."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None  # not there (yet): the flags' values stand
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen == self._seen:
            return None
        self._seen = seen
        try:
            with open(self.path, encoding="utf-8") as f:
                return parse_objectives(f.read())
        except (OSError, ValueError) as e:
            log.warning("ignoring %s (the previous objectives stand): %s", self.path, e)
            return None
