"""Measuring what the KV cache must leave room for, then sizing it (worker/memory_budget.py does the sums).

After the weights load (target and draft), one dummy step runs at the largest shape the scheduler can
send: its whole token budget (--max-num-batched-tokens) spread over as many sequences as it may run
(--max-num-seqs), with logits for every row (a step of prompt-logprobs requests projects them all),
sampled as rank 0 samples at its most expensive. The draft model runs its largest forward likewise.
Both run over a scratch KV cache of a few blocks, freed afterwards. The peak of memory allocated
during the step, above what was allocated before it, is the step's activation peak.

On CUDA the allocator's own counters give that peak, and the KV budget is what the device leaves.
On CPU there are no device counters and the budget stays a set number (--kv-cache-memory, else
1 GiB); the profile runs only when asked (tests), since a CPU forward of a full token budget takes
from seconds to a minute: too slow for every start-up.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ..config import EngineConfig
from ..core.request import Request
from ..distributed import parallel_state as ps
from ..sample.sampler import Sampler
from ..sampling_params import SamplingParams
from .memory_budget import DeviceMemory, KVPlan, KVShape, fixed_kv_budget, plan_from_budget, plan_from_device
from .memory_meter import PeakMeter, dummy_step, model_bytes

if TYPE_CHECKING:
    from ..draft_interface import DraftModel
    from .model_runner import ModelRunner

log = logging.getLogger("sluice.engine")

# Every filter the sampler has, each of which holds a [rows, vocab] tensor while it runs: logprobs, the
# copy a logit bias writes into, top-k's and top-p's sorts, min-p, the exponential noise.
_COSTLIEST_SAMPLING = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, logprobs=20,
                                     logit_bias={0: 0.0})


def max_sampled_rows(cfg: EngineConfig) -> int:
    """The most logits rows one step samples: one per running sequence, or with speculation the
    drafts' rows plus one for each speculating sequence (at most --speculative-disable-batch-size)."""
    seqs = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
    spec = cfg.speculative_config()
    if spec.method is None:
        return seqs
    speculating = min(seqs, spec.disable_batch_size)
    return min(cfg.max_num_batched_tokens, max(seqs, speculating * (spec.num_speculative_tokens + 1)))


def max_speculating_seqs(cfg: EngineConfig) -> int:
    """The most sequences a draft forward runs: above --speculative-disable-batch-size running
    requests, no step speculates."""
    return min(cfg.max_num_seqs, cfg.speculative_disable_batch_size)


# -- profiling -----------------------------------------------------------------------------------
@torch.inference_mode()
def profile_target_step(runner: ModelRunner) -> int:
    """The activation peak of the target's largest step on this rank, rank 0's sampling included.
    Every rank runs it at the same point of start-up, so the step's collectives pair up."""
    cfg = runner.cfg
    step = dummy_step(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.block_size, runner.max_model_len,
                      every_row=True)
    with runner.scratch_kv_cache(step.num_blocks), PeakMeter(runner.device) as meter:
        logits = runner.execute_model(step.sched)
        if logits is None and runner.shard.rank == 0:  # pipeline stages: the last one sends rank 0 the logits
            logits = ps.recv_logits((step.sched.num_tokens, runner.model_config.vocab_size), runner.device)
        if logits is not None:
            _sample_costliest(logits, max_sampled_rows(cfg))
        del logits
    return meter.peak


def _sample_costliest(logits: torch.Tensor, rows: int) -> None:
    """What rank 0 does with a step's logits, at its most memory: samples `rows` of them with every
    filter on, then log-softmaxes all of them (prompt logprobs: step_sampler._prompt_logprobs)."""
    req = Request("memory-profile", [0], _COSTLIEST_SAMPLING)
    Sampler(logits.device)(logits[torch.arange(rows, device=logits.device)], [req] * rows)
    torch.log_softmax(logits, dim=-1)


def cuda_graph_pool_bytes(runner: ModelRunner, activation_peak: int) -> int:
    """Device memory the decode CUDA graphs keep apart from what the profile sees (0 when steps run
    eagerly), plus the scratch KV block their padding rows write to.

    Graphs are captured after the KV cache is allocated (they bake in its addresses), so their pool is
    estimated, not measured: every size shares one pool, captured largest first, so the pool is about
    the activations of the largest captured batch, one token per sequence. The profiled peak of a step of
    --max-num-batched-tokens tokens, scaled to that many tokens (activations grow with tokens; the
    logits and sampler share of it is an overestimate here), plus 4 MiB per graph (batch size x split
    count: runner.graph_plan) for its own state."""
    from .cuda_graphs import graphs_off_reason

    cfg = runner.cfg
    scratch = runner.kv_bytes_per_block
    if graphs_off_reason(cfg.enforce_eager, runner.device, runner.backend.name, cfg.world_size) is not None:
        return scratch
    plan = runner.graph_plan()
    share = min(1.0, max(plan) / max(1, cfg.max_num_batched_tokens))
    return scratch + int(activation_peak * share) + sum(map(len, plan.values())) * (4 << 20)


def measure_device_memory(runner: ModelRunner, draft: DraftModel | None, activation_peak: int,
                          draft_activation_peak: int) -> DeviceMemory:
    """What the CUDA device holds now, split as the sizing needs it. Measured after the profile: the
    first step loads kernels and cuBLAS/NCCL buffers that stay."""
    dev = runner.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()  # memory the allocator caches but does not use is free for the KV cache
    free, total = torch.cuda.mem_get_info(dev)
    allocated = torch.cuda.memory_allocated(dev)
    draft_weights = 0 if draft is None else model_bytes(draft.model)
    return DeviceMemory(
        total=total, utilization=runner.cfg.gpu_memory_utilization,
        # Other processes, this one's CUDA context and non-torch buffers, and the allocator's slack.
        used_by_others=total - free - allocated,
        # Every tensor held now is the target's or the draft's: weights, rotary tables, buffers.
        weights=allocated - draft_weights, draft_weights=draft_weights,
        activation_peak=activation_peak, draft_activation_peak=draft_activation_peak,
        cuda_graph_pool=cuda_graph_pool_bytes(runner, activation_peak),
    )


def plan_kv_cache(runner: ModelRunner, draft: DraftModel | None = None, *,
                  profile_anyway: bool = False) -> KVPlan:
    """This rank's KV caches, the target's and the draft's out of one budget: profiled and measured
    on CUDA without --kv-cache-memory; a set budget otherwise (profiled only with profile_anyway,
    for the log). Logs the sums."""
    cfg = runner.cfg
    kv = KVShape(runner.kv_bytes_per_token, 0 if draft is None else draft.kv_bytes_per_token, cfg.block_size)
    fixed = fixed_kv_budget(runner.device.type, cfg.kv_cache_memory)
    act = draft_act = None
    if fixed is None or profile_anyway:
        act = profile_target_step(runner)
        draft_act = 0 if draft is None else draft.profile_step_peak(max_speculating_seqs(cfg))
    if fixed is None:
        plan = plan_from_device(measure_device_memory(runner, draft, act, draft_act), kv)
    else:
        plan = plan_from_budget(fixed[0], fixed[1], kv, weights=model_bytes(runner.model),
                                draft_weights=0 if draft is None else model_bytes(draft.model),
                                activation_peak=act, draft_activation_peak=draft_act or 0)
    sh = runner.shard
    log.info("%s%s", plan.summary, "" if sh.tp * sh.pp == 1 else f" (rank {sh.rank})")
    return plan
