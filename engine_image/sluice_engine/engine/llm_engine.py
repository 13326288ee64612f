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
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import EngineConfig
from ..core.kv_cache import KVCacheManager
from ..core.lora_slots import LoRARef, LoRASlotTable
from ..core.request import FinishReason, LogitsProcessor, PromptLeaders, Request
from ..core.sched_output import SchedulerOutput
from ..core.scheduler import Scheduler
from ..executor.executor import Executor
from ..kv_transfer.connector import KVConnector
from ..kv_transfer.keys import load_key
from ..metrics import EngineMetrics, StatsSnapshot
from ..model_fetch import resolve_model
from ..sample.sampler import Sampler
from ..sample.step_sampler import LaunchedSample, StepResult
from ..sampling_params import InvalidParam, SamplingParams, check_priority
from ..spec_decode import build_proposer, resolve_draft
from ..step_timeline import StepTimeline, span
from ..structured.constraint import warm_up_bitmask
from ..tokenizer import Tokenizer
from ..worker.warmup import WarmupReport, WarmupTarget, warm_up
from ..worker.warmup import limits as warmup_limits
from ..worker.warmup import resolve_mode as resolve_warmup_mode
from .drafts import may_run_ahead, propose_drafts
from .engine_stats import EngineStats
from .lora_adapters import LoRAAdapters, check_lora_config
from .model_info import ModelInfo, check_prompt
from .output import RequestOutput, failed_output
from .output_processor import OutputProcessor
from .request_tokens import apply_tokens
from .step_sampling import launch_sample, run_device_step
from .step_thread import StepThread, wants_async_scheduling

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
        lora_modules = check_lora_config(cfg, self.served_model_name)
        # Async scheduling needs the sampled tokens on the device of the rank that starts the next step: rank 0
        # alone samples, so with more ranks steps run one at a time (pipeline stages still overlap).
        self.async_scheduling = wants_async_scheduling(cfg) and cfg.world_size == 1
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
                                   lora_slots=self.lora_slots, policy=cfg.scheduling_policy)
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
        # Tracing on: a request's first delta carries its times (RequestOutput.timing); off, nothing more is done.
        self.trace_timing = cfg.otlp_traces_endpoint is not None
        self.output_processor = OutputProcessor(self.tokenizer, self.finish_request, timed=self.trace_timing)
        self._prompt_leaders = PromptLeaders()
        self.timeline: StepTimeline | None = None  # set_timeline(): where each step's time goes (benchmarks)
        self.model_info = ModelInfo(self.served_model_name, self.model_dir, self.max_model_len,
                                    self.runner.model_config.vocab_size, self.eos_token_ids)
        # LoRA adapters served by name (engine/lora_adapters.py), those of --lora-modules from the start.
        self.adapters = LoRAAdapters(self.lora_slots, self.scheduler, self.runner.lora, self.served_model_name,
                                     self._publish_loras)
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
                    kv_push_to: str | None = None, priority: int = 0) -> Request:
        self.check_prompt(prompt_token_ids, params)
        check_priority(priority, self.cfg.scheduling_policy)
        if request_id in self._open:
            raise InvalidParam("request_id", f"request id {request_id!r} is already in flight")
        lora = self.adapters.find(lora_name)
        if kv_push_to is not None and (lora is not None or self.cfg.world_size > 1):
            raise InvalidParam("kv_transfer_params", "KV transfer runs for base-model requests on one rank only "
                               "(not yet with LoRA adapters or tensor/pipeline parallelism)")
        req = Request(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids,
                      logits_processors=list(logits_processors or []), lora=lora, kv_push_to=kv_push_to,
                      priority=priority)
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
        self._prompt_leaders.follow(req)
        if self.detokenize:
            self.output_processor.add(request_id, req.prompt_token_ids, params)
        self._open.add(request_id)
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str, client_left_at: float | None = None) -> None:
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            if client_left_at is not None:
                self.stats.count_abandoned(req, client_left_at)
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

    def _on_finished(self, req: Request) -> None:
        """The request is finished: drop what the engine keeps for it besides its output."""
        if self.proposer is not None:
            self.proposer.release(req.request_id)
        self._prompt_leaders.release(req)
        self.adapters.settle(req.lora)
        if req.kv_push_to is not None and req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.kv_connector.start_push(req.request_id, req.prompt_token_ids, req.kv_push_to)

    def stats_snapshot(self) -> StatsSnapshot:
        """The engine's counters and gauges now, as plain copied values (engine_stats.py)."""
        return self.stats.snapshot(self.metrics, self.scheduler, self.kv, self.runner,
                                   **self.adapters.stats(self.metrics), **self.kv_connector.stats())

    # -- LoRA adapters (engine/lora_adapters.py) --------------------------------------------------
    @property
    def loras(self) -> dict[str, LoRARef]:
        return self.adapters.served

    def load_lora(self, name: str, path: str) -> LoRARef:
        return self.adapters.load(name, path)

    def unload_lora(self, name: str) -> int:
        return self.adapters.unload(name)

    def _publish_loras(self, names: tuple[str, ...]) -> None:
        self.model_info = dataclasses.replace(self.model_info, lora_names=names)

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
                if req is None:  # finished in the core already: its text failed to build
                    log.warning("request %s failed: %r", out.request_id, e)
                    text = failed_output(out.request_id, out.num_prompt_tokens, out.num_output_tokens, e)
                else:
                    text = self._fail(req, e)
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
                launched, failed = launch_sample(self.sampler, logits, sched, requests)
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
        if (self._in_flight and self.async_scheduling
                and not may_run_ahead(self.proposer, self.scheduler, self.spec_config.disable_batch_size)):
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
                propose_drafts(self.proposer, self.scheduler, self.spec_config.disable_batch_size,
                               self.max_model_len, ve)
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
                step.device_work = self._steps.submit(run_device_step, self.executor, self.sampler, self.runner,
                                                      sched, requests, before)
            else:
                self.executor.submit(sched)
            self._in_flight.append(step)
            return True
        return False

    def _fail(self, req: Request, e: Exception) -> RequestOutput:
        """Finish one request with an error; the engine goes on for everyone else."""
        log.warning("request %s failed: %r", req.request_id, e)
        if not req.is_finished:
            self.scheduler.finish(req, FinishReason.ERROR)
            self._on_finished(req)
            self.stats.finished[FinishReason.ERROR.value] += 1
        self._close(req.request_id)
        return failed_output(req.request_id, req.num_prompt_tokens, req.num_output_tokens, e)

    def keepalive(self) -> None:
        """Idle: keep the other ranks' wait for the next step alive (a no-op with one rank)."""
        self.executor.keepalive()

    def shutdown(self) -> None:
        self.kv_connector.shutdown()
        self.executor.shutdown()

    def _process(self, res: StepResult) -> RequestOutput | None:
        """Apply one request's step result (engine/request_tokens.py): its tokens, and whether they end it."""
        req = res.request
        num_drafts = self.scheduler.update_from_output(req, res.num_scheduled, res.num_rejected, res.sampled)
        if num_drafts:
            self.stats.count_spec(num_drafts, len(res.token_ids) - 1)
        if res.prompt_logprobs:
            req.prompt_logprobs.extend(res.prompt_logprobs)
        if not res.token_ids:
            return None
        first = req.first_token_time is None
        if first:
            req.first_token_time = time.monotonic()
            self.stats.prompt_tokens += req.num_prompt_tokens

        got = apply_tokens(req, res.token_ids, res.logprobs, self.max_model_len)
        self.stats.generation_tokens += len(got.token_ids)
        finish = got.finish
        if finish is not None:
            self.scheduler.finish(req, finish)
            self._on_finished(req)
            req.stop_reason = got.stop_reason
            self.stats.finished[finish.value] += 1
        out = RequestOutput(req.request_id, got.token_ids, "", got.logprobs, finished=finish is not None,
                            finish_reason=finish.value if finish else None, stop_reason=got.stop_reason,
                            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
                            num_cached_tokens=max(req.num_cached_tokens, 0))
        if first and self.trace_timing:  # the times the request's span is built from (API side), sent once
            scheduled = req.first_scheduled_time
            out.timing = (req.arrival_time, req.arrival_time if scheduled is None else scheduled, req.first_token_time)
        if req.params.prompt_logprobs is not None and req.request_id not in self._prompt_logprobs_sent:
            out.prompt_logprobs = list(req.prompt_logprobs)
            self._prompt_logprobs_sent.add(req.request_id)
        if finish is not None:
            self._open.discard(req.request_id)
            self._prompt_logprobs_sent.discard(req.request_id)
            if self.kv_connector.hold(req.request_id, out):  # its answer waits for its push to end
                return None
        return out
