"""The llama.cpp-arithmetic attention (attention/ggml_cpu.py, cpu_kernels/ggml_attention.cpp): against dense
causal attention within fp16 rounding, and its results' independence of the cache's block layout and of the
batch, on each kernel level this CPU runs. Bit-exactness against llama.cpp itself (this op, the layer ops and
the quantized GEMM) is checked by benchmarks/ggml_check/ (run_checks.py), run here for each level whose
llama.cpp build is at hand (scripts/get-llama-server.sh), skipped elsewhere."""

import importlib.util
from pathlib import Path

import pytest
import torch
from cpu_isas import CPU_ISAS, isa_lib
from test_torch_attention import _case, _dense

from sluice_engine.attention.ggml_cpu import KV_DTYPE, GgmlCpuAttention
from sluice_engine.forward_context import AttentionMetadata

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("run_checks", ROOT / "benchmarks/ggml_check/run_checks.py")
run_checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_checks)


@pytest.fixture(scope="module", params=CPU_ISAS)
def backend(request):
    return GgmlCpuAttention(isa_lib(request.param))


def _ggml_cache(backend, fp32_cache, meta):
    """The fp32 test cache rewritten through the backend's own write (fp16, K in rotary-pair order)."""
    _, nb, bs, hkv, d = fp32_cache.shape
    cache = torch.zeros(2, nb, bs, hkv, d, dtype=KV_DTYPE)
    for i, s in enumerate(meta.seq_lens_cpu):
        table = meta.block_tables[i].tolist()
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(s)], dtype=torch.int64)
        k = fp32_cache[0].view(-1, hkv, d)[slots]
        v = fp32_cache[1].view(-1, hkv, d)[slots]
        write = AttentionMetadata(query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                                  block_tables=meta.block_tables, slot_mapping=slots, max_query_len=s, max_seq_len=s,
                                  query_lens_cpu=[s], seq_lens_cpu=[s], block_size=bs)
        backend.write_kv(cache, k, v, write)
    return cache


@pytest.mark.parametrize("q_lens,seq_lens,hq,hkv,d", [
    ([1, 1, 1], [1, 17, 40], 6, 2, 64),  # decode (the vec path), GQA
    ([5, 1, 3], [9, 33, 5], 6, 2, 64),  # short prompts beside decodes (vec)
    ([70, 1], [70, 300], 9, 3, 64),  # a prompt of 64+ rows (the tiled path) beside a long decode
    ([80], [200], 4, 1, 128),  # tiled after a cached prefix, MQA, head dim 128
    ([3, 65], [50, 65], 4, 2, 128),  # vec, 128-dim heads (the portable loops)
])
def test_matches_dense_attention(backend, q_lens, seq_lens, hq, hkv, d):
    q, fp32_cache, meta, k_full, v_full = _case(q_lens, seq_lens, hq=hq, hkv=hkv, d=d, bs=16)
    cache = _ggml_cache(backend, fp32_cache, meta)
    got = backend.attend(q, None, None, cache, meta, d**-0.5)
    half = [x.half().float() for x in k_full], [x.half().float() for x in v_full]
    want = _dense(q, meta, *half, d**-0.5)
    # the vec path rounds its accumulator to fp16 at every key (as llama.cpp): errors of fp16's order
    torch.testing.assert_close(got, want, atol=4e-3, rtol=4e-3)


def test_results_do_not_depend_on_block_layout_or_batch(backend):
    """The same sequences in other physical blocks, and one sequence alone instead of beside others:
    identical bits (each sequence's path is chosen by its own query length)."""
    q, fp32_cache, meta, _, _ = _case([70, 1, 4], [70, 90, 30], hq=9, hkv=3, d=64, bs=16, seed=1)
    base = backend.attend(q, None, None, _ggml_cache(backend, fp32_cache, meta), meta, 0.125)
    q2, fp32_cache2, meta2, _, _ = _case([70, 1, 4], [70, 90, 30], hq=9, hkv=3, d=64, bs=16, seed=1)
    perm = torch.randperm(fp32_cache2.shape[1], generator=torch.Generator().manual_seed(7))
    moved = torch.empty_like(fp32_cache2)
    moved[:, perm] = fp32_cache2
    meta2.block_tables = perm[meta2.block_tables.long()].to(torch.int32)
    assert torch.equal(backend.attend(q2, None, None, _ggml_cache(backend, moved, meta2), meta2, 0.125), base)
    # the decode row alone
    alone = AttentionMetadata(query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                              seq_lens=meta.seq_lens[1:2].clone(), block_tables=meta.block_tables[1:2].clone(),
                              slot_mapping=torch.zeros(1, dtype=torch.int64), max_query_len=1, max_seq_len=90,
                              query_lens_cpu=[1], seq_lens_cpu=[90], block_size=16)
    cache = _ggml_cache(backend, fp32_cache, meta)
    assert torch.equal(backend.attend(q[70:71], None, None, cache, alone, 0.125), base[70:71])


def test_levels_agree():
    """Each level this CPU runs against the others on the vec and tiled paths: the AVX-512 levels and the portable
    loops (which follow AVX-512's sums) bit for bit, avx2 (llama.cpp's AVX2 sums and expf) within fp16 rounding."""
    q, fp32_cache, meta, _, _ = _case([70, 1, 4], [70, 90, 30], hq=9, hkv=3, d=64, bs=16, seed=2)
    outs = {}
    for isa in CPU_ISAS:
        backend = GgmlCpuAttention(isa_lib(isa))
        outs[isa] = backend.attend(q, None, None, _ggml_cache(backend, fp32_cache, meta), meta, 0.125)
    for isa, got in outs.items():
        if isa == "avx2":
            torch.testing.assert_close(got, outs["portable"], atol=4e-3, rtol=4e-3)
        else:
            assert torch.equal(got, outs["portable"]), isa


# Each level that has a llama.cpp build of its own instruction set to be exact against, and the checks run on it.
# Not (avx512-vnni, layer_ops): ggml's rope loop is vectorized by GCC, and how its last pairs are rounded (fused or
# not) at head dims with an odd pair count follows the -mtune of llama.cpp's native build (a Xeon's tuning takes
# 256-bit vectors and matches ours; a Zen 4's or a generic AVX-512 one differs at dims 4, 6, 68, 70, never 64).
EXACT = [(isa, check) for isa in ("avx512-vnni", "avx2") if isa in CPU_ISAS for check in sorted(run_checks.CHECKS)
         if (isa, check) != ("avx512-vnni", "layer_ops")]


@pytest.mark.parametrize("isa,check", EXACT)
def test_bit_identical_to_llama_cpp(tmp_path, isa, check):
    if run_checks.llama_libs(isa) is None:
        pytest.skip(f"llama.cpp's {run_checks.BUILD_DIR[isa]} is not here (scripts/get-llama-server.sh)")
    ok, out = run_checks.run_check(check, isa, tmp_path)
    assert ok, out
