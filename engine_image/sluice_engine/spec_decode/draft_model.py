"""Draft-model speculation: a smaller model of the same tokenizer proposes the next k tokens greedily,
batched over every request that speculates this step, in k short forwards over its own paged KV cache.

The draft keeps a shadow of each request: the tokens whose KV its cache holds. Each round it first
catches up on what the target accepted since the last round (the whole prompt the first time; the
bonus token, plus the last draft when every draft was accepted, afterwards), which yields the first
draft; each further forward feeds one draft and yields the next. Rejected drafts roll back by counter,
as in the target: the shadow keeps the prefix that still matches the request and later rounds
overwrite the rest.

Greedy drafts are a deterministic function of the context, so the verifier treats them exactly like
n-gram drafts (a one-hot proposal distribution) and the output distribution stays the target's.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..core.kv_cache import KVCacheManager
from ..core.request import Request
from ..core.sched_output import ScheduledRequest, SchedulerOutput
from ..draft_interface import DraftQuery
from ..forward_context import ForwardContext, forward_context
from ..model_config import ModelConfig
from ..models.loader import checkpoint_quantization, load_model
from ..quant.formats import check_device as check_quant_device
from ..sampling_params import SamplingParams
from ..worker.input_buffers import InputBuffers
from ..worker.memory_meter import PeakMeter, dummy_step

log = logging.getLogger("sluice.engine")


class DraftModelProposer:
    name = "draft"

    def __init__(self, model_dir: Path, k: int, *, backend, device: torch.device, dtype: torch.dtype,
                 block_size: int, max_positions: int, target_vocab_size: int, max_forward_tokens: int,
                 max_num_seqs: int):
        self.k = k
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_positions = max_positions
        # A catch-up longer than this is fed in several forwards: the draft's activations were
        # profiled at this many tokens (worker/memory_profile.py), --max-num-batched-tokens, as the target's.
        self.max_forward_tokens = max_forward_tokens
        self.model_config = mc = ModelConfig.from_dir(model_dir)
        if mc.vocab_size > target_vocab_size:
            raise ValueError(f"--draft-model {model_dir}: its vocabulary ({mc.vocab_size}) is larger than the "
                             f"target's ({target_vocab_size}); draft and target must share a tokenizer")
        # A draft checkpoint quantized for the GPU formats (config.json quantization_config) is served in its
        # format, as a target would be with --quantization auto.
        quantization = checkpoint_quantization(model_dir) or "none"
        if quantization != "none":
            check_quant_device(quantization, device.type, backend.name)
        self.model = load_model(model_dir, mc, backend, device, dtype, max_positions, quantization=quantization)
        # The cache comes once the memory is sized (allocate_kv_cache), out of the target's budget.
        self.kv_caches: list[torch.Tensor] = []
        self.kv: KVCacheManager | None = None
        self._shadows: dict[str, Request] = {}
        # Persistent inputs as the target's (worker/input_buffers.py), one block-table row per shadow. The buffers
        # grow on demand if a forward is larger (the draft is never captured in a graph).
        self.max_num_seqs = max_num_seqs
        self.inputs = self._new_inputs()
        self._released: list[str] = []  # shadows freed since the last forward: their rows go back first

    def _new_inputs(self) -> InputBuffers:
        return InputBuffers(max_tokens=self.max_forward_tokens, max_rows=self.max_num_seqs,
                            max_model_len=self.max_positions, block_size=self.block_size, device=self.device)

    # -- memory --------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        mc = self.model_config
        return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * self.dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """As many blocks as the target's cache (memory_profile.plan_kv_cache sizes both from one
        budget), so the draft never runs out of room before the target does."""
        self.kv_caches = self._new_kv_cache(num_blocks)
        # No prefix caching: shadows hold drafts that were never verified, which must not be shared.
        self.kv = KVCacheManager(num_blocks, self.block_size, enable_prefix_caching=False)
        log.info("draft model: %d layers, KV cache %d blocks (%.1f MiB)", self.model_config.num_layers, num_blocks,
                 num_blocks * self.block_size * self.kv_bytes_per_token / 2**20)

    @torch.inference_mode()
    def profile_step_peak(self, num_seqs: int) -> int:
        """The activation peak of the draft's largest forward (worker/memory_profile.py): a catch-up of
        max_forward_tokens tokens over `num_seqs` speculating requests, over a scratch cache."""
        step = dummy_step(max(self.max_forward_tokens, num_seqs), num_seqs, self.block_size, self.max_positions,
                          every_row=False)
        assert not self.kv_caches, "the memory profile runs before the KV cache is allocated"
        self.kv_caches = self._new_kv_cache(step.num_blocks)
        try:
            with PeakMeter(self.device) as meter:
                self._run(step.sched.scheduled)
        finally:
            self.kv_caches = []
            self.inputs = self._new_inputs()  # the dummy sequences' block-table rows go with them
        return meter.peak

    def _new_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        mc = self.model_config
        shape = (2, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_layers)]

    # -- the proposer interface ----------------------------------------------------------------
    @torch.inference_mode()
    def propose_batch(self, queries: list[DraftQuery]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in queries]
        # Forward 0: catch up and draft one token.
        feeds: list[tuple[int, Request, int]] = []  # (query index, shadow, tokens fed)
        for i, q in enumerate(queries):
            if q.max_tokens < 1:
                continue
            shadow = self._sync(q)
            fed = shadow.num_tokens - shadow.num_computed_tokens
            # Room for everything this round feeds: the catch-up and all drafts but the last.
            if not self.kv.allocate(shadow, fed + min(self.k, q.max_tokens) - 1):
                self.release(q.request_id)  # the draft cache is full: this request goes without
                continue
            feeds.append((i, shadow, fed))
        feeds = self._catch_up(feeds)
        while feeds:
            next_ids = self._forward(feeds)
            still: list[tuple[int, Request, int]] = []
            for (i, shadow, fed), token in zip(feeds, next_ids, strict=True):
                shadow.num_computed_tokens += fed
                drafts[i].append(token)
                if len(drafts[i]) < min(self.k, queries[i].max_tokens):
                    shadow.all_token_ids.append(token)
                    still.append((i, shadow, 1))
            feeds = still
        return drafts

    def release(self, request_id: str) -> None:
        shadow = self._shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)
            self._released.append(request_id)

    # -- internals -----------------------------------------------------------------------------
    def _sync(self, q: DraftQuery) -> Request:
        """The request's shadow, rolled back to the longest prefix its cache shares with the request."""
        shadow = self._shadows.get(q.request_id)
        if shadow is None:
            shadow = Request(q.request_id, [], SamplingParams(max_tokens=1))
            self._shadows[q.request_id] = shadow
        held = shadow.all_token_ids[: shadow.num_computed_tokens]
        valid = 0
        # Tokens never change once known, so only the tail (drafts of the last round) can differ;
        # a shadow longer than the request means the request was replaced under the same id.
        if len(held) <= len(q.token_ids):
            valid = len(held)
            for j in range(max(0, len(held) - self.k - 1), len(held)):
                if held[j] != q.token_ids[j]:
                    valid = j
                    break
        shadow.all_token_ids = list(q.token_ids)
        # At least the last token is fed: its logits give the first draft.
        shadow.num_computed_tokens = min(valid, len(q.token_ids) - 1)
        return shadow

    def _catch_up(self, feeds: list[tuple[int, Request, int]]) -> list[tuple[int, Request, int]]:
        """Feed long catch-ups (a whole prompt, the first time) in forwards of at most
        max_forward_tokens tokens, without logits, until the rest fits one forward; the feeds left
        (each still ending on its last token, whose logits give the first draft)."""
        while sum(fed for _, _, fed in feeds) > self.max_forward_tokens:
            room = self.max_forward_tokens
            chunk: list[tuple[int, Request, int]] = []
            rest: list[tuple[int, Request, int]] = []
            for i, shadow, fed in feeds:
                n = min(fed - 1, room)
                if n > 0:
                    chunk.append((i, shadow, n))
                    room -= n
                rest.append((i, shadow, fed - n))
            if not chunk:
                break  # every feed is down to its last token: more speculating requests than tokens
            self._forward(chunk, sample=False)
            for _, shadow, n in chunk:
                shadow.num_computed_tokens += n
            feeds = rest
        return feeds

    def _forward(self, feeds: list[tuple[int, Request, int]], sample: bool = True) -> list[int]:
        """One draft forward over `fed` new tokens of each shadow; the greedy next token of each
        (none when not `sample`)."""
        scheduled = []
        for _, shadow, fed in feeds:
            start = shadow.num_computed_tokens
            scheduled.append(ScheduledRequest(shadow.request_id, shadow.all_token_ids[start : start + fed], start,
                                              self.kv.block_ids(shadow.request_id), samples=sample))
        return self._run(scheduled)

    def _run(self, scheduled: list[ScheduledRequest]) -> list[int]:
        rows, _ = SchedulerOutput(scheduled).logits_layout()  # each sampling shadow's last row: its next token
        # NOTE: shadows outlive their requests' preemption (a preempted request keeps its draft KV), so
        # there may be more of them than block-table rows: idle shadows give theirs up (evict_idle).
        inp = self.inputs.prepare(scheduled, rows, self._released, evict_idle=True)
        self._released.clear()
        with forward_context(ForwardContext(inp.attn, self.kv_caches)):
            hidden = self.model(inp.input_ids, inp.positions)
        if not rows:
            return []
        logits = self.model.compute_logits(hidden[inp.logits_rows])
        return logits.argmax(dim=-1).tolist()
