"""The engine's KV connector (as vLLM keeps its KV connector beside, not inside, its engine): everything about KV
blocks crossing to and from other engines, behind a narrow face the engine calls at fixed points.

- Out: a request with `kv_push_to` (a prefill engine's request from a decode engine's hop; the API has checked its
  hop token) has its prompt's blocks pushed when it finishes (`start_push`, a thread per push: the engine loop
  never waits on the network); its last output is held (`hold`) until the push has ended, so whoever sends the
  request on to the decode engine next finds the blocks there (`released`).
- In: with --kv-role decode|both, a receiver (tcp.py) takes batches from other engines into `_inbox`; the engine
  loop takes them into the offload tier between steps (`take_inbox`), and each batch's share of the receiver's
  in-flight bytes is freed then.
The endpoint's key (`--kv-secret-file`, keys.py) seals both directions; without one the receiver listens on
loopback only and no request may push.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable

from ..core.kv_cache import KVCacheManager, hash_block
from .keys import KVKey
from .tcp import REFUSAL_REASONS, KVReceiver, push_blocks
from .wire import BlockBatch, KVLayout

log = logging.getLogger("sluice.engine")

MAX_CONNECTIONS = 16  # concurrent connections a receiver serves (a prefill pool's engines each push one at a time)


class KVConnector:
    def __init__(self, cfg, kv: KVCacheManager, runner, served_model_name: str, key: KVKey | None,
                 on_device: Callable):
        """runner: rank 0's model runner (its cache layout, read_blocks, kv_tier); on_device(fn, *args) runs fn in
        the thread that owns the device work."""
        self.cfg, self.kv, self.runner, self.key = cfg, kv, runner, key
        self._on_device = on_device
        sh = runner.shard
        self.layout = KVLayout(served_model_name, str(runner.kv_cache_dtype).removeprefix("torch."), cfg.block_size,
                               sh.num_layers, sh.num_kv_heads, runner.model_config.head_dim)
        self._inbox: queue.Queue[BlockBatch] = queue.Queue()
        self.pushes: Counter = Counter()  # prompt-block pushes to other engines: ok, failed
        self._events = threading.Event()  # a push finished or a batch arrived: the metrics changed
        self._pushing: set[str] = set()
        self._held: dict[str, object] = {}
        self._pushed: queue.Queue[str] = queue.Queue()
        self.receiver = None
        if cfg.kv_role in ("decode", "both"):
            if kv.offload is None:
                raise ValueError(f"--kv-role {cfg.kv_role} takes blocks from prefill engines into the KV offload "
                                 "tier: set --kv-offload-bytes (and keep prefix caching on)")
            # In flight at most what the tier holds: a batch bigger than the tier could never be taken whole.
            tier_bytes = kv.offload.num_slots * self.layout.block_bytes()
            self.receiver = KVReceiver(cfg.kv_host, cfg.kv_port, self.layout, self.receive, key,
                                       max_blocks=kv.offload.num_slots, max_inflight_bytes=tier_bytes,
                                       max_connections=MAX_CONNECTIONS, timeout=cfg.kv_push_timeout,
                                       on_refusal=self._events.set)
            log.info("KV receiver (--kv-role %s) on %s:%d, %s", cfg.kv_role, cfg.kv_host, self.receiver.port,
                     "sealed with the endpoint's key" if key is not None else "no key: loopback only")

    # -- out: a finished request's prompt blocks to another engine --------------------------------
    def export_prefix(self, prompt_token_ids: list[int]) -> BlockBatch:
        """The blocks of a prompt that this engine's device cache holds, from its first block on (a prefix
        computed here, e.g. by a request that just ended), with their names. One rank only for now; base-model
        prompts (a LoRA adapter's blocks are named per process)."""
        if self.cfg.world_size > 1:
            raise ValueError("KV export runs with one rank only (tensor/pipeline parallel: not yet)")
        bs, names, blocks, parent = self.cfg.block_size, [], [], self.kv.names_root
        for i in range(len(prompt_token_ids) // bs):
            parent = hash_block(parent, prompt_token_ids[i * bs : (i + 1) * bs])
            block = self.kv.pool.lookup(parent)
            if block is None:
                break
            names.append(parent)
            blocks.append(block.block_id)
        data = self._on_device(self.runner.read_blocks, blocks)
        return BlockBatch(self.layout, names, data)

    def start_push(self, request_id: str, prompt_token_ids: list[int], push_to: str) -> None:
        """Push the finished request's prompt blocks (cached here, as it just ended) to `push_to` from a thread. A
        failed push is logged and counted; the receiving engine then computes the prompt itself."""
        batch = self.export_prefix(prompt_token_ids)
        if not batch.names:
            return
        host, _, port = push_to.rpartition(":")
        host = host.strip("[]")

        def push() -> None:
            try:
                push_blocks(host, int(port), batch, self.key, timeout=self.cfg.kv_push_timeout)
                self.pushes["ok"] += 1
            except Exception as e:  # noqa: BLE001 - any failure of a push is that push's: counted, never a hang
                self.pushes["failed"] += 1
                log.warning("KV push of request %s to %s failed: %s", request_id, push_to, e)
            finally:
                self._events.set()
                self._pushed.put(request_id)  # its held answer goes out (released)

        self._pushing.add(request_id)
        threading.Thread(target=push, name="kv-push", daemon=True).start()

    def hold(self, request_id: str, output) -> bool:
        """Keep a finished request's last output until its push has ended; False when it has no push running."""
        if request_id not in self._pushing:
            return False
        self._held[request_id] = output
        return True

    def released(self, wait: float = 0.0) -> list:
        """The held outputs of requests whose pushes have ended (acknowledged or failed)."""
        out: list = []
        if not self._pushing:
            return out
        while True:
            try:
                rid = self._pushed.get(timeout=wait) if wait and not out else self._pushed.get_nowait()
            except queue.Empty:
                break
            self._pushing.discard(rid)
            held = self._held.pop(rid, None)
            if held is not None:
                out.append(held)
        return out

    def has_held(self) -> bool:
        return bool(self._held)

    # -- in: batches from other engines, into the offload tier ------------------------------------
    def receive(self, batch: BlockBatch) -> int:
        """The receiver's thread: a batch of this engine's layout (the receiver checked it), queued for the engine
        loop. Returns how many blocks were queued."""
        self._inbox.put(batch)
        self._events.set()
        return len(batch.names)

    def idle_work(self) -> bool:
        """The engine loop's, between steps (idle too): take in the blocks other engines sent, and say whether
        anything the metrics show changed since the last call (blocks taken, pushes finished)."""
        changed = self._events.is_set()
        if changed:
            self._events.clear()
        self.take_inbox()
        return changed

    def take_inbox(self) -> None:
        """Blocks other engines sent: named in the tier's index, their data written into the slots (on the device
        thread, after any step in flight, before the next). Called before every schedule: nothing to do is cheap."""
        while not self._inbox.empty():
            try:
                batch = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                slots, rows = [], []
                for i, name in enumerate(batch.names):
                    if self.kv.pool.lookup(name) is not None:
                        continue  # on the device already
                    slot = self.kv.offload.insert(name)
                    if slot is not None:
                        slots.append(slot)
                        rows.append(i)
                if slots:
                    self._on_device(self.runner.kv_tier.write, slots, batch.data[rows])
            finally:
                if batch.release is not None:
                    batch.release()

    def stats(self) -> dict:
        r = self.receiver
        return dict(kv_pushes=dict(self.pushes),
                    kv_receiver_refusals={k: r.refusals.get(k, 0) for k in REFUSAL_REASONS} if r is not None else {},
                    kv_receiver_inflight_bytes=r.inflight_bytes if r is not None else 0)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
