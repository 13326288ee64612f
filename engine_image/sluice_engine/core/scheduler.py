"""Continuous batching with one token budget per step (vLLM V1 style).

A step is `{request_id: number of tokens to compute}`. Running requests go first, then waiting ones,
until `max_num_batched_tokens` is spent; a long prompt simply gets a chunk this step and the rest in
later steps. When blocks run out, the most recently admitted running request is preempted by
recompute: its blocks are freed and it goes back to the front of the queue.

With pipeline parallelism the requests are split over `num_virtual` virtual engines (one per stage, as
vLLM's virtual engines): each step schedules one of them, so while its micro-batch is in flight the next
step schedules another, disjoint set and every stage has work. A request stays on its virtual engine;
a new one joins the least loaded; preemption only ever takes from the virtual engine being scheduled
(never a request whose step is still in flight). Each virtual engine may run max_num_seqs / num_virtual.

Priority (--scheduling-policy priority, vLLM's semantics: a lower `Request.priority` is served earlier): the
waiting queue and the running list are both kept sorted by (priority, arrival), by binary insertion, so every
place above that reads "front of the queue" or "most recently admitted" reads "most urgent" and "least urgent"
instead: running requests are stepped most urgent first, and a request that runs out of blocks preempts the least
urgent running one (the latest arrival of the worst priority, never one more urgent than itself). Before a step,
if the most urgent waiting request would not fit (no batch slot, no token budget, no blocks), running requests of
a strictly worse priority are preempted, least urgent first, until it fits or none is left; requests of equal
priority never preempt each other, so among them it is first come, first served. With fcfs nothing of this runs.

Async scheduling: a step may be scheduled while the previous one is still in flight. A request's next
step starts after the tokens in flight (`num_scheduled_tokens`), and the token its step in flight will
sample is a PLACEHOLDER in the new step's input (the runner takes it from that step's sampled tokens on the
device). A request whose tokens in flight may already reach its length limit waits for them instead.
"""

from __future__ import annotations

import bisect
import time
from collections import deque

from .kv_cache import KVCacheManager
from .lora_slots import LoRARef, LoRASlotTable
from .request import FinishReason, Request, RequestStatus
from .sched_output import PLACEHOLDER, ScheduledRequest, SchedulerOutput


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, num_virtual: int = 1,
                 max_model_len: int | None = None, lora_slots: LoRASlotTable | None = None, policy: str = "fcfs"):
        self.kv = kv
        self.by_priority = policy == "priority"
        self.max_model_len = max_model_len
        self.lora_slots = lora_slots  # None: LoRA off
        self.num_virtual = num_virtual
        self.max_num_seqs = max(1, -(-max_num_seqs // num_virtual))  # per virtual engine
        self._load = [0] * num_virtual  # unfinished requests per virtual engine
        self.max_num_batched_tokens = max_num_batched_tokens
        # fcfs: waiting in arrival order (preempted requests at the front), running in admission order. priority:
        # both sorted by _urgency (a list: binary insertion; deleting from it is O(n), as from the deque).
        self.waiting: deque[Request] | list[Request] = [] if self.by_priority else deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Requests whose blocks were freed since the last step that ran (SchedulerOutput.freed_req_ids).
        self._freed: list[str] = []
        # LoRA adapters to load into slots with the next step that runs (SchedulerOutput.lora_loads), in order.
        self._lora_loads: list[tuple[int, LoRARef]] = []
        self._lora_drops: list[LoRARef] = []

    def note_freed(self, request_ids: list[str]) -> None:
        """Sequences that ran outside the scheduler (warm-up's dummy steps): the next step tells the model
        runners to release their block-table rows, as for requests it freed itself."""
        self._freed.extend(request_ids)

    def take_freed(self) -> list[str]:
        """The requests freed since the last step that ran; the step that takes them releases their rows."""
        freed, self._freed = self._freed, []
        return freed

    # -- queue ---------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.virtual_engine = min(range(self.num_virtual), key=self._load.__getitem__)
        self._load[request.virtual_engine] += 1
        self.requests[request.request_id] = request
        if self.by_priority:
            bisect.insort(self.waiting, request, key=_urgency)  # after its equals: arrival order among them
        else:
            self.waiting.append(request)

    def has_work_on(self, ve: int) -> bool:
        return any(r.virtual_engine == ve for r in self.running) or any(r.virtual_engine == ve for r in self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def prompt_tokens_pending(self) -> int:
        """Prompt tokens of waiting and running requests not computed yet: the prefill backlog (a prefill pool's
        scaling signal; prefix hits count once they are found)."""
        return sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in (*self.waiting, *self.running))

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Finish a request (done, aborted or failed) and give its blocks back."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._release_lora(request)
        self.kv.free(request)
        self._freed.append(request.request_id)
        self.requests.pop(request.request_id, None)
        self._load[request.virtual_engine] -= 1

    # -- the request state it owns: the engine reports, the scheduler writes --------------------------
    def set_drafts(self, request: Request, drafts: list[int]) -> None:
        """A proposer's guesses for the request's next tokens, scheduled for verification next step."""
        request.spec_token_ids = drafts

    def update_from_output(self, request: Request, num_scheduled: int, num_rejected: int, sampled: bool) -> int:
        """A step's result for the request: its `num_scheduled` tokens are in the cache but for the
        `num_rejected` drafts at the end (the counter stops before their slots; later steps overwrite them);
        `sampled`: the step sampled a token (the caller appends it). The drafts are spent either way. Returns how
        many drafts the step verified.

        A request preempted while this step was in flight (async scheduling) starts again from 0: its token
        still counts (the caller appends it: the same token a step run alone would have given before the
        preemption), its counters do not."""
        if request.status is RequestStatus.RUNNING:
            request.num_computed_tokens += num_scheduled - num_rejected
            request.num_in_flight_tokens -= num_scheduled
            request.num_output_placeholders -= sampled
        num_drafts = len(request.spec_token_ids)
        if num_drafts:
            request.spec_token_ids = []
        return num_drafts

    # -- one step ------------------------------------------------------------------------------
    def schedule(self, ve: int = 0) -> SchedulerOutput:
        """One step for virtual engine `ve` (the only one without pipeline parallelism)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.monotonic()
        # Requests preempted for a more urgent waiting one: not readmitted in this step (they would thrash).
        made_room = self._make_room(ve, out) if self.by_priority and self.waiting else frozenset()

        i = 0
        thrashed = False  # a running request lacked blocks: nothing is admitted this step
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.virtual_engine != ve:  # another virtual engine's (with one, every request is on 0)
                i += 1
                continue
            num_new = min(req.num_tokens + req.num_output_placeholders - req.num_scheduled_tokens, budget)
            if num_new <= 0 or self._may_be_done(req):  # nothing to do / its step in flight may end it
                i += 1
                continue
            if req.spec_token_ids:
                # Drafts ride along after the last known token, as far as the budget allows.
                del req.spec_token_ids[budget - num_new :]
                num_new += len(req.spec_token_ids)
            while not self.kv.allocate(req, num_new):
                thrashed = True
                victim = self._pop_victim(ve)  # most recently admitted (priority: least urgent) of this virtual engine
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.scheduled.append(self._plain(req, num_new))
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted; everything after it already was

        # Admit waiting requests only if no running request lacked blocks this step (they would thrash).
        running = len(self.running) if self.num_virtual == 1 else sum(r.virtual_engine == ve for r in self.running)
        idx = 0
        while idx < len(self.waiting) and budget > 0 and running < self.max_num_seqs and not thrashed:
            req = self.waiting[idx]
            if req.virtual_engine != ve or req in made_room:
                idx += 1
                continue
            fork = self._fork_state(req)
            if fork == "wait":
                idx += 1  # its source is still computing the shared prompt; later requests may pass
                continue
            if not self._acquire_lora(req, out):
                idx += 1  # every adapter slot is held by running requests of other adapters: it waits
                continue
            if fork == "now":
                copies = self.kv.fork(req, req.fork_source, req.num_prompt_tokens - 1)
                if copies is None:
                    self._release_lora(req)
                    break
                del self.waiting[idx]
                req.num_computed_tokens = req.num_prompt_tokens - 1
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = req.num_computed_tokens
                out.block_copies.extend(copies)
                self._admit(req, 1, now, out)
                running += 1
                budget -= 1
                continue
            cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            offloaded = self.kv.find_offloaded(req, len(cached)) if req.num_computed_tokens == 0 else []
            num_cached = (len(cached) + len(offloaded)) * self.kv.block_size
            num_new = min(req.num_tokens - req.num_computed_tokens - num_cached, budget)
            if not self.kv.allocate(req, num_new, cached, offloaded):
                self._release_lora(req)
                break
            del self.waiting[idx]
            if req.num_cached_tokens < 0:  # first admission: report prefix-cache use once
                req.num_cached_tokens = num_cached
                self.kv.prefix_queries += req.num_prompt_tokens
                self.kv.prefix_hits += num_cached
            req.num_computed_tokens += num_cached
            self._admit(req, num_new, now, out)
            running += 1
            budget -= num_new
        if out.scheduled:
            # NOTE: only a step that runs reaches the runners (an empty one is dropped), so the list waits
            # for one; the runner releases these before taking rows for this step's requests.
            out.freed_req_ids = self.take_freed()
            out.lora_loads, self._lora_loads = self._lora_loads, []
            out.lora_drops, self._lora_drops = self._lora_drops, []
            if self.kv.offload is not None:
                out.kv_stores, out.kv_loads = self.kv.offload.take()
        return out

    def forget_lora(self, ref: LoRARef) -> None:
        """An adapter unloaded, no request left on it: its slot is free, and every rank drops it with the next step."""
        self.lora_slots.forget(ref)
        self._lora_drops.append(ref)

    def _acquire_lora(self, req: Request, out: SchedulerOutput) -> bool:
        if self.lora_slots is None or req.lora is None:
            req.lora_slot = 0
            return True
        slot = self.lora_slots.acquire(req.lora, self._lora_loads)
        req.lora_slot = slot
        return slot is not None

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot and self.lora_slots is not None:
            self.lora_slots.release(req.lora)
        req.lora_slot = None

    def _may_be_done(self, req: Request) -> bool:
        """Its tokens in flight reach the request's length limit: it ends when they are back."""
        ph = req.num_output_placeholders
        if not ph:
            return False
        over_len = self.max_model_len is not None and req.num_tokens + ph >= self.max_model_len
        return req.num_output_tokens + ph >= req.params.max_tokens or over_len

    def _pop_victim(self, ve: int) -> Request:
        for j in range(len(self.running) - 1, -1, -1):
            if self.running[j].virtual_engine == ve:
                return self.running.pop(j)
        raise AssertionError("no running request of this virtual engine to preempt")

    def _fork_state(self, req: Request) -> str:
        """'now': share the source's prompt KV; 'wait': the source will have it soon; 'no': prefill."""
        src = req.fork_source
        if src is None or req.num_computed_tokens != 0:
            return "no"
        if src.is_finished:
            req.fork_source = None
            return "no"
        if src.status is RequestStatus.RUNNING and src.num_computed_tokens >= req.num_prompt_tokens - 1:
            return "now"
        return "wait"

    def _admit(self, req: Request, num_new: int, now: float, out: SchedulerOutput) -> None:
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        if self.by_priority:
            bisect.insort(self.running, req, key=_urgency)
        else:
            self.running.append(req)
        out.scheduled.append(self._plain(req, num_new))

    def _plain(self, req: Request, num_new: int) -> ScheduledRequest:
        """The step's part of one request as plain data (its blocks are allocated by now); its tokens count as in
        flight until update_from_output."""
        start = req.num_scheduled_tokens
        drafts = req.spec_token_ids
        known_end = start + num_new - len(drafts)
        tokens = req.all_token_ids[start:known_end]  # all_token_ids ends where the drafts begin
        if known_end > req.num_tokens:  # the token the step in flight samples (at most one: one step ahead)
            tokens += [PLACEHOLDER] * (known_end - max(start, req.num_tokens))
        samples = known_end == req.num_tokens + req.num_output_placeholders
        req.num_in_flight_tokens += num_new
        req.num_output_placeholders += samples
        return ScheduledRequest(
            req.request_id, tokens + drafts, start, self.kv.block_ids(req.request_id), len(drafts),
            samples=samples,
            prompt_logprobs=req.params.prompt_logprobs is not None and start < req.num_prompt_tokens,
            lora_slot=req.lora_slot or 0,
        )

    def _preempt(self, req: Request) -> None:
        self._release_lora(req)
        self.kv.free(req)
        self._freed.append(req.request_id)
        req.spec_token_ids.clear()
        req.num_computed_tokens = 0
        req.num_in_flight_tokens = req.num_output_placeholders = 0  # a step in flight still brings its token
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            bisect.insort(self.waiting, req, key=_urgency)  # back to its place: its priority, then its arrival
        else:
            self.waiting.appendleft(req)

    # -- priority ------------------------------------------------------------------------------
    def _make_room(self, ve: int, out: SchedulerOutput) -> frozenset[Request]:
        """Before a step (priority policy): if the most urgent waiting request of `ve` would not be admitted by it
        (no batch slot, no token budget left after the running requests, too few free blocks for its first chunk
        and the running requests' next tokens), preempt running requests of a strictly worse priority, least
        urgent first (the end of the sorted running list), until it would or none is left. Returns the preempted.

        NOTE: done before anything is scheduled, never after: a request scheduled in this step has its new blocks
        registered in the prefix cache already (KVCacheManager.allocate), and preempting it then would free
        blocks named for KV that no forward wrote. The estimate leaves out LoRA slots and drafts trimmed by the
        budget; where it is short, the running requests preempt as under fcfs and no one is admitted this step.
        O(running + waiting of ve) per step."""
        head = next((r for r in self.waiting if r.virtual_engine == ve), None)
        if head is None or self._fork_state(head) == "wait":
            return frozenset()
        mine = [r for r in self.running if r.virtual_engine == ve]
        if not mine or mine[-1].priority <= head.priority:
            return frozenset()  # nobody less urgent runs: the head waits for its turn as under fcfs
        # What each running request takes this step if it runs (tokens, new blocks), as the running loop gives it.
        need_tokens = [self._tokens_wanted(r) for r in mine]
        need_blocks = [self.kv.new_blocks_needed(r, n) for r, n in zip(mine, need_tokens, strict=True)]
        tokens, blocks = sum(need_tokens), sum(need_blocks)
        cached = self.kv.find_cached_prefix(head) if head.num_computed_tokens == 0 else []
        head_left = head.num_tokens - head.num_computed_tokens - len(cached) * self.kv.block_size
        victims: list[Request] = []
        while mine and mine[-1].priority > head.priority:
            chunk = min(head_left, self.max_num_batched_tokens - tokens)
            head_blocks = self.kv.blocks_needed(head.num_computed_tokens + len(cached) * self.kv.block_size + chunk)
            head_blocks -= len(cached)
            if (len(mine) < self.max_num_seqs and chunk > 0
                    and blocks + head_blocks <= self.kv.num_free_blocks() - sum(b.ref_cnt == 0 for b in cached)):
                break
            victim = mine.pop()
            tokens -= need_tokens.pop()
            blocks -= need_blocks.pop()
            self.running.remove(victim)  # at or near the end: the least urgent
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            victims.append(victim)
        return frozenset(victims)

    def _tokens_wanted(self, req: Request) -> int:
        """The tokens the running loop would give `req` with the whole budget (its drafts included)."""
        num_new = req.num_tokens + req.num_output_placeholders - req.num_scheduled_tokens
        if num_new <= 0 or self._may_be_done(req):
            return 0
        return min(num_new, self.max_num_batched_tokens) + len(req.spec_token_ids)


def _urgency(req: Request) -> tuple[int, float]:
    """The priority policy's order: lower priority values first, then earlier arrivals."""
    return req.priority, req.arrival_time
