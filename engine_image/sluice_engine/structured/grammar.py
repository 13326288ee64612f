"""Grammar specs from API fields, and their compilation: once per spec, off the event loop and the
engine loop, cached.

xgrammar is imported on first use: it imports transformers, which costs seconds that a server
never asked for structured output should not pay (docs/architecture.md, "No transformers").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..tokenizer import Tokenizer

if TYPE_CHECKING:  # torch: imported where a constraint is made (the engine), never for compiling alone
    from .constraint import GrammarConstraint

log = logging.getLogger("sluice.structured")

# Compiled grammars kept (a JSON schema compiles in ~5-30 ms, a grammar holds a few hundred KB at most).
GRAMMAR_CACHE_SIZE = 256
# Bounds on compilation (a "grammar bomb" must not stall other structured requests): a request waits at
# most this long for its grammar (then a 400: too complex); this many compile at once, in threads
# (xgrammar releases the GIL while it compiles); at most this many wait to compile (then a 503).
COMPILE_TIMEOUT_S = 10.0
COMPILE_THREADS = 4
MAX_PENDING_COMPILES = 32
# NOTE: compiles run at the lowest CPU priority (nice 19, per thread; the xgrammar workers a compile starts inherit
# it): on a CPU box every tenant's decode comes before one request's compile, which takes what the cores leave.
# Measured on a busy 2-core AMD EPYC: beside a running decode at nice 0, 8 compile threads made its steps take
# seconds; at nice 19 the steps kept their median and the compile (0.8 s alone) took 15.7 s (then a 400 if past
# the timeout: that request's error alone). With cores to spare (a GPU server) it changes nothing. Importing
# xgrammar and indexing the vocabulary (once per server) keep the normal priority: a starved first grammar
# would time out.
COMPILE_NICE = 19
_compile_thread = threading.local()  # .background: a compile thread of ours (not a caller's own thread)

KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")


class GrammarError(ValueError):
    """A grammar the request gave (or implied) is malformed or too complex: a 400 naming `param`
    (`status` 503: the server is too busy compiling others' grammars; retry)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What to constrain the output to. `kind` and `source` (the spec as text) are the cache key;
    `param` is the request field it came from, named when it does not compile."""

    kind: str
    source: str
    param: str

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind


def grammar_spec(req: Any) -> GrammarSpec | None:
    """The grammar a completions or chat request asks for: OpenAI's `response_format`, or one of
    vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. None: free text."""
    given = [name for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
             if getattr(req, name, None) is not None]
    if given == ["response_format"] or not given:
        return _from_response_format(getattr(req, "response_format", None))
    if "response_format" in given and _from_response_format(req.response_format) is None:
        given.remove("response_format")  # {"type": "text"} beside a guided_* field
    if len(given) > 1:
        raise GrammarError(f"at most one of {', '.join(given)} may be set", param=given[1])
    name = given[0]
    value = getattr(req, name)
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise GrammarError(f"guided_json is not valid JSON: {e}", param=name) from None
        return _schema_spec(value, name)
    if name == "guided_regex":
        return GrammarSpec("regex", value, name)
    if name == "guided_choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            raise GrammarError("guided_choice must be a non-empty list of non-empty strings", param=name)
        # EBNF string literals take JSON's escapes, so json.dumps quotes any choice exactly.
        return GrammarSpec("ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value), name)
    return GrammarSpec("ebnf", value, name)


def _from_response_format(rf: dict[str, Any] | None) -> GrammarSpec | None:
    param = "response_format"
    if rf is None:
        return None
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", param)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise GrammarError("response_format of type json_schema needs json_schema.schema", param=param)
        return _schema_spec(js["schema"], param)
    raise GrammarError(f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
                       param=param)


def _schema_spec(schema: Any, param: str) -> GrammarSpec:
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{param}: a JSON schema must be an object", param=param)
    # Not sort_keys: the order of `properties` is the order the output follows.
    return GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False), param)


class StructuredOutputs:
    """Compiles grammars against one engine's vocabulary and makes per-request constraints.

    Compilation runs on a worker thread, so neither the event loop nor the engine loop waits for
    it, and each distinct spec compiles once: the cache holds the future, so concurrent requests
    with the same schema share one compilation. The xgrammar vocabulary index (TokenizerInfo) is
    built on the first compile.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Iterable[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (the logits' width), which may exceed the tokenizer's
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], concurrent.futures.Future] = OrderedDict()
        self._waiters: dict[concurrent.futures.Future, int] = {}
        self.timeout = COMPILE_TIMEOUT_S
        self.max_pending = MAX_PENDING_COMPILES
        self._executor = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="sluice-grammar",
                                            initializer=_mark_compile_thread)
        self._lock = threading.Lock()
        self._compiler = None
        self._stop_row = None  # bitmask row allowing only the stop tokens (a terminated grammar)

    async def compile(self, spec: GrammarSpec):
        """The compiled grammar for spec; GrammarError (naming spec.param) if it does not compile, does
        not compile within the timeout, or too many others are waiting to compile (503)."""
        key = (spec.kind, spec.source)
        fut = self._cache.get(key)
        if fut is None:
            if sum(1 for f in self._cache.values() if not f.done()) >= self.max_pending:
                raise GrammarError(f"{spec.param}: the server is compiling too many grammars; retry shortly",
                                   param=spec.param, status=503)
            fut = self._executor.submit(self.compile_sync, spec)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        self._waiters[fut] = self._waiters.get(fut, 0) + 1
        try:
            # Shielded: a client leaving must not cancel a compilation other requests wait on.
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout)
        except TimeoutError:
            # It keeps compiling (a thread cannot be stopped): a later request for the same grammar
            # waits on it rather than starting another.
            raise GrammarError(f"{spec.param} is too complex: it did not compile within {self.timeout:g} s",
                               param=spec.param) from None
        except GrammarError as e:
            if self._cache.get(key) is fut:
                del self._cache[key]  # failures are not cached
            raise GrammarError(str(e), param=spec.param) from None
        finally:
            self._waiters[fut] -= 1
            if not self._waiters[fut]:
                del self._waiters[fut]
                # Every request that wanted it has left: drop a compile that has not started yet.
                if fut.cancel() and self._cache.get(key) is fut:
                    del self._cache[key]

    def compile_sync(self, spec: GrammarSpec):
        compiler = self._get_compiler()
        _background_priority()
        try:
            if spec.kind == "json_schema":
                # Compact JSON (no free whitespace): a small model cannot stall in an endless run of
                # newlines, and the output is what json.dumps would print.
                return compiler.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.source)
            if spec.kind == "ebnf":
                return compiler.compile_grammar(spec.source)
            return compiler.compile_structural_tag(spec.source)
        except Exception as e:  # xgrammar reports malformed input as RuntimeError/ValueError/pydantic errors
            raise GrammarError(f"{spec.param} does not compile: {_clean_error(e)}", param=spec.param) from None

    def constraint(self, compiled) -> GrammarConstraint:
        """A fresh per-request constraint (one per choice: each has its own grammar state)."""
        from .constraint import GrammarConstraint

        if self._stop_row is None:
            self._stop_row = GrammarConstraint.stop_row(self.vocab_size, self.stop_token_ids)
        return GrammarConstraint(compiled, self._stop_row)

    def compile_future(self, spec: GrammarSpec) -> concurrent.futures.Future:
        """The engine core's: spec's compilation as a future, started on the compile threads unless the cache
        has it (done or still running). Never waits, so the engine loop never compiles: the core holds the
        request aside until the future is done (engine/core_loop.py). A failed compile is not kept."""
        key = (spec.kind, spec.source)
        fut = self._cache.get(key)
        if fut is not None and not (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            self._cache.move_to_end(key)
            return fut
        fut = self._executor.submit(self.compile_sync, spec)
        self._cache[key] = fut
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return fut

    def compiled_now(self, spec: GrammarSpec):
        """The compiled grammar, waiting for it (cached): for scripts and tests, never the engine loop."""
        return self.compile_future(spec).result()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                # NOTE: max_threads=1: xgrammar's own compile pool (8 threads by default) runs at normal priority
                # whatever ours is, and took the cores from the engine's threads for a whole compile (a ~0.5 s gap
                # in every other stream per slow schema on a quiet 2-core box: tests/faults/
                # test_grammar_compile_stall.py, p99 351 vs 77 ms; 124 vs 110 ms single-threaded). Parallel compiles
                # are ours (COMPILE_THREADS), each at nice 19.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # we cache, by spec
                self._stop_row = None  # made with the first constraint (it is a tensor: torch)
                log.info("structured output: vocabulary indexed (%d tokens, %s)", self.vocab_size,
                         info.vocab_type.name)
            return self._compiler


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A request's grammar as the API compiled it: the spec (what crosses to an engine-core process, which
    compiles it again, cached, off its loop) and the compiled grammar (what an engine in this process
    constrains with)."""

    spec: GrammarSpec
    compiled: Any
    structured: StructuredOutputs

    def constraint(self) -> GrammarConstraint:
        return self.structured.constraint(self.compiled)


def _mark_compile_thread() -> None:
    _compile_thread.background = True


def _background_priority() -> None:
    """A compile thread of ours drops to COMPILE_NICE (for good: a thread cannot raise its priority again)."""
    if not getattr(_compile_thread, "background", False) or getattr(_compile_thread, "niced", False):
        return
    _compile_thread.niced = True
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)  # Linux: this thread alone
    except (AttributeError, OSError):  # not Linux, or not allowed: compiles run at the process's priority
        log.debug("grammar compile threads run at normal priority", exc_info=True)


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the vocabulary, built from tokenizer.json alone (no transformers tokenizer).

    Ids past the tokenizer's vocabulary (a model's padded vocab) and special tokens get the empty
    string, which xgrammar never allows; the stop tokens are allowed where the grammar can end.
    """
    import xgrammar as xgr

    backend = tokenizer.backend
    encoded: list[str] = [""] * vocab_size
    for token, idx in backend.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = token
    for idx, added in backend.get_added_tokens_decoder().items():
        if added.special and idx < vocab_size:
            encoded[idx] = ""  # <|im_start|> and the like: never grammar text
    # NOTE: the byte-level / byte-fallback detection is xgrammar's own, from the serialized
    # tokenizer (what TokenizerInfo.from_huggingface uses), so both agree on how tokens decode.
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                             add_prefix_space=meta["add_prefix_space"])


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _clean_error(e: Exception) -> str:
    """xgrammar's C++ messages start with a timestamp and a source location; keep the message."""
    text = str(e).strip()
    text = _LOG_PREFIX.sub("", text.splitlines()[0] if text else type(e).__name__)
    return text or type(e).__name__
