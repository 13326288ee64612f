"""Reading a quantized checkpoint: config.json's quantization_config and, per linear layer, its packed tensors
from the safetensors files (read with the `safetensors` package, which knows F8_E4M3), into the format's
weights class (registry.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .registry import check_quant_config, weights_class


def read_quant_config(model_dir: Path) -> dict | None:
    """config.json's quantization_config (validated), or None for a dense checkpoint."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    qcfg = cfg.get("quantization_config")
    if qcfg is None:
        return None
    check_quant_config(qcfg)
    return qcfg


class QuantCheckpoint:
    """The tensors of a checkpoint directory's *.safetensors files, by name; `linear(prefix)` builds one layer's
    quantized weights, e.g. prefix "model.layers.0.mlp.down_proj."."""

    def __init__(self, model_dir: Path, device: torch.device | str = "cpu"):
        self.model_dir = Path(model_dir)
        self.qcfg = read_quant_config(self.model_dir)
        if self.qcfg is None:
            raise ValueError(f"{model_dir}/config.json has no quantization_config")
        self.method = check_quant_config(self.qcfg)
        self.device = torch.device(device)
        self._file_of: dict[str, Path] = {}
        for f in sorted(self.model_dir.glob("*.safetensors")):
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    self._file_of[name] = f

    def has(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor | None:
        f = self._file_of.get(name)
        if f is None:
            return None
        with safe_open(f, framework="pt") as st:
            return st.get_tensor(name)

    def linear(self, prefix: str):
        weights = weights_class(self.method).from_checkpoint(self.get, prefix, self.qcfg)
        return weights.to(self.device)

    def bias(self, prefix: str) -> torch.Tensor | None:
        b = self.get(prefix + "bias")
        return None if b is None else b.to(self.device)
