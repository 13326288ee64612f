"""`LayerOps` with llama.cpp's CPU arithmetic, bit for bit: the `sluice_ggml_*` calls in cpu_kernels/layer_ops.cpp.

Acceptance for GGUF serving on CPU is greedy parity with llama-server on the same file. Both engines quantize
activations to 8 bits before each quantized GEMM, so a one-ulp difference in a norm, the rotary or the
activation can round a different int8 and end in a different token; these ops remove that source. They
reproduce ggml's CPU backend as built for llama-cpp-python 0.3.36's vendored llama.cpp (-O3 -march=native,
GCC 12, an AVX-512 CPU; on the avx2 kernel level, its AVX2+FMA+F16C build), checked float for float against
ggml itself by benchmarks/ggml_check/layer_ops_check.cpp (run_checks.py, per level):

- RMSNorm (`ggml_rms_norm` then the weight's `ggml_mul`): squares in float summed in double in order, the mean
  rounded to float, `x * (1 / sqrtf(mean + eps)) * w`. The residual add is one float add.
- Rotary (`ggml_rope_ext`, rope type NORM, no YaRN): ggml's cos/sin cache, where each position's angle is the
  position times `powf(base, -2 / head_dim)` once per pair, iterated in float; glibc's sincosf; the rotation
  with GCC's FMAs. GGUF's Q/K rows are permuted for NORM rope's adjacent pairs and our model un-permutes them
  to the rotate-half layout, which pairs the same two values: the arithmetic is per pair, so it is done here
  in our layout. The cos/sin rows must be ggml's, from `rotary_embedding` (the model's `RotaryEmbedding` table
  is torch's: `position * inv_freq`, a different rounding).
- SiLU-and-multiply (`ggml_swiglu_split`): ggml's AVX-512 exp polynomial (`ggml_v_expf`) for each 16-float
  block of a row (avx2 level: its AVX2 form, 8-float blocks), libm's expf for the row's remainder.

Inputs the kernels do not take (16-bit activations, layouts they do not cover) go to the torch reference, as
in `CpuLayerOps`: right to float rounding, not bit for bit.
"""

from __future__ import annotations

import logging

import torch

from .cpu_ops import CpuLayerOps

log = logging.getLogger("sluice.engine")


def ggml_freq_scale(scaling: dict) -> float:
    """llama.cpp's rope freq_scale for an HF rope_scaling dict: 1 without scaling, 1/factor (in float) for
    linear. Other kinds (llama3's frequency factors, YaRN, ...) are not reproduced."""
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind in (None, "default"):
        return 1.0
    if kind == "linear":
        one = torch.tensor(1.0, dtype=torch.float32)
        return (one / torch.tensor(scaling["factor"], dtype=torch.float32)).item()
    raise ValueError(f"rope scaling {kind!r} is not reproduced by the ggml layer ops")


class GgmlRotaryEmbedding(torch.nn.Module):
    """`models.rotary.RotaryEmbedding` with ggml's cos/sin table (built once, in C++, for positions
    0..max_positions-1): the same call, positions [T] -> (cos, sin) rows [T, 1, D/2]."""

    def __init__(self, rope_cache, head_dim: int, max_positions: int, theta: float, scaling: dict):
        super().__init__()
        half = head_dim // 2
        cos = torch.empty(max_positions, half, dtype=torch.float32)
        sin = torch.empty(max_positions, half, dtype=torch.float32)
        positions = torch.arange(max_positions, dtype=torch.int64)
        rope_cache(positions.data_ptr(), max_positions, head_dim, theta, ggml_freq_scale(scaling), cos.data_ptr(),
                   sin.data_ptr())
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class GgmlLayerOps(CpuLayerOps):
    """The decoder's norms, residual adds, rotary and SiLU-and-multiply reproducing llama.cpp's CPU arithmetic
    bit for bit (llama-cpp-python 0.3.36's vendored llama.cpp; see the module docstring). fp32 on CPU. The
    rotary is exact with the cos/sin rows of `rotary_embedding(...)`."""

    name = "ggml"

    def __init__(self, lib):
        super().__init__(lib)
        self._norm = lib.sluice_ggml_rms_norm_f32
        self._add_norm = lib.sluice_ggml_add_rms_norm_f32
        self._rotary = lib.sluice_ggml_rotary_f32
        self._silu_mul = lib.sluice_ggml_swiglu_f32
        self._rope_cache = lib.sluice_ggml_rope_cache_f32

    def rotary_embedding(self, head_dim: int, max_positions: int, theta: float,
                         scaling: dict) -> torch.nn.Module:
        """The model's rotary table with these ops: `RotaryEmbedding`'s arguments, ggml's cos/sin. A scaling
        these ops do not reproduce (llama3's frequency factors, YaRN) gets torch's table: the model is served
        right, only not bit for bit as llama.cpp."""
        try:
            ggml_freq_scale(scaling)
        except ValueError as e:
            log.warning("%s: this model's rotary angles are torch's (right to float rounding, not llama.cpp's "
                        "bit for bit)", e)
            return super().rotary_embedding(head_dim, max_positions, theta, scaling)
        return GgmlRotaryEmbedding(self._rope_cache, head_dim, max_positions, theta, scaling)
