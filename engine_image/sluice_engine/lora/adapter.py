"""A PEFT LoRA adapter, read and checked against the base model before any of it reaches a device.

What a PEFT adapter directory holds: `adapter_config.json` (`peft_type` LORA, rank `r`, `lora_alpha`,
`target_modules`, `use_rslora`, ...) and `adapter_model.safetensors`, whose keys name each target module's
low-rank pair: `base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]). A request on the adapter computes `y = W x + scaling * B (A x)` in every target module, with scaling
`lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA).

Everything that would make serving it wrong is refused here with a message that names the problem (the server
says it at start-up for `--lora-modules`, or as a 400 for a run-time load): missing files, a rank over
`--max-lora-rank`, target modules the model lacks, shapes that do not match the model, and the PEFT features
not served yet (DoRA, biases, `modules_to_save`, per-module rank or alpha patterns).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model_config import ModelConfig

# The projections a Llama-family decoder layer has, by their HF names, and where each sits in ours: the fused
# QKV and gate/up projections hold several (models/llama.py).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION + MLP

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served on this model: the message names the problem."""


def projection_shape(mc: ModelConfig, proj: str) -> tuple[int, int]:
    """(in_features, out_features) of a projection of the whole (unsharded) model."""
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    return {"q_proj": (mc.hidden_size, q), "k_proj": (mc.hidden_size, kv), "v_proj": (mc.hidden_size, kv),
            "o_proj": (q, mc.hidden_size), "gate_proj": (mc.hidden_size, mc.intermediate_size),
            "up_proj": (mc.hidden_size, mc.intermediate_size),
            "down_proj": (mc.intermediate_size, mc.hidden_size)}[proj]


@dataclass(slots=True)
class LoRAAdapter:
    name: str
    path: Path
    rank: int
    scaling: float
    # (layer index, projection) -> (A [rank, in], B [out, rank]), float32 on the host.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def target_modules(self) -> list[str]:
        return [p for p in PROJECTIONS if any(proj == p for _, proj in self.weights)]

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())

    @classmethod
    def load(cls, name: str, path: str | Path, mc: ModelConfig, max_rank: int) -> LoRAAdapter:
        path = Path(path)
        cfg_file = path / "adapter_config.json"
        if not path.is_dir():
            raise AdapterError(f"LoRA adapter {name!r}: {path} is not a directory")
        if not cfg_file.is_file():
            raise AdapterError(f"LoRA adapter {name!r}: no adapter_config.json in {path}")
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise AdapterError(f"LoRA adapter {name!r}: adapter_config.json is not valid JSON ({e})") from None
        rank, alpha = _check_config(name, cfg, max_rank)
        weights_file = path / "adapter_model.safetensors"
        if not weights_file.is_file():
            other = " (adapter_model.bin is not read: save it with safe_serialization)" if (
                path / "adapter_model.bin").exists() else ""
            raise AdapterError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path}{other}")
        scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        adapter = cls(name, path, rank, scaling)
        adapter.weights = _read_weights(name, weights_file, mc, rank)
        _check_targets(name, cfg, adapter.target_modules)
        return adapter


def _check_config(name: str, cfg: dict, max_rank: int) -> tuple[int, float]:
    what = f"LoRA adapter {name!r}"
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{what}: peft_type {cfg.get('peft_type')!r} is not LORA")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"{what}: adapter_config.json has no positive integer rank r (got {rank!r})")
    if rank > max_rank:
        raise AdapterError(f"{what}: rank {rank} exceeds --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, int | float):
        raise AdapterError(f"{what}: lora_alpha must be a number (got {alpha!r})")
    unsupported = []
    if cfg.get("use_dora"):
        unsupported.append("use_dora (DoRA)")
    if cfg.get("bias", "none") != "none":
        unsupported.append(f"bias {cfg.get('bias')!r}")
    if cfg.get("modules_to_save"):
        unsupported.append(f"modules_to_save {cfg['modules_to_save']}")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        unsupported.append("per-module rank_pattern / alpha_pattern")
    if unsupported:
        raise AdapterError(f"{what}: not served yet: {', '.join(unsupported)}")
    return rank, float(alpha)


def _check_targets(name: str, cfg: dict, found: list[str]) -> None:
    """target_modules names only modules the model has (a list of names, or "all-linear"); a regex is taken as
    it comes (the weights say what it matched)."""
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        lacking = sorted(set(targets) - set(PROJECTIONS))
        if lacking:
            raise AdapterError(f"LoRA adapter {name!r}: target_modules {lacking} are not modules of this model "
                               f"(LoRA applies to {', '.join(PROJECTIONS)})")
    if not found:
        raise AdapterError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA weights")


def _read_weights(name: str, weights_file: Path, mc: ModelConfig, rank: int):
    from safetensors import safe_open

    what = f"LoRA adapter {name!r}"
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    with safe_open(str(weights_file), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            m = _KEY.search(key)
            if m is None or m.group(3) not in PROJECTIONS:
                unknown.append(key)
                continue
            layer, proj, ab = int(m.group(1)), m.group(3), m.group(4)
            pairs.setdefault((layer, proj), {})[ab] = f.get_tensor(key).float()
    if unknown:
        raise AdapterError(f"{what}: weights for modules LoRA is not applied to on this model: {unknown[:3]}"
                           + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""))
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, proj), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{proj}"
        if layer >= mc.num_layers:
            raise AdapterError(f"{what}: {where}: the model has {mc.num_layers} layers")
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{what}: {where} has lora_{''.join(sorted(ab))} but not its pair")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = projection_shape(mc, proj)
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise AdapterError(f"{what}: {where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not match "
                               f"the model ({fan_in} -> {fan_out}) at rank {rank}: an adapter of another model?")
        weights[(layer, proj)] = (a.contiguous(), b.contiguous())
    return weights
