"""CUDA graphs of decode steps (cuda_graphs.py), as far as a machine without a GPU can take them.

- The pure parts: capture sizes, the size a step replays, when graphs are off, the attention workspaces.
- TorchCudaGraphs against a stand-in torch.cuda: one pool and one side stream for every capture, warm-up
  on that stream before capturing.
- DecodeGraphs end to end on a tiny random Llama with the Triton backend (in Triton's interpreter): a
  stand-in graph API whose "replay" reruns the captured forward over the same persistent buffers, which is
  what a graph does. Decode steps replay padded batches with the fixed split count and preallocated
  attention outputs, prefill steps run eagerly, and the logits match an eager runner on the per-step
  builder; padding rows never touch a real request's KV.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from contextlib import contextmanager

import pytest
import torch
from reference_inputs import ReferenceInputs
from safetensors.torch import save_file

from sluice_engine.config import EngineConfig
from sluice_engine.core.sched_output import ScheduledRequest, SchedulerOutput
from sluice_engine.worker import cuda_graphs as cg

CPU = torch.device("cpu")


# -- pure parts ------------------------------------------------------------------------------------
def test_capture_sizes():
    assert cg.capture_sizes(1) == [1]
    assert cg.capture_sizes(6) == [1, 2, 4, 6]
    assert cg.capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = cg.capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert all(b - a <= 8 for a, b in zip(sizes, sizes[1:], strict=False))  # at most 7 padding rows
    with pytest.raises(ValueError, match=">= 1"):
        cg.capture_sizes(0)


def _decode(n: int, start: int = 5) -> SchedulerOutput:
    return SchedulerOutput([ScheduledRequest(f"r{i}", [i], start, [i]) for i in range(n)])


def test_which_steps_replay_which_size():
    sizes = cg.capture_sizes(20)
    assert [cg.bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 20, 21)] == [1, 2, 4, 8, 8, 16, 20, 20, None]
    assert cg.graph_batch_size(_decode(3), sizes) == 4
    assert cg.graph_batch_size(_decode(21), sizes) is None  # more rows than the largest graph: eager
    mixed = _decode(2)
    mixed.scheduled.append(ScheduledRequest("p", [1, 2, 3], 0, [9]))  # a prompt chunk: eager
    assert cg.graph_batch_size(mixed, sizes) is None
    drafts = SchedulerOutput([ScheduledRequest("s", [4, 7, 8], 9, [1], num_drafts=2)])
    assert cg.graph_batch_size(drafts, sizes) is None  # verification is not captured
    one_token_chunk = SchedulerOutput([ScheduledRequest("c", [4], 3, [1], samples=False)])
    assert cg.graph_batch_size(one_token_chunk, sizes) == 1  # the same shapes as a decode


def test_when_graphs_are_off():
    cuda = torch.device("cuda")
    assert cg.graphs_off_reason(False, cuda, "triton", 1) is None
    assert cg.graphs_off_reason(True, cuda, "triton", 1) == "--enforce-eager"
    assert "CUDA" in cg.graphs_off_reason(False, CPU, "triton", 1)
    assert "torch" in cg.graphs_off_reason(False, cuda, "torch", 1)
    assert "parallel" in cg.graphs_off_reason(False, cuda, "triton", 2)
    assert EngineConfig().cuda_graph_max_batch == 256 and not EngineConfig().enforce_eager
    with pytest.raises(ValueError, match="--cuda-graph-max-batch"):
        EngineConfig(cuda_graph_max_batch=0)


def test_workspaces_are_views_of_one_allocation_per_kind():
    plan = {1: [1, 2, 4, 8], 2: [1, 2, 4], 4: [1, 2], 8: [1]}
    ws = cg.decode_workspaces(plan, num_heads=3, head_dim=16, dtype=torch.float16, device=CPU)
    assert set(ws) == {(n, s) for n, splits in plan.items() for s in splits}
    for (n, s), w in ws.items():
        assert w.num_splits == s
        assert w.out.shape == (n, 3, 16) and w.out.dtype == torch.float16
        assert w.mid_o.shape == (n, 3, s, 16) and w.mid_o.is_contiguous() and w.mid_o.dtype == torch.float32
        assert w.mid_lse.shape == (n, 3, s) and w.mid_lse.is_contiguous()
    assert len({w.out.data_ptr() for w in ws.values()}) == 1
    assert len({w.mid_o.data_ptr() for w in ws.values()}) == 1
    # One allocation holds the largest size x splits of any graph (here 8 rows of 1 split and 1 row of 8).
    assert ws[(1, 8)].mid_o.untyped_storage().nbytes() == 8 * 3 * 16 * 4


def test_a_step_replays_the_split_the_chooser_picks_or_the_nearest_above():
    assert cg.nearest_split([1, 2, 4, 8], 4) == 4
    assert cg.nearest_split([1, 4, 16], 2) == 4  # more splits, never fewer (a long context would serialize)
    assert cg.nearest_split([1, 4], 32) == 4  # none above: the largest
    assert cg.describe_plan({1: [1, 2], 2: [1, 2]}) == "2 batch sizes 1..2 x split counts [1, 2]"
    assert cg.describe_plan({1: [1, 2], 2: [1]}) == "2 batch sizes 1..2, split counts per size 1: [1, 2], 2: [1]"

    chosen: list[list[int]] = []

    def choose(seq_lens):
        chosen.append(seq_lens)
        return 4 if max(seq_lens) > 100 else 1

    graphs = cg.DecodeGraphs({1: [1, 4], 2: [1, 2, 8], 4: [1]}, inputs=None, forward=None, workspaces={
        k: None for k in [(1, 1), (1, 4), (2, 1), (2, 2), (2, 8), (4, 1)]}, api=None, choose_splits=choose)
    assert graphs.key(_decode(1)) == (1, 1)
    assert graphs.key(_decode(1, start=200)) == (1, 4)
    assert graphs.key(_decode(2, start=200)) == (2, 8)  # 4 not captured for size 2: the nearest above
    assert graphs.key(_decode(3, start=200)) == (4, 1)  # size 4 holds only 1
    assert chosen[-1] == [201, 201, 201]  # the real rows' contexts after the step: padding not counted
    assert graphs.key(_decode(5)) is None and len(chosen) == 4  # no graph holds 5 rows: nothing chosen


def test_torch_cuda_graphs_share_one_pool_and_stream(monkeypatch):
    """The real capture code against a stand-in torch.cuda (recording what it is called with)."""
    calls: list = []

    class Stream:
        def wait_stream(self, other):
            calls.append(("wait", self, other))

    class Graph:
        def replay(self):
            calls.append(("replay", self))

    @contextmanager
    def graph(g, pool=None, stream=None):
        calls.append(("capture", g, pool, stream))
        yield

    @contextmanager
    def on_stream(s):
        calls.append(("on", s))
        yield

    current = Stream()
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current)
    api = cg.TorchCudaGraphs(torch.device("cuda"))
    out = torch.ones(2)
    api.warm_up(lambda: calls.append("forward"))
    assert calls == [("wait", api.stream, current), ("on", api.stream), "forward", ("wait", current, api.stream)]
    calls.clear()
    replays = [api.capture(lambda: out) for _ in range(2)]
    captures = [c for c in calls if c[0] == "capture"]
    assert [c[2:] for c in captures] == [("pool", api.stream)] * 2  # one pool, one stream
    assert captures[0][1] is not captures[1][1]
    replay, got = replays[1]
    assert got is out
    replay()
    assert calls[-1] == ("replay", captures[1][1])


# -- end to end on a tiny model, Triton interpreted ---------------------------------------------------
HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB, INTER, BLOCK = 4, 2, 16, 2, 96, 128, 16
HIDDEN = HEADS * HEAD_DIM


def _interpreter_ready() -> bool:
    if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
        return False
    # As tests/engine/test_triton_attention.py: the interpreter only if set before triton's first import.
    os.environ["TRITON_INTERPRET"] = "1"
    from sluice_engine.attention import triton_kernels as tk

    return tk.INTERPRETER_READY


needs_interpreter = pytest.mark.skipif(not _interpreter_ready(),
                                       reason="needs Triton's interpreter (no GPU); a GPU runs test_real_graphs")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                               reason="needs a CUDA GPU and triton")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama-graphs")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "tie_word_embeddings": False,
    }))
    g = torch.Generator().manual_seed(0)

    def w(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    t = {"model.embed_tokens.weight": w(VOCAB, HIDDEN, scale=1.0), "lm_head.weight": w(VOCAB, HIDDEN),
         "model.norm.weight": 1 + w(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": 1 + w(HIDDEN), p + "post_attention_layernorm.weight": 1 + w(HIDDEN),
              p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
              p + "mlp.gate_proj.weight": w(INTER, HIDDEN), p + "mlp.up_proj.weight": w(INTER, HIDDEN),
              p + "mlp.down_proj.weight": w(HIDDEN, INTER)}
    save_file(t, str(d / "model.safetensors"))
    return d


class ReplayByRerun:
    """Stands in for torch.cuda's graphs on CPU: "capturing" keeps the forward, "replaying" reruns it over
    the captured ModelInput, i.e. over whatever the persistent buffers hold now, into the same output."""

    def __init__(self):
        self.captured: list[int] = []
        self.replays = 0

    def warm_up(self, fn):
        fn()

    def capture(self, fn):
        out = fn()
        self.captured.append(out.shape[0])

        def replay():
            self.replays += 1
            out.copy_(fn())

        return replay, out

    def synchronize(self):
        pass


def steps() -> list[SchedulerOutput]:
    """Prompts (eager), then decodes of 3 requests (replayed at size 4: one padding row), a request
    finishing (2 rows, replayed at size 2), and a new prompt beside a decode (eager again). Blocks of 16.
    Six 3-row decodes: each split count the stand-in chooser cycles through is replayed twice (a graph rerun
    over inputs another graph's replay changed in between); a 26-token prompt, so that a crosses into its third
    block (a new block id mid-decode) at the 2-row step."""
    a, b, c = list(range(3, 29)), list(range(30, 47)), [5, 6, 7, 8, 9]
    out = [SchedulerOutput([ScheduledRequest("a", a, 0, [4, 9]), ScheduledRequest("b", b, 0, [2, 7]),
                            ScheduledRequest("c", c, 0, [11, 12])])]
    decodes = 6
    for k in range(decodes):
        out.append(SchedulerOutput([ScheduledRequest("a", [40 + k], len(a) + k, [4, 9]),
                                    ScheduledRequest("b", [50 + k], len(b) + k, [2, 7]),
                                    ScheduledRequest("c", [60 + k], len(c) + k, [11, 12])]))
    assert len(a) + decodes == 32  # a's 33rd token: the first of its third block
    out.append(SchedulerOutput([ScheduledRequest("a", [70], 32, [4, 9, 13]),
                                ScheduledRequest("b", [71], len(b) + decodes, [2, 7])], freed_req_ids=["c"]))
    out.append(SchedulerOutput([ScheduledRequest("d", list(range(60, 80)), 0, [11, 3]),
                                ScheduledRequest("a", [72], 33, [4, 9, 13])]))
    return out


REPLAYED_STEPS = 7  # steps(): the six 3-row decodes and the 2-row one


def _runner(model_dir, device: str = "cpu", **kw):
    from sluice_engine.worker.model_runner import ModelRunner

    cfg = EngineConfig(model=str(model_dir), device=device, dtype="float32", attention_backend="triton",
                       block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=64, **kw)
    runner = ModelRunner(cfg, model_dir)
    runner.allocate_kv_cache(16)
    return runner


def _close(got: torch.Tensor, want: torch.Tensor, msg: str | None = None) -> None:
    """Equal to fp32 rounding, measured against the largest |want| (logits and K/V of a few units; a bare
    absolute bound would tighten as their magnitude grows)."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.float().abs().max().item(), msg=msg)


def _assert_same_steps(graphed, eager, replays: Callable[[], int], sizes: list[int]) -> None:
    for i, sched in enumerate(steps()):
        before = replays()
        got, want = graphed.execute_model(sched), eager.execute_model(sched)
        assert (replays() > before) == (cg.graph_batch_size(sched, sizes) is not None), i
        assert got.shape == want.shape
        # Split-KV (the graph's fixed count against the eager path's choice) sums in another order.
        _close(got, want, f"step {i}")
    assert replays() == REPLAYED_STEPS
    # The requests' KV is the same on both runners: padding rows wrote only to the scratch block.
    for c_graphed, c_eager in zip(graphed.kv_caches, eager.kv_caches, strict=True):
        for block in (2, 3, 4, 7, 9, 11, 12, 13):
            _close(c_graphed[:, block].float(), c_eager[:, block].float())


# fp8: the FP8 KV cache (issue 16) replays too: its scales are device buffers the kernels read.
KV_CACHE_DTYPES = ["auto", pytest.param("fp8", marks=pytest.mark.slow)]


@needs_interpreter
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_decode_steps_replay_padded_graphs_with_the_eager_logits(tiny_llama, kv_cache_dtype, one_thread):
    # one_thread: the interpreter runs numpy on tiny tiles, where threads only add overhead (restored after the
    # module: a bare torch.set_num_threads(1) here left every later test of the session on one thread)
    graphed = _runner(tiny_llama, kv_cache_dtype=kv_cache_dtype)
    eager = _runner(tiny_llama, kv_cache_dtype=kv_cache_dtype)
    assert graphed.graphs is None  # on CPU the runner does not capture; this test does, with a stand-in
    eager.inputs = ReferenceInputs(BLOCK, CPU)
    api = ReplayByRerun()
    sizes = cg.capture_sizes(4)
    # Split-KV decoding with preallocated partials: graphs of 1, 2 and 4 splits per size (of the fixed launch
    # set), where the eager path picks 1 on CPU; a stand-in chooser cycles through them step by step.
    plan = {n: [1, 2, 4] for n in sizes}
    workspaces = cg.decode_workspaces(plan, HEADS, HEAD_DIM, torch.float32, CPU)
    for ws in workspaces.values():  # garbage until a replay writes it
        for t in (ws.out, ws.mid_o, ws.mid_lse):
            t.fill_(float("nan"))
    calls = iter(range(1000))
    graphed.graphs = cg.DecodeGraphs(plan, graphed.inputs, graphed.forward, workspaces, api,
                                     lambda seq_lens: 4 >> (next(calls) % 3))
    real_kv = [c[:, :16].clone() for c in graphed.kv_caches]
    graphed.graphs.capture()
    assert api.captured == [4, 4, 4, 2, 2, 2, 1, 1, 1]  # largest size first
    assert graphed.graphs.captured == sorted(workspaces)
    replayed = []
    replay = graphed.graphs.replay
    graphed.graphs.replay = lambda key: replayed.append(key) or replay(key)
    assert graphed.inputs.frozen
    # Capturing ran every layer over padding rows: only the scratch block (id 16) was written.
    assert all(torch.equal(c[:, :16], r) for c, r in zip(graphed.kv_caches, real_kv, strict=True))
    assert any(c[:, 16].float().abs().sum() > 0 for c in graphed.kv_caches)

    _assert_same_steps(graphed, eager, lambda: api.replays, sizes)
    assert set(replayed) == {(4, 4), (4, 2), (4, 1), (2, 4)}  # 6 steps of 3 rows (size 4), then one of 2
    # Attention wrote its outputs and split partials where the graphs were captured to (no allocation).
    for key in ((4, 4), (4, 2), (2, 4)):
        ws = workspaces[key]
        # Every split writes its log-sum-exp; a split that gets no keys writes no partial output (the merge
        # skips it), so mid_o may keep its garbage there.
        assert not any(t.isnan().any() for t in (ws.out, ws.mid_lse)), key
        assert not ws.mid_o[:, :, 0].isnan().any(), key  # the first split always has keys


@needs_gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_real_graphs(tiny_llama, kv_cache_dtype):
    """On a GPU: the runner captures real CUDA graphs itself; the same steps as above against
    --enforce-eager on the per-step builder."""
    graphed = _runner(tiny_llama, "cuda", kv_cache_dtype=kv_cache_dtype)
    eager = _runner(tiny_llama, "cuda", enforce_eager=True, kv_cache_dtype=kv_cache_dtype)
    # A 256-token window: contexts too short to split, so one split count per size.
    assert graphed.graphs is not None and graphed.graphs.captured == [(1, 1), (2, 1), (4, 1)] and eager.graphs is None
    assert graphed.graph_state == cg.GraphState("on", captured=3)
    eager.inputs = ReferenceInputs(BLOCK, torch.device("cuda"))
    count = 0
    replay = graphed.graphs.replay

    def counted(key):
        nonlocal count
        count += 1
        return replay(key)

    graphed.graphs.replay = counted
    _assert_same_steps(graphed, eager, lambda: count, graphed.graphs.sizes)


@needs_interpreter
def test_a_failed_capture_leaves_the_runner_serving_eagerly(tiny_llama, monkeypatch, caplog):
    """A GPU path never run before must not stop the server: the capture fails, steps run eagerly."""
    from sluice_engine.worker import model_runner

    class FailingCapture(ReplayByRerun):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(model_runner, "graphs_off_reason", lambda *a: None)  # as on a GPU
    monkeypatch.setattr(model_runner.ModelRunner, "_graph_api", lambda self: FailingCapture())
    with caplog.at_level("WARNING", logger="sluice.engine"):
        runner = _runner(tiny_llama)
    assert runner.graphs is None and not runner.inputs.frozen
    assert "CUDA graph capture failed" in caplog.text
    assert runner.graph_state == cg.GraphState(
        "failed", "RuntimeError: operation not permitted when stream is capturing")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("operation not permitted when stream is capturing" in w and "eagerly" in w for w in warnings)
    eager = _runner(tiny_llama, enforce_eager=True)
    for sched in steps()[:3]:
        _close(runner.execute_model(sched), eager.execute_model(sched))


@needs_interpreter
def test_off_on_cpu_with_the_reason(tiny_llama):
    runner = _runner(tiny_llama)
    assert runner.graphs is None
    assert runner.graph_state == cg.GraphState("off", "graphs need CUDA (device is cpu)")


@pytest.fixture(scope="module")
def tiny_llama_4k(tiny_llama, tmp_path_factory):
    """The tiny model with a 4096-token window: contexts long enough to split."""
    import shutil

    d = tmp_path_factory.mktemp("tiny-llama-4k") / "model"
    shutil.copytree(tiny_llama, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return d


@needs_interpreter
def test_the_replayed_split_count_follows_the_live_contexts(tiny_llama_4k, monkeypatch, one_thread):
    """The runner captures each size at every split count its batches can get, and a decode step replays the
    graph whose count is the backend's choice for the step's contexts: short contexts unsplit, a long one split
    as far as it needs (an eager step of the same batch launches the same), never the count of the longest
    context the window allows (16 here, for every step)."""
    from sluice_engine.attention.kernel_buckets import (
        AttentionLaunch,
        attention_launches,
        decode_split_choices,
    )
    from sluice_engine.worker import model_runner

    monkeypatch.setattr(model_runner, "graphs_off_reason", lambda *a: None)  # as on a GPU
    monkeypatch.setattr(model_runner.ModelRunner, "_graph_api", lambda self: ReplayByRerun())

    def runner(**kw):
        r = model_runner.ModelRunner(EngineConfig(
            model=str(tiny_llama_4k), device="cpu", dtype="float32", attention_backend="triton", block_size=BLOCK,
            max_num_seqs=2, max_num_batched_tokens=64, **kw), tiny_llama_4k)
        r.backend.num_sms = 16  # the interpreter counts one SM, which never splits
        r.allocate_kv_cache(256)  # "d" holds blocks 20..207
        return r

    graphed, eager = runner(), runner(enforce_eager=True)
    assert decode_split_choices(1, KV_HEADS, 16, 4096) == [1, 2, 4, 8, 16]
    assert graphed.graph_plan() == {1: [1, 2, 4, 8, 16], 2: [1, 2, 4, 8, 16]}
    assert graphed.graphs.captured == [(n, s) for n in (1, 2) for s in (1, 2, 4, 8, 16)]
    assert graphed.graph_state == cg.GraphState("on", captured=10)
    # What capture compiled is the decode tile at every split count: members of the fixed launch set.
    assert graphed.backend.issued == {AttentionLaunch(s, 16) for s in (1, 2, 4, 8, 16)}
    assert graphed.backend.issued <= attention_launches(HEADS // KV_HEADS, KV_HEADS, 16, 4096)

    replayed = []
    replay = graphed.graphs.replay
    graphed.graphs.replay = lambda key: replayed.append(key) or replay(key)

    def blocks(first: int, context: int) -> list[int]:
        return list(range(first, first + -(-context // BLOCK)))

    # (request id, context before the step): the contexts' KV is the cache's zeros (both runners' alike).
    cases = [([("a", 19), ("b", 29)], (2, 1)),  # short contexts: unsplit
             ([("a", 20), ("c", 999)], (2, 4)),  # one of 1000 keys: ceil(1000 / 256) -> 4 splits
             ([("d", 2999)], (1, 8))]  # alone, 3000 keys: 8 (16 would leave splits under 256 keys)
    for i, (rows, want) in enumerate(cases):
        firsts = {"a": 0, "b": 10, "c": 20, "d": 20}
        sched = SchedulerOutput([ScheduledRequest(rid, [7 + i], ctx, blocks(firsts[rid], ctx + 1)) for rid, ctx in rows],
                                freed_req_ids=["b"] if i == 1 else ["a", "c"] if i == 2 else [])
        eager.backend.issued.clear()
        got, expect = graphed.execute_model(sched), eager.execute_model(sched)
        assert replayed[-1] == want, i
        assert eager.backend.issued == {AttentionLaunch(want[1], 16)}  # the eager step's choice: the same count
        _close(got, expect, f"step {i}")
    assert len(replayed) == len(cases)


# -- LoRA in the graphs (issue 26): each row's adapter slot is a graph input -----------------------------------
def _tiny_adapter(d, seed: int):
    from sluice_engine.core.lora_slots import LoRARef

    g = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj": (HIDDEN, HEADS * HEAD_DIM), "self_attn.v_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
              "self_attn.o_proj": (HEADS * HEAD_DIM, HIDDEN), "mlp.up_proj": (HIDDEN, INTER),
              "mlp.down_proj": (INTER, HIDDEN)}
    t = {}
    for i in range(LAYERS):
        for mod, (fan_in, fan_out) in shapes.items():
            p = f"base_model.model.model.layers.{i}.{mod}"
            t[f"{p}.lora_A.weight"] = torch.randn(4, fan_in, generator=g) * 0.2
            t[f"{p}.lora_B.weight"] = torch.randn(fan_out, 4, generator=g) * 0.2
    d.mkdir()
    save_file(t, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    return LoRARef(d.name, seed, str(d))


def lora_steps(refs) -> list[SchedulerOutput]:
    """steps() with a and d on one adapter, c on another, b on the base; both loaded with the first step."""
    on = {"a": 1, "b": 0, "c": 2, "d": 1}
    out = steps()
    for sched in out:
        for s in sched.scheduled:
            s.lora_slot = on[s.request_id]
    out[0].lora_loads = [(1, refs[0]), (2, refs[1])]
    return out


@needs_interpreter
def test_decode_graphs_replay_lora_rows_by_their_slot_input(tiny_llama, tmp_path, monkeypatch, one_thread):
    refs = [_tiny_adapter(tmp_path / "one", 1), _tiny_adapter(tmp_path / "two", 2)]
    graphed = _runner(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=8)
    eager = _runner(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=8)
    base = _runner(tiny_llama)
    eager.inputs = ReferenceInputs(BLOCK, CPU)
    api = ReplayByRerun()
    sizes = cg.capture_sizes(4)
    plan = {n: [1] for n in sizes}
    graphed.graphs = cg.DecodeGraphs(plan, graphed.inputs, graphed.graph_forward,
                                     cg.decode_workspaces(plan, HEADS, HEAD_DIM, torch.float32, CPU), api, lambda _: 1)
    graphed.graphs.capture()
    for i, sched in enumerate(lora_steps(refs)):
        before = api.replays
        got, want = graphed.execute_model(sched), eager.execute_model(sched)
        assert (api.replays > before) == (cg.graph_batch_size(sched, sizes) is not None), i
        _close(got, want, f"step {i}")
        if i == 1:  # a decode of a (adapter one), b (base), c (adapter two): the adapters' rows are theirs
            plain = base.execute_model(steps()[0]) is not None and base.execute_model(steps()[1])
            assert (got[1] - plain[1]).abs().max() < 1e-4  # b, on the base, with a padding row on slot 0 beside
            assert (got[0] - plain[0]).abs().max() > 1e-2 and (got[2] - plain[2]).abs().max() > 1e-2
    assert api.replays == REPLAYED_STEPS


@needs_gpu
def test_real_graphs_with_lora(tiny_llama, tmp_path):
    """On a GPU: real graphs with the Triton shrink/expand kernels captured in them, against --enforce-eager."""
    refs = [_tiny_adapter(tmp_path / "one", 1), _tiny_adapter(tmp_path / "two", 2)]
    graphed = _runner(tiny_llama, "cuda", enable_lora=True, max_loras=2, max_lora_rank=8)
    eager = _runner(tiny_llama, "cuda", enforce_eager=True, enable_lora=True, max_loras=2, max_lora_rank=8)
    assert graphed.graph_state == cg.GraphState("on", captured=3)
    eager.inputs = ReferenceInputs(BLOCK, torch.device("cuda"))
    for i, sched in enumerate(lora_steps(refs)):
        _close(graphed.execute_model(sched), eager.execute_model(sched), f"step {i}")
