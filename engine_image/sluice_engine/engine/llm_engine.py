"""The synchronous engine: requests in, one step at a time, output deltas out.

`LLMEngine.step()` schedules, runs one forward, appends sampled tokens, ends requests at their stop tokens or
length, frees finished requests, and (unless `detokenize` is off) turns the token deltas into text deltas
with the output processor (engine/output_processor.py: detokenization and stop strings). The engine loop and the
offline `LLM` drive it; an engine-core process runs it with `detokenize` off and its API process makes the
text.

Async scheduling (one rank; by default on CUDA): the step's device work (inputs, forward, sampling) runs in a step
thread (engine/step_thread.py) and the next step is scheduled and queued before this one's outputs are applied,
so the engine's host work (scheduling, applying outputs, publishing them) runs while the device computes. The
token a step in flight will sample is a placeholder in the next step's input (core/scheduler.py), copied on the
device from the sampled tokens (worker/model_runner.py). What keeps the tokens exactly those of steps run one at
a time: a step samples only after the outputs of the step before are applied (grammars, penalties, prompt
logprobs and stop checks see every earlier token), and a step that could verify drafts never runs ahead (its
drafts need the last token).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import EngineConfig
from ..core.kv_cache import KVCacheManager
from ..core.lora_slots import LoRABusy, LoRAError, LoRANotFound, LoRARef, LoRASlotTable
from ..core.request import FinishReason, LogitsProcessor, Request
from ..core.sched_output import SchedulerOutput
from ..core.scheduler import Scheduler
from ..executor.executor import Executor
from ..kv_transfer.connector import KVConnector
from ..kv_transfer.keys import load_key
from ..metrics import HISTOGRAMS, EngineMetrics, StatsSnapshot
from ..model_fetch import resolve_model
from ..sample.sampler import Sampler, TokenLogprobs
from ..sample.step_sampler import LaunchedSample, StepResult, launch_step_sample
from ..sampling_params import InvalidParam, SamplingParams
from ..spec_decode import DraftQuery, build_proposer, resolve_draft
from ..step_timeline import StepTimeline, span
from ..structured.constraint import warm_up_bitmask
from ..tokenizer import Tokenizer
from ..worker.warmup import WarmupReport, WarmupTarget, warm_up
from ..worker.warmup import limits as warmup_limits
from ..worker.warmup import resolve_mode as resolve_warmup_mode
from .model_info import ModelInfo, check_prompt
from .output import RequestOutput
from .output_processor import OutputProcessor
from .step_thread import StepThread

log = logging.getLogger("sluice.engine")


@dataclass(slots=True)
class _InFlightStep:
    virtual_engine: int
    sched: SchedulerOutput
    requests: list[Request]  # of sched.scheduled, in order
    preempted: list[Request]
    started: float
    # Async scheduling: the step's device work in the step thread ((results, failures) once sampled), and set
    # once its outputs are applied (the next step samples only then).
    device_work: Future | None = None
    applied: threading.Event | None = None


@dataclass(slots=True)
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Counter = field(default_factory=Counter)
    steps: int = 0
    # Requests whose client left, by how far they had got then (queued / prefill / decode), and
    # those of them scheduled after their client had left: work done for nobody.
    abandoned: Counter = field(default_factory=Counter)
    scheduled_after_client_left: int = 0
    # Speculative decoding: drafts verified, drafts accepted, and acceptances by draft position.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafted_per_pos: list[int] = field(default_factory=list)
    spec_accepted_per_pos: list[int] = field(default_factory=list)


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.model_dir: Path = resolve_model(cfg.model)
        self.served_model_name = cfg.served_model_name or (cfg.model and Path(cfg.model).name) or "SmolLM2-135M-Instruct"
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        if cfg.draft_model is not None and cfg.world_size > 1:
            raise ValueError("--draft-model does not run with --tensor-parallel-size or --pipeline-parallel-size "
                             "above 1 yet; use --speculative-method ngram")
        self.spec_config = cfg.speculative_config()
        lora_modules = _check_lora_config(cfg, self.served_model_name)
        # Async scheduling needs the sampled tokens on the device of the rank that starts the next step: rank 0
        # alone samples, so with more ranks steps run one at a time (pipeline stages still overlap).
        self.async_scheduling = _wants_async_scheduling(cfg) and cfg.world_size == 1
        # The step thread owns the device work, the model's loading and warm-up included: on CPU torch's OpenMP
        # workers serve the thread that first ran parallel work (engine/owner_thread.py).
        self._steps = StepThread() if self.async_scheduling else None
        # The endpoint's KV key (--kv-secret-file): it names prompt blocks and seals transfers (kv_transfer/).
        kv_key = load_key(cfg.kv_secret_file)
        # Every rank of the layout (this process is rank 0): model shards, KV cache shards, and the
        # draft model beside rank 0's shard, its KV cache out of the same memory budget.
        self.executor = self._on_device(Executor, cfg, self.model_dir, resolve_draft(self.spec_config, self.tokenizer))
        self.runner = self.executor.runner  # rank 0's shard (model config, device, dtype, backend)
        capacity = self.executor.num_blocks * cfg.block_size
        if cfg.max_model_len is not None and cfg.max_model_len > capacity:
            raise ValueError(
                f"--max-model-len {cfg.max_model_len} does not fit the KV cache ({capacity} tokens); "
                "raise --kv-cache-memory (or --gpu-memory-utilization) or lower --max-model-len"
            )
        self.max_model_len = min(self.runner.max_model_len, capacity)
        self.kv = KVCacheManager(self.executor.num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                 offload_blocks=self.executor.num_offload_blocks,
                                 names_root=kv_key.names_root() if kv_key is not None else None)
        # One virtual engine per pipeline stage: disjoint micro-batches keep every stage busy.
        self.lora_slots = LoRASlotTable(cfg.max_loras) if cfg.enable_lora else None
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   num_virtual=self.executor.max_in_flight, max_model_len=self.max_model_len,
                                   lora_slots=self.lora_slots)
        # Steps in flight: one per pipeline stage; with async scheduling, this step and the next.
        self._max_in_flight = 2 if self.async_scheduling else self.executor.max_in_flight
        self._in_flight: deque[_InFlightStep] = deque()
        self._next_ve = 0
        # Set by AsyncEngine: takes in the commands (adds, aborts) that arrived since the step
        # began, so a request whose client has just left is not scheduled.
        self.before_schedule: Callable[[], None] | None = None
        # Called once a step is scheduled, before it runs (the AsyncEngine publishes its stats snapshot: the queue
        # as the scheduler left it).
        self.after_schedule: Callable[[], None] | None = None
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.runner.model_config.eos_token_ids)
        self.stats = EngineStats()
        self.metrics = EngineMetrics.from_config(cfg, self.executor.num_devices)
        self.sampler = Sampler(self.runner.device, cfg.seed)
        self.proposer = build_proposer(self.spec_config, self.executor.draft)
        # Requests in flight (added, not finished), and those whose prompt logprobs have gone out.
        self._open: set[str] = set()
        self._prompt_logprobs_sent: set[str] = set()
        # Token deltas to text (detokenization, stop strings). An engine core in its own process turns it
        # off (detokenize = False): the API process makes the text there (engine/output_processor.py).
        self.detokenize = True
        self.output_processor = OutputProcessor(self.tokenizer, self.finish_request)
        self._prompt_leaders: dict[tuple[int, ...], Request] = {}
        self.timeline: StepTimeline | None = None  # set_timeline(): where each step's time goes (benchmarks)
        # LoRA adapters served now, by name; those unloaded while requests still run on them (dropped once the
        # last of those ends); and the next registration's id.
        self.loras: dict[str, LoRARef] = {}
        self._unloading: dict[LoRARef, None] = {}
        self._lora_ids = itertools.count(1)
        self.model_info = ModelInfo(self.served_model_name, self.model_dir, self.max_model_len,
                                    self.runner.model_config.vocab_size, self.eos_token_ids)
        for name, path in lora_modules:
            self.load_lora(name, path)
        # Prompt blocks to and from other engines (kv_transfer/connector.py): pushes of finished requests' prompts,
        # and with --kv-role decode|both a receiver of other engines' pushes.
        try:
            self.kv_connector = KVConnector(cfg, self.kv, self.runner, self.served_model_name, kv_key,
                                            self._on_device)
        except BaseException:
            self.executor.shutdown()
            raise
        log.info("engine ready: model %s as %r, max_model_len %d, prefix caching %s, async scheduling %s",
                 self.model_dir, self.served_model_name, self.max_model_len,
                 "on" if cfg.enable_prefix_caching else "off", "on" if self.async_scheduling else "off")

    def set_timeline(self, timeline: StepTimeline | None) -> None:
        self.timeline = self.runner.timeline = timeline

    def _on_device(self, fn, *args):
        """Run fn in the thread that owns the device work (the step thread with async scheduling, else this one)."""
        if self._steps is None:
            return fn(*args)
        return self._steps.submit(fn, *args).result()

    def warm_up(self, on_step: Callable[[float | None], None] | None = None) -> WarmupReport:
        """Run --warmup's dummy steps (worker/warmup.py) before any request; the server calls it and reports
        ready only after. on_step: told when each dummy step starts and ends (the watchdog)."""
        mode = resolve_warmup_mode(self.cfg.warmup, self.runner.device)
        if mode != "off":  # the structured-output mask's Triton kernel on CUDA, before the first grammar request
            warm_up_bitmask(self.runner.device, self.runner.model_config.vocab_size)
        target = WarmupTarget(
            runner=self.runner, execute=self.executor.execute_model, pool=self.kv.pool,
            block_size=self.cfg.block_size, take_freed=self.scheduler.take_freed,
            note_freed=self.scheduler.note_freed, proposer=self.proposer,
            limits=warmup_limits(self.cfg, self.runner, self.spec_config, self.max_model_len))
        return self._on_device(warm_up, target, mode, on_step)

    # -- requests ------------------------------------------------------------------------------
    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return max(1, self.max_model_len - num_prompt_tokens)

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected if the request can never be served (a 400 at the API)."""
        check_prompt(self.model_info, prompt_token_ids, params)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    logits_processors: list[LogitsProcessor] | None = None,
                    arrival_time: float | None = None, lora_name: str | None = None,
                    kv_push_to: str | None = None) -> Request:
        self.check_prompt(prompt_token_ids, params)
        if request_id in self._open:
            raise InvalidParam("request_id", f"request id {request_id!r} is already in flight")
        lora = None
        if lora_name is not None:
            lora = self.loras.get(lora_name)
            if lora is None:
                known = ", ".join(sorted(self.loras)) or "none (start with --enable-lora --lora-modules)"
                raise InvalidParam("model", f"no LoRA adapter {lora_name!r}; adapters: {known}")
        if kv_push_to is not None and (lora is not None or self.cfg.world_size > 1):
            raise InvalidParam("kv_transfer_params", "KV transfer runs for base-model requests on one rank only "
                               "(not yet with LoRA adapters or tensor/pipeline parallelism)")
        req = Request(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids,
                      logits_processors=list(logits_processors or []), lora=lora, kv_push_to=kv_push_to)
        if arrival_time is not None:  # when the server received it (time.monotonic()); default: now
            req.arrival_time = arrival_time
        # Everything that can fail comes before the request is registered anywhere: a request that
        # fails here leaves no trace (a half-registered one once made later identical prompts wait
        # forever on a leader that never ran).
        if params.seed is not None:
            try:
                req.generator = torch.Generator(device=self.runner.device)
                req.generator.manual_seed(params.seed)
            except (RuntimeError, OverflowError, ValueError) as e:
                raise InvalidParam("seed", f"seed {params.seed} is not usable ({e})") from None
        # n > 1 siblings and identical concurrent prompts share the prompt's KV (forked once the
        # first of them has computed it) instead of each prefilling it.
        key = (lora and lora.id, *req.prompt_token_ids)  # the prompt's KV is the adapter's
        leader = self._prompt_leaders.get(key)
        if leader is not None and not leader.is_finished and params.prompt_logprobs is None:
            req.fork_source = leader
        else:
            self._prompt_leaders[key] = req
        if self.detokenize:
            self.output_processor.add(request_id, req.prompt_token_ids, params)
        self._open.add(request_id)
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str, client_left_at: float | None = None) -> None:
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            if client_left_at is not None:
                self._count_abandoned(req, client_left_at)
            self.scheduler.finish(req, FinishReason.ABORT)
            self.stats.finished[FinishReason.ABORT.value] += 1
            self._on_finished(req)
        self._close(request_id)

    def finish_request(self, request_id: str, stop_string: str) -> None:
        """The request's text reached a stop string (the output processor found it): it is done, as if a stop
        token had ended it. A no-op for a request that has already finished."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return
        self.scheduler.finish(req, FinishReason.STOP)
        req.stop_reason = stop_string
        self._on_finished(req)
        self.stats.finished[FinishReason.STOP.value] += 1
        self.metrics.on_finished(req)
        self._close(request_id)

    def _close(self, request_id: str) -> None:
        self._open.discard(request_id)
        self._prompt_logprobs_sent.discard(request_id)
        self.output_processor.drop(request_id)

    def _count_abandoned(self, req: Request, left_at: float) -> None:
        scheduled = req.first_scheduled_time
        if scheduled is None or scheduled > left_at:
            phase = "queued"
            if scheduled is not None:  # scheduled between the client leaving and this abort
                self.stats.scheduled_after_client_left += 1
        elif req.num_output_tokens == 0:
            phase = "prefill"
        else:
            phase = "decode"
        self.stats.abandoned[phase] += 1

    def _on_finished(self, req: Request) -> None:
        """The request is finished: drop what the engine keeps for it besides its output."""
        if self.proposer is not None:
            self.proposer.release(req.request_id)
        key = (req.lora and req.lora.id, *req.prompt_token_ids)
        if self._prompt_leaders.get(key) is req:
            del self._prompt_leaders[key]
        if req.lora is not None and req.lora in self._unloading:
            self._drop_unloaded()
        if req.kv_push_to is not None and req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.kv_connector.start_push(req.request_id, req.prompt_token_ids, req.kv_push_to)

    # -- LoRA adapters -------------------------------------------------------------------------
    def load_lora(self, name: str, path: str) -> LoRARef:
        """Serve the PEFT adapter in `path` as model `name` from now on. LoRAError (a ValueError) names what is
        wrong: LoRA off, the name taken, an adapter that does not fit the model."""
        if self.lora_slots is None:
            raise LoRAError("LoRA adapters need --enable-lora", param=None)
        if not name or name == self.served_model_name:
            raise LoRAError(f"adapter name {name!r} is the base model's served name" if name
                            else "lora_name is empty")
        if name in self.loras:
            raise LoRAError(f"LoRA adapter {name!r} is already loaded (from {self.loras[name].path}); unload it "
                            "first")
        finishing = [ref for ref in self._unloading if ref.name == name]
        if finishing:
            raise LoRABusy(f"LoRA adapter {name!r} was unloaded and requests still run on it: load it again once "
                            "they finish")
        ref = LoRARef(name, next(self._lora_ids), str(path))
        self.runner.lora.register(ref)  # reads and checks it (AdapterError is a ValueError)
        self.loras[name] = ref
        self._publish_loras()
        return ref

    def unload_lora(self, name: str) -> int:
        """Stop serving adapter `name`: new requests on it are refused from now on; those already on it run to
        their end, and it leaves its slot and the host once the last has (the count returned)."""
        ref = self.loras.pop(name, None)
        if ref is None:
            raise LoRANotFound(f"no LoRA adapter {name!r} is loaded"
                               + (f"; adapters: {', '.join(sorted(self.loras))}" if self.loras else ""))
        self._unloading[ref] = None
        self._publish_loras()
        return self._drop_unloaded().get(ref, 0)

    def _drop_unloaded(self) -> dict[LoRARef, int]:
        """Drop the unloaded adapters no unfinished request uses; how many still use each of the others."""
        users = Counter(r.lora for r in self.scheduler.requests.values() if r.lora in self._unloading
                        and not r.is_finished)
        for ref in [ref for ref in self._unloading if not users[ref]]:
            del self._unloading[ref]
            self.scheduler.forget_lora(ref)
            self.runner.lora.forget(ref)  # rank 0's copy now; the other ranks' with the next step
            log.info("LoRA adapter %r unloaded", ref.name)
        return users

    def _publish_loras(self) -> None:
        self.model_info = dataclasses.replace(self.model_info, lora_names=tuple(sorted(self.loras)))

    def stats_snapshot(self) -> StatsSnapshot:
        """The engine's counters and gauges now, as plain copied values (metrics.py): the engine thread's
        to call; /metrics renders the latest one published."""
        m, stats, kv, graphs = self.metrics, self.stats, self.kv, self.runner.graph_state
        return StatsSnapshot(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            prompt_tokens_pending=self.scheduler.prompt_tokens_pending,
            kv_usage=kv.usage(), kv_num_blocks=kv.num_blocks, graphs_captured=graphs.captured,
            graphs_state=graphs.state, graphs_reason=graphs.reason, prompt_tokens=stats.prompt_tokens,
            generation_tokens=stats.generation_tokens, prefix_queries=kv.prefix_queries, prefix_hits=kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions, finished=dict(stats.finished),
            abandoned=dict(stats.abandoned), scheduled_after_client_left=stats.scheduled_after_client_left,
            requests_slo_checked=m.requests_slo_checked, requests_goodput=m.requests_goodput,
            requests_met_ttft=m.requests_met_ttft, requests_met_tpot=m.requests_met_tpot,
            busy_prefill_seconds=m.busy_prefill_seconds, busy_decode_seconds=m.busy_decode_seconds,
            # Every draft has a position 0, so drafts verified = drafts at position 0.
            spec_num_drafts=stats.spec_drafted_per_pos[0] if stats.spec_drafted_per_pos else 0,
            spec_draft_tokens=stats.spec_draft_tokens, spec_accepted_tokens=stats.spec_accepted_tokens,
            spec_accepted_per_pos=tuple(stats.spec_accepted_per_pos),
            histograms={name: getattr(m, name).copy() for name in HISTOGRAMS},
            slo_ttft=m.slo_ttft, slo_tpot=m.slo_tpot, gpu_hour_usd=m.gpu_hour_usd, num_gpus=m.num_gpus,
            **self._lora_stats(), **self._kv_offload_stats(), **self.kv_connector.stats())

    def _kv_offload_stats(self) -> dict:
        ix, tier = self.kv.offload, self.runner.kv_tier
        if ix is None or tier is None:
            return {}
        return dict(kv_offload_blocks=ix.num_slots, kv_offload_used=len(ix), kv_offload_stored=ix.stored,
                    kv_offload_loaded=ix.loaded, kv_offload_hits=self.kv.offload_hits,
                    kv_offload_dropped=ix.dropped, kv_offload_block_bytes=tier.bytes_per_slot,
                    kv_offload_store_seconds=tier.store_seconds, kv_offload_load_seconds=tier.load_seconds,
                    kv_offload_received=ix.received)

    def _lora_stats(self) -> dict:
        if self.lora_slots is None:
            return {}
        m, sched = self.metrics, self.scheduler
        return dict(max_lora=self.lora_slots.max_loras,
                    lora_running=tuple(sorted(self.lora_slots.running_adapters)),  # each pins a slot
                    lora_waiting=tuple(sorted({r.lora.name for r in sched.waiting if r.lora is not None})),
                    lora_prompt_tokens=dict(m.lora_prompt_tokens), lora_generation_tokens=dict(m.lora_generation_tokens),
                    lora_requests=dict(m.lora_requests), lora_goodput=dict(m.lora_goodput))

    def kv_idle_work(self) -> bool:
        """The engine loop's, between steps: blocks other engines sent, taken in; True when metrics changed."""
        return self.kv_connector.idle_work()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._in_flight) or self.kv_connector.has_held()

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Start steps until one per pipeline stage is in flight (just one without pipeline
        parallelism), then finish the oldest: its outputs, as text deltas (or token deltas only, with
        detokenize off: an engine core whose API process makes the text)."""
        outputs = self._step_tokens()
        if not self.detokenize:
            return outputs
        texts = []
        for out in outputs:
            try:
                text = self.output_processor.process(out)
            except Exception as e:  # noqa: BLE001 - detokenizing, stop strings: this request's failure
                req = self.scheduler.requests.get(out.request_id)
                text = self._fail(req, e) if req is not None else _failed_output(out, e)
            if text is not None:
                texts.append(text)
        return texts

    def _step_tokens(self) -> list[RequestOutput]:
        released = self.kv_connector.released()
        while len(self._in_flight) < self._max_in_flight and self._start_step():
            pass
        if not self._in_flight:
            if not released and self.kv_connector.has_held():  # only answers waiting on pushes: wait, not spin
                released = self.kv_connector.released(wait=0.005)
            return released
        step = self._in_flight.popleft()
        try:
            return released + self._finish_step(step)
        finally:
            if step.applied is not None:
                step.applied.set()  # the next step may sample (also when this one failed: it has nothing to wait for)

    def _finish_step(self, step: _InFlightStep) -> list[RequestOutput]:
        sched, requests = step.sched, step.requests
        # A failure of the forward is the engine's (device, memory, a lost rank): it propagates and
        # the engine stops. What follows is per request: a failure there fails that request alone.
        if step.device_work is not None:
            launched, failed = step.device_work.result()
        else:
            logits = self.executor.collect()
            with span(self.timeline, "sample"):
                launched, failed = self._launch_sample(logits, sched, requests)
        with span(self.timeline, "outputs"):
            return self._apply_outputs(step, launched, failed)

    def _apply_outputs(self, step: _InFlightStep, launched: list[LaunchedSample],
                       failed: list[tuple[Request, Exception]]) -> list[RequestOutput]:
        sched, requests = step.sched, step.requests
        results = [r for part in launched for r in part.results()]
        self.stats.steps += 1
        outputs = [self._fail(req, e) for req, e in failed]
        for res in results:
            if res.request.is_finished:
                continue  # aborted (or ended by the step before) while its step was in flight
            try:
                out = self._process(res)
            except Exception as e:  # noqa: BLE001 - detokenizing, stop checks, a grammar's accept
                out = self._fail(res.request, e)
            if out is not None:
                outputs.append(out)
        self.metrics.on_step([(r, s.num_tokens) for r, s in zip(requests, sched.scheduled, strict=True)],
                             step.preempted, step.started)
        return outputs

    def _start_step(self) -> bool:
        """Schedule and submit a step of the next virtual engine that has work and no step in flight (with async
        scheduling: of the one virtual engine, whose step in flight may be one)."""
        if self._in_flight and self.async_scheduling and not self._may_run_ahead():
            return False
        self.kv_connector.take_inbox()
        if self.before_schedule is not None:
            self.before_schedule()
        busy = set() if self.async_scheduling else {st.virtual_engine for st in self._in_flight}
        n = self.scheduler.num_virtual
        for k in range(n):
            ve = (self._next_ve + k) % n
            if ve in busy or not self.scheduler.has_work_on(ve):
                continue
            started = time.monotonic()
            if self.proposer is not None:
                self._propose_drafts(ve)
            with span(self.timeline, "schedule"):
                sched = self.scheduler.schedule(ve)
            if sched.is_empty:
                continue
            self._next_ve = (ve + 1) % n
            requests = [self.scheduler.requests[s.request_id] for s in sched.scheduled]
            preempted = [self.scheduler.requests[rid] for rid in sched.preempted]
            if self.after_schedule is not None:
                self.after_schedule()
            step = _InFlightStep(ve, sched, requests, preempted, started)
            if self._steps is not None:
                before = self._in_flight[-1].applied if self._in_flight else None
                step.applied = threading.Event()
                step.device_work = self._steps.submit(self._run_step, sched, requests, before)
            else:
                self.executor.submit(sched)
            self._in_flight.append(step)
            return True
        return False

    def _may_run_ahead(self) -> bool:
        """Whether the next step may be scheduled before the one in flight is back: not when a request could get
        drafts (they are guessed from its last token, which is not known yet)."""
        if self.proposer is None:
            return True
        running = self.scheduler.running
        if len(running) > self.spec_config.disable_batch_size:
            return True
        return not any(r.params.speculative and not r.logits_processors and not r.params.needs_penalties
                       for r in running)

    def _run_step(self, sched: SchedulerOutput, requests: list[Request], before: threading.Event | None):
        """In the step thread: the step's forward, then, once the outputs of the step before are applied, its
        sampling. The sampled tokens stay on the device for the next step's placeholders."""
        tl = self.timeline
        if tl is not None:
            tl.job_started()
        logits = self.executor.execute_model(sched)
        if before is not None:
            with span(tl, "device_wait"):
                before.wait()
        # A request the step before ended (a stop token, its length) is not sampled: its grammar may have
        # nothing left to allow.
        live = [i for i, r in enumerate(requests) if not r.is_finished]
        if len(live) < len(requests):
            sched, requests, logits = _select(sched, requests, logits, live)
        with span(self.timeline, "sample"):
            launched, failed = self._launch_sample(logits, sched, requests)
        self.runner.placeholder_source = launched[0].sampled_tokens if len(launched) == 1 else _merged(launched)
        if tl is not None:
            tl.job_ended()
        return launched, failed

    def _launch_sample(self, logits, sched, requests: list[Request]) -> tuple[list[LaunchedSample],
                                                                             list[tuple[Request, Exception]]]:
        """Queue the whole batch's sampling; if that raises, each request's on its own, so only the requests
        whose own state makes sampling fail (a logits processor that raises, say) fail."""
        if not requests:
            return [], []
        try:
            return [launch_step_sample(self.sampler, logits, sched, requests)], []
        except Exception:  # noqa: BLE001 - attributed below, request by request
            log.warning("sampling the batch failed; sampling its %d requests one by one", len(requests))
        rows, firsts = sched.logits_layout()
        launched: list[LaunchedSample] = []
        failed: list[tuple[Request, Exception]] = []
        for s, req, first in zip(sched.scheduled, requests, firsts, strict=True):
            one = type(sched)([s])
            k = s.logits_rows()
            try:
                launched.append(launch_step_sample(self.sampler, logits[first : first + k], one, [req]))
            except Exception as e:  # noqa: BLE001 - this request's failure
                failed.append((req, e))
        return launched, failed

    def _fail(self, req: Request, e: Exception) -> RequestOutput:
        """Finish one request with an error; the engine goes on for everyone else."""
        log.warning("request %s failed: %r", req.request_id, e)
        if not req.is_finished:
            self.scheduler.finish(req, FinishReason.ERROR)
            self._on_finished(req)
            self.stats.finished[FinishReason.ERROR.value] += 1
        self._close(req.request_id)
        return RequestOutput(req.request_id, [], "", [], finished=True, finish_reason=FinishReason.ERROR.value,
                             num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
                             error=f"{type(e).__name__}: {e}")

    def keepalive(self) -> None:
        """Idle: keep the other ranks' wait for the next step alive (a no-op with one rank)."""
        self.executor.keepalive()

    def shutdown(self) -> None:
        self.kv_connector.shutdown()
        self.executor.shutdown()

    def _propose_drafts(self, ve: int = 0) -> None:
        """The draft-proposal hook: guess the next tokens of each decoding request (speculative
        decoding). The scheduler computes them after the last known token; the sampler verifies."""
        assert self.proposer is not None
        running = [r for r in self.scheduler.running if r.virtual_engine == ve]
        if len(running) > self.spec_config.disable_batch_size:
            return  # a large batch already uses the compute that speculation would fill
        queries: list[DraftQuery] = []
        asking: list[Request] = []
        for req in running:
            p = req.params
            # Penalties and plain logits processors depend on the tokens before each position; drafts
            # would need them applied position by position, which the verifier does not do (yet).
            # Token constraints (grammars) do: the verifier masks each row by the state after the
            # drafts before it.
            if (not p.speculative or req.num_computed_tokens != req.num_tokens - 1 or req.num_in_flight_tokens
                    or req.logits_processors or p.needs_penalties):
                continue
            # Room for the drafts plus the one token every step produces anyway.
            room = min(p.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            if room > 0:
                queries.append(DraftQuery(req.request_id, req.all_token_ids, room))
                asking.append(req)
        if not queries:
            return
        for req, drafts in zip(asking, self.proposer.propose_batch(queries), strict=True):
            for c in req.constraints:  # a draft the grammar forbids would surely be rejected
                del drafts[c.valid_prefix(drafts):]
            self.scheduler.set_drafts(req, drafts)

    def _process(self, res: StepResult) -> RequestOutput | None:
        """Apply one request's step result: its tokens, and whether an end-of-sequence or stop token or the
        length limit ends it. Tokens only: the text (and stop strings) are the output processor's."""
        req = res.request
        num_drafts = self.scheduler.update_from_output(req, res.num_scheduled, res.num_rejected, res.sampled)
        if num_drafts:
            self._count_spec(num_drafts, len(res.token_ids) - 1)
        if res.prompt_logprobs:
            req.prompt_logprobs.extend(res.prompt_logprobs)
        if not res.token_ids:
            return None
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            self.stats.prompt_tokens += req.num_prompt_tokens

        p = req.params
        finish: FinishReason | None = None
        stop_reason: int | None = None
        new_token_ids: list[int] = []
        logprobs: list[TokenLogprobs] = []
        for token, lp in zip(res.token_ids, res.logprobs, strict=True):
            req.append_output_token(token)
            for c in req.constraints:
                c.accept(token)
            new_token_ids.append(token)
            self.stats.generation_tokens += 1
            if lp is not None:
                logprobs.append(lp)
            if (not p.ignore_eos and token in req.eos_token_ids) or token in p.stop_token_ids:
                finish, stop_reason = FinishReason.STOP, (token if token in p.stop_token_ids else None)
            elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
                finish = FinishReason.LENGTH
            if finish is not None:
                break  # accepted drafts after the end are dropped

        if finish is not None:
            self.scheduler.finish(req, finish)
            self._on_finished(req)
            req.stop_reason = stop_reason
            self.stats.finished[finish.value] += 1
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_token_ids,
            new_text="",
            logprobs=logprobs,
            finished=finish is not None,
            finish_reason=finish.value if finish else None,
            stop_reason=stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
        )
        if p.prompt_logprobs is not None and req.request_id not in self._prompt_logprobs_sent:
            out.prompt_logprobs = list(req.prompt_logprobs)
            self._prompt_logprobs_sent.add(req.request_id)
        if finish is not None:
            self._open.discard(req.request_id)
            self._prompt_logprobs_sent.discard(req.request_id)
            if self.kv_connector.hold(req.request_id, out):  # its answer waits for its push to end
                return None
        return out

    def _count_spec(self, num_drafts: int, num_accepted: int) -> None:
        st = self.stats
        st.spec_draft_tokens += num_drafts
        st.spec_accepted_tokens += num_accepted
        grow = num_drafts - len(st.spec_drafted_per_pos)
        if grow > 0:
            st.spec_drafted_per_pos.extend([0] * grow)
            st.spec_accepted_per_pos.extend([0] * grow)
        for i in range(num_drafts):
            st.spec_drafted_per_pos[i] += 1
            st.spec_accepted_per_pos[i] += i < num_accepted


def _check_lora_config(cfg: EngineConfig, served_model_name: str) -> list[tuple[str, str]]:
    """The adapters of --lora-modules (name, path), refused with a reason where they cannot work."""
    if not cfg.enable_lora:
        if cfg.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        if cfg.lora_modules_file:
            raise ValueError("--lora-modules-file needs --enable-lora")
        return []
    if cfg.max_loras < 1 or cfg.max_lora_rank < 1:
        raise ValueError("--max-loras and --max-lora-rank must be at least 1")
    if cfg.max_cpu_loras is not None and cfg.max_cpu_loras < cfg.max_loras:
        raise ValueError(f"--max-cpu-loras ({cfg.max_cpu_loras}) must be at least --max-loras ({cfg.max_loras})")
    modules: list[tuple[str, str]] = []
    for spec in cfg.lora_modules:
        name, eq, path = spec.partition("=")
        if not eq or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, not {spec!r}")
        if name == served_model_name:
            raise ValueError(f"--lora-modules: adapter name {name!r} is the base model's served name")
        if any(name == n for n, _ in modules):
            raise ValueError(f"--lora-modules: adapter name {name!r} given twice")
        modules.append((name, path))
    return modules


def _wants_async_scheduling(cfg: EngineConfig) -> bool:
    """--async-scheduling, or by default where the forward runs on a GPU. On CPU the forward is the host's own work:
    there is no device to hide the host's work behind, the two threads share the cores and the GIL, and a request
    that arrives during a step waits one step more (docs/BENCHMARKS.md#async-scheduling)."""
    if cfg.async_scheduling is not None:
        return cfg.async_scheduling
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def _select(sched: SchedulerOutput, requests: list[Request], logits, keep: list[int]):
    """The step's part for the requests at `keep`, and their logits rows."""
    rows, firsts = sched.logits_layout()
    picked = [firsts[i] + j for i in keep for j in range(sched.scheduled[i].logits_rows())]
    sub = SchedulerOutput([sched.scheduled[i] for i in keep])
    idx = torch.tensor(picked, dtype=torch.long).to(logits.device, non_blocking=True)
    return sub, [requests[i] for i in keep], logits.index_select(0, idx)


def _merged(launched: list[LaunchedSample]):
    """One SampledTokens over several launches (a batch sampled request by request after a failure)."""
    from ..sample.step_sampler import SampledTokens

    parts = [x.sampled_tokens for x in launched if x.sampled_tokens is not None]
    if not parts:
        return None
    row_of: dict[str, int] = {}
    base = 0
    for p in parts:
        row_of.update({rid: base + r for rid, r in p.row_of.items()})
        base += p.tokens.shape[0]
    return SampledTokens(torch.cat([p.tokens for p in parts]), row_of)


def _failed_output(out: RequestOutput, e: Exception) -> RequestOutput:
    """An error delta for a request the core has already finished (its text failed to build)."""
    log.warning("request %s failed: %r", out.request_id, e)
    return RequestOutput(out.request_id, [], "", [], finished=True, finish_reason=FinishReason.ERROR.value,
                         num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
                         error=f"{type(e).__name__}: {e}")
