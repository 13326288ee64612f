"""The output processor (output_processor.py): token deltas from the engine core to text deltas, stop strings
found in the text, and what the core is told when it made tokens past one (it runs a step behind when it
is another process)."""

from __future__ import annotations

import pytest

from sluice_engine.engine.output import RequestOutput
from sluice_engine.engine.output_processor import OutputProcessor
from sluice_engine.sampling_params import SamplingParams
from sluice_engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def _deltas(tokenizer: Tokenizer, text: str, per_delta: int) -> list[list[int]]:
    ids = tokenizer.encode(text)
    return [ids[i : i + per_delta] for i in range(0, len(ids), per_delta)]


def _run(tokenizer, params, deltas, finish_last: str | None = None):
    """Feed the deltas as the core would send them; return (text, tokens, outputs, finish calls)."""
    finished: list[tuple[str, str]] = []
    proc = OutputProcessor(tokenizer, lambda rid, s: finished.append((rid, s)))
    proc.add("r", tokenizer.encode("Hello"), params)
    outs, n = [], 0
    for i, ids in enumerate(deltas):
        n += len(ids)
        last = i == len(deltas) - 1
        o = RequestOutput("r", list(ids), "", [(-0.5, [])] * len(ids), finished=last and finish_last is not None,
                          finish_reason=finish_last if last else None, num_prompt_tokens=2, num_output_tokens=n)
        got = proc.process(o)
        if got is not None:
            outs.append(got)
    return "".join(o.new_text for o in outs), [t for o in outs for t in o.new_token_ids], outs, finished


@pytest.mark.parametrize("per_delta", [1, 3])
def test_text_is_the_tokenizers_decode_of_the_tokens(tokenizer, per_delta) -> None:
    text = "Paris is the capital of France — café, naïve, 東京, emoji 🎉 done."
    got, tokens, outs, finished = _run(tokenizer, SamplingParams(max_tokens=100), _deltas(tokenizer, text, per_delta),
                                       "length")
    assert got == tokenizer.decode(tokenizer.encode(text)) and finished == []
    assert outs[-1].finished and outs[-1].finish_reason == "length"


@pytest.mark.parametrize("per_delta", [1, 2, 5])
def test_a_stop_string_cuts_the_text_drops_later_tokens_and_tells_the_core(tokenizer, per_delta) -> None:
    text = "one, two, three, four, five, six, seven"
    deltas = _deltas(tokenizer, text, per_delta)
    got, tokens, outs, finished = _run(tokenizer, SamplingParams(max_tokens=100, stop=[", fo"]), deltas)
    assert got == "one, two, three"
    assert outs[-1].finished and (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", ", fo")
    assert finished == [("r", ", fo")]  # the core had not ended it
    # The client's tokens end at the one that completed the stop string; the usage counts them alone.
    assert tokenizer.decode(tokens).startswith("one, two, three, fo") and outs[-1].num_output_tokens == len(tokens)
    assert len(outs[-1].logprobs) == len(outs[-1].new_token_ids)
    # Deltas the core made before it heard of the stop are dropped: nothing follows the finished delta.
    assert [o.finished for o in outs].index(True) == len(outs) - 1


def test_the_stop_string_is_kept_when_asked(tokenizer) -> None:
    got, *_ = _run(tokenizer, SamplingParams(max_tokens=100, stop=["three"], include_stop_str_in_output=True),
                   _deltas(tokenizer, "one two three four", 1))
    assert got == "one two three"


def test_text_that_may_begin_a_stop_string_is_held_back(tokenizer) -> None:
    finished: list = []
    proc = OutputProcessor(tokenizer, lambda rid, s: finished.append(s))
    proc.add("r", [1], SamplingParams(max_tokens=100, stop=["STOP HERE"]))
    ids = tokenizer.encode("abc STOP")
    out = proc.process(RequestOutput("r", ids, "", [], False, num_output_tokens=len(ids)))
    assert "STOP" not in out.new_text  # 8 chars could still become "STOP HERE"
    more = tokenizer.encode(" now")
    out2 = proc.process(RequestOutput("r", more, "", [], True, "length", num_output_tokens=len(ids) + len(more)))
    assert out.new_text + out2.new_text == tokenizer.decode(ids + more) and finished == []


def test_a_stop_token_is_left_out_of_the_text_and_needs_no_word_to_the_core(tokenizer) -> None:
    eos = min(tokenizer.eos_token_ids)
    ids = tokenizer.encode("fine")
    finished: list = []
    proc = OutputProcessor(tokenizer, lambda rid, s: finished.append(s))
    proc.add("r", [1], SamplingParams(max_tokens=100, stop=["zzz"], skip_special_tokens=False))
    out = proc.process(RequestOutput("r", [*ids, eos], "", [], True, "stop", num_output_tokens=len(ids) + 1))
    assert out.new_text == "fine" and finished == [] and out.finish_reason == "stop"


def test_an_error_delta_passes_through_and_unknown_requests_are_dropped(tokenizer) -> None:
    proc = OutputProcessor(tokenizer, lambda rid, s: None)
    err = RequestOutput("gone", [], "", [], True, "error", error="RuntimeError: x")
    assert proc.process(err) is err
    assert proc.process(RequestOutput("never-added", [5], "", [], False)) is None
