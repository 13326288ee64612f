"""CUDA graphs of pure-decode steps: one graph per batch size in `capture_sizes`, replayed when every
request of a step computes exactly one token.

A decode step of a small model is a few hundred short kernels; launched one by one from Python the GPU
idles between them. A graph replays the whole forward with one launch. It replays the kernels with the
addresses they were captured with, so everything the forward reads lives in persistent buffers
(input_buffers.py) rewritten in place before each replay, and attention writes into preallocated
outputs with a split count fixed per graph (forward_context.AttentionWorkspace).

A batch of n requests replays the smallest captured size >= n; the rows past n are padding: token 0 at
position 0 with a one-token context, whose K/V go to the scratch block no request owns and whose
block-table row holds only that block, so padding never touches a real request's KV. The logits are
computed outside the graph, from the real rows only.

Graphs are captured only on CUDA with the Triton attention backend (the torch and C++ paths plan each
step on the host: not capturable), one rank (collectives inside a capture are not verified yet), and
without --enforce-eager. Capture goes largest size first, every graph in one memory pool, so the
smaller graphs reuse the largest one's activation memory.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from .forward_context import AttentionWorkspace
from .input_buffers import InputBuffers
from .model_input import ModelInput
from .sched_output import SchedulerOutput

log = logging.getLogger("sluice.engine")

# NOTE: the kernel-bucket list of the warm-up work is to replace this one when both land (one list).
SMALL_SIZES = (1, 2, 4)
SIZE_STEP = 8


def capture_sizes(max_batch: int) -> list[int]:
    """Decode batch sizes a graph is captured for: 1, 2, 4, then every multiple of 8, and max_batch
    itself, up to max_batch. A batch pads to the next size, so padding wastes at most 7 rows."""
    if max_batch < 1:
        raise ValueError(f"the largest CUDA graph batch must be >= 1, got {max_batch}")
    sizes = [n for n in SMALL_SIZES if n <= max_batch] + list(range(SIZE_STEP, max_batch + 1, SIZE_STEP))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs rows; None when none does (run eagerly)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def graph_batch_size(sched: SchedulerOutput, sizes: list[int]) -> int | None:
    """The captured size this step replays, or None: a step replays only when every scheduled request
    computes exactly one token (decode, or a one-token prompt chunk: the same shapes), no drafts."""
    if not sched.scheduled or any(s.num_tokens != 1 for s in sched.scheduled):
        return None
    return bucket_for(len(sched.scheduled), sizes)


def graphs_off_reason(enforce_eager: bool, device: torch.device, backend: str, world_size: int) -> str | None:
    """Why this runner steps eagerly, or None when decode steps replay graphs."""
    if enforce_eager:
        return "--enforce-eager"
    if device.type != "cuda":
        return f"graphs need CUDA (device is {device.type})"
    if backend != "triton":
        return f"attention backend {backend} plans each step on the host; only triton's is capturable"
    if world_size > 1:
        return "not yet captured with tensor or pipeline parallelism (collectives inside a graph are unverified)"
    return None


def decode_workspaces(sizes: list[int], splits_for: Callable[[int], int], num_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> dict[int, AttentionWorkspace]:
    """Attention outputs for every captured size, carved from one allocation per kind: graphs replay one
    at a time, so they share it. Each size gets contiguous [n, Hq, S, D] partials for its split count."""
    splits = {n: splits_for(n) for n in sizes}
    out = torch.empty((max(sizes), num_heads, head_dim), dtype=dtype, device=device)
    mid_o = torch.empty(max(n * splits[n] for n in sizes) * num_heads * head_dim, dtype=torch.float32,
                        device=device)
    mid_lse = torch.empty(max(n * splits[n] for n in sizes) * num_heads, dtype=torch.float32, device=device)
    return {
        n: AttentionWorkspace(
            splits[n], out[:n], mid_o[: n * num_heads * splits[n] * head_dim].view(n, num_heads, splits[n], head_dim),
            mid_lse[: n * num_heads * splits[n]].view(n, num_heads, splits[n]),
        )
        for n in sizes
    }


class GraphApi(Protocol):
    """What capture needs from torch.cuda (a seam: tests stand in for it on CPU)."""

    def warm_up(self, fn: Callable[[], object]) -> None: ...

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]: ...

    def synchronize(self) -> None: ...


class TorchCudaGraphs:
    """torch.cuda's graphs: one side stream and one memory pool for every capture."""

    def __init__(self, device: torch.device):
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def warm_up(self, fn: Callable[[], object]) -> None:
        # On the capture stream, as torch's docs do: lazy initialisation (Triton compiles, cuBLAS
        # workspaces) happens here and not inside the capture, where it would be illegal.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()
        torch.cuda.current_stream().wait_stream(self.stream)

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        return graph.replay, out

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class DecodeGraphs:
    """The captured decode graphs of one model runner, by batch size."""

    def __init__(self, sizes: list[int], inputs: InputBuffers, forward: Callable[[ModelInput], torch.Tensor],
                 workspaces: dict[int, AttentionWorkspace], api: GraphApi):
        """forward: the model's forward over a ModelInput inside its forward context (hidden states out)."""
        assert sizes == sorted(sizes) and set(workspaces) >= set(sizes)
        self.sizes = sizes
        self.inputs = inputs
        self.forward = forward
        self.workspaces = workspaces
        self.api = api
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}

    def capture(self) -> None:
        start = time.monotonic()
        self.inputs.freeze()  # graphs hold the buffers' addresses from now on
        with torch.inference_mode():
            for n in sorted(self.sizes, reverse=True):  # largest first: the pool grows once
                inp = self.inputs.capture_input(n)
                inp.attn.workspace = self.workspaces[n]
                self.api.warm_up(lambda inp=inp: self.forward(inp))
                self._graphs[n] = self.api.capture(lambda inp=inp: self.forward(inp))
        self.api.synchronize()
        log.info("CUDA graphs: captured decode batch sizes %s in %.1f s", self.sizes, time.monotonic() - start)

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def batch_size(self, sched: SchedulerOutput) -> int | None:
        """The size this step replays, or None (eager). Prepare the inputs padded to it, then `replay`."""
        return graph_batch_size(sched, self.sizes)

    def replay(self, n: int) -> torch.Tensor:
        """Run the size-n graph over what the inputs hold now: its hidden states [n, hidden], in the graph's
        own output tensor (overwritten by its next replay)."""
        replay, out = self._graphs[n]
        replay()
        return out
