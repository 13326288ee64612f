"""Tiny random GPU-quantized layers and checkpoints for the tests (test_quant_triton.py, test_quant_model.py):
each layer comes with its packed tensors, in the names and layouts AWQ / GPTQ / FP8 checkpoints use, and its
dequantized dense twin W [N, K] (fp32, exact: the tests hold the quantized path to the twin)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sluice_engine.quant import awq, fp8, gptq


def random_w4(k: int, n: int, group: int, gen: torch.Generator, scale: float = 1.0):
    """4-bit values q [K, N], zeros z [K/G, N] (0..15) and fp16 scales s [K/G, N]."""
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // group, n), generator=gen)
    s = ((torch.rand(k // group, n, generator=gen) * 0.02 + 0.001) * scale).half()
    return q, z, s


def awq_layer(k: int, n: int, group: int, gen: torch.Generator, scale: float = 1.0):
    """({qweight, qzeros, scales}, W [N, K])"""
    q, z, s = random_w4(k, n, group, gen, scale)
    w = (q - z.repeat_interleave(group, 0)).float() * s.float().repeat_interleave(group, 0)  # [K, N]
    return {"qweight": awq.pack_awq(q), "qzeros": awq.pack_awq(z), "scales": s}, w.T.contiguous()


def gptq_layer(k: int, n: int, group: int, gen: torch.Generator, g_idx: torch.Tensor | None = None,
               scale: float = 1.0):
    """({qweight, qzeros, scales, g_idx}, W [N, K]); g_idx None stores the trivial k // G (as checkpoints
    without act-order do)."""
    q, z, s = random_w4(k, n, group, gen, scale)
    g = torch.arange(k) // group if g_idx is None else g_idx.long()
    w = (q - (z + 1)[g]).float() * s.float()[g]  # v1: zeros stored minus one
    tensors = {"qweight": gptq.pack_rows(q), "qzeros": gptq.pack_cols(z), "scales": s, "g_idx": g.int()}
    return tensors, w.T.contiguous()


def fp8_layer(k: int, n: int, gen: torch.Generator, per_channel: bool, std: float = 1.0):
    """({weight e4m3, weight_scale}, W [N, K]); the scale as checkpoints store it: 0-d per tensor, [N, 1]
    per channel."""
    wq, scale = fp8.quantize_fp8(torch.randn(n, k, generator=gen) * std, per_channel)
    w = wq.float() * (scale[:, None] if per_channel else scale)
    return {"weight": wq, "weight_scale": scale[:, None] if per_channel else scale.reshape(())}, w


def write_checkpoint(root: Path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 2) -> None:
    """config.json and the tensors in `shards` safetensors files (a loader must find each tensor in
    whichever file holds it)."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    for i in range(shards):
        part = names[i * len(names) // shards : (i + 1) * len(names) // shards]
        save_file({n: tensors[n].contiguous() for n in part},
                  str(root / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
