"""The C++ fp32 GEMM behind the CPU path's linear layers (cpu_kernels/gemm.cpp, cpu_kernels/linear.py)
against F.linear, and the model's linear layers packed for it."""

import pytest
import torch
import torch.nn.functional as F
from cpu_isas import CPU_ISAS, isa_lib
from torch import nn

from sluice_engine.cpu_kernels.linear import (
    PackedEmbedding,
    PackedLinear,
    pack_linears,
    pack_weight,
    reference_linear,
)


@pytest.fixture(scope="module", params=CPU_ISAS)
def lib(request):
    lib = isa_lib(request.param)
    if not lib.sluice_gemm_available():
        pytest.skip(f"{request.param}: no GEMM kernel (x86-64 without AVX2): the engine keeps F.linear")
    return lib


# Rows: 1..8 (one register tile), 9..16, a ragged 37, and past one 128-row chunk; columns: whole panels,
# a ragged last panel (<16 and >16 columns in it), fewer than one panel.
@pytest.mark.parametrize("m", [1, 3, 8, 13, 37, 130, 300])
@pytest.mark.parametrize("k,n", [(64, 96), (576, 960), (40, 7), (33, 50), (128, 1000)])
def test_gemm_matches_f_linear(lib, m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g)
    layer = PackedLinear(w, None, lib)
    torch.testing.assert_close(layer(x), F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_bias_strided_rows_leading_dims_and_empty(lib):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(70, 48, generator=g), torch.randn(70, generator=g)
    layer = PackedLinear(w, b, lib)
    wide = torch.randn(2, 5, 80, generator=g)
    x = wide[..., 16:64]  # rows strided by 80, unit stride within a row: read in place
    torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    cols = torch.randn(48, 6, generator=g).t()  # unit stride across rows: copied first
    torch.testing.assert_close(layer(cols), F.linear(cols, w, b), atol=1e-4, rtol=1e-5)
    assert layer(torch.empty(0, 48)).shape == (0, 70)
    torch.testing.assert_close(reference_linear(x, layer), F.linear(x, w, b))


def test_pack_weight_layout():
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)  # 40 outputs: a panel and 8 columns
    p = pack_weight(w, 32)
    assert p.shape == (2, 3, 32)
    assert torch.equal(p[0, :, 5], w[5]) and torch.equal(p[1, :, 7], w[39])
    assert p[1, :, 8:].abs().sum() == 0  # zero padding
    assert pack_weight(w, 16).shape == (3, 3, 16)


@pytest.mark.skipif("avx2" not in CPU_ISAS, reason="this CPU has no AVX2")
def test_avx2_build_has_16_wide_panels():
    """The vector-extension path that AVX2 (and AArch64) machines run: 16-wide panels (AVX-512: 32)."""
    lib = isa_lib("avx2")
    assert lib.sluice_gemm_available() and lib.sluice_gemm_panel_width() == 16


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 24, bias=True)
        self.inner = nn.Sequential(nn.Linear(24, 16, bias=False))
        self.lm_head = None


def test_pack_linears_replaces_every_linear_and_unties_the_head(lib):
    model = _Tied()
    x = torch.randn(3, 16)
    ids = torch.tensor([0, 7, 31, 32, 49])  # both sides of a panel edge, and the last row
    table = model.embed_tokens.weight.detach().clone()
    want = model.inner(model.proj(x))
    assert pack_linears(model) == 3
    assert isinstance(model.proj, PackedLinear) and isinstance(model.inner[0], PackedLinear)
    torch.testing.assert_close(model.inner(model.proj(x)), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.lm_head(x), F.linear(x, table), atol=1e-5, rtol=1e-5)
    # The table is held once: the embedding reads the output layer's packed weight.
    assert isinstance(model.embed_tokens, PackedEmbedding)
    assert torch.equal(model.embed_tokens(ids), table[ids])
    assert model.embed_tokens.head is model.lm_head
    params = list(model.parameters())  # a shared tensor is listed once
    assert len(params) == 4  # packed table, proj's packed weight and bias, inner's packed weight
    assert any(p is model.lm_head.packed for p in params)
