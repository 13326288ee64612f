"""The GGUF decoder layers as one C++ call per step (models/ggml_decoder.py, cpu_kernels/ggml_decoder.cpp) give
the floats of the layer loop they replace, bit for bit, on every CPU kernel level this machine runs: the bundled
model in its Q4_1 blocks, greedy with log-probabilities, through batches that mix prompts (chunked: a prompt's
later chunks attend to its cached first ones, and 64+ rows take the tiled attention) with decodes of other
sequences. Also: where the stack does not apply, the loop runs (LoRA wraps the projections; the switch)."""

from __future__ import annotations

import pytest
import torch
from cpu_isas import CPU_ISAS

from sluice_engine.entrypoints.llm import LLM
from sluice_engine.models.ggml_decoder import GgmlDecoderStack
from sluice_engine.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 4,
           "List three colors:", "Explain photosynthesis in one sentence, then explain why leaves are green."]


@pytest.fixture(scope="module")
def bundled_gguf(model_dir):
    from sluice_engine.model_fetch import gguf_source

    return gguf_source(None)  # the Q4_1 file the fp32 model was converted from (fetched once if need be)


def _run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    return [(o.token_ids, [lp[0] for lp in o.logprobs]) for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("isa", CPU_ISAS)
def test_the_stack_equals_the_layer_loop_bit_for_bit(bundled_gguf, monkeypatch, isa):
    monkeypatch.setenv("SLUICE_CPU_ISA", isa)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the kernels' parallel paths too (threads take whole rows, groups or heads)
    try:
        _compare()
    finally:
        torch.set_num_threads(threads)


def _compare() -> None:
    llm = LLM(device="cpu", quantization="q4_1", kv_cache_memory=64 << 20, enable_prefix_caching=False,
              max_num_batched_tokens=80)  # the long prompt in chunks, beside the others' decodes
    model = llm.engine.runner.model
    assert isinstance(model.fused_layers, GgmlDecoderStack)
    fused = _run(llm)
    stack, model.fused_layers = model.fused_layers, None
    loop = _run(llm)
    model.fused_layers = stack
    assert fused == loop  # token ids and log-probabilities, exactly
    assert len({tuple(ids) for ids, _ in fused}) == len(PROMPTS)  # five different continuations: real work


def test_fast_numerics_reach_every_layer_and_the_stack(bundled_gguf):
    """--numerics fast: every block-format layer rounds per block, the one-call stack too (the same floats as the
    layer loop), and the outputs are not the exact order's."""
    from sluice_engine.cpu_kernels.quant import GgufBlockLinear

    exact = _run(LLM(device="cpu", quantization="q4_1", kv_cache_memory=64 << 20, enable_prefix_caching=False))
    llm = LLM(device="cpu", quantization="q4_1", kv_cache_memory=64 << 20, enable_prefix_caching=False,
              numerics="fast", max_num_batched_tokens=80)
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, GgufBlockLinear)]
    assert layers and all(m.round_per_block for m in layers)
    fused = _run(llm)
    stack, model.fused_layers = model.fused_layers, None
    loop = _run(llm)
    model.fused_layers = stack
    assert fused == loop
    assert [lps for _, lps in fused] != [lps for _, lps in exact]


def test_where_the_stack_does_not_apply_the_loop_runs(bundled_gguf, monkeypatch):
    monkeypatch.setenv("SLUICE_CPU_FUSED_DECODER", "off")
    llm = LLM(device="cpu", quantization="q4_1", kv_cache_memory=64 << 20)
    assert llm.engine.runner.model.fused_layers is None
    monkeypatch.delenv("SLUICE_CPU_FUSED_DECODER")
    lora = LLM(device="cpu", quantization="q4_1", kv_cache_memory=64 << 20, enable_lora=True, max_lora_rank=8)
    assert lora.engine.runner.model.fused_layers is None  # its projections are LoRA layers now
    fp32 = LLM(device="cpu", quantization="none", kv_cache_memory=64 << 20)
    assert fp32.engine.runner.model.fused_layers is None  # not a GGUF's blocks
