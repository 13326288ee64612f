"""Quantized weights for linear layers: one module per format, each with its checkpoint layout, a plain-torch
dequantize reference and the kernel that serves it; `registry` maps a checkpoint's quant_method to its format.

GPU formats (Triton, triton_gemm.py): fp8 (e4m3 weight-only), awq and gptq (4-bit, group-wise). Served through
models/gpu_quant_loader.py, which builds a quantized checkpoint's decoder projections as linear.QuantLinear (see
docs/engine-flags.md, --quantization).
"""
