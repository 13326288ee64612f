"""Which part of the model each rank holds: pure arithmetic on the model config and the layout, checked
before any rank loads a weight (so a split that cannot work is refused with the numbers that say why).

Megatron-style tensor parallelism: query heads, KV heads, the MLP's intermediate columns and the
(padded) vocabulary are split evenly over the TP ranks; when there are more TP ranks than KV heads,
each KV head is replicated on tp / num_kv_heads ranks (as vLLM does). Pipeline parallelism splits
the decoder layers into contiguous stages, as evenly as they go (earlier stages take the remainder).
Global rank = stage * tp + tp_rank, so a TP group is contiguous (one node's GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model_config import ModelConfig

# The vocabulary is padded to a multiple of this times the TP size, so each rank's slice of the
# embedding and the output layer has the same, aligned size.
VOCAB_PAD = 64


def check_layout(mc: ModelConfig, tp: int, pp: int) -> None:
    """Raise ValueError, naming the numbers, unless `mc` can be split over tp x pp ranks."""
    if tp < 1 or pp < 1:
        raise ValueError(f"--tensor-parallel-size and --pipeline-parallel-size must be >= 1, got {tp} and {pp}")
    if mc.num_heads % tp:
        raise ValueError(f"{mc.num_heads} attention heads are not divisible by --tensor-parallel-size {tp}")
    kv = mc.num_kv_heads
    if tp <= kv and kv % tp:
        raise ValueError(f"{kv} KV heads are not divisible by --tensor-parallel-size {tp}")
    if tp > kv and tp % kv:
        raise ValueError(f"--tensor-parallel-size {tp} is more than the {kv} KV heads but not a multiple of "
                         f"them (KV heads are replicated only evenly)")
    if mc.intermediate_size % tp:
        raise ValueError(f"the MLP's intermediate size {mc.intermediate_size} is not divisible by "
                         f"--tensor-parallel-size {tp}")
    if pp > mc.num_layers:
        raise ValueError(f"--pipeline-parallel-size {pp} is more than the model's {mc.num_layers} layers")


@dataclass(frozen=True, slots=True)
class RankShard:
    """What one rank holds of the model."""

    tp: int
    tp_rank: int
    pp: int
    pp_rank: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    first_head: int  # this rank's query heads are first_head .. first_head + num_heads
    first_kv_head: int
    intermediate: int  # MLP columns on this rank
    first_layer: int  # decoder layers first_layer .. end_layer on this stage
    end_layer: int
    vocab_padded: int  # the whole vocabulary padded to a multiple of VOCAB_PAD * tp
    vocab_start: int  # this rank's slice of the (padded) vocabulary
    vocab_end: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp + self.tp_rank


def stage_layers(num_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """Layers [first, end) of pipeline stage `stage`: even split, the first stages take the remainder."""
    base, extra = divmod(num_layers, pp)
    first = stage * base + min(stage, extra)
    return first, first + base + (stage < extra)


def rank_shard(mc: ModelConfig, tp: int, pp: int, rank: int) -> RankShard:
    check_layout(mc, tp, pp)
    if not 0 <= rank < tp * pp:
        raise ValueError(f"rank {rank} is outside the {tp * pp} ranks of the layout")
    pp_rank, tp_rank = divmod(rank, tp)
    heads = mc.num_heads // tp
    if tp <= mc.num_kv_heads:
        kv_heads = mc.num_kv_heads // tp
        first_kv = tp_rank * kv_heads
    else:  # replicated: rank r's query heads all read KV head r * kv / tp
        kv_heads = 1
        first_kv = tp_rank * mc.num_kv_heads // tp
    first, end = stage_layers(mc.num_layers, pp, pp_rank)
    pad = VOCAB_PAD * tp
    vocab_padded = mc.vocab_size if tp == 1 else -(-mc.vocab_size // pad) * pad
    per_rank = vocab_padded // tp
    return RankShard(tp, tp_rank, pp, pp_rank, heads, kv_heads, tp_rank * heads, first_kv,
                     mc.intermediate_size // tp, first, end, vocab_padded, tp_rank * per_rank,
                     (tp_rank + 1) * per_rank)


def single_shard(mc: ModelConfig) -> RankShard:
    return rank_shard(mc, 1, 1, 0)
