"""Persistent step inputs: every tensor a forward reads, allocated once on the device and rewritten in
place each step, so the model (and a captured CUDA graph, worker/cuda_graphs.py) always reads the same memory.

What a step writes:
- the block table [rows + 1, max blocks per request] stays on the device between steps; a request keeps
  its row while it runs and only the block ids appended since the last step are sent
  (worker/block_table_rows.py decides which);
- token ids, positions, slot mapping, query start locations, sequence lengths, the batch's block-table
  rows and the logits rows are packed on the host into one staging buffer (pinned on CUDA) with the same
  layout as its device twin, and go over in one non-blocking copy; the new block ids ride in the same
  copy and are scattered into the table on the device.

On CPU the staging buffer is the device buffer: the step's values are written where the model reads
them, and nothing is copied. The host-side arithmetic is numpy over the whole batch (positions and
slots of every token at once), not a Python loop per token.

The returned ModelInput holds views of these buffers: valid until the next `prepare`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np
import torch

from ..core.sched_output import ScheduledRequest
from ..forward_context import AttentionMetadata
from .block_table_rows import BlockTableRows
from .model_input import ModelInput


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _StepBuffer:
    """One flat int64 buffer cut into fixed sections (int32 ones as int64 halves), on the host and on the
    device. The sections never move, so views of the device buffer are stable for graph capture."""

    def __init__(self, max_tokens: int, max_rows: int, max_writes: int, device: torch.device, staged: bool):
        sizes = {  # section -> (dtype, length)
            "query_start_loc": (torch.int32, max_rows + 1),
            "seq_lens": (torch.int32, max_rows),
            "batch_rows": (torch.int64, max_rows),
            "input_ids": (torch.int64, max_tokens),
            "positions": (torch.int64, max_tokens),
            "slot_mapping": (torch.int64, max_tokens),
            "logits_rows": (torch.int64, max_tokens),
            "write_index": (torch.int64, max_writes),  # flat block-table index of each new block id
            "write_value": (torch.int32, max_writes),
        }
        spans = {}
        offset = 0  # in int64 units
        for name, (dtype, n) in sizes.items():
            words = n if dtype == torch.int64 else _cdiv(n, 2)
            spans[name] = (dtype, offset, n)
            offset += words
        self.max_tokens, self.max_rows, self.max_writes = max_tokens, max_rows, max_writes
        self.device_flat = torch.zeros(offset, dtype=torch.int64, device=device)
        # Pinned staging makes the copy truly asynchronous (pageable memory goes through a bounce buffer).
        self.host_flat = (torch.zeros(offset, dtype=torch.int64, pin_memory=device.type == "cuda") if staged
                          else self.device_flat)
        self.dev: dict[str, torch.Tensor] = {}
        self.host: dict[str, np.ndarray] = {}
        for name, (dtype, start, n) in spans.items():
            words = n if dtype == torch.int64 else _cdiv(n, 2)
            d = self.device_flat[start : start + words]
            h = self.host_flat[start : start + words]
            if dtype == torch.int32:
                d, h = d.view(torch.int32), h.view(torch.int32)
            self.dev[name] = d[:n]
            self.host[name] = h[:n].numpy()


class InputBuffers:
    """The persistent inputs of one model (the target's runner, or the draft model's)."""

    def __init__(self, *, max_tokens: int, max_rows: int, max_model_len: int, block_size: int,
                 device: torch.device, scratch_block: int | None = None, max_writes: int | None = None,
                 staged: bool | None = None):
        """max_tokens: tokens of the largest step (grows on demand until `freeze`); max_rows: requests
        that may hold a row at once; scratch_block: a KV block no request owns, where padding rows of a
        padded (CUDA graph) batch write and read; None: this model's batches are never padded.
        staged: host staging + copy + scatter (default: off the CPU only; on the CPU it tests that path)."""
        self.device = device
        self.block_size = block_size
        self.max_blocks = _cdiv(max_model_len, block_size)
        self.rows = BlockTableRows(max_rows, self.max_blocks)
        self.scratch_block = scratch_block
        self.frozen = False
        self._copies = device.type != "cpu" if staged is None else staged
        self.block_table = torch.zeros((max_rows + 1, self.max_blocks), dtype=torch.int32, device=device)
        # The host's copy of the table, for the slot mapping. On CPU it is the table itself.
        self._table = np.zeros(tuple(self.block_table.shape), dtype=np.int32) if self._copies else (
            self.block_table.numpy())
        if scratch_block is not None:
            self.block_table[self.rows.scratch_row] = scratch_block
            self._table[self.rows.scratch_row] = scratch_block
        # Block ids one step usually appends: one per row crossing a block boundary, one per block of
        # new tokens, doubled for admissions with short cached prefixes. More go in a one-off copy.
        self.max_writes = max_writes or 2 * (max_rows + _cdiv(max_tokens, block_size))
        self._buf = _StepBuffer(max(max_tokens, max_rows), max_rows, self.max_writes, device, self._copies)
        # A padded batch's block tables at full width, where a captured graph reads them.
        self.batch_tables: torch.Tensor | None = None
        if scratch_block is not None:
            self.batch_tables = torch.zeros((max_rows, self.max_blocks), dtype=torch.int32, device=device)
        self._copied: torch.cuda.Event | None = None  # the last host->device copy (staging is reusable after)

    @property
    def scratch_slot(self) -> int:
        assert self.scratch_block is not None, "these inputs have no scratch block"
        return self.scratch_block * self.block_size

    @property
    def max_tokens(self) -> int:
        return self._buf.max_tokens

    def freeze(self) -> None:
        """No more growing: graphs are about to capture the current buffers' addresses."""
        self.frozen = True

    # -- one step ------------------------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledRequest], logits_rows: list[int], freed: Iterable[str] = (),
                pad_to: int | None = None, evict_idle: bool = False) -> ModelInput:
        """The step's ModelInput. `freed`: requests whose blocks the scheduler freed since the last step
        (their rows are released first). `pad_to`: pad a pure-decode batch with dummy rows up to this
        many (a CUDA graph's batch size); the padded tensors are returned, logits rows are the real ones.
        `evict_idle`: when rows run out, take them from requests outside this step (for the draft model,
        whose shadows outlive preemption); without it running out of rows is a bug and raises."""
        self.rows.release(freed)
        if evict_idle:
            self._evict_idle(scheduled)
        b = len(scheduled)
        assert b, "a step schedules at least one request"
        qlens = np.fromiter((s.num_tokens for s in scheduled), dtype=np.int64, count=b)
        t = int(qlens.sum())
        n = b if pad_to is None else pad_to
        if pad_to is not None:
            assert t == b <= pad_to <= self._buf.max_rows and self.scratch_block is not None, (t, b, pad_to)
        self._reserve(max(t, n), len(logits_rows))
        self._wait_for_staging()
        buf = self._buf.host

        # Rows and newly appended block ids (into the host table now, the device table after the copy).
        rows = np.empty(b, dtype=np.int64)
        write_index: list[int] = []
        write_value: list[int] = []
        mb = self.max_blocks
        for i, s in enumerate(scheduled):
            row, col = self.rows.update(s.request_id, s.block_ids)
            rows[i] = row
            if col < len(s.block_ids):
                new = s.block_ids[col:]
                self._table[row, col : len(s.block_ids)] = new
                if self._copies:  # on CPU the host table is the device table
                    write_index.extend(range(row * mb + col, row * mb + len(s.block_ids)))
                    write_value.extend(new)

        starts = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=b)
        ends = np.cumsum(qlens)
        seq_lens = starts + qlens
        buf["query_start_loc"][0] = 0
        buf["query_start_loc"][1 : b + 1] = ends
        buf["seq_lens"][:b] = seq_lens
        buf["batch_rows"][:b] = rows
        buf["input_ids"][:t] = list(itertools.chain.from_iterable(s.token_ids for s in scheduled))
        # Token j of sequence i sits at starts[i] + (j - its first row).
        pos = np.arange(t, dtype=np.int64) + np.repeat(starts - (ends - qlens), qlens)
        buf["positions"][:t] = pos
        blocks = self._table[np.repeat(rows, qlens), pos // self.block_size].astype(np.int64)
        buf["slot_mapping"][:t] = blocks * self.block_size + pos % self.block_size
        buf["logits_rows"][: len(logits_rows)] = logits_rows
        if n > b:
            self._write_padding(b, n)
        self._transfer(write_index, write_value)

        max_seq_len = int(seq_lens.max())
        if pad_to is None:
            # Only the columns this batch reads; an eager forward may allocate.
            cols = _cdiv(max_seq_len, self.block_size)
            tables = self.block_table[:, :cols].index_select(0, self._buf.dev["batch_rows"][:b])
        else:
            tables = self._gather_full_tables(n)
        q_list, s_list = qlens.tolist(), seq_lens.tolist()
        if n > b:
            q_list += [1] * (n - b)
            s_list += [1] * (n - b)
        return self._model_input(n, n - b + t, len(logits_rows), tables, int(qlens.max()), max_seq_len,
                                 q_list, s_list)

    def capture_input(self, n: int) -> ModelInput:
        """A pure-decode batch of `n` padding rows, for warming up and capturing a graph of that size:
        every row reads and writes the scratch block only."""
        assert self.scratch_block is not None and n <= self._buf.max_rows, n
        self._wait_for_staging()
        self._write_padding(0, n)
        self._transfer([], [])
        return self._model_input(n, n, 0, self._gather_full_tables(n), 1, self.max_blocks * self.block_size,
                                 [1] * n, [1] * n)

    # -- internals -----------------------------------------------------------------------------
    def _evict_idle(self, scheduled: list[ScheduledRequest]) -> None:
        rows = self.rows
        need = sum(rows.row_of(s.request_id) is None for s in scheduled) - rows.num_free
        if need > 0:  # an evicted request's table is written in full when it next comes
            stepping = {s.request_id for s in scheduled}
            rows.release([rid for rid in rows.holders() if rid not in stepping][:need])

    def _write_padding(self, b: int, n: int) -> None:
        """Rows b..n-1 of a decode batch become dummies: one token each, id 0 at position 0, a context of
        one token, written to and read from the scratch block (its table row holds nothing else)."""
        buf = self._buf.host
        buf["query_start_loc"][b + 1 : n + 1] = np.arange(b + 1, n + 1)
        buf["seq_lens"][b:n] = 1
        buf["batch_rows"][b:n] = self.rows.scratch_row
        buf["input_ids"][b:n] = 0
        buf["positions"][b:n] = 0
        buf["slot_mapping"][b:n] = self.scratch_slot

    def _transfer(self, write_index: list[int], write_value: list[int]) -> None:
        """Staging -> device in one copy (nothing to copy on CPU), then the new block ids into the table."""
        k = len(write_index)
        overflow = k > self.max_writes
        if k and not overflow:
            self._buf.host["write_index"][:k] = write_index
            self._buf.host["write_value"][:k] = write_value
        if self._copies:
            self._buf.device_flat.copy_(self._buf.host_flat, non_blocking=True)
            if self.device.type == "cuda":
                if self._copied is None:
                    self._copied = torch.cuda.Event()
                self._copied.record()
        if not k:
            return
        flat = self.block_table.view(-1)
        if overflow:  # rare (an admission with a long cached prefix): a one-off copy of its own
            idx = torch.tensor(write_index, dtype=torch.int64).to(self.device)
            val = torch.tensor(write_value, dtype=torch.int32).to(self.device)
        else:
            idx, val = self._buf.dev["write_index"][:k], self._buf.dev["write_value"][:k]
        flat.index_copy_(0, idx, val)

    def _wait_for_staging(self) -> None:
        # The last step's copy may still be reading the pinned staging buffer (it runs after the host has
        # moved on). By the time a step is sampled it is long done, so this rarely waits.
        if self._copied is not None:
            self._copied.synchronize()

    def _gather_full_tables(self, n: int) -> torch.Tensor:
        assert self.batch_tables is not None
        out = self.batch_tables[:n]
        torch.index_select(self.block_table, 0, self._buf.dev["batch_rows"][:n], out=out)
        return out

    def _reserve(self, tokens: int, logits_rows: int) -> None:
        if max(tokens, logits_rows) <= self._buf.max_tokens:
            return
        if self.frozen:
            raise RuntimeError(f"a step of {tokens} tokens exceeds the {self._buf.max_tokens} the persistent "
                               "inputs were sized for (--max-num-batched-tokens)")
        self._wait_for_staging()
        self._copied = None
        self._buf = _StepBuffer(max(tokens, logits_rows, 2 * self._buf.max_tokens), self._buf.max_rows,
                                self.max_writes, self.device, self._copies)

    def _model_input(self, n: int, t: int, r: int, tables: torch.Tensor, max_query_len: int, max_seq_len: int,
                     query_lens: list[int], seq_lens: list[int]) -> ModelInput:
        d = self._buf.dev
        attn = AttentionMetadata(
            query_start_loc=d["query_start_loc"][: n + 1], seq_lens=d["seq_lens"][:n], block_tables=tables,
            slot_mapping=d["slot_mapping"][:t], max_query_len=max_query_len, max_seq_len=max_seq_len,
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, block_size=self.block_size,
        )
        return ModelInput(d["input_ids"][:t], d["positions"][:t], attn, d["logits_rows"][:r])
