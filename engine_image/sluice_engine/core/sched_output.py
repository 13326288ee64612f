"""The step as plain data: what the scheduler decided, and all a model runner needs to run it.

Plain ints, lists and strings only (no Request, no tensors), so rank 0 can send it to every other
rank (executor/executor.py) and a worker runs its shard of the forward from this object alone, as
vLLM V1's `core/sched/output.py` does. Sampling state stays on rank 0 with the requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .lora_slots import LoRARef

# A token id not known yet when the step was scheduled (async scheduling): the token the previous step samples
# for this request. The model runner reads it from that step's sampled tokens on the device.
PLACEHOLDER = -1


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # computed this step: the next known tokens (the last may be a PLACEHOLDER), then the drafts
    start: int  # position of token_ids[0]: the request's num_computed_tokens
    block_ids: list[int]  # its block table, covering every position up to start + len(token_ids)
    num_drafts: int = 0  # speculative tokens at the end of token_ids, verified by the sampler
    samples: bool = True  # the step reaches the end of the known tokens: a next token is sampled
    prompt_logprobs: bool = False  # logits of every row are needed (prompt logprobs)
    lora_slot: int = 0  # the device slot of the request's LoRA adapter (0: the base model)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def logits_rows(self) -> int:
        """How many of this request's rows (its last ones) are projected to logits this step."""
        if self.num_drafts:
            return self.num_drafts + 1
        if self.prompt_logprobs:
            return self.num_tokens
        return 1 if self.samples else 0


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # batch order
    preempted: list[str] = field(default_factory=list)  # request ids preempted (by recompute) this step
    # KV blocks to copy (src block id, dst block id) before the forward: a forked request's own copy
    # of its source's partial last prompt block (copy-on-write at fork time).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Requests whose blocks were freed (finished, aborted, preempted) since the last step that ran: a
    # runner drops what it keeps for them (their block-table rows, worker/input_buffers.py) before this step.
    freed_req_ids: list[str] = field(default_factory=list)
    # LoRA adapters to load into their device slots before this step's forward: (slot, adapter).
    lora_loads: list[tuple[int, LoRARef]] = field(default_factory=list)
    # LoRA adapters unloaded since the last step that ran: every rank drops its host copy.
    lora_drops: list[LoRARef] = field(default_factory=list)
    # The KV offload tier (core/kv_offload.py), before anything else in the step: evicted cached blocks copied
    # out to tier slots (device block id, tier slot), then tier slots copied into fresh blocks (tier slot, block).
    kv_stores: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def logits_layout(self) -> tuple[list[int], list[int]]:
        """(hidden-state rows projected to logits, in order; per request, its first row among them)."""
        rows: list[int] = []
        firsts: list[int] = []
        base = 0
        for s in self.scheduled:
            k = s.logits_rows()
            firsts.append(len(rows))
            rows.extend(range(base + s.num_tokens - k, base + s.num_tokens))
            base += s.num_tokens
        return rows, firsts
