"""How long the engine's idle OpenMP threads spin before they sleep: libgomp's default is ~300,000 pause
iterations (7.5 ms on a Zen 4, ~15 ms on a Xeon), set here to 2,000 (~50-100 us) for every process `sluice serve`
starts, unless the user chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment wins).

Why: a CPU engine's step is its kernels' parallel regions, back to back (microseconds apart: a short spin
catches every one), then the step's host work on one thread (scheduling, sampling, outputs: a few ms), while
the API process streams tokens and the clients run on the same cores. With the default, the other OpenMP
threads spin through that host work and hold cores the API process needs, so the OS preempts a thread that is
computing instead, and its partner spins at the next barrier too. Served on the bundled model (AMD EPYC Zen 4,
2 threads, docs/BENCHMARKS.md), side by side in both orders: 2,000 gave 1.05-1.06x the default's output tok/s
at c32 (c8 and c1 within the noise); 500 and 5,000-20,000 less than 2,000; passive less than the default.

libgomp reads these at load, so this must run before torch (which loads libgomp) in the processes concerned:
`sluice serve` calls it first, and the engine-core and rank processes it starts inherit the environment.
"""

from __future__ import annotations

from collections.abc import MutableMapping

SPIN_COUNT = 2000


def default_omp_wait(env: MutableMapping[str, str]) -> bool:
    """Set GOMP_SPINCOUNT in env unless the user chose a wait policy; True if it was set."""
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return False
    env["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return True
