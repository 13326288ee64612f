"""The fixed kernel launch set (kernel_buckets.py): bounded, never left by the chooser, covered by warm-up, and
a split heuristic that does not let one long context serialize a batch. Pure functions: no torch, no Triton."""

from __future__ import annotations

import math
import random

import pytest

from sluice_engine.attention.kernel_buckets import (
    SPLIT_CHOICES,
    AttentionLaunch,
    WarmupLimits,
    attention_launches,
    choose_attention_launch,
    choose_num_splits,
    decode_batch_buckets,
    decode_split_choices,
    launch_of,
    prefill_chunk_buckets,
    warmup_batches,
)

# (query heads per KV head, KV heads per rank): SmolLM2-135M; Llama-3-8B; Llama-3-70B over TP 8; an MQA model.
MODELS = [(3, 3), (4, 8), (8, 1), (32, 1)]
H200_SMS = 132


def limits(group: int, hkv: int, *, sms: int = H200_SMS, max_num_seqs: int = 64, budget: int = 2048,
           window: int = 8192, k: int = 0) -> WarmupLimits:
    return WarmupLimits(max_num_seqs, budget, window, group, hkv, sms, num_speculative_tokens=k,
                        speculative_max_batch=8 if k else 0)


def test_buckets_are_vllm_like_and_end_at_the_limit():
    assert decode_batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_batch_buckets(1) == [1]
    assert decode_batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert len(decode_batch_buckets(256)) == 35
    assert prefill_chunk_buckets(2048) == [32, 64, 128, 256, 512, 1024, 2048]
    assert prefill_chunk_buckets(3000) == [32, 64, 128, 256, 512, 1024, 2048, 3000]
    assert prefill_chunk_buckets(10) == [10]


@pytest.mark.parametrize("group, hkv", MODELS)
@pytest.mark.parametrize("max_num_seqs", [64, 256])
def test_the_set_is_small_whatever_the_batch_size(group, hkv, max_num_seqs):
    lim = limits(group, hkv, max_num_seqs=max_num_seqs, budget=max(2048, max_num_seqs), window=131072, k=4)
    launches = attention_launches(group, hkv, H200_SMS, lim.max_model_len)
    # Two tiles (decode, other) at each split count: what a model compiles of the attention kernel.
    assert len(launches) <= 2 * len(SPLIT_CHOICES) == 12
    # Warm-up steps grow with the decode buckets (11 for 64 sequences, 35 for 256), not with contexts:
    # 7 prompt chunks, the decode buckets, 4 verification buckets, 2 x 5 split counts above 1.
    batches = warmup_batches("full", lim)
    assert len(batches) == 7 + len(decode_batch_buckets(max_num_seqs)) + 4 + 10 <= 56


@pytest.mark.parametrize("group, hkv", MODELS)
@pytest.mark.parametrize("sms", [1, 16, 78, H200_SMS])
def test_the_chooser_never_leaves_the_set(group, hkv, sms):
    """Random ragged batches (sizes, context lengths, chunks; some decode, some verification, some prefill)
    always get a launch that the enumeration holds, so warm-up compiled it."""
    window = 32768
    allowed = attention_launches(group, hkv, sms, window)
    rng = random.Random(group * 1000 + sms)
    seen = set()
    for _ in range(3000):
        b = rng.choice([1, 2, 3, 8, 31, 64, 256])
        kind = rng.random()
        query = 1 if kind < 0.5 else rng.randint(2, 16) if kind < 0.8 else rng.randint(17, 2048)
        # Context lengths from log-uniform, so one long among many short is common.
        seq_lens = [min(window, max(query, int(2 ** rng.uniform(0, 15)))) for _ in range(b)]
        launch = choose_attention_launch(query, seq_lens, group, hkv, sms)
        assert launch in allowed, (query, seq_lens, launch)
        seen.add(launch)
    if sms >= 16:
        assert seen == allowed  # and the enumeration holds nothing the chooser cannot reach


@pytest.mark.parametrize("hkv", [1, 2, 8])
@pytest.mark.parametrize("sms, window", [(16, 4096), (H200_SMS, 8192), (H200_SMS, 131072)])
@pytest.mark.parametrize("min_seqs", [1, 3, 33, 249])
def test_decode_split_choices_are_what_the_chooser_returns(hkv, sms, window, min_seqs):
    """What a CUDA graph size is captured at (cuda_graphs.py): every count the chooser returns for decode
    batches of min_seqs to min_seqs + 7 sequences, and nothing it cannot return."""
    choices = decode_split_choices(min_seqs, hkv, sms, window)
    rng = random.Random(hkv * 7 + sms + min_seqs)
    seen = set()
    for _ in range(2000):
        b = rng.randint(min_seqs, min_seqs + 7)
        # Log-uniform contexts (one may reach the window's end), sometimes one among one-token ones: skewed and
        # even batches.
        seq_lens = [rng.choice([window, int(2 ** rng.uniform(0, math.log2(window)))])]
        seq_lens += [min(window, int(2 ** rng.uniform(0, 17))) for _ in range(b - 1)]
        if rng.random() < 0.3:
            seq_lens[1:] = [1] * (b - 1)
        s = choose_num_splits(seq_lens, hkv, sms)
        assert s in choices, (seq_lens, s)
        seen.add(s)
    assert seen == set(choices)


@pytest.mark.parametrize("group, hkv", MODELS)
@pytest.mark.parametrize("sms, window", [(1, 8192), (16, 2048), (H200_SMS, 8192), (H200_SMS, 131072)])
@pytest.mark.parametrize("k", [0, 4])
def test_full_warmup_runs_every_launch_and_respects_the_limits(group, hkv, sms, window, k):
    lim = limits(group, hkv, sms=sms, window=window, k=k)
    batches = warmup_batches("full", lim)
    assert {launch_of(b, lim) for b in batches} == attention_launches(group, hkv, sms, window)
    for batch in batches:
        assert 1 <= len(batch) <= lim.max_num_seqs
        assert sum(n for _, n in batch) <= lim.max_num_batched_tokens
        assert all(c >= 0 and n >= 1 and c + n <= window for c, n in batch)
    sizes = {len(b) for b in batches if all(n == 1 for _, n in b)}
    assert set(decode_batch_buckets(lim.max_num_seqs)) <= sizes
    prompts = {n for b in batches for c, n in b if c == 0 and len(b) == 1}
    assert set(prefill_chunk_buckets(lim.max_num_batched_tokens)) <= prompts
    if k:  # verification steps of k + 1 tokens at every speculating batch size
        assert {len(b) for b in batches if b[0][1] == k + 1} == set(decode_batch_buckets(8))


def test_minimal_warmup_is_one_step_with_a_prompt_chunk_and_a_decode_row():
    lim = limits(3, 3)
    assert warmup_batches("minimal", lim) == [((0, 16), (16, 1))]
    tiny = WarmupLimits(4, 8, 12, 3, 3, 1)  # a budget and window below the usual chunk
    assert warmup_batches("minimal", tiny) == [((0, 7), (7, 1))]
    assert warmup_batches("minimal", WarmupLimits(1, 8, 12, 3, 3, 1)) == [((0, 8),)]  # one sequence a step
    with pytest.raises(ValueError, match="warm-up mode"):
        warmup_batches("sometimes", lim)


# -- the split heuristic ----------------------------------------------------------------------------------
def test_equal_contexts_split_to_fill_the_gpu_and_stay_long():
    assert choose_num_splits([4096], 8, H200_SMS) == 16  # 4096 / 256: chunks no shorter than 256
    assert choose_num_splits([100_000], 8, H200_SMS) == 32  # capped
    assert choose_num_splits([4096] * 4, 8, H200_SMS) == 16  # ~2 waves of 132: 9 wanted, rounded up
    assert choose_num_splits([4096] * 64, 8, H200_SMS) == 1  # the batch fills the GPU already
    assert choose_num_splits([200], 8, H200_SMS) == 1  # too short to split


def test_one_long_context_among_short_ones_is_split():
    """64 sequences fill the GPU (8 x 64 programs), so equal contexts are not split; but one 32k context
    among 63 short ones would run on 8 programs while the rest idle: the longest decides."""
    short = [100] * 63
    assert choose_num_splits(short + [100], 8, H200_SMS) == 1
    assert choose_num_splits(short + [32_000], 8, H200_SMS) == 32
    # The longest program reads no more than an even share of all the keys over two waves.
    for long in (2_000, 8_000, 32_000, 128_000):
        seq_lens = short + [long]
        s = choose_num_splits(seq_lens, 8, H200_SMS)
        fair = sum(seq_lens) * 8 / (2 * H200_SMS)
        assert long / s <= max(fair, 256) or s == SPLIT_CHOICES[-1], (long, s)
    # Many long contexts share the GPU between them: fewer splits again.
    assert choose_num_splits([4096] * 63 + [32_000], 8, H200_SMS) == 4
    # The mean (the old rule's view of this batch) would have said 1.
    assert choose_num_splits([sum(short + [32_000]) // 64] * 64, 8, H200_SMS) == 1


def test_long_queries_never_split_and_decode_uses_the_small_tile():
    assert choose_attention_launch(1, [32_000], 4, 8, H200_SMS) == AttentionLaunch(32, 16)
    assert choose_attention_launch(5, [32_000], 4, 8, H200_SMS) == AttentionLaunch(32, 64)
    assert choose_attention_launch(17, [32_000], 4, 8, H200_SMS) == AttentionLaunch(1, 64)
    assert choose_attention_launch(1, [10], 32, 1, H200_SMS).block_m == 32  # a wide GQA group sets the tile
