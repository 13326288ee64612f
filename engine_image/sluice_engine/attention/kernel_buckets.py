"""The kernel launch configurations the engine uses: a small fixed set, one chooser that picks from it per step,
and the dummy batches start-up warm-up runs so that every member is compiled before the server is ready.

Why: Triton compiles a kernel once per distinct set of compile-time constants (and per class of the integer
arguments it specializes: equal to 1, divisible by 16), about a second each, the first time a batch needs it;
and a new pod (a restart, a scale from zero) starts with none of them. Free-running choices (any split count,
block sizes per shape, a block-table width that changes with the batch) made tens to hundreds of variants,
each compiled on the serving path. Here the Triton attention launch is one of `attention_launches(...)`
(at most 2 x len(SPLIT_CHOICES) per model and device, whatever the batch sizes), triton_kernels.py refuses
anything else and does not specialize on the block-table width, and `warmup_batches` covers the set.

Pure Python (no torch, no triton): the choice is a function of plain numbers, tested as one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Flash-decoding splits of a sequence's key range: powers of two only, so a handful of variants.
SPLIT_CHOICES = (1, 2, 4, 8, 16, 32)
# A split is never shorter than this many keys (each costs a partial output and a merge).
MIN_TOKENS_PER_SPLIT = 256
# Only batches of short queries split (decode, speculative verification, a short extend after a prefix hit):
# a prefill tile already has work enough, and partial outputs cost T x Hq x splits x D floats.
SPLIT_MAX_QUERY_LEN = 16
# Programs per SM the split count aims at (about two waves).
PROGRAMS_PER_SM = 2
# Query rows per program: decode fills them with one token's GQA group; longer queries want longer tiles.
# A group wider than the tile sets the tile (next power of two), up to the last choice.
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64
BLOCK_M_CHOICES = (16, 32, 64, 128)
# Keys per inner-loop iteration: one choice.
BLOCK_N = 64


@dataclass(frozen=True, slots=True, order=True)
class AttentionLaunch:
    """The compile-time shape of one paged-attention launch (besides the model's constants)."""

    num_splits: int
    block_m: int
    block_n: int = BLOCK_N

    def __post_init__(self) -> None:
        if (self.num_splits not in SPLIT_CHOICES or self.block_m not in BLOCK_M_CHOICES
                or self.block_n != BLOCK_N):
            raise ValueError(f"{self} is outside the fixed launch set (splits {SPLIT_CHOICES}, block_m "
                             f"{BLOCK_M_CHOICES}, block_n {BLOCK_N}): it would compile on the serving path")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pow2_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def block_m_for(max_query_len: int, group: int) -> int:
    """Query rows per program: the batch's kind (decode or not) and the GQA group decide, nothing else."""
    if group > BLOCK_M_CHOICES[-1]:
        raise ValueError(f"{group} query heads per KV head: the Triton attention holds at most "
                         f"{BLOCK_M_CHOICES[-1]} in a tile")
    return max(DECODE_BLOCK_M if max_query_len == 1 else PREFILL_BLOCK_M, _pow2_at_least(group))


def choose_num_splits(seq_lens: Sequence[int], num_kv_heads: int, num_sms: int) -> int:
    """How many programs share one (sequence, KV head)'s key range, for a batch of short queries.

    The kernel lasts as long as its slowest program. Unsplit, that is the one reading the longest sequence:
    one long context among short ones would serialize the whole batch on one program per KV head. So split
    until the longest sequence's share per program is no more than an even spread of all the batch's keys
    over PROGRAMS_PER_SM programs per SM. With equal lengths this is "about two waves of programs over
    the SMs"; a batch that fills the GPU with equal work gets 1. Never below MIN_TOKENS_PER_SPLIT keys a
    split; rounded to SPLIT_CHOICES.
    """
    longest, total = max(seq_lens), sum(seq_lens)
    want = _ceil_div(PROGRAMS_PER_SM * num_sms * longest, num_kv_heads * total)
    most = _ceil_div(longest, MIN_TOKENS_PER_SPLIT)
    return min(_pow2_at_least(want), _pow2_at_most(most), SPLIT_CHOICES[-1])


def choose_attention_launch(max_query_len: int, seq_lens: Sequence[int], group: int, num_kv_heads: int,
                            num_sms: int) -> AttentionLaunch:
    """The launch of a step's attention: max_query_len is the batch's longest new-token count, seq_lens each
    sequence's context after the step (cached + new), num_kv_heads this rank's."""
    splits = 1
    if max_query_len <= SPLIT_MAX_QUERY_LEN:
        splits = choose_num_splits(seq_lens, num_kv_heads, num_sms)
    return AttentionLaunch(splits, block_m_for(max_query_len, group))


def split_cap(num_kv_heads: int, num_sms: int, max_model_len: int) -> int:
    """The most splits choose_num_splits can return for contexts up to max_model_len (total >= longest
    bounds `want`; longest <= max_model_len bounds `most`)."""
    want = _ceil_div(PROGRAMS_PER_SM * num_sms, num_kv_heads)
    most = _ceil_div(max_model_len, MIN_TOKENS_PER_SPLIT)
    return min(_pow2_at_least(want), _pow2_at_most(most), SPLIT_CHOICES[-1])


def decode_split_choices(min_seqs: int, num_kv_heads: int, num_sms: int, max_model_len: int) -> list[int]:
    """Every split count choose_num_splits can return for a batch of at least min_seqs sequences whose contexts
    are 1..max_model_len tokens: from 1 (short contexts) up to what one max_model_len context among one-token
    ones gets (the most keys on one sequence relative to the batch's). Every power of two between is reached
    on the way (raising that one context raises the choice a power of two at a time)."""
    most = choose_num_splits([max_model_len] + [1] * (min_seqs - 1), num_kv_heads, num_sms)
    return [s for s in SPLIT_CHOICES if s <= most]


def attention_launches(group: int, num_kv_heads: int, num_sms: int, max_model_len: int) -> frozenset[AttentionLaunch]:
    """Every launch choose_attention_launch can return for this model (group, KV heads per rank) on this
    device (SMs) up to max_model_len: decode and short-query tiles at each reachable split count (long
    queries never split, so theirs is the short-query tile unsplit)."""
    cap = split_cap(num_kv_heads, num_sms, max_model_len)
    return frozenset(AttentionLaunch(s, block_m_for(q, group))
                     for s in SPLIT_CHOICES if s <= cap for q in (1, 2))


# -- warm-up -----------------------------------------------------------------------------------------------
# A dummy batch: per sequence, (tokens already in its cache, tokens computed this step).
WarmupBatch = tuple[tuple[int, int], ...]


def decode_batch_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes warm-up runs: 1, 2, 4, then every multiple of 8 (vLLM's CUDA-graph capture sizes),
    and max_batch itself."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return [*sizes, max_batch]


def prefill_chunk_buckets(max_chunk: int) -> list[int]:
    """Prompt chunk lengths warm-up runs: powers of two above the short-query limit up to the step's token
    budget, and the budget itself (the largest activations a step allocates)."""
    sizes, c = [], 2 * SPLIT_MAX_QUERY_LEN
    while c < max_chunk:
        sizes.append(c)
        c *= 2
    return [*sizes, max_chunk]


def split_context(num_splits: int, new_tokens: int) -> int:
    """A context length (cached + new) at which a lone sequence gets exactly num_splits, given the device
    allows that many (num_splits <= split_cap)."""
    return max(new_tokens, MIN_TOKENS_PER_SPLIT * (num_splits - 1) + 1)


@dataclass(frozen=True, slots=True)
class WarmupLimits:
    """What bounds the dummy batches: the engine's limits and the attention's shape on this rank and device."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    group: int
    num_kv_heads: int
    num_sms: int
    num_speculative_tokens: int = 0  # 0: no speculation
    speculative_max_batch: int = 0  # at most this many requests speculate in one step


def warmup_batches(mode: str, lim: WarmupLimits) -> list[WarmupBatch]:
    """The dummy batches warm-up runs. `minimal`: one step holding a prompt chunk and a decode row (every
    layer once, both kinds of rows; the Triton attention only unsplit). `full`: each prefill chunk bucket,
    each decode batch bucket, each speculative verification bucket, and a decode and a short-query batch at
    every reachable split count above 1, so every member of attention_launches(...) runs (tests check the
    two agree). Every batch respects the token budget, the batch size and the context window."""
    budget, window = lim.max_num_batched_tokens, lim.max_model_len
    small = min(SPLIT_MAX_QUERY_LEN, budget, window - 1)
    if mode == "minimal":
        prompt = min(small, budget - 1)
        return [((0, prompt), (prompt, 1))] if prompt >= 1 and lim.max_num_seqs >= 2 else [((0, small),)]
    if mode != "full":
        raise ValueError(f"unknown warm-up mode {mode!r}")
    batches: list[WarmupBatch] = [((0, c),) for c in prefill_chunk_buckets(min(budget, window))]
    decode_max = min(lim.max_num_seqs, budget)
    batches += [((small, 1),) * b for b in decode_batch_buckets(decode_max)]
    k = lim.num_speculative_tokens
    if k:
        verify = k + 1
        spec_max = min(lim.speculative_max_batch, lim.max_num_seqs, budget // verify)
        ctx = min(small, window - verify)
        if spec_max >= 1 and ctx >= 0:
            batches += [((ctx, verify),) * b for b in decode_batch_buckets(spec_max)]
    cap = split_cap(lim.num_kv_heads, lim.num_sms, window)
    for s in SPLIT_CHOICES[1:]:  # unsplit launches ran above (decode buckets, prompt chunks)
        if s > cap:
            break
        for new in (1, 2):  # decode, and a short query (verification, an extend after a prefix hit)
            if new <= budget:
                batches.append(((split_context(s, new) - new, new),))
    return batches


def launch_of(batch: WarmupBatch, lim: WarmupLimits) -> AttentionLaunch:
    """The launch the engine's chooser makes for a dummy batch."""
    return choose_attention_launch(max(n for _, n in batch), [c + n for c, n in batch], lim.group,
                                   lim.num_kv_heads, lim.num_sms)
