"""A GGUF file as a checkpoint (models/gguf_file.py, models/gguf_checkpoint.py): the hand-written header reader
against gguf-py's, the dequantizers against gguf-py's float for float, the bundled model's tensors under their HF
names against transformers' own GGUF loading (the former full conversion), and a converted directory that holds
no weights of its own loading, moved or not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from sluice_engine.models.gguf_checkpoint import (  # noqa: E402
    GGUF_REFERENCE,
    dequantize,
    gguf_checkpoint,
    gguf_tensors,
    hf_dense_dir,
    hf_name,
)
from sluice_engine.models.gguf_file import GgufFile  # noqa: E402

T = gguf.GGMLQuantizationType


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    """A GGUF with a tensor of each type the engine dequantizes itself (and Q5_1, which gguf-py dequantizes for it), written
    by gguf-py's writer, with metadata of every value kind."""
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_uint32("test.u32", 7)
    w.add_int64("test.i64", -5)
    w.add_float32("test.f32", 0.25)
    w.add_bool("test.flag", True)
    w.add_string("test.name", "héllo")
    w.add_array("test.ints", [1, 2, 3])
    w.add_array("test.words", ["a", "bc", ""])
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((8, 256)) * 3).astype(np.float32)
    values[1, :32] = 0.0  # an all-zero block
    # (llama.cpp names, so they map to HF ones; no head counts in the metadata, so nothing is permuted)
    for name, kind in (("blk.0.attn_v", T.Q4_0), ("blk.0.ffn_up", T.Q4_1), ("token_embd", T.Q8_0),
                       ("blk.0.ffn_down", T.Q5_1), ("blk.0.attn_output", T.BF16)):
        w.add_tensor(f"{name}.weight", gguf.quants.quantize(values, kind), raw_dtype=kind)
    w.add_tensor("output_norm.weight", values)
    w.add_tensor("blk.0.ffn_gate.weight", values.astype(np.float16))
    w.add_tensor("rope_freqs.weight", values[0])  # no HF counterpart: left out
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reader_matches_gguf_py(small_gguf):
    ours, ref = GgufFile(small_gguf), gguf.GGUFReader(small_gguf)
    assert ours.field("test.u32") == 7 and ours.field("test.i64") == -5 and ours.field("test.f32") == 0.25
    assert ours.field("test.flag") is True and ours.field("test.name") == "héllo"
    assert ours.field("test.ints").tolist() == [1, 2, 3]
    assert ours.field("test.words") is None  # string arrays are stepped over, not decoded
    assert ours.field("general.architecture") == "llama"
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.type_name == t.tensor_type.name and mine.shape == tuple(int(n) for n in t.shape)
        assert np.array_equal(np.asarray(mine.data).view(np.uint8).ravel(), np.asarray(t.data).view(np.uint8).ravel()), t.name


def test_dequantize_is_gguf_py_float_for_float(small_gguf):
    ours = GgufFile(small_gguf)
    for t in gguf.GGUFReader(small_gguf).tensors:
        expected = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        got = dequantize(ours.tensors[t.name])
        assert got.dtype == torch.float32 and got.shape == tuple(reversed([int(n) for n in t.shape]))
        assert torch.equal(_bits(got), _bits(torch.from_numpy(np.ascontiguousarray(expected)))), t.name


def test_reader_rejects_what_is_not_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GgufFile(bad)


def test_hf_names():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_name("blk.11.ffn_down.weight") == "model.layers.11.mlp.down_proj.weight"
    assert hf_name("blk.2.attn_k_norm.weight") == "model.layers.2.self_attn.k_norm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None


@pytest.fixture(scope="module")
def bundled_gguf(model_dir):
    from sluice_engine.model_fetch import gguf_source

    return gguf_source(None)


@pytest.mark.slow
def test_bundled_model_tensors_are_transformers_gguf_loading(bundled_gguf):
    """Every tensor of the bundled Q4_1 file, named, un-permuted and dequantized here, is bit for bit the one
    transformers' own GGUF loading gives (what the former full conversion wrote to safetensors)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(bundled_gguf.parent), gguf_file=bundled_gguf.name,
                                               dtype=torch.float32).state_dict()
    ours = {name: get[:] for name, get in gguf_tensors(bundled_gguf)}
    ref.pop("lm_head.weight")  # tied: the embedding's table
    assert sorted(ours) == sorted(ref)
    differ = [n for n in ref if not torch.equal(_bits(ours[n]), _bits(ref[n]))]
    assert differ == []


def test_converted_directory_holds_no_weights(model_dir):
    """The bundled model's directory (converted on this machine's first use) reads its weights from the GGUF:
    no dense copy beside config and tokenizer. A cache converted by an older sluice has safetensors instead."""
    if (model_dir / "model.safetensors").is_file():
        pytest.skip(f"{model_dir} is an older full conversion (model.safetensors); a fresh cache has none")
    gguf_path = gguf_checkpoint(model_dir)
    assert gguf_path is not None and gguf_path.is_file()
    assert not list(model_dir.glob("*.safetensors"))
    assert json.loads((model_dir / GGUF_REFERENCE).read_text())["gguf"].startswith("..")  # relative in the cache


def _small_model_dir(tmp_path: Path, small_gguf: Path, reference: str) -> Path:
    d = tmp_path / "models" / "m"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    (d / GGUF_REFERENCE).write_text(json.dumps({"gguf": reference}))
    shutil.copy(small_gguf, tmp_path / "models" / "small.gguf")
    return d


def test_reference_relative_to_the_directory_survives_a_move(tmp_path, small_gguf):
    d = _small_model_dir(tmp_path / "a", small_gguf, "../small.gguf")
    assert gguf_checkpoint(d) == (tmp_path / "a" / "models" / "small.gguf").resolve()
    moved = tmp_path / "b"
    shutil.move(tmp_path / "a", moved)
    assert gguf_checkpoint(moved / "models" / "m") == (moved / "models" / "small.gguf").resolve()


def test_missing_gguf_is_a_clear_error(tmp_path, small_gguf):
    from sluice_engine.models.loader import checkpoint_tensors

    d = _small_model_dir(tmp_path, small_gguf, "../gone.gguf")
    with pytest.raises(ValueError, match="gone.gguf.*not there"):
        checkpoint_tensors(d)


def test_hf_dense_dir_writes_a_loadable_copy_once(tmp_path, small_gguf):
    from safetensors.torch import load_file

    d = _small_model_dir(tmp_path, small_gguf, "../small.gguf")
    (d / "tokenizer.json").write_text("{}")
    out = hf_dense_dir(d)
    assert out == d.with_name("m-hf-fp32") and not (out / GGUF_REFERENCE).exists()
    assert (out / "tokenizer.json").read_text() == "{}" and (out / "config.json").is_file()
    weights = load_file(str(out / "model.safetensors"))
    streamed = {name: get[:] for name, get in gguf_tensors(tmp_path / "models" / "small.gguf")}
    assert sorted(weights) == sorted(streamed) and len(weights) == 7  # rope_freqs has no HF name
    assert all(torch.equal(_bits(weights[n]), _bits(streamed[n])) for n in weights)
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert hf_dense_dir(d) == out and (out / "model.safetensors").stat().st_mtime_ns == mtime
    assert hf_dense_dir(out) == out  # a directory with safetensors is its own
