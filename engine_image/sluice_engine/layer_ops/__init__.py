"""The decoder's elementwise and normalization ops, behind one seam: chosen once per model.

A Llama layer's work outside the GEMMs and attention is RMSNorm, residual adds, the rotary embedding and
SiLU-and-multiply. In plain torch each is several kernels (an fp16/bf16 RMSNorm alone is ~8: upcast,
square, mean, add, rsqrt, multiply, downcast, weight), which at decode sizes cost launches, not math.
`LayerOps` names them as four calls so one implementation can do each in one kernel:

- `torch_ops.TorchLayerOps`: the reference (its arithmetic is the model's definition).
- `cpu_ops.CpuLayerOps`: one C++ call per op (`cpu_kernels/layer_ops.cpp`, fp32) beside the `cpu` attention
  backend (the engine's C++ CPU path).
- `triton_ops.TritonLayerOps`: one Triton kernel per op (`triton_kernels.py`); the model uses it with the
  Triton attention backend, i.e. on CUDA (or in Triton's interpreter, for tests).
- `ggml_ops.GgmlLayerOps`: the C++ ops with llama.cpp's CPU arithmetic, bit for bit (for greedy parity with
  llama-server on GGUF models). Its `rotary` is exact given ggml's cos/sin rows: the model builds its
  rotary table with `GgmlLayerOps.rotary_embedding` in place of `RotaryEmbedding`.

The residual stream is carried beside each layer's output rather than added in place of it (as vLLM's
`fused_add_rms_norm`): a norm that follows a residual add takes both and returns the normed output and
the new stream, so the add is done in the norm's kernel.
"""

from __future__ import annotations

from typing import Protocol

import torch


class LayerOps(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of x ([T, N] or [T, H, N]), times weight [N]."""

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + x, then RMSNorm of that sum ([T, N] each). Returns (normed, the sum: the new residual)."""

    def rotary(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, H, D] (query and/or key heads) rotated by each token's angles (cos/sin: [T, 1, D/2] fp32,
        `RotaryEmbedding`'s rows). x is consumed: an implementation may rotate it in place and return it."""

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] (a merged gate/up projection: gate columns first) -> silu(gate) * up, [T, I]."""

    def rotary_embedding(self, head_dim: int, max_positions: int, theta: float, scaling: dict) -> torch.nn.Module:
        """The model's table of rotary angles for these ops' `rotary` (`models.rotary.RotaryEmbedding`, except
        where the ops reproduce another implementation's angles too)."""


def select_layer_ops(attention_backend: str) -> LayerOps:
    """The Triton kernels beside the Triton attention backend (which has already checked that Triton can
    run here); the C++ ops beside the C++ `cpu` backend (whose library has loaded), and their llama.cpp-exact
    twins beside the `ggml` one (attention/ggml_cpu.py); the torch reference with every other backend."""
    if attention_backend == "triton":
        from .triton_ops import TritonLayerOps

        return TritonLayerOps()
    if attention_backend in ("cpu", "ggml"):
        from .. import cpu_kernels

        lib = cpu_kernels.load()
        if lib is not None:
            if attention_backend == "ggml":  # a GGUF in its blocks: llama.cpp's arithmetic throughout
                from .ggml_ops import GgmlLayerOps

                return GgmlLayerOps(lib)
            from .cpu_ops import CpuLayerOps

            return CpuLayerOps(lib)
    from .torch_ops import TorchLayerOps

    return TorchLayerOps()
