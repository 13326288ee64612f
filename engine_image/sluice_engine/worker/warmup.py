"""Start-up warm-up: dummy steps through the real executor (every rank, every layer, the real attention backend)
before the server reports ready, so no kernel compiles on the serving path and a shape that cannot run
(out of memory at the full token budget, a missing compiler) fails the start, not the first request.

What runs is kernel_buckets.warmup_batches: `full` covers every prefill chunk bucket, decode batch bucket,
verification bucket and attention launch of the fixed set; `minimal` one step holding a prompt chunk and a
decode row (on CPU that is all there is to warm: the C++ kernels are built when the backend is chosen, and
the step runs every layer and both kinds of rows once). The steps run eagerly, even those a CUDA graph holds
(graphs compiled their own variants at capture): a decode step that does not replay (a batch above
--cuda-graph-max-batch, graphs off after a failed capture) must not compile on the serving path either. The
report's launches are what the Triton backend actually issued (its `issued` set: these steps, the memory
profile's and the graphs' captures), not a prediction. The dummy sequences' block tables point at one free KV block that caches nothing,
borrowed from the pool and given back, so nothing a request owns or the prefix cache holds is read or
written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..attention.kernel_buckets import (
    SPLIT_CHOICES,
    AttentionLaunch,
    WarmupBatch,
    WarmupLimits,
    split_cap,
    split_context,
    warmup_batches,
)
from ..core.kv_cache import BlockPool, KVBlock
from ..core.sched_output import ScheduledRequest, SchedulerOutput
from ..draft_interface import DraftQuery

if TYPE_CHECKING:
    from ..config import EngineConfig, SpeculativeConfig
    from ..draft_interface import DraftProposer
    from .model_runner import ModelRunner

log = logging.getLogger("sluice.engine")

WARMUP_REQUEST_PREFIX = "sluice-warmup-"


@dataclass(frozen=True, slots=True)
class WarmupReport:
    mode: str  # what ran: full | minimal | off
    steps: int
    # Triton attention launches issued so far, i.e. compiled (warm-up steps, graph captures, the memory
    # profile): the backend's record, empty for other backends.
    launches: frozenset[AttentionLaunch]
    draft_queries: int
    seconds: float


def resolve_mode(mode: str, device: torch.device) -> str:
    """auto: full on CUDA (compiled kernels, cheap steps), minimal elsewhere (nothing is compiled per shape,
    and steps are slow)."""
    if mode == "auto":
        return "full" if device.type == "cuda" else "minimal"
    return mode


@dataclass(frozen=True, slots=True)
class WarmupTarget:
    """The parts of an engine that warm-up drives (the engine builds it; warm-up never sees the engine):
    the step path, the KV pool it borrows a block from, and the scheduler's record of freed rows."""
    runner: ModelRunner  # device, attention backend, eager_steps()
    execute: Callable[[SchedulerOutput], object]  # the executor's execute_model: every rank runs the step
    pool: BlockPool
    block_size: int
    take_freed: Callable[[], list[str]]  # the scheduler's freed requests, whose rows the first step releases
    note_freed: Callable[[list[str]], None]  # hands the last dummy step's rows back to the scheduler
    limits: WarmupLimits
    proposer: DraftProposer | None = None


def limits(cfg: EngineConfig, runner: ModelRunner, spec: SpeculativeConfig, max_model_len: int) -> WarmupLimits:
    shard = runner.shard
    # NOTE: only the Triton backend splits; the others count as one SM, which makes split_cap 1.
    num_sms = runner.backend.num_sms if runner.backend.name == "triton" else 1
    return WarmupLimits(
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=max_model_len, group=shard.num_heads // shard.num_kv_heads,
        num_kv_heads=shard.num_kv_heads, num_sms=num_sms,
        num_speculative_tokens=spec.num_speculative_tokens if spec.method else 0,
        speculative_max_batch=spec.disable_batch_size if spec.method else 0,
    )


def dummy_step(batch: WarmupBatch, block_id: int, block_size: int, freed: list[str] | None = None) -> SchedulerOutput:
    """A step of dummy sequences (token 0 everywhere) whose every block is block_id. `freed`: the previous
    dummy step's sequences, whose block-table rows (worker/input_buffers.py) are released before this step's are
    taken: the same ids come back with other block tables."""
    scheduled = []
    for i, (context, new) in enumerate(batch):
        blocks = -(-(context + new) // block_size)
        scheduled.append(ScheduledRequest(f"{WARMUP_REQUEST_PREFIX}{i}", [0] * new, context, [block_id] * blocks))
    return SchedulerOutput(scheduled, freed_req_ids=list(freed or ()))


def warm_up(target: WarmupTarget, mode: str, on_step: Callable[[float | None], None] | None = None) -> WarmupReport:
    """Run the warm-up steps of `mode` (resolved: full | minimal | off). on_step(t) is told when each step
    starts (time.monotonic()) and on_step(None) when it ends: the watchdog's view of a step."""
    started = time.monotonic()
    if mode == "off":
        return WarmupReport("off", 0, frozenset(), 0, 0.0)
    lim, runner = target.limits, target.runner
    batches = warmup_batches(mode, lim)
    block = _borrow_block(target.pool)
    # The last dummy step's sequences hold block-table rows until released; the first step also releases
    # those of requests the scheduler freed since its last step (a warm-up after serving: tests).
    held: list[str] = target.take_freed()
    try:
        with runner.eager_steps():
            for batch in batches:
                step = dummy_step(batch, block.block_id, target.block_size, freed=held)
                held = [s.request_id for s in step.scheduled]
                with _step(on_step, runner.device):
                    target.execute(step)
    finally:
        target.pool.release([block])
        target.note_freed(held)  # the first real step releases their rows on every rank
    drafts = _warm_up_draft(target, mode, on_step)
    backend = runner.backend.name
    launches = frozenset(runner.backend.issued) if backend == "triton" else frozenset()
    report = WarmupReport(mode, len(batches), launches, drafts, time.monotonic() - started)
    attention = (f"{len(launches)} attention launches (splits x block_m: "
                 + ", ".join(f"{x.num_splits}x{x.block_m}" for x in sorted(launches)) + ")"
                 if backend == "triton" else f"{backend} attention")
    log.info("warm-up (%s): %d step%s (%s), %s%s in %.1f s", mode, report.steps, "" if report.steps == 1 else "s",
             _describe(batches), attention, f", {drafts} draft queries" if drafts else "", report.seconds)
    return report


@contextmanager
def _step(on_step: Callable[[float | None], None] | None, device: torch.device) -> Iterator[None]:
    """One dummy step as the watchdog sees it; on CUDA it ends when the device has finished it."""
    if on_step is not None:
        on_step(time.monotonic())
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if on_step is not None:
        on_step(None)


def _borrow_block(pool: BlockPool) -> KVBlock:
    """A free block that holds no prefix-cache entry, taken out of the free queue until released (at
    start-up every block is such a one); only when every free block caches something is the least recently
    used one evicted, as any allocation would."""
    block = next((b for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is None), None)
    if block is None:
        (block,) = pool.allocate(1)
    else:
        pool.touch([block])
    return block


def _warm_up_draft(target: WarmupTarget, mode: str, on_step: Callable[[float | None], None] | None) -> int:
    """A draft model runs its own forwards (catch-up prefill, then decode): one query per context at which
    some split count is chosen (with one KV head, the most any draft can reach), or one short query."""
    proposer, lim = target.proposer, target.limits
    if proposer is None or proposer.name != "draft":
        return 0
    if mode == "minimal":
        contexts = [min(16, lim.max_model_len - 1)]
    else:
        cap = split_cap(1, lim.num_sms, lim.max_model_len)
        contexts = [min(split_context(s, 1), lim.max_model_len - 1) for s in SPLIT_CHOICES if s <= cap]
    for i, n in enumerate(contexts):
        rid = f"{WARMUP_REQUEST_PREFIX}draft-{i}"
        try:
            with _step(on_step, target.runner.device):
                # Room inside the window for every draft: their positions must have rotary entries.
                proposer.propose_batch([DraftQuery(rid, [0] * n, min(proposer.k, lim.max_model_len - n))])
        finally:
            proposer.release(rid)
    return len(contexts)


def _describe(batches: list[WarmupBatch]) -> str:
    prompts = sorted({n for b in batches for c, n in b if c == 0 and n > 1})
    decode = sorted({k for b in batches if (k := sum(n == 1 for _, n in b))})
    return f"prompt chunks {_span(prompts)}, decode batches {_span(decode)}"


def _span(values: list[int]) -> str:
    if not values:
        return "none"
    return str(values[0]) if len(values) == 1 else f"{len(values)} sizes {values[0]}..{values[-1]}"
