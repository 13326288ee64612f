"""The C++ GEMM over GGUF block-quantized weights (cpu_kernels/quant_gemm.cpp, cpu_kernels/quant.py)
against dequantize-then-F.linear, with the gguf package's quantize/dequantize as the reference of
each format; both the build for this CPU and the portable (plain loops) build."""

import ctypes
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, dequantize, quantize

from sluice_engine import cpu_kernels
from sluice_engine.cpu_kernels.quant import QuantLinear, dequantize_rows, quantize_weight

FORMATS = ["q8_0", "q4_0", "q4_1"]


@pytest.fixture(scope="module")
def lib():
    lib = cpu_kernels.load()
    if lib is None:
        pytest.fail("the CPU kernels did not build (is g++ installed?); see the log")
    return lib


@pytest.fixture(scope="module")
def portable_lib(tmp_path_factory):
    """The same sources without -march=native: the plain-loop paths every other CPU runs."""
    compiler = cpu_kernels._compiler()
    if compiler is None:
        pytest.fail("no C++ compiler")
    out = tmp_path_factory.mktemp("portable") / "kernels.so"
    subprocess.run([compiler, *cpu_kernels.PORTABLE_FLAGS, *map(str, cpu_kernels.SOURCES), "-o", str(out)],
                   check=True, capture_output=True)
    return cpu_kernels._bind(ctypes.CDLL(str(out)))


def reference(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """gguf's own dequantize of the blocks: the format's reference."""
    qtype = GGMLQuantizationType[fmt.upper()]
    return torch.from_numpy(np.ascontiguousarray(dequantize(blocks.numpy(), qtype)))


def check(layer: QuantLinear, x: torch.Tensor, w: torch.Tensor) -> None:
    # Tolerance: the kernel and F.linear add the same K products in different orders, so they differ by
    # float rounding, which grows with the sum of |products|: 1e-5 of it per output (K <= 1536 terms at
    # 2^-24 each is <= 1e-4 in the worst case; observed below 2e-6).
    y = layer(x)
    ref = F.linear(x, w)
    bound = 1e-5 * (x.abs() @ w.abs().t()) + 1e-6
    assert y.shape == ref.shape
    assert ((y - ref).abs() <= bound).all(), f"max error {(y - ref).abs().max().item()}"


def test_dequantize_rows_matches_gguf():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(7, 96, generator=g) * 0.1 + 0.02
    for fmt in FORMATS:
        blocks = quantize_weight(w, fmt)
        assert torch.equal(dequantize_rows(blocks, fmt), reference(blocks, fmt))


# Rows: 1 and 3 (the decode path), 17 and 64 (the prefill path); K: one block and the model's widths
# (576 hidden, 1536 intermediate); N: ragged against the 2-row pairs, the 16-row ranges and 32-wide panels.
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("k,n", [(32, 5), (576, 193), (1536, 577), (96, 33)])
def test_quant_gemm_matches_dequantized_f_linear(lib, fmt, m, k, n):
    g = torch.Generator().manual_seed(m * 7919 + k + n)
    blocks = torch.from_numpy(quantize(torch.randn(n, k, generator=g).numpy(), GGMLQuantizationType[fmt.upper()]))
    layer = QuantLinear(blocks, fmt, k, None, lib)
    check(layer, torch.randn(m, k, generator=g), reference(blocks, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 17])
def test_portable_build_matches(portable_lib, fmt, m):
    g = torch.Generator().manual_seed(m)
    blocks = quantize_weight(torch.randn(45, 576, generator=g), fmt)
    check(QuantLinear(blocks, fmt, 576, None, portable_lib), torch.randn(m, 576, generator=g), reference(blocks, fmt))


def test_bias_strided_rows_leading_dims_empty(lib):
    g = torch.Generator().manual_seed(2)
    blocks = quantize_weight(torch.randn(70, 64, generator=g), "q4_1")
    bias = torch.randn(70, generator=g)
    layer = QuantLinear(blocks, "q4_1", 64, bias, lib)
    w = reference(blocks, "q4_1")
    wide = torch.randn(2, 5, 80, generator=g)
    x = wide[..., 8:72]  # rows 80 apart, read in place
    torch.testing.assert_close(layer(x), F.linear(x, w, bias), atol=1e-4, rtol=1e-5)
    assert layer(torch.empty(0, 64)).shape == (0, 70)


def test_shapes_refused(lib):
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantLinear(torch.zeros(4, 20, dtype=torch.uint8), "q4_1", 40, None, lib)
    with pytest.raises(ValueError, match=r"uint8 \[N, 40\]"):
        QuantLinear(torch.zeros(4, 36, dtype=torch.uint8), "q4_1", 64, None, lib)


# -- the bundled model: its GGUF blocks loaded as they are, served end to end --------------------------
@pytest.fixture(scope="module")
def bundled_gguf(model_dir):
    from sluice_engine.model_fetch import gguf_source

    return gguf_source(None)  # the Q4_1 file the fp32 model was converted from (fetched once if need be)


def test_gguf_blocks_are_the_converted_weights(model_dir, bundled_gguf):
    """Blocks read from the GGUF, rows un-permuted, dequantize to exactly the fp32 weights transformers
    converted from the same file: the loader's names, row order and layout are right."""
    from safetensors import safe_open

    from sluice_engine.models.quant_loader import GGUFBlocks

    gguf = GGUFBlocks(bundled_gguf)
    cases = [("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 9),
             ("blk.29.attn_k.weight", "model.layers.29.self_attn.k_proj.weight", 3),
             ("blk.7.attn_v.weight", "model.layers.7.self_attn.v_proj.weight", None),
             ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", None),
             ("blk.12.ffn_up.weight", "model.layers.12.mlp.up_proj.weight", None),
             ("token_embd.weight", "model.embed_tokens.weight", None)]
    with safe_open(str(model_dir / "model.safetensors"), "pt") as st:
        for name, hf_name, heads in cases:
            fmt = gguf.format(name)
            assert fmt == ("q8_0" if name == "token_embd.weight" else "q4_1")
            w = dequantize_rows(torch.from_numpy(np.array(gguf.rows(name, heads))), fmt)
            assert torch.equal(w, st.get_tensor(hf_name)), name


def test_quantization_flag_refusals():
    from sluice_engine.config import EngineConfig

    with pytest.raises(ValueError, match="awq weights need CUDA kernels; on CPU"):
        EngineConfig(device="cpu", quantization="awq")
    with pytest.raises(ValueError, match="q4_1 kernels run on CPU only"):
        EngineConfig(device="cuda", quantization="q4_1")
    with pytest.raises(ValueError, match="--quantization must be one of"):
        EngineConfig(quantization="int3")


PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "Explain photosynthesis in one sentence.", "List three colors:"]


def test_bundled_model_served_q4_1_matches_fp32(model_dir, bundled_gguf):
    """LLM with --quantization q4_1 (the GGUF's Q4_1 layers and Q8_0 tied output layer, never
    dequantized) against the default fp32 model (the same weights, dequantized at conversion): same
    weights, different summation order, so greedy tokens should agree but for near-ties."""
    from sluice_engine.cpu_kernels.quant import QuantEmbedding
    from sluice_engine.llm import LLM
    from sluice_engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0)
    fp32 = LLM(device="cpu", kv_cache_memory=64 << 20)
    expected = fp32.generate(PROMPTS, params)
    del fp32
    q = LLM(device="cpu", kv_cache_memory=64 << 20, quantization="q4_1")
    model = q.engine.runner.model
    assert model.layers[0].mlp.down_proj.fmt == "q4_1" and model.lm_head.fmt == "q8_0"
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in model.parameters())  # no fp32 matrix left
    got = q.generate(PROMPTS, params)
    same = [a.token_ids == b.token_ids for a, b in zip(expected, got, strict=True)]
    print(f"greedy agreement q4_1 vs fp32: {sum(same)}/{len(same)} prompts")
    assert sum(same) >= len(same) - 1
    # Where the sequences agree, each token's log-probability agrees to float rounding.
    for a, b, s in zip(expected, got, same, strict=True):
        if s:
            lp_a = torch.tensor([lp[0] for lp in a.logprobs])
            lp_b = torch.tensor([lp[0] for lp in b.logprobs])
            torch.testing.assert_close(lp_b, lp_a, atol=1e-3, rtol=0)
