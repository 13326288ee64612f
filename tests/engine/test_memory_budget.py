"""The KV sizing arithmetic (memory_budget.py), offline: it never over-commits the device, gives the
target and the draft caches the same number of tokens, finds a split whenever one exists, and fits
an 8B target with a 1B draft on an H200 (which used to run out of memory at start-up)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice_engine.worker.memory_budget import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    DeviceMemory,
    InsufficientMemory,
    KVShape,
    fixed_kv_budget,
    plan_from_budget,
    plan_from_device,
)

GB = 10**9
GiB = 2**30


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * layers * kv_heads * head_dim * dtype_bytes


# Layer/head shapes of real models (Llama, Qwen, Mistral, Gemma, Phi...) and their cache dtypes.
kv_per_token = st.builds(kv_bytes_per_token, st.integers(1, 128), st.sampled_from([1, 2, 4, 8, 16, 32, 64]),
                         st.sampled_from([64, 80, 96, 128, 256]), st.sampled_from([1, 2, 4]))


def fits(mem: DeviceMemory, kv: KVShape, num_blocks: int) -> bool:
    """The specification, written out: everything the engine holds within its share of the device.
    The target's and the draft's activations count once, the larger: the draft proposes, then the
    target runs its step, one after the other on one stream."""
    held = (mem.weights + mem.draft_weights + max(mem.activation_peak, mem.draft_activation_peak)
            + mem.cuda_graph_pool + num_blocks * kv.block_size * (kv.bytes_per_token + kv.draft_bytes_per_token))
    return held <= int(mem.total * mem.utilization) - mem.used_by_others


@settings(max_examples=400, deadline=None)
@given(
    total=st.integers(8 * GB, 200 * GB),
    utilization=st.floats(0.5, 0.98),
    used_by_others=st.integers(0, 8 * GB),
    weights=st.integers(100 * 10**6, 140 * GB),
    activation_peak=st.integers(0, 24 * GB),
    cuda_graph_pool=st.one_of(st.just(0), st.integers(0, 4 * GB)),
    target_kv=kv_per_token,
    draft=st.one_of(st.none(), st.tuples(st.integers(50 * 10**6, 20 * GB), st.integers(0, 8 * GB), kv_per_token)),
    block_size=st.sampled_from([1, 8, 16, 32, 128, 256]),
)
def test_device_plan_never_over_commits_and_finds_every_feasible_split(
        total, utilization, used_by_others, weights, activation_peak, cuda_graph_pool, target_kv, draft, block_size):
    draft_weights, draft_activation_peak, draft_kv = draft or (0, 0, 0)
    mem = DeviceMemory(total=total, utilization=utilization, used_by_others=used_by_others, weights=weights,
                       activation_peak=activation_peak, draft_weights=draft_weights,
                       draft_activation_peak=draft_activation_peak, cuda_graph_pool=cuda_graph_pool)
    kv = KVShape(target_kv, draft_kv, block_size)
    if not fits(mem, kv, 1):
        with pytest.raises(InsufficientMemory, match="--gpu-memory-utilization.*--max-num-batched-tokens.*--kv-cache-memory"):
            plan_from_device(mem, kv)
        return
    plan = plan_from_device(mem, kv)
    assert plan.num_blocks >= 1
    # Never over-commits, and leaves less than one more block unused (the most that fits).
    assert fits(mem, kv, plan.num_blocks)
    assert not fits(mem, kv, plan.num_blocks + 1)
    # The caches' bytes are the blocks' (no rounding lost between the split and what is allocated).
    assert plan.target_bytes == plan.num_blocks * block_size * target_kv
    assert plan.draft_bytes == plan.draft_num_blocks * block_size * draft_kv
    # The draft holds a slot for every token the target holds: the same number of tokens.
    if draft is not None:
        assert plan.draft_num_blocks * block_size == plan.num_tokens
        # ... so the bytes split in proportion to their KV per token.
        assert plan.draft_bytes * target_kv == plan.target_bytes * draft_kv
    else:
        assert plan.draft_num_blocks == 0 and "draft" not in plan.summary
    assert plan.summary.startswith("memory: total ") and plan.summary.endswith(f"= {plan.num_tokens} tokens")


@settings(max_examples=200, deadline=None)
@given(budget=st.integers(0, 64 * GB), target_kv=kv_per_token, draft_kv=st.one_of(st.just(0), kv_per_token),
       block_size=st.sampled_from([1, 16, 256]))
def test_set_budget_holds_both_caches(budget, target_kv, draft_kv, block_size):
    """--kv-cache-memory (and the CPU default) is the budget of the two caches together."""
    kv = KVShape(target_kv, draft_kv, block_size)
    per_block = block_size * (target_kv + draft_kv)
    if budget < per_block:
        with pytest.raises(InsufficientMemory, match="--kv-cache-memory"):
            plan_from_budget(budget, "--kv-cache-memory", kv, weights=GB)
        return
    plan = plan_from_budget(budget, "--kv-cache-memory", kv, weights=GB)
    assert plan.target_bytes + plan.draft_bytes <= budget < plan.target_bytes + plan.draft_bytes + per_block
    assert plan.draft_num_blocks == (plan.num_blocks if draft_kv else 0)


def test_llama_8b_with_a_1b_draft_fits_an_h200_at_0_9():
    """Llama-3.1-8B (bf16, 32 layers, 8 KV heads of 128) with Llama-3.2-1B as its draft (16 layers, 8 KV
    heads of 64) on a 141 GB H200 at --gpu-memory-utilization 0.9."""
    target_kv = kv_bytes_per_token(32, 8, 128, 2)  # 128 KiB a token
    draft_kv = kv_bytes_per_token(16, 8, 64, 2)  # 32 KiB a token
    mem = DeviceMemory(total=141 * GB, utilization=0.9, used_by_others=600 * 2**20, weights=int(16.1 * GB),
                       activation_peak=2 * GiB, draft_weights=int(2.5 * GB), draft_activation_peak=GiB // 2)
    kv = KVShape(target_kv, draft_kv, 16)
    plan = plan_from_device(mem, kv)
    assert fits(mem, kv, plan.num_blocks)
    assert plan.draft_num_blocks == plan.num_blocks and plan.num_tokens > 500_000
    assert plan.target_bytes == 4 * plan.draft_bytes  # a token of the draft costs a quarter of the target's
    # The old sizing gave the target alone `total x 0.9 - used - 1 GiB`, then allocated the draft's
    # cache for as many tokens on top: more than the device has.
    old_target_kv = mem.limit - mem.used_by_others - mem.weights - mem.draft_weights - GiB
    assert mem.limit + old_target_kv // 4 > mem.total
    assert plan.summary == (
        "memory: total 131.32 GiB x 0.90 = 118.18 GiB; others 600.0 MiB; weights 14.99 GiB (+draft 2.33 GiB); "
        f"activations peak 2.00 GiB (draft 512.0 MiB); graphs 0.0 MiB; KV {(plan.target_bytes + plan.draft_bytes) / GiB:.2f} GiB "
        f"= {plan.num_blocks} blocks (target) + {plan.num_blocks} blocks (draft) = {plan.num_tokens} tokens")


def test_refusal_says_what_is_left_and_which_flags_move_it():
    mem = DeviceMemory(total=24 * GiB, utilization=0.9, used_by_others=GiB, weights=18 * GiB, activation_peak=4 * GiB)
    with pytest.raises(InsufficientMemory) as e:
        plan_from_device(mem, KVShape(kv_bytes_per_token(32, 8, 128, 2), 0, 16))
    msg = str(e.value)
    assert "weights 18.00 GiB; activations peak 4.00 GiB" in msg and "leaves -1.40 GiB, less than one block" in msg
    assert "--gpu-memory-utilization" in msg and "--max-num-batched-tokens" in msg and "--kv-cache-memory" in msg


def test_kv_cache_memory_sets_the_budget_on_every_device():
    assert fixed_kv_budget("cuda", 64 << 20) == (64 << 20, "--kv-cache-memory")
    assert fixed_kv_budget("cpu", 64 << 20) == (64 << 20, "--kv-cache-memory")
    assert fixed_kv_budget("cpu", None) == (DEFAULT_CPU_KV_CACHE_BYTES, "the CPU default")
    assert fixed_kv_budget("cuda", None) is None  # measured: profile the step, read the device
