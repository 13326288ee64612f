"""KV blocks between engines over TCP (issue 28, the seam of prefill/decode disaggregation): one engine computes
prompts, exports their blocks by name and pushes them to another engine's receiver, which takes them into its
offload tier; that engine then serves the prompts from those blocks (counted as cached tokens) with the greedy
tokens and logprobs of computing them itself. Both engines hold one endpoint key (issue 39): transfers are sealed
with it and block names keyed by it. Refusals and failures leave nothing behind and hang nothing: a layout that
differs (named), a sender that dies mid-batch, a receiver that is not there."""

from __future__ import annotations

import dataclasses
import socket
import struct
import time

import pytest
import torch

from sluice_engine.kv_transfer.channel import TAG
from sluice_engine.kv_transfer.keys import KVKey
from sluice_engine.kv_transfer.tcp import push_blocks
from sluice_engine.kv_transfer.wire import CHUNK, BlockBatch, KVLayout
from sluice_engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
PROMPTS = [" ".join(WORDS[(i + j) % len(WORDS)] + str(j % 7) for j in range(120)) + "\nWhat comes next?"
           for i in range(3)]


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv") / "kv-secret"
    path.write_text("ab" * 32 + "\n")
    return path


@pytest.fixture(scope="module")
def engines(key_file):
    from sluice_engine.entrypoints.llm import LLM

    kw = dict(kv_cache_memory=64 << 20, max_model_len=640, quantization="none", kv_secret_file=str(key_file))
    prefill = LLM(None, **kw)
    decode = LLM(None, kv_offload_bytes=128 << 20, kv_role="decode", kv_port=0, **kw)
    alone = LLM(None, **kw)
    yield prefill, decode, alone, decode.engine.kv_connector.receiver
    for llm in (prefill, decode, alone):
        llm.engine.shutdown()


def push(prefill, receiver, batch, **kw) -> int:
    return push_blocks("127.0.0.1", receiver.port, batch, prefill.engine.kv_connector.key, **kw)


def test_blocks_computed_by_one_engine_serve_another_as_its_own(engines):
    prefill, decode, alone, receiver = engines
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1)
    sent = 0
    for prompt in PROMPTS:
        ids = prefill.engine.tokenizer.encode(prompt)
        prefill.generate([prompt], SamplingParams(max_tokens=1, temperature=0))  # the prefill instance's part
        batch = prefill.engine.kv_connector.export_prefix(ids)
        assert len(batch.names) == len(ids) // 16 and batch.data.dtype == torch.float32
        assert push(prefill, receiver, batch) == len(batch.names)
        sent += len(batch.names)
        got = decode.generate([prompt], params)[0]
        want = alone.generate([prompt], params)[0]
        assert got.num_cached_tokens == min(len(batch.names) * 16, (len(ids) - 1) // 16 * 16)
        assert want.num_cached_tokens == 0
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a[0] == pytest.approx(b[0], abs=1e-3)
    assert decode.engine.kv.offload.received == sent


def test_a_batch_of_another_layout_is_refused_by_name_and_nothing_is_taken(engines):
    prefill, decode, _, receiver = engines
    batch = prefill.engine.kv_connector.export_prefix(prefill.engine.tokenizer.encode(PROMPTS[0]))
    before = len(decode.engine.kv.offload)
    for field, value in (("block_size", 32), ("dtype", "float16"), ("model", "another-model")):
        layout = dataclasses.replace(batch.layout, **{field: value})
        shape = (len(batch.names), *layout.block_shape())
        wrong = BlockBatch(layout, batch.names, torch.zeros(shape, dtype=getattr(torch, layout.dtype)))
        with pytest.raises(ValueError, match=field):
            push(prefill, receiver, wrong)
    decode.generate(["hello"], SamplingParams(max_tokens=1))  # a step: the inbox (empty) is taken
    assert len(decode.engine.kv.offload) == before and receiver.refusals["layout"] >= 3


def test_a_sender_dying_mid_batch_leaves_nothing_and_the_receiver_serves_on(engines):
    prefill, decode, _, receiver = engines
    batch = prefill.engine.kv_connector.export_prefix(prefill.engine.tokenizer.encode(PROMPTS[1]))
    failed = receiver.refusals["disconnected"]

    class DiesMidPayload(BlockBatch):
        def send_payload(self, ch) -> None:
            # The first payload frame's length (a whole chunk and its tag), a little of it, then gone.
            ch.sock.sendall(struct.pack(">I", CHUNK + TAG) + b"\0" * 1000)
            ch.sock.close()
            raise ConnectionError("sender died")

    dying = DiesMidPayload(batch.layout, batch.names, batch.data)
    with pytest.raises(OSError):
        push(prefill, receiver, dying)
    for _ in range(100):
        if receiver.refusals["disconnected"] > failed:
            break
        time.sleep(0.05)
    assert receiver.refusals["disconnected"] == failed + 1
    assert receiver.inflight_bytes == 0  # nothing half-taken, nothing held
    assert push(prefill, receiver, batch) == len(batch.names)  # the next batch is taken


def test_pushing_to_no_receiver_fails_fast():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    layout = KVLayout("m", "float32", 16, 1, 1, 4)
    with pytest.raises(OSError):
        push_blocks("127.0.0.1", port, BlockBatch(layout, [], torch.empty(0, *layout.block_shape())),
                    KVKey(b"k" * 32), timeout=2)
