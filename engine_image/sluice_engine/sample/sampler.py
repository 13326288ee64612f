"""From the logits of each sampling row to tokens (drafts verified on the way), and logprobs when asked.

Order (as users of vLLM expect): token constraints (grammar masks) -> logits processors -> logit bias
-> penalties -> greedy argmax or temperature -> top-k -> top-p -> min-p -> sample. Reported logprobs
are of the raw model distribution, before any of that processing.

The whole batch is sampled in batched tensor ops with per-row parameters as tensors, and nothing is
read back until the step's end: `sample` returns a PendingSample still on the device, and
`device_io.fetch` reads it (with the step's prompt logprobs) in one transfer. Nothing in here reads
a tensor on the host; decisions about what work to do are made from the requests' Python parameters.
User logits processors are the exception: they are Python callables and may read what they like.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.request import Request, TokenConstraint
from ..device_io import fetch
from .cpu_draw import inverse_cdf
from .logprobs import DeviceLogprobs, TokenLogprobs, gather_logprobs
from .penalties import apply_logit_bias, apply_penalties
from .sampling_batch import SamplingBatch
from .truncation import sampling_probs

__all__ = ["PendingSample", "Sampler", "SamplerOutput", "TokenLogprobs", "apply_constraints"]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


@dataclass(slots=True)
class PendingSample:
    """A sampled batch still on the device (a device_io.DeviceResult). Per row: the token it emits
    (its draft if accepted, else the token drawn in its place); per request with drafts: how many
    were accepted. `read` turns the fetched values into, per request, (tokens, their logprobs)."""

    batch: SamplingBatch
    tokens: torch.Tensor  # [rows]
    accepted: torch.Tensor | None  # [requests]; None when no request has drafts
    logprobs: DeviceLogprobs | None

    def tensors(self) -> list[torch.Tensor]:
        out = [self.tokens]
        if self.accepted is not None:
            out.append(self.accepted)
        if self.logprobs is not None:
            out.extend(self.logprobs.tensors())
        return out

    def read(self, values: list[list[float]]) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
        b = self.batch
        tokens = [int(t) for t in values[0]]
        accepted = [int(a) for a in values[1]] if self.accepted is not None else [0] * len(b.requests)
        row_lps: list[TokenLogprobs | None] = [None] * b.num_rows
        if self.logprobs is not None:
            lp_values = values[2:] if self.accepted is not None else values[1:]
            for row, lp in zip(b.logprob_rows, self.logprobs.read(lp_values), strict=True):
                row_lps[row] = lp
        out = []
        for first, n in zip(b.firsts, accepted, strict=True):
            # The accepted drafts, then the token drawn at the first rejected draft (or the bonus).
            out.append((tokens[first : first + n + 1], row_lps[first : first + n + 1]))
        return out


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        # The noise of every request without a seed of its own.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [B, V] float32, row i for requests[i]: one token each (drafts not verified)."""
        (results,) = fetch([self.sample(logits, requests, [[] for _ in requests])])
        return SamplerOutput([t[0] for t, _ in results], [lp[0] for _, lp in results])

    def verify(self, logits: torch.Tensor, requests: list[Request]) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
        """Speculative decoding: logits holds, per request in order, len(spec_token_ids) + 1 rows.
        Returns (emitted tokens, their logprobs) per request: accepted drafts plus one more token."""
        (results,) = fetch([self.sample(logits, requests, [r.spec_token_ids for r in requests])])
        return results

    def sample(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]) -> PendingSample:
        """Sample and verify on the device, with no read back. logits: per request in order,
        len(drafts[i]) + 1 rows; row j of request i is the target's distribution after drafts[i][:j].

        Greedy: a draft is accepted iff it is the argmax, and the row's token is the argmax. Sampling:
        the drafts are deterministic guesses (q one-hot), so draft d is accepted with probability p(d)
        and, on rejection, the token is drawn from p with d removed (renormalised); after all drafts are
        accepted the bonus token is drawn from the last row. That is the standard rejection-sampling
        scheme with q one-hot; the output has exactly the target's distribution. A request without
        drafts is the plain case: its one row is a bonus row.
        """
        batch = SamplingBatch.build(requests, drafts, logits.shape[-1], self.device)
        assert batch.num_rows == logits.shape[0], (batch.num_rows, tuple(logits.shape))
        tokens, accepted_rows = self._choose(self._process(logits, batch), batch)
        accepted = None
        if batch.any_drafts:
            # A row's token is its draft where accepted; where not, the token drawn in its place.
            tokens = torch.where(accepted_rows, batch.t["draft"], tokens)
            accepted = _accepted_lengths(accepted_rows, batch.t["row_request"], batch.t["first_row"])
        lps = None
        if batch.logprob_rows:
            whole = len(batch.logprob_rows) == batch.num_rows
            rows = batch.t["logprob_rows"]
            lps = gather_logprobs(logits if whole else logits.index_select(0, rows),
                                  tokens if whole else tokens.index_select(0, rows), batch.logprob_ks)
        return PendingSample(batch, tokens, accepted, lps)

    def _choose(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per row: the token drawn (the argmax for a greedy row), and whether its draft is accepted
        (None without drafts). A rejected draft's row draws from p with the draft removed."""
        draft = batch.t["draft"]
        argmax = logits.argmax(dim=-1) if batch.any_greedy else None
        if batch.all_greedy:
            return argmax, (argmax == draft if batch.any_drafts else None)  # a bonus row's draft, -1, never matches
        probs = sampling_probs(logits, batch)
        on_cpu = probs.device.type == "cpu"
        if on_cpu:  # one uniform per row, not a vocabulary of noise (cpu_draw.py)
            draw_u, uniform = self._uniforms(batch)
        else:
            noise, uniform = self._noise(batch)
        accepted = None
        if batch.any_drafts:
            # A draft outside the vocabulary (a draft model's, say) has probability 0.
            valid = (draft >= 0) & (draft < batch.vocab)
            safe = draft.clamp(0, batch.vocab - 1)[:, None]
            p_draft = probs.gather(1, safe)[:, 0]
            # Rows that verify nothing may hold any value in `uniform`: only valid rows can accept.
            accepted = valid & (uniform < p_draft)
            # The residual, p without the draft (renormalising is not needed for the draw below); other
            # rows write back the value that was there.
            probs = probs.scatter(1, safe, torch.where(valid, 0.0, p_draft)[:, None])
        if on_cpu:
            tokens = inverse_cdf(probs, draw_u)
        else:
            # Exponential race: argmax p / q with q ~ Exp(1) is a draw from p, with no host sync.
            tokens = (probs / noise).argmax(dim=-1)
        if argmax is not None:
            greedy = batch.t["greedy"]
            tokens = torch.where(greedy, argmax, tokens)
            if accepted is not None:
                accepted = torch.where(greedy, argmax == draft, accepted)
        return tokens, accepted

    def _process(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Constraints, logits processors, logit bias and penalties, on a copy when there are any."""
        if not batch.needs_clone:
            return logits
        logits = logits.clone(memory_format=torch.contiguous_format)
        # Each row masked by the constraint's state after the drafts before it.
        constrained = [(first, c, d) for r, first, d in zip(batch.requests, batch.firsts, batch.drafts, strict=True)
                       for c in r.constraints]
        apply_constraints(logits, constrained)
        for i, r in enumerate(batch.requests):
            for j, history in enumerate(batch.row_histories(i) if r.logits_processors else ()):
                row = batch.firsts[i] + j
                for proc in r.logits_processors:
                    logits[row] = proc(history, logits[row])
        if batch.any_bias:
            apply_logit_bias(logits, batch.t)
        if batch.any_penalties:
            apply_penalties(logits, batch.t)
        return logits

    def _uniforms(self, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """CPU: per row, the uniform of its draw (float64) and (with drafts) the one of its acceptance test.

        As in _noise, a seeded request's rows draw from its own generator and the other rows share the sampler's,
        drawn in one call in row order: so a seeded request's tokens do not depend on the batch."""
        rows, per_row = batch.num_rows, 2 if batch.any_drafts else 1
        u = torch.empty(rows, per_row, dtype=torch.float64)
        unseeded = len(batch.unseeded_rows)
        if unseeded:
            shared = torch.rand(unseeded, per_row, dtype=torch.float64, generator=self.generator)
            if unseeded == rows:
                u = shared
            else:
                u.index_copy_(0, batch.t["unseeded_rows"], shared)
        for r, first, d in zip(batch.requests, batch.firsts, batch.drafts, strict=True):
            if r.generator is not None:
                u[first : first + len(d) + 1] = torch.rand(len(d) + 1, per_row, dtype=torch.float64,
                                                            generator=r.generator)
        return u[:, 0], (u[:, 1].float() if batch.any_drafts else None)

    def _noise(self, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """GPU: Exp(1) noise per row and vocabulary entry, and (with drafts) one uniform per row.

        A seeded request draws its rows' noise from its own generator, so its tokens do not depend on
        what else is batched; the other rows share the sampler's generator, drawn in one call in row
        order. (Without drafts this is the same stream the sampler has always drawn: a seeded
        request's tokens are the same as before this sampler was batched.)
        """
        dev, rows, vocab = self.device, batch.num_rows, batch.vocab
        noise = torch.empty(rows, vocab, device=dev)
        uniform = torch.empty(rows, device=dev) if batch.any_drafts else None
        unseeded = len(batch.unseeded_rows)
        if unseeded:
            shared = torch.empty(unseeded, vocab, device=dev).exponential_(generator=self.generator)
            shared_u = torch.rand(unseeded, device=dev, generator=self.generator) if uniform is not None else None
            if unseeded == rows:
                noise, uniform = shared, shared_u
            else:
                idx = batch.t["unseeded_rows"]
                noise.index_copy_(0, idx, shared)
                if uniform is not None:
                    uniform.index_copy_(0, idx, shared_u)
        for r, first, d in zip(batch.requests, batch.firsts, batch.drafts, strict=True):
            if r.generator is None:
                continue
            noise[first : first + len(d) + 1].exponential_(generator=r.generator)
            if d:
                assert uniform is not None
                uniform[first : first + len(d) + 1].uniform_(generator=r.generator)
        return noise, uniform


def _accepted_lengths(accepted_rows: torch.Tensor, row_request: torch.Tensor, first_row: torch.Tensor) -> torch.Tensor:
    """Per request, how many of its drafts were accepted before the first rejection: the offset of
    its first row that is not an accepted draft (its bonus row is one, so there always is one)."""
    rows = accepted_rows.shape[0]
    pos = torch.arange(rows, device=accepted_rows.device)
    stop = torch.where(accepted_rows, rows, pos)
    first_stop = torch.full_like(first_row, rows).scatter_reduce_(0, row_request, stop, reduce="amin")
    return first_stop - first_row


def apply_constraints(logits: torch.Tensor, rows: list[tuple[int, TokenConstraint, list[int]]]) -> None:
    """Masks logits in place: one apply_batch call per constraint class, so a class can fill all its
    rows' masks and apply them to the batch in one operation."""
    by_class: dict[type, list[tuple[int, TokenConstraint, list[int]]]] = {}
    for item in rows:
        by_class.setdefault(type(item[1]), []).append(item)
    for cls, items in by_class.items():
        cls.apply_batch(logits, items)
