"""The CPU kernel levels this machine runs (cpu_kernels.supported_isas(): avx512-vnni, avx512, avx2, portable,
best first), for the kernels' tests to run each against the reference and against each other."""

import pytest

from sluice_engine import cpu_kernels

CPU_ISAS = cpu_kernels.supported_isas()


def isa_lib(isa: str):
    """The kernels' library built for `isa` (one of CPU_ISAS); fails the test where it does not build."""
    lib = cpu_kernels.load(isa)
    if lib is None:
        pytest.fail(f"the CPU kernels did not build for {isa} (is g++ installed?); see the log")
    return lib
