"""KV transfer as an attacker with network reach to a pod meets it (issue 39, docs/security.md), real `sluice serve`
processes on 127.0.0.1. Each case was a finding on the code before: blocks pushed without any credential under a
prompt's names were taken and its answer turned to garbage; 100 connections announcing a 16 MiB header grew the
decode engine by 1.6 GiB; a client's push_to made the engine connect where the client said.

- Poisoning: blocks pushed under a prompt's very names (the attacker is even granted the names, which the keyed
  hash keeps from it) without the key, or with another endpoint's, are refused; the answers stay exactly those of a
  colocated engine. The control: the same garbage sealed with the right key is taken and changes the answer, so
  the check can see a poisoning.
- Exhaustion: 200 connections with hostile headers leave the engine-core process's RSS within 64 MiB of before,
  the engine healthy and the receiver taking a real batch afterwards.
- SSRF: a client's push_to (no hop token, a token for another target, or made with another key) is a 400 naming the
  field, and the listener it named sees no connection.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import httpx
import pytest
import torch
from servers import engine_core_pid, free_port, rss_mib

from sluice_engine.core.kv_cache import hash_block
from sluice_engine.kv_transfer.channel import _HELLO, MAGIC, PLAIN, SEALED, VERSION
from sluice_engine.kv_transfer.keys import KVKey
from sluice_engine.kv_transfer.tcp import push_blocks
from sluice_engine.kv_transfer.wire import BlockBatch, KVLayout

pytestmark = pytest.mark.slow

SECRET = "a7" * 32
KEY = KVKey(SECRET.encode())
# The served layout of `--quantization none` on CPU: float32 KV, SmolLM2's 30 layers x 3 KV heads x 64.
LAYOUT = KVLayout("smollm2", "float32", 16, 30, 3, 64)
PROMPT_IDS = [100 + (i * 37) % 4000 for i in range(14 * 16 + 5)]  # 14 full blocks and a tail


@pytest.fixture(scope="module")
def key_args(tmp_path_factory) -> tuple[str, ...]:
    path = tmp_path_factory.mktemp("kv") / "kv-secret"
    path.write_text(SECRET + "\n")
    return ("--kv-secret-file", str(path))


@pytest.fixture(scope="module")
def decode(start_server, key_args):
    kv_port = free_port()
    server = start_server("--quantization", "none", "--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                          "--kv-role", "decode", "--kv-host", "127.0.0.1", "--kv-port", str(kv_port),
                          "--kv-offload-bytes", "128MiB", *key_args)
    server.kv_port = kv_port
    return server


def answer(server, ids: list[int]) -> tuple[list[str], list[float]]:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": server.model, "prompt": ids, "max_tokens": 8, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def metrics_when(server, cond, timeout: float = 15.0) -> dict[str, float]:
    """The server's metrics once `cond` holds of them (an idle engine publishes within a tick or two)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if cond(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def names_of(ids: list[int], key: KVKey) -> list[int]:
    out, parent = [], key.names_root()
    for i in range(len(ids) // 16):
        parent = hash_block(parent, ids[i * 16 : (i + 1) * 16])
        out.append(parent)
    return out


def garbage(names: list[int]) -> BlockBatch:
    return BlockBatch(LAYOUT, names, torch.full((len(names), *LAYOUT.block_shape()), 7.0))


def test_blocks_pushed_without_the_key_are_refused_and_answers_stay_exact(decode, start_server, key_args):
    alone = start_server("--quantization", "none", "--max-model-len", "1024", "--kv-cache-memory", "64MiB")
    names = names_of(PROMPT_IDS, KEY)  # granted to the attacker: without the key it could not compute them
    for key in (None, KVKey(b"x" * 32)):
        with pytest.raises((ValueError, OSError)):
            push_blocks("127.0.0.1", decode.kv_port, garbage(names), key, timeout=10)
    m = metrics_when(decode, lambda m: m["sluice_kv_receiver_refusals_total"] >= 2)
    assert m["sluice_kv_receiver_refusals_total"] == 2 and m.get("sluice_kv_offload_blocks_used", 0) == 0
    want = answer(alone, PROMPT_IDS)
    got = answer(decode, PROMPT_IDS)
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)
    # The control: sealed with the endpoint's key, the same garbage under another prompt's names is taken and
    # turns that prompt's answer (the check above would have seen a poisoning).
    other = [i + 1 for i in PROMPT_IDS]
    assert push_blocks("127.0.0.1", decode.kv_port, garbage(names_of(other, KEY)), KEY, timeout=10) == 14
    time.sleep(0.5)
    assert answer(decode, other)[0] != answer(alone, other)[0]


def hostile(port: int, kind: int, held: list[socket.socket]) -> None:
    """One attacker connection: announces a huge header, a maximal one that never comes, or a forged one."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:
        return
    held.append(s)
    try:
        if kind == 0:  # 16 MiB header announced, then silence
            s.sendall(_HELLO.pack(MAGIC, VERSION, SEALED, b"\0" * 16) + struct.pack(">I", 16 << 20))
        elif kind == 1:  # the largest header allowed announced, a few bytes of it, then silence
            s.sendall(_HELLO.pack(MAGIC, VERSION, SEALED, b"\0" * 16) + struct.pack(">I", (256 << 10) + 16) + b"{")
        elif kind == 2:  # unsealed, a header naming a huge batch
            s.sendall(_HELLO.pack(MAGIC, VERSION, PLAIN, b"\0" * 16) + struct.pack(">I", 60)
                      + b'{"layout": {}, "names": [1], "nbytes": 99999999999999}'.ljust(60))
        else:  # the old protocol's 8-byte length
            s.sendall(struct.pack(">Q", 16 << 20) + b"{" * 100)
    except OSError:
        pass


def test_hostile_connections_leave_the_receiver_bounded_and_serving(decode, probe, assert_settled):
    before_text = probe(decode)
    pid = engine_core_pid(decode)
    before = rss_mib(pid)
    held: list[socket.socket] = []
    threads = [threading.Thread(target=hostile, args=(decode.kv_port, i % 4, held)) for i in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(1.0)
    during = rss_mib(pid)
    for s in held:
        s.close()
    refusals = metrics_when(decode, lambda m: m["sluice_kv_receiver_refusals_total"] >= 150)[
        "sluice_kv_receiver_refusals_total"]
    print(f"engine core RSS: {before:.1f} MiB before, {during:.1f} MiB with 200 hostile connections; "
          f"{refusals:.0f} refusals")
    assert during - before < 64
    assert refusals >= 150  # most closed at once (connections over the cap) or refused on their header
    assert_settled(decode, before_text)
    # A real batch is taken afterwards (the cap's slots are free again).
    names = names_of([5 + i for i in range(48)], KEY)
    deadline = time.monotonic() + 30
    while True:
        try:
            assert push_blocks("127.0.0.1", decode.kv_port, garbage(names), KEY, timeout=10) == len(names)
            break
        except ValueError as e:  # busy while the last attackers' connections are reaped
            assert "busy" in str(e) and time.monotonic() < deadline


def test_a_client_push_to_makes_no_connection(start_server, key_args):
    prefill = start_server("--max-model-len", "512", "--kv-role", "prefill", *key_args)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    target = f"127.0.0.1:{listener.getsockname()[1]}"
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    threading.Thread(target=count, daemon=True).start()
    prompt = " ".join(f"word{j % 11}" for j in range(80))
    try:
        for params in ({"push_to": target},
                       {"push_to": target, "hop_token": KEY.hop_token("10.0.0.9:8100")},
                       {"push_to": target, "hop_token": KVKey(b"z" * 32).hop_token(target)},
                       {"push_to": target, "hop_token": KEY.hop_token(target, now=time.time() - 3600)}):
            r = httpx.post(f"{prefill.url}/v1/completions", timeout=60, json={
                "model": prefill.model, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": params})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "kv_transfer_params.push_to"
        time.sleep(1.0)
        assert accepted == []
        assert prefill.metrics().get("sluice_kv_pushes_total", 0) == 0
    finally:
        stop.set()
        listener.close()
        for c in accepted:
            c.close()
