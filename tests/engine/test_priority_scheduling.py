"""--scheduling-policy priority (vLLM's semantics: a lower `priority` is served earlier; docs/engine-flags.md): the
scheduler's order and preemption as counter arithmetic, then a real `sluice serve` through the `openai` client."""

import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI

from sluice_engine.core.kv_cache import KVCacheManager
from sluice_engine.core.request import FinishReason, Request, RequestStatus
from sluice_engine.core.scheduler import Scheduler
from sluice_engine.sampling_params import MAX_PRIORITY, SamplingParams


def make(policy="priority", num_blocks=64, block_size=4, max_seqs=8, budget=64):
    kv = KVCacheManager(num_blocks, block_size, False)
    return Scheduler(kv, max_seqs, budget, policy=policy), kv


def req(rid: str, priority: int, arrival: float, prompt_len=7, max_tokens=6) -> Request:
    return Request(rid, list(range(100 * len(rid), 100 * len(rid) + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   arrival_time=arrival, priority=priority)


def run_step(s: Scheduler, token=7):
    """Plays the model runner (test_scheduler.py's): advances counters, samples once a request has caught up."""
    out = s.schedule()
    for sr in out.scheduled:
        r = s.requests[sr.request_id]
        s.update_from_output(r, sr.num_tokens, 0, sr.samples)
        if sr.samples:
            r.append_output_token(token)
            if r.num_output_tokens >= r.params.max_tokens:
                s.finish(r, FinishReason.LENGTH)
    return out


def admission_order(s: Scheduler, reqs: list[Request]) -> list[str]:
    for r in reqs:
        s.add(r)
    order = []
    while s.has_work():
        order += [sr.request_id for sr in run_step(s).scheduled if sr.request_id not in order]
    return order


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s, _ = make(max_seqs=1)
    reqs = [req("a", 0, 1.0, max_tokens=1), req("b", -1, 2.0, max_tokens=1), req("c", 0, 0.5, max_tokens=1),
            req("d", -1, 3.0, max_tokens=1), req("e", 0, 1.0, max_tokens=1)]  # e: a's twin, added after it
    assert admission_order(s, reqs) == ["b", "d", "c", "a", "e"]


def test_fcfs_ignores_priority():
    s, _ = make(policy="fcfs", max_seqs=1)
    reqs = [req("a", 0, 1.0, max_tokens=1), req("b", -1, 2.0, max_tokens=1), req("c", 0, 0.5, max_tokens=1)]
    assert admission_order(s, reqs) == ["a", "b", "c"]


def fill_pool(s: Scheduler, running: list[Request]) -> None:
    """Admit and prefill `running`: 7-token prompts take 2 blocks of 4 each (in a pool of 4, two fill it)."""
    for r in running:
        s.add(r)
    out = run_step(s)
    assert sorted(sr.request_id for sr in out.scheduled) == sorted(r.request_id for r in running)
    assert s.kv.num_free_blocks() == s.kv.num_blocks - 2 * len(running)


def test_an_urgent_request_preempts_the_least_urgent_running_one():
    s, _ = make(num_blocks=4)
    # lo5 was admitted first but is the least urgent; lo3 arrived later with a better priority.
    lo5, lo3 = req("lo5", 5, 1.0), req("lo3", 3, 2.0)
    fill_pool(s, [lo5, lo3])
    hi = req("hi", 0, 3.0, prompt_len=3)
    s.add(hi)
    out = run_step(s)
    assert out.preempted == ["lo5"]  # under fcfs it would wait (and lo3, the latest admitted, be the victim)
    assert [sr.request_id for sr in out.scheduled] == ["lo3", "hi"]  # admitted in the same step
    assert lo5.status is RequestStatus.WAITING and lo5.num_computed_tokens == 0
    assert [r.request_id for r in s.running] == ["hi", "lo3"]  # most urgent first
    while s.has_work():
        run_step(s)
    assert lo5.num_output_tokens == lo3.num_output_tokens == hi.num_output_tokens == 6


def test_among_equal_priorities_the_latest_arrival_is_preempted_first():
    s, _ = make(num_blocks=6)
    a, b, c = req("a", 5, 1.0), req("b", 5, 2.0), req("c", 5, 3.0, prompt_len=3)
    fill_pool(s, [a, b])
    s.add(c)
    run_step(s)  # c (equal priority) fits in the two free blocks
    s.add(req("hi", 0, 4.0, prompt_len=9))  # 3 blocks: two running requests must go
    out = run_step(s)
    assert out.preempted == ["c", "b"] and [sr.request_id for sr in out.scheduled] == ["a", "hi"]


@pytest.mark.parametrize("short_of", ["blocks", "slots"])
def test_equal_priorities_never_preempt_each_other(short_of):
    s, _ = make(num_blocks=6) if short_of == "blocks" else make(max_seqs=2)
    a, b = req("a", 5, 1.0, max_tokens=3), req("b", 5, 2.0, max_tokens=3)
    fill_pool(s, [a, b])
    same = req("same", 5, 0.0, prompt_len=9)  # 3 blocks; even arriving first, it waits for room
    s.add(same)
    while same.first_scheduled_time is None:
        out = run_step(s)
        assert not out.preempted
    assert a.is_finished and b.is_finished  # it got its turn when they were done, not before


def test_a_more_urgent_request_is_never_preempted_for_a_less_urgent_one():
    s, _ = make(num_blocks=4)
    hi, mid = req("hi", 0, 1.0), req("mid", 1, 2.0)
    fill_pool(s, [hi, mid])
    s.add(lo := req("lo", 9, 0.0, prompt_len=3))
    out = run_step(s)
    assert out.preempted == [] and lo.status is RequestStatus.WAITING


def test_a_batch_slot_and_the_token_budget_count_as_room_too():
    # One slot: the urgent request takes it from the running one.
    s, _ = make(max_seqs=1)
    s.add(lo := req("lo", 1, 1.0))
    run_step(s)
    s.add(req("hi", 0, 2.0))
    out = run_step(s)
    assert out.preempted == ["lo"] and [sr.request_id for sr in out.scheduled] == ["hi"]
    # The budget: a long prompt prefilling takes all of it; the urgent request preempts it to get a chunk.
    s, _ = make(budget=16, num_blocks=64)
    s.add(long := req("long", 1, 1.0, prompt_len=60))
    run_step(s)
    s.add(req("hi", 0, 2.0, prompt_len=5))
    out = run_step(s)
    assert out.preempted == ["long"] and [(sr.request_id, sr.num_tokens) for sr in out.scheduled] == [("hi", 5)]
    assert long.status is RequestStatus.WAITING  # not readmitted in the step that preempted it
    out = run_step(s)
    assert [(sr.request_id, sr.num_tokens) for sr in out.scheduled] == [("hi", 1), ("long", 15)]
    assert lo.status is RequestStatus.WAITING


def test_running_requests_out_of_blocks_preempt_the_least_urgent_not_the_latest():
    for policy, victim in (("fcfs", "hi"), ("priority", "lo")):
        s, _ = make(policy=policy, num_blocks=4)
        lo, hi = req("lo", 9, 1.0, max_tokens=8), req("hi", 0, 2.0, max_tokens=8)
        fill_pool(s, [lo, hi])
        preempted = []
        while s.has_work():
            preempted += run_step(s).preempted
        assert preempted[0] == victim, policy


# -- the server ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(start_server):
    # One request runs at a time: the queue's order is all there is to see.
    return start_server("--scheduling-policy", "priority", "--max-num-seqs", "1", "--max-model-len", "256")


def client_of(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=600, max_retries=0)


@pytest.mark.slow
@pytest.mark.parametrize("value", [True, 1.5, "1", MAX_PRIORITY + 1, -MAX_PRIORITY - 1])
def test_a_priority_that_is_not_a_bounded_integer_is_a_400(server, value):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(f"{server.url}{path}", json={"model": server.model, "max_tokens": 1, "priority": value, **body})
        assert r.status_code == 400, (path, value)
        assert r.json()["error"]["param"] == "priority", r.json()


@pytest.mark.slow
def test_an_urgent_request_submitted_last_finishes_first(server):
    client = client_of(server)
    done: dict[str, float] = {}
    first_token: dict[str, float] = {}

    def run(name: str, priority: int) -> None:
        stream = client.completions.create(model=server.model, prompt=f"Tell a story about {name}:", max_tokens=24,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True,
                                                                                   "priority": priority})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first_token.setdefault(name, time.monotonic())
        done[name] = time.monotonic()

    lows = [threading.Thread(target=run, args=(f"low{i}", 10)) for i in range(4)]
    for t in lows:
        t.start()
    deadline = time.monotonic() + 60
    while server.metrics()["sluice_num_requests_waiting"] < 3:  # one running, three queued
        assert time.monotonic() < deadline, "the low-priority requests never queued"
        time.sleep(0.05)
    urgent = threading.Thread(target=run, args=("urgent", -5))
    urgent.start()
    for t in [*lows, urgent]:
        t.join()
    # It preempts the running one (strictly worse priority) and passes the queue.
    assert done["urgent"] < min(v for k, v in done.items() if k != "urgent"), done
    queued = [k for k in first_token if k != "urgent" and first_token[k] > first_token["urgent"]]
    assert len(queued) >= 3, first_token
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, extra_body={"priority": -3})
    assert chat.choices[0].message.content is not None


@pytest.mark.slow
def test_the_openai_client_gets_the_400_named(server):
    with pytest.raises(openai.BadRequestError) as e:
        client_of(server).completions.create(model=server.model, prompt="hi", max_tokens=1,
                                             extra_body={"priority": 0.5})
    assert e.value.body["param"] == "priority"
