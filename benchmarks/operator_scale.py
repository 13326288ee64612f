"""The operator at N endpoints on kmock's in-memory Kubernetes API (tests/support/kube_emulator.py): time to converge
and API requests per endpoint per minute at rest, with the resync by change (drift.py, the default) and,
side by side, the old resync by clock (a whole pass over every endpoint every round).

    .venv/bin/python benchmarks/operator_scale.py --endpoints 300          # ~5 min on 2 cores (both modes)

Steps, per mode: create N endpoints at once; "converged" is when every one has a status for its generation
(the operator applied its ~8 children and wrote the status of each), the periodic resync off meanwhile. Then
run resync rounds directly (Loop.resync_round): two to reach rest, then --rounds counted: the operator's own
requests to the API (its client's metric; kopf's watch streams excluded) and its passes. Requests per endpoint per minute are given for the default
`--resync-seconds 60`: a round's requests / N (a round runs once a minute). The emulator is a Python
process on the same cores, so times are the operator's and the emulator's together: ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import kopf
from kmock._internal import apps

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kopf_harness import ENDPOINT, NS, serve_kinds  # noqa: E402
from kube_emulator import ApiServer  # noqa: E402

from sluice_engine.bench.machine import cpu_name, load_average  # noqa: E402
from sluice_operator import drift  # noqa: E402
from sluice_operator.handlers import Loop, build_registry  # noqa: E402
from sluice_operator.main import serve  # noqa: E402


def endpoint(i: int) -> dict[str, Any]:
    doc = copy.deepcopy(ENDPOINT)
    doc["metadata"].update(name=f"ep{i:04d}", generation=1)
    doc["spec"]["model"]["servedName"] = f"ep{i:04d}"
    return doc


async def settle(loop: Loop, quiet_s: float = 2.0) -> None:
    """Until the coalesced passes after child events, and the handlers of the events the last writes caused,
    are over: the operator has sent no request for `quiet_s`."""
    quiet_since, calls = time.monotonic(), loop.metrics.api_requests_total()
    while loop.background or time.monotonic() - quiet_since < quiet_s:
        await asyncio.sleep(0.2)
        if loop.background or loop.metrics.api_requests_total() != calls:
            quiet_since, calls = time.monotonic(), loop.metrics.api_requests_total()


async def run(mode: str, n: int, rounds: int) -> dict[str, float]:
    real_needed = drift.needed
    if mode == "clock":  # what the resync did before drift.py: a full pass over every endpoint, every round
        drift.needed = lambda previous, now: "apply"
    try:
        async with ApiServer() as k8s, apps.Server(k8s):
            k8s.record_requests = False  # kmock's history scan per request would make the run quadratic
            serve_kinds(k8s)
            url = str(k8s.url).rstrip("/")
            loop = Loop()
            # No periodic resync while the endpoints converge (events drive that); rounds are run below.
            registry = build_registry(loop, namespaces=[NS], login=lambda **_: kopf.ConnectionInfo(server=url),
                                      resync_seconds=1e6)
            stop = asyncio.Event()
            task = asyncio.create_task(serve(loop, registry, [NS], stop=stop))
            started = time.monotonic()
            async with aiohttp.ClientSession() as http:
                sem = asyncio.Semaphore(16)

                async def create(i: int) -> None:
                    async with sem, http.post(f"{url}/apis/sluice.dev/v1alpha1/namespaces/{NS}/inferenceendpoints",
                                              json=endpoint(i)) as r:
                        assert r.status < 400, await r.text()
                await asyncio.gather(*(create(i) for i in range(n)))
            created = time.monotonic() - started

            def converged() -> int:
                done = 0
                for (res, _, _name), obj in list(k8s.objects.items()):
                    if res.plural == "inferenceendpoints" and not obj.deleted:
                        st = obj.raw.get("status") or {}
                        done += st.get("observedGeneration") == 1
                return done

            while converged() < n:
                await asyncio.sleep(0.5)
            converge_s = time.monotonic() - started
            print(f"[{mode}] {n} endpoints created in {created:.1f} s, converged {converge_s:.1f} s after the first",
                  flush=True)
            await settle(loop)
            log = logging.getLogger("operator_scale")
            async with loop.api() as api:
                for _ in range(2):  # the first round sees every child for the first time: one more pass each
                    await loop.resync_round(api, log)
                    await settle(loop)
                calls0, passes0, t0 = loop.metrics.api_requests_total(), loop.metrics.reconciles_total(), time.monotonic()
                for _ in range(rounds):
                    await loop.resync_round(api, log)
                calls, busy = loop.metrics.api_requests_total() - calls0, time.monotonic() - t0
                round_passes = (loop.metrics.reconciles_total() - passes0) / rounds
            stop.set()
            await asyncio.wait_for(task, 60)
            per_round = calls / rounds
            return {"converge_s": converge_s, "calls_per_round": per_round, "passes_per_round": round_passes,
                    "calls_per_endpoint_per_min_at_60s": per_round / n, "round_s": busy / rounds}
    finally:
        drift.needed = real_needed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoints", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3, help="rounds counted at rest")
    ap.add_argument("--modes", default="change,clock")
    ap.add_argument("--clock-endpoints", type=int, default=None,
                    help="endpoints for the clock mode (default: --endpoints); its round is a pass over every "
                         "endpoint, so at 300 on kmock one round takes minutes")
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}; load {load_average()}")
    results = {}
    for mode in args.modes.split(","):
        n = args.clock_endpoints if mode == "clock" and args.clock_endpoints else args.endpoints
        results[mode] = asyncio.run(run(mode, n, args.rounds))
        r = results[mode]
        print(f"[{mode}] converge {r['converge_s']:.1f} s; at rest {r['calls_per_round']:.0f} requests and "
              f"{r['passes_per_round']:.0f} passes per round "
              f"({r['calls_per_endpoint_per_min_at_60s']:.3f} per endpoint per minute at --resync-seconds 60); "
              f"a round takes {r['round_s']:.2f} s", flush=True)
    if {"change", "clock"} <= results.keys():
        a, b = results["change"], results["clock"]
        print(f"per endpoint per minute at rest: change {a['calls_per_endpoint_per_min_at_60s']:.3f}, "
              f"clock {b['calls_per_endpoint_per_min_at_60s']:.1f} "
              f"({b['calls_per_endpoint_per_min_at_60s'] / a['calls_per_endpoint_per_min_at_60s']:.0f}x)")


if __name__ == "__main__":
    main()
