"""The sampler's draw on CPU (sample/cpu_draw.py, cpu_kernels/sampling.cpp; issue 44): the kernel on every level this
CPU runs gives the index of the torch definition (the float64 cumulative sum's searchsorted) on rows of every
shape the sampler makes (unnormalised, zeros from top-k/top-p/min-p, strided, a vocabulary off the kernel's
stride), the rows with no answer give their argmax, and the draws have the distribution of p."""

from __future__ import annotations

import ctypes

import pytest
import torch
from cpu_isas import CPU_ISAS, isa_lib

from sluice_engine.sample.cpu_draw import inverse_cdf, inverse_cdf_torch


def kernel_draw(isa: str, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.int64)
    u = u.to(torch.float64).contiguous()
    isa_lib(isa).sluice_sample_inverse_cdf_f32(probs.data_ptr(), probs.stride(0), rows, vocab, u.data_ptr(),
                                               out.data_ptr(), ctypes.c_int(2))
    return out


def sampler_rows(g: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Rows as the sampler hands them over: softmax of sharp and flat logits, some truncated to zeros, some
    scaled (min-p and a rejected draft's residual leave rows unnormalised), inside a wider buffer (a stride)."""
    wide = torch.zeros(rows, vocab + 5)
    p = wide[:, 2 : 2 + vocab]
    p.copy_((torch.randn(rows, vocab, generator=g) * torch.rand(rows, 1, generator=g) * 6).softmax(-1))
    p[0, : vocab // 2] = 0  # the mass all in the second half
    if rows > 2:
        p[1][p[1] < p[1].median()] = 0  # a truncated row
        p[2] *= 0.37  # unnormalised
    return p


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 5), (4, 256), (5, 257), (32, 49152), (7, 1000)])
def test_the_kernel_draws_the_index_torch_defines(isa, rows, vocab):
    g = torch.Generator().manual_seed(rows * 1000 + vocab)
    p = sampler_rows(g, rows, vocab)
    for _ in range(20):
        u = torch.rand(rows, dtype=torch.float64, generator=g)
        assert torch.equal(kernel_draw(isa, p, u), inverse_cdf_torch(p, u))
    # The edges of [0, 1): the first token with mass, and the last.
    for edge in (0.0, 1.0 - 2.0**-53):
        u = torch.full((rows,), edge, dtype=torch.float64)
        want = inverse_cdf_torch(p, u)
        assert torch.equal(kernel_draw(isa, p, u), want)
        nonzero = [(row > 0).nonzero()[:, 0] for row in p]
        assert want.tolist() == [int(nz[0] if edge == 0 else nz[-1]) for nz in nonzero]


@pytest.mark.parametrize("isa", CPU_ISAS)
def test_rows_without_an_answer_give_their_argmax(isa):
    p = torch.rand(3, 300, generator=torch.Generator().manual_seed(1))
    p[0] = 0  # nothing to draw
    p[1, 7] = float("nan")  # a NaN poisons the sum
    u = torch.full((3,), 0.5, dtype=torch.float64)
    want = inverse_cdf_torch(p, u)
    assert want[:2].tolist() == [0, 7]
    assert torch.equal(kernel_draw(isa, p, u), want)


def test_the_draws_follow_p():
    p = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(60_000, -1).contiguous() * 3  # unnormalised rows
    u = torch.rand(60_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    share = torch.bincount(inverse_cdf(p, u), minlength=4).double() / 60_000
    # Binomial standard deviations here are at most 0.002: 5 of them.
    assert torch.allclose(share, torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64), atol=0.01), share
    assert share[1] == 0  # a token of probability 0 is never drawn
