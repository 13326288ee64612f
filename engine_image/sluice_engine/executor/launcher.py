"""The processes of a multi-rank engine on one node.

`sluice serve` starts this node's ranks itself, one process each (`python -m
sluice_engine.executor.rank_process RANK`): on node 0 the serving process is rank 0 and starts ranks
1..n-1; on a node >= 1 (`--node-rank`), the process starts all of the node's ranks, serves only
`/health` on --port (so the pod can be probed) and exits non-zero as soon as any of them fails. A
worker dies with its parent (PR_SET_PDEATHSIG), so no rank outlives the server that started it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from ..config import EngineConfig

log = logging.getLogger("sluice.engine")


def configure_rank_threads(cfg: EngineConfig) -> None:
    """On CPU the node's cores are shared by its ranks: each takes its share, so ranks do not fight
    over cores (an explicit OMP_NUM_THREADS wins)."""
    if cfg.ranks_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // cfg.ranks_per_node))


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the parent's shutdown still stops workers


def free_port(host: str) -> int:
    """A port nothing listens on now (the OS's pick). Rank 0's store binds it a moment later; the window
    between is what every launcher that picks a port (torchrun's too) accepts."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalWorkers:
    """Worker processes for ranks first_rank .. first_rank + count - 1; `on_exit(rank, code)` runs
    (in a watcher thread) when one exits before stop()."""

    def __init__(self, cfg: EngineConfig, model_dir: Path, first_rank: int, count: int,
                 on_exit: Callable[[int, int], None]):
        self._stopping = False
        self._on_exit = on_exit
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "SLUICE_WORKER_CONFIG": json.dumps(
            {"config": dataclasses.asdict(cfg), "model_dir": str(model_dir)})}
        self.procs: dict[int, subprocess.Popen] = {}
        for rank in range(first_rank, first_rank + count):
            self.procs[rank] = subprocess.Popen([sys.executable, "-m", "sluice_engine.executor.rank_process", str(rank)],
                                                env=env, preexec_fn=_die_with_parent)
            threading.Thread(target=self._watch, args=(rank,), name=f"sluice-rank-{rank}", daemon=True).start()
        if count:
            log.info("started ranks %d-%d (pids %s)", first_rank, first_rank + count - 1,
                     ", ".join(str(p.pid) for p in self.procs.values()))

    def _watch(self, rank: int) -> None:
        code = self.procs[rank].wait()
        if not self._stopping:
            self._on_exit(rank, code)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def stop(self, timeout: float = 10) -> None:
        self._stopping = True
        for p in self.procs.values():
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
            if p.poll() is None:
                p.kill()
                p.wait()


def run_worker_node(cfg: EngineConfig, model_dir: Path, host: str, port: int) -> int:
    """Node >= 1: run this node's ranks and answer /health until they stop. Returns the exit code:
    0 when rank 0 stopped the group, 1 when a rank failed."""
    from ..distributed.layout import check_layout
    from ..model_config import ModelConfig

    check_layout(ModelConfig.from_dir(model_dir), cfg.tensor_parallel_size, cfg.pipeline_parallel_size)
    first = cfg.node_rank * cfg.ranks_per_node
    failed: list[str] = []
    done = threading.Event()

    def on_exit(rank: int, code: int) -> None:
        if code != 0:
            failed.append(f"rank {rank} exited with code {code}")
            log.error("rank %d exited with code %d: this node stops", rank, code)
            done.set()
        elif not any(p.poll() is None for p in workers.procs.values()):
            done.set()  # every rank stopped cleanly: rank 0 ended the group

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?")[0] != "/health":
                self.send_error(404, "a worker node serves /health only; requests go to node 0")
                return
            ok = not failed and workers.alive()
            body = json.dumps({"status": "ok" if ok else "dead", "node_rank": cfg.node_rank,
                               "ranks": list(workers.procs), "error": "; ".join(failed) or None}).encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # probes every few seconds: keep the log for the ranks
            pass

    workers = LocalWorkers(cfg, model_dir, first, cfg.ranks_per_node, on_exit)
    server = ThreadingHTTPServer((host, port), Health)
    threading.Thread(target=server.serve_forever, name="sluice-health", daemon=True).start()
    log.info("node %d of %d: ranks %d-%d; /health on http://%s:%d (node 0 at %s:%d serves requests)",
             cfg.node_rank, cfg.nnodes, first, first + cfg.ranks_per_node - 1, host, port, cfg.master_addr,
             cfg.master_port)
    # SIGTERM (the group is being replaced): keep the ranks until node 0 has drained its requests and
    # ends the group (its ranks then exit 0), or the group fails; the pod's grace period bounds it.
    signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: waiting for node 0 to end the group"))
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    code = 1 if failed else 0
    workers.stop(timeout=0 if failed else 10)
    server.shutdown()
    return code
