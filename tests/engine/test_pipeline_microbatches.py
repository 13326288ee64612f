"""Issue 12, pipeline parallelism keeps its stages busy: with --pipeline-parallel-size 2 the engine has
two micro-batches (virtual engines) in flight, and what it generates is token for token what one
process generates -- with requests aborted while their step is in flight, and with no block leaked."""

import pytest
from servers import free_port

from sluice_engine.distributed.parallel_state import destroy_distributed
from sluice_engine.entrypoints.llm import LLM
from sluice_engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [f"Story number {i}: once upon a time, in a land" for i in range(10)]
PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def generate(engine, abort_after: int | None = None) -> tuple[dict, int]:
    """Greedy outputs by request id; the most steps ever in flight at once."""
    ids = engine.tokenizer.encode
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", ids(p), PARAMS)
    out = {f"r{i}": [] for i in range(len(PROMPTS))}
    most = steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        steps += 1
        most = max(most, len(engine._in_flight) + 1)
        if steps == abort_after:
            in_flight = {s.request_id for st in engine._in_flight for s in st.sched.scheduled}
            victims = sorted(in_flight)[:2]
            assert victims, "nothing in flight to abort"
            for v in victims:
                engine.abort_request(v)
                out.pop(v)
    assert engine.kv.usage() == 0 and not engine._in_flight
    return out, most


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(str(model_dir), kv_cache_memory=64 << 20)
    return generate(llm.engine)[0]


def test_two_micro_batches_in_flight_same_tokens(model_dir, reference):
    llm = LLM(str(model_dir), kv_cache_memory=64 << 20, pipeline_parallel_size=2, master_port=free_port())
    try:
        got, most = generate(llm.engine)
        assert most == 2  # a second micro-batch started before the first one's logits came back
        assert got == reference
        aborted, _ = generate(llm.engine, abort_after=6)
        assert len(aborted) == len(PROMPTS) - 2
        assert all(aborted[k] == reference[k] for k in aborted)
    finally:
        llm.engine.shutdown()
        destroy_distributed()
