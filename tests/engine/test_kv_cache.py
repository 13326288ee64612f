"""Block pool and block tables: free list order, prefix hits, LRU eviction, ref counts."""

from sluice_engine.core.kv_cache import BlockPool, KVCacheManager, hash_block
from sluice_engine.core.request import Request
from sluice_engine.sampling_params import SamplingParams


def req(rid: str, tokens: list[int], **kw) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8, **kw))


def test_pool_allocates_and_frees_in_lru_order():
    pool = BlockPool(4, enable_caching=True)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1] and pool.num_free_blocks == 2
    pool.release(reversed(a))  # tail first: block 1 becomes older than block 0
    assert pool.num_free_blocks == 4
    order = [pool.allocate(1)[0].block_id for _ in range(4)]
    assert order == [2, 3, 1, 0]


def test_cached_block_is_reused_and_evicted_lru():
    pool = BlockPool(2, enable_caching=True)
    (b0,) = pool.allocate(1)
    pool.cache_block(b0, 123)
    pool.release([b0])
    assert pool.lookup(123) is b0  # freed but still cached
    pool.touch([b0])
    assert b0.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.release([b0])
    pool.allocate(2)  # needs every block: evicts the cached one
    assert pool.lookup(123) is None


def test_prefix_hit_needs_whole_chain_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.find_cached_prefix(a) == []
    assert kv.allocate(a, 10)
    a.num_computed_tokens = 10
    kv.free(a)
    b = req("b", list(range(8)) + [99, 98, 97])
    assert len(kv.find_cached_prefix(b)) == 2
    # Same first block, different second block: only the first hits (hash chains the parent).
    c = req("c", [0, 1, 2, 3, 50, 51, 52, 53, 9])
    assert len(kv.find_cached_prefix(c)) == 1
    # A prompt of exactly the cached 8 tokens reuses only 1 block: one token must be computed.
    d = req("d", list(range(8)))
    assert len(kv.find_cached_prefix(d)) == 1


def test_allocate_failure_changes_nothing_and_shared_blocks_are_refcounted():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = req("a", list(range(8)))
    assert kv.allocate(a, 8)
    a.num_computed_tokens = 8
    b = req("b", list(range(8)) + [7, 7, 7, 7])
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 2 and all(blk.ref_cnt == 1 for blk in hit)
    free_before = kv.num_free_blocks()
    assert not kv.allocate(b, 12, [])  # 3 blocks needed, 1 free
    assert kv.num_free_blocks() == free_before and kv.block_ids("b") == []
    assert kv.allocate(b, 4, hit)  # 2 shared + 1 new block
    assert all(blk.ref_cnt == 2 for blk in hit)
    kv.free(a)
    assert all(blk.ref_cnt == 1 for blk in hit) and kv.num_free_blocks() == 0
    kv.free(b)
    assert kv.num_free_blocks() == 3


def test_no_prefix_caching_means_no_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = req("a", list(range(9)))
    kv.allocate(a, 9)
    kv.free(a)
    assert kv.find_cached_prefix(req("b", list(range(9)))) == []


def test_hash_chains_parent():
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0]), [1, 2])
    assert hash_block(5, (1, 2)) == hash_block(5, [1, 2])


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    src = req("src", list(range(10)))  # blocks: [0-3] [4-7] [8-9 + room]
    assert kv.allocate(src, 10)
    src.num_computed_tokens = 10
    child = req("child", list(range(10)))
    copies = kv.fork(child, src, 9)  # share 9 tokens: 2 full blocks + 1 partial
    src_ids, child_ids = kv.block_ids("src"), kv.block_ids("child")
    assert child_ids[:2] == src_ids[:2] and child_ids[2] != src_ids[2]
    assert copies == [(src_ids[2], child_ids[2])]
    assert [b.ref_cnt for b in kv.req_blocks["src"]] == [2, 2, 1]
    # A block-aligned fork copies nothing; the child gets a fresh block for its next token.
    aligned = req("aligned", list(range(10)))
    assert kv.fork(aligned, src, 8) == [] and len(kv.block_ids("aligned")) == 3
    kv.free(src)
    kv.free(child)
    kv.free(aligned)
    assert kv.num_free_blocks() == 8


def test_fork_without_room_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    src = req("src", list(range(10)))
    assert kv.allocate(src, 10)
    child = req("child", list(range(10)))
    assert kv.fork(child, src, 9) is None
    assert kv.block_ids("child") == [] and [b.ref_cnt for b in kv.req_blocks["src"]] == [1, 1, 1]
