"""The `--quantization` flag's names and what each means on which device (torch-free: config.py
validates with it).

- CPU formats (q8_0, q4_0, q4_1): GGUF block formats run by cpu_kernels/quant_gemm.cpp, on the C++ CPU path.
- GPU formats (fp8, awq, gptq): weight-only formats run by the Triton GEMM kernels of quant/triton_gemm.py,
  which dequantize in the kernel. A checkpoint quantized in one of them (config.json quantization_config)
  is served in it with auto or its own name (models/gpu_quant_loader.py builds its decoder projections from
  the packed tensors); naming another format for it is refused. `fp8` on a dense checkpoint quantizes its
  weights at load (per-channel scales); awq and gptq need a checkpoint quantized so.
  They run where Triton runs: on CUDA, and on CPU only in Triton's interpreter (TRITON_INTERPRET=1), i.e.
  with the Triton attention backend (--attention-backend triton), which is how the tests run the whole
  engine without a GPU; any other CPU setup is refused. FP8 (e4m3) weights dequantize in the kernel on any
  CUDA GPU: those with e4m3 conversions (compute capability 8.9+: L4, H100, H200) convert natively, older ones
  (A100, A10, ...) decode the e4m3 bits with integer arithmetic -- the same values; weight-only FP8 is about
  memory, so either way it halves a bf16 model's weight bytes.
"""

from __future__ import annotations

CPU_FORMATS = ("q8_0", "q4_0", "q4_1")
GPU_FORMATS = ("fp8", "awq", "gptq")  # Triton kernels: CUDA, or Triton's interpreter on CPU (tests)
CHOICES = ("auto", "none", *CPU_FORMATS, *GPU_FORMATS)


def gpu_formats_run(device: str, attention_backend: str = "auto") -> bool:
    """Whether the GPU formats' Triton kernels run on `device` (cpu | cuda | auto, as the flag may still say):
    on CUDA, and on CPU beside the Triton attention backend (Triton's interpreter: tests)."""
    return device != "cpu" or attention_backend == "triton"


def check_device(quantization: str, device: str, attention_backend: str = "auto") -> None:
    """Raise ValueError where `device` (cpu | cuda | auto) has no kernels for `quantization`."""
    if quantization in ("auto", "none"):
        return
    if quantization in GPU_FORMATS and not gpu_formats_run(device, attention_backend):
        raise ValueError(f"--quantization {quantization}: {quantization} weights need CUDA kernels; on CPU "
                         f"use one of {', '.join(CPU_FORMATS)} or none (Triton's interpreter runs them on CPU "
                         "with --attention-backend triton, for tests)")
    if device == "cuda" and quantization in CPU_FORMATS:
        raise ValueError(f"--quantization {quantization}: the {quantization} kernels run on CPU only; "
                         f"on CUDA use none (or serve with --device cpu)")


# -- the KV cache (--kv-cache-dtype) ----------------------------------------------------------------------------
# auto: the model's dtype. fp8: float8_e4m3fn with a per-tensor scale per layer for K and for V (the checkpoint's
# k_scale/v_scale, else 1.0): half the bytes of a bf16 cache, so twice the tokens in the same memory. Written
# and read by the Triton attention kernels (and the torch reference backend on CUDA); on CPU only in Triton's
# interpreter (tests), as the GPU weight formats.
KV_CACHE_DTYPES = ("auto", "fp8")


def check_kv_cache_dtype(kv_cache_dtype: str, device: str, attention_backend: str = "auto") -> None:
    """Raise ValueError unless `device` (cpu | cuda | auto, as the flag may still say) with `attention_backend`
    runs a cache of `kv_cache_dtype`: fp8 on CUDA, or on CPU with the Triton backend (the interpreter: tests).
    The C++ CPU kernel reads the model's dtype only."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "fp8" and (attention_backend == "cpu" or (device == "cpu" and attention_backend != "triton")):
        raise ValueError("--kv-cache-dtype fp8: the FP8 KV cache needs the Triton attention kernels (CUDA); "
                         "on CPU use auto")
