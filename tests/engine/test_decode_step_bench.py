"""benchmarks/decode_step.py's core on CPU: the tiny random model (benchmarks/random_model.py) loads through the
engine's own config/loader/tokenizer, and two decode steps at batch 2 give finite times and the right token counts.
The GPU figures themselves come from benchmarks/gpu_check.sh."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_step  # noqa: E402
import random_model  # noqa: E402


def test_tiny_random_model_loads_and_decodes(tmp_path):
    from sluice_engine.model_config import ModelConfig
    from sluice_engine.tokenizer import Tokenizer

    model_dir = random_model.create(tmp_path / "tiny", "tiny", device="cpu")
    mc = ModelConfig.from_dir(model_dir)
    assert (mc.vocab_size, mc.num_layers, mc.num_kv_heads) == (512, 2, 2)
    tok = Tokenizer.from_dir(model_dir)
    assert tok.vocab_size == 512 and tok.eos_token_ids == {random_model.EOS_ID}
    assert tok.encode("t5 t77", add_special_tokens=False) == [5, 77]
    assert tok.encode_chat([{"role": "user", "content": "t9"}])
    total, read = random_model.weight_bytes(json.loads((model_dir / "config.json").read_text()), 2)
    assert (model_dir / "model.safetensors").stat().st_size > total > read  # + the header
    # created again with the same config: reused, not rewritten
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert random_model.create(model_dir, "tiny", device="cpu") == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime

    torch.manual_seed(0)
    results = decode_step.bench(model_dir, "cpu", "float32", [2], steps=2, prompt_len=8, modes=[True],
                                backend="torch", kv_cache_memory=8 << 20, warmup=False)
    (row,) = results[True]
    assert row["batch"] == 2 and row["steps"] >= 1 and math.isfinite(row["median_ms"]) and row["median_ms"] > 0
    assert row["tokens_per_request"] == [3]  # the prefill's token + 2 decoded
