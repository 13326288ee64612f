"""Model loading: the device and dtype a config names, and the weights of one rank's shard streamed
from a checkpoint's safetensors files (or, for a directory converted from a GGUF, from the GGUF itself:
models/gguf_checkpoint.py).

Each checkpoint tensor is read lazily, tensor by tensor, and only the rows this rank holds
(distributed/layout.py) are read from the file (columns: the tensor, then sliced): peak memory while
loading is about the rank's shard plus one tensor, never the whole checkpoint. Sharded checkpoints are read
through their `model.safetensors.index.json`. Q/K/V and gate/up land in their fused projections.

Quantized checkpoints (config.json quantization_config: fp8, awq, gptq) have their decoder projections built
from the packed tensors by models/gpu_quant_loader.py before the model is; this loader then fills the rest
(embeddings, norms, output layer, projections the checkpoint keeps dense) and passes over the packed tensors.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..distributed.layout import RankShard, single_shard
from ..model_config import ModelConfig
from ..quant.formats import CPU_FORMATS, GPU_FORMATS, gpu_formats_run
from ..quant.formats import check_device as check_quant_device
from .gguf_checkpoint import GGUF_REFERENCE, GgufTensorSlice, gguf_checkpoint, gguf_tensors
from .llama import LlamaForCausalLM, dense_linear

log = logging.getLogger("sluice.engine")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# KV-cache scales of FP8 checkpoints, used by --kv-cache-dtype fp8 (the cache holds K / k_scale, V / v_scale):
# the name after "layers.N.self_attn." -> which of the layer's [k_scale, v_scale] it sets. The spellings in use:
# llm-compressor's `self_attn.k_scale`, AutoFP8/ModelOpt/Quark's `k_proj.k_scale`, compressed-tensors' older
# `k_proj.output_scale`, `attn.k_scale`, and one `kv_scale` for both. Loaded whatever --kv-cache-dtype says
# (they are two floats per layer); only an FP8 cache reads them.
_KV_SCALES = {
    "k_scale": (0,), "v_scale": (1,), "kv_scale": (0, 1),
    "k_proj.k_scale": (0,), "v_proj.v_scale": (1,),
    "k_proj.output_scale": (0,), "v_proj.output_scale": (1,),
    "attn.k_scale": (0,), "attn.v_scale": (1,),
}


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """auto: CUDA when there is one. With several ranks on a node, rank i takes CUDA device i."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"rank {local_rank} of this node needs CUDA device {local_rank}, but only "
                             f"{torch.cuda.device_count()} are visible")
        return torch.device("cuda", local_rank)
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # fp32 on CPU: bf16 matmuls are several times slower for prefill on common x86 CPUs.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def checkpoint_quantization(model_dir: Path) -> str | None:
    """The quant_method of an HF directory's config.json quantization_config (validated: registry.py), or
    None for a dense checkpoint."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    qcfg = cfg.get("quantization_config")
    if qcfg is None:
        return None
    from ..quant.registry import check_quant_config

    return check_quant_config(qcfg)


def resolve_quantization(cfg, device: torch.device, dtype: torch.dtype, backend,
                         checkpoint: str | None = None, gguf: Path | None = None, unsharded: bool = True) -> str:
    """--quantization as this rank runs it: none, a CPU block format, `auto` (a GGUF's own CPU-format
    blocks, layer by layer: models/quant_loader.py), or a GPU format (quant/formats.py).
    checkpoint: the checkpoint's own quantization (`checkpoint_quantization`), None for a dense one;
    gguf: the GGUF file the model came from (`gguf_source`), None for an HF directory."""
    q = cfg.quantization
    check_quant_device(q, device.type, backend.name)
    if checkpoint is not None:
        if q not in ("auto", checkpoint):
            raise ValueError(f"--quantization {q}: the checkpoint is {checkpoint}-quantized (config.json "
                             f"quantization_config); serve it with --quantization auto or {checkpoint}")
        if not gpu_formats_run(device.type, backend.name):
            raise ValueError(f"the checkpoint is {checkpoint}-quantized (config.json quantization_config): "
                             f"{checkpoint} weights need CUDA kernels (Triton), not {device.type}; on CPU serve "
                             f"a dense checkpoint or a GGUF one ({', '.join(CPU_FORMATS)})")
        return checkpoint
    if q in GPU_FORMATS:
        if q != "fp8":
            raise ValueError(f"--quantization {q} serves {q} checkpoints (config.json quantization_config "
                             f"quant_method {q}); this checkpoint is dense (use auto or none, or fp8 to "
                             "quantize its weights at load)")
        return q  # fp8 on a dense checkpoint: quantized at load (models/gpu_quant_loader.py)
    if q == "auto":
        # On the C++ CPU path a GGUF is served in its own blocks (the bundled model: its Q4_1 layers and its
        # Q8_0 output layer): 5x fewer bytes per decode step than fp32, and int8 activations make its prefill
        # faster too (docs/BENCHMARKS.md). Anywhere else, and for an HF directory, the dtype's weights.
        if (gguf is not None and device.type == "cpu" and dtype == torch.float32 and backend.name == "cpu"
                and unsharded):
            from ..cpu_kernels import load as load_kernels

            if load_kernels() is not None:
                return "auto"
        return "none"
    if q != "none" and (dtype != torch.float32 or backend.name != "cpu"):
        raise ValueError(f"--quantization {q} runs with the C++ CPU path: --dtype float32 and --attention-backend "
                         f"cpu (got {dtype}, {backend.name})")
    return q


def checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, SafetensorsSlice | GgufTensorSlice]]:
    """(name, lazy slice) of every tensor of a checkpoint: its safetensors files, or for a directory converted
    from a GGUF that has none, the GGUF's tensors dequantized as read (models/gguf_checkpoint.py)."""
    gguf = gguf_checkpoint(model_dir)
    if gguf is not None and not any(Path(model_dir).glob("*.safetensors")):
        if not gguf.is_file():
            raise ValueError(f"{model_dir} reads its weights from {gguf} ({GGUF_REFERENCE}), which is not there")
        return gguf_tensors(gguf)
    return _checkpoint_tensors(checkpoint_files(model_dir))


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ValueError(f"{index} names files that are not there: {missing[:3]}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    return files


def load_model(model_dir: Path, mc: ModelConfig, backend, device: torch.device, dtype: torch.dtype,
               max_positions: int, shard: RankShard | None = None, quantization: str = "none",
               gguf_path: Path | None = None, numerics: str = "exact") -> LlamaForCausalLM:
    """This rank's shard of the model of an HF directory, built directly in `dtype` on `device` (no
    fp32 copy of the weights ever exists), in eval mode. With `quantization` a CPU block format (or
    auto), linear layers are then held in GGUF blocks, read from `gguf_path` where it has them
    (models/quant_loader.py). With a GPU format (fp8, awq, gptq), a checkpoint quantized in it has its
    decoder projections built from its packed tensors, and fp8 on a dense checkpoint quantizes them once
    loaded (models/gpu_quant_loader.py)."""
    t0 = time.perf_counter()
    shard = shard or single_shard(mc)
    own = checkpoint_quantization(model_dir)
    if own is not None:
        if quantization not in ("auto", own):
            raise ValueError(f"{model_dir} is {own}-quantized (config.json quantization_config); it loads with "
                             f"--quantization {own} (or auto), not {quantization}")
        quantization = own
    linear, quant_linears, blocks, lib = dense_linear, None, None, None
    if own is not None:
        from .gpu_quant_loader import QuantLinears

        linear = quant_linears = QuantLinears(model_dir, mc, shard, dtype, device)
    elif quantization in CPU_FORMATS or quantization == "auto":
        from ..cpu_kernels import load as load_kernels
        from .quant_loader import GGUFBlocks, GGUFLinears

        lib = load_kernels()
        if lib is None:
            raise ValueError(f"--quantization {quantization}: the C++ CPU kernels did not build (see the log)")
        blocks = GGUFBlocks(gguf_path) if gguf_path else None
        if blocks is not None and shard.tp * shard.pp == 1:
            # The GGUF's own blocks become the layers as the model is built: their fp32 weights never exist.
            linear = GGUFLinears(quantization, blocks, mc, lib)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(mc, backend, max_positions=max_positions, shard=shard, linear=linear)
    finally:
        torch.set_default_dtype(default_dtype)
    load_weights(model, checkpoint_tensors(model_dir))
    if quant_linears is not None:
        quant_linears.finish()
    elif quantization == "fp8":
        from .gpu_quant_loader import quantize_fp8_linears

        quantize_fp8_linears(model)
    where = "" if shard.tp * shard.pp == 1 else (
        f" (rank {shard.rank}: TP {shard.tp_rank}/{shard.tp}, layers {shard.first_layer}-{shard.end_layer - 1})")
    log.info("loaded %s (%s, %d layers, %.1fM params%s) on %s in %.1fs", model_dir, mc.architecture,
             shard.num_layers, sum(p.numel() for p in model.parameters()) / 1e6, where, device,
             time.perf_counter() - t0)
    if quantization in CPU_FORMATS or quantization == "auto":
        from .quant_loader import quantize_linears

        # The layers left: quantized from their loaded fp32 weights where the format asks for it, and the
        # output layer (with a tied embedding reading its blocks) where the GGUF ships it quantized.
        quantize_linears(model, quantization, blocks, lib)
        if numerics != "exact":
            from ..cpu_kernels.quant import set_numerics

            log.info("block-format GEMM: --numerics %s (%d layers round once per block)", numerics,
                     set_numerics(model, numerics))
    if backend.name in ("cpu", "ggml") and dtype == torch.float32:  # the C++ CPU path: linear layers too
        from ..cpu_kernels.linear import pack_linears

        pack_linears(model)
    return model.eval()


# -- weights ---------------------------------------------------------------------------------------
def load_weights(model: LlamaForCausalLM, tensors: Iterable[tuple[str, Any]]) -> None:
    """Copy this shard's slices of every checkpoint tensor (`checkpoint_tensors`) into the model; raise ValueError on a
    tensor the model does not know, a shape that does not fit, or a parameter left unfilled. The layers
    already built from a quantized checkpoint's packed tensors (gpu_quant_loader.py) are passed over, with
    the tensors of them and the auxiliary scales weight-only serving does not use."""
    from ..cpu_kernels.quant import GgufBlockLinear
    from .gpu_quant_loader import AUX_TENSORS, QUANT_MODULES

    params = dict(model.named_parameters())
    # Layers built before loading: from a quantized checkpoint's packed tensors, or from a GGUF's blocks.
    quantized = {name for name, m in model.named_modules() if isinstance(m, (*QUANT_MODULES, GgufBlockLinear))}
    # parameter name -> the rows of it filled so far (fused projections fill in parts)
    filled: dict[str, int] = {}
    with torch.no_grad():
        for name, get in tensors:
            if _load_kv_scale(model, name, get):
                continue
            for param_name, rows, take in _targets(model, name):
                if quantized and (param_name.rsplit(".", 1)[0] in quantized
                                  or param_name.rsplit(".", 1)[-1] in AUX_TENSORS):
                    continue
                if param_name not in params:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                param = params[param_name]
                part = take(get)
                dst = param if rows is None else param[rows : rows + part.shape[0]]
                if dst.shape != part.shape:
                    raise ValueError(f"weight {name}: checkpoint slice {tuple(part.shape)} does not fit "
                                     f"{param_name} {tuple(dst.shape)}")
                dst.copy_(part)
                filled[param_name] = filled.get(param_name, 0) + part.shape[0]
    sh = model.shard
    missing = []
    for pname, p in params.items():
        if pname.rsplit(".", 1)[0] in quantized:
            continue
        want = p.shape[0]
        if pname in ("embed_tokens.weight", "lm_head.weight"):  # padding rows past the vocabulary stay zero
            want = max(0, min(sh.vocab_end, model.cfg.vocab_size) - sh.vocab_start)
        if filled.get(pname, 0) < want:
            missing.append(pname)
    if missing:
        raise ValueError(f"checkpoint lacks weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def _load_kv_scale(model: LlamaForCausalLM, name: str, get) -> bool:
    """Whether checkpoint tensor `name` is a layer's KV-cache scale (_KV_SCALES); if so it is set in that
    layer's attention (when this rank holds the layer). A scale must be one positive finite number."""
    m = _LAYER.match(name.removeprefix("model."))
    if m is None or not m.group(2).startswith("self_attn."):
        return False
    which = _KV_SCALES.get(m.group(2).removeprefix("self_attn."))
    if which is None:
        return False
    sh, layer = model.shard, int(m.group(1))
    if not sh.first_layer <= layer < sh.end_layer:
        return True
    value = get[:].to(torch.float32).reshape(-1)
    if value.numel() != 1 or not (torch.isfinite(value).all() and (value > 0).all()):
        raise ValueError(f"KV-cache scale {name}: want one positive finite number (a per-tensor scale), got "
                         f"{value.numel()} value(s): {value[:4].tolist()}")
    attn = model.layers[layer - sh.first_layer].self_attn
    for i in which:
        attn.kv_scale[i] = value[0]
    attn.kv_scale_source = "checkpoint"
    return True


def _checkpoint_tensors(files: list[Path]) -> Iterator[tuple[str, SafetensorsSlice]]:
    """(name, lazy slice) of every tensor, one file open at a time."""
    for f in files:
        with open(f, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(header_len))
            base = 8 + header_len
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in _ST_DTYPES:
                    raise ValueError(f"{f}: tensor {name} has dtype {info['dtype']}, which sluice cannot load")
                start, end = info["data_offsets"]
                yield name, SafetensorsSlice(fh, _ST_DTYPES[info["dtype"]], tuple(info["shape"]), base + start)


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}


class SafetensorsSlice:
    """One tensor of a safetensors file, read on indexing: `[:]` (all), `[a:b]` (rows a..b: only their
    bytes are read) or `[:, a:b]` (columns: the tensor is read, sliced and the rest dropped).

    NOTE: plain reads, not a memory map: a mapped file's pages count in the process's resident memory
    for as long as it is open, so a rank reading its column slices of every layer would show most of the
    checkpoint in its RSS. Read into private buffers, a rank's peak is its shard plus one tensor."""

    def __init__(self, fh, dtype: torch.dtype, shape: tuple[int, ...], offset: int):
        self.fh, self.dtype, self.shape, self.offset = fh, dtype, shape, offset

    def _read_rows(self, a: int, b: int) -> torch.Tensor:
        row = self.dtype.itemsize
        for d in self.shape[1:]:
            row *= d
        buf = bytearray((b - a) * row)
        self.fh.seek(self.offset + a * row)
        if self.fh.readinto(buf) != len(buf):
            raise ValueError(f"{self.fh.name}: truncated tensor data")
        return torch.frombuffer(buf, dtype=self.dtype).view(b - a, *self.shape[1:]) if buf else \
            torch.empty(0, *self.shape[1:], dtype=self.dtype)

    def __getitem__(self, key) -> torch.Tensor:
        rows = self.shape[0] if self.shape else 1
        if not self.shape:  # a scalar
            return self._read_rows(0, 1).reshape(())
        if isinstance(key, slice):
            a, b, step = key.indices(rows)
            assert step == 1
            return self._read_rows(a, b)
        cols = key[1]
        return self._read_rows(0, rows)[:, cols].clone()
def _targets(model: LlamaForCausalLM, name: str):
    """Where checkpoint tensor `name` goes on this rank: (parameter, first row or None for all,
    slice reader) for each destination; none when another rank or stage holds it."""
    sh, mc = model.shard, model.cfg
    d = mc.head_dim
    name = name.removeprefix("model.")
    if "rotary_emb" in name:
        return []
    vocab_rows = _rows(sh.vocab_start, min(sh.vocab_end, mc.vocab_size))
    if name == "embed_tokens.weight":
        out = []
        if model.embed_tokens is not None:
            out.append(("embed_tokens.weight", 0, vocab_rows))
        if mc.tie_word_embeddings and model.lm_head is not None:  # the last stage's copy of a tied table
            out.append(("lm_head.weight", 0, vocab_rows))
        return out
    if name == "lm_head.weight":
        return [("lm_head.weight", 0, vocab_rows)] if model.lm_head is not None and not mc.tie_word_embeddings else []
    if name == "norm.weight":
        return [("norm.weight", None, _all)] if model.norm is not None else []
    m = _LAYER.match(name)
    if m is None:
        return [(name, None, _all)]  # unknown: reported as unexpected
    layer = int(m.group(1))
    if not sh.first_layer <= layer < sh.end_layer:
        return []
    prefix, rest = f"layers.{layer - sh.first_layer}.", m.group(2)
    q_rows = sh.num_heads * d
    kv_rows = sh.num_kv_heads * d
    heads = _rows(sh.first_head * d, (sh.first_head + sh.num_heads) * d)
    kv_heads = _rows(sh.first_kv_head * d, (sh.first_kv_head + sh.num_kv_heads) * d)
    cols = _rows(sh.tp_rank * sh.intermediate, (sh.tp_rank + 1) * sh.intermediate)
    kind = rest.rsplit(".", 1)[-1]  # weight | bias
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, heads),
        "self_attn.k_proj": ("self_attn.qkv_proj", q_rows, kv_heads),
        "self_attn.v_proj": ("self_attn.qkv_proj", q_rows + kv_rows, kv_heads),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, cols),
        "mlp.up_proj": ("mlp.gate_up_proj", sh.intermediate, cols),
    }
    module = rest.rsplit(".", 1)[0]
    if module in fused:
        target, row, take = fused[module]
        return [(f"{prefix}{target}.{kind}", row, take)]
    if module == "self_attn.o_proj":  # row-parallel: this rank's input columns
        return [(f"{prefix}{rest}", None, _cols(sh.first_head * d, (sh.first_head + sh.num_heads) * d))]
    if module == "mlp.down_proj":
        return [(f"{prefix}{rest}", None, _cols(sh.tp_rank * sh.intermediate, (sh.tp_rank + 1) * sh.intermediate))]
    return [(f"{prefix}{rest}", None, _all)]  # norms: whole on every rank


def _all(get) -> torch.Tensor:
    return get[:]


def _rows(start: int, end: int):
    return lambda get: get[start:end]


def _cols(start: int, end: int):
    return lambda get: get[:, start:end]
