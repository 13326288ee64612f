"""What sealing KV transfers costs (issue 39): batches of KV blocks pushed to a receiver on 127.0.0.1, sealed with an
endpoint key (AES-256-GCM, kv_transfer/channel.py) and plain (no key: what a loopback-only receiver allows),
alternated in one process so both meet the same machine state. Reported per batch size: the median time of a push
(connect, hellos, header, payload, acknowledgement; the receiver's engine side is a queue that frees each batch at
once), its cost per block, throughput, and sealed/plain.

Blocks are the bundled model's (SmolLM2-135M: 30 layers x 2 x 16 tokens x 3 KV heads x 64, float32: 360 KiB; a
float16 cache halves it). Both sides share the machine's cores, as in a real pod they would each have their own:
the sealed/plain ratio here is an upper bound of what a push costs the sender and the receiver each.

    .venv/bin/python benchmarks/kv_transfer_seal.py                 # ~1 min
    .venv/bin/python benchmarks/kv_transfer_seal.py --blocks 1 16 128 --repeats 15 --dtype float16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine_image"))

from sluice_engine.bench.machine import cpu_name  # noqa: E402
from sluice_engine.kv_transfer.keys import KVKey  # noqa: E402
from sluice_engine.kv_transfer.tcp import KVReceiver, push_blocks  # noqa: E402
from sluice_engine.kv_transfer.wire import BlockBatch, KVLayout  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 16, 128, 512])
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    a = ap.parse_args()
    layout = KVLayout("smollm2", a.dtype, 16, 30, 3, 64)
    key = KVKey(os.urandom(32))
    most = max(a.blocks)

    def sink(batch: BlockBatch) -> int:
        batch.release()
        return len(batch.names)

    receivers = {mode: KVReceiver("127.0.0.1", 0, layout, sink, k, max_blocks=most,
                                  max_inflight_bytes=most * layout.block_bytes(), timeout=60)
                 for mode, k in (("sealed", key), ("plain", None))}
    print(f"CPU: {cpu_name()}; torch threads {torch.get_num_threads()}; block {layout.block_bytes() / 1024:.0f} KiB "
          f"({a.dtype}); {a.repeats} pushes each, alternated; medians")
    print(f"{'blocks':>7} {'MiB':>8} {'plain ms':>10} {'sealed ms':>10} {'plain us/blk':>13} {'sealed us/blk':>14} "
          f"{'plain GB/s':>11} {'sealed GB/s':>12} {'sealed/plain':>13}")
    try:
        for n in a.blocks:
            dtype = getattr(torch, a.dtype)
            batch = BlockBatch(layout, list(range(n)), torch.randn(n, *layout.block_shape()).to(dtype))
            times: dict[str, list[float]] = {"sealed": [], "plain": []}
            for i in range(a.repeats + 1):
                for mode in (("sealed", "plain") if i % 2 else ("plain", "sealed")):
                    k = key if mode == "sealed" else None
                    t0 = time.perf_counter()
                    assert push_blocks("127.0.0.1", receivers[mode].port, batch, k, timeout=60) == n
                    if i:  # the first round warms both up
                        times[mode].append(time.perf_counter() - t0)
            p, s = statistics.median(times["plain"]), statistics.median(times["sealed"])
            nbytes = n * layout.block_bytes()
            print(f"{n:>7} {nbytes / 2**20:>8.1f} {p * 1e3:>10.2f} {s * 1e3:>10.2f} {p / n * 1e6:>13.0f} "
                  f"{s / n * 1e6:>14.0f} {nbytes / p / 1e9:>11.2f} {nbytes / s / 1e9:>12.2f} {s / p:>12.2f}x")
    finally:
        for r in receivers.values():
            r.close()


if __name__ == "__main__":
    main()
