"""Which row of the persistent block table each request holds, and which of its block ids are new.

The model runner keeps one device block table, [rows + 1, max blocks per request], for the whole life of
the engine (worker/input_buffers.py). A request takes a row the first time it is scheduled and keeps it while
it runs; each step only the block ids appended since the last step are written. Its row is given back
when the scheduler frees its blocks (finished, aborted, preempted: `SchedulerOutput.freed_req_ids`), and
the next new request may take it. The extra last row is the scratch row: every entry is the reserved
scratch block, and padding rows of a CUDA graph's batch read and write only there.

Plain Python (no torch), so the bookkeeping is tested on its own.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class BlockTableRows:
    """Row assignment and incremental writes of a block table with `num_rows` request rows."""

    def __init__(self, num_rows: int, max_blocks: int):
        if num_rows < 1 or max_blocks < 1:
            raise ValueError(f"a block table needs rows and columns, got {num_rows} x {max_blocks}")
        self.num_rows = num_rows
        self.max_blocks = max_blocks
        self.scratch_row = num_rows  # the extra row padding reads (see the module docstring)
        self._row: dict[str, int] = {}
        # A min-heap: the lowest free row goes first, so a lightly loaded engine keeps to the top rows.
        self._free = list(range(num_rows))
        self._written = [0] * num_rows  # block ids of the row's request written so far
        self._last = [-1] * num_rows  # the last of them: a cheap check that the table only grew

    def row_of(self, request_id: str) -> int | None:
        return self._row.get(request_id)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def holders(self) -> list[str]:
        """Requests holding a row, oldest row-taker first."""
        return list(self._row)

    def release(self, request_ids: Iterable[str]) -> None:
        """The scheduler freed these requests' blocks: their rows are free for other requests. Ids
        that hold no row (never scheduled, or already released) are ignored."""
        for rid in request_ids:
            row = self._row.pop(rid, None)
            if row is not None:
                self._written[row] = 0
                self._last[row] = -1
                heapq.heappush(self._free, row)

    def update(self, request_id: str, block_ids: list[int]) -> tuple[int, int]:
        """The request's row (taken now if it has none) and the first column to write: block_ids[col:]
        are new since the last step (none when col == len(block_ids)). Records them as written.

        A held row's blocks only ever grow (the KV manager appends; a preempted request is freed before
        it comes back), so a table that shrank or whose last written id changed is a bookkeeping bug,
        and raises rather than let attention read another request's KV."""
        n = len(block_ids)
        if n > self.max_blocks:
            raise ValueError(f"request {request_id} has {n} blocks; the block table holds {self.max_blocks} "
                             "per request (max_model_len / block_size)")
        row = self._row.get(request_id)
        if row is None:
            if not self._free:
                raise RuntimeError(f"no free block-table row for request {request_id}: all {self.num_rows} are "
                                   "held (a request's row was never released?)")
            row = heapq.heappop(self._free)
            self._row[request_id] = row
        col = self._written[row]
        if n < col or (col and block_ids[col - 1] != self._last[row]):
            raise RuntimeError(f"request {request_id}'s block table changed under its row (had {col} blocks "
                               f"ending in {self._last[row]}, now {n}); it was not freed first")
        if n > col:
            self._written[row] = n
            self._last[row] = block_ids[-1]
        return row, col
