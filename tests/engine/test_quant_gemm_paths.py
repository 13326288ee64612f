"""quant/gemm_paths.py (issue 43): the FP8 x FP8 path through torch._scaled_mm (activations quantized per token), the
dequantize-then-GEMM path, and the per-shape table measured at start-up that picks among them and the Triton
kernels. torch._scaled_mm runs on CPU too, so the FP8 path's arithmetic is checked here; the timings are the GPU's
(benchmarks/gpu_check.sh), so the measurement is checked with a timer that reports made-up times."""

from __future__ import annotations

import pytest
import torch
from quant_checkpoints import awq_layer, fp8_layer

from sluice_engine.quant import gemm_paths
from sluice_engine.quant.awq import AwqWeights
from sluice_engine.quant.fp8 import Fp8Weights
from sluice_engine.quant.linear import QuantLinear


@pytest.fixture
def table(monkeypatch):
    """A fresh process table (nothing measured, nothing forced) for the weights classes to consult."""
    t = gemm_paths.GemmTable()
    t.forced = None
    monkeypatch.setattr(gemm_paths, "TABLE", t)
    return t


def fp8_weights(k: int, n: int, per_channel: bool, seed: int = 0) -> tuple[Fp8Weights, torch.Tensor]:
    tensors, w = fp8_layer(k, n, torch.Generator().manual_seed(seed), per_channel)
    return Fp8Weights(tensors["weight"], tensors["weight_scale"]), w


def test_rows_are_quantized_with_their_amax_at_448():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 1e-3, -448.0]])
    q, scale = gemm_paths.quantize_rows_e4m3(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 1)
    assert torch.equal(q.float().abs().amax(dim=1)[[0, 2]], torch.tensor([448.0, 448.0]))
    assert torch.equal(q[1].float(), torch.zeros(3))  # a zero row stays zero (its scale is tiny, not 0)
    assert torch.allclose(q.float() * scale, x, rtol=2**-3, atol=1e-2)


@pytest.mark.parametrize("per_channel", [True, False])
def test_scaled_mm_is_the_product_of_the_per_token_quantized_activations(per_channel):
    """The FP8 path computes exactly (x quantized per row) @ (e4m3 weights x their scales), rounded to bf16 once,
    and stays within activation-quantization error of the 16-bit activations' product (W8A16)."""
    weights, w = fp8_weights(64, 48, per_channel)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    bias = torch.randn(48).to(torch.bfloat16)
    got = gemm_paths.fp8_scaled_mm(x, weights.weight, weights.weight_scale, bias)
    xq, sa = gemm_paths.quantize_rows_e4m3(x)
    want = ((xq.float() * sa) @ w.T).to(torch.bfloat16) + bias
    assert got.dtype == torch.bfloat16 and got.shape == (5, 48)
    assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=2**-7 * want.float().abs().max().item())
    w8a16 = x.float() @ w.T + bias.float()
    assert (got.float() - w8a16).norm() / w8a16.norm() < 0.05


def test_the_table_picks_by_m_bucket_and_only_paths_that_apply(table):
    weights, _ = fp8_weights(64, 48, True)
    table.choice[("fp8", 16, 48, 64)] = "scaled_mm"
    table.choice[("fp8", 1024, 48, 64)] = "dequant"
    table.choice[("fp8", 256, 48, 64)] = "dequant"  # not offered below DEQUANT_MIN_M: ignored
    bf16 = lambda m: torch.zeros(m, 64, dtype=torch.bfloat16)  # noqa: E731
    assert [gemm_paths.m_bucket(m) for m in (1, 2, 16, 17, 64, 65, 5000)] == [1, 16, 16, 64, 64, 256, 4096]
    assert table.pick("fp8", bf16(1), 48, 64) == "triton"  # not measured
    assert table.pick("fp8", bf16(9), 48, 64) == "scaled_mm"
    assert table.pick("fp8", torch.zeros(9, 64), 48, 64) == "triton"  # fp32 activations: no FP8 GEMM writes them
    assert table.pick("fp8", bf16(300), 48, 64) == "dequant"
    assert table.pick("fp8", bf16(200), 48, 64) == "triton"
    assert table.pick("fp8", bf16(9), 40, 64) == "triton"  # another shape


@pytest.mark.parametrize("fmt", ["fp8", "awq"])
def test_the_dequantized_path_is_the_reference_product(table, fmt):
    gen = torch.Generator().manual_seed(2)
    if fmt == "fp8":
        weights, w = fp8_weights(64, 32, True)
    else:
        tensors, w = awq_layer(64, 32, 32, gen)
        weights = AwqWeights(tensors["qweight"], tensors["scales"], tensors["qzeros"])
    layer = QuantLinear(weights, bias=torch.randn(32, generator=gen))
    x = torch.randn(3, 64, generator=gen)
    table.forced = "dequant"
    torch.testing.assert_close(layer(x), x @ w.T + layer.bias, rtol=1e-5, atol=1e-5)


def test_measuring_fills_the_table_with_the_fastest_path_and_the_layers_take_it(table, monkeypatch, caplog):
    """A model of two FP8 layers of one shape and one of another: each distinct shape is timed once per M bucket
    and path (made-up times: Triton fastest at M <= 16, FP8 x FP8 above); a forward then runs what was chosen."""
    a, _ = fp8_weights(64, 48, True, seed=3)
    b, _ = fp8_weights(64, 48, False, seed=4)
    c, _ = fp8_weights(48, 32, True, seed=5)
    model = torch.nn.Sequential(QuantLinear(a), torch.nn.Identity(), QuantLinear(c))
    model.add_module("twin", QuantLinear(b))
    timed = []

    def timer(fn) -> float:
        path, m = table.forced, timer.m
        timed.append(path)
        return {"triton": 1.0 if m <= 16 else 5.0, "scaled_mm": 2.0 if m <= 16 else 1.0, "dequant": 3.0}[path]

    real_pick = gemm_paths.GemmTable.pick

    def spy_pick(self, fmt, x, n, k):  # which M the timer is being asked about
        timer.m = x.numel() // k
        return real_pick(self, fmt, x, n, k)

    monkeypatch.setattr(gemm_paths.GemmTable, "pick", spy_pick)
    with caplog.at_level("INFO", logger="sluice_engine.quant.gemm_paths"):
        rows = gemm_paths.measure_model(model, 64, torch.bfloat16, torch.device("cpu"), timer=timer, table=table)
    assert {(r["n"], r["k"]) for r in rows} == {(48, 64), (32, 48)}
    assert [r["m"] for r in rows if (r["n"], r["k"]) == (48, 64)] == [1, 16, 64]
    assert len(timed) == 2 * 3 * 2  # shapes x buckets x paths (each distinct shape once; dequant: prompts only)
    assert table.choice[("fp8", 16, 48, 64)] == "triton" and table.choice[("fp8", 64, 48, 64)] == "scaled_mm"
    assert table.forced is None
    assert "quantized GEMM paths by shape" in caplog.text and "scaled_mm" in caplog.text
    monkeypatch.setattr(gemm_paths.GemmTable, "pick", real_pick)
    calls = []
    monkeypatch.setattr(gemm_paths, "fp8_scaled_mm", lambda *args: calls.append(args[0].shape) or torch.zeros(40, 48))
    model[0](torch.zeros(40, 64, dtype=torch.bfloat16))
    assert calls == [(40, 64)]


def test_a_forced_path_is_not_measured(table):
    table.forced = "dequant"
    weights, _ = fp8_weights(64, 48, True)
    assert gemm_paths.measure_model(QuantLinear(weights), 64, torch.bfloat16, torch.device("cpu"),
                                    timer=lambda fn: pytest.fail("timed"), table=table) == []
    assert table.forced == "dequant"
