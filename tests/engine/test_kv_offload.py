"""The KV offload tier (issue 28; docs/architecture.md, "KV beyond one engine"): its index (LRU, slots pinned by
the step that loads them), the scheduler's stores of evicted prefix blocks and loads of tier hits into fresh
blocks, and the engine end to end: a device pool far smaller than the working set, 4 long shared prefixes in
rotation, tier hits counted, greedy tokens identical to recomputing them."""

from __future__ import annotations

import pytest
from test_scheduler import run_step

from sluice_engine.core.kv_cache import KVCacheManager
from sluice_engine.core.kv_offload import OffloadIndex
from sluice_engine.core.request import Request
from sluice_engine.core.scheduler import Scheduler
from sluice_engine.sampling_params import SamplingParams


def test_index_is_lru_and_never_hands_out_a_slot_its_step_loads():
    ix = OffloadIndex(2)
    ix.store(10, block_id=0)
    ix.store(11, block_id=1)
    assert ix.take() == ([(0, 0), (1, 1)], [])
    ix.store(10, block_id=5)  # held already: no copy, just used
    assert ix.take() == ([], [])
    ix.store(12, block_id=2)  # full: the least recently used (11) gives way
    assert 11 not in ix.slots and ix.slots[12] == 1
    assert ix.lookup([10, 12, 99, 10]) == 2
    ix.take()
    ix.load(10, block_id=7)  # pinned until the step is taken: stores this step take another slot
    ix.store(13, block_id=3)
    assert ix.slots == {10: 0, 13: 1}
    ix.store(14, block_id=4)  # every slot pinned or just written this step... 13's slot is not pinned
    assert 10 in ix.slots
    stores, loads = ix.take()
    assert loads == [(0, 7)] and (4, 1) in stores
    ix.load(10, block_id=8)
    ix.load(14, block_id=9)
    ix.store(15, block_id=6)  # both slots pinned: the block is dropped, not stored over a load's source
    assert ix.dropped == 1 and 15 not in ix.slots
    ix.take()
    ix.load(10, block_id=1)
    ix.clear()  # a prefix-cache reset: entries gone; the pinned slot comes back after its step
    ix.store(16, block_id=2)
    assert ix.slots == {16: 1}
    ix.take()
    ix.store(17, block_id=3)
    assert sorted(ix.slots.values()) == [0, 1]


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1))


def test_evicted_prefix_blocks_are_stored_and_a_later_hit_loads_them_into_fresh_blocks():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True, offload_blocks=8)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    first = list(range(100, 117))  # 4 full blocks + 1 token
    s.add(_request("a", first))
    out = run_step(s)
    assert out.kv_stores == [] and out.kv_loads == []
    a_blocks = out.scheduled[0].block_ids
    s.add(_request("b", list(range(200, 221))))  # needs all 6 blocks: a's cached ones are evicted
    out = run_step(s)
    stored = dict(out.kv_stores)  # device block -> tier slot, before this step overwrites them
    assert set(stored) <= set(a_blocks) and len(stored) == 4
    assert kv.offload.stored == 4
    s.add(_request("c", [*first[:16], 5, 6]))  # a's 4 full blocks again: not on the device, in the tier
    out = run_step(s)
    c = out.scheduled[0]
    assert c.start == 16 and c.token_ids == [5, 6]  # the tier's 16 tokens count as computed
    assert [blk for _, blk in out.kv_loads] == c.block_ids[:4]
    assert {slot for slot, _ in out.kv_loads} == set(stored.values())
    assert kv.offload_hits == 16 and kv.prefix_hits == 16
    # A store and a load in one step: the runner stores first, so a block evicted and reloaded is saved first.
    assert all(slot not in {t for _, t in out.kv_stores} for slot, _ in out.kv_loads)


def test_no_tier_without_prefix_caching_or_bytes():
    assert KVCacheManager(8, 4, enable_prefix_caching=False, offload_blocks=8).offload is None
    assert KVCacheManager(8, 4, enable_prefix_caching=True).offload is None


@pytest.mark.slow
def test_engine_serves_prefixes_from_the_tier_as_recomputing_them_would():
    """The bundled model on CPU (fp32 weights and cache) with a 30 MiB cache (~42 blocks) and 4 prefixes of ~430
    tokens (~27 blocks each) in rotation, twice: the second round's prefixes come back from the tier (counted),
    greedy tokens and logprobs as recomputing them, and logprobs exactly those of an engine whose cache is big
    enough to hit them on the device (both read the KV the first round computed).

    fp32 because the default Q4_1 path's cache is fp16 (llama.cpp's): there an extend over cached KV rounds
    otherwise than a one-chunk prefill, device prefix hits and tier hits alike, and 2 of 8 such prompts'
    greedy tokens differ from recomputing them (the tier's still equal the device hits').

    4 prefixes, not 8 (each ~430-token prefill is most of the time; 83 s in CI with 8): the pool still holds under
    half of them, so every second-round prefix is evicted by the time it comes back."""
    from sluice_engine.entrypoints.llm import LLM

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    n = 4
    prefixes = [" ".join(words[(i + j) % len(words)] + str(j % 7) for j in range(150)) for i in range(n)]
    prompts = [f"{p}\nQuestion {k}: what comes next?" for k in range(2) for p in prefixes]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1)
    results = {}
    engines = (("tier", 30, {"kv_offload_bytes": 256 << 20}), ("recompute", 30, {}), ("device", 1024, {}))
    for name, mib, extra in engines:
        llm = LLM(None, kv_cache_memory=mib << 20, max_model_len=640, quantization="none", **extra)
        results[name] = [llm.generate([p], params)[0] for p in prompts]
        kv = llm.engine.kv
        if name == "tier":
            assert kv.num_blocks * 16 < 430 * n / 2  # the device pool holds under half the working set
            assert kv.offload.loaded >= n * 20  # each second-round prefix came back from the tier
            assert kv.offload_hits >= n * 20 * 16
            assert all(c.num_cached_tokens >= 320 for c in results[name][n:])
            from sluice_engine.metrics import PrometheusExporter

            text = PrometheusExporter(llm.engine).render()[0].decode()
            ix = kv.offload
            model = f'model_name="{llm.engine.served_model_name}"'
            for line in (f"sluice_kv_offload_hits_total{{{model}}} {float(kv.offload_hits)}",
                         f'sluice_kv_offload_blocks_moved_total{{direction="load",{model}}} {float(ix.loaded)}',
                         f'sluice_kv_offload_blocks_moved_total{{direction="store",{model}}} {float(ix.stored)}',
                         f"sluice_kv_offload_blocks{{{model}}} {float(ix.num_slots)}"):
                assert line in text, line
            assert f'sluice_kv_offload_bytes_total{{direction="load",{model}}}' in text
        elif name == "recompute":
            assert kv.offload is None
            assert all(c.num_cached_tokens < 320 for c in results[name][n:])  # evicted: recomputed
        else:
            assert all(c.num_cached_tokens >= 320 for c in results[name][n:])  # device hits
        llm.engine.shutdown()
    for tier, again, device in zip(results["tier"], results["recompute"], results["device"], strict=True):
        assert tier.token_ids == again.token_ids == device.token_ids
        for a, b, c in zip(tier.logprobs, again.logprobs, device.logprobs, strict=True):  # the chosen token's
            assert a[0] == pytest.approx(b[0], abs=1e-3)
            assert a[0] == c[0]
