"""CUDA graphs of pure-decode steps: one graph per (batch size, split count), batch sizes from
`capture_sizes`, replayed when every request of a step computes exactly one token.

A decode step of a small model is a few hundred short kernels; launched one by one from Python the GPU
idles between them. A graph replays the whole forward with one launch. It replays the kernels with the
addresses they were captured with, so everything the forward reads lives in persistent buffers
(worker/input_buffers.py) rewritten in place before each replay, and attention writes into preallocated
outputs with the split count of its graph (forward_context.AttentionWorkspace).

A batch of n requests replays the smallest captured size >= n; the rows past n are padding: token 0 at
position 0 with a one-token context, whose K/V go to the scratch block no request owns and whose
block-table row holds only that block, so padding never touches a real request's KV. The logits are
computed outside the graph, from the real rows only.

Split counts follow the live batch. A graph bakes in its attention's split-KV count, and the right count
depends on the contexts (kernel_buckets.choose_num_splits): one count fixed for the longest context a model
allows (32 for 128k) made a batch of 1k contexts run half its programs empty and pay partials and a merge
for nothing. So each size is captured at every split count the chooser can return for the batches that
replay it (kernel_buckets.decode_split_choices: 1 up to what one max_model_len context among one-token
ones gets), and a step replays the graph whose count is the one the backend chooses for its real rows'
contexts (padding not counted): the choice an eager step of the same batch makes, so a graph's launch is
always a member of kernel_buckets.attention_launches. Were a chosen count not captured (a coarser plan),
the nearest captured count above it replays (more splits only cost partials; fewer would serialize a long
context), else the largest.

The trade-off is the number of graphs: sizes x split counts, at most 35 x 6 = 210 with the default
--cuda-graph-max-batch 256 and a long-context model on a large GPU (fewer where the window or the SMs
bound the splits). Each costs a warm-up forward and a capture at start-up (tens of ms for an 8B) and its
own graph state (worker/memory_profile.py budgets 4 MiB each); their activations share one pool. Capturing all
of them keeps graph and eager steps identical; --cuda-graph-max-batch lowers the count.

Graphs are captured only on CUDA with the Triton attention backend (the torch and C++ paths plan each
step on the host: not capturable), one rank (collectives inside a capture are not verified yet), and
without --enforce-eager. Capture goes largest size first (and, per size, largest split first), every
graph in one memory pool, so the smaller graphs reuse the largest one's activation memory. What happened
(on, off and why, failed and why) is kept as a GraphState for the metrics (sluice_cuda_graphs_*).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from ..core.sched_output import SchedulerOutput
from ..forward_context import AttentionWorkspace
from .input_buffers import InputBuffers
from .model_input import ModelInput

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


# (batch size, split count): one captured graph.
GraphKey = tuple[int, int]


def decode_workspaces(plan: dict[int, list[int]], num_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device) -> dict[GraphKey, AttentionWorkspace]:
    """Attention outputs for every graph of `plan` (batch size -> split counts), carved from one allocation
    per kind: graphs replay one at a time, so they share it. Each (size, split count) gets contiguous
    [n, Hq, S, D] partials; the allocation holds the largest n x S."""
    out = torch.empty((max(plan), num_heads, head_dim), dtype=dtype, device=device)
    rows = max(n * max(splits) for n, splits in plan.items())
    mid_o = torch.empty(rows * num_heads * head_dim, dtype=torch.float32, device=device)
    mid_lse = torch.empty(rows * num_heads, dtype=torch.float32, device=device)
    return {
        (n, s): AttentionWorkspace(
            s, out[:n], mid_o[: n * num_heads * s * head_dim].view(n, num_heads, s, head_dim),
            mid_lse[: n * num_heads * s].view(n, num_heads, s),
        )
        for n, splits in plan.items() for s in splits
    }


def nearest_split(captured: Sequence[int], chosen: int) -> int:
    """The captured split count a step replays: the chosen one, else the nearest above it, else the largest."""
    return min((s for s in captured if s >= chosen), default=max(captured))


@dataclass(frozen=True, slots=True)
class GraphState:
    """What a runner's decode graphs came to, for the metrics: `on` (captured), `off` (never tried: reason
    is graphs_off_reason's) or `failed` (the capture raised: reason is its error; steps run eagerly)."""

    state: Literal["on", "off", "failed"]
    reason: str = ""
    captured: int = 0  # graphs held (0 unless on)


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
    """The captured decode graphs of one model runner, by (batch size, split count)."""

    def __init__(self, plan: dict[int, list[int]], inputs: InputBuffers,
                 forward: Callable[[ModelInput], torch.Tensor], workspaces: dict[GraphKey, AttentionWorkspace],
                 api: GraphApi, choose_splits: Callable[[list[int]], int]):
        """plan: batch size -> the split counts captured for it. forward: the model's forward over a ModelInput
        inside its forward context (hidden states out). choose_splits: the attention backend's split count
        for a decode batch of these context lengths (what an eager step of it would launch)."""
        self.sizes = sorted(plan)
        self.plan = {n: sorted(set(plan[n])) for n in self.sizes}
        assert all(self.plan.values()) and set(workspaces) >= set(self.keys)
        self.inputs = inputs
        self.forward = forward
        self.workspaces = workspaces
        self.api = api
        self.choose_splits = choose_splits
        self._graphs: dict[GraphKey, tuple[Callable[[], None], torch.Tensor]] = {}

    @property
    def keys(self) -> list[GraphKey]:
        return [(n, s) for n in self.sizes for s in self.plan[n]]

    def capture(self) -> None:
        start = time.monotonic()
        self.inputs.freeze()  # graphs hold the buffers' addresses from now on
        with torch.inference_mode():
            for n, s in sorted(self.keys, reverse=True):  # largest first: the pool grows once
                inp = self.inputs.capture_input(n)
                inp.attn.workspace = self.workspaces[(n, s)]
                self.api.warm_up(lambda inp=inp: self.forward(inp))
                self._graphs[(n, s)] = self.api.capture(lambda inp=inp: self.forward(inp))
        self.api.synchronize()
        log.info("CUDA graphs: captured %d decode graphs (%s) in %.1f s", len(self._graphs), describe_plan(self.plan),
                 time.monotonic() - start)

    @property
    def captured(self) -> list[GraphKey]:
        return sorted(self._graphs)

    def key(self, sched: SchedulerOutput) -> GraphKey | None:
        """The graph this step replays, or None (eager): the size that holds its batch, at the split count the
        backend chooses for its requests' contexts. Prepare the inputs padded to the size, then `replay`."""
        n = graph_batch_size(sched, self.sizes)
        if n is None:
            return None
        chosen = self.choose_splits([s.start + s.num_tokens for s in sched.scheduled])
        return n, nearest_split(self.plan[n], chosen)

    def replay(self, key: GraphKey) -> torch.Tensor:
        """Run the graph over what the inputs hold now: its hidden states [n, hidden], in the graph's own
        output tensor (overwritten by its next replay)."""
        replay, out = self._graphs[key]
        replay()
        return out


def describe_plan(plan: dict[int, list[int]]) -> str:
    """'35 batch sizes 1..256 x split counts [1, 2, 4]' (per-size split sets named when they differ)."""
    sizes = sorted(plan)
    span = f"{len(sizes)} batch sizes {sizes[0]}..{sizes[-1]}" if len(sizes) > 1 else f"batch size {sizes[0]}"
    sets = {tuple(sorted(plan[n])) for n in sizes}
    if len(sets) == 1:
        return f"{span} x split counts {list(next(iter(sets)))}"
    return f"{span}, split counts per size " + ", ".join(f"{n}: {sorted(plan[n])}" for n in sizes)
