"""Warm-up before ready (issue 15): the server answers /ready 503 "warming up" until its dummy steps have run,
then 200; the dummy steps leave requests' KV and the prefix cache alone; a warm-up that fails fails the start.

In process (the app over the engine, TestClient): warm-up is made observable by holding LLMEngine.warm_up on
an event, so no timing is involved. The bundled model on CPU; `auto` is `minimal` there."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from fastapi.testclient import TestClient

from sluice_engine.config import EngineConfig
from sluice_engine.entrypoints.llm import LLM
from sluice_engine.entrypoints.openai.server import build_app
from sluice_engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    # Small limits, so that a `full` warm-up on CPU is a handful of steps: prompt chunks 32 and 64, decode
    # batches 1, 2 and 4 (the torch and cpu backends never split: no split steps).
    # fp32 weights (not the bundled model's default Q4_1): the test compares a prefix-cached run's greedy tokens
    # with an uncached one's exactly, and int8 activations can flip a near-tie between the two paths.
    return LLM(kv_cache_memory=16 << 20, max_model_len=256, device="cpu", max_num_seqs=4, max_num_batched_tokens=64,
               quantization="none")


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_ready_is_503_warming_up_until_the_warmup_has_run(llm, monkeypatch, caplog):
    engine = llm.engine
    release = threading.Event()
    entered = threading.Event()
    original = engine.warm_up

    def held_warm_up(on_step=None):
        entered.set()
        assert release.wait(60), "the test never released the warm-up"
        return original(on_step)

    monkeypatch.setattr(engine, "warm_up", held_warm_up)
    caplog.set_level(logging.INFO, logger="sluice.engine")
    with TestClient(build_app(engine)) as http:
        assert entered.wait(30)
        r = http.get("/ready")
        assert r.status_code == 503 and r.json() == {"status": "not ready", "error": "warming up"}
        assert http.get("/health").status_code == 200  # alive: liveness must not restart a warming pod
        # A request sent meanwhile (a client that did not wait for readiness) waits, then is served.
        answer = {}
        t = threading.Thread(target=lambda: answer.update(r=http.post("/v1/completions", json={
            "model": engine.served_model_name, "prompt": "Hello", "max_tokens": 2})))
        t.start()
        time.sleep(0.2)
        assert not answer and http.get("/ready").status_code == 503
        release.set()
        wait_for(lambda: http.get("/ready").status_code == 200)
        assert http.get("/ready").json()["status"] == "ready"
        t.join(60)
        assert answer["r"].status_code == 200 and answer["r"].json()["usage"]["completion_tokens"] == 2
        report = http.app.state.async_engine.warmup_report
    assert report.mode == "minimal" and report.steps == 1  # auto on CPU
    assert any("warm-up (minimal): 1 step (prompt chunks 16, decode batches 1)" in r.getMessage() for r in caplog.records)


def test_warmup_leaves_kv_and_prefix_cache_alone(llm):
    """Full warm-up between two identical requests: the second still hits the first's cached prefix and
    generates the same tokens; every block is free again afterwards."""
    engine = llm.engine
    prompt = list(range(100, 150))  # 50 tokens: three full 16-token blocks to cache
    first = llm.generate([prompt], GREEDY)[0]
    cached_before = dict(engine.kv.pool.cached)
    assert len(cached_before) >= 3
    engine.cfg.warmup = "full"
    try:
        report = engine.warm_up()
    finally:
        engine.cfg.warmup = "auto"
    assert report.mode == "full"
    assert report.steps == 2 + 3  # prompt chunks 32 and 64; decode batches 1, 2 and 4; no splits on CPU
    assert engine.kv.pool.cached == cached_before
    assert engine.kv.num_free_blocks() == engine.kv.num_blocks
    second = llm.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens == 48
    assert second.token_ids == first.token_ids
    # The dummy sequences' block-table rows went back with the first real step (input_buffers.py).
    held = [rid for rid in engine.runner.inputs.rows._row if rid.startswith("sluice-warmup-")]
    assert held == []


def test_warmup_off_is_ready_at_once_and_runs_no_step(llm, monkeypatch):
    engine = llm.engine
    monkeypatch.setattr(engine.cfg, "warmup", "off")
    calls = []
    monkeypatch.setattr(engine.executor, "execute_model", lambda sched: calls.append(sched))
    with TestClient(build_app(engine)) as http:
        wait_for(lambda: http.get("/ready").status_code == 200)
        assert http.app.state.async_engine.warmup_report.steps == 0
    assert calls == []


def test_a_failing_warmup_fails_the_start(llm, monkeypatch):
    """A shape that cannot run (here: the forward raises, as a missing compiler or an OOM would) is found
    before any request: never ready, /health 503, and the server is told to stop (on_dead)."""
    engine = llm.engine

    def boom(sched):
        raise RuntimeError("no C compiler (simulated)")

    monkeypatch.setattr(engine.executor, "execute_model", boom)
    app = build_app(engine)
    dead = threading.Event()
    app.state.async_engine.on_dead = lambda e: dead.set()
    with TestClient(app) as http:
        assert dead.wait(30)
        assert http.get("/ready").status_code == 503
        r = http.get("/health")
        # A fixed reason: the exception's text is logged, never shown to whoever probes (issue 39).
        assert r.status_code == 503 and r.json() == {"status": "dead", "error": "engine dead"}
    assert engine.kv.num_free_blocks() == engine.kv.num_blocks  # the borrowed block went back


def test_the_flag_is_validated():
    with pytest.raises(ValueError, match="--warmup must be one of auto, full, minimal, off"):
        EngineConfig(warmup="always")


@pytest.mark.slow
def test_full_warmup_covers_verification_and_the_draft_model(model_dir, tmp_path):
    """With a draft model, warm-up also runs verification batches (k + 1 tokens a sequence, up to the
    speculating batch size) and the draft's own forwards, and hands the draft's KV back."""
    from sluice_engine.spec_decode.layer_draft import write_layer_draft

    draft = write_layer_draft(model_dir, tmp_path / "draft-2l", 2)
    llm = LLM(str(model_dir), kv_cache_memory=16 << 20, max_model_len=256, device="cpu", max_num_seqs=4,
              max_num_batched_tokens=64, draft_model=str(draft), num_speculative_tokens=2, warmup="full")
    engine = llm.engine
    report = engine.warm_up()
    assert report.steps == 2 + 3 + 3  # prompt chunks 32, 64; decode batches 1, 2, 4; verification 1, 2, 4
    assert report.draft_queries == 1  # no split on CPU: one short query (catch-up, then a decode forward)
    assert engine.proposer.kv.num_free_blocks() == engine.proposer.kv.num_blocks
    assert engine.kv.num_free_blocks() == engine.kv.num_blocks
    out = llm.generate([list(range(100, 120))], GREEDY)[0]  # and it serves
    assert len(out.token_ids) == GREEDY.max_tokens
