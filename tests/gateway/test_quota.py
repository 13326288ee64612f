"""Tenants and their limits, offline: the keys file's `tenants`, the sliding windows (admit, settle, peers'
counts, Retry-After), the reservation, and reading `usage` out of answers as they pass (usage_tap.py)."""

from __future__ import annotations

import json

import pytest

from sluice_autoscaler.auth import ApiKeys, parse_keys
from sluice_autoscaler.quota import (
    ALL_ENDPOINTS,
    Limits,
    Refusal,
    Ticket,
    UsageBoard,
    parse_snapshot,
    reservation,
)
from sluice_autoscaler.usage_tap import UsageTap, wants_usage

KEYS = """
keys:
  default/other: [sk-other]
tenants:
  team-a:
    keys: [sk-a]
    limits: {requestsPerMinute: 100, tokensPerMinute: 1000}
    endpoints:
      default/smollm2: {tokensPerMinute: 500}
  team-b:
    keys: [sk-b1, sk-b2]
endpointLimits:
  default/smollm2: {requestsPerMinute: 50}
"""


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_tenants_file_opens_endpoints_and_names_the_tenant(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS)
    keys = ApiKeys(str(path))
    assert set(keys.tenants) == {"team-a", "team-b"}
    # team-a's keys open only the endpoints it lists; team-b's (no `endpoints`) open every endpoint.
    assert keys.check("default/smollm2", "smollm2", "Bearer sk-a") is None
    assert keys.check("default/other", "other", "Bearer sk-a") is not None
    assert keys.check("default/other", "other", "Bearer sk-b2") is None
    assert keys.tenant("Bearer sk-b2").name == "team-b"
    assert keys.tenant("Bearer sk-other") is None  # a key outside `tenants`
    a, b = keys.tenants["team-a"], keys.tenants["team-b"]
    assert a.scoped_limits("default/smollm2", "smollm2") == [(ALL_ENDPOINTS, Limits(100, 1000)),
                                                             ("default/smollm2", Limits(None, 500))]
    # team-b has no limit of its own on the endpoint: the endpoint's default for every tenant applies.
    assert b.scoped_limits("default/smollm2", "smollm2")[1] == ("default/smollm2", Limits(50, None))
    assert b.scoped_limits("default/other", "other") == [(ALL_ENDPOINTS, Limits())]


@pytest.mark.parametrize("text, message", [
    ("tenants: {Team: {keys: [k]}}", "tenant name 'Team'"),
    ("tenants: {none: {keys: [k]}}", "not 'none'"),
    ("tenants: {a: {keys: [k]}, b: {keys: [k]}}", "share a key"),
    ("tenants: {a: {keys: [k], limits: {tokensPerMinute: 0}}}", "tenants.a.limits.tokensPerMinute"),
    ("tenants: {a: {keys: [k], limits: {tokensPerHour: 5}}}", "unknown limits ['tokensPerHour']"),
    ("tenants: {a: {keys: [k], quota: 5}}", "unknown entries ['quota']"),
    ("tenants: {a: {keys: [k], endpoints: [x]}}", "tenants.a.endpoints"),
    ("endpointLimits: {x: {requestsPerMinute: -1}}", "endpointLimits.x.requestsPerMinute"),
])
def test_bad_tenants_are_refused_naming_the_field(text, message):
    with pytest.raises(ValueError, match=None) as e:
        parse_keys(text)
    assert message in str(e.value)
    assert "k]" not in str(e.value)  # key material is never quoted


def test_a_request_is_admitted_while_its_reservation_fits_and_settles_to_what_it_used():
    clock = Clock()
    board = UsageBoard(clock)
    lim = [(ALL_ENDPOINTS, Limits(tokens_per_minute=100))]
    t1 = board.admit("a", lim, 60)
    assert isinstance(t1, Ticket)
    refused = board.admit("a", lim, 60)  # 60 reserved + 60 > 100
    assert isinstance(refused, Refusal) and refused.limit == "tokens" and refused.used == 60
    assert "tokensPerMinute limit 100" in refused.message and refused.retry_after == 60
    board.settle(t1, 10)  # it used 10: the window has room again
    assert board.used("a", ALL_ENDPOINTS, int(clock.t))[1] == 10
    clock.t += 1
    assert isinstance(board.admit("a", lim, 60), Ticket)
    # The window slides: 60 s after the first second, its tokens no longer count.
    clock.t += 59
    assert board.used("a", ALL_ENDPOINTS, int(clock.t))[1] == 60
    too_big = board.admit("a", lim, 500)
    assert isinstance(too_big, Refusal) and "more than the limit" in too_big.message


def test_requests_per_minute_and_retry_after_from_the_oldest_bucket():
    clock = Clock()
    board = UsageBoard(clock)
    lim = [(ALL_ENDPOINTS, Limits(requests_per_minute=3))]
    for dt in (0, 10, 20):
        clock.t += dt and 10
        assert isinstance(board.admit("a", lim, 1), Ticket)
    refused = board.admit("a", lim, 1)
    assert isinstance(refused, Refusal) and refused.limit == "requests"
    assert refused.retry_after == 40  # the first request (20 s ago) leaves the window in 40 s
    assert "requestsPerMinute limit 3" in refused.message
    # Another tenant is not affected.
    assert isinstance(board.admit("b", lim, 1), Ticket)


def test_a_refused_scope_admits_nothing_in_the_others():
    board = UsageBoard(Clock())
    lims = [(ALL_ENDPOINTS, Limits(tokens_per_minute=1000)), ("ep", Limits(tokens_per_minute=10))]
    assert isinstance(board.admit("a", lims, 50), Refusal)
    assert board.used("a", ALL_ENDPOINTS, 1_000_000)[:2] == (0, 0)


def test_peers_windows_count_and_travel_as_json():
    clock = Clock()
    one, two = UsageBoard(clock), UsageBoard(clock)
    lim = [(ALL_ENDPOINTS, Limits(tokens_per_minute=100))]
    assert isinstance(one.admit("a", lim, 70), Ticket)
    one.admit("ghost", lim, 5)
    snapshot = json.loads(json.dumps(one.local_snapshot()))
    two.set_peer("http://one", parse_snapshot(snapshot, ["a"]))  # "ghost" is not a tenant replica two knows
    assert set(two.peers["http://one"]) == {("a", ALL_ENDPOINTS)}
    refused = two.admit("a", lim, 40)
    assert isinstance(refused, Refusal) and refused.used == 70
    two.set_peer("http://one", None)  # the peer left: its counts go with it
    assert isinstance(two.admit("a", lim, 40), Ticket)
    for bad in ([], {"a": [[1, 2]]}, {"a\t*": "x"}, {"a\t*": [[1, 2, True]]}, {"a\t*": [[1, 1, 1]] * 62}):
        with pytest.raises(ValueError):
            parse_snapshot(bad, ["a"])


def test_reservation_is_the_prompt_estimate_plus_what_may_be_generated():
    assert reservation({"max_tokens": 10}, 400) == 110
    assert reservation({"max_completion_tokens": 10, "n": 3}, 40) == 40
    assert reservation({}, 4) == 1 + 256  # no max_tokens: the default assumption
    assert reservation({"max_tokens": "x", "n": True}, 4) == 257


def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def engine_stream(include_usage: bool) -> bytes:
    """As the engine writes it (serving.py: `usage` last, null in every chunk, then a usage chunk)."""
    chunks = []
    for text in ("Hel", "lo"):
        body = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
        if include_usage:
            body["usage"] = None
        chunks.append(sse(body))
    if include_usage:
        chunks.append(sse({"id": "x", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2,
                                                               "total_tokens": 9}}))
    return b"".join(chunks) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("split", [1, 3, 7, 1000])
def test_tap_takes_out_the_usage_the_client_did_not_ask_for(split):
    stream = engine_stream(include_usage=True)
    tap = UsageTap(strip=True)
    tap.start("text/event-stream; charset=utf-8")
    out = b"".join(tap.feed(stream[i:i + split]) for i in range(0, len(stream), split)) + tap.flush()
    assert out == engine_stream(include_usage=False)
    assert (tap.usage.prompt, tap.usage.completion) == (7, 2)


def test_tap_leaves_a_stream_that_asked_for_usage_as_it_is():
    stream = engine_stream(include_usage=True)
    tap = UsageTap(strip=False)
    tap.start("text/event-stream")
    assert tap.feed(stream[:50]) + tap.feed(stream[50:]) + tap.flush() == stream
    assert tap.usage.total == 9


def test_tap_reads_a_json_answers_usage_and_counts_chunks_of_a_cut_stream():
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()
    tap = UsageTap(strip=False)
    tap.start("application/json")
    assert tap.feed(body[:5]) + tap.feed(body[5:]) == body
    tap.flush()
    assert tap.usage.total == 7
    cut = UsageTap(strip=True)
    cut.start("text/event-stream")
    cut.feed(engine_stream(include_usage=True)[:-60])
    assert cut.usage is None and cut.events == 2


def test_wants_usage_asks_only_when_the_client_did_not():
    body = {"stream": True, "stream_options": {"continuous_usage_stats": False}}
    assert wants_usage(body) and body["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert not wants_usage({"stream_options": {"include_usage": True}})
