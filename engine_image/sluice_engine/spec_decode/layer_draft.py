"""Write a layer-truncated copy of a model for use as its own draft (`--draft-model`): the first N
decoder layers, the final norm and the head, with the same tokenizer (early-exit self-speculation).

A trained small sibling (Llama-3.2-1B for an 8B, Qwen2.5-0.5B for a 7B) drafts better; this is for
models that have none, and is how the tests and benchmarks get a draft on machines that hold only
one model.

    python -m sluice_engine.spec_decode.layer_draft SRC_DIR DST_DIR --layers 8
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import save_file

from ..models.gguf_checkpoint import GGUF_REFERENCE
from ..models.loader import checkpoint_tensors

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def write_layer_draft(src: Path, dst: Path, num_layers: int) -> Path:
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 1 <= num_layers <= total:
        raise ValueError(f"--layers must be between 1 and {total} (the model's layer count), got {num_layers}")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, get in checkpoint_tensors(src):  # safetensors, or the GGUF a converted directory reads
        m = _LAYER.search(name)
        if m is None or int(m.group(1)) < num_layers:
            tensors[name] = get[:].contiguous()
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():  # tokenizer, chat template, generation config
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", GGUF_REFERENCE):
            shutil.copy2(f, dst / f.name)
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path, help="an HF model directory")
    p.add_argument("dst", type=Path, help="where to write the draft")
    p.add_argument("--layers", type=int, required=True, help="decoder layers to keep (from the bottom)")
    args = p.parse_args(argv)
    print(write_layer_draft(args.src, args.dst, args.layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
