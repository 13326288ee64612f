"""How rank 0 runs a step over every rank.

One rank: the executor is just the model runner. Several: `sluice serve` on node 0 starts this node's
other ranks as worker processes (launcher.py), joins the group as rank 0, and every step broadcasts
the SchedulerOutput (plain data) to all ranks before running its own part; the logits come back to
rank 0. While idle it pings the workers, so their wait for the next step never hits the collective
timeout, and a lost rank is noticed within a ping.

Any failure of a rank is the group's: a collective raises (peer gone, timeout) or a local worker
process exits, and `on_failure` (set by the async engine) reports the engine dead so the server turns
/health to 503 and exits non-zero. Kubernetes (or LeaderWorkerSet's group restart) starts it again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import EngineConfig
from ..model_runner import ModelRunner
from ..models.model_config import ModelConfig
from ..sched_output import SchedulerOutput
from . import parallel_state as ps
from .layout import check_layout

log = logging.getLogger("sluice.engine")

PING = "ping"  # the control message of an idle step
PING_INTERVAL_S = 1.0


class Executor:
    def __init__(self, cfg: EngineConfig, model_dir: Path):
        self.cfg = cfg
        self.world_size = cfg.world_size
        self.workers = None
        self.on_failure: Callable[[BaseException], None] | None = None
        self._last_broadcast = time.monotonic()
        self._closed = False
        if self.world_size > 1:
            # Refuse a split that cannot work before any rank loads a weight.
            check_layout(ModelConfig.from_dir(model_dir), cfg.tensor_parallel_size, cfg.pipeline_parallel_size)
            from .launcher import LocalWorkers, configure_rank_threads

            configure_rank_threads(cfg)
            self.workers = LocalWorkers(cfg, model_dir, first_rank=1, count=cfg.ranks_per_node - 1,
                                        on_exit=self._worker_exited)
            ps.init_distributed(0, cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.master_addr,
                                cfg.master_port, _device_hint(cfg), cfg.distributed_timeout)
        self.runner = ModelRunner(cfg, model_dir, rank=0, local_rank=0)
        blocks = self.runner.kv_block_capacity()
        if self.world_size > 1:
            blocks = ps.all_ranks_min(blocks)
        self.runner.allocate_kv_cache(blocks)

    # -- what the engine reads -----------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def model_config(self) -> ModelConfig:
        return self.runner.model_config

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def num_devices(self) -> int:
        """Accelerators of the whole replica (every rank's), 0 on CPU."""
        return self.world_size if self.runner.device.type == "cuda" else 0

    # -- steps ---------------------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput) -> torch.Tensor:
        if self.world_size > 1:
            ps.broadcast_from_rank0(sched)
            self._last_broadcast = time.monotonic()
        logits = self.runner.execute_model(sched)
        assert logits is not None
        return logits

    def keepalive(self) -> None:
        """Called when idle: ping the workers once a ping interval has passed since the last message."""
        if self.world_size > 1 and time.monotonic() - self._last_broadcast >= PING_INTERVAL_S:
            ps.broadcast_from_rank0(PING)
            self._last_broadcast = time.monotonic()

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers: a stop message when the group is healthy, else kill this node's."""
        if self._closed or self.world_size == 1:
            return
        self._closed = True
        if graceful:
            try:
                done = threading.Event()
                threading.Thread(target=lambda: (ps.broadcast_from_rank0(None), done.set()), daemon=True).start()
                done.wait(5)
            except Exception:  # noqa: BLE001 - the group is already broken: kill below
                log.warning("could not tell the workers to stop; killing this node's")
        if self.workers is not None:
            self.workers.stop(timeout=10 if graceful else 0)

    def _worker_exited(self, rank: int, code: int) -> None:
        if self._closed:
            return
        err = RuntimeError(f"rank {rank} exited with code {code}: the group cannot serve")
        log.error("%s", err)
        if self.on_failure is not None:
            self.on_failure(err)


def _device_hint(cfg: EngineConfig) -> torch.device:
    """The backend each rank will use (NCCL on CUDA, gloo on CPU), known before the model loads."""
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")
