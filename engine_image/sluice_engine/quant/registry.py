"""The GPU quantization formats a checkpoint's config.json can name (quantization_config.quant_method), their
weights classes, and the checks that refuse variants the kernels do not implement. Torch-free: the classes
are imported by name when asked for, so config validation needs neither torch nor triton.

Each weights class has `from_checkpoint(get, prefix, qcfg)` (get: tensor name -> tensor or None),
`dequantize()` (the plain-torch reference, W^T or W in fp32), `apply(x, bias)` (the kernel) and `to(device)`.
"""

from __future__ import annotations

import importlib

# quant_method -> "module:Class" under sluice_engine.quant
GPU_FORMATS: dict[str, str] = {
    "fp8": "fp8:Fp8Weights",
    "awq": "awq:AwqWeights",
    "gptq": "gptq:GptqWeights",
}


def check_quant_config(qcfg: dict) -> str:
    """The quant_method of a config.json quantization_config, or ValueError saying what is not supported."""
    method = str(qcfg.get("quant_method", "")).lower()
    if method not in GPU_FORMATS:
        raise ValueError(f"quantization_config.quant_method {method or '(missing)'!r} is not supported; "
                         f"supported: {', '.join(GPU_FORMATS)}")
    if method in ("awq", "gptq") and qcfg.get("bits", 4) != 4:
        raise ValueError(f"{method}: only 4-bit weights are supported, not bits={qcfg['bits']}")
    if method == "awq":
        if str(qcfg.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"awq: only the GEMM packing (version gemm) is supported, not {qcfg['version']!r}")
        if not qcfg.get("zero_point", True):
            raise ValueError("awq: only zero_point true checkpoints are supported")
    if method == "gptq" and str(qcfg.get("checkpoint_format", "gptq")).lower() != "gptq":
        raise ValueError(f"gptq: only the v1 checkpoint_format 'gptq' is supported, not "
                         f"{qcfg['checkpoint_format']!r}")
    if method == "fp8" and qcfg.get("weight_block_size"):
        raise ValueError("fp8: block-wise scales (weight_block_size) are not supported; per-tensor and "
                         "per-channel scales are")
    return method


def weights_class(method: str) -> type:
    module, cls = GPU_FORMATS[method].split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)
