"""Runs the LLMEngine in its own thread so the API's event loop never waits on a forward pass.

Commands (add, abort) reach the thread through a queue; each step's outputs go back to the event
loop in one `call_soon_threadsafe`, into one asyncio.Queue per request.

`AsyncEngine` is the API layer's one face of the engine (an engine client, as vLLM's EngineClient):
model info, the tokenizer, request checks, generate, abort, and the engine's health.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from .engine import LLMEngine, RequestOutput
from .metrics import StatsSnapshot
from .owner_thread import start_owner_thread
from .request import LogitsProcessor
from .sampling_params import SamplingParams

log = logging.getLogger("sluice.engine")


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (its own fault); the engine serves on."""


class ServerShuttingDownError(RuntimeError):
    """The server is draining (SIGTERM): no new requests; open ones cut at the drain deadline."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    logits_processors: list[LogitsProcessor] | None
    arrival_time: float  # time.monotonic() when the API handed it over: TTFT and latencies count from here


@dataclass(slots=True)
class _Abort:
    request_id: str
    client_left_at: float | None = None  # time.monotonic() the API noticed its client leave


IDLE_TICK_S = 0.5  # an idle engine thread wakes this often (keepalive of the other ranks)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        # Called once (from whichever thread noticed) when the engine can no longer serve: the server
        # turns /health to 503 and exits non-zero.
        self.on_dead: Callable[[BaseException], None] | None = None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = threading.Event()
        self._started = threading.Event()  # the event loop is known: the engine thread may deliver
        self._thread: threading.Thread | None = None
        # Submitted requests (event loop thread) and those the engine thread has taken into the scheduler;
        # the difference is what is still in the command queue. Each counter has one writer.
        self._adds_submitted = 0
        self._adds_taken = 0
        self._taking = threading.Lock()
        self.dead: BaseException | None = None
        self._fail_lock = threading.Lock()
        self.step_started: float | None = None  # monotonic start of the step now running (the watchdog's)
        self.draining = False  # SIGTERM received: /ready is 503 and new requests are refused
        # Until the engine thread has run the warm-up steps (LLMEngine.warm_up), /ready is 503 "warming up";
        # requests submitted meanwhile wait in the command queue.
        self.warming_up = True
        self.warmup_report = None
        # The engine's counters as of its last step (or batch of adds and aborts): what /metrics renders.
        # Written by the engine thread (one reference store), read by the HTTP thread.
        self._stats: StatsSnapshot | None = None

    @classmethod
    def build(cls, factory: Callable[[], LLMEngine]) -> AsyncEngine:
        """Build the engine in the thread that will step it (faster on CPU: see owner_thread.py), and
        return once it is built; the loop starts with start()."""
        self = cls(None)  # type: ignore[arg-type]  # the engine is set once the thread has built it

        def run() -> None:
            self._started.wait()
            self._warm_up_then_run()

        self.engine, self._thread = start_owner_thread(factory, run, "sluice-engine")
        return self

    def _watch_ranks(self) -> None:
        executor = getattr(self.engine, "executor", None)
        if executor is not None:
            executor.on_failure = self.fail

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._watch_ranks()
        self.engine.before_schedule = self._take_commands
        self.engine.after_schedule = self._publish
        if self._thread is None:
            self._thread = threading.Thread(target=self._warm_up_then_run, name="sluice-engine", daemon=True)
            self._thread.start()
        self._started.set()

    def shutdown(self) -> None:
        self._stopped.set()
        self._started.set()  # a built engine whose loop never started: let its thread end
        self._cmds.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.dead is None and self.engine is not None:
            self.engine.shutdown()  # the other ranks stop with it

    # -- API side (event loop) -----------------------------------------------------------------
    @property
    def model_info(self):
        return self.engine.model_info

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected (a 400) if the request can never be served; reads only fixed limits."""
        self.engine.check_prompt(prompt_token_ids, params)

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return self.engine.default_max_tokens(num_prompt_tokens)

    # -- graceful shutdown ---------------------------------------------------------------------
    def begin_drain(self) -> None:
        self.draining = True

    @property
    def num_open(self) -> int:
        """Requests whose client is still being served (open streams, pending adds included)."""
        return len(self._streams)

    def end_open_requests(self, reason: str) -> None:
        """The drain deadline passed: every open request ends now with ServerShuttingDownError (an
        error event and [DONE] on a stream) and is aborted in the engine."""
        if self._loop is None or self._loop.is_closed():
            return
        err = ServerShuttingDownError(reason)
        self._loop.call_soon_threadsafe(lambda: self._deliver([(rid, err) for rid in list(self._streams)]))

    def hung_for(self) -> float | None:
        """Seconds the current step has run past --step-timeout (the watchdog), or None."""
        started = self.step_started
        if started is None:
            return None
        over = time.monotonic() - started - self.engine.cfg.step_timeout
        return over if over > 0 else None

    @property
    def num_waiting(self) -> int:
        # Under the lock the engine thread takes a submitted request into the scheduler with: a request
        # is counted once, as pending or as waiting, never both (the /metrics gauge read 7 for a queue of 4).
        with self._taking:
            return self.engine.scheduler.num_waiting + self._adds_submitted - self._adds_taken

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            logits_processors: list[LogitsProcessor] | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request now (it counts as waiting from this call on: the API's queue bound is
        checked and taken in one go) and return its stream of output deltas. Leaving the stream early
        aborts the request; a stream never iterated must be aborted by the caller."""
        if self.dead is not None:
            raise EngineDeadError(f"engine loop died: {self.dead!r}")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        self._adds_submitted += 1
        self._cmds.put(_Add(request_id, prompt_token_ids, params, logits_processors, time.monotonic()))
        return self._outputs(request_id, q)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       logits_processors: list[LogitsProcessor] | None = None) -> AsyncIterator[RequestOutput]:
        """Yields output deltas until the request finishes (submitted on first iteration). A request
        the engine refuses (LLMEngine.add_request) ends the stream with its ValueError."""
        async for out in self.add(request_id, prompt_token_ids, params, logits_processors):
            yield out

    async def _outputs(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    raise RequestFailedError(f"request failed in the engine: {item.error}")
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._cmds.put(_Abort(request_id))

    def abort(self, request_id: str, client_left_at: float | None = None) -> None:
        """Abort a request (a no-op for one that has finished). client_left_at: when its client
        left, if that is why (the engine counts abandoned requests by how far they got)."""
        self._cmds.put(_Abort(request_id, client_left_at))

    # -- engine thread -------------------------------------------------------------------------
    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        for request_id, item in items:
            q = self._streams.get(request_id)
            if q is not None:
                q.put_nowait(item)

    def _deliver_threadsafe(self, items: list) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, items)

    def stats(self) -> StatsSnapshot:
        """The latest snapshot the engine thread published (metrics.py); one taken now before its first."""
        snap = self._stats
        return snap if snap is not None else dataclasses.replace(self.engine.stats_snapshot(),
                                                                 adds_taken=self._adds_taken)

    def waiting_in(self, snap: StatsSnapshot) -> int:
        """The /metrics queue depth: the snapshot's waiting requests plus those submitted since that the engine
        had not taken in when it was made (each counted once)."""
        return snap.num_waiting + self._adds_submitted - snap.adds_taken

    def _publish(self) -> None:
        # Engine thread: the reference store is atomic; readers get an old snapshot or this one, whole.
        self._stats = dataclasses.replace(self.engine.stats_snapshot(), adds_taken=self._adds_taken)

    def _warm_up_then_run(self) -> None:
        self._publish()
        self._warm_up()
        self._run()

    def _warm_up(self) -> None:
        """Engine thread, once the server has started (on_dead is set, open requests can be failed), before
        the loop. A warm-up that fails is the engine's failure: the server never reports ready and exits
        non-zero, instead of dying on its first request."""
        try:
            self.warmup_report = self.engine.warm_up(on_step=self._on_warmup_step)
        except BaseException as e:  # noqa: BLE001 - reported through fail(), like a failed step
            log.exception("warm-up failed")
            self.fail(e)
        finally:
            self.step_started = None
            self.warming_up = False

    def _on_warmup_step(self, started: float | None) -> None:
        self.step_started = started  # a dummy step is a step: the watchdog covers it

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        engine = self.engine
        try:
            while not self._stopped.is_set() and self.dead is None:
                block = not engine.has_unfinished()
                errors = self._drain(block)
                if not engine.has_unfinished():
                    self._publish()  # what the adds and aborts changed; a step publishes once it has scheduled
                self._deliver_threadsafe(errors)
                if engine.has_unfinished():
                    self.step_started = time.monotonic()
                    outs = engine.step()
                    self.step_started = None
                    self._publish()  # before the outputs leave: a client that got its answer sees it counted
                    self._deliver_threadsafe([(o.request_id, o) for o in outs])
                elif not self._stopped.is_set():
                    engine.keepalive()
        except BaseException as e:  # the loop must never die silently: fail every open request
            log.exception("engine loop failed")
            self.fail(e)

    def _take_commands(self) -> None:
        # Engine thread, right before each schedule: an abort that arrived during the previous step
        # (a client that left) is applied before its request could be admitted.
        self._deliver_threadsafe(self._drain(False))

    def fail(self, e: BaseException) -> None:
        """The engine cannot serve any more (its loop died, or a rank of its group was lost): every
        open request ends with an error, /health and /ready answer 503, and on_dead runs once."""
        with self._fail_lock:
            if self.dead is not None:
                return
            self.dead = e
        engine = self.engine
        engine.stats.finished["error"] += len(engine.scheduler.requests)  # every request in flight fails
        self._publish()  # the engine thread is stopped or stopping: this is the last snapshot
        err = EngineDeadError(f"engine loop died: {e!r}")
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(lambda: self._deliver([(rid, err) for rid in list(self._streams)]))
        self._cmds.put(None)  # wake an idle engine thread
        if self.on_dead is not None:
            self.on_dead(e)

    def _drain(self, block: bool) -> list:
        errors = []
        while True:
            try:
                cmd = self._cmds.get(block=block, timeout=IDLE_TICK_S if block else None)
            except queue.Empty:
                return errors
            block = False
            if cmd is None:
                return errors
            if isinstance(cmd, _Add):
                try:
                    with self._taking:
                        self._adds_taken += 1
                        self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                                cmd.logits_processors, arrival_time=cmd.arrival_time)
                except ValueError as e:
                    errors.append((cmd.request_id, e))
                except Exception as e:  # noqa: BLE001 - this request's own failure, never the loop's
                    log.warning("request %s could not be added: %r", cmd.request_id, e)
                    errors.append((cmd.request_id, RequestFailedError(f"request failed in the engine: {e!r}")))
            else:
                self.engine.abort_request(cmd.request_id, client_left_at=cmd.client_left_at)
