"""Linear layers whose weights stay in a GGUF block format (Q8_0, Q4_0, Q4_1) on CPU, multiplied by
cpu_kernels/quant_gemm.cpp, and the per-layer choice between them and the fp32 PackedLinear.

The weight of a layer is a uint8 tensor [N, K / 32 * block bytes]: row n is output n's K weights as
GGUF blocks, byte for byte as a GGUF file stores them (so a GGUF's tensors load without dequantizing).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..quantization import CPU_FORMATS

log = logging.getLogger("sluice.engine")

BLOCK = 32  # weights per block in all three formats
# The kernel's format codes (quant_gemm.cpp `Format`) and each format's bytes per block.
FORMAT_CODE = {"q8_0": 0, "q4_0": 1, "q4_1": 2}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


def dequantize_rows(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """[..., K/32 * bytes] uint8 -> [..., K] fp32, in torch: the embedding's few rows per step."""
    lead = blocks.shape[:-1]
    b = blocks.reshape(-1, BLOCK_BYTES[fmt])
    d = b[:, :2].contiguous().view(torch.float16).float()
    if fmt == "q8_0":
        w = b[:, 2:].contiguous().view(torch.int8).float() * d
    else:
        q = b[:, -16:]
        q = torch.cat([q & 0x0F, q >> 4], dim=1).float()  # byte j: weight j (low nibble), j + 16 (high)
        if fmt == "q4_0":
            w = (q - 8) * d
        else:
            w = q * d + b[:, 2:4].contiguous().view(torch.float16).float()
    return w.reshape(*lead, -1)


def quantize_weight(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 [N, K] -> GGUF blocks [N, K/32 * bytes], with the gguf package's quantizer (the format's
    reference), for layers a checkpoint holds in another type."""
    from gguf import GGMLQuantizationType, quantize

    q = quantize(weight.detach().float().numpy(), GGMLQuantizationType[fmt.upper()])
    return torch.from_numpy(np.ascontiguousarray(q))


class QuantLinear(nn.Module):
    """y = x W^T (+ b), W as GGUF blocks of format `fmt`."""

    def __init__(self, blocks: torch.Tensor, fmt: str, in_features: int, bias: torch.Tensor | None, lib):
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"{fmt}: input width {in_features} is not a multiple of {BLOCK}")
        row_bytes = in_features // BLOCK * BLOCK_BYTES[fmt]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes:
            raise ValueError(f"{fmt} weight of {in_features} inputs must be uint8 [N, {row_bytes}], "
                             f"got {blocks.dtype} {tuple(blocks.shape)}")
        self.fmt, self.in_features, self.out_features = fmt, in_features, blocks.shape[0]
        self.blocks = nn.Parameter(blocks.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self._code = FORMAT_CODE[fmt]
        self._gemm = lib.sluice_quant_gemm_f32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == torch.float32 and x.shape[-1] == self.in_features
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        m = rows.shape[0]
        y = torch.empty(m, self.out_features, dtype=x.dtype)
        if m:
            self._gemm(self._code, rows.data_ptr(), rows.stride(0), self.blocks.data_ptr(), m, self.in_features,
                       self.out_features, y.data_ptr(), self.out_features, torch.get_num_threads())
        if self.bias is not None:
            y += self.bias
        return y.view(*lead, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_rows(self.blocks, self.fmt)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}"


class QuantEmbedding(nn.Module):
    """The input embedding of a tied model whose output layer is a QuantLinear: each id's row is
    dequantized from the output layer's blocks, so the table is held once, quantized."""

    def __init__(self, head: QuantLinear):
        super().__init__()
        self.head = head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.head.blocks[ids], self.head.fmt)


# -- the per-layer quant method (vLLM's quant_method): what a linear layer becomes on load ------------
@dataclass(frozen=True, slots=True)
class LinearMethod:
    """`fmt` None: the fp32 path (PackedLinear, left to pack_linears). Otherwise the layer is held in
    `fmt` blocks: taken byte for byte from the checkpoint when `blocks` come with it in that format,
    else quantized from the fp32 weight at load."""

    fmt: str | None

    def create(self, weight: torch.Tensor, bias: torch.Tensor | None, lib,
               blocks: torch.Tensor | None = None) -> nn.Module | None:
        if self.fmt is None:
            return None
        assert self.fmt in CPU_FORMATS
        if blocks is None:
            blocks = quantize_weight(weight, self.fmt)
        return QuantLinear(blocks, self.fmt, weight.shape[1], bias, lib)
