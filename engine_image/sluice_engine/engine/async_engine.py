"""The API layer's one face of the engine (an engine client, as vLLM's EngineClient): model info, the
tokenizer, request checks, generate, abort, the engine's health and its latest stats snapshot.

The engine loop (engine/core_loop.py) runs in one of two places, and the API cannot tell which:
- its own process (`AsyncEngine.spawn`, what `sluice serve` does): the engine core, fed by plain messages
  over ZMQ (engine/core_process.py). The HTTP server, tokenization and response building never share a GIL with
  the scheduler and the model runner.
- a thread of this process (`AsyncEngine(engine)`, `AsyncEngine.build`): what tests, the offline paths
  and `sluice serve --no-engine-process` use.

Either way, each step's outputs reach the event loop in one `call_soon_threadsafe`, into one asyncio.Queue
per request, after the step's stats snapshot (what /metrics renders).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import msgspec

from ..config import EngineConfig
from ..core.request import LogitsProcessor
from ..metrics import StatsSnapshot
from ..sampling_params import InvalidParam, SamplingParams
from ..tokenizer import Tokenizer
from .messages import (
    AbortRequest,
    AddRequest,
    CoreDead,
    CoreOutputs,
    CoreReady,
    CoreWarmedUp,
    FinishRequest,
    LoadLoRA,
    LoRAUpdated,
    RequestFailedError,
    Shutdown,
    UnloadLoRA,
    command_codec,
    core_message_codec,
    refusal_error,
)
from .model_info import ModelInfo, check_prompt
from .output import RequestOutput
from .output_processor import OutputProcessor
from .owner_thread import start_owner_thread
from .step_clock import IDLE_TICK_S, MappedStepClock, StepClock

if TYPE_CHECKING:  # the engine itself is imported only where it runs in this process (torch)
    from .llm_engine import LLMEngine

log = logging.getLogger("sluice.engine")

__all__ = ["AsyncEngine", "EngineDeadError", "RequestFailedError", "ServerShuttingDownError"]


class EngineDeadError(RuntimeError):
    pass


class ServerShuttingDownError(RuntimeError):
    """The server is draining (SIGTERM): no new requests; open ones cut at the drain deadline."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine | None, cfg: EngineConfig | None = None):
        # The engine when it runs in this process (None with an engine-core process).
        self.engine = engine
        self.cfg: EngineConfig = cfg if cfg is not None else engine.cfg  # type: ignore[union-attr]
        # Called once (from whichever thread noticed) when the engine can no longer serve: the server
        # turns /health to 503 and exits non-zero.
        self.on_dead: Callable[[BaseException], None] | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.adds_submitted = 0  # by the event loop; the snapshot says how many the engine has taken in
        self.dead: BaseException | None = None
        self._fail_lock = threading.Lock()
        self.draining = False  # SIGTERM received: /ready is 503 and new requests are refused
        # Until the engine has run the warm-up steps (LLMEngine.warm_up), /ready is 503 "warming up";
        # requests submitted meanwhile wait for it.
        self.warming_up = True
        self.warmup_report = None
        # The engine's counters as of its last step (or batch of adds and aborts): what /metrics renders.
        # Written by one thread (one reference store), read by the HTTP thread.
        self._stats: StatsSnapshot | None = None
        self._core: _ThreadCore | _ProcessCore | None = None
        # LoRA load/unload calls waiting for the core's answer, by call id.
        self._lora_calls: dict[str, asyncio.Future] = {}
        self._lora_call_ids = itertools.count(1)
        if engine is not None:
            self._model_info = engine.model_info
            self._tokenizer = engine.tokenizer
            self._core = _ThreadCore(self, engine)

    @classmethod
    def build(cls, factory: Callable[[], LLMEngine]) -> AsyncEngine:
        """Build the engine in the thread that will step it (faster on CPU: see engine/owner_thread.py), and
        return once it is built; the loop starts with start()."""
        started = threading.Event()
        holder: list[_ThreadCore] = []

        def run() -> None:  # in the owner thread, once start() has set `started` (holder is filled by then)
            started.wait()
            holder[0].loop.run()

        engine, thread = start_owner_thread(factory, run, "sluice-engine")
        self = cls(engine)
        assert isinstance(self._core, _ThreadCore)
        holder.append(self._core)
        self._core.thread, self._core.started = thread, started
        return self

    @classmethod
    def spawn(cls, cfg: EngineConfig, log_level: str = "info") -> AsyncEngine:
        """Start the engine core in its own process (engine/core_process.py) and return once its model is loaded.
        A configuration the engine refuses raises ValueError with its message; any other start failure
        raises EngineDeadError."""
        self = cls(None, cfg)
        core = _ProcessCore(self, cfg, log_level)
        self._core = core
        ready = core.wait_ready()
        self._model_info = ready.model_info()
        self._stats = ready.stats
        self._tokenizer = Tokenizer.from_dir(self._model_info.model_dir)
        core.texts = OutputProcessor(self._tokenizer, core.finish, timed=cfg.otlp_traces_endpoint is not None)
        return self

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._core.start()

    def shutdown(self) -> None:
        if self._core is not None:
            self._core.shutdown(graceful=self.dead is None)

    # -- API side (event loop) -----------------------------------------------------------------
    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected (a 400) if the request can never be served; reads only fixed limits."""
        check_prompt(self._model_info, prompt_token_ids, params)

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return max(1, self._model_info.max_model_len - num_prompt_tokens)

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
        started = self._core.clock.started if self._core is not None else None
        if started is None:
            return None
        over = time.monotonic() - started - self.cfg.step_timeout
        return over if over > 0 else None

    @property
    def num_waiting(self) -> int:
        """Requests waiting for the engine: its queue as of the latest snapshot plus those submitted since
        that it had not taken in then (each counted once)."""
        return self.waiting_in(self.stats())

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            logits_processors: list[LogitsProcessor] | None = None, grammar=None,
            lora_name: str | None = None, kv_push_to: str | None = None,
            arrival_time: float | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Submit a request now (it counts as waiting from this call on: the API's queue bound is
        checked and taken in one go) and return its stream of output deltas. Leaving the stream early
        aborts the request; a stream never iterated must be aborted by the caller. grammar: the request's
        CompiledGrammar (structured output), or None. arrival_time: when its latency started
        (time.monotonic(); default now), e.g. before a decode engine's prefill hop, so TTFT counts the hop.
        priority: its place in the queue with --scheduling-policy priority (lower first)."""
        if self.dead is not None:
            raise EngineDeadError(f"engine loop died: {self.dead!r}")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        self.adds_submitted += 1
        arrived = time.monotonic() if arrival_time is None else arrival_time
        self._core.add(AddRequest(request_id, prompt_token_ids, params, arrived,
                                  grammar.spec if grammar is not None else None, lora_name, kv_push_to, priority),
                       logits_processors, grammar)
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
            if not finished and self.dead is None:
                self._core.abort(AbortRequest(request_id))

    def abort(self, request_id: str, client_left_at: float | None = None) -> None:
        """Abort a request (a no-op for one that has finished). client_left_at: when its client
        left, if that is why (the engine counts abandoned requests by how far they got)."""
        if self.dead is None:
            self._core.abort(AbortRequest(request_id, client_left_at))

    # -- LoRA adapters at run time --------------------------------------------------------------
    async def load_lora(self, name: str, path: str) -> str:
        """Serve the adapter in `path` as model `name` (the core reads and checks it). ValueError: why not."""
        return await self._lora_call(lambda cid: LoadLoRA(cid, name, path))

    async def unload_lora(self, name: str) -> str:
        """Stop serving adapter `name` (requests on it run to their end). LookupError: no such adapter."""
        return await self._lora_call(lambda cid: UnloadLoRA(cid, name))

    async def _lora_call(self, make) -> str:
        if self.dead is not None:
            raise EngineDeadError(f"engine loop died: {self.dead!r}")
        call_id = str(next(self._lora_call_ids))
        fut = asyncio.get_running_loop().create_future()
        self._lora_calls[call_id] = fut
        try:
            self._core.send(make(call_id))
            msg: LoRAUpdated = await fut
        finally:
            self._lora_calls.pop(call_id, None)
        if msg.error_kind == "not_found":
            raise LookupError(msg.error)
        if msg.error_kind == "invalid":
            raise InvalidParam(msg.error_param or "", msg.error)
        if msg.error is not None:
            raise RequestFailedError(msg.error)
        return msg.message

    def _on_lora_updated(self, msg: LoRAUpdated) -> None:
        # The served adapters first (model checks read them), then the caller's answer.
        self._model_info = dataclasses.replace(self._model_info, lora_names=tuple(msg.lora_names))
        if msg.call_id is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._answer_lora_call, msg)

    def _answer_lora_call(self, msg: LoRAUpdated) -> None:
        fut = self._lora_calls.get(msg.call_id)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    # -- from the engine -----------------------------------------------------------------------
    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        for request_id, item in items:
            q = self._streams.get(request_id)
            if q is not None:
                q.put_nowait(item)

    def _deliver_threadsafe(self, items: list) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, items)

    def _on_outputs(self, items: list, stats: StatsSnapshot | None) -> None:
        # The snapshot first (one reference store: readers get an old one or this one, whole), then the
        # outputs: a client that got its answer sees it counted.
        if stats is not None:
            self._stats = stats
        self._deliver_threadsafe(items)

    def _fail_lora_calls(self, err: BaseException) -> None:
        for fut in self._lora_calls.values():
            if not fut.done():
                fut.set_exception(err)

    def _on_warmed_up(self, report) -> None:
        self.warmup_report = report
        self.warming_up = False

    def stats(self) -> StatsSnapshot:
        """The latest snapshot the engine published (metrics.py)."""
        snap = self._stats
        if snap is None:  # an in-process engine whose loop has not published yet
            snap = self._core.loop.snapshot()  # type: ignore[union-attr]
        return snap

    def waiting_in(self, snap: StatsSnapshot) -> int:
        """The /metrics queue depth: the snapshot's waiting requests plus those submitted since that the engine
        had not taken in when it was made (each counted once)."""
        return snap.num_waiting + self.adds_submitted - snap.adds_taken

    def fail(self, e: BaseException) -> None:
        """The engine cannot serve any more (its loop died, a rank of its group was lost, its process
        exited): every open request ends with an error, /health and /ready answer 503, and on_dead runs once."""
        with self._fail_lock:
            if self.dead is not None:
                return
            self.dead = e
        self.warming_up = False
        err = EngineDeadError(f"engine loop died: {e!r}")
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(lambda: self._deliver([(rid, err) for rid in list(self._streams)]))
            self._loop.call_soon_threadsafe(self._fail_lora_calls, err)
        if self.on_dead is not None:
            self.on_dead(e)


# -- the engine in a thread of this process ------------------------------------------------------------
class _QueueInbox:
    def __init__(self) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()

    def get(self, timeout: float | None):
        try:
            return self.q.get(block=timeout is not None, timeout=timeout)
        except queue.Empty:
            return None


class _ClientOutbox:
    """The loop's outputs, straight to the client in this process."""

    def __init__(self, client: AsyncEngine):
        self.client = client

    def send(self, items, stats) -> None:
        self.client._on_outputs(items, stats)

    def warmed_up(self, report) -> None:
        self.client._on_warmed_up(report)

    def lora_updated(self, msg: LoRAUpdated) -> None:
        self.client._on_lora_updated(msg)

    def dead(self, e: BaseException) -> None:
        self.client.fail(e)


class _ThreadCore:
    def __init__(self, client: AsyncEngine, engine: LLMEngine):
        from .core_loop import EngineLoop  # the engine runs here: torch is loaded already

        self.engine = engine
        self.inbox = _QueueInbox()
        self.clock = StepClock()
        cfg = engine.cfg
        self.loop = EngineLoop(engine, self.inbox, _ClientOutbox(client), self.clock,
                               lora_modules_file=cfg.lora_modules_file)
        self.thread: threading.Thread | None = None
        self.started: threading.Event | None = None  # set: the owner thread (AsyncEngine.build) may run the loop

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self.loop.run, name="sluice-engine", daemon=True)
            self.thread.start()
        else:
            assert self.started is not None
            self.started.set()

    def add(self, add: AddRequest, logits_processors, grammar) -> None:
        procs = list(logits_processors or [])
        if grammar is not None:
            procs.append(grammar.constraint())
        add.grammar = None  # compiled here already: the constraint goes as an object
        from .core_loop import LocalAdd

        self.inbox.q.put(LocalAdd(add, procs or None))

    def abort(self, cmd: AbortRequest) -> None:
        self.inbox.q.put(cmd)

    def send(self, cmd) -> None:
        self.inbox.q.put(cmd)

    def shutdown(self, graceful: bool) -> None:
        self.loop.stop()
        self.inbox.q.put(Shutdown())
        if self.started is not None:
            self.started.set()  # a built engine whose loop never started: let its thread end
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
        if graceful:
            self.engine.shutdown()  # the other ranks stop with it


# -- the engine core in its own process --------------------------------------------------------------
class _ProcessCore:
    """Starts engine/core_process.py, sends it commands (from the event loop's thread) and reads its messages in a
    thread of its own: decoding a step's outputs is the only work the API process does for a step."""

    def __init__(self, client: AsyncEngine, cfg: EngineConfig, log_level: str):
        import zmq

        self.client = client
        self._dir = tempfile.mkdtemp(prefix="sluice-core-")
        clock_path = os.path.join(self._dir, "step-clock")
        MappedStepClock.create(clock_path)
        self.clock = MappedStepClock(clock_path)
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.bind(f"ipc://{self._dir}/commands")
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(f"ipc://{self._dir}/outputs")
        self._send_lock = threading.Lock()
        self._encoder, _ = command_codec()
        _, self._decoder = core_message_codec()
        self._reader: threading.Thread | None = None
        self._stopping = False
        # Token deltas to text deltas (detokenization, stop strings): set once the tokenizer is loaded.
        self.texts: OutputProcessor | None = None
        self.proc = subprocess.Popen([
            sys.executable, "-m", "sluice_engine.engine.core_process", "--commands", f"ipc://{self._dir}/commands",
            "--outputs", f"ipc://{self._dir}/outputs", "--clock", clock_path, "--parent-pid", str(os.getpid()),
            "--log-level", log_level])
        log.info("engine core: process %d", self.proc.pid)
        self._push.send(msgspec.msgpack.encode(cfg))

    def wait_ready(self) -> CoreReady:
        while True:
            if self._pull.poll(int(IDLE_TICK_S * 1000)):
                msg = self._decoder.decode(self._pull.recv())
                if isinstance(msg, CoreReady):
                    return msg
                if isinstance(msg, CoreDead):
                    self._reap()
                    if msg.config_error:
                        raise ValueError(msg.error)
                    raise EngineDeadError(msg.error)
                continue
            code = self.proc.poll()
            if code is not None:
                self._reap()
                raise EngineDeadError(f"the engine core process exited with code {code} before it was ready")

    def start(self) -> None:
        self._reader = threading.Thread(target=self._read, name="sluice-core-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        client = self.client
        try:
            while not self._stopping:
                if not self._pull.poll(int(IDLE_TICK_S * 1000)):
                    code = self.proc.poll()
                    if code is not None and not self._stopping:
                        client.fail(EngineDeadError(f"the engine core process exited with code {code}"))
                        return
                    continue
                msg = self._decoder.decode(self._pull.recv())
                if isinstance(msg, CoreOutputs):
                    items: list = []
                    for o in msg.outputs:
                        try:
                            text = self.texts.process(o)
                        except Exception as e:  # noqa: BLE001 - detokenizing: this request's failure alone
                            log.warning("request %s failed: %r", o.request_id, e)
                            self.texts.drop(o.request_id)
                            self.send(AbortRequest(o.request_id))
                            items.append((o.request_id, RequestFailedError(f"request failed: {e!r}")))
                            continue
                        if text is not None:
                            items.append((o.request_id, text))
                    for r in msg.refused:
                        self.texts.drop(r.request_id)
                        items.append((r.request_id, refusal_error(r)))
                    client._on_outputs(items, msg.stats)
                elif isinstance(msg, CoreWarmedUp):
                    client._on_warmed_up(msg)
                elif isinstance(msg, LoRAUpdated):
                    client._on_lora_updated(msg)
                elif isinstance(msg, CoreDead):
                    client.fail(EngineDeadError(msg.error))
                    return
        except BaseException as e:  # noqa: BLE001 - a reader that stops must not leave requests hanging
            if not self._stopping:
                log.exception("reading the engine core's outputs failed")
                client.fail(e)

    def add(self, add: AddRequest, logits_processors, grammar) -> None:
        if logits_processors:
            raise ValueError("logits processors (objects) cannot reach an engine-core process; "
                             "run the engine in this process (--no-engine-process)")
        self.texts.add(add.request_id, add.prompt_token_ids, add.params)
        self.send(add)

    def abort(self, cmd: AbortRequest) -> None:
        self.texts.drop(cmd.request_id)
        self.send(cmd)

    def finish(self, request_id: str, stop_string: str) -> None:
        """The output processor found a stop string: the core finishes the request (it may have made a token
        or two more by then, which the output processor drops)."""
        self.send(FinishRequest(request_id, stop_string))

    def send(self, cmd) -> None:
        data = self._encoder.encode(cmd)
        with self._send_lock:
            self._push.send(data, copy=False)

    def shutdown(self, graceful: bool) -> None:
        if self._stopping:
            return
        self._stopping = True
        if graceful and self.proc.poll() is None:
            try:
                self.send(Shutdown())
                self.proc.wait(timeout=10)
            except (subprocess.TimeoutExpired, self._zmq.ZMQError):
                log.warning("the engine core did not stop within 10 s: killing it")
        self._reap()

    def _reap(self) -> None:
        self._stopping = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=2)
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

