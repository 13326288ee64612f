"""Issue 15, acceptance 1: the Triton layer kernels (sluice_engine.layer_ops.triton_kernels) against the torch
reference (`TorchLayerOps`, the model's own arithmetic), and the model built with them.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is set before triton is
first imported, as in test_triton_attention.py). bf16 arithmetic is wrong there, so the kernels are checked in
fp32 and fp16 (bf16 joins on CUDA) on the same inputs as the reference in the same dtype, to a fraction of the
largest |reference output| (TOL). Shapes: SmolLM2-135M's (hidden 576, 9 query / 3 KV heads of 64, MLP 1536),
Llama-3-8B's (hidden 4096, 32 / 8 heads of 128, MLP 14336) at few tokens, and odd sizes that are not a
power of two.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from triton_interpreter import import_kernels  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# Max error as a fraction of the largest |reference output|. The kernels compute in fp32 and round where the
# reference rounds (the normalised x before the weight multiply, silu before the multiply by up), so in 16 bits
# the two differ only where their fp32 values (a few fp32 ulps apart: GPU exp and rsqrt are approximate, sums
# run in another order) fall on either side of a rounding boundary: one ulp of that dtype. bf16 has an 8-bit
# mantissa: a rounding errs by at most 2^-8 of the value, so one ulp is at most 2^-7 of it (fp16, 11 bits: 2^-10);
# a flip in the first rounding can carry into the second: 2 ulps, 2^-6 (bf16) and 2^-9 (fp16). An absolute
# bound fails on large outputs: SiLU-and-mul reaches ~60, where one bf16 ulp is 0.25. fp32: a few fp32 ulps
# (2^-23 each; observed 1.3e-7 on CPU).
TOL = {torch.float32: 1e-6, torch.float16: 2**-9, torch.bfloat16: 2**-6}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])

tk = import_kernels("sluice_engine.layer_ops.triton_kernels")
from sluice_engine.layer_ops import select_layer_ops  # noqa: E402
from sluice_engine.layer_ops.rotary import RotaryEmbedding  # noqa: E402
from sluice_engine.layer_ops.torch_ops import TorchLayerOps  # noqa: E402
from sluice_engine.layer_ops.triton_ops import TritonLayerOps  # noqa: E402

REF = TorchLayerOps()


pytestmark = pytest.mark.usefixtures("one_thread")


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype == dtype, (got.shape, want.shape, got.dtype)
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= TOL[dtype] * scale, f"max abs error {err:.3g} > {TOL[dtype]:.3g} x {scale:.3g} ({dtype})"


# -- RMSNorm and the fused residual add --------------------------------------------------------------
# (tokens, hidden): decode, a few rows of SmolLM2, Llama-8B, and hidden sizes not a power of two or odd.
NORM_SHAPES = [(1, 576), (7, 576), (3, 4096), (5, 100), (2, 1023)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("t", "n"), NORM_SHAPES)
def test_rms_norm(t, n, dtype):
    x = _randn(t, n, dtype=dtype, scale=3.0)
    w = 1 + _randn(n, dtype=dtype, seed=1, scale=0.2)
    _close(tk.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("t", "n"), NORM_SHAPES)
def test_fused_add_rms_norm_returns_the_norm_and_the_new_residual(t, n, dtype):
    x = _randn(t, n, dtype=dtype, scale=2.0)
    residual = _randn(t, n, dtype=dtype, seed=2, scale=4.0)
    w = 1 + _randn(n, dtype=dtype, seed=1, scale=0.2)
    x_before, res_before = x.clone(), residual.clone()
    out, new_res = tk.fused_add_rms_norm(x, residual, w, 1e-6)
    want_out, want_res = REF.fused_add_rms_norm(x, residual, w, 1e-6)
    _close(out, want_out, dtype)
    _close(new_res, want_res, dtype)
    assert torch.equal(new_res, want_res)  # the sum is rounded once to the dtype, as the reference's is
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_of_strided_head_views(dtype):
    """Qwen3's q/k norm: per-head RMSNorm of the query columns of a fused QKV output ([T, H, D], strided)."""
    t, hq, hkv, d = 4, 9, 3, 64
    qkv = _randn(t, (hq + 2 * hkv) * d, dtype=dtype, scale=2.0)
    q = qkv[:, : hq * d].view(t, hq, d)
    w = 1 + _randn(d, dtype=dtype, seed=1, scale=0.2)
    got = tk.rms_norm(q, w, 1e-6)
    assert got.is_contiguous()
    _close(got, REF.rms_norm(q, w, 1e-6), dtype)


# -- rotary ------------------------------------------------------------------------------------------
SCALINGS = {
    "default": (100000.0, {}),  # SmolLM2's theta
    "linear": (10000.0, {"rope_type": "linear", "factor": 4.0}),
    "llama3": (500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [(1, 9, 3, 64), (6, 9, 3, 64), (2, 32, 8, 128), (3, 5, 1, 80)],
                         ids=["smollm2-decode", "smollm2", "llama8b", "odd-head-dim"])
def test_rotary_rotates_q_and_k_of_the_fused_qkv_in_place(t, hq, hkv, d, scaling, dtype):
    theta, rope_scaling = SCALINGS[scaling]
    rope = RotaryEmbedding(d, 20000, theta, rope_scaling).to(DEVICE)
    positions = torch.randint(0, 20000, (t,), generator=torch.Generator().manual_seed(t)).to(DEVICE)
    cos_sin = rope(positions)
    qkv = _randn(t, (hq + 2 * hkv) * d, dtype=dtype, scale=2.0)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    want = REF.rotary(qk.clone(), cos_sin)
    got = tk.rotary_(qk, *cos_sin)
    assert got.data_ptr() == qkv.data_ptr()  # in place: q and k stay views of the fused output
    _close(got, want, dtype)
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)  # V's columns untouched


# -- SiLU and multiply -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("t", "inter"), [(1, 1536), (5, 1536), (2, 14336), (3, 100), (1, 1025)])
def test_silu_and_mul(t, inter, dtype):
    gate_up = _randn(t, 2 * inter, dtype=dtype, scale=3.0)
    _close(tk.silu_and_mul(gate_up), REF.silu_and_mul(gate_up), dtype)


def test_empty_batches():
    x = torch.empty(0, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    assert tk.rms_norm(x, w, 1e-6).shape == (0, 64)
    assert [o.shape for o in tk.fused_add_rms_norm(x, x, w, 1e-6)] == [(0, 64), (0, 64)]
    assert tk.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)
    cos = torch.empty(0, 1, 32, device=DEVICE)
    assert tk.rotary_(torch.empty(0, 4, 64, device=DEVICE), cos, cos).shape == (0, 4, 64)


def test_ops_follow_the_attention_backend():
    assert select_layer_ops("triton").name == "triton"
    assert select_layer_ops("torch").name == "torch"
    from sluice_engine import cpu_kernels

    # the C++ ops beside the C++ backend (test_cpu_layer_ops.py), where they build (SLUICE_CPU_KERNELS=off: the GPU
    # check builds none, and then the torch ops stand in)
    assert select_layer_ops("cpu").name == ("cpu" if cpu_kernels.load() is not None else "torch")


def test_triton_ops_off_cuda_without_the_interpreter_name_the_variable(monkeypatch):
    if CUDA:
        pytest.skip("CUDA runs the compiled kernels")
    monkeypatch.setattr(tk, "INTERPRETER_READY", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        TritonLayerOps()
