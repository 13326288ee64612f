"""The interface every attention backend implements, and the choice between them."""

from __future__ import annotations

from typing import Protocol

import torch

from ..forward_context import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                 kv_scale: torch.Tensor | None = None) -> None:
        """Scatter this step's K/V rows ([T, Hkv, D]) into their cache slots. An FP8 cache (float8_e4m3fn,
        --kv-cache-dtype fp8) stores K / k_scale and V / v_scale, saturated to +-448, with kv_scale the layer's
        [k_scale, v_scale] (float32, on the device); a cache in the model's dtype ignores kv_scale."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float, kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of the new query rows ([T, Hq, D]) over each sequence's cached context
        (which already includes this step's K/V). k/v are this step's rows, for backends that can use
        them directly (not with an FP8 cache: every key and value is read back from the cache, so a prompt
        sees the same rounded K/V whether its prefix was cached or not). Returns [T, Hq, D]."""


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """auto: the Triton kernels on CUDA when triton imports; on CPU the C++ kernel when it builds
    (a C++ compiler is there), else the torch reference."""
    if name == "auto":
        if device.type == "cuda":
            name = "triton" if _triton_available() else "torch"
        else:
            name = "cpu" if _cpu_kernel() is not None else "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"--attention-backend cpu runs on the CPU, not {device.type}")
        lib = _cpu_kernel()
        if lib is None:
            raise ValueError("--attention-backend cpu: the C++ kernel could not be built (see the log)")
        from .cpu_paged import CpuPagedAttention

        return CpuPagedAttention(lib)
    if name == "torch":
        from .torch_paged import TorchPagedAttention

        return TorchPagedAttention()
    if name == "triton":
        try:
            from .triton_paged import TritonPagedAttention
        except ImportError as e:
            raise ValueError(f"--attention-backend triton needs the triton package ({e})") from e
        return TritonPagedAttention(device)
    raise ValueError(f"unknown attention backend {name!r}")


def _cpu_kernel():
    from .. import cpu_kernels

    return cpu_kernels.load()


def _triton_available() -> bool:
    try:
        from . import triton_paged  # noqa: F401
    except ImportError:
        return False
    return True
