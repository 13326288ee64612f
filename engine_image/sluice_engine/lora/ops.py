"""The low-rank half of a LoRA layer over a batch that mixes adapters (SGMV-style: segmented gather
matrix-vector): the torch path (CPU, and the reference the Triton kernels are tested against), and the dispatch
to the Triton kernels (triton_ops.py) for CUDA tensors when Triton is installed.

The batch is ragged and request-contiguous, so a step's tokens fall into segments of consecutive tokens on one
adapter slot (`LoRASegments`; slot 0 = no adapter, skipped). The base layer's GEMM runs once for the whole
batch; then, per segment, `shrink` (x @ A[slot].T: in -> rank) and `expand` (h @ B[slot].T: rank -> out, added into
the base output at a column offset, so one shrink serves the q, k and v slices of a fused projection).

Slots hold the resident adapters' weights stacked ([slots, rank, in] and [slots, out, rank]), padded with zeros
to the largest rank (zero rows of A and columns of B change nothing), with the adapter's scaling folded into B.

Two ways over the batch, the same sums: per segment (a GEMM per run of tokens: few long runs, e.g. prompt
chunks), or gathered per token (each token's slot weights gathered, one batched product for the whole step:
many short runs, e.g. decode steps mixing many adapters, where a loop over segments is dominated by launches).
`LoRASegments.token_slots` (set for small steps with several runs) selects the second.

On CUDA with Triton, the runner sets `token_slots` on every step with adapter tokens, and both functions run
the kernels, which read it alone (one launch each, whatever the runs; no host sync, so a CUDA graph can hold
them). Without it, or on other devices, the torch path runs as above.

On CPU with the C++ kernels built (fp32), the runner sets `LoRASegments.by_slot` and every LoRA layer makes one
call into cpu_kernels/lora.cpp for the whole step (lora/cpu_ops.py). Without them, the runner takes a third way (`LoRASegments.groups`, `grouped_shrink`/`grouped_expand`): the step's tokens
gathered by slot, whatever their order in the batch ([S slots, L tokens], short groups padded), so each
projection is one batched product over S slot weights instead of a product per run (round-robin adapters make a
run of every decode token) or a gather of the weights per token (tokens x rank x width of memory traffic: on
2 cores 32 decode tokens over 4 adapters ran at 0.40x the base model's speed; grouped, see BENCHMARKS.md).
Groups of very different lengths (a prompt chunk beside decodes) go in separate buckets, so padding stays under
half of a bucket.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass(slots=True)
class LoRASegments:
    """Runs of consecutive tokens on one adapter slot, those on slot 0 (no adapter) left out."""

    starts: list[int]
    ends: list[int]
    slots: list[int]
    # Every token's slot (0 for the base) on the device: set when the step is gathered per token (torch), and on
    # every step where the Triton kernels run (kernels_run_on).
    token_slots: torch.Tensor | None = None
    # The tokens gathered by slot, in buckets (the CPU's torch way: grouped_shrink/grouped_expand); None: the above.
    groups: list[LoRAGroup] | None = None
    # The adapter tokens' rows sorted by slot and their slots (int64 on CPU): set where the C++ kernel runs
    # (lora/cpu_ops.py: an fp32 model on CPU with the kernels built), which takes precedence over the above.
    by_slot: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_requests(cls, num_tokens: list[int], slots: list[int]) -> LoRASegments:
        """Per request in batch order, its token count and adapter slot; neighbours on one slot make one run."""
        starts: list[int] = []
        ends: list[int] = []
        out_slots: list[int] = []
        at = 0
        for n, slot in zip(num_tokens, slots, strict=True):
            if slot and out_slots and out_slots[-1] == slot and ends[-1] == at:
                ends[-1] = at + n
            elif slot and n:
                starts.append(at)
                ends.append(at + n)
                out_slots.append(slot)
            at += n
        return cls(starts, ends, out_slots)

    def __bool__(self) -> bool:
        return bool(self.slots)


@dataclass(slots=True)
class LoRAGroup:
    """A bucket of slot groups: the rows of S slots' tokens gathered as [S, L] (rows [S * L], a short group padded
    with row 0, whose products `pad` zeroes), and the S slots."""

    rows: torch.Tensor  # [S * L] int64
    slots: torch.Tensor  # [S] int64
    pad: torch.Tensor | None  # [S, L, 1] bool, True on padding; None when no group is short
    num_slots: int
    length: int


def rows_per_slot(num_tokens: list[int], slots: list[int]) -> dict[int, list[int]]:
    """The step's adapter tokens (rows of the batch) by slot, the base's left out. Per request in batch order, its
    token count and slot (0 = the base)."""
    rows: dict[int, list[int]] = {}
    at = 0
    for n, slot in zip(num_tokens, slots, strict=True):
        if slot:
            rows.setdefault(slot, []).extend(range(at, at + n))
        at += n
    return rows


def group_tokens(num_tokens: list[int], slots: list[int]) -> list[tuple[list[int], list[list[int]]]]:
    """The step's adapter tokens by slot, in buckets: (slots, their token rows) per bucket, longest groups first,
    a bucket growing while its padding stays at most half its rows. Per request in batch order, its token count
    and slot (0 = the base: left out)."""
    ordered = sorted(rows_per_slot(num_tokens, slots).items(), key=lambda kv: -len(kv[1]))
    buckets: list[tuple[list[int], list[list[int]]]] = []
    for slot, toks in ordered:
        if buckets:
            b_slots, b_rows = buckets[-1]
            longest = len(b_rows[0])
            if longest * (len(b_rows) + 1) <= 2 * (sum(map(len, b_rows)) + len(toks)):
                b_slots.append(slot)
                b_rows.append(toks)
                continue
        buckets.append(([slot], [toks]))
    return buckets


def grouped_shrink(x: torch.Tensor, a: torch.Tensor, g: LoRAGroup) -> torch.Tensor:
    """h [S, L, rank]: each group's tokens through its slot's A (padding rows zero)."""
    xs = x.index_select(0, g.rows).view(g.num_slots, g.length, x.shape[1])
    h = torch.bmm(xs, a.index_select(0, g.slots).transpose(1, 2))
    if g.pad is not None:
        h.masked_fill_(g.pad, 0)
    return h


def grouped_expand(h: torch.Tensor, b: torch.Tensor, g: LoRAGroup, y: torch.Tensor, offset: int = 0) -> None:
    """y[t, offset:offset + out] += B[slot] @ h for every group's tokens, in place (padding adds zeros to row 0)."""
    out = b.shape[1]
    delta = torch.bmm(h, b.index_select(0, g.slots).transpose(1, 2))
    y[:, offset : offset + out].index_add_(0, g.rows, delta.view(-1, out))


@functools.cache
def _kernels(device_type: str) -> ModuleType | None:
    """The Triton kernels for tensors of this device type, or None (the torch path). Imported on first use, so
    CPU-only engines never import triton."""
    if device_type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from . import triton_ops

    return triton_ops


def kernels_run_on(device: torch.device) -> bool:
    """Whether shrink and expand run the Triton kernels on `device`: they need `token_slots` on every step."""
    return _kernels(device.type) is not None


def lora_shrink(x: torch.Tensor, a: torch.Tensor, segs: LoRASegments) -> torch.Tensor:
    """h[t] = A[slot(t)] @ x[t] for the tokens of every segment (rows outside them are zero).
    x [T, in], a [slots, rank, in] -> [T, rank] in x's dtype, accumulated in float32."""
    if segs.token_slots is not None and (kernels := _kernels(x.device.type)) is not None:
        return kernels.lora_shrink(x, a, segs.token_slots)
    if segs.token_slots is not None:
        return torch.einsum("tri,ti->tr", a.index_select(0, segs.token_slots), x)
    h = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    for s, e, slot in zip(segs.starts, segs.ends, segs.slots, strict=True):
        h[s:e] = (x[s:e].float() @ a[slot].float().T).to(x.dtype)
    return h


def lora_expand(h: torch.Tensor, b: torch.Tensor, segs: LoRASegments, y: torch.Tensor, offset: int = 0) -> None:
    """y[t, offset:offset + out] += B[slot(t)] @ h[t] for the tokens of every segment, in place.
    h [T, rank], b [slots, out, rank], y [T, >= offset + out]."""
    if segs.token_slots is not None and (kernels := _kernels(h.device.type)) is not None:
        kernels.lora_expand_(h, b, segs.token_slots, y, offset)
        return
    out = b.shape[1]
    if segs.token_slots is not None:  # the base's tokens gather slot 0, all zeros
        y[:, offset : offset + out] += torch.einsum("tor,tr->to", b.index_select(0, segs.token_slots), h)
        return
    for s, e, slot in zip(segs.starts, segs.ends, segs.slots, strict=True):
        delta = h[s:e].float() @ b[slot].float().T
        y[s:e, offset : offset + out] += delta.to(y.dtype)
