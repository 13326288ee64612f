"""Triton kernel modules in tests: compiled for the GPU when there is one, else run by Triton's interpreter.

Triton reads TRITON_INTERPRET when a kernel is decorated, when triton.language is first imported, and again
during launches (lazy imports, constexpr functions), so the variable is set before the first import and stays
set for the rest of the process. Without a GPU nothing else can run Triton code anyway. Pytest imports every
test module before running any test, and no other module imports triton at import time.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

CUDA = torch.cuda.is_available()


def import_kernels(module: str) -> ModuleType:
    """`module` (which exposes INTERPRETER_READY), imported so that its kernels can run here."""
    if not CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    mod = importlib.import_module(module)
    if not CUDA and not mod.INTERPRETER_READY:
        raise RuntimeError("triton was imported in this process before TRITON_INTERPRET=1 was set; run these "
                           "tests with TRITON_INTERPRET=1 in the environment")
    return mod
