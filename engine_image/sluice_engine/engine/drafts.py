"""Speculative decoding's proposal hook, run before a step is scheduled: guess the next tokens of each decoding
request that may speculate (spec_decode/ proposes them; the scheduler computes them after the last known token;
the sampler verifies)."""

from __future__ import annotations

from ..draft_interface import DraftQuery


def propose_drafts(proposer, scheduler, disable_batch_size: int, max_model_len: int, ve: int = 0) -> None:
    running = [r for r in scheduler.running if r.virtual_engine == ve]
    if len(running) > disable_batch_size:
        return  # a large batch already uses the compute that speculation would fill
    queries: list[DraftQuery] = []
    asking = []
    for req in running:
        p = req.params
        # Penalties and plain logits processors depend on the tokens before each position; drafts
        # would need them applied position by position, which the verifier does not do (yet).
        # Token constraints (grammars) do: the verifier masks each row by the state after the
        # drafts before it.
        if (not p.speculative or req.num_computed_tokens != req.num_tokens - 1 or req.num_in_flight_tokens
                or req.logits_processors or p.needs_penalties):
            continue
        # Room for the drafts plus the one token every step produces anyway.
        room = min(p.max_tokens - req.num_output_tokens, max_model_len - req.num_tokens) - 1
        if room > 0:
            queries.append(DraftQuery(req.request_id, req.all_token_ids, room))
            asking.append(req)
    if not queries:
        return
    for req, drafts in zip(asking, proposer.propose_batch(queries), strict=True):
        for c in req.constraints:  # a draft the grammar forbids would surely be rejected
            del drafts[c.valid_prefix(drafts):]
        scheduler.set_drafts(req, drafts)


def may_run_ahead(proposer, scheduler, disable_batch_size: int) -> bool:
    """Whether the next step may be scheduled before the one in flight is back (async scheduling): not when a
    request could get drafts (they are guessed from its last token, which is not known yet)."""
    if proposer is None:
        return True
    running = scheduler.running
    if len(running) > disable_batch_size:
        return True
    return not any(r.params.speculative and not r.logits_processors and not r.params.needs_penalties
                   for r in running)
