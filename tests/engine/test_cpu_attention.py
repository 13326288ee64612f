"""The C++ CPU attention kernel (attention/cpu_paged.py) against dense causal attention, the torch
reference path, and an engine run, on each kernel level this CPU runs; plus its build cache, the fallback without
a compiler, and the choice of level (SLUICE_CPU_ISA, and a library never loaded on a CPU that lacks its level)."""

import ctypes
import logging
import os
import platform
import shutil

import pytest
import torch
from cpu_isas import CPU_ISAS, isa_lib
from test_torch_attention import _case, _dense

from sluice_engine import cpu_kernels
from sluice_engine.attention.backend import select_backend
from sluice_engine.attention.cpu_paged import CpuPagedAttention
from sluice_engine.attention.torch_paged import TorchPagedAttention

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=CPU_ISAS)
def kernel(request):
    return CpuPagedAttention(isa_lib(request.param))


@pytest.mark.parametrize("q_lens,seq_lens,hq,hkv,d,bs", [
    ([1, 1, 1], [1, 17, 40], 6, 2, 64, 4),  # decode, GQA
    ([5, 1, 3], [9, 33, 5], 6, 2, 64, 4),  # verification rows beside a decode (causal within a sequence)
    ([8, 2], [8, 64], 4, 4, 32, 16),  # MHA; a whole short prompt
    ([1, 2], [300, 70], 8, 1, 128, 16),  # MQA, head dim 128, a long context
    ([1, 20, 1, 3], [30, 20, 7, 12], 6, 2, 64, 4),  # a prompt (the torch loop) beside short queries
    ([1, 16, 1], [5, 40, 64], 6, 2, 96, 8),  # a prompt chunk after a cached prefix
])
def test_kernel_matches_dense_attention(kernel, q_lens, seq_lens, hq, hkv, d, bs):
    q, cache, meta, k_full, v_full = _case(q_lens, seq_lens, hq=hq, hkv=hkv, d=d, bs=bs)
    k_new = torch.cat([k[-n:] for k, n in zip(k_full, q_lens, strict=True)])
    v_new = torch.cat([v[-n:] for v, n in zip(v_full, q_lens, strict=True)])
    got = kernel.attend(q, k_new, v_new, cache, meta, d**-0.5)
    torch.testing.assert_close(got, _dense(q, meta, k_full, v_full, d**-0.5), atol=1e-5, rtol=1e-5)


def test_kernel_reads_strided_queries_and_bf16(kernel):
    """Queries as the model makes them (a view into the fused QKV output, rows strided), and a bf16
    cache: the kernel computes in fp32 and rounds once, so it stays within bf16 rounding of the
    reference."""
    q, cache, meta, _, _ = _case([1, 1, 4], [50, 9, 31], hq=6, hkv=2, d=64, bs=4, seed=3)
    qkv = torch.randn(q.shape[0], 6 * 64 + 2 * 2 * 64)
    qkv[:, : 6 * 64] = q.flatten(1)
    strided = qkv[:, : 6 * 64].view(-1, 6, 64)
    assert not strided.is_contiguous()
    want = TorchPagedAttention().attend(q, None, None, cache, meta, 0.125)
    meta.per_step.clear()
    torch.testing.assert_close(kernel.attend(strided, None, None, cache, meta, 0.125), want, atol=1e-5, rtol=1e-5)
    meta.per_step.clear()
    got = kernel.attend(q.bfloat16(), None, None, cache.bfloat16(), meta, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_unsupported_head_dim_falls_back_to_torch(kernel):
    q, cache, meta, k_full, v_full = _case([1, 1], [10, 20], hq=2, hkv=1, d=24, bs=4)
    got = kernel.attend(q, None, None, cache, meta, 0.2)
    torch.testing.assert_close(got, _dense(q, meta, k_full, v_full, 0.2), atol=1e-5, rtol=1e-5)
    assert "torch_paged" in meta.per_step  # the reference path made this step's plan


def test_auto_picks_the_kernel_on_cpu(kernel):
    assert select_backend("auto", CPU).name == "cpu"
    assert select_backend("torch", CPU).name == "torch"


def test_kernel_builds_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    lib = cpu_kernels.load()
    assert lib is not None
    built = list((tmp_path / "kernels").glob("sluice_cpu_kernels-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    assert cpu_kernels.load() is not None
    assert built[0].stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_no_compiler_means_the_torch_path(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    assert cpu_kernels.load() is None
    assert "no C++ compiler" in caplog.text
    assert select_backend("auto", CPU).name == "torch"
    with pytest.raises(ValueError, match="could not be built"):
        select_backend("cpu", CPU)


def test_cpu_kernels_off_builds_nothing(tmp_path, monkeypatch, caplog):
    """SLUICE_CPU_KERNELS=off (the GPU check sets it): no build at all, auto takes torch."""
    import logging

    caplog.set_level(logging.INFO, logger="sluice.engine")
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SLUICE_CPU_KERNELS", "off")
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setattr(cpu_kernels, "build", lambda *a: pytest.fail("built with SLUICE_CPU_KERNELS=off"))
    assert cpu_kernels.load() is None
    assert "SLUICE_CPU_KERNELS=off" in caplog.text
    assert select_backend("auto", CPU).name == "torch"
    assert not (tmp_path / "kernels").exists()


def test_broken_build_is_reported_not_raised(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    broken = ["-include", "/nonexistent.h"]
    monkeypatch.setattr(cpu_kernels, "BASE_FLAGS", [*cpu_kernels.BASE_FLAGS, *broken])
    assert cpu_kernels.load() is None
    assert "unavailable, using the torch paths" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))


AVX2_CPU = frozenset(cpu_kernels.ISAS["avx2"].cpu_flags)  # an AVX2-only CPU (an AMD EPYC of the Zen 2/3 kind)


def test_levels_are_explicit_flags_never_march_native():
    assert list(cpu_kernels.ISAS) == ["avx512-vnni", "avx512", "avx2", "portable"]
    for isa in cpu_kernels.ISAS:
        flags = cpu_kernels.isa_flags(isa)
        assert not any(f.startswith(("-march", "-mtune", "-mcpu")) for f in flags), flags
    assert "-mavx512f" not in cpu_kernels.isa_flags("avx2") and "-mavx2" not in cpu_kernels.isa_flags("portable")
    assert cpu_kernels.supported_isas()[-1] == "portable"


def test_levels_follow_the_cpus_flags(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert cpu_kernels.supported_isas(AVX2_CPU) == ["avx2", "portable"]
    assert cpu_kernels.supported_isas(frozenset({"avx", "avx2", "fma"})) == ["portable"]  # no F16C
    vnni = frozenset(cpu_kernels.ISAS["avx512-vnni"].cpu_flags)
    assert cpu_kernels.supported_isas(vnni) == ["avx512-vnni", "avx512", "avx2", "portable"]
    assert cpu_kernels.supported_isas(vnni - {"avx512_vnni"})[0] == "avx512"
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert cpu_kernels.supported_isas(vnni) == ["portable"]


def test_auto_takes_the_best_level_and_says_which(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="sluice.engine")
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SLUICE_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    lib = cpu_kernels.load()
    assert lib.sluice_kernels_isa().decode() == CPU_ISAS[0]
    assert f"CPU kernels: {CPU_ISAS[0]} " in caplog.text
    [built] = (tmp_path / "kernels").glob("*.so")
    assert built.name.startswith(f"sluice_cpu_kernels-{CPU_ISAS[0]}-")
    assert cpu_kernels.library_isa(built) == CPU_ISAS[0]


@pytest.mark.parametrize("isa", CPU_ISAS)
def test_sluice_cpu_isa_forces_a_level(monkeypatch, isa):
    monkeypatch.setenv("SLUICE_CPU_ISA", isa)
    assert cpu_kernels.selected_isa() == isa
    assert cpu_kernels.load().sluice_kernels_isa().decode() == isa


def test_sluice_cpu_isa_refuses_a_level_the_cpu_lacks(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: AVX2_CPU)
    monkeypatch.setenv("SLUICE_CPU_ISA", "avx512-vnni")
    with pytest.raises(cpu_kernels.CpuIsaError, match="SLUICE_CPU_ISA=avx512-vnni: this CPU .* lacks it; it runs avx2, portable"):
        cpu_kernels.load()
    monkeypatch.setenv("SLUICE_CPU_ISA", "avx3")
    with pytest.raises(cpu_kernels.CpuIsaError, match="not a level"):
        cpu_kernels.load()
    with pytest.raises(cpu_kernels.CpuIsaError, match="lacks it"):
        cpu_kernels.load("avx512")
    assert not (tmp_path / "kernels").exists()  # refused before any build


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None,
                    reason="x86-64 levels, built with g++")
def test_a_library_for_a_level_the_cpu_lacks_is_never_loaded(tmp_path, monkeypatch, caplog):
    """An AVX-512 library (built here: any x86-64 CPU can compile it) in the cache of a CPU without AVX-512,
    under its own name and copied over the AVX2 one (an image or cache from another machine): auto takes avx2,
    and no call ever opens the AVX-512 file."""
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SLUICE_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    avx512 = cpu_kernels.library_path("g++", "avx512-vnni")
    cpu_kernels.build("g++", "avx512-vnni", avx512)
    assert cpu_kernels.library_isa(avx512) == "avx512-vnni"
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: AVX2_CPU)
    opened = []
    real_cdll = ctypes.CDLL
    monkeypatch.setattr(ctypes, "CDLL", lambda path, *a, **kw: (opened.append(str(path)), real_cdll(path, *a, **kw))[1])
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: "g++")
    lib = cpu_kernels.load()
    assert lib.sluice_kernels_isa() == b"avx2" and opened == [str(cpu_kernels.library_path("g++", "avx2"))]
    with pytest.raises(cpu_kernels.CpuIsaError, match="lacks"):
        cpu_kernels.open_library(avx512, "avx512-vnni")
    # the AVX-512 file where the AVX2 one should be: read, refused, never opened. A new file (copy, then
    # rename over): the AVX2 library loaded above stays mapped in this process, and rewriting its inode in
    # place would change its code under it (the interpreter then crashed at exit in its destructors).
    avx2 = cpu_kernels.library_path("g++", "avx2")
    shutil.copyfile(avx512, avx2.with_name(avx2.name + ".new"))
    os.replace(avx2.with_name(avx2.name + ".new"), avx2)
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    opened.clear()
    assert cpu_kernels.load() is None
    assert "built for avx512-vnni, not avx2" in caplog.text
    assert opened == []


@pytest.mark.slow
def test_engine_tokens_and_logprobs_match_the_torch_path(model_dir):
    """The real model through the whole engine -- chunked prefill, decode, n-gram verification rows --
    with the kernel (this CPU's best level) and with the torch reference: the same greedy tokens, logprobs
    within float noise."""
    isa_lib(CPU_ISAS[0])
    from sluice_engine.entrypoints.llm import LLM
    from sluice_engine.sampling_params import SamplingParams

    prompts = ["The capital of France is", "def fib(n):\n    if n < 2:\n        return n\n    return",
               "One two three four five six seven eight nine ten eleven twelve one two three four five",
               "Write a haiku about the sea."]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1, ignore_eos=True)
    runs = {}
    for backend in ("cpu", "torch"):
        llm = LLM(str(model_dir), max_model_len=512, max_num_batched_tokens=16, kv_cache_memory=32 << 20,
                  attention_backend=backend,
                  speculative_method="ngram", num_speculative_tokens=3)
        assert llm.engine.runner.backend.name == backend
        runs[backend] = llm.generate(prompts, params)
    for a, b in zip(runs["cpu"], runs["torch"], strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(la[0] - lb[0]) < 1e-4
