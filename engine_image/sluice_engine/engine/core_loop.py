"""The engine's own loop: take in commands, step, hand out each step's outputs and a stats snapshot.

One loop per engine, run in the thread that built the engine (AsyncEngine's in-process mode) or as the main
loop of the engine-core process (engine/core_process.py). Where commands come from and where outputs go is the
`Inbox` and the `Outbox`: a queue and the event loop in one process, ZMQ sockets across two. The loop is
the same either way, so both modes keep every promise the server makes (docs/reliability.md): an add that
fails is that request's error alone, a loop that dies fails every open request and says so once.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from ..core.request import LogitsProcessor
from ..metrics import StatsSnapshot
from ..objectives import ObjectivesFile
from .llm_engine import LLMEngine
from .messages import (
    AbortRequest,
    AddRequest,
    FinishRequest,
    LoadLoRA,
    LoRAUpdated,
    RequestFailedError,
    Shutdown,
    UnloadLoRA,
)
from .output import RequestOutput
from .step_clock import IDLE_TICK_S, StepClock

log = logging.getLogger("sluice.engine")

OBJECTIVES_POLL_S = 1.0
# How often an idle loop that holds adds aside (their grammars compiling) looks whether one is ready. NOTE: a
# poll, not a wake-up: an idle loop waits in inbox.get(), and the ZMQ inbox (core_process.py) has no way to be
# woken from a compile thread. Only while an add is held and nothing runs; 5 ms beside a compile of 10 ms-10 s.
HELD_POLL_S = 0.005


@dataclass(slots=True)
class LocalAdd:
    """An add from the same process: it may carry logits processors (objects, which cannot cross processes)."""

    add: AddRequest
    logits_processors: list[LogitsProcessor] | None


@dataclass(slots=True)
class HeldAdd:
    """An add whose grammar the core is still compiling: held aside, not in the scheduler, until the compile is
    done (then added), its deadline passes (then refused: too complex) or its client leaves (then dropped)."""

    add: AddRequest
    logits_processors: list[LogitsProcessor] | None
    compiled: concurrent.futures.Future
    deadline: float  # time.monotonic()


class Inbox(Protocol):
    def get(self, timeout: float | None) -> AddRequest | LocalAdd | AbortRequest | Shutdown | None:
        """The next command; None if none came within `timeout` seconds (None: do not wait)."""


class Outbox(Protocol):
    def send(self, items: list[tuple[str, RequestOutput | BaseException]], stats: StatsSnapshot | None) -> None:
        """Hand out a step's outputs (and refused adds), after its stats snapshot (None: unchanged)."""

    def warmed_up(self, report) -> None: ...

    def lora_updated(self, msg: LoRAUpdated) -> None:
        """The adapters served changed (or a load/unload call is answered)."""

    def dead(self, e: BaseException) -> None:
        """The loop cannot serve any more: every open request fails, the server says so and exits."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, inbox: Inbox, outbox: Outbox, clock: StepClock,
                 objectives_file: str | None = None, lora_modules_file: str | None = None):
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.clock = clock
        self.adds_taken = 0  # adds taken into the engine: the API counts the ones still in transit from it
        self.dead: BaseException | None = None
        self._stop = False
        self._fail_lock = threading.Lock()
        # The core process applies the objectives file itself (in one process the /metrics scrape does).
        self._objectives = ObjectivesFile(objectives_file) if objectives_file else None
        self._objectives_checked = 0.0
        self._lora_sync = None
        if lora_modules_file:
            from ..lora.modules_file import LoRAModulesSync

            self._lora_sync = LoRAModulesSync(lora_modules_file)
        # Compiles an AddRequest's grammar (a spec from another process) on its own threads: built on first use.
        self._structured = None
        self._held: dict[str, HeldAdd] = {}  # request id -> its add, while its grammar compiles
        engine.before_schedule = self._take_commands
        engine.after_schedule = self._publish_now
        executor = getattr(engine, "executor", None)
        if executor is not None:
            executor.on_failure = self.fail

    def snapshot(self) -> StatsSnapshot:
        return dataclasses.replace(self.engine.stats_snapshot(), adds_taken=self.adds_taken)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        """Warm up, then serve until Shutdown (or until the loop fails: fail() has then told everyone)."""
        if self._stop:  # shut down before it ever started
            return
        self.outbox.send([], self.snapshot())
        if not self._warm_up():
            return
        self.outbox.send([], self.snapshot())  # what the warm-up changed
        torch.set_grad_enabled(False)
        engine = self.engine
        try:
            while not self._stop and self.dead is None:
                changed = self._poll_objectives()
                changed |= engine.kv_idle_work()  # blocks other engines sent; pushes finished (their metrics)
                busy = engine.has_unfinished()
                errors, taken = self._drain(None if busy else HELD_POLL_S if self._held else IDLE_TICK_S)
                if self._stop:
                    break
                if not engine.has_unfinished():
                    # What the adds, aborts or objectives changed (an idle tick changes nothing: no message);
                    # a step publishes once it has scheduled.
                    if taken or changed:
                        self.outbox.send(errors, self.snapshot())
                    engine.keepalive()
                    continue
                if errors:
                    self.outbox.send(errors, None)
                self.clock.started = time.monotonic()
                outs = engine.step()
                self.clock.started = None
                # The snapshot goes before the outputs: a client that got its answer sees it counted.
                self.outbox.send([(o.request_id, o) for o in outs], self.snapshot())
        except BaseException as e:  # the loop must never die silently: fail every open request
            log.exception("engine loop failed")
            self.fail(e)

    def stop(self) -> None:
        self._stop = True

    def _warm_up(self) -> bool:
        """Before the loop. A warm-up that fails is the engine's failure: the server never reports ready and
        exits non-zero, instead of dying on its first request."""
        try:
            report = self.engine.warm_up(on_step=self._on_warmup_step)
        except BaseException as e:  # noqa: BLE001 - reported through fail(), like a failed step
            log.exception("warm-up failed")
            self.clock.started = None
            self.fail(e)
            return False
        self.clock.started = None
        self.outbox.warmed_up(report)
        return True

    def _on_warmup_step(self, started: float | None) -> None:
        self.clock.started = started  # a dummy step is a step: the watchdog covers it

    def _poll_objectives(self) -> bool:
        """Apply the objectives file and the adapters file if they changed (checked once a second at most);
        whether anything changed."""
        if self._objectives is None and self._lora_sync is None:
            return False
        now = time.monotonic()
        if now - self._objectives_checked < OBJECTIVES_POLL_S:
            return False
        self._objectives_checked = now
        changed = False
        if self._objectives is not None:
            o = self._objectives.changed()
            if o is not None:
                self.engine.metrics.set_objectives(o)
                changed = True
        if self._lora_sync is not None:
            try:
                loras_changed = self._lora_sync.sync(self.engine)
            except Exception:  # noqa: BLE001 - a bad adapter file never stops the engine
                log.exception("applying %s failed", self._lora_sync.file.path)
                loras_changed = False
            if loras_changed:
                self.outbox.lora_updated(LoRAUpdated(None, sorted(self.engine.loras)))
            changed |= loras_changed
        return changed

    # -- commands ------------------------------------------------------------------------------
    def _take_commands(self) -> None:
        # Right before each schedule: an abort that arrived during the previous step (a client that left) is
        # applied before its request could be admitted.
        errors, _ = self._drain(None)
        if errors:
            self.outbox.send(errors, None)

    def _publish_now(self) -> None:
        # A step has been scheduled (the queue as the scheduler left it): the snapshot goes out at once, so
        # /metrics shows the queue while a long step runs.
        self.outbox.send([], self.snapshot())

    def _drain(self, timeout: float | None) -> tuple[list[tuple[str, BaseException]], int]:
        """Add the held adds whose grammar is ready, then apply the commands waiting (the first waited for up to
        `timeout` s, unless a held add was just taken): the adds refused, and how many were applied or taken."""
        errors: list[tuple[str, BaseException]] = []
        taken = self._take_held(errors) if self._held else 0
        if taken:
            timeout = None
        while True:
            cmd = self.inbox.get(timeout)
            timeout = None
            if cmd is None:
                return errors, taken
            taken += 1
            if isinstance(cmd, Shutdown):
                self._stop = True
                return errors, taken
            if isinstance(cmd, AbortRequest):
                if self._held.pop(cmd.request_id, None) is not None:
                    self.adds_taken += 1  # it never reaches the engine: the API stops counting it in transit
                    continue
                self.engine.abort_request(cmd.request_id, client_left_at=cmd.client_left_at)
                continue
            if isinstance(cmd, FinishRequest):
                self.engine.finish_request(cmd.request_id, cmd.stop_string)
                continue
            if isinstance(cmd, LoadLoRA | UnloadLoRA):
                self.outbox.lora_updated(self._lora_call(cmd))
                continue
            add, procs = (cmd.add, cmd.logits_processors) if isinstance(cmd, LocalAdd) else (cmd, None)
            if add.grammar is not None:
                try:
                    compiled = self._compile(add.grammar)
                except Exception as e:  # noqa: BLE001 - this request's own failure, never the loop's
                    self.adds_taken += 1
                    errors.append((add.request_id, RequestFailedError(f"request failed in the engine: {e!r}")))
                    continue
                if not compiled.done():
                    # Held aside until its grammar is ready: the scheduler never waits on a compile. It counts as
                    # in transit (the API's queue depth) until it is added, refused or dropped.
                    self._held[add.request_id] = HeldAdd(add, procs, compiled, time.monotonic() + self._structured.timeout)
                    continue
                procs = self._with_constraint(add, procs, compiled, errors)
                if procs is None:
                    self.adds_taken += 1
                    continue
            self._add(add, procs, errors)

    def _add(self, add: AddRequest, procs: list[LogitsProcessor] | None,
             errors: list[tuple[str, BaseException]]) -> None:
        self.adds_taken += 1
        try:
            self.engine.add_request(add.request_id, add.prompt_token_ids, add.params, procs,
                                    arrival_time=add.arrival_time, lora_name=add.lora_name,
                                    kv_push_to=add.kv_push_to, priority=add.priority)
        except ValueError as e:
            errors.append((add.request_id, e))
        except Exception as e:  # noqa: BLE001 - this request's own failure, never the loop's
            log.warning("request %s could not be added: %r", add.request_id, e)
            errors.append((add.request_id, RequestFailedError(f"request failed in the engine: {e!r}")))

    # -- grammars (an add from another process carries its spec) --------------------------------
    # NOTE: the core compiles the spec again, on its own threads, instead of receiving the API's compiled grammar
    # serialized: xgrammar 0.2.9's CompiledGrammar.serialize_json holds the token-mask cache as JSON, 2.3 MB for
    # a schema that compiles in 0.4 s and 12 MB (deserialized in ~300 ms, on the loop's GIL) for one of 3.5 s,
    # and even a 4 ms regex takes ~8 ms to deserialize. A compile on a thread costs the loop nothing (xgrammar
    # releases the GIL), and a spec seen before is a cache hit: most requests are never held at all.
    def _compile(self, spec) -> concurrent.futures.Future:
        if self._structured is None:
            from ..structured import StructuredOutputs

            info = self.engine.model_info
            self._structured = StructuredOutputs(self.engine.tokenizer, info.vocab_size, info.eos_token_ids)
        return self._structured.compile_future(spec)

    def _with_constraint(self, add: AddRequest, procs: list[LogitsProcessor] | None,
                         compiled: concurrent.futures.Future,
                         errors: list[tuple[str, BaseException]]) -> list[LogitsProcessor] | None:
        """procs and the add's grammar constraint (its compile done); None if the grammar failed (refused)."""
        e = compiled.exception()
        if e is None:
            try:
                return [*(procs or []), self._structured.constraint(compiled.result())]
            except Exception as err:  # noqa: BLE001 - this request's own failure, never the loop's
                e = err
        if not isinstance(e, ValueError):  # GrammarError names its field: a 400; anything else is the engine's
            log.warning("request %s: its grammar failed in the engine: %r", add.request_id, e)
            e = RequestFailedError(f"request failed in the engine: {e!r}")
        errors.append((add.request_id, e))
        return None

    def _take_held(self, errors: list[tuple[str, BaseException]]) -> int:
        """Add the held adds whose grammar is ready; refuse those past their deadline: how many left the hold."""
        from ..structured import GrammarError

        now = time.monotonic()
        left = 0
        for rid, held in list(self._held.items()):
            if held.compiled.done():
                del self._held[rid]
                procs = self._with_constraint(held.add, held.logits_processors, held.compiled, errors)
                if procs is None:
                    self.adds_taken += 1
                else:
                    self._add(held.add, procs, errors)
                left += 1
            elif now >= held.deadline:  # it keeps compiling (a thread cannot be stopped): a retry waits on it
                del self._held[rid]
                self.adds_taken += 1
                param = held.add.grammar.param
                # The API waited as long at most for the same compile: the core gives its own as long.
                errors.append((rid, GrammarError(f"{param} is too complex: it did not compile within "
                                                 f"{self._structured.timeout:g} s", param=param)))
                left += 1
        return left

    def _lora_call(self, cmd: LoadLoRA | UnloadLoRA) -> LoRAUpdated:
        from ..core.lora_slots import LoRANotFound
        from ..lora.paths import resolve_under_root

        engine = self.engine
        try:
            if isinstance(cmd, LoadLoRA):
                # The server checked the path against --lora-root already; checked again where it is read, so a
                # load that reaches the core some other way cannot leave the root either.
                engine.load_lora(cmd.name, resolve_under_root(cmd.path, engine.cfg.lora_root))
                message = f"LoRA adapter {cmd.name!r} loaded"
            else:
                left = engine.unload_lora(cmd.name)
                message = f"LoRA adapter {cmd.name!r} unloaded" + (
                    f"; the {left} request(s) on it run to their end first" if left else "")
        except LoRANotFound as e:
            return LoRAUpdated(cmd.call_id, sorted(engine.loras), str(e.args[0]), "not_found")
        except ValueError as e:  # LoRAError names its field; an adapter that does not fit is its path's fault
            return LoRAUpdated(cmd.call_id, sorted(engine.loras), str(e), "invalid", getattr(e, "param", "lora_path"))
        except Exception as e:  # noqa: BLE001 - the call fails, the engine serves on
            log.exception("LoRA %s failed", type(cmd).__name__)
            return LoRAUpdated(cmd.call_id, sorted(engine.loras), f"{type(e).__name__}: {e}", "failed")
        log.info("%s", message)
        return LoRAUpdated(cmd.call_id, sorted(engine.loras), message=message)

    # -- failure -------------------------------------------------------------------------------
    def fail(self, e: BaseException) -> None:
        """The engine cannot serve any more (its loop died, or a rank of its group was lost): every open
        request ends with an error, and the outbox says so once."""
        with self._fail_lock:  # the loop's thread, or the executor's watcher of the other ranks
            if self.dead is not None:
                return
            self.dead = e
        engine = self.engine
        # Every request in flight fails, the held ones too.
        engine.stats.finished["error"] += len(engine.scheduler.requests) + len(self._held)
        try:
            self.outbox.send([], self.snapshot())  # the loop is stopped or stopping: this is the last snapshot
        except Exception:  # noqa: BLE001 - the failure itself must still be told
            log.exception("could not publish the last snapshot")
        self.outbox.dead(e)
