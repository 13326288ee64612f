"""Issue 39: the engine core never compiles a grammar on its loop. An add whose grammar is still compiling
(on the compile threads) is held aside, not in the scheduler, and added once the compile is done; it is
refused alone when its compile fails or runs past its deadline (a 400 naming its field, across the process
boundary too), and dropped when its client leaves. (Compiles are simulated: a test releases them.)"""

import concurrent.futures
import threading
import time
from collections import deque
from types import SimpleNamespace

from sluice_engine.engine.core_loop import EngineLoop
from sluice_engine.engine.messages import AbortRequest, AddRequest, refusal, refusal_error
from sluice_engine.sampling_params import SamplingParams
from sluice_engine.structured.grammar import GrammarError, GrammarSpec, StructuredOutputs


class GatedCompiles(StructuredOutputs):
    """compile_sync waits until the test releases it; "bad" fails like a malformed grammar."""

    def __init__(self):
        super().__init__(tokenizer=None, vocab_size=10, stop_token_ids=[0])
        self.release = threading.Event()

    def compile_sync(self, spec):
        self.release.wait(30)
        if spec.source == "bad":
            raise GrammarError(f"{spec.param} does not compile: bad", param=spec.param)
        return f"compiled {spec.source}"

    def constraint(self, compiled):
        return ("constraint", compiled)


class FakeEngine:
    def __init__(self):
        self.added: list[tuple[str, list]] = []
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt_token_ids, params, procs, **_):
        self.added.append((request_id, procs))

    def abort_request(self, request_id, client_left_at=None):
        self.aborted.append(request_id)


class ListInbox:
    def __init__(self):
        self.q: deque = deque()

    def get(self, timeout):
        return self.q.popleft() if self.q else None


def make_loop():
    engine, inbox = FakeEngine(), ListInbox()
    loop = EngineLoop(engine, inbox, SimpleNamespace(), SimpleNamespace(started=None))
    loop._structured = GatedCompiles()
    return loop, engine, inbox


def add(rid: str, source: str | None = None) -> AddRequest:
    grammar = GrammarSpec("regex", source, "guided_regex") if source is not None else None
    return AddRequest(rid, [1, 2], SamplingParams(max_tokens=2), time.monotonic(), grammar)


def wait_done(loop, rid: str) -> None:
    assert concurrent.futures.wait([loop._held[rid].compiled], timeout=10).done


def test_a_compiling_grammar_is_held_then_added_and_never_blocks_the_loop():
    loop, engine, inbox = make_loop()
    try:
        inbox.q.extend([add("g", "[a-z]+"), add("plain")])
        t0 = time.monotonic()
        errors, _ = loop._drain(None)
        assert time.monotonic() - t0 < 0.5  # the compile is still blocked: the loop did not wait for it
        assert errors == [] and [rid for rid, _ in engine.added] == ["plain"]  # the other add went on
        assert list(loop._held) == ["g"] and loop.adds_taken == 1  # held: still in transit for the API
        loop._structured.release.set()
        wait_done(loop, "g")
        errors, taken = loop._drain(None)
        assert errors == [] and taken == 1 and loop.adds_taken == 2 and not loop._held
        assert engine.added[-1] == ("g", [("constraint", "compiled [a-z]+")])
        # The same grammar again: a cache hit, added at once.
        inbox.q.append(add("g2", "[a-z]+"))
        loop._drain(None)
        assert engine.added[-1] == ("g2", [("constraint", "compiled [a-z]+")]) and not loop._held
    finally:
        loop._structured.release.set()


def test_an_abort_drops_a_held_add():
    loop, engine, inbox = make_loop()
    try:
        inbox.q.extend([add("g", "x+"), AbortRequest("g")])
        assert loop._drain(None)[0] == []
        assert not loop._held and engine.added == [] and engine.aborted == [] and loop.adds_taken == 1
        loop._structured.release.set()
        assert loop._drain(None) == ([], 0) and engine.added == []
    finally:
        loop._structured.release.set()


def test_a_failed_or_late_grammar_is_refused_alone_naming_its_field():
    loop, engine, inbox = make_loop()
    try:
        loop._structured.timeout = 0.2
        inbox.q.append(add("late", "slow"))
        loop._drain(None)
        loop._structured.timeout = 30
        inbox.q.append(add("bad", "bad"))
        loop._drain(None)
        time.sleep(0.3)
        errors, _ = loop._drain(None)
        assert [rid for rid, _ in errors] == ["late"] and "too complex" in str(errors[0][1])
        assert errors[0][1].param == "guided_regex"
        loop._structured.release.set()
        wait_done(loop, "bad")
        errors, _ = loop._drain(None)
        assert [rid for rid, _ in errors] == ["bad"] and isinstance(errors[0][1], GrammarError)
        assert engine.added == [] and not loop._held and loop.adds_taken == 2
        # Across the process boundary it is the same 400, naming the field.
        again = refusal_error(refusal("bad", errors[0][1]))
        assert isinstance(again, GrammarError) and again.param == "guided_regex" and "does not compile" in str(again)
    finally:
        loop._structured.release.set()
