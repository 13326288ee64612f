"""The KV offload tier across ranks (issue 28): every rank stores and loads its own shard of each block (its KV
heads under TP, its layers under PP) by the step's plain-data instructions, so a request continued from blocks
loaded back from the tier gets the logits it gets from the blocks it computed: one process, TP 2 and PP 2
(real processes joined over gloo; the tiny model of test_distributed_model.py)."""

import pytest
import torch
from servers import free_port
from test_distributed_model import VOCAB, tiny_llama  # noqa: F401 - the fixture

from sluice_engine.config import EngineConfig
from sluice_engine.core.sched_output import ScheduledRequest, SchedulerOutput
from sluice_engine.executor.executor import Executor

pytestmark = pytest.mark.slow

A = [5, 17, 299, 64, 3, 128, 200, 11, 9]  # 9 tokens: blocks of 4, the third block partly full
X = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 250]


def steps(tier: bool) -> list[SchedulerOutput]:
    """a's prompt in blocks 0-2; then x's prompt, which (with the tier) overwrites blocks 0-2 after they are
    stored to tier slots 0-2; then a's next token, (with the tier) from blocks 5-7 loaded from those slots."""
    if not tier:
        return [SchedulerOutput([ScheduledRequest("a", A, 0, [0, 1, 2])]),
                SchedulerOutput([ScheduledRequest("x", X, 0, [8, 9, 10])]),
                SchedulerOutput([ScheduledRequest("a", [42], 9, [0, 1, 2])])]
    return [SchedulerOutput([ScheduledRequest("a", A, 0, [0, 1, 2])]),
            SchedulerOutput([ScheduledRequest("x", X, 0, [0, 1, 2])], kv_stores=[(0, 0), (1, 1), (2, 2)]),
            SchedulerOutput([ScheduledRequest("a2", [42], 9, [5, 6, 7])], kv_loads=[(0, 5), (1, 6), (2, 7)],
                            freed_req_ids=["a"])]


def run(model_dir, tp: int, pp: int, tier: bool) -> list[torch.Tensor]:
    cfg = EngineConfig(model=str(model_dir), device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp,
                       kv_cache_memory=4 << 20, block_size=4, master_port=free_port(), distributed_timeout=120,
                       kv_offload_bytes=(1 << 20) if tier else 0)
    ex = Executor(cfg, model_dir)
    try:
        assert ex.num_offload_blocks == (((1 << 20) // ex.runner.kv_bytes_per_block) if tier else 0)
        return [ex.execute_model(s).clone() for s in steps(tier)]
    finally:
        ex.shutdown()
        from sluice_engine.distributed.parallel_state import destroy_distributed

        destroy_distributed()


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)], ids=["one-rank", "tp2", "pp2"])
def test_blocks_loaded_from_the_tier_give_the_logits_of_the_blocks_computed(tiny_llama, tp, pp):  # noqa: F811
    want = run(tiny_llama, tp, pp, tier=False)
    got = run(tiny_llama, tp, pp, tier=True)
    assert got[2].shape == (1, VOCAB)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=1e-6)
