"""The draw on CPU: a token per row from its probabilities and one uniform, by the inverse of its cumulative
distribution, instead of the exponential race the GPU runs.

Why: the race needs a vocabulary's worth of Exp(1) noise per row, and torch draws that on CPU on one thread from
its Mersenne Twister, a log per value: ~30-40 ms for 32 rows of 49,152 (AMD EPYC, AVX2), as long as the rest of
a batch-32 decode step of the bundled model. Every request with a temperature above 0 paid it (`vllm bench serve`
sends none, so the server's default of 1 applies; issue 44's profile, docs/BENCHMARKS.md). The inverse CDF needs
one uniform per row and one pass over the probabilities in float64 (cpu_kernels/sampling.cpp): 8-16 ms against
the race's 65-72 ms side by side on the same, loaded machine (docs/BENCHMARKS.md). On CUDA, noise is cheap and the race needs no scan: the GPU keeps it.

The distribution is the same (p over its row's sum; rows need not be normalised: min-p and a rejected draft's
residual are not); the tokens of a seeded request differ from the race's, and are again the same alone or in any
batch (each seeded row draws its uniform from the request's own generator).
"""

from __future__ import annotations

import torch

from .. import cpu_kernels


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of probs [rows, vocab] (float32, >= 0), the first index whose running float64 sum exceeds u x the
    row's sum (u [rows] float64 in [0, 1)); a row with no such index (all zero, NaN) gives its argmax. int64 [rows].
    The kernel where the CPU kernels are built, else torch; the same index either way."""
    rows, vocab = probs.shape
    lib = cpu_kernels.load()
    if lib is None or probs.dtype != torch.float32 or probs.stride(1) != 1:
        return inverse_cdf_torch(probs, u)
    u = u.to(torch.float64).contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    lib.sluice_sample_inverse_cdf_f32(probs.data_ptr(), probs.stride(0), rows, vocab, u.data_ptr(), out.data_ptr(),
                                      torch.get_num_threads())
    return out


def inverse_cdf_torch(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """inverse_cdf in torch ops: the definition the kernel is checked against."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    idx = torch.searchsorted(cdf, (u.to(torch.float64) * cdf[:, -1])[:, None], right=True)[:, 0]
    none = idx >= probs.shape[-1]
    return torch.where(none, probs.argmax(dim=-1), idx.clamp(max=probs.shape[-1] - 1))
