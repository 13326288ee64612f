"""The engine's own counters (EngineStats) and the one stats snapshot it publishes per step (metrics.py
StatsSnapshot): plain copied values of the scheduler's, the KV cache's, the metrics' and the components' state, the
engine thread's to take; /metrics renders the latest one published."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from ..metrics import HISTOGRAMS, StatsSnapshot


@dataclass(slots=True)
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Counter = field(default_factory=Counter)
    steps: int = 0
    # Requests whose client left, by how far they had got then (queued / prefill / decode), and
    # those of them scheduled after their client had left: work done for nobody.
    abandoned: Counter = field(default_factory=Counter)
    scheduled_after_client_left: int = 0
    # Speculative decoding: drafts verified, drafts accepted, and acceptances by draft position.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafted_per_pos: list[int] = field(default_factory=list)
    spec_accepted_per_pos: list[int] = field(default_factory=list)

    def count_abandoned(self, req, left_at: float) -> None:
        """A request whose client left at `left_at` (time.monotonic()), by how far it had got then."""
        scheduled = req.first_scheduled_time
        if scheduled is None or scheduled > left_at:
            phase = "queued"
            if scheduled is not None:  # scheduled between the client leaving and this abort
                self.scheduled_after_client_left += 1
        elif req.num_output_tokens == 0:
            phase = "prefill"
        else:
            phase = "decode"
        self.abandoned[phase] += 1

    def count_spec(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_draft_tokens += num_drafts
        self.spec_accepted_tokens += num_accepted
        grow = num_drafts - len(self.spec_drafted_per_pos)
        if grow > 0:
            self.spec_drafted_per_pos.extend([0] * grow)
            self.spec_accepted_per_pos.extend([0] * grow)
        for i in range(num_drafts):
            self.spec_drafted_per_pos[i] += 1
            self.spec_accepted_per_pos[i] += i < num_accepted

    def snapshot(self, m, scheduler, kv, runner, **components) -> StatsSnapshot:
        """m: the engine's EngineMetrics; components: the LoRA and KV-transfer components' own fields."""
        graphs = runner.graph_state
        return StatsSnapshot(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            prompt_tokens_pending=scheduler.prompt_tokens_pending,
            kv_usage=kv.usage(), kv_num_blocks=kv.num_blocks, graphs_captured=graphs.captured,
            graphs_state=graphs.state, graphs_reason=graphs.reason, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens, prefix_queries=kv.prefix_queries, prefix_hits=kv.prefix_hits,
            num_preemptions=scheduler.num_preemptions, finished=dict(self.finished),
            abandoned=dict(self.abandoned), scheduled_after_client_left=self.scheduled_after_client_left,
            requests_slo_checked=m.requests_slo_checked, requests_goodput=m.requests_goodput,
            requests_met_ttft=m.requests_met_ttft, requests_met_tpot=m.requests_met_tpot,
            busy_prefill_seconds=m.busy_prefill_seconds, busy_decode_seconds=m.busy_decode_seconds,
            # Every draft has a position 0, so drafts verified = drafts at position 0.
            spec_num_drafts=self.spec_drafted_per_pos[0] if self.spec_drafted_per_pos else 0,
            spec_draft_tokens=self.spec_draft_tokens, spec_accepted_tokens=self.spec_accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec_accepted_per_pos),
            histograms={name: getattr(m, name).copy() for name in HISTOGRAMS},
            slo_ttft=m.slo_ttft, slo_tpot=m.slo_tpot, gpu_hour_usd=m.gpu_hour_usd, num_gpus=m.num_gpus,
            taken_at=time.time(), **_offload_stats(kv, runner.kv_tier), **components)


def _offload_stats(kv, tier) -> dict:
    ix = kv.offload
    if ix is None or tier is None:
        return {}
    return dict(kv_offload_blocks=ix.num_slots, kv_offload_used=len(ix), kv_offload_stored=ix.stored,
                kv_offload_loaded=ix.loaded, kv_offload_hits=kv.offload_hits,
                kv_offload_dropped=ix.dropped, kv_offload_block_bytes=tier.bytes_per_slot,
                kv_offload_store_seconds=tier.store_seconds, kv_offload_load_seconds=tier.load_seconds,
                kv_offload_received=ix.received)
