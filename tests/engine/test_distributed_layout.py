"""Issue 12, acceptance 3 and the layout arithmetic: how a model splits over ranks, and the splits
that are refused (before any rank loads a weight) with the numbers that say why."""

import subprocess
import sys

import pytest

from sluice_engine.config import EngineConfig
from sluice_engine.distributed.layout import check_layout, rank_shard, stage_layers
from sluice_engine.model_config import ModelConfig


def config(heads=9, kv=3, layers=30, inter=1536, vocab=49152) -> ModelConfig:
    return ModelConfig("llama", vocab, 576, inter, layers, heads, kv, 64, 1e-5, 1e5, 8192, True)


@pytest.mark.parametrize(("kw", "tp", "pp", "message"), [
    ({}, 2, 1, "9 attention heads are not divisible by --tensor-parallel-size 2"),
    ({"heads": 8, "kv": 4}, 6, 1, "8 attention heads are not divisible by --tensor-parallel-size 6"),
    ({"heads": 8, "kv": 4}, 8, 31, "--pipeline-parallel-size 31 is more than the model's 30 layers"),
    ({"heads": 12, "kv": 4}, 6, 1, "--tensor-parallel-size 6 is more than the 4 KV heads but not a multiple"),
    ({"heads": 8, "kv": 6}, 4, 1, "6 KV heads are not divisible by --tensor-parallel-size 4"),
    ({"heads": 8, "kv": 4, "inter": 100}, 8, 1, "intermediate size 100 is not divisible"),
    ({}, 0, 1, "must be >= 1"),
])
def test_impossible_splits_are_refused_with_their_numbers(kw, tp, pp, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_layout(config(**kw), tp, pp)


def test_bundled_model_splits():
    check_layout(config(), 3, 2)
    shards = [rank_shard(config(), 3, 2, r) for r in range(6)]
    assert [(s.pp_rank, s.tp_rank) for s in shards] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert {(s.num_heads, s.num_kv_heads) for s in shards} == {(3, 1)}
    assert [s.first_kv_head for s in shards[:3]] == [0, 1, 2]
    assert [(s.first_layer, s.end_layer) for s in shards[::3]] == [(0, 15), (15, 30)]
    assert [(s.vocab_start, s.vocab_end) for s in shards[:3]] == [(0, 16384), (16384, 32768), (32768, 49152)]
    assert shards[0].is_first_stage and not shards[0].is_last_stage and shards[5].is_last_stage


def test_kv_heads_replicated_beyond_their_count():
    mc = config(heads=8, kv=4, vocab=1000)
    shards = [rank_shard(mc, 8, 1, r) for r in range(8)]
    assert [s.first_kv_head for s in shards] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert {s.num_kv_heads for s in shards} == {1}
    # Query heads 2r, 2r+1 of rank r belong to KV head r // 2 (2 query heads per KV head): the same one.
    assert all(s.first_head // 2 == s.first_kv_head for s in shards)
    assert shards[0].vocab_padded == 1024 and shards[-1].vocab_end == 1024  # padded to 64 x 8... then split


def test_uneven_layers_split_earlier_stages_first():
    assert [stage_layers(30, 4, s) for s in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [stage_layers(2, 2, s) for s in range(2)] == [(0, 1), (1, 2)]


@pytest.mark.parametrize(("kw", "message"), [
    ({"tensor_parallel_size": 0}, "--tensor-parallel-size must be >= 1, got 0"),
    ({"pipeline_parallel_size": -1}, "--pipeline-parallel-size must be >= 1"),
    ({"nnodes": 2, "node_rank": 2, "pipeline_parallel_size": 2}, r"--node-rank must be in 0..1 \(--nnodes 2\), got 2"),
    ({"nnodes": 2, "tensor_parallel_size": 3}, "3 ranks .* cannot be spread evenly over --nnodes 2"),
    ({"master_port": 70000}, "--master-port must be a TCP port"),
    ({"nnodes": 2, "pipeline_parallel_size": 2, "master_port": 0}, "--master-port 0 .* works on one node only"),
])
def test_engine_config_refuses_bad_layouts(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_master_port_defaults_by_node_count():
    assert EngineConfig().master_port == 0  # one node: a free port when the ranks start
    assert EngineConfig(nnodes=2, pipeline_parallel_size=2).master_port == 29500  # the other nodes must know it
    assert EngineConfig(master_port=1234).master_port == 1234


@pytest.mark.parametrize(("flags", "message"), [
    (["--tensor-parallel-size", "2"], "9 attention heads are not divisible by --tensor-parallel-size 2"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1, got 0"),
    (["--pipeline-parallel-size", "31"], "--pipeline-parallel-size 31 is more than the model's 30 layers"),
    (["--nnodes", "2", "--node-rank", "3", "-pp", "2"], "--node-rank must be in 0..1"),
])
def test_sluice_serve_refuses_before_loading(model_dir, flags, message):
    """One line on stderr, exit 2, no worker started and no weight loaded."""
    proc = subprocess.run([sys.executable, "-m", "sluice_engine.entrypoints.cli", "serve", "--model", str(model_dir), *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "started ranks" not in proc.stderr and "loaded" not in proc.stderr
