"""Structured output on CUDA: xgrammar's Triton masking kernel is named (never "auto") and compiled at engine
start-up, not at the first grammar request. On CPU, with a stand-in for the device check and xgrammar's
apply_token_bitmask_inplace recording its calls."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import VOCAB, write_tiny_llama

from sluice_engine.config import EngineConfig
from sluice_engine.engine.llm_engine import LLMEngine
from sluice_engine.structured import constraint

xgr = pytest.importorskip("xgrammar")


def test_the_backend_is_named_for_each_device():
    assert constraint.bitmask_backend(torch.device("cuda", 0)) == "triton"
    assert constraint.bitmask_backend(torch.device("cpu")) == "cpu"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def engine(model_dir, warmup: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", attention_backend="torch", quantization="none",
                                  kv_cache_memory=8 << 20, max_model_len=128, max_num_seqs=2,
                                  max_num_batched_tokens=32, warmup=warmup))


@pytest.fixture
def applied(monkeypatch) -> list[dict]:
    calls: list[dict] = []

    def record(logits, bitmask, *, vocab_size=None, indices=None, backend="auto"):
        calls.append(dict(logits=logits.clone(), bitmask=bitmask.clone(), indices=indices, backend=backend))

    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace", record)
    return calls


@pytest.mark.parametrize("on_cuda", [True, False], ids=["cuda-stand-in", "cpu"])
def test_startup_warms_the_triton_kernel_once_on_cuda_only(tiny_llama, applied, monkeypatch, on_cuda):
    monkeypatch.setattr(constraint, "on_cuda", lambda device: on_cuda)
    e = engine(tiny_llama, "minimal")
    assert applied == []  # building the engine compiles nothing: the server's warm-up does
    e.warm_up()
    if not on_cuda:
        assert applied == []
        return
    # Once per kind of masked-row count Triton specializes on (1, a multiple of 16, any other), with the
    # backend named, on logits as the sampler masks them (fp32, the model's vocabulary), nothing masked.
    assert [c["backend"] for c in applied] == ["triton"] * len(constraint.WARMUP_ROWS)
    assert [len(c["indices"]) for c in applied] == list(constraint.WARMUP_ROWS)
    for c in applied:
        assert c["logits"].dtype == torch.float32 and c["logits"].shape == (max(constraint.WARMUP_ROWS), VOCAB)
        assert c["indices"].dtype == torch.int32
        assert c["bitmask"].shape == tuple(xgr.get_bitmask_shape(max(constraint.WARMUP_ROWS), VOCAB))
        assert bool((c["bitmask"] == -1).all()), "warm-up's bitmask allows every token"


def test_no_warmup_means_no_kernel_warmup(tiny_llama, applied, monkeypatch):
    monkeypatch.setattr(constraint, "on_cuda", lambda device: True)
    engine(tiny_llama, "off").warm_up()
    assert applied == []


@pytest.mark.parametrize("on_cuda", [True, False], ids=["cuda-stand-in", "cpu"])
def test_a_grammar_request_masks_with_the_named_backend(applied, monkeypatch, on_cuda):
    monkeypatch.setattr(constraint, "on_cuda", lambda device: on_cuda)
    vocab = ["a", "b", "c", "</s>"]
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[3])).compile_regex("a+")
    c = constraint.GrammarConstraint(compiled, constraint.GrammarConstraint.stop_row(len(vocab), [3]))
    constraint.GrammarConstraint.apply_batch(torch.zeros(2, len(vocab)), [(1, c, [])])
    (call,) = applied
    assert call["backend"] == ("triton" if on_cuda else "cpu")
    assert list(call["indices"]) == [1]
