"""An HF-format Llama model directory with random weights, for benchmarks and checks on machines that
cannot download a real checkpoint (issue 15's GPU check runs with no network).

    python benchmarks/random_model.py /tmp/llama8b --preset llama-8b          # ~16 GB of bf16 weights
    python benchmarks/random_model.py /tmp/tiny --preset tiny --device cpu    # a few MB, for CPU runs

The directory holds what the engine reads (model_config.py, models/loader.py, tokenizer.py):
config.json, model.safetensors (bf16 by default, normal(0, 0.02) so activations stay finite; norms are 1),
tokenizer.json (a WordLevel vocabulary "t0", "t1", ... padded to the config's vocab, three special tokens
<unk> <s> </s> as ids 0-2, whitespace split; or with --tokenizer bytes a byte-level BPE without merges: the 256
bytes as ids 3-258, then "t259", ... to the vocab, so any text, JSON included, can be spelled and a grammar can
constrain the output), tokenizer_config.json (eos </s>, a plain chat template) and
generation_config.json. Weights are generated on the GPU when there is one (CPU generation of 8B normals
takes minutes) and written with a small safetensors writer of our own, tensor by tensor, so neither the
`safetensors` package nor a second copy of the model in host memory is needed. Only torch, and the
`tokenizers` package for tokenizer.json (without it the tokenizer is written as JSON by hand: the same file).
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

PRESETS: dict[str, dict] = {
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                     rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192}),
    # Small enough for the CPU (~1.3M params), wide enough that greedy decoding does not repeat one token.
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=256, vocab_size=512, max_position_embeddings=2048, rope_theta=10000.0,
                 rope_scaling=None),
}

SPECIALS = ["<unk>", "<s>", "</s>"]
EOS_ID = 2
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
_ST_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def model_config(preset: str) -> dict:
    shape = dict(PRESETS[preset])
    if shape["rope_scaling"] is None:
        del shape["rope_scaling"]
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS_ID, torch_dtype="bfloat16",
                hidden_act="silu", attention_bias=False, **shape)


def tensor_shapes(cfg: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every checkpoint tensor of a Llama with this config, HF names, in file order."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    yield "model.embed_tokens.weight", (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (inter, h)
        yield p + "mlp.up_proj.weight", (inter, h)
        yield p + "mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def weight_bytes(cfg: dict, itemsize: int = 2) -> tuple[int, int]:
    """(all checkpoint bytes, bytes a decode step reads: everything but the embedding table, of which a
    step reads only its tokens' rows)."""
    total = sum(math.prod(s) for _, s in tensor_shapes(cfg)) * itemsize
    embed = cfg["vocab_size"] * cfg["hidden_size"] * itemsize
    return total, total - embed


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                      make: Callable[[str, tuple[int, ...]], torch.Tensor]) -> None:
    """A safetensors file (8-byte header length, JSON header, raw little-endian data), each tensor made
    by `make` and written as soon as it exists."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        n = math.prod(shape) * itemsize
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in tensors:
            t = make(name, shape).to(dtype).contiguous()
            if t.numel():
                f.write(t.cpu().view(torch.uint8).numpy().data)  # the host copy's buffer, not a second copy


def byte_tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE with no merges: every text is its UTF-8 bytes, one token each (GPT-2's byte alphabet)."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab |= {ch: len(SPECIALS) + i for i, ch in enumerate(alphabet)}
    vocab |= {f"t{i}": i for i in range(len(vocab), vocab_size)}
    tok = Tokenizer(BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return tok.to_str()


def tokenizer_json(vocab_size: int) -> str:
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab |= {f"t{i}": i for i in range(len(SPECIALS), vocab_size)}
    try:
        from tokenizers import AddedToken, Tokenizer
        from tokenizers.models import WordLevel
        from tokenizers.pre_tokenizers import WhitespaceSplit

        tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = WhitespaceSplit()
        tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
        return tok.to_str()
    except ImportError:  # the same structure by hand (what tokenizers 0.2x writes)
        added = [dict(id=i, content=s, single_word=False, lstrip=False, rstrip=False, normalized=False,
                      special=True) for i, s in enumerate(SPECIALS)]
        return json.dumps(dict(version="1.0", truncation=None, padding=None, added_tokens=added, normalizer=None,
                               pre_tokenizer={"type": "WhitespaceSplit"}, post_processor=None, decoder=None,
                               model={"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}))


def create(out_dir: str | Path, preset: str = "tiny", device: str = "auto", dtype: torch.dtype = torch.bfloat16,
           seed: int = 0, std: float = 0.02, tokenizer: str = "words") -> Path:
    """Write the model directory and return it. Reuses one already complete for the same config. tokenizer: words
    (WordLevel "t<i>") or bytes (byte-level BPE)."""
    out = Path(out_dir)
    cfg = model_config(preset)
    marker = out / ".random-model-complete"
    done = {"config": cfg, "dtype": str(dtype), "seed": seed, "tokenizer": tokenizer}
    if marker.is_file() and json.loads(marker.read_text()) == done:
        return out
    out.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    gen = torch.Generator(device=dev).manual_seed(seed)

    def make(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype, device=dev)
        # normal(0, std), drawn in the target dtype where torch can (no fp32 temporary on the GPU)
        return torch.randn(shape, generator=gen, device=dev, dtype=dtype if dev.type == "cuda" else torch.float32) * std

    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    write_safetensors(out / "model.safetensors", list(tensor_shapes(cfg)), dtype, make)
    (out / "tokenizer.json").write_text((byte_tokenizer_json if tokenizer == "bytes" else tokenizer_json)(cfg["vocab_size"]))
    (out / "tokenizer_config.json").write_text(json.dumps(dict(
        bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=CHAT_TEMPLATE,
        add_bos_token=False, model_max_length=cfg["max_position_embeddings"], tokenizer_class="PreTrainedTokenizerFast")))
    (out / "generation_config.json").write_text(json.dumps(dict(bos_token_id=1, eos_token_id=EOS_ID)))
    marker.write_text(json.dumps(done))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--preset", choices=list(PRESETS), default="tiny")
    p.add_argument("--device", default="auto", help="where the weights are generated: auto (CUDA if any), cpu, cuda")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", choices=["words", "bytes"], default="words",
                   help="bytes: a byte-level BPE (spells any text: structured output)")
    args = p.parse_args()
    t0 = time.perf_counter()
    out = create(args.out_dir, args.preset, args.device, getattr(torch, args.dtype), args.seed, tokenizer=args.tokenizer)
    total, _ = weight_bytes(model_config(args.preset), torch.empty((), dtype=getattr(torch, args.dtype)).element_size())
    print(f"{out}: {args.preset}, {total / 1e9:.3f} GB of {args.dtype} weights, {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
