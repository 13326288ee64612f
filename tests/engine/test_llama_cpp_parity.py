"""The pure parts of benchmarks/llama_cpp_parity.py: llama-perplexity's chunking and scoring, and the
first-difference / logprob-margin helpers of the greedy comparison. No servers."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import llama_cpp_parity as parity  # noqa: E402


def test_first_difference():
    assert parity.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert parity.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert parity.first_difference([7, 2], [1, 2]) == 0
    # one stopped early (EOS) and the other did not: the first position only one of them has
    assert parity.first_difference([1, 2], [1, 2, 3]) == 2
    assert parity.first_difference([], []) is None


def test_margin():
    assert parity.margin([-0.5, -2.0]) == pytest.approx(1.5)
    assert parity.margin([-3.0, -0.25, -1.0]) == pytest.approx(0.75)  # any order: top-1 minus top-2
    assert parity.margin([-0.1]) is None
    assert parity.margin(None) is None


def test_chunks_follow_llama_perplexity():
    tokens = list(range(100, 113))  # 13 tokens, n_ctx 6: floor(13 / 6) = 2 chunks, the tail dropped
    assert parity.perplexity_chunks(tokens, 6) == [[100, 101, 102, 103, 104, 105], [106, 107, 108, 109, 110, 111]]
    # a vocab that adds BOS: the first token of each chunk becomes BOS (not inserted)
    assert parity.perplexity_chunks(tokens, 6, bos=1) == [[1, 101, 102, 103, 104, 105], [1, 107, 108, 109, 110, 111]]
    with pytest.raises(ValueError):
        parity.perplexity_chunks(tokens[:11], 6)  # fewer than 2 * n_ctx tokens


def test_scoring_by_hand():
    # n_ctx 6: first = 3, so the logits at positions 3 and 4 score tokens 4 and 5 (6 - 3 - 1 = 2 per chunk).
    a = [None, -9.0, -9.0, -9.0, -1.0, -2.0]  # positions 1..3 are not scored, whatever they hold
    b = [None, -9.0, -9.0, -9.0, -0.5, -0.5, -7.0]  # an echo's extra generated entry is ignored
    assert parity.chunk_nll(a, 6) == (3.0, 2)
    assert parity.chunk_nll(b, 6) == (1.0, 2)
    assert parity.perplexity([a, b], 6) == pytest.approx(math.exp((3.0 + 1.0) / 4))
    # n_ctx 512, llama-perplexity's default: 255 scored per chunk
    assert parity.chunk_nll([None] + [-1.0] * 511, 512) == (255.0, 255)
    with pytest.raises(ValueError):
        parity.chunk_nll([None, -1.0, -1.0, -1.0, None, -1.0], 6)  # a scored position without a logprob


def test_parse_llama_perplexity():
    out = ("perplexity: calculating perplexity over 8 chunks, n_ctx=512, batch_size=512, n_seq=1\n"
           "[1]12.3,[2]13.4,\nFinal estimate: PPL = 13.4567 +/- 0.41234\n")
    assert parity.parse_llama_perplexity(out) == (13.4567, 8)


def test_compare_reports_margins_at_first_difference():
    a = parity.Generation([5, 6, 7], [{5: -0.1, 9: -3.0}, {6: -0.6, 8: -0.7}, {7: -0.2, 1: -2.0}], "length")
    b = parity.Generation([5, 8, 2], [{5: -0.1, 9: -3.1}, {8: -0.65, 6: -0.66}, {2: -0.1, 3: -3.0}], "stop")
    r = parity.compare(0, "text", "a prompt", 4, a, b)
    assert not r.identical and r.diff_pos == 1 and (r.llama_token, r.sluice_token) == (6, 8)
    assert r.llama_margin == pytest.approx(0.1) and r.sluice_margin == pytest.approx(0.01)
    assert r.note == "same top-2, order swapped"
    assert r.max_top1_delta == pytest.approx(0.0)  # position 0: -0.1 on both
    same = parity.compare(1, "text", "p", 4, a, a)
    assert same.identical and same.diff_pos is None and same.max_top1_delta == 0.0
