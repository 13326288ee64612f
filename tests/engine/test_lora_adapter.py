"""PEFT LoRA adapters read and checked against the model (issue 26): adapters written by PEFT on a tiny Llama load
with their weights and scaling as PEFT applies them; every adapter that cannot be served is refused with a
message that names the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny_llama import write_tiny_llama

from sluice_engine.lora.adapter import PROJECTIONS, AdapterError, LoRAAdapter
from sluice_engine.lora.ops import LoRASegments, lora_expand, lora_shrink
from sluice_engine.model_config import ModelConfig

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = write_tiny_llama(tmp_path_factory.mktemp("tiny"))
    return d, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)


def write_adapter(base, out, **lora_kw):
    """A PEFT adapter with random (not zero) B, saved as PEFT saves it; returns (dir, the PEFT model)."""
    import copy

    _, hf = base
    cfg = peft.LoraConfig(init_lora_weights=False, **lora_kw)
    torch.manual_seed(0)
    model = peft.get_peft_model(copy.deepcopy(hf), cfg)
    model.save_pretrained(out)
    return out, model


@pytest.mark.parametrize("rslora", [False, True])
def test_peft_adapter_loads_as_peft_applies_it(base, tmp_path, rslora):
    d, _ = base
    path, model = write_adapter(base, tmp_path / "a", r=8, lora_alpha=16, target_modules=list(PROJECTIONS),
                                use_rslora=rslora)
    mc = ModelConfig.from_dir(d)
    ad = LoRAAdapter.load("a", path, mc, max_rank=16)
    assert ad.rank == 8 and ad.target_modules == list(PROJECTIONS)
    assert ad.scaling == pytest.approx(16 / 8 ** 0.5 if rslora else 16 / 8)
    assert len(ad.weights) == mc.num_layers * len(PROJECTIONS)
    # Each module's delta, through our shrink/expand, is what PEFT adds to the base layer's output.
    x = torch.randn(5, mc.hidden_size)
    for layer in range(mc.num_layers):
        peft_q = model.base_model.model.model.layers[layer].self_attn.q_proj
        want = peft_q(x) - peft_q.base_layer(x)
        a, b = ad.weights[(layer, "q_proj")]
        y = torch.zeros(5, b.shape[0])
        segs = LoRASegments.from_requests([5], [1])
        lora_expand(lora_shrink(x, torch.stack([torch.zeros_like(a), a]), segs),
                    torch.stack([torch.zeros_like(b), b * ad.scaling]), segs, y)
        torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


def test_a_subset_of_targets_loads_only_those(base, tmp_path):
    d, _ = base
    path, _ = write_adapter(base, tmp_path / "qv", r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    ad = LoRAAdapter.load("qv", path, ModelConfig.from_dir(d), max_rank=64)
    assert ad.target_modules == ["q_proj", "v_proj"] and ad.rank == 16 and ad.scaling == 2.0


def test_bad_adapters_are_refused_by_name(base, tmp_path):
    d, _ = base
    mc = ModelConfig.from_dir(d)
    good, _ = write_adapter(base, tmp_path / "good", r=8, lora_alpha=8, target_modules=["q_proj", "o_proj"])

    def refused(path, match, max_rank=64):
        with pytest.raises(AdapterError, match=match):
            LoRAAdapter.load("bad", path, mc, max_rank=max_rank)

    refused(good, r"rank 8 exceeds --max-lora-rank 4", max_rank=4)
    refused(tmp_path / "nowhere", "is not a directory")
    no_weights = tmp_path / "no-weights"
    shutil.copytree(good, no_weights)
    (no_weights / "adapter_model.safetensors").unlink()
    refused(no_weights, "no adapter_model.safetensors")
    cfg = json.loads((good / "adapter_config.json").read_text())
    for change, match in [({"use_dora": True}, "DoRA"), ({"bias": "all"}, "bias 'all'"),
                          ({"target_modules": ["q_proj", "c_attn"]}, r"\['c_attn'\] are not modules of this model"),
                          ({"r": 0}, "no positive integer rank"), ({"peft_type": "IA3"}, "is not LORA")]:
        bad = tmp_path / f"bad-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(good, bad)
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
        refused(bad, match)
    # An adapter of another model: the same names, other shapes.
    other_dir = write_tiny_llama(tmp_path / "other")
    other_cfg = json.loads((other_dir / "config.json").read_text())
    other = ModelConfig.from_dict({**other_cfg, "hidden_size": 64, "intermediate_size": 96})
    with pytest.raises(AdapterError, match=r"do not match the model .* an adapter of another model"):
        LoRAAdapter.load("bad", good, other, max_rank=64)
    # LoRA on the output layer: not a module LoRA is applied to here.
    lm_head, _ = write_adapter(base, tmp_path / "lm-head", r=4, lora_alpha=4, target_modules=["q_proj", "lm_head"])
    refused(lm_head, "lm_head")
