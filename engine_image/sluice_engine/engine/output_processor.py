"""Token deltas to text deltas: detokenization and stop strings, on the API side of the engine.

The engine core works in tokens: it appends each step's tokens and stops a request on an end-of-sequence or
stop token or at its length limit. Text is made here, as vLLM V1's output processor makes it, so the core's
step never waits on detokenization. A stop string is text, so it is found here too: the request's output is
cut at it (the tokens after it dropped) and the core is told to finish the request (`finish`), which it does
at once when it runs in this process (`LLMEngine.step`) and a step or so later when it runs in its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..sampling_params import SamplingParams
from ..tokenizer import IncrementalDetokenizer, Tokenizer
from .output import RequestOutput


@dataclass(slots=True)
class _TextState:
    params: SamplingParams
    detok: IncrementalDetokenizer
    text: str = ""
    emitted: int = 0  # chars of `text` already sent
    dropped: int = 0  # tokens the core made past a stop string (it learns of the stop late): not the client's


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, finish: Callable[[str, str], None], timed: bool = False):
        """finish(request_id, stop_string): tell the engine core the request hit a stop string. timed (tracing
        on): each request's time here is summed and set on its last delta (RequestOutput.detokenize_seconds)."""
        self.tokenizer = tokenizer
        self.finish = finish
        self._states: dict[str, _TextState] = {}
        self._seconds: dict[str, float] = {}
        if timed:  # chosen once: untimed, process() is the plain method and costs nothing more
            self._untimed = self.process
            self.process = self._timed_process

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._states[request_id] = _TextState(
            params, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens))

    def drop(self, request_id: str) -> None:
        """The request ended otherwise (aborted, refused, failed): forget its text."""
        self._states.pop(request_id, None)
        self._seconds.pop(request_id, None)

    def _timed_process(self, out: RequestOutput) -> RequestOutput | None:
        t0 = time.perf_counter()
        res = self._untimed(out)
        seconds = self._seconds.get(out.request_id, 0.0) + time.perf_counter() - t0
        if res is not None and res.finished:
            self._seconds.pop(out.request_id, None)
            res.detokenize_seconds = seconds
        elif out.request_id in self._states:
            self._seconds[out.request_id] = seconds
        return res

    def process(self, out: RequestOutput) -> RequestOutput | None:
        """The core's token delta as a text delta (written into `out`); None for a delta of a request that
        already ended here at a stop string (tokens the core made before it heard)."""
        if out.error is not None:  # the request failed in the core: its error goes out as it is
            self._states.pop(out.request_id, None)
            return out
        state = self._states.get(out.request_id)
        if state is None:
            return None
        p = state.params
        text = state.text
        n = len(out.new_token_ids)
        stop_string: str | None = None
        kept = n
        for i, token in enumerate(out.new_token_ids):
            last = i == n - 1
            # The core ends a request only at the last token of a delta: a stop token (reason "stop") or the
            # length limit; the text of a stop token is left out unless asked for.
            stop_token = last and out.finished and out.finish_reason == "stop"
            if not stop_token or p.include_stop_str_in_output:
                text += state.detok.step([token])
            if last and out.finished:
                text += state.detok.flush()  # a character still split across bytes, if any
            if p.stop and not stop_token:
                hit = _find_stop(text, p.stop, state.emitted)
                if hit is not None:
                    idx, stop_string = hit
                    text = text[: idx + len(stop_string)] if p.include_stop_str_in_output else text[:idx]
                    kept = i + 1
                    break
        if stop_string is not None:
            if not (out.finished and kept == n):  # the core had not ended it: it must learn of the stop
                self.finish(out.request_id, stop_string)
            state.dropped += n - kept
            out.new_token_ids = out.new_token_ids[:kept]
            out.logprobs = out.logprobs[:kept] if out.logprobs else out.logprobs
            out.finished, out.finish_reason, out.stop_reason = True, "stop", stop_string
        out.num_output_tokens -= state.dropped
        state.text = text
        if out.finished:
            new_text = text[state.emitted :]
            self._states.pop(out.request_id, None)
        else:
            # Hold back a tail that could still turn out to be the start of a stop string.
            hold = max((len(s) for s in p.stop), default=1) - 1
            new_text = text[state.emitted : max(state.emitted, len(text) - hold)]
        state.emitted += len(new_text)
        out.new_text = new_text
        return out


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """The earliest stop string in text[start:], as (index, stop string)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
