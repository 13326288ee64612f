"""How rank 0 runs a step over every rank.

One rank: the executor is just the model runner. Several: `sluice serve` on node 0 starts this node's
other ranks as worker processes (launcher.py), joins the group as rank 0, and every step broadcasts
the SchedulerOutput (plain data) to all ranks before running its own part; the logits come back to
rank 0. With pipeline stages, up to one step per stage is in flight (submit / collect): stage 0 starts
the next micro-batch while later stages work on earlier ones. While idle it pings the workers, so their wait for the next step never hits the collective
timeout, and a lost rank is noticed within a ping.

Any failure of a rank is the group's: a collective raises (peer gone, timeout) or a local worker
process exits, and `on_failure` (set by the async engine) reports the engine dead so the server turns
/health to 503 and exits non-zero. Kubernetes (or LeaderWorkerSet's group restart) starts it again.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import EngineConfig
from ..core.sched_output import SchedulerOutput
from ..distributed import parallel_state as ps
from ..distributed.layout import check_layout
from ..model_config import ModelConfig
from ..worker.memory_profile import plan_kv_cache
from ..worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from ..spec_decode.draft_model import DraftModelProposer

log = logging.getLogger("sluice.engine")

PING = "ping"  # the control message of an idle step
PING_INTERVAL_S = 1.0


class Executor:
    def __init__(self, cfg: EngineConfig, model_dir: Path, draft_dir: Path | None = None):
        self.cfg = cfg
        self.world_size = cfg.world_size
        self.workers = None
        self.on_failure: Callable[[BaseException], None] | None = None
        self._last_message = time.monotonic()
        self._closed = False
        self._in_flight: deque[tuple[SchedulerOutput, torch.Tensor | None]] = deque()
        if self.world_size > 1:
            # Refuse a split that cannot work before any rank loads a weight.
            check_layout(ModelConfig.from_dir(model_dir), cfg.tensor_parallel_size, cfg.pipeline_parallel_size)
            from .launcher import LocalWorkers, configure_rank_threads, free_port

            configure_rank_threads(cfg)
            if cfg.master_port == 0:  # one node: a free port, told to the local ranks in their config
                cfg = self.cfg = dataclasses.replace(cfg, master_port=free_port(cfg.master_addr))
            self.workers = LocalWorkers(cfg, model_dir, first_rank=1, count=cfg.ranks_per_node - 1,
                                        on_exit=self._worker_exited)
            atexit.register(self.shutdown)  # a script that never calls shutdown() still stops its ranks cleanly
            ps.init_distributed(0, cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.master_addr,
                                cfg.master_port, _device_hint(cfg), cfg.distributed_timeout)
        self.runner = ModelRunner(cfg, model_dir, rank=0, local_rank=0)
        # The draft model (one rank only: the engine refuses it with more) loads before the KV cache
        # is sized: its weights, activations and cache come out of the same memory as the target's.
        self.draft: DraftModelProposer | None = None
        if draft_dir is not None:
            from ..spec_decode.proposer import load_draft_model

            self.draft = load_draft_model(draft_dir, self.runner)
        blocks = plan_kv_cache(self.runner, self.draft).num_blocks
        offload = self.runner.offload_blocks_wanted()
        if self.world_size > 1:
            blocks = ps.all_ranks_min(blocks)
            offload = ps.all_ranks_min(offload)
        self.runner.allocate_kv_cache(blocks, offload)
        if self.draft is not None:
            self.draft.allocate_kv_cache(blocks)  # as many tokens as the target's: the plan's split

    # -- what the engine reads -----------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def num_offload_blocks(self) -> int:
        """The offload tier's size in blocks (0: none)."""
        return self.runner.kv_tier.num_slots if self.runner.kv_tier is not None else 0

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
    @property
    def max_in_flight(self) -> int:
        """Steps that may be in flight at once: one per pipeline stage, so every stage has work."""
        return self.cfg.pipeline_parallel_size

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def submit(self, sched: SchedulerOutput) -> None:
        """Start a step: every rank gets it; this rank runs its (first) stage and hands it on."""
        if self.world_size > 1:
            ps.send_control(sched)
            self._last_message = time.monotonic()
        self._in_flight.append((sched, self.runner.execute_model(sched)))

    def collect(self) -> torch.Tensor:
        """The logits of the oldest step in flight (waits for the last stage)."""
        sched, logits = self._in_flight.popleft()
        if logits is None:
            rows, _ = sched.logits_layout()
            logits = ps.recv_logits((len(rows), self.model_config.vocab_size), self.runner.device)
        return logits

    def execute_model(self, sched: SchedulerOutput) -> torch.Tensor:
        """One step, start to logits."""
        self.submit(sched)
        return self.collect()

    def keepalive(self) -> None:
        """Called when idle: ping the workers once a ping interval has passed since the last message."""
        if self.world_size > 1 and time.monotonic() - self._last_message >= PING_INTERVAL_S:
            ps.send_control(PING)
            self._last_message = time.monotonic()

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers: a stop message when the group is healthy, else kill this node's."""
        if self._closed or self.world_size == 1:
            return
        self._closed = True
        if graceful:
            try:
                ps.send_control(None)
                done = threading.Event()
                threading.Thread(target=lambda: (ps.wait_sends(), done.set()), daemon=True).start()
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
