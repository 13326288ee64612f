"""Linear layers whose weights stay in a GGUF block format (Q8_0, Q4_0, Q4_1) on CPU, multiplied by
cpu_kernels/quant_gemm.cpp, and the per-layer choice between them and the fp32 PackedLinear.

A layer is built from a uint8 tensor [N, K / 32 * block bytes]: row n is output n's K weights as GGUF
blocks, byte for byte as a GGUF file stores them (so a GGUF's tensors load without dequantizing), and
holds them repacked once into the kernel's interleaved layout (quant_gemm.cpp explains it). The kernel
quantizes activations to 8 bits per block of 32 (as llama.cpp does) and takes integer dot products.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..quant.formats import CPU_FORMATS

log = logging.getLogger("sluice.engine")

BLOCK = 32  # weights per block in all three formats
GROUP = 16  # output rows per group of the kernel's packed layout
# The kernel's format codes (quant_gemm.cpp `Format`) and each format's bytes per block.
FORMAT_CODE = {"q8_0": 0, "q4_0": 1, "q4_1": 2}
ROUND_PER_BLOCK = 16  # a GEMM format code | this: one float rounding per block (--numerics fast; quant_gemm.cpp)
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


def dequantize_rows(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """[..., K/32 * bytes] uint8 -> [..., K] fp32, in torch, from GGUF-layout blocks (the loader's checks;
    layers dequantize from their packed layout in C++: GgufBlockLinear.rows)."""
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


class GgufBlockLinear(nn.Module):
    """y = x W^T (+ b), W given as GGUF blocks of format `fmt` ([N, K/32 * block bytes], byte for byte as
    a GGUF file stores them) and held repacked for the kernel (quant_gemm.cpp's layout: 16 output rows
    interleaved per group, fp16 scales apart; as many bytes as the blocks, plus a ragged last group's
    padding). `packed` is the layer's only weight tensor; the blocks are not kept."""

    def __init__(self, blocks: torch.Tensor, fmt: str, in_features: int, bias: torch.Tensor | None, lib):
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"{fmt}: input width {in_features} is not a multiple of {BLOCK}")
        row_bytes = in_features // BLOCK * BLOCK_BYTES[fmt]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes:
            raise ValueError(f"{fmt} weight of {in_features} inputs must be uint8 [N, {row_bytes}], "
                             f"got {blocks.dtype} {tuple(blocks.shape)}")
        self.fmt, self.in_features, self.out_features = fmt, in_features, blocks.shape[0]
        self._code = FORMAT_CODE[fmt]
        self.round_per_block = False  # --numerics fast (set_numerics): the GEMM's float order, not the weights
        self._lib = lib
        n, k = self.out_features, in_features
        groups = -(-n // GROUP)
        packed = torch.empty(groups, lib.sluice_quant_packed_bytes(self._code, n, k) // max(groups, 1),
                             dtype=torch.uint8)
        blocks = blocks.contiguous()
        lib.sluice_quant_repack(self._code, blocks.data_ptr(), n, k, packed.data_ptr())
        self.packed = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
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
            self._gemm(self.gemm_code, rows.data_ptr(), rows.stride(0), self.packed.data_ptr(), m, self.in_features,
                       self.out_features, y.data_ptr(), self.out_features, torch.get_num_threads())
        if self.bias is not None:
            y += self.bias
        return y.view(*lead, self.out_features)

    @property
    def gemm_code(self) -> int:
        """The kernel's code for this layer's GEMM: the format's, with the float order's bit."""
        return self._code | (ROUND_PER_BLOCK if self.round_per_block else 0)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) of W as fp32, [*ids.shape, K], dequantized from the packed layout
        exactly as the GGUF format defines them."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            raise IndexError(f"row ids must be in [0, {self.out_features})")
        out = torch.empty(flat.numel(), self.in_features)
        if flat.numel():
            self._lib.sluice_quant_unpack_rows(self._code, self.packed.data_ptr(), self.out_features,
                                               self.in_features, flat.data_ptr(), flat.numel(), out.data_ptr(),
                                               self.in_features)
        return out.view(*ids.shape, self.in_features)

    def dequantized_weight(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}"


class QuantEmbedding(nn.Module):
    """The input embedding of a tied model whose output layer is a GgufBlockLinear: each id's row is
    dequantized from the output layer's packed weights, so the table is held once, quantized."""

    def __init__(self, head: GgufBlockLinear):
        super().__init__()
        self.head = head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.rows(ids)


def set_numerics(model: nn.Module, numerics: str) -> int:
    """Every block-format layer of `model` multiplies in `numerics`' float order (exact | fast); returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, GgufBlockLinear):
            m.round_per_block = numerics == "fast"
            n += 1
    return n


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
        return GgufBlockLinear(blocks, self.fmt, weight.shape[1], bias, lib)
