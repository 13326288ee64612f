"""The Triton weight-only GEMM kernels (sluice_engine.quant.triton_gemm) against dequantize-then-matmul, the
dequantize references against the formats' element formulas, and tiny AWQ / GPTQ / FP8 checkpoints written
here and loaded back.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is set before triton
is first imported, as in test_triton_attention.py). bf16 arithmetic is wrong there, so activations are fp32
and fp16; bf16 joins on CUDA. Tolerances, as a fraction of the largest |reference| output:
- fp32 activations: 1e-5 (the same fp32 products, summed in another order);
- fp16 activations: 2e-3 (the kernel rounds each dequantized weight to fp16 before the dot: 2^-11 relative,
  and writes fp16 output; the reference multiplies fp16-rounded x by the exact fp32 weight);
- bf16 (CUDA only): 2e-2 (an 8-bit mantissa).
"""

from __future__ import annotations

import importlib
import importlib.util
import json

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from quant_checkpoints import random_w4 as _random_w4  # noqa: E402
from quant_checkpoints import write_checkpoint  # noqa: E402
from triton_interpreter import import_kernels  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])

tg = import_kernels("sluice_engine.quant.triton_gemm")
from sluice_engine.quant import awq, fp8, gptq  # noqa: E402
from sluice_engine.quant.checkpoint import QuantCheckpoint, read_quant_config  # noqa: E402
from sluice_engine.quant.linear import QuantLinear  # noqa: E402
from sluice_engine.quant.registry import check_quant_config  # noqa: E402

# (M, K, N, group): decode, a small batch, a prefill tile plus one; K a multiple of group 128 or 32. Split-K
# (M <= 64; a fixed split of 3 in the interpreter): 5 K tiles in splits of 2, 2, 1 at M = 1; M = 16 with group
# 64 (64-row tiles) and N = 96 (a part-filled column tile); group 8 (below a tile: zeros and scales per input
# row) with K = 200, whose last 32-row tile is part-filled.
SHAPES = [(1, 256, 64, 128), (5, 128, 192, 32), (33, 384, 256, 128),
          (1, 640, 128, 128), (16, 320, 96, 64), (16, 200, 64, 8)]


pytestmark = pytest.mark.usefixtures("one_thread")


def _close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype and y.shape == ref.shape
    err = (y.float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= TOL[dtype] * scale, f"{dtype}: max error {err:.3g} vs {TOL[dtype]} x {scale:.3g}"


# -- the references against the formats' element formulas ---------------------------------------------------
def test_awq_nibble_order():
    """AWQ stores logical column j of each 8 at nibble [0, 4, 1, 5, 2, 6, 3, 7][j]."""
    for j, nibble in enumerate((0, 4, 1, 5, 2, 6, 3, 7)):
        row = torch.zeros(1, 8, dtype=torch.int32)
        row[0, j] = 0xA
        assert awq.pack_awq(row).item() & 0xFFFFFFFF == 0xA << (4 * nibble)
    packed = torch.tensor([[0x76543210]], dtype=torch.int32)  # nibble p holds p: column j reads its nibble
    assert awq.unpack_awq(packed).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]


def test_gptq_packing_order():
    packed = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert gptq.unpack_rows(packed)[:, 0].tolist() == list(range(8))  # along K: nibble i is row 8r + i
    assert gptq.unpack_cols(packed).tolist() == [list(range(8))]  # qzeros along N, in order
    high = torch.tensor([[-1]], dtype=torch.int32)  # every nibble 15: the sign bit must not leak
    assert gptq.unpack_rows(high)[:, 0].tolist() == [15] * 8


def test_dequantize_references_match_the_element_formulas():
    gen = torch.Generator().manual_seed(1)
    k, n, group = 64, 16, 32
    q, z, s = _random_w4(k, n, group, gen)
    w_awq = awq.dequantize_awq(awq.pack_awq(q), s, awq.pack_awq(z))
    g_idx = torch.randint(0, k // group, (k,), generator=gen)
    w_gptq = gptq.dequantize_gptq(gptq.pack_rows(q), s, gptq.pack_cols(z), g_idx.int())
    for kk in range(0, k, 7):
        for nn in range(0, n, 3):
            g = kk // group
            assert w_awq[kk, nn] == (q[kk, nn] - z[g, nn]) * s[g, nn].float()
            gi = g_idx[kk]
            assert w_gptq[kk, nn] == (q[kk, nn] - (z[gi, nn] + 1)) * s[gi, nn].float()
    w = torch.randn(8, 32, generator=gen)
    for per_channel in (False, True):
        wq, scale = fp8.quantize_fp8(w, per_channel)
        deq = fp8.dequantize_fp8(wq, scale)
        assert deq[3, 5] == wq[3, 5].float() * scale[3 if per_channel else 0]
        assert (deq - w).abs().max() <= 0.07 * w.abs().max()  # e4m3: a 3-bit mantissa


# -- kernels against dequantize-then-matmul ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_fp8_kernel(shape, dtype, per_channel):
    m, k, n, _ = shape
    gen = torch.Generator().manual_seed(m * 1000 + n)
    wq, scale = fp8.quantize_fp8(torch.randn(n, k, generator=gen), per_channel)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if m in (5, 16) else None
    ref = x.float() @ fp8.dequantize_fp8(wq, scale).T + (0 if bias is None else bias.float())
    y = tg.fp8_linear(x.to(DEVICE), wq.to(DEVICE), scale.to(DEVICE), None if bias is None else bias.to(DEVICE))
    _close(y.cpu(), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_awq_kernel(shape, dtype):
    m, k, n, group = shape
    gen = torch.Generator().manual_seed(m * 1000 + n + 1)
    q, z, s = _random_w4(k, n, group, gen)
    w = awq.AwqWeights(awq.pack_awq(q), s, awq.pack_awq(z))
    x = torch.randn(m, k, generator=gen).to(dtype)
    ref = x.float() @ w.dequantize()
    _close(w.to(DEVICE).apply(x.to(DEVICE)).cpu(), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("act_order", [False, True], ids=["g_idx_none", "g_idx_act_order"])
def test_gptq_kernel(shape, dtype, act_order):
    m, k, n, group = shape
    gen = torch.Generator().manual_seed(m * 1000 + n + 2)
    q, z, s = _random_w4(k, n, group, gen)
    # act-order: input rows are visited in a permuted order, so the groups of consecutive rows are scattered.
    g_idx = (torch.randperm(k, generator=gen) // group).int() if act_order else None
    w = gptq.GptqWeights(gptq.pack_rows(q), s, gptq.pack_cols(z), g_idx)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if m in (33, 16) else None
    ref = x.float() @ w.dequantize() + (0 if bias is None else bias.float())
    _close(w.to(DEVICE).apply(x.to(DEVICE), None if bias is None else bias.to(DEVICE)).cpu(), ref, dtype)


@pytest.mark.parametrize("m", [1, 16])
def test_split_k_outputs_are_the_same_every_run(m):
    """Decode-sized M splits K (fp32 partials summed in split order, no atomics): two calls agree bit for bit."""
    gen = torch.Generator().manual_seed(16)
    k, n, group = 640, 64, 128
    assert tg._plan(m, n, k, DEVICE, n * k, block_n=64, block_k=tg._block_k(k)).split_k > 1
    q, z, s = _random_w4(k, n, group, gen)
    g_idx = (torch.randperm(k, generator=gen) // group).int()
    x = torch.randn(m, k, generator=gen).half().to(DEVICE)
    wq, scale = fp8.quantize_fp8(torch.randn(n, k, generator=gen), per_channel=True)
    weights = [awq.AwqWeights(awq.pack_awq(q), s, awq.pack_awq(z)),
               gptq.GptqWeights(gptq.pack_rows(q), s, gptq.pack_cols(z), g_idx), fp8.Fp8Weights(wq, scale)]
    for w in weights:
        w = w.to(DEVICE)
        assert torch.equal(w.apply(x), w.apply(x)), type(w).__name__


def test_leading_dims_and_shape_checks():
    gen = torch.Generator().manual_seed(3)
    q, z, s = _random_w4(128, 64, 32, gen)
    w = awq.AwqWeights(awq.pack_awq(q), s, awq.pack_awq(z))
    x = torch.randn(2, 3, 128, generator=gen)
    y = QuantLinear(w).to(DEVICE).forward(x.to(DEVICE)).cpu()
    assert y.shape == (2, 3, 64)
    _close(y.reshape(6, 64), x.reshape(6, 128) @ w.dequantize(), torch.float32)
    with pytest.raises(AssertionError, match="features"):
        w.apply(torch.randn(1, 64))
    with pytest.raises(AssertionError, match="different devices"):  # weights left behind when x moved
        w.apply(torch.randn(1, 128, device="meta"))


def test_fp8_bit_decoding_matches_the_e4m3_type():
    """GPUs without Triton's e4m3 type (compute capability < 8.9) read the bytes and decode them: every e4m3
    value (all 256 bytes but the two NaNs) comes out exactly, with either sign, subnormals included."""
    b = torch.arange(256, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0
    w = b.view(torch.float8_e4m3fn).reshape(16, 16)
    eye = torch.eye(16)
    for decode_bits in (False, True):
        y = tg.fp8_linear(eye.to(DEVICE), w.to(DEVICE), torch.ones(1, device=DEVICE), decode_bits=decode_bits)
        assert torch.equal(y.cpu(), w.float().T), decode_bits
    gen = torch.Generator().manual_seed(11)
    wq, scale = fp8.quantize_fp8(torch.randn(64, 128, generator=gen), per_channel=True)
    x = torch.randn(5, 128, generator=gen).half()
    y = tg.fp8_linear(x.to(DEVICE), wq.to(DEVICE), scale.to(DEVICE), decode_bits=True)
    _close(y.cpu(), x.float() @ fp8.dequantize_fp8(wq, scale).T, torch.float16)


# -- fused projections and tensor-parallel slices -----------------------------------------------------------
def _w4_parts(cls, k: int, ns: list[int], group: int, gen, g_idx=None):
    out = []
    for n in ns:
        q, z, s = _random_w4(k, n, group, gen)
        if cls is awq.AwqWeights:
            out.append(cls(awq.pack_awq(q), s, awq.pack_awq(z)))
        else:
            out.append(cls(gptq.pack_rows(q), s, gptq.pack_cols(z), g_idx))
    return out


@pytest.mark.parametrize("cls", [awq.AwqWeights, gptq.GptqWeights], ids=["awq", "gptq"])
def test_w4_concatenation_and_slices_are_the_dequantized_ones(cls):
    gen = torch.Generator().manual_seed(12)
    k, group = 128, 32
    parts = _w4_parts(cls, k, [64, 16, 16], group, gen)  # q, k, v
    fused = cls.cat_out(parts)
    assert fused.shape == (96, k)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts], dim=1))
    w = fused.dequantize()
    assert torch.equal(fused.narrow_out(64, 80).dequantize(), w[:, 64:80])
    assert torch.equal(fused.narrow_in(32, 96).dequantize(), w[32:96])
    with pytest.raises(ValueError, match="8-column"):
        fused.narrow_out(4, 20)
    if cls is awq.AwqWeights:
        with pytest.raises(ValueError, match="group boundaries"):
            fused.narrow_in(16, 48)
    else:  # off the group boundaries: every group's scales kept, an explicit g_idx picks them
        part = fused.narrow_in(16, 48)
        assert part.g_idx is not None and part.scales.shape[0] == k // group
        assert torch.equal(part.dequantize(), w[16:48])
        x = torch.randn(3, 32, generator=gen)
        _close(part.to(DEVICE).apply(x.to(DEVICE)).cpu(), x @ w[16:48], torch.float32)


def test_gptq_act_order_parts_concatenate_only_with_one_g_idx():
    gen = torch.Generator().manual_seed(13)
    k, group = 64, 32
    g_idx = (torch.randperm(k, generator=gen) // group).int()
    same = _w4_parts(gptq.GptqWeights, k, [32, 16], group, gen, g_idx)
    fused = gptq.GptqWeights.cat_out(same)
    assert torch.equal(fused.g_idx, g_idx)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in same], dim=1))
    other = _w4_parts(gptq.GptqWeights, k, [16], group, gen, (torch.randperm(k, generator=gen) // group).int())
    assert gptq.GptqWeights.cat_out(same + other) is None
    assert gptq.GptqWeights.cat_out(_w4_parts(gptq.GptqWeights, k, [8, 8], group, gen)).g_idx is None
    # A row-parallel slice of an act-order layer: g_idx sliced, every group kept.
    part = fused.narrow_in(8, 40)
    assert torch.equal(part.g_idx, g_idx[8:40]) and torch.equal(part.dequantize(), fused.dequantize()[8:40])


def test_fp8_concatenation_keeps_values_and_makes_differing_scales_per_channel():
    gen = torch.Generator().manual_seed(14)
    tensor_parts = [fp8.Fp8Weights(*fp8.quantize_fp8(torch.randn(n, 32, generator=gen) * (i + 1), False))
                    for i, n in enumerate([16, 8, 8])]
    fused = fp8.Fp8Weights.cat_out(tensor_parts)
    assert fused.per_channel and fused.weight_scale.shape == (32,)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in tensor_parts]))
    one_scale = [fp8.Fp8Weights(p.weight, tensor_parts[0].weight_scale) for p in tensor_parts]
    assert not fp8.Fp8Weights.cat_out(one_scale).per_channel
    channel_parts = [fp8.Fp8Weights(*fp8.quantize_fp8(torch.randn(n, 32, generator=gen), True)) for n in (16, 8)]
    fused = fp8.Fp8Weights.cat_out(channel_parts + tensor_parts[1:2])
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in channel_parts + tensor_parts[1:2]]))
    w = fused.dequantize()
    assert torch.equal(fused.narrow_out(8, 24).dequantize(), w[8:24])
    assert torch.equal(fused.narrow_in(8, 24).dequantize(), w[:, 8:24])


def test_quant_linear_registers_its_tensors():
    """The packed tensors are the module's buffers (the memory profile counts the model's bytes from
    them), and a device move hands the moved tensors back to the weights."""
    gen = torch.Generator().manual_seed(15)
    w = _w4_parts(gptq.GptqWeights, 64, [16], 32, gen, (torch.randperm(64, generator=gen) // 32).int())[0]
    layer = QuantLinear(w)
    assert {n for n, _ in layer.named_buffers()} == {"qweight", "scales", "qzeros", "g_idx"}
    moved = layer.to("meta")
    assert moved.weights.qweight.device.type == "meta" and moved.qweight is moved.weights.qweight


# -- checkpoints --------------------------------------------------------------------------------------------
LAYERS = {"model.layers.0.self_attn.o_proj.": (128, 64), "model.layers.0.mlp.down_proj.": (256, 128)}  # K, N


def _write(tmp_path, qcfg: dict, tensors: dict[str, torch.Tensor]) -> None:
    write_checkpoint(tmp_path, {"architectures": ["LlamaForCausalLM"], "quantization_config": qcfg}, tensors)


def _check_loaded(tmp_path, twins: dict[str, torch.Tensor], transpose: bool) -> None:
    ckpt = QuantCheckpoint(tmp_path)
    gen = torch.Generator().manual_seed(7)
    for prefix, twin in twins.items():
        weights = ckpt.linear(prefix)
        dense = weights.dequantize()
        assert torch.equal(dense.T if transpose else dense, twin), prefix
        x = torch.randn(5, twin.shape[0], generator=gen)
        layer = QuantLinear(weights, ckpt.bias(prefix)).to(DEVICE)  # the checkpoint's tensors load on CPU
        _close(layer(x.to(DEVICE)).cpu(), x @ twin + ckpt.bias(prefix), torch.float32)


def test_awq_checkpoint_loads_as_its_dequantized_twin(tmp_path):
    gen = torch.Generator().manual_seed(4)
    tensors, twins = {}, {}
    for prefix, (k, n) in LAYERS.items():
        q, z, s = _random_w4(k, n, 128, gen)
        tensors |= {prefix + "qweight": awq.pack_awq(q), prefix + "qzeros": awq.pack_awq(z), prefix + "scales": s,
                    prefix + "bias": torch.randn(n, generator=gen)}
        twins[prefix] = (q - z.repeat_interleave(128, 0)).float() * s.float().repeat_interleave(128, 0)
    _write(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                      "version": "gemm"}, tensors)
    _check_loaded(tmp_path, twins, transpose=False)


def test_gptq_checkpoint_loads_as_its_dequantized_twin(tmp_path):
    gen = torch.Generator().manual_seed(5)
    tensors, twins = {}, {}
    for i, (prefix, (k, n)) in enumerate(LAYERS.items()):
        q, z, s = _random_w4(k, n, 32, gen)
        # Layer 0 act-order; layer 1 stores the trivial g_idx = k // G (which the loader drops).
        g_idx = (torch.randperm(k, generator=gen) // 32) if i == 0 else torch.arange(k) // 32
        tensors |= {prefix + "qweight": gptq.pack_rows(q), prefix + "qzeros": gptq.pack_cols(z),
                    prefix + "scales": s, prefix + "g_idx": g_idx.int(), prefix + "bias": torch.randn(n, generator=gen)}
        twins[prefix] = (q - (z + 1)[g_idx]).float() * s.float()[g_idx]
    _write(tmp_path, {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
                      "checkpoint_format": "gptq"}, tensors)
    ckpt = QuantCheckpoint(tmp_path)
    assert ckpt.linear("model.layers.0.self_attn.o_proj.").g_idx is not None
    assert ckpt.linear("model.layers.0.mlp.down_proj.").g_idx is None
    _check_loaded(tmp_path, twins, transpose=False)


def test_fp8_checkpoint_loads_as_its_dequantized_twin(tmp_path):
    gen = torch.Generator().manual_seed(6)
    tensors, twins = {}, {}
    for i, (prefix, (k, n)) in enumerate(LAYERS.items()):
        wq, scale = fp8.quantize_fp8(torch.randn(n, k, generator=gen), per_channel=i == 1)
        # Per-tensor: a 0-d scale; per-channel: [N, 1], as checkpoints store them.
        tensors |= {prefix + "weight": wq, prefix + "weight_scale": scale.reshape(()) if i == 0 else scale[:, None],
                    prefix + "input_scale": torch.tensor(1.0), prefix + "bias": torch.randn(n, generator=gen)}
        twins[prefix] = wq.float() * (scale if i == 0 else scale[:, None])
    _write(tmp_path, {"quant_method": "fp8", "activation_scheme": "static"}, tensors)
    _check_loaded(tmp_path, {p: t.T for p, t in twins.items()}, transpose=True)


@pytest.mark.parametrize("qcfg, match", [
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"}, "v1"),
    ({"quant_method": "gptq", "bits": 8}, "4-bit"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "GEMM"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
    ({"quant_method": "bitsandbytes"}, "not supported"),
])
def test_unsupported_variants_are_refused(tmp_path, qcfg, match):
    with pytest.raises(ValueError, match=match):
        check_quant_config(qcfg)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qcfg}))
    with pytest.raises(ValueError, match=match):
        read_quant_config(tmp_path)


def test_missing_tensors_name_the_layer(tmp_path):
    gen = torch.Generator().manual_seed(8)
    q, z, s = _random_w4(128, 64, 128, gen)
    _write(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"},
           {"a.qweight": awq.pack_awq(q), "a.scales": s})
    with pytest.raises(ValueError, match="a.qzeros"):
        QuantCheckpoint(tmp_path).linear("a.")
