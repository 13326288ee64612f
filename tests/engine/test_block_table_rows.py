"""The persistent block table's bookkeeping (block_table_rows.py), as pure logic: which row a request holds,
which of its block ids are new each step, rows coming back when the scheduler frees requests, and the
scheduler telling the runner which ones it freed (SchedulerOutput.freed_req_ids)."""

import pytest

from sluice_engine.core.kv_cache import KVCacheManager
from sluice_engine.core.request import Request
from sluice_engine.core.scheduler import Scheduler
from sluice_engine.sampling_params import SamplingParams
from sluice_engine.worker.block_table_rows import BlockTableRows


def test_a_request_keeps_its_row_and_only_appended_blocks_are_new():
    rows = BlockTableRows(num_rows=4, max_blocks=8)
    assert rows.update("a", [7, 3]) == (0, 0)  # a first step: the whole table is written
    assert rows.update("b", [5]) == (1, 0)
    assert rows.update("a", [7, 3]) == (0, 2)  # same blocks: nothing to write
    assert rows.update("a", [7, 3, 9]) == (0, 2)  # one block appended: column 2 only
    assert rows.update("b", [5, 6, 8]) == (1, 1)
    assert rows.row_of("a") == 0 and rows.row_of("b") == 1 and rows.num_free == 2


def test_released_rows_are_reused_lowest_first_and_written_from_scratch():
    rows = BlockTableRows(num_rows=3, max_blocks=4)
    for rid in "abc":
        rows.update(rid, [1, 2])
    rows.release(["b", "a", "never-scheduled", "b"])  # unknown and repeated ids are ignored
    assert rows.row_of("a") is None and rows.num_free == 2
    assert rows.update("d", [9]) == (0, 0)  # a's old row, written from column 0 again
    assert rows.update("a", [4, 5, 6]) == (1, 0)  # a came back (say after preemption): a fresh row
    assert rows.holders() == ["c", "d", "a"]


def test_the_scratch_row_is_past_the_request_rows():
    rows = BlockTableRows(num_rows=3, max_blocks=4)
    assert rows.scratch_row == 3
    assert all(rows.update(rid, [1])[0] < rows.scratch_row for rid in "abc")


def test_a_table_that_changed_under_its_row_is_refused():
    rows = BlockTableRows(num_rows=2, max_blocks=4)
    rows.update("a", [1, 2, 3])
    with pytest.raises(RuntimeError, match="changed under its row"):
        rows.update("a", [1, 2])  # shrank
    with pytest.raises(RuntimeError, match="changed under its row"):
        rows.update("a", [1, 2, 8, 9])  # the last written id differs: not an append
    with pytest.raises(ValueError, match="holds 4 per request"):
        rows.update("b", [0] * 5)
    rows.update("b", [4])
    with pytest.raises(RuntimeError, match="no free block-table row"):
        rows.update("c", [5])


def _request(rid: str, n: int, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))


def _run(sched_out, scheduler: Scheduler, rows: BlockTableRows) -> dict[str, tuple[int, int]]:
    """What a runner does with a step's output: release, then update rows; and what the engine does after
    the forward: advance counters, append a token to every request that sampled."""
    rows.release(sched_out.freed_req_ids)
    seen = {s.request_id: rows.update(s.request_id, s.block_ids) for s in sched_out.scheduled}
    for s in sched_out.scheduled:
        req = scheduler.requests[s.request_id]
        scheduler.update_from_output(req, s.num_tokens, 0, s.samples)
        if s.samples:
            req.append_output_token(0)
    return seen


def test_preemption_and_finishing_free_rows_through_the_scheduler_output():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    rows = BlockTableRows(num_rows=4, max_blocks=8)
    a, b = _request("a", 8), _request("b", 8)
    scheduler.add(a)
    scheduler.add(b)
    first = _run(scheduler.schedule(), scheduler, rows)
    assert first == {"a": (0, 0), "b": (1, 0)}  # 2 blocks each (+ room for the next token)
    # Decode until blocks run out: b (admitted last) is preempted; its row comes back in the same output
    # as the step that runs without it.
    for _ in range(8):
        out = scheduler.schedule()
        seen = _run(out, scheduler, rows)
        if out.preempted:
            break
    assert out.preempted == ["b"] and out.freed_req_ids == ["b"] and "b" not in seen
    assert rows.row_of("b") is None and rows.row_of("a") == 0
    scheduler.finish(a, reason=None)  # done (the reason does not matter here)
    out = scheduler.schedule()  # b resumes with new blocks; a's release rides along, before b's update
    assert out.freed_req_ids == ["a"] and [s.request_id for s in out.scheduled] == ["b"]
    assert _run(out, scheduler, rows) == {"b": (0, 0)}  # the lowest free row, written from scratch


def test_freed_ids_wait_for_a_step_that_runs():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    a = _request("a", 4)
    scheduler.add(a)
    scheduler.schedule()
    scheduler.finish(a, reason=None)
    empty = scheduler.schedule()
    assert empty.is_empty and empty.freed_req_ids == []  # dropped by the engine: must not carry the ids
    scheduler.add(_request("c", 4))
    assert scheduler.schedule().freed_req_ids == ["a"]
