"""Paged KV cache bookkeeping: a pool of fixed-size blocks with an O(1) LRU free list and a prefix
cache keyed by chained block hashes, plus the per-request block tables built on top of it.

The tensors themselves live in the model runner; this module only hands out block ids.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .kv_offload import OffloadIndex
from .request import Request


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Hash of (parent block hash, this block's token ids) once the block is full and cached.
    block_hash: int | None = None
    # Links of the doubly linked free list (None when not in it).
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks. Front = least recently freed = evicted first.

    NOTE: a free block can still hold cached KV; a prefix hit takes it out of the middle of the
    queue, so removal must be O(1) -- hence links in the blocks rather than a deque.
    """

    def __init__(self, blocks: Sequence[KVBlock]):
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block not in free queue"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(first)
        return first


def hash_block(parent_hash: int | None, token_ids: Iterable[int]) -> int:
    """A block's name: 64 bits of BLAKE2b over its parent's name and its token ids. Chaining the parent makes a
    hit imply the whole prefix matched. The same in every process (engines exchange blocks by name:
    kv_transfer/), which Python's own hash is not: hash(None) is the object's address before Python 3.12."""
    h = hashlib.blake2b(b"\0" if parent_hash is None else b"\1" + parent_hash.to_bytes(8, "little", signed=True),
                        digest_size=8)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def _root(request: Request, names_root: int | None) -> int | None:
    """The parent of a request's first block: `names_root` (keyed by the endpoint's KV key, so names cannot be
    computed without it: kv_transfer/keys.py; None without a key), and for a prefix computed under a LoRA adapter
    that adapter's (it changes k and v), never a hit for another adapter or for the base model."""
    if request.lora is None:
        return names_root
    return hash_block(names_root, [request.lora.id, -1])


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool):
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        self.cached: dict[int, KVBlock] = {}
        self.offload: OffloadIndex | None = None  # where evicted cached blocks go (--kv-offload-bytes)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free ones, including evictable cached ones)."""
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.free_queue.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # evict its cached content (LRU: oldest freed first)
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                    if self.offload is not None:  # saved to the tier before this step overwrites it
                        self.offload.store(block.block_hash, block.block_id)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; a block reaching zero goes to the back of the free queue, keeping its
        cached content until it is evicted. Callers pass a request's blocks tail first so that the
        end of a sequence is evicted before its (more shareable) beginning."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} released too often"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: int) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        # Keep the first copy when two requests computed the same block; the second stays private.
        self.cached.setdefault(block_hash, block)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.offload is not None:
            self.offload.clear()


class KVCacheManager:
    """Block tables per request on top of the block pool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 offload_blocks: int = 0, names_root: int | None = None):
        """offload_blocks: the offload tier's size in blocks (--kv-offload-bytes; 0: no tier). It keeps the
        prefix cache's evicted blocks, so it needs prefix caching. names_root: the parent of every prompt's first
        block name (the endpoint's KV key's: kv_transfer/keys.py), None without a key."""
        self.block_size = block_size
        self.names_root = names_root
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.offload = OffloadIndex(offload_blocks) if offload_blocks and enable_prefix_caching else None
        self.pool.offload = self.offload
        self.offload_hits = 0  # prompt tokens loaded from the tier (also counted in prefix_hits)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[int]] = {}  # hashes of the request's full blocks, in order
        # Prefix-cache statistics in tokens (queries = prompt tokens looked up).
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def new_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """The fresh blocks `allocate(request, num_new_tokens)` would take from the pool for a running request."""
        held = len(self.req_blocks.get(request.request_id, ()))
        return max(self.blocks_needed(request.num_scheduled_tokens + num_new_tokens) - held, 0)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def _block_hashes(self, request: Request, upto_tokens: int) -> list[int]:
        """Hashes of the request's full blocks within its first `upto_tokens` tokens (memoised)."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= upto_tokens:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else _root(request, self.names_root), tokens[i * bs : (i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest chain of cached blocks matching the request's tokens.

        At least one token is always left to compute: its logits are what the step samples from.
        """
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []
        hashes = self._block_hashes(request, request.num_tokens - 1)
        hit: list[KVBlock] = []
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def find_offloaded(self, request: Request, num_device_hits: int) -> list[int]:
        """The names of the request's blocks after its device hits that the offload tier holds, in order (to
        be loaded into fresh blocks by `allocate`)."""
        if self.offload is None or not len(self.offload) or request.params.prompt_logprobs is not None:
            return []
        names = self._block_hashes(request, request.num_tokens - 1)[num_device_hits:]
        return names[: self.offload.lookup(names)]

    def allocate(self, request: Request, num_new_tokens: int, cached_prefix: Sequence[KVBlock] = (),
                 offloaded: Sequence[int] = ()) -> bool:
        """Make room for `num_new_tokens` more computed tokens, after a new request's `cached_prefix` (device
        hits) and `offloaded` blocks (tier hits: loaded into fresh blocks with this step). Returns False
        (changing nothing) if the pool cannot supply the blocks."""
        blocks = self.req_blocks.get(request.request_id)
        if blocks is None:
            blocks = []
        num_computed = request.num_scheduled_tokens + (len(cached_prefix) + len(offloaded)) * self.block_size
        total = num_computed + num_new_tokens
        need = self.blocks_needed(total) - len(blocks) - len(cached_prefix)
        # Cached blocks sitting in the free queue are not available for new allocations once touched.
        evictable_hits = sum(1 for b in cached_prefix if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - evictable_hits:
            return False
        if cached_prefix:
            self.pool.touch(cached_prefix)
            blocks.extend(cached_prefix)
        if need > 0:
            fresh = self.pool.allocate(need)
            for name, block in zip(offloaded, fresh, strict=False):
                self.offload.load(name, block.block_id)
            blocks.extend(fresh)
        self.offload_hits += len(offloaded) * self.block_size
        self.req_blocks[request.request_id] = blocks
        if self.enable_prefix_caching:
            # NOTE: the blocks filled by this step are registered now, before the forward writes
            # them. That is safe: a request hitting them is batched into the same or a later step,
            # and every layer writes the whole batch's K/V before any attention reads it.
            # Only known tokens are hashed: draft tokens (speculative decoding) may be rejected, and a
            # placeholder (async scheduling) is hashed by a later step, once its token is known.
            hashes = self._block_hashes(request, min(total, request.num_tokens))
            for block, h in zip(blocks, hashes, strict=False):
                self.pool.cache_block(block, h)
        return True

    def fork(self, child: Request, source: Request, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give `child` the KV of `source`'s first `num_tokens` tokens (the same prompt) plus room for
        one more token: full blocks are shared (reference-counted), the partial last block is copied
        into a fresh block (copy-on-write at fork time: the source keeps appending to its own).
        Returns the (src, dst) block copies for the runner, or None (changing nothing) if the pool
        cannot supply the fresh blocks."""
        bs = self.block_size
        src_blocks = self.req_blocks[source.request_id]
        num_full = num_tokens // bs
        need = self.blocks_needed(num_tokens + 1) - num_full
        if need > self.pool.num_free_blocks:
            return None
        shared = src_blocks[:num_full]
        self.pool.touch(shared)
        fresh = self.pool.allocate(need)
        copies = [(src_blocks[num_full].block_id, fresh[0].block_id)] if num_tokens % bs else []
        self.req_blocks[child.request_id] = shared + fresh
        if source.request_id in self.req_hashes:  # same tokens, same chained hashes
            self.req_hashes[child.request_id] = self.req_hashes[source.request_id][:num_full]
        return copies

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, None)
        self.req_hashes.pop(request.request_id, None)
        if blocks:
            self.pool.release(reversed(blocks))

    def usage(self) -> float:
        return self.pool.usage()

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
