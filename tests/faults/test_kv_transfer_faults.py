"""Fault cases of moving KV between engines (issues 28 and 39, kv_transfer/), real servers on 127.0.0.1: a decode
engine's receiver that dies mid-transfer fails the push alone (the prefill engine's request was answered, the
push is counted failed, the engine settles and serves on); a sender that dies mid-batch leaves the decode engine
nothing half-taken, settled, and taking the next batch. Nothing hangs. And as an attacker with network reach
meets them (issue 39; tests/faults/test_kv_transfer_attacks.py)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import torch
from servers import free_port

from sluice_engine.kv_transfer.channel import Channel
from sluice_engine.kv_transfer.keys import KVKey
from sluice_engine.kv_transfer.wire import BlockBatch, KVLayout

pytestmark = pytest.mark.slow

PROMPT = " ".join(f"word{j % 11}" for j in range(80))
SECRET = "c0" * 32
KEY = KVKey(SECRET.encode())
LAYOUT = KVLayout("smollm2", "float32", 16, 30, 3, 64)


@pytest.fixture(scope="module")
def key_args(tmp_path_factory) -> tuple[str, ...]:
    path = tmp_path_factory.mktemp("kv") / "kv-secret"
    path.write_text(SECRET)
    return ("--kv-secret-file", str(path))


def test_a_receiver_dying_mid_transfer_fails_the_push_alone(start_server, probe, assert_settled, key_args):
    prefill = start_server("--max-model-len", "512", "--kv-role", "prefill", *key_args)
    before = probe(prefill)
    # A receiver that takes the start of a batch and dies (its pod killed mid-transfer). It speaks the protocol up to
    # there: the receiver speaks first (a hello), so one that only read waited in vain for the sender to say anything
    # and the push failed after 30 s on "the peer sent nothing in time" (a silent peer, not this case).
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    died: list[str] = []

    def die_mid_batch() -> None:
        conn, _ = lsock.accept()
        try:
            ch = Channel(conn, KEY, sender=False, deadline=time.monotonic() + 60)
            ch.accept()
            ch.recv(4096)  # the batch's header
            ch.send(b'{"ready": true}')
            died.append(f"after {len(conn.recv(4096))} payload bytes")
        finally:
            conn.close()
            lsock.close()

    threading.Thread(target=die_mid_batch, daemon=True).start()
    r = httpx.post(f"{prefill.url}/v1/completions", timeout=120, json={
        "model": prefill.model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"push_to": f"127.0.0.1:{port}", "hop_token": KEY.hop_token(f"127.0.0.1:{port}")}})
    assert r.status_code == 200, r.text  # the request itself is served, once its push has failed
    assert died, "the push never reached the payload"
    text = httpx.get(f"{prefill.url}/metrics", timeout=10).text
    assert 'result="failed"} 1.0' in text
    assert_settled(prefill, before)


def test_a_sender_dying_mid_batch_leaves_the_decode_engine_settled(start_server, probe, assert_settled, key_args):
    kv_port = free_port()
    decode = start_server("--max-model-len", "512", "--kv-role", "decode", "--kv-host", "127.0.0.1",
                          "--kv-port", str(kv_port), "--kv-offload-bytes", "64MiB", *key_args)
    before = probe(decode)
    batch = BlockBatch(LAYOUT, [11, 12, 13], torch.zeros(3, *LAYOUT.block_shape()))
    with socket.create_connection(("127.0.0.1", kv_port), timeout=10) as sock:
        ch = Channel(sock, KEY, sender=True, deadline=time.monotonic() + 10)
        ch.connect()
        ch.send(batch.header())
        assert b"ready" in ch.recv(4096)
        ch.send(b"\0" * 4096)  # a first payload frame of the wrong size, then gone
    for _ in range(50):
        if decode.metrics().get("sluice_kv_receiver_refusals_total", 0):
            break
        time.sleep(0.1)
    m = decode.metrics()
    assert m["sluice_kv_receiver_refusals_total"] == 1
    assert m.get("sluice_kv_offload_blocks_used", 0) == 0 and m["sluice_kv_receiver_inflight_bytes"] == 0
    assert_settled(decode, before)
    # A batch that is not even a batch: refused, the connection closed, the receiver serves on.
    with socket.create_connection(("127.0.0.1", kv_port), timeout=10) as sock:
        sock.recv(22)
        sock.sendall(b"nope!" * 10)
        while sock.recv(4096):  # at most a refusal, then closed
            pass
    assert_settled(decode, before)


def test_a_prefill_engine_dying_or_hanging_mid_hop_means_computing_here(start_server, probe, assert_settled,
                                                                      key_args):
    """A decode engine's prefill hop (--prefill-url) to a prefill engine that dies after reading the request, and
    then to one that never answers (past --prefill-timeout): each request is served, computed here, the hop
    counted failed; nothing hangs."""
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(60)
    mode = {"hang": False}
    held: list[socket.socket] = []

    def fake_prefill() -> None:
        while True:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            conn.recv(65536)
            if mode["hang"]:
                held.append(conn)  # read, never answered
            else:
                conn.close()  # died mid-hop

    threading.Thread(target=fake_prefill, daemon=True).start()
    decode = start_server("--max-model-len", "512", "--kv-role", "decode", "--kv-host", "127.0.0.1",
                          "--kv-port", str(free_port()), "--kv-offload-bytes", "64MiB", "--prefill-url",
                          f"http://127.0.0.1:{lsock.getsockname()[1]}", "--prefill-min-prompt-tokens", "0",
                          "--prefill-timeout", "2", *key_args)
    before = probe(decode)
    try:
        for hang in (False, True):
            mode["hang"] = hang
            t0 = time.monotonic()
            r = httpx.post(f"{decode.url}/v1/completions", timeout=120, json={
                "model": decode.model, "prompt": ("Hang: " if hang else "") + PROMPT, "max_tokens": 2,
                "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed here
            assert time.monotonic() - t0 < 60
        text = httpx.get(f"{decode.url}/metrics", timeout=10).text
        assert 'sluice_kv_prefill_hops_total{model_name="smollm2",outcome="failed"} 2.0' in text
        assert_settled(decode, before)
    finally:
        lsock.close()
        for c in held:
            c.close()


def test_a_decode_engine_dying_mid_hop_fails_its_request_cleanly(start_server, key_args):
    """The client's request is at a decode engine whose prefill hop is in flight when the decode engine dies (its
    pod killed): the client gets an error at once, not a hang."""
    lsock = socket.create_server(("127.0.0.1", 0))
    got_hop = threading.Event()
    held: list[socket.socket] = []

    def fake_prefill() -> None:
        try:
            conn, _ = lsock.accept()
        except OSError:
            return
        conn.recv(65536)
        held.append(conn)  # the hop is in flight: never answered
        got_hop.set()

    threading.Thread(target=fake_prefill, daemon=True).start()
    decode = start_server("--max-model-len", "512", "--kv-role", "decode", "--kv-host", "127.0.0.1",
                          "--kv-port", str(free_port()), "--kv-offload-bytes", "64MiB", "--prefill-url",
                          f"http://127.0.0.1:{lsock.getsockname()[1]}", "--prefill-min-prompt-tokens", "0",
                          *key_args)
    outcome: dict[str, object] = {}

    def client() -> None:
        try:
            r = httpx.post(f"{decode.url}/v1/completions", timeout=60, json={
                "model": decode.model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
            outcome["status"] = r.status_code
        except httpx.HTTPError as e:
            outcome["error"] = type(e).__name__

    t = threading.Thread(target=client)
    t.start()
    try:
        assert got_hop.wait(30), "the decode engine never sent its prefill hop"
        t0 = time.monotonic()
        decode.proc.kill()
        t.join(30)
        assert not t.is_alive(), "the client hung on a dead decode engine"
        assert "error" in outcome, outcome  # the connection dropped: a clean failure the client can retry
        assert time.monotonic() - t0 < 10
    finally:
        lsock.close()
        for c in held:
            c.close()
