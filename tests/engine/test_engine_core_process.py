"""The engine core in its own process (core_process.py): the messages it speaks, the same tokens as the engine in
a thread, and its lifecycle with the API process (it stops with it; its death stops the server)."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from servers import engine_core_pid, process_gone

from sluice_engine.engine.messages import (
    AbortRequest,
    AddRefused,
    AddRequest,
    CoreDead,
    CoreOutputs,
    CoreReady,
    RequestFailedError,
    Shutdown,
    command_codec,
    core_message_codec,
    refusal,
    refusal_error,
)
from sluice_engine.engine.model_info import RequestRejected
from sluice_engine.engine.output import RequestOutput
from sluice_engine.metrics import StatsSnapshot
from sluice_engine.omp_wait import SPIN_COUNT, default_omp_wait
from sluice_engine.sampling_params import InvalidParam, SamplingParams
from sluice_engine.structured.grammar import GrammarSpec


# -- libgomp's wait policy ---------------------------------------------------------------------------
def test_a_short_spin_is_the_default_and_the_users_choice_wins() -> None:
    env: dict[str, str] = {}
    assert default_omp_wait(env) and env == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    for chosen in ({"OMP_WAIT_POLICY": "active"}, {"OMP_WAIT_POLICY": "passive"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(chosen)
        assert not default_omp_wait(env) and env == chosen


# -- the messages --------------------------------------------------------------------------------------
def test_commands_round_trip_as_typed_structs() -> None:
    enc, dec = command_codec()
    params = SamplingParams(max_tokens=7, temperature=0.5, stop=["\n"], stop_token_ids=[2], logit_bias={5: -100.0},
                            logprobs=3, seed=11)
    sent = [AddRequest("r-0", [1, 2, 3], params, 12.5, GrammarSpec("json_schema", '{"type":"object"}', "response_format")),
            AbortRequest("r-0", 13.0), Shutdown()]
    for msg in sent:
        assert dec.decode(enc.encode(msg)) == msg


def test_a_command_of_another_shape_is_refused_not_misread() -> None:
    import msgspec

    _, dec = command_codec()
    with pytest.raises(msgspec.ValidationError):
        dec.decode(msgspec.msgpack.encode(["add", "r-0", "not a token list", {}, 1.0, None]))
    # SamplingParams' own checks run on decode too: a core never takes params the API could not have made.
    with pytest.raises(msgspec.ValidationError, match="max_tokens must be at least 1"):
        dec.decode(msgspec.msgpack.encode(["add", "r-0", [1], {"max_tokens": 0}, 1.0, None]))


def test_outputs_carry_deltas_refusals_and_the_stats_snapshot() -> None:
    enc, dec = core_message_codec()
    snap = StatsSnapshot.zero()
    snap.histograms["ttft"].observe(0.25)
    out = RequestOutput("r-1", [5, 6], "hi", [(-0.1, [(5, -0.1), (7, -2.0)]), (-0.3, [])], False, None, None, 4, 2, 0)
    msg = CoreOutputs([out], [refusal("r-2", RequestRejected("max_tokens", "too long", "context_length_exceeded"))],
                      snap)
    back = dec.decode(enc.encode(msg))
    assert back.outputs == [out]
    assert back.stats.histograms["ttft"].counts == snap.histograms["ttft"].counts
    assert back.stats.histograms["ttft"].sum == 0.25
    assert back.stats == snap or back.stats.generation_tokens == snap.generation_tokens
    ready = CoreReady("m", "/models/m", 8192, 49152, [0, 2], snap)
    info = dec.decode(enc.encode(ready)).model_info()
    assert (info.max_model_len, info.vocab_size, info.eos_token_ids) == (8192, 49152, frozenset({0, 2}))
    assert dec.decode(enc.encode(CoreDead("boom", config_error=True))) == CoreDead("boom", True)


@pytest.mark.parametrize("error, cls, param, code", [
    (RequestRejected("prompt", "prompt is empty", "empty_prompt"), RequestRejected, "prompt", "empty_prompt"),
    (InvalidParam("seed", "seed 3 is not usable"), InvalidParam, "seed", None),
    (ValueError("request id 'x' is already in flight"), ValueError, None, None),
    (RuntimeError("kaput"), RequestFailedError, None, None),
])
def test_a_refused_add_is_raised_again_as_the_same_class_naming_its_field(error, cls, param, code) -> None:
    r = refusal("r", error)
    enc, dec = core_message_codec()
    back: AddRefused = dec.decode(enc.encode(CoreOutputs([], [r], None))).refused[0]
    again = refusal_error(back)
    assert type(again) is cls and getattr(again, "param", None) == param and getattr(again, "code", None) == code
    assert str(error) in str(again)


# -- served -------------------------------------------------------------------------------------------
def _complete(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": "smollm2", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


BODIES = [
    {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0},
    {"prompt": "Count: one, two,", "max_tokens": 24, "temperature": 0, "stop": [" five"]},
    {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.9, "seed": 7, "n": 2, "logprobs": 2},
    {"prompt": "A JSON object about a cat:", "max_tokens": 40, "temperature": 0,
     "response_format": {"type": "json_schema", "json_schema": {"name": "cat", "schema": {
         "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
         "required": ["name", "age"]}}}},
]


@pytest.mark.slow
def test_the_core_process_serves_what_the_engine_thread_serves(start_server) -> None:
    from concurrent.futures import ThreadPoolExecutor

    # The two servers start side by side, and each body goes to both at once (one request at a time per server).
    # The second has the default flags: an engine-core process.
    with ThreadPoolExecutor(2) as pool:
        in_process, core = pool.map(lambda flags: start_server(*flags), [("--no-engine-process",), ()])
        for body in BODIES:
            a, b = pool.map(lambda url, body=body: _complete(url, body), [in_process.url, core.url])
            assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]], body
            assert [c["finish_reason"] for c in a["choices"]] == [c["finish_reason"] for c in b["choices"]]
            assert [c["logprobs"] for c in a["choices"]] == [c["logprobs"] for c in b["choices"]]
            assert a["usage"] == b["usage"]
    # The refusals keep their field: a prompt past the window is refused by the API, a bad seed by the core's
    # request checks (it needs the device's generator).
    r = httpx.post(f"{core.url}/v1/completions", timeout=30,
                   json={"model": "smollm2", "prompt": "hi", "max_tokens": 100000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    m = core.metrics()
    assert m["sluice_request_success_total"] >= len(BODIES) + 1  # n=2 counts twice
    assert m["sluice_num_requests_running"] == 0


@pytest.mark.slow
def test_a_killed_api_process_takes_its_core_with_it(start_server) -> None:
    server = start_server()
    core = engine_core_pid(server)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    assert process_gone(core, 10), "the engine core outlived the API process"


@pytest.mark.slow
def test_sigterm_stops_the_core_in_order(start_server) -> None:
    server = start_server()
    core = engine_core_pid(server)
    # The API process serves plain requests without torch (the core holds the model): ~0.5 GiB less per server.
    _complete(server.url, BODIES[0])
    with open(f"/proc/{server.proc.pid}/maps") as f:
        assert "libtorch" not in f.read(), "the API process loaded torch"
    # The core's OpenMP threads sleep after a short spin (omp_wait.py) unless the user chose a wait policy.
    with open(f"/proc/{core}/environ", "rb") as f:
        core_env = f.read().split(b"\0")
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        assert f"GOMP_SPINCOUNT={SPIN_COUNT}".encode() in core_env
    server.proc.terminate()
    assert server.proc.wait(timeout=30) == 0
    assert process_gone(core, 10)
