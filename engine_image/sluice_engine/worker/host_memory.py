"""Host memory for KV blocks: the CPU cache (model_runner.py) and the offload tier (kv_tier.py)."""

from __future__ import annotations

import math

import numpy as np
import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in memory the OS maps on first write: numpy's zeros is calloc, which for a large size is a fresh
    anonymous mapping left untouched, where torch.zeros writes every byte. So on CPU a KV cache's blocks count
    in the process's resident memory once used, not all at startup (1 GiB by default on CPU)."""
    return torch.from_numpy(np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8)).view(dtype).view(shape)
