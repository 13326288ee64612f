"""--objectives-file: the engine re-reads its SLO and GPU price while running (no model, no server).

The file is laid out as the kubelet mounts a ConfigMap: `objectives.json` is a symlink through `..data`, and an
update swaps `..data` to a new directory; the engine must see the new values at its next scrape.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from sluice_engine.config import EngineConfig
from sluice_engine.metrics import EngineMetrics, RequestTimes, StatsSnapshot, _EngineCollector
from sluice_engine.objectives import Objectives, ObjectivesFile, parse_objectives


def write_configmap(root: Path, generation: int, objectives: dict) -> Path:
    """What the kubelet does on a ConfigMap update: a new timestamped directory, then an atomic swap of ..data."""
    data = root / f"..{generation}"
    data.mkdir()
    (data / "objectives.json").write_text(json.dumps(objectives))
    tmp = root / "..data_tmp"
    tmp.symlink_to(data.name)
    os.replace(tmp, root / "..data")
    link = root / "objectives.json"
    if not link.is_symlink():
        link.symlink_to("..data/objectives.json")
    return link


def test_parse_names_what_is_wrong() -> None:
    assert parse_objectives('{"slo-ttft-ms": 500, "slo-tpot-ms": null, "gpu-hour-usd": 2}') == Objectives(500.0, None, 2.0)
    for text, message in (('{"slo-ttft": 1}', "unknown keys"), ('{"slo-ttft-ms": 0}', "must be > 0"),
                          ('{"gpu-hour-usd": -1}', "must be >= 0"), ('{"slo-tpot-ms": "5"}', "a number or null"),
                          ("[]", "a JSON object")):
        with pytest.raises(ValueError, match=message):
            parse_objectives(text)


def test_a_configmap_update_is_seen_once(tmp_path: Path) -> None:
    path = write_configmap(tmp_path, 1, {"slo-ttft-ms": 500, "slo-tpot-ms": 50, "gpu-hour-usd": 1.5})
    watched = ObjectivesFile(str(path))
    assert watched.changed() == Objectives(500.0, 50.0, 1.5)
    assert watched.changed() is None  # unchanged: not parsed again
    write_configmap(tmp_path, 2, {"slo-ttft-ms": 250, "slo-tpot-ms": None, "gpu-hour-usd": 1.5})
    assert watched.changed() == Objectives(250.0, None, 1.5)
    write_configmap(tmp_path, 3, {"slo-ttft-ms": -1})
    assert watched.changed() is None  # invalid: the previous values stand
    assert ObjectivesFile(str(tmp_path / "absent.json")).changed() is None


def test_the_scrape_applies_new_objectives_to_goodput(tmp_path: Path) -> None:
    path = write_configmap(tmp_path, 1, {"slo-ttft-ms": 1000, "slo-tpot-ms": None, "gpu-hour-usd": None})
    cfg = EngineConfig(slo_ttft_ms=1.0, gpu_hour_usd=3.0, objectives_file=str(path))
    metrics = EngineMetrics.from_config(cfg, num_gpus=0)
    engine = SimpleNamespace(cfg=cfg, metrics=metrics, served_model_name="m", stats_snapshot=StatsSnapshot.zero)
    collector = _EngineCollector(engine)  # reads the file at its first scrape
    next(collector.collect())
    assert (metrics.slo_ttft, metrics.slo_tpot, metrics.gpu_hour_usd) == (1.0, None, 0.0)

    def complete(ttft_s: float) -> None:
        """A one-token request completing `ttft_s` after it arrived."""
        req = SimpleNamespace(num_output_tokens=1, arrival_time=0.0, first_scheduled_time=0.0, lora_name=None)
        times = RequestTimes(num_output_tokens=1, first_token_time=ttft_s, last_token_time=ttft_s, prefilling=False)
        metrics._on_completed(req, times, now=ttft_s)

    complete(0.5)
    assert metrics.requests_goodput == 1  # 500 ms meets the file's 1 s objective (the flag said 1 ms)
    write_configmap(tmp_path, 2, {"slo-ttft-ms": 100, "slo-tpot-ms": None, "gpu-hour-usd": 2.5})
    next(collector.collect())
    assert (metrics.slo_ttft, metrics.gpu_hour_usd) == (0.1, 2.5)
    complete(0.5)
    assert (metrics.requests_slo_checked, metrics.requests_goodput) == (2, 1)  # now 500 ms misses


def test_the_scrape_renders_the_published_snapshot_only() -> None:
    # /metrics reads no live engine object from the HTTP thread: it renders what the engine thread published
    # (AsyncEngine.stats) and the HTTP side's own count of submitted requests (waiting_in).
    import dataclasses

    cfg = EngineConfig()
    published = dataclasses.replace(StatsSnapshot.zero(), num_running=3, num_waiting=2, generation_tokens=17,
                                    adds_taken=5)

    class Engine:  # no scheduler, no KV manager, no stats: touching one would raise AttributeError
        served_model_name = "m"
        metrics = EngineMetrics.from_config(cfg, num_gpus=0)

        def __init__(self) -> None:
            self.cfg = cfg

        def stats_snapshot(self) -> StatsSnapshot:
            raise AssertionError("the scrape built a snapshot from the live engine")

    class Async:
        adds_submitted = 7

        def stats(self) -> StatsSnapshot:
            return published

        def waiting_in(self, snap: StatsSnapshot) -> int:
            return snap.num_waiting + self.adds_submitted - snap.adds_taken

    families = {f.name: f for f in _EngineCollector(Engine(), Async()).collect()}
    value = {name: families[name].samples[0].value for name in
             ("sluice_num_requests_running", "sluice_num_requests_waiting", "sluice_generation_tokens")}
    assert value == {"sluice_num_requests_running": 3, "sluice_num_requests_waiting": 4,
                     "sluice_generation_tokens": 17}
