"""GPU time of one call as a replayed CUDA graph runs it: host launch cost out, L2 flushed before each call.

Eager timing (`triton.testing.do_bench`) of a small kernel measures the host: a Triton launch from Python costs
tens of microseconds (the paged attention's split kernel and merge ~0.2 ms on the H200's host), while the GPU
finishes in a few. The engine replays decode steps from CUDA graphs, so this is the time that matters there.
"""

from __future__ import annotations

import torch


def graph_us(fn, reps: int = 20, trials: int = 5) -> float:
    """Median GPU time of one call replayed from a CUDA graph, L2 flushed before each call: a graph of reps x
    (flush, fn) minus a graph of reps x flush, per call. Host launch cost is out of it, as in the engine's
    replayed decode steps."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")  # several times H100/H200's 50 MB L2
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(stream)

    def capture(with_fn: bool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                flush.zero_()
                if with_fn:
                    fn()
        return graph

    both, flush_only = capture(True), capture(False)

    def timed(graph: torch.cuda.CUDAGraph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3

    both.replay(), flush_only.replay()
    diffs = sorted((timed(both) - timed(flush_only)) / reps for _ in range(trials))
    return max(diffs[len(diffs) // 2], 1e-3)
