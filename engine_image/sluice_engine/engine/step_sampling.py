"""A step's sampling as the engine launches it (sample/step_sampler.py does the sampling): the whole batch at once,
or request by request when that raises, so only the requests whose own state makes sampling fail (a logits
processor that raises, say) fail; and the part of a step for some of its requests."""

from __future__ import annotations

import logging
import threading

import torch

from ..core.request import Request
from ..core.sched_output import SchedulerOutput
from ..sample.step_sampler import LaunchedSample, SampledTokens, launch_step_sample
from ..step_timeline import span

log = logging.getLogger("sluice.engine")


def launch_sample(sampler, logits, sched: SchedulerOutput,
                  requests: list[Request]) -> tuple[list[LaunchedSample], list[tuple[Request, Exception]]]:
    """Queue the whole batch's sampling; if that raises, each request's on its own."""
    if not requests:
        return [], []
    try:
        return [launch_step_sample(sampler, logits, sched, requests)], []
    except Exception:  # noqa: BLE001 - attributed below, request by request
        log.warning("sampling the batch failed; sampling its %d requests one by one", len(requests))
    rows, firsts = sched.logits_layout()
    launched: list[LaunchedSample] = []
    failed: list[tuple[Request, Exception]] = []
    for s, req, first in zip(sched.scheduled, requests, firsts, strict=True):
        one = type(sched)([s])
        k = s.logits_rows()
        try:
            launched.append(launch_step_sample(sampler, logits[first : first + k], one, [req]))
        except Exception as e:  # noqa: BLE001 - this request's failure
            failed.append((req, e))
    return launched, failed


def select(sched: SchedulerOutput, requests: list[Request], logits, keep: list[int]):
    """The step's part for the requests at `keep`, and their logits rows."""
    rows, firsts = sched.logits_layout()
    picked = [firsts[i] + j for i in keep for j in range(sched.scheduled[i].logits_rows())]
    sub = SchedulerOutput([sched.scheduled[i] for i in keep])
    idx = torch.tensor(picked, dtype=torch.long).to(logits.device, non_blocking=True)
    return sub, [requests[i] for i in keep], logits.index_select(0, idx)


def merged(launched: list[LaunchedSample]) -> SampledTokens | None:
    """One SampledTokens over several launches (a batch sampled request by request after a failure)."""
    if len(launched) == 1:
        return launched[0].sampled_tokens
    parts = [x.sampled_tokens for x in launched if x.sampled_tokens is not None]
    if not parts:
        return None
    row_of: dict[str, int] = {}
    base = 0
    for p in parts:
        row_of.update({rid: base + r for rid, r in p.row_of.items()})
        base += p.tokens.shape[0]
    return SampledTokens(torch.cat([p.tokens for p in parts]), row_of)


def run_device_step(executor, sampler, runner, sched: SchedulerOutput, requests: list[Request],
                    before: threading.Event | None):
    """In the step thread (async scheduling): the step's forward, then, once the outputs of the step before are
    applied (`before`), its sampling. The sampled tokens stay on the device for the next step's placeholders."""
    tl = runner.timeline
    if tl is not None:
        tl.job_started()
    logits = executor.execute_model(sched)
    if before is not None:
        with span(tl, "device_wait"):
            before.wait()
    # A request the step before ended (a stop token, its length) is not sampled: its grammar may have
    # nothing left to allow.
    live = [i for i, r in enumerate(requests) if not r.is_finished]
    if len(live) < len(requests):
        sched, requests, logits = select(sched, requests, logits, live)
    with span(tl, "sample"):
        launched, failed = launch_sample(sampler, logits, sched, requests)
    runner.placeholder_source = merged(launched)
    if tl is not None:
        tl.job_ended()
    return launched, failed
