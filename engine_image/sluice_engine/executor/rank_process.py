"""A worker rank: joins the group, loads its shard, then runs every step rank 0 broadcasts until told
to stop. Started by launcher.py as `python -m sluice_engine.executor.rank_process` with the engine config
in $SLUICE_WORKER_CONFIG. Any error ends the process non-zero: the group is restarted whole."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

from ..config import EngineConfig
from ..distributed import parallel_state as ps
from ..worker.memory_profile import plan_kv_cache
from ..worker.model_runner import ModelRunner
from .executor import PING, _device_hint
from .launcher import configure_rank_threads

log = logging.getLogger("sluice.engine")


def run_worker(cfg: EngineConfig, model_dir: Path, rank: int) -> None:
    configure_rank_threads(cfg)
    local_rank = rank % cfg.ranks_per_node
    ps.init_distributed(rank, cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.master_addr,
                        cfg.master_port, _device_hint(cfg), cfg.distributed_timeout, local_rank)
    runner = ModelRunner(cfg, model_dir, rank=rank, local_rank=local_rank)
    # Sized like rank 0's (executor.py): the profile's collectives pair up with the other ranks'.
    blocks = ps.all_ranks_min(plan_kv_cache(runner).num_blocks)
    runner.allocate_kv_cache(blocks, ps.all_ranks_min(runner.offload_blocks_wanted()))
    torch.set_grad_enabled(False)
    steps = 0
    while True:
        msg = ps.recv_control()
        if msg is None:
            break
        if msg == PING:
            continue
        runner.execute_model(msg)
        steps += 1
    ps.wait_sends()
    log.info("rank %d: stopped after %d steps", rank, steps)


def main() -> int:
    logging.basicConfig(level=os.environ.get("SLUICE_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(os.environ["SLUICE_WORKER_CONFIG"])
    rank = int(sys.argv[1])
    cfg = EngineConfig(**spec["config"])
    try:
        run_worker(cfg, Path(spec["model_dir"]), rank)
    except KeyboardInterrupt:
        return 1
    except BaseException:
        log.exception("rank %d failed", rank)
        return 1
    # Skip interpreter teardown: the process group's destructors can wait on peers that already left.
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
