"""The KV receiver and sender as an attacker with network reach meets them (issue 39, docs/security.md): sealed
with the endpoint's key, a batch from a peer without it (or with another) is refused before anything is allocated;
every header field is bounded and checked; connections, in-flight bytes and time are capped; a receiver's broken
reply fails the push instead of hanging it; hop tokens bind push_to to the key holder; block names are keyed.
No model: a small layout and a receiver whose engine side is a list."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import pytest
import torch

from sluice_engine.config import EngineConfig
from sluice_engine.core.kv_cache import KVCacheManager
from sluice_engine.core.request import Request
from sluice_engine.kv_transfer.channel import _HELLO, MAGIC, PLAIN, SEALED, VERSION, Channel
from sluice_engine.kv_transfer.keys import HOP_TOKEN_TTL_S, KVKey
from sluice_engine.kv_transfer.tcp import KVReceiver, push_blocks
from sluice_engine.kv_transfer.wire import BlockBatch, KVLayout
from sluice_engine.sampling_params import SamplingParams

LAYOUT = KVLayout("m", "float32", 4, 2, 1, 8)  # 512 bytes a block
KEY = KVKey(b"k" * 32)
OTHER = KVKey(b"o" * 32)


def batch(n: int = 3, layout: KVLayout = LAYOUT) -> BlockBatch:
    data = torch.arange(n * layout.block_bytes() // 4, dtype=torch.float32).view(n, *layout.block_shape())
    return BlockBatch(layout, list(range(100, 100 + n)), data)


class Sink:
    """The engine side of a receiver: keeps what it is handed, and releases it (as the engine does once taken)."""

    def __init__(self, release: bool = True):
        self.got: list[BlockBatch] = []
        self.release = release

    def __call__(self, b: BlockBatch) -> int:
        self.got.append(b)
        if self.release:
            b.release()
        return len(b.names)


@pytest.fixture
def receiver():
    made: list[KVReceiver] = []

    def make(key=KEY, sink=None, **kw) -> tuple[KVReceiver, Sink]:
        sink = sink or Sink()
        kw = {"max_blocks": 64, "max_inflight_bytes": 64 * LAYOUT.block_bytes(), "timeout": 2.0, **kw}
        r = KVReceiver("127.0.0.1", 0, LAYOUT, sink, key, **kw)
        made.append(r)
        return r, sink

    yield make
    for r in made:
        r.close()


def wait_for(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def test_a_sealed_batch_arrives_whole_and_equal(receiver):
    r, sink = receiver()
    b = batch(5)
    assert push_blocks("127.0.0.1", r.port, b, KEY, timeout=5) == 5
    assert sink.got[0].names == b.names and torch.equal(sink.got[0].data, b.data)
    assert r.inflight_bytes == 0  # released once taken


@pytest.mark.parametrize("sender_key", [None, OTHER], ids=["no-key", "another-key"])
def test_a_peer_without_the_key_is_refused_and_nothing_is_taken(receiver, sender_key):
    r, sink = receiver()
    with pytest.raises((ValueError, ConnectionError, OSError)):
        push_blocks("127.0.0.1", r.port, batch(), sender_key, timeout=3)
    wait_for(lambda: r.refusals["unauthenticated"] == 1)
    assert sink.got == [] and r.inflight_bytes == 0


def test_a_forged_header_frame_is_refused_before_any_payload_is_allocated(receiver):
    """A peer that knows the protocol but not the key: its frames fail authentication."""
    r, sink = receiver()
    with socket.create_connection(("127.0.0.1", r.port), timeout=5) as s:
        s.recv(_HELLO.size)
        s.sendall(_HELLO.pack(MAGIC, VERSION, SEALED, b"\0" * 16))
        head = header()
        s.sendall(struct.pack(">I", len(head) + 16) + head + b"\0" * 16)
        assert s.recv(100) == b""  # closed, told nothing
    assert r.refusals["unauthenticated"] == 1 and sink.got == []


def test_a_keyless_receiver_listens_on_loopback_only():
    with pytest.raises(ValueError, match="--kv-secret-file"):
        KVReceiver("0.0.0.0", 0, LAYOUT, Sink(), None, max_blocks=4, max_inflight_bytes=1 << 20)
    with pytest.raises(ValueError, match="--kv-secret-file"):
        EngineConfig(kv_role="decode", kv_host="10.0.0.5")
    assert EngineConfig(kv_role="decode").kv_host == "127.0.0.1"
    assert EngineConfig(kv_role="decode", kv_secret_file="/k").kv_host == "0.0.0.0"
    for kw in ({"kv_role": "prefill"}, {"kv_role": "decode", "prefill_url": "http://p"}):
        with pytest.raises(ValueError, match="--kv-secret-file"):
            EngineConfig(**kw)


def plain_exchange(port: int, frames: list[bytes], read: bool = True) -> bytes:
    """Speak the plain protocol by hand: hellos, then `frames` as given (length-prefixed), then read the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        hello = s.recv(_HELLO.size)
        assert hello[:4] == MAGIC
        s.sendall(_HELLO.pack(MAGIC, VERSION, PLAIN, b"\0" * 16))
        for f in frames:
            s.sendall(struct.pack(">I", len(f)) + f)
        if not read:
            return b""
        n = s.recv(4)
        if len(n) < 4:
            return b""
        return s.recv(struct.unpack(">I", n)[0])


def header(**over) -> bytes:
    head = {"layout": {"model": "m", "dtype": "float32", "block_size": 4, "num_layers": 2, "num_kv_heads": 1,
                       "head_dim": 8}, "names": [1, 2], "nbytes": 1024}
    for k, v in over.items():
        if k in head["layout"]:
            head["layout"][k] = v
        else:
            head[k] = v
    return json.dumps(head).encode()


@pytest.mark.parametrize(("frame", "why"), [
    (header(dtype="Tensor"), "layout.dtype"),
    (header(dtype="__class__"), "layout.dtype"),
    (header(names=list(range(65))), "names"),
    (header(names=["1"]), "names"),
    (header(nbytes=1 << 40), "nbytes"),
    (header(block_size=1 << 30, nbytes=0, names=[]), "layout.block_size"),
    (b"[1, 2]", "exactly layout"),
    (b"\xff\xfe", "not JSON"),
])
def test_every_header_field_is_checked_before_the_payload(receiver, frame, why):
    r, sink = receiver(key=None)
    reply = json.loads(plain_exchange(r.port, [frame]))
    assert why in reply["error"]
    assert r.refusals["malformed"] == 1 and sink.got == [] and r.inflight_bytes == 0


def test_an_announced_huge_header_is_refused_without_reading_it(receiver):
    r, _ = receiver(key=None)
    with socket.create_connection(("127.0.0.1", r.port), timeout=5) as s:
        s.recv(_HELLO.size)
        s.sendall(_HELLO.pack(MAGIC, VERSION, PLAIN, b"\0" * 16) + struct.pack(">I", 16 << 20))
        n = struct.unpack(">I", s.recv(4))[0]
        assert "at most" in json.loads(s.recv(n))["error"]
    assert r.refusals["malformed"] == 1


def test_another_layout_is_refused_by_name_before_the_payload(receiver):
    r, sink = receiver(key=None)
    reply = json.loads(plain_exchange(r.port, [header(model="other")]))
    assert "model" in reply["error"] and r.refusals["layout"] == 1 and sink.got == []


def test_in_flight_bytes_are_capped_by_the_tier(receiver):
    sink = Sink(release=False)  # the engine has not taken anything in yet
    r, _ = receiver(sink=sink, max_inflight_bytes=4 * LAYOUT.block_bytes())
    assert push_blocks("127.0.0.1", r.port, batch(3), KEY, timeout=5) == 3
    with pytest.raises(ValueError, match="busy"):
        push_blocks("127.0.0.1", r.port, batch(2), KEY, timeout=5)
    assert r.inflight_bytes == 3 * LAYOUT.block_bytes()
    sink.got[0].release()  # taken into the tier
    assert push_blocks("127.0.0.1", r.port, batch(2), KEY, timeout=5) == 2


def test_connections_beyond_the_cap_are_closed_at_once(receiver):
    r, _ = receiver(max_connections=4, timeout=5.0)
    held = [socket.create_connection(("127.0.0.1", r.port), timeout=5) for _ in range(4)]
    try:
        for s in held:
            s.recv(_HELLO.size)  # each is served (a thread each), silent
        extra = socket.create_connection(("127.0.0.1", r.port), timeout=5)
        assert extra.recv(100) == b""  # closed without a hello
        extra.close()
        assert r.refusals["busy"] >= 1
    finally:
        for s in held:
            s.close()
    wait_for(lambda: r._active == 0)
    assert push_blocks("127.0.0.1", r.port, batch(1), KEY, timeout=5) == 1


def test_a_peer_that_trickles_is_cut_off_at_the_deadline(receiver):
    r, _ = receiver(key=None, timeout=0.5)
    with socket.create_connection(("127.0.0.1", r.port), timeout=15) as s:
        s.recv(_HELLO.size)
        t0 = time.monotonic()
        s.sendall(_HELLO.pack(MAGIC, VERSION, PLAIN, b"\0" * 16) + struct.pack(">I", 200))
        try:
            while s.recv(100):  # a byte of header now and then, each within the per-read timeout
                pass
        except OSError:
            pass
        for _ in range(40):
            try:
                s.sendall(b"{")
            except OSError:
                break
            time.sleep(0.3)
        assert time.monotonic() - t0 < 14  # cut off at the connection's deadline, not held for ever
    wait_for(lambda: r.refusals["timeout"] == 1)


def fake_receiver(reply: bytes) -> tuple[socket.socket, int]:
    """A plain 'receiver' that reads a batch and answers `reply` (a broken one)."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = lsock.accept()
        with conn:
            ch = Channel(conn, None, sender=False, deadline=time.monotonic() + 10)
            ch.accept()
            ch.recv(1 << 20)
            ch.send(b'{"ready": true}')
            ch.recv_into(memoryview(bytearray(3 * LAYOUT.block_bytes())))
            ch.send(reply)

    threading.Thread(target=serve, daemon=True).start()
    return lsock, lsock.getsockname()[1]


@pytest.mark.parametrize("reply", [b"{}", b"[]", b'{"taken": "3"}', b"nope"])
def test_a_broken_reply_fails_the_push_instead_of_hanging_it(reply):
    lsock, port = fake_receiver(reply)
    with lsock, pytest.raises(ValueError, match="reply"):
        push_blocks("127.0.0.1", port, batch(3), None, timeout=5)


def test_hop_tokens_bind_push_to_to_the_key_and_expire():
    now = time.time()
    token = KEY.hop_token("10.0.0.7:8100", now)
    assert KEY.check_hop_token("10.0.0.7:8100", token, now)
    assert not KEY.check_hop_token("127.0.0.1:9999", token, now)  # another target
    assert not OTHER.check_hop_token("10.0.0.7:8100", token, now)  # another endpoint's key
    assert not KEY.check_hop_token("10.0.0.7:8100", token, now + HOP_TOKEN_TTL_S + 1)  # expired
    for bad in (None, "", "v1", "v1.x.y", "v1.1." + "0" * 64, token + "0"):
        assert not KEY.check_hop_token("10.0.0.7:8100", bad, now)


def test_block_names_are_keyed(tmp_path):
    ids = list(range(40))
    names = []
    for root in (None, KEY.names_root(), OTHER.names_root()):
        kv = KVCacheManager(8, 16, names_root=root)
        req = Request("r", ids, SamplingParams(max_tokens=1))
        names.append(kv._block_hashes(req, len(ids)))
    assert len({tuple(n) for n in names}) == 3  # without the key a prompt's names cannot be computed
    p = tmp_path / "key"
    p.write_bytes(b"x" * 31 + b"\n")
    with pytest.raises(ValueError, match="--kv-secret-file"):
        KVKey.from_file(p)
    p.write_bytes(b"x" * 64 + b"\n")
    assert KVKey.from_file(p).secret == b"x" * 64
