"""The persistent step inputs (input_buffers.py) against the per-step builder they replace
(reference_inputs.py), on hand-made steps: every tensor and host list the forward reads is the same,
through new rows, appended blocks, freed and reused rows, prefix-shared blocks, drafts and prompt chunks;
with the host staging + copy + scatter of the CUDA path (run on CPU tensors) as well as the direct CPU
path; and padding rows of a graph batch point only at the scratch block."""

import pytest
import torch
from reference_inputs import build_model_input

from sluice_engine.core.sched_output import ScheduledRequest, SchedulerOutput
from sluice_engine.worker.input_buffers import InputBuffers

CPU = torch.device("cpu")
BS = 4
SCRATCH = 40


def steps() -> list[SchedulerOutput]:
    a = [5, 17, 299, 64, 3, 128, 200, 11, 9]
    b = list(range(1, 15))
    return [
        SchedulerOutput([ScheduledRequest("a", a, 0, [0, 1, 2], prompt_logprobs=True),
                         ScheduledRequest("b", b[:6], 0, [3, 4])]),  # b: a prompt chunk
        SchedulerOutput([ScheduledRequest("b", b[6:], 6, [3, 4, 5, 6]),
                         ScheduledRequest("a", [42], 9, [0, 1, 2]),
                         ScheduledRequest("c", [44], 9, [0, 1, 7])]),  # c: forked from a
        SchedulerOutput([ScheduledRequest("a", [7, 8, 9, 10], 10, [0, 1, 2, 8], num_drafts=3),
                         ScheduledRequest("b", [12], 14, [3, 4, 5, 6])], freed_req_ids=["c"]),
        # b's row is released before d takes the lowest free one (b's); d hits a's first two blocks.
        SchedulerOutput([ScheduledRequest("d", [1, 2, 3, 4, 5], 8, [0, 1, 9, 10]),
                         ScheduledRequest("a", [77], 12, [0, 1, 2, 8])], freed_req_ids=["b", "b"]),
        SchedulerOutput([ScheduledRequest("a", [78], 13, [0, 1, 2, 8]),
                         ScheduledRequest("d", [6], 13, [0, 1, 9, 10])]),
    ]


def buffers(**kw) -> InputBuffers:
    kw = {"max_tokens": 32, "max_rows": 4, "max_model_len": 64, "block_size": BS, "device": CPU,
          "scratch_block": SCRATCH} | kw
    return InputBuffers(**kw)


def assert_same_input(got, want):
    for name in ("input_ids", "positions", "logits_rows"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    g, w = got.attn, want.attn
    for name in ("query_start_loc", "seq_lens", "slot_mapping"):
        assert getattr(g, name).dtype == getattr(w, name).dtype, name
        assert torch.equal(getattr(g, name), getattr(w, name)), name
    # The reference pads tables to the batch's longest table; only the columns the contexts cover are read.
    cols = -(-g.max_seq_len // BS)
    assert g.block_tables.dtype == w.block_tables.dtype
    assert torch.equal(g.block_tables[:, :cols], w.block_tables[:, :cols])
    for name in ("max_query_len", "max_seq_len", "query_lens_cpu", "seq_lens_cpu", "block_size"):
        assert getattr(g, name) == getattr(w, name), name


@pytest.mark.parametrize("staged", [False, True], ids=["cpu-direct", "staged-copy"])
@pytest.mark.parametrize("max_writes", [None, 2], ids=["writes-in-copy", "writes-overflow"])
def test_same_inputs_as_the_per_step_builder(staged, max_writes):
    buf = buffers(staged=staged, max_writes=max_writes)
    for sched in steps():
        rows, _ = sched.logits_layout()
        got = buf.prepare(sched.scheduled, rows, sched.freed_req_ids)
        assert_same_input(got, build_model_input(sched.scheduled, rows, BS, CPU))
        # The device table holds what the host thinks it does, row by row.
        for s in sched.scheduled:
            row = buf.rows.row_of(s.request_id)
            assert buf.block_table[row, : len(s.block_ids)].tolist() == s.block_ids
    assert buf.rows.row_of("d") == 1  # b's old row, released in the same step
    assert buf.rows.row_of("b") is None and buf.rows.num_free == 2


def test_the_draft_models_buffers_grow_until_frozen():
    buf = InputBuffers(max_tokens=4, max_rows=2, max_model_len=64, block_size=BS, device=CPU)
    long = [ScheduledRequest("a", list(range(30)), 0, list(range(8)))]
    got = buf.prepare(long, [29])
    assert got.input_ids.tolist() == list(range(30)) and buf.max_tokens >= 30
    buf.freeze()
    with pytest.raises(RuntimeError, match="exceeds"):
        buf.prepare([ScheduledRequest("a", list(range(60)), 30, list(range(16)))], [59])


@pytest.mark.parametrize("staged", [False, True], ids=["cpu-direct", "staged-copy"])
def test_padding_rows_read_and_write_only_the_scratch_block(staged):
    buf = buffers(staged=staged, max_rows=8)
    prefill = SchedulerOutput([ScheduledRequest("a", [1, 2, 3, 4, 5], 0, [3, 7]),
                               ScheduledRequest("b", [6, 7, 8, 9, 10, 11, 12, 13, 14], 0, [1, 2, 5])])
    buf.prepare(prefill.scheduled, prefill.logits_layout()[0])
    decode = [ScheduledRequest("a", [20], 5, [3, 7]), ScheduledRequest("b", [21], 9, [1, 2, 5])]
    inp = buf.prepare(decode, [0, 1], pad_to=8)
    meta = inp.attn
    assert inp.input_ids.tolist() == [20, 21] + [0] * 6
    assert inp.positions.tolist() == [5, 9] + [0] * 6
    assert meta.query_start_loc.tolist() == list(range(9))
    assert meta.seq_lens.tolist() == [6, 10] + [1] * 6
    scratch_slot = SCRATCH * BS
    assert meta.slot_mapping.tolist() == [7 * BS + 1, 5 * BS + 1] + [scratch_slot] * 6
    assert meta.block_tables.shape == (8, buf.max_blocks)  # full width: a graph reads a fixed shape
    assert meta.block_tables[0, :2].tolist() == [3, 7] and meta.block_tables[1, :3].tolist() == [1, 2, 5]
    assert (meta.block_tables[2:] == SCRATCH).all()
    assert meta.query_lens_cpu == [1] * 8 and meta.seq_lens_cpu == [6, 10] + [1] * 6
    assert inp.logits_rows.tolist() == [0, 1]  # the real rows only
    assert meta.block_tables.data_ptr() == buf.batch_tables.data_ptr()  # where a captured graph reads

    # A smaller batch next: rows 1.. must be padding again, not the last step's values.
    inp = buf.prepare([ScheduledRequest("b", [22], 10, [1, 2, 5])], [0], freed=["a"], pad_to=4)
    assert inp.attn.slot_mapping.tolist() == [5 * BS + 2] + [scratch_slot] * 3
    assert inp.attn.query_start_loc.tolist() == [0, 1, 2, 3, 4]


def test_capture_input_is_all_padding():
    buf = buffers()
    inp = buf.capture_input(4)
    assert inp.num_tokens == 4 and inp.attn.max_query_len == 1
    assert inp.attn.slot_mapping.tolist() == [SCRATCH * BS] * 4
    assert (inp.attn.block_tables == SCRATCH).all() and inp.attn.seq_lens.tolist() == [1] * 4
    assert inp.logits_rows.numel() == 0


def test_idle_rows_are_evicted_only_when_asked():
    """The draft model's shadows outlive preemption, so it lets a step take rows from requests outside it;
    the evicted request's table is written in full when it comes back."""
    def one(rid, blocks):
        return [ScheduledRequest(rid, [1], 0, blocks)]

    buf = buffers(max_rows=2)
    buf.prepare(one("a", [1, 2]), [0])
    buf.prepare(one("b", [3]), [0])
    with pytest.raises(RuntimeError, match="no free block-table row"):
        buf.prepare(one("c", [4]), [0])
    buf = buffers(max_rows=2)
    buf.prepare(one("a", [1, 2]), [0])
    buf.prepare(one("b", [3]), [0])
    got = buf.prepare(one("c", [4]), [0], evict_idle=True)
    assert buf.rows.row_of("a") is None and buf.rows.row_of("c") == 0  # a held the oldest row
    assert got.attn.slot_mapping.tolist() == [4 * BS]
    got = buf.prepare(one("a", [1, 2, 5]), [0], evict_idle=True)
    assert buf.rows.row_of("a") == 1 and buf.block_table[1, :3].tolist() == [1, 2, 5]
