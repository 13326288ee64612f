"""A GGUF file as the checkpoint of an HF-format directory: its tensors under their HF names, dequantized to
float32 as they are read, so a directory converted from a GGUF needs no dense copy of the weights on disk.

model_fetch.py converts a GGUF into config.json, the tokenizer files and a reference to the GGUF
(`GGUF_REFERENCE`); models/loader.py reads the weights through `gguf_tensors` where the directory has no
*.safetensors. The CPU path's quantized layers take their blocks straight from the file (quant_loader.py) and
never ask for theirs, so a default start dequantizes only the embedding and the norms; `--quantization none`
and GPU starts dequantize every tensor at load (0.7 s for the bundled model), nothing is written.
`hf_dense_dir` writes a dense copy beside it for readers that take only HF directories (transformers as the
tests' numerical reference, the HF peer of the benchmarks).

The floats are those of gguf-py's dequantizers (what transformers' GGUF loading, and so the former full
conversion, produced): for Q4_1 `d * q + m`, Q8_0 `d * q`, Q4_0 `d * (q - 8)`, each a float32 multiply then
add (torch's CPU ops round each one, no fused multiply-add), d and m widened from fp16. Other block types
are dequantized by gguf-py itself. llama.cpp's converter permutes the rows of a llama model's attn_q and
attn_k (rotary pairs interleaved per head); they are put back in HF order, as transformers does.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

# GGUF_REFERENCE: the file beside config.json, {"gguf": path relative to the directory, or absolute}
from ..model_fetch import GGUF_REFERENCE
from .gguf_file import GgufTensor, open_gguf

# GGUF tensor name -> HF name (llama.cpp's names for the decoder families the engine runs: llama, mistral,
# qwen2, qwen3)
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_TENSOR = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def gguf_checkpoint(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory reads its weights from, or None (an ordinary HF directory)."""
    ref = Path(model_dir) / GGUF_REFERENCE
    if not ref.is_file():
        return None
    return (Path(model_dir) / json.loads(ref.read_text())["gguf"]).resolve()


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, None for one with no HF counterpart (llama.cpp's rope_freqs: the rope
    scaling it encodes is in config.json)."""
    m = _LAYER_TENSOR.match(gguf_name)
    if m is not None:
        part = _PER_LAYER.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    m = _GLOBAL_TENSOR.match(gguf_name)
    if m is not None and m.group(1) in _GLOBAL:
        return f"{_GLOBAL[m.group(1)]}.{m.group(2)}"
    return None


def _fp16_scale(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return blocks[:, at : at + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """A block's 16 bytes as its 32 4-bit values: the low nibbles are elements 0-15, the high ones 16-31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _fp16_scale(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return _fp16_scale(blocks, 0) * q.to(torch.float32)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:]).to(torch.float32)
    return _fp16_scale(blocks, 0) * q + _fp16_scale(blocks, 2)


# block type -> (bytes per block of 32, dequantizer over [blocks, bytes] uint8)
_BLOCK_TYPES = {"Q8_0": (34, _q8_0), "Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1)}
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # as read: BF16 comes as uint16


def dequantize(tensor: GgufTensor) -> torch.Tensor:
    """A GGUF tensor as float32, in its HF shape (rows = outputs)."""
    kind, shape = tensor.type_name, tensor.hf_shape
    if kind in _FLOAT_TYPES:
        return torch.from_numpy(np.array(tensor.data)).view(_FLOAT_TYPES[kind]).to(torch.float32).reshape(shape)
    if kind in _BLOCK_TYPES:
        size, fn = _BLOCK_TYPES[kind]
        blocks = torch.from_numpy(np.array(tensor.data).reshape(-1, size))  # a copy: the file's map is read-only
        return fn(blocks).reshape(shape)
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize  # k-quants and the rest: gguf-py's own

    values = gguf_dequantize(np.array(tensor.data), GGMLQuantizationType(tensor.type_id))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def unpermute_rows(rows, n_head: int):
    """Undo llama.cpp's converter's rotary permutation of attn_q/attn_k rows: per head it holds the two
    halves of the head's dims interleaved; HF holds them as [first half, second half]. Whole rows move, so it
    applies to dense rows and block rows alike."""
    n = rows.shape[0]
    return rows.reshape(n_head, n // n_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


class GgufTensorSlice:
    """One GGUF tensor, read on indexing as loader.SafetensorsSlice is: `[:]`, `[a:b]` (rows) or `[:, a:b]`
    (columns). Dequantized whole when first indexed, then dropped with the slice."""

    def __init__(self, tensor: GgufTensor, heads_for_permutation: int | None):
        self.tensor, self.heads = tensor, heads_for_permutation
        self.shape = tensor.hf_shape

    def _dense(self) -> torch.Tensor:
        t = dequantize(self.tensor)
        return unpermute_rows(t, self.heads).contiguous() if self.heads else t

    def __getitem__(self, key) -> torch.Tensor:
        dense = self._dense()  # a fresh tensor: whole, it is the answer; a slice of it is copied out
        return dense if key == slice(None) else dense[key].clone()


def gguf_tensors(path: Path) -> Iterator[tuple[str, GgufTensorSlice]]:
    """(HF name, lazy slice) of every tensor of a GGUF file that has an HF counterpart."""
    gguf = open_gguf(path)
    arch = gguf.field("general.architecture")
    heads = {"attn_q": gguf.field(f"{arch}.attention.head_count"),
             "attn_k": gguf.field(f"{arch}.attention.head_count_kv")}
    for t in gguf.tensors.values():
        name = hf_name(t.name)
        if name is None:
            continue
        part = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        # llama.cpp permutes q/k for its llama architecture (Llama, Mistral, SmolLM...), not for qwen2/qwen3
        permute = heads.get(part) if arch == "llama" and name.endswith(".weight") else None
        yield name, GgufTensorSlice(t, permute)


def hf_dense_dir(model_dir: Path) -> Path:
    """A directory HF transformers can load for `model_dir`: the directory itself when it has safetensors,
    else (converted from a GGUF) a copy beside it, `<name>-hf-fp32`, with the same config and tokenizer and
    the dense float32 weights, written once. For the readers that take only HF directories: transformers as
    the tests' numerical reference and the HF peer of the benchmarks. The engine never needs it."""
    import shutil

    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    gguf = gguf_checkpoint(model_dir)
    if gguf is None or any(model_dir.glob("*.safetensors")):
        return model_dir
    out = model_dir.with_name(f"{model_dir.name}-hf-fp32")
    if (out / "model.safetensors").is_file():
        return out
    tensors = {name: get[:] for name, get in gguf_tensors(gguf)}
    if json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name != GGUF_REFERENCE:
            shutil.copy2(f, tmp / f.name)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    try:
        tmp.rename(out)
    except OSError:  # another process wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out
