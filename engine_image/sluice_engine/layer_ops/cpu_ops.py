"""`LayerOps` for the C++ CPU path: each op one call into cpu_kernels/layer_ops.cpp (fp32).

At decode the torch reference spends more on dispatch than on arithmetic (RMSNorm plus the residual add
is two ops, the rotary six, SiLU-and-multiply three; ~1.6 ms of a 16 ms batch-1 step of the bundled
model). Anything the kernels do not cover (16-bit activations, a layout they do not take) goes to the
torch reference, which these ops match to float rounding (tests/engine/test_cpu_layer_ops.py).
"""

from __future__ import annotations

import torch

from .torch_ops import TorchLayerOps

_F32 = torch.float32


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, n] with unit stride along n (a view), or None where it is not one."""
    if x.dtype != _F32 or x.device.type != "cpu" or x.stride(-1) != 1:
        return None
    if x.dim() == 2:
        return x
    return x.view(-1, x.shape[-1]) if x.is_contiguous() else None


class CpuLayerOps(TorchLayerOps):
    name = "cpu"

    def __init__(self, lib):
        self._norm = lib.sluice_rms_norm_f32
        self._add_norm = lib.sluice_add_rms_norm_f32
        self._rotary = lib.sluice_rotary_f32
        self._silu_mul = lib.sluice_silu_mul_f32

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = _rows(x)
        if rows is None or weight.dtype != _F32 or not weight.is_contiguous():
            return super().rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=_F32)
        m, n = rows.shape
        self._norm(rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), n, m, n, eps,
                   torch.get_num_threads())
        return out

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if (x.dim() != 2 or x.shape != residual.shape or _rows(x) is None or _rows(residual) is None
                or weight.dtype != _F32 or not weight.is_contiguous()):
            return super().fused_add_rms_norm(x, residual, weight, eps)
        m, n = x.shape
        out, total = torch.empty(m, n, dtype=_F32), torch.empty(m, n, dtype=_F32)
        self._add_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
                       out.data_ptr(), n, total.data_ptr(), n, m, n, eps, torch.get_num_threads())
        return out, total

    def rotary(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = cos_sin
        t, h, d = x.shape
        if (x.dtype != _F32 or x.stride(2) != 1 or d % 2 or cos.dtype != _F32 or sin.dtype != _F32
                or cos.shape != (t, 1, d // 2) or not (cos.is_contiguous() and sin.is_contiguous())):
            return super().rotary(x, cos_sin)
        if t:
            self._rotary(x.data_ptr(), x.stride(0), x.stride(1), t, h, d, cos.data_ptr(), sin.data_ptr(), d // 2,
                         torch.get_num_threads())
        return x

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or _rows(gate_up) is None or gate_up.shape[1] % 2:
            return super().silu_and_mul(gate_up)
        m, n2 = gate_up.shape
        out = torch.empty(m, n2 // 2, dtype=_F32)
        if m:
            self._silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), n2 // 2, m, n2 // 2,
                           torch.get_num_threads())
        return out
