"""KV blocks between engines over TCP (issue 28, the seam of prefill/decode disaggregation): one engine computes
prompts, exports their blocks by name and pushes them to another engine's receiver, which takes them into its
offload tier; that engine then serves the prompts from those blocks (counted as cached tokens) with the greedy
tokens and logprobs of computing them itself. Refusals and failures leave nothing behind and hang nothing: a
layout that differs (named), a sender that dies mid-batch, a receiver that is not there."""

from __future__ import annotations

import dataclasses
import socket
import struct
import time

import pytest
import torch

from sluice_engine.kv_transfer.tcp import KVReceiver, push_blocks
from sluice_engine.kv_transfer.wire import BlockBatch, KVLayout
from sluice_engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
PROMPTS = [" ".join(WORDS[(i + j) % len(WORDS)] + str(j % 7) for j in range(120)) + "\nWhat comes next?"
           for i in range(3)]


@pytest.fixture(scope="module")
def engines():
    from sluice_engine.entrypoints.llm import LLM

    kw = dict(kv_cache_memory=64 << 20, max_model_len=640, quantization="none")
    prefill, decode, alone = LLM(None, **kw), LLM(None, kv_offload_bytes=128 << 20, **kw), LLM(None, **kw)
    receiver = KVReceiver("127.0.0.1", 0, decode.engine.take_blocks, timeout=5)
    yield prefill, decode, alone, receiver
    receiver.close()
    for llm in (prefill, decode, alone):
        llm.engine.shutdown()


def test_blocks_computed_by_one_engine_serve_another_as_its_own(engines):
    prefill, decode, alone, receiver = engines
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1)
    sent = 0
    for prompt in PROMPTS:
        ids = prefill.engine.tokenizer.encode(prompt)
        prefill.generate([prompt], SamplingParams(max_tokens=1, temperature=0))  # the prefill instance's part
        batch = prefill.engine.export_prefix(ids)
        assert len(batch.names) == len(ids) // 16 and batch.data.dtype == torch.float32
        assert push_blocks("127.0.0.1", receiver.port, batch) == len(batch.names)
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
    batch = prefill.engine.export_prefix(prefill.engine.tokenizer.encode(PROMPTS[0]))
    before = len(decode.engine.kv.offload)
    for field, value in (("block_size", 32), ("dtype", "float16"), ("model", "another-model")):
        layout = dataclasses.replace(batch.layout, **{field: value})
        shape = (len(batch.names), *layout.block_shape())
        wrong = BlockBatch(layout, batch.names, torch.zeros(shape, dtype=getattr(torch, layout.dtype)))
        with pytest.raises(ValueError, match=field):
            push_blocks("127.0.0.1", receiver.port, wrong)
    decode.generate(["hello"], SamplingParams(max_tokens=1))  # a step: the inbox (empty) is taken
    assert len(decode.engine.kv.offload) == before and receiver.refused >= 3


def test_a_sender_dying_mid_batch_leaves_nothing_and_the_receiver_serves_on(engines):
    prefill, decode, _, receiver = engines
    batch = prefill.engine.export_prefix(prefill.engine.tokenizer.encode(PROMPTS[1]))
    failed = receiver.failed
    with socket.create_connection(("127.0.0.1", receiver.port), timeout=5) as sock:
        header = (b'{"layout": {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "block_size": 16, '
                  b'"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}, "names": [1, 2], "nbytes": 5898240}')
        sock.sendall(struct.pack(">Q", len(header)) + header + b"\0" * 1000)  # then gone, mid-payload
    for _ in range(100):
        if receiver.failed > failed:
            break
        time.sleep(0.05)
    assert receiver.failed == failed + 1
    assert push_blocks("127.0.0.1", receiver.port, batch) == len(batch.names)  # the next batch is taken


def test_pushing_to_no_receiver_fails_fast():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    layout = KVLayout("m", "float32", 16, 1, 1, 4)
    with pytest.raises(OSError):
        push_blocks("127.0.0.1", port, BlockBatch(layout, [], torch.empty(0, *layout.block_shape())), timeout=2)
