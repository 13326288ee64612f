"""The C++ CPU layer ops (cpu_kernels/layer_ops.cpp via layer_ops/cpu_ops.py) against the torch reference
(layer_ops/torch_ops.py): RMSNorm, residual add + RMSNorm, rotary in place, SiLU-and-multiply, over the
shapes the decoder gives them (decode's few rows on one thread, prefill's many in parallel, the strided
Q/K view of a fused QKV output), and the bundled model through the engine with them. Then the ggml-exact
ops (layer_ops/ggml_ops.py): the same checks against the torch reference, determinism, and their rope table's
iterated angles (their bit-exactness against llama.cpp itself is benchmarks/ggml_check/layer_ops_check.cpp,
which needs llama.cpp built)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cpu_isas import CPU_ISAS, isa_lib

from sluice_engine.layer_ops import select_layer_ops
from sluice_engine.layer_ops.cpu_ops import CpuLayerOps
from sluice_engine.layer_ops.ggml_ops import GgmlLayerOps, ggml_freq_scale
from sluice_engine.layer_ops.rotary import RotaryEmbedding
from sluice_engine.layer_ops.torch_ops import TorchLayerOps

ROWS = [1, 3, 15, 16, 17, 70]  # around the kernels' parallel threshold (16)


@pytest.fixture(scope="module", params=CPU_ISAS)
def ops(request):
    return CpuLayerOps(isa_lib(request.param))


REF = TorchLayerOps()
# Tolerances: the same fp32 arithmetic summed in another order (the norm's sum of squares over <= 576
# terms, vectorized), and for SiLU an exp within 2e-7 relative of libm's; observed errors are ~1e-7.
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
def test_norms(ops, rows):
    g = torch.Generator().manual_seed(rows)
    x, res = torch.randn(rows, 576, generator=g) * 3, torch.randn(rows, 576, generator=g)
    w = torch.rand(576, generator=g) + 0.5
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5), **TOL)
    got, got_sum = ops.fused_add_rms_norm(x, res, w, 1e-5)
    want, want_sum = REF.fused_add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(got_sum, want_sum)  # one add per element: exact
    # [T, H, D] heads (Qwen3's q/k norms) and a row-strided view (a slice of a wider tensor).
    heads = torch.randn(rows, 4, 64, generator=g)
    torch.testing.assert_close(ops.rms_norm(heads, w[:64], 1e-6), REF.rms_norm(heads, w[:64], 1e-6), **TOL)
    wide = torch.randn(rows, 700, generator=g)
    torch.testing.assert_close(ops.rms_norm(wide[:, 100:676], w, 1e-5), REF.rms_norm(wide[:, 100:676], w, 1e-5),
                               **TOL)


@pytest.mark.parametrize("rows", ROWS)
def test_rotary_in_place_on_the_fused_qkv_view(ops, rows):
    q_heads, kv_heads, d = 9, 3, 64
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * d, generator=g)
    before = qkv.clone()
    positions = torch.randint(0, 4000, (rows,), generator=g)
    cos_sin = RotaryEmbedding(d, 4096, 100000.0, {})(positions)
    view = qkv[:, : (q_heads + kv_heads) * d].view(rows, -1, d)
    want = REF.rotary(view.clone(), cos_sin)
    got = ops.rotary(view, cos_sin)
    assert got.data_ptr() == qkv.data_ptr()  # in place, in the fused output
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * d :], before[:, (q_heads + kv_heads) * d :])  # V untouched


@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul(ops, rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, generator=g) * 4
    gate_up[0, :6] = torch.tensor([0.0, -100.0, 100.0, -87.5, 88.5, 1e-30])  # exp's clamps and tiny values
    torch.testing.assert_close(ops.silu_and_mul(gate_up), REF.silu_and_mul(gate_up), **TOL)


def test_other_dtypes_and_empty_batches_take_the_reference(ops):
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5))
    assert ops.silu_and_mul(torch.empty(0, 32)).shape == (0, 16)
    empty = torch.empty(0, 2, 8)
    assert ops.rotary(empty, (torch.empty(0, 1, 4), torch.empty(0, 1, 4))).shape == (0, 2, 8)


def test_the_cpu_backend_selects_them():
    assert select_layer_ops("cpu").name == "cpu"
    assert select_layer_ops("torch").name == "torch"


# -- the ggml-exact ops ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=CPU_ISAS)
def ggml_ops(request):
    return GgmlLayerOps(isa_lib(request.param))


def test_ggml_levels_agree():
    """The ggml-exact ops on each level this CPU runs: the same bits but for SwiGLU on avx2 (llama.cpp's AVX2
    expf, within float rounding of AVX-512's)."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(17, 576, generator=g), torch.randn(576, generator=g)
    gate_up = torch.randn(17, 2 * 1547, generator=g) * 4
    runs = {}
    for isa in CPU_ISAS:
        ops = GgmlLayerOps(isa_lib(isa))
        runs[isa] = ops.rms_norm(x, w, 1e-5), ops.silu_and_mul(gate_up)
    for isa, (norm, act) in runs.items():
        assert torch.equal(norm, runs["portable"][0]), isa
        if isa == "avx2":
            torch.testing.assert_close(act, runs["portable"][1], atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(act, runs["portable"][1]), isa


@pytest.mark.parametrize("rows", ROWS)
def test_ggml_norms(ggml_ops, rows):
    g = torch.Generator().manual_seed(rows)
    x, res = torch.randn(rows, 576, generator=g) * 3, torch.randn(rows, 576, generator=g)
    w = torch.rand(576, generator=g) + 0.5
    torch.testing.assert_close(ggml_ops.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5), **TOL)
    got, got_sum = ggml_ops.fused_add_rms_norm(x, res, w, 1e-5)
    want, want_sum = REF.fused_add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(got_sum, want_sum)
    heads = torch.randn(rows, 4, 64, generator=g)
    torch.testing.assert_close(ggml_ops.rms_norm(heads, w[:64], 1e-6), REF.rms_norm(heads, w[:64], 1e-6), **TOL)


@pytest.mark.parametrize("rows", ROWS)
def test_ggml_rotary_in_place_on_the_fused_qkv_view(ggml_ops, rows):
    q_heads, kv_heads, d = 9, 3, 64
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * d, generator=g)
    before = qkv.clone()
    positions = torch.randint(0, 4000, (rows,), generator=g)
    cos_sin = ggml_ops.rotary_embedding(d, 4096, 100000.0, {})(positions)
    view = qkv[:, : (q_heads + kv_heads) * d].view(rows, -1, d)
    want = REF.rotary(view.clone(), cos_sin)  # the same angles, rotated by torch
    got = ggml_ops.rotary(view, cos_sin)
    assert got.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * d :], before[:, (q_heads + kv_heads) * d :])
    # Against torch's own table: the angles round differently (by up to ~1e-3 rad at position 4000).
    torch.testing.assert_close(got, REF.rotary(before[:, : (q_heads + kv_heads) * d].view(rows, -1, d),
                                               RotaryEmbedding(d, 4096, 100000.0, {})(positions)),
                               atol=1e-2, rtol=0)


def _ggml_angles(positions: np.ndarray, head_dim: int, base: float) -> np.ndarray:
    """ggml_rope_cache_init's angles, emulated in float32: theta starts at the position and is multiplied by
    powf(base, -2/head_dim) after each pair."""
    theta_scale = np.float32(np.power(np.float64(np.float32(base)), np.float64(np.float32(-2.0 / head_dim))))
    theta = positions.astype(np.float32)
    angles = np.empty((len(positions), head_dim // 2), dtype=np.float32)
    for i in range(head_dim // 2):
        angles[:, i] = theta
        theta = theta * theta_scale  # float32 * float32: one rounding, as ggml's
    return angles


@pytest.mark.parametrize("base", [100000.0, 10000.0])
def test_ggml_rope_table_iterates_theta(ggml_ops, base):
    d, positions = 64, np.array([0, 1, 2, 3, 7, 100, 1000, 2047, 4000, 4095])
    rope = ggml_ops.rotary_embedding(d, 4096, base, {})
    cos, sin = (t.squeeze(1).double().numpy() for t in rope(torch.from_numpy(positions)))
    angles = _ggml_angles(positions, d, base).astype(np.float64)
    # cos/sin of exactly the emulated float32 angles (sincosf: within an ulp of the true values)
    np.testing.assert_allclose(cos, np.cos(angles), rtol=0, atol=1.2e-7)
    np.testing.assert_allclose(sin, np.sin(angles), rtol=0, atol=1.2e-7)
    # ... which are not torch's position * inv_freq: far from 0 they differ by much more than an ulp.
    torch_cos = RotaryEmbedding(d, 4096, base, {})(torch.from_numpy(positions))[0].squeeze(1).double().numpy()
    assert np.abs(cos[-3:] - torch_cos[-3:]).max() > 1e-5
    assert np.array_equal(cos[0], np.ones(d // 2)) and np.array_equal(sin[0], np.zeros(d // 2))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [1536, 1547])  # 1547: an 11-float tail per row (libm's expf)
def test_ggml_silu_and_mul(ggml_ops, rows, inter):
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 4
    gate_up[0, :8] = torch.tensor([0.0, -100.0, 100.0, -87.5, 88.5, 1e-30, -200.0, 200.0])
    gate_up[0, inter - 3 : inter] = torch.tensor([-100.0, 100.0, 1e-30])
    torch.testing.assert_close(ggml_ops.silu_and_mul(gate_up), REF.silu_and_mul(gate_up), **TOL)


def test_ggml_ops_are_deterministic(ggml_ops):
    """The same input gives the same bits, run twice and whatever rows share its batch (a prefill's many
    rows run on several threads; a decode row alone runs on one)."""
    g = torch.Generator().manual_seed(7)
    x, res = torch.randn(40, 576, generator=g) * 3, torch.randn(40, 576, generator=g)
    w = torch.rand(576, generator=g) + 0.5
    qk = torch.randn(40, 12, 64, generator=g)
    gate_up = torch.randn(40, 2 * 1536, generator=g) * 4
    rope = ggml_ops.rotary_embedding(64, 4096, 100000.0, {})
    cos_sin = rope(torch.randint(0, 4096, (40,), generator=g))

    def run(rows: slice):
        cs = (cos_sin[0][rows].contiguous(), cos_sin[1][rows].contiguous())
        return (ggml_ops.rms_norm(x[rows], w, 1e-5), *ggml_ops.fused_add_rms_norm(x[rows], res[rows], w, 1e-5),
                ggml_ops.rotary(qk[rows].clone(), cs), ggml_ops.silu_and_mul(gate_up[rows]))

    first, second, alone = run(slice(None)), run(slice(None)), run(slice(17, 18))
    for a, b, c in zip(first, second, alone, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a[17:18], c)


def test_ggml_rope_scaling(ggml_ops):
    positions = torch.arange(0, 4096, 12)
    linear = ggml_ops.rotary_embedding(64, 4096, 10000.0, {"rope_type": "linear", "factor": 4.0})(positions)
    plain = ggml_ops.rotary_embedding(64, 4096, 10000.0, {})(positions // 4)
    # freq_scale 1/4: a quarter of each angle, exactly the angles of position p / 4 (scaling by a power of two
    # commutes with rounding)
    assert torch.equal(linear[0], plain[0]) and torch.equal(linear[1], plain[1])
    with pytest.raises(ValueError):
        ggml_freq_scale({"rope_type": "yarn", "factor": 4.0})
    # a scaling ggml's table is not reproduced for (a Llama 3.x GGUF): torch's table, the model still served
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    table = ggml_ops.rotary_embedding(64, 4096, 500000.0, llama3)
    assert isinstance(table, RotaryEmbedding)
    want = RotaryEmbedding(64, 4096, 500000.0, llama3)(positions)
    assert torch.equal(table(positions)[0], want[0])


@pytest.mark.slow
def test_engine_greedy_tokens_match_the_torch_path(model_dir):
    """SmolLM2-135M, fp32, through the engine: the `cpu` backend (C++ attention, C++ layer ops) against the
    `torch` backend (torch attention and ops); chunked prefill mixes prompt chunks with decode rows."""
    from sluice_engine.entrypoints.llm import LLM
    from sluice_engine.sampling_params import SamplingParams

    prompts = ["The capital of France is", "def add(a, b):", "One, two, three,"]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    runs = {}
    for backend in ("cpu", "torch"):
        llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=64, block_size=16,
                  max_num_batched_tokens=16, kv_cache_memory=8 << 20, attention_backend=backend)
        assert llm.engine.runner.model.ops.name == backend
        runs[backend] = llm.generate(prompts, params)
    for fast, ref in zip(runs["cpu"], runs["torch"], strict=True):
        assert fast.token_ids == ref.token_ids
        for a, b in zip(fast.logprobs, ref.logprobs, strict=True):
            assert abs(a[0] - b[0]) < 1e-3  # the sampled token's logprob
