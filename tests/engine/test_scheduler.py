"""The scheduler as counter arithmetic: chunked prefill, the token budget, preemption by recompute."""

from sluice_engine.core.kv_cache import KVCacheManager
from sluice_engine.core.request import FinishReason, Request, RequestStatus
from sluice_engine.core.sched_output import PLACEHOLDER
from sluice_engine.core.scheduler import Scheduler
from sluice_engine.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, max_seqs=8, budget=16, caching=True):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(kv, max_seqs, budget), kv


def run_step(s: Scheduler, token=7):
    """Plays the model runner: advances counters; a request caught up with its tokens samples one."""
    out = s.schedule()
    for sr in out.scheduled:
        req, n = s.requests[sr.request_id], sr.num_tokens
        assert sr.token_ids == req.all_token_ids[sr.start : sr.end] and sr.start == req.num_computed_tokens
        assert len(sr.block_ids) * s.kv.block_size >= sr.end  # the plain step holds all the runner needs
        s.update_from_output(req, n, 0, sr.samples)
        if sr.samples:
            req.append_output_token(token)
            if req.num_output_tokens >= req.params.max_tokens:
                s.finish(req, FinishReason.LENGTH)
    return out


def test_long_prompt_is_chunked_within_budget():
    s, _ = make(budget=16)
    r = Request("a", list(range(40)), SamplingParams(max_tokens=2))
    s.add(r)
    sizes = [run_step(s).num_tokens for _ in range(3)]
    assert sizes == [16, 16, 8]
    assert r.num_output_tokens == 1  # sampled only when the prompt was fully computed


def test_running_first_then_waiting_and_max_num_seqs():
    s, _ = make(budget=100, max_seqs=2)
    reqs = [Request(f"r{i}", list(range(5)), SamplingParams(max_tokens=3)) for i in range(3)]
    for r in reqs:
        s.add(r)
    out = run_step(s)
    assert [r.request_id for r in out.scheduled] == ["r0", "r1"]
    out = run_step(s)
    assert [(r.request_id, r.num_tokens) for r in out.scheduled] == [("r0", 1), ("r1", 1)]
    run_step(s)  # r0, r1 finish
    out = run_step(s)
    assert [r.request_id for r in out.scheduled] == ["r2"]


def test_preemption_by_recompute_when_blocks_run_out():
    # 4 blocks of 4 tokens; two requests of 7 prompt tokens each need 2 blocks, then grow.
    s, kv = make(num_blocks=4, block_size=4, budget=64, caching=False)
    a = Request("a", list(range(7)), SamplingParams(max_tokens=6))
    b = Request("b", list(range(100, 107)), SamplingParams(max_tokens=6))
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled (7 tokens, 2 blocks each): the pool is full
    run_step(s)  # position 7 still fits in the second block
    out = run_step(s)  # both need a third block: only a can have one -> b (admitted last) is preempted
    assert b.request_id in out.preempted and b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert s.waiting[0] is b and s.num_preemptions == 1
    while s.has_work():
        run_step(s)
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert kv.num_free_blocks() == 4


def test_finish_frees_blocks_and_abort_of_waiting():
    s, kv = make()
    a = Request("a", list(range(9)), SamplingParams(max_tokens=4))
    b = Request("b", list(range(9)), SamplingParams(max_tokens=4))
    s.add(a)
    run_step(s)
    s.add(b)
    s.finish(a, FinishReason.ABORT)
    s.finish(b, FinishReason.ABORT)
    assert not s.has_work() and kv.num_free_blocks() == kv.num_blocks
    assert a.finish_reason is FinishReason.ABORT


def test_virtual_engines_partition_requests_and_preempt_only_their_own():
    """Pipeline parallelism: two virtual engines step disjoint halves; when blocks run out, the engine
    being scheduled preempts its own latest request, never one of the other's (whose step may be in flight)."""
    kv = KVCacheManager(6, 4, False)
    s = Scheduler(kv, 8, 64, num_virtual=2)
    reqs = [Request(f"r{i}", list(range(10 * i, 10 * i + 7)), SamplingParams(max_tokens=6)) for i in range(3)]
    for r in reqs:
        s.add(r)
    assert [r.virtual_engine for r in reqs] == [0, 1, 0]  # least loaded first
    assert s.max_num_seqs == 4  # max_num_seqs split over the virtual engines

    def step(ve):
        out = s.schedule(ve)
        assert {s.requests[x.request_id].virtual_engine for x in out.scheduled} <= {ve}
        for sr in out.scheduled:
            req = s.requests[sr.request_id]
            s.update_from_output(req, sr.num_tokens, 0, sr.samples)
            if sr.samples:
                req.append_output_token(7)
                if req.num_output_tokens >= req.params.max_tokens:
                    s.finish(req, FinishReason.LENGTH)
        return out

    assert [x.request_id for x in step(0).scheduled] == ["r0", "r2"]  # 4 of the 6 blocks
    assert [x.request_id for x in step(1).scheduled] == ["r1"]  # the last 2
    step(0)  # position 7 fits
    step(1)
    out = step(0)  # r0 and r2 need a third block, none is free: r2 (ve 0's latest) goes, not r1
    assert out.preempted == ["r2"] and reqs[1].status is RequestStatus.RUNNING
    while s.has_work():
        step(0)
        step(1)
    assert all(r.num_output_tokens == 6 for r in reqs) and kv.num_free_blocks() == 6


# -- async scheduling: a step scheduled while the one before is in flight ------------------------------------
def test_a_step_ahead_reads_the_token_in_flight_as_a_placeholder():
    s, _ = make(budget=64)
    r = Request("a", list(range(5)), SamplingParams(max_tokens=4))
    s.add(r)
    first = s.schedule()  # the prompt; samples token 5
    (sr,) = first.scheduled
    assert sr.token_ids == list(range(5)) and sr.samples
    assert (r.num_computed_tokens, r.num_in_flight_tokens, r.num_output_placeholders) == (0, 5, 1)
    ahead = s.schedule()  # before the prompt's step is back: one token, not known yet
    (sa,) = ahead.scheduled
    assert sa.token_ids == [PLACEHOLDER] and sa.start == 5 and sa.samples
    assert len(sa.block_ids) * s.kv.block_size >= 6
    # The prompt's step comes back with its token: counters as if it had run alone, one step still in flight.
    s.update_from_output(r, 5, 0, True)
    r.append_output_token(42)
    assert (r.num_computed_tokens, r.num_in_flight_tokens, r.num_output_placeholders) == (5, 1, 1)
    nxt = s.schedule()  # the token at 6 is the one the step ahead samples: a placeholder again
    assert nxt.scheduled[0].token_ids == [PLACEHOLDER] and nxt.scheduled[0].start == 6


def test_a_request_whose_tokens_in_flight_reach_its_length_waits_for_them():
    s, _ = make(budget=64)
    r = Request("a", list(range(5)), SamplingParams(max_tokens=1))
    s.add(r)
    s.schedule()  # its one token is in flight
    assert s.schedule().is_empty  # no second step: the first may end it
    s.update_from_output(r, 5, 0, True)
    r.append_output_token(42)
    s.finish(r, FinishReason.LENGTH)
    assert not s.has_work()


def test_a_request_preempted_with_a_step_in_flight_keeps_that_steps_token():
    s, kv = make(num_blocks=4, block_size=4, budget=64, caching=False)
    a = Request("a", list(range(7)), SamplingParams(max_tokens=6))
    b = Request("b", list(range(100, 107)), SamplingParams(max_tokens=6))
    s.add(a)
    s.add(b)
    first = s.schedule()  # both prompts (2 blocks each): the pool is full
    assert [x.request_id for x in first.scheduled] == ["a", "b"]
    ahead = s.schedule()  # position 7 fits in each second block
    assert [x.token_ids for x in ahead.scheduled] == [[PLACEHOLDER], [PLACEHOLDER]]
    for req in (a, b):  # the prompts' step comes back
        s.update_from_output(req, 7, 0, True)
        req.append_output_token(1)
    third = s.schedule()  # position 8 needs a third block each: b is preempted with its step ahead in flight
    assert third.preempted == ["b"] and b.status is RequestStatus.WAITING
    assert (b.num_computed_tokens, b.num_in_flight_tokens, b.num_output_placeholders) == (0, 0, 0)
    # That step comes back: b's token counts (as it would have, run alone, before the preemption); its counters
    # stay those of a request about to recompute from the start.
    s.update_from_output(a, 1, 0, True)
    a.append_output_token(2)
    s.update_from_output(b, 1, 0, True)
    b.append_output_token(2)
    assert b.num_tokens == 9 and b.num_computed_tokens == 0 and b.num_in_flight_tokens == 0
