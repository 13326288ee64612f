"""A step's sampled tokens applied to their request: appended (its grammars told), their logprobs kept, and
whether an end-of-sequence or stop token or the length limit ends the request. Tokens only: the text (and stop
strings) are the output processor's (engine/output_processor.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.request import FinishReason, Request
from ..sample.token_logprobs import TokenLogprobs


@dataclass(slots=True)
class AppliedTokens:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish: FinishReason | None = None
    stop_reason: int | None = None  # the stop token (of params.stop_token_ids) that ended it


def apply_tokens(req: Request, token_ids: list[int], logprobs: list, max_model_len: int) -> AppliedTokens:
    p = req.params
    out = AppliedTokens()
    for token, lp in zip(token_ids, logprobs, strict=True):
        req.append_output_token(token)
        for c in req.constraints:
            c.accept(token)
        out.token_ids.append(token)
        if lp is not None:
            out.logprobs.append(lp)
        if (not p.ignore_eos and token in req.eos_token_ids) or token in p.stop_token_ids:
            out.finish, out.stop_reason = FinishReason.STOP, (token if token in p.stop_token_ids else None)
        elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= max_model_len:
            out.finish = FinishReason.LENGTH
        if out.finish is not None:
            break  # accepted drafts after the end are dropped
    return out
