"""Issue 13: grammar compilation is bounded. A grammar that does not compile in time is a 400 naming it
as too complex, while other grammars compile meanwhile; too many waiting compiles are a 503; a compile
whose every client left before it started never runs. (Compiles are simulated: their time is the test's.)"""

import asyncio
import threading
import time

import pytest

from sluice_engine.structured import grammar as grammar_mod
from sluice_engine.structured.grammar import GrammarError, GrammarSpec, StructuredOutputs


class SlowCompiles(StructuredOutputs):
    """compile_sync takes as long as the spec's source says ("slow:<seconds>"), and records what ran."""

    def __init__(self):
        self.ran: list[str] = []
        self.release = threading.Event()
        super().__init__(tokenizer=None, vocab_size=10, stop_token_ids=[0])

    def compile_sync(self, spec):
        self.ran.append(spec.source)
        if spec.source.startswith("slow:"):
            self.release.wait(float(spec.source.split(":")[1]))
        return f"compiled {spec.source}"


def spec(source: str) -> GrammarSpec:
    return GrammarSpec("regex", source, "guided_regex")


def test_too_slow_is_a_400_and_does_not_stall_others():
    so = SlowCompiles()
    so.timeout = 0.5

    async def main():
        bomb = asyncio.create_task(so.compile(spec("slow:30")))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        assert await so.compile(spec("[a-z]+")) == "compiled [a-z]+"  # another grammar, meanwhile
        assert time.monotonic() - t0 < 0.4
        with pytest.raises(GrammarError) as e:
            await bomb
        assert e.value.status == 400 and e.value.param == "guided_regex" and "too complex" in str(e.value)
        # A retry of the same grammar waits on the compile already running instead of starting another.
        with pytest.raises(GrammarError):
            await so.compile(spec("slow:30"))
        assert so.ran.count("slow:30") == 1

    try:
        asyncio.run(main())
    finally:
        so.release.set()


def test_queue_bound_is_a_503_and_abandoned_compiles_never_run(monkeypatch):
    monkeypatch.setattr(grammar_mod, "COMPILE_THREADS", 1)
    so = SlowCompiles()
    so.max_pending = 3

    async def main():
        first = asyncio.create_task(so.compile(spec("slow:30")))  # takes the only thread
        queued = [asyncio.create_task(so.compile(spec(f"slow:{i}.{i}"))) for i in (1, 2)]
        await asyncio.sleep(0.05)
        with pytest.raises(GrammarError) as e:
            await so.compile(spec("x"))
        assert e.value.status == 503
        for t in queued:  # their clients leave before the compiles started
            t.cancel()
        await asyncio.gather(*queued, return_exceptions=True)
        so.release.set()
        assert await first == "compiled slow:30"
        assert await so.compile(spec("y")) == "compiled y"  # room again
        assert so.ran == ["slow:30", "y"]  # the abandoned compiles never ran

    try:
        asyncio.run(main())
    finally:
        so.release.set()
