"""The `--quantization` flag's names and what each means on which device (torch-free: config.py
validates with it). The CPU formats are GGUF block formats run by cpu_kernels/quant_gemm.cpp; the GPU
formats are named here so that CPU serving can refuse them with a message."""

from __future__ import annotations

CPU_FORMATS = ("q8_0", "q4_0", "q4_1")
GPU_FORMATS = ("fp8", "awq", "gptq")  # no CPU kernels: refused on CPU
CHOICES = ("auto", "none", *CPU_FORMATS, *GPU_FORMATS)


def check_device(quantization: str, device: str) -> None:
    """Raise ValueError where `device` (cpu | cuda | auto) has no kernels for `quantization`."""
    if quantization in ("auto", "none"):
        return
    if quantization in GPU_FORMATS and device != "cpu":
        # NOTE: the Triton kernels and checkpoint readers exist (sluice_engine/quant) but the model loader does
        # not build QuantLinear layers from them yet: refuse rather than load such a checkpoint as dense.
        raise ValueError(f"--quantization {quantization}: this engine build cannot serve {quantization} weights "
                         "yet (its Triton kernels are not wired into model loading); use none")
    if device == "cpu" and quantization in GPU_FORMATS:
        raise ValueError(f"--quantization {quantization}: {quantization} weights need CUDA kernels; on CPU "
                         f"use one of {', '.join(CPU_FORMATS)} or none")
    if device == "cuda" and quantization in CPU_FORMATS:
        raise ValueError(f"--quantization {quantization}: the {quantization} kernels run on CPU only; "
                         f"on CUDA use none (or serve with --device cpu)")
