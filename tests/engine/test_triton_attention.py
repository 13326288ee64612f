"""The Triton paged-attention kernels against the torch reference (TorchPagedAttention).

Without a GPU the kernels run in Triton's interpreter on CPU tensors: this module sets TRITON_INTERPRET=1
before triton is first imported (see `_import_kernels`). On a CUDA machine the same tests run the
compiled kernels on the GPU.

The interpreter gets bf16 arithmetic wrong (the kernels upcast bf16 to fp32 there), so the numbers are
checked in fp32 (<= 1e-5) and fp16 (<= 1e-3) against the reference in fp32 on the same inputs, as fractions of
the largest |V|: an output averages V rows, so its rounding error scales with them, not with the output.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from sluice_engine.attention.backend import select_backend
from sluice_engine.attention.kernel_buckets import AttentionLaunch, block_m_for, choose_attention_launch
from sluice_engine.attention.torch_paged import TorchPagedAttention
from sluice_engine.forward_context import AttentionMetadata

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from tiny_llama import VOCAB, write_tiny_llama
from triton_interpreter import import_kernels  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2}  # bf16: an 8-bit mantissa

tk = import_kernels("sluice_engine.attention.triton_kernels")
from sluice_engine.attention.triton_paged import TritonPagedAttention  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


# -- a ragged batch over a paged cache -------------------------------------------------------------
class Batch:
    """Sequences given as (cached prefix, new tokens), their K/V already in shuffled cache blocks."""

    def __init__(self, seqs: list[tuple[int, int]], hq: int, hkv: int, d: int, block_size: int,
                 dtype: torch.dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)

        def rand(*shape):  # uniform in [-1, 1]: outputs stay below 1, where an fp16 ulp is < 1e-3
            return (torch.rand(*shape, generator=g) * 2 - 1).to(dtype)

        lens = [p + n for p, n in seqs]
        blocks_per_seq = [-(-seq_len // block_size) for seq_len in lens]
        num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
        order = torch.randperm(num_blocks, generator=g).tolist()
        self.cache = rand(2, num_blocks, block_size, hkv, d)  # garbage everywhere until written
        flat = self.cache.view(2, num_blocks * block_size, hkv, d)
        tables, slots, qs, ks, vs, starts = [], [], [], [], [], [0]
        for (prefix, new), seq_len, nb in zip(seqs, lens, blocks_per_seq, strict=True):
            table = [order.pop() for _ in range(nb)]
            seq_slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(seq_len)])
            k, v = rand(seq_len, hkv, d), rand(seq_len, hkv, d)
            flat[0, seq_slots], flat[1, seq_slots] = k, v
            tables.append(table)
            slots.append(seq_slots[prefix:])
            ks.append(k[prefix:])
            vs.append(v[prefix:])
            qs.append(rand(new, hq, d))
            starts.append(starts[-1] + new)
        width = max(blocks_per_seq)
        q_lens = [n for _, n in seqs]
        self.q, self.k, self.v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        self.meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            slot_mapping=torch.cat(slots).long(),
            max_query_len=max(q_lens), max_seq_len=max(lens),
            query_lens_cpu=q_lens, seq_lens_cpu=lens, block_size=block_size,
        )
        self.scale = d**-0.5

    def reference(self) -> torch.Tensor:
        """The torch backend on fp32 copies of the same numbers."""
        return TorchPagedAttention().attend(self.q.float(), self.k.float(), self.v.float(), self.cache.float(),
                                            self.meta, self.scale)

    @property
    def v_max(self) -> float:
        """The largest |V| in the cache (uniform in [-1, 1]: about 1), the scale of the outputs' errors."""
        return self.cache[1].float().abs().max().item()

    def on(self, device: torch.device):
        m = self.meta
        meta = AttentionMetadata(m.query_start_loc.to(device), m.seq_lens.to(device), m.block_tables.to(device),
                                 m.slot_mapping.to(device), m.max_query_len, m.max_seq_len, m.query_lens_cpu,
                                 m.seq_lens_cpu, m.block_size)
        return self.q.to(device), self.cache.to(device), meta

    def triton(self, num_splits: int = 1, block_m: int | None = None,
               launch: AttentionLaunch | None = None) -> torch.Tensor:
        q, cache, meta = self.on(DEVICE)
        group = q.shape[1] // cache.shape[3]
        launch = launch or AttentionLaunch(num_splits, block_m or block_m_for(meta.max_query_len, group))
        out = tk.paged_attention(q, cache[0], cache[1], meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                 meta.max_query_len, self.scale, launch=launch)
        assert out.dtype == q.dtype and out.shape == q.shape
        return out.float().cpu()


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# -- cache write ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)])
def test_store_kv_scatters_rows_into_their_slots(dtype, cache_dtype):
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size, hkv, d, t = 6, 16, 3, 64, 19
    # K and V as the model makes them: column slices of one fused projection (rows are strided).
    qkv = torch.randn(t, 5 * hkv * d, generator=g).to(dtype)
    k = qkv[:, hkv * d : 2 * hkv * d].view(t, hkv, d)
    v = qkv[:, 3 * hkv * d : 4 * hkv * d].view(t, hkv, d)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(cache_dtype)
    expected = cache.clone()
    meta = Batch([(0, 1)], 1, 1, 16, 16, torch.float32).meta  # only slot_mapping is read
    meta.slot_mapping = slots
    TorchPagedAttention().write_kv(expected, k, v, meta)
    padded = torch.cat([slots, torch.tensor([-1])])  # a padding row with no slot writes nothing
    dev_cache = cache.to(DEVICE)
    pad_row = torch.full((1, hkv, d), 7.0, dtype=dtype)
    tk.store_kv(torch.cat([k, pad_row]).to(DEVICE), torch.cat([v, pad_row]).to(DEVICE),
                dev_cache[0], dev_cache[1], padded.to(DEVICE))
    assert torch.equal(dev_cache.cpu(), expected)


# -- decode: one query per sequence, split-KV ----------------------------------------------------------
DECODE_LENGTHS = [1, 15, 16, 17, 300]


@pytest.mark.parametrize("hq, hkv, block_size, d, splits, dtype", [
    (4, 4, 16, 64, 1, torch.float32),    # GQA ratio 1
    (6, 2, 16, 64, 4, torch.float32),    # ratio 3
    (8, 1, 16, 128, 4, torch.float16),   # ratio 8
    (6, 2, 8, 128, 2, torch.float16),
    (8, 1, 32, 80, 8, torch.float32),    # head_dim not a power of two; more splits than some sequences need
    (6, 2, 16, 64, 2, torch.bfloat16),
], ids=lambda x: str(x).removeprefix("torch."))
def test_decode_matches_reference(hq, hkv, block_size, d, splits, dtype):
    batch = Batch([(n - 1, 1) for n in DECODE_LENGTHS], hq, hkv, d, block_size, dtype, seed=splits)
    assert max_err(batch.triton(splits), batch.reference()) <= TOL[dtype] * batch.v_max


# -- prefill and extend: ragged new tokens over cached prefixes ------------------------------------------
MIXED = [(0, 17), (16, 15), (0, 1), (280, 5), (14, 1), (3, 40)]  # prefill, prefix hits, decode rows


@pytest.mark.parametrize("hq, hkv, block_size, d, dtype, block_m", [
    (4, 4, 16, 64, torch.float32, None),
    (6, 2, 16, 64, torch.float16, None),
    (8, 1, 16, 128, torch.float32, None),
    (6, 2, 32, 64, torch.float32, 16),  # 16 rows hold 5 tokens x 3 heads: one row idle per tile
    (8, 1, 8, 64, torch.float16, 32),
    # compiled on a GPU only (the interpreter upcasts bf16): Llama-3-8B's heads in the dtype it serves in
    *([(32, 8, 16, 128, torch.bfloat16, None)] if CUDA else []),
], ids=lambda x: str(x).removeprefix("torch."))
def test_prefill_and_extend_match_reference(hq, hkv, block_size, d, dtype, block_m):
    batch = Batch(MIXED, hq, hkv, d, block_size, dtype, seed=hq)
    assert max_err(batch.triton(block_m=block_m), batch.reference()) <= TOL[dtype] * batch.v_max


@pytest.mark.parametrize("block_m", [16, 64, 128])
def test_long_prompts_mix_unmasked_and_diagonal_key_tiles(block_m):
    """Prompts longer than a few key tiles: each query tile reads its keys before its first row unmasked, whole
    BLOCK_N tiles at a time, and the causal diagonal and the ragged end masked; tile starts fall on, before and after
    BLOCK_N boundaries (5, 21 and 42 tokens per tile with 3 heads per KV head), with and without a cached prefix."""
    batch = Batch([(0, 200), (50, 151), (64, 64), (0, 129)], 6, 2, 64, 16, torch.float32, seed=block_m)
    assert max_err(batch.triton(block_m=block_m), batch.reference()) <= 1e-5 * batch.v_max


def test_splits_also_merge_multi_token_queries():
    """Speculative verification splits too: rows of one tile see different key ranges per split (the
    first sequence's 205 keys make four 64-key chunks, the last one partly beyond some rows' limit)."""
    batch = Batch([(200, 5), (0, 3), (140, 1)], 6, 2, 64, 16, torch.float32)
    assert max_err(batch.triton(num_splits=4), batch.reference()) <= 1e-5 * batch.v_max


def test_launches_outside_the_fixed_set_are_refused():
    """A split count or tile outside kernel_buckets' set would compile on the serving path."""
    for bad in (dict(num_splits=3, block_m=16), dict(num_splits=1, block_m=48), dict(num_splits=1, block_m=16,
                                                                                     block_n=16)):
        with pytest.raises(ValueError, match="fixed launch set"):
            AttentionLaunch(**bad)


def test_one_long_sequence_among_short_ones_splits_and_matches_the_reference():
    """The uneven decode batch of the split heuristic: one long context among 15 short ones. The chooser
    splits it (on a 16-SM device; in the interpreter the backend counts one SM) and the split, partly
    empty for the short sequences, merges to the reference."""
    seqs = [(700, 1)] + [(n, 1) for n in (0, 1, 3, 7, 15, 16, 20, 31, 2, 5, 9, 12, 40, 63, 64)]
    batch = Batch(seqs, 4, 2, 32, 16, torch.float32, seed=5)
    launch = choose_attention_launch(1, batch.meta.seq_lens_cpu, group=2, num_kv_heads=2, num_sms=16)
    assert launch.num_splits == 2  # 701 keys: at most 2 chunks of >= 256 (the cap), though 16 SMs want more
    assert max_err(batch.triton(launch=launch), batch.reference()) <= 1e-5 * batch.v_max
    launch = AttentionLaunch(8, launch.block_m)  # most splits of most sequences are empty
    assert max_err(batch.triton(launch=launch), batch.reference()) <= 1e-5 * batch.v_max


# -- the backend ---------------------------------------------------------------------------------
def test_backend_writes_then_attends_like_the_torch_backend():
    batch = Batch([(30, 1), (0, 9), (17, 4)], 6, 2, 64, 16, torch.float32)
    q, cache, meta = batch.on(DEVICE)
    stale = cache.clone()
    stale.view(2, -1, 2, 64)[:, meta.slot_mapping] = 0.0  # the new rows are not in the cache yet
    backend = select_backend("triton", DEVICE)
    assert isinstance(backend, TritonPagedAttention)
    k, v = batch.k.to(DEVICE), batch.v.to(DEVICE)
    backend.write_kv(stale, k, v, meta)
    assert torch.equal(stale, cache)
    out = backend.attend(q, k, v, stale, meta, batch.scale)
    assert max_err(out.cpu(), batch.reference()) <= 1e-5 * batch.v_max


def test_prefill_tuning_keeps_the_fastest_launch_and_prompts_take_it(monkeypatch):
    """tune_prefill (CUDA start-up) runs every candidate launch (here in the interpreter, on a 32-token prompt),
    keeps the fastest (made-up times: 128-row tiles, 8 warps, 3 stages), and the backend then launches prompt chunks
    with it, still equal to the reference; short-query batches keep the chooser's launch and Triton's defaults."""
    from sluice_engine.attention import triton_paged

    backend = TritonPagedAttention(DEVICE)
    made_up = iter([5.0, 4.0, 3.0, 1.0, 2.0])  # in PREFILL_CANDIDATES' order

    def timer(fn):
        fn()  # each candidate runs
        return next(made_up)

    times = backend.tune_prefill(6, 2, 64, torch.float32, 16, DEVICE, max_tokens=32, timer=timer)
    assert len(times) == len(triton_paged.PREFILL_CANDIDATES)
    assert backend.prefill_config == (128, 8, 3)
    seen = []
    real = tk.paged_attention
    monkeypatch.setattr(triton_paged.tk, "paged_attention",
                        lambda *a, **kw: seen.append((kw["launch"], kw.get("num_warps"), kw.get("num_stages")))
                        or real(*a, **kw))
    for seqs in ([(0, 40), (20, 30), (5, 1)], [(30, 1), (7, 2)]):
        batch = Batch(seqs, 6, 2, 64, 16, torch.float32)
        q, cache, meta = batch.on(DEVICE)
        out = backend.attend(q, batch.k.to(DEVICE), batch.v.to(DEVICE), cache, meta, batch.scale)
        assert max_err(out.cpu(), batch.reference()) <= 1e-5 * batch.v_max
    assert seen[0] == (AttentionLaunch(1, 128), 8, 3)
    assert seen[1][0].block_m == block_m_for(2, 3) and seen[1][1:] == (None, None)


def test_auto_is_never_triton_on_cpu():
    """Off CUDA, auto picks the C++ CPU kernels when they build, else the torch reference."""
    from sluice_engine import cpu_kernels

    want = "cpu" if cpu_kernels.load() is not None else "torch"
    assert select_backend("auto", torch.device("cpu")).name == want


def test_triton_off_cuda_without_the_interpreter_names_the_flag(monkeypatch):
    monkeypatch.setattr(tk, "INTERPRETER_READY", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", torch.device("cpu"))


# -- end to end: the engine's greedy tokens do not depend on the backend ------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A 2-layer Llama (6 query heads over 2 KV heads) with random weights, as an HF directory."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.slow
def test_engine_greedy_tokens_match_the_torch_backend(tiny_llama):
    from sluice_engine.entrypoints.llm import LLM
    from sluice_engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, VOCAB, (12,), generator=g).tolist()
    first = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 23)] + [shared + [1, 2, 3]]
    second = [shared + [4, 5]]  # a prefix-cache hit on the shared blocks
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)

    def run(backend: str, prompts_list):
        # block size 4 and a 16-token budget: chunked prefill mixes prompt chunks with decode rows.
        llm = LLM(str(tiny_llama), device=DEVICE.type, dtype="float32", block_size=4, kv_cache_memory=1 << 20,
                  max_num_batched_tokens=16, attention_backend=backend)
        assert llm.engine.runner.backend.name == backend
        if backend == "triton":
            llm.engine.runner.backend.num_splits = 2  # exercise the split-KV merge in the decode steps
        return [llm.generate(prompts, params) for prompts in prompts_list]

    want = run("torch", [first, second])
    got = run("triton", [first, second])
    assert got[1][0].num_cached_tokens == want[1][0].num_cached_tokens == 12
    assert len({t for batch in want for c in batch for t in c.token_ids}) > 6  # not one repeated token
    for w_batch, g_batch in zip(want, got, strict=True):
        for w, c in zip(w_batch, g_batch, strict=True):
            assert c.token_ids == w.token_ids
            for wl, cl in zip(w.logprobs, c.logprobs, strict=True):
                assert abs(wl[0] - cl[0]) < 1e-4  # the sampled token's logprob


class ReplayByRerun:
    """torch.cuda's graphs on CPU (as tests/engine/test_cuda_graphs.py's): capture keeps the forward, replay reruns it."""

    def __init__(self):
        self.replays = 0

    def warm_up(self, fn):
        fn()

    def capture(self, fn):
        out = fn()

        def replay():
            self.replays += 1
            out.copy_(fn())

        return replay, out

    def synchronize(self):
        pass


@pytest.mark.slow
def test_full_warmup_runs_exactly_the_launch_set(tiny_llama, tmp_path, monkeypatch):
    """The engine's full warm-up over the Triton backend, with decode CUDA graphs captured (on CPU by a stand-in
    graph API, as on a GPU): the launches the backend actually issued in the warm-up steps are the enumerated
    set (split counts 1, 2 and 4 for a 1024-token window), and the report is that record. The steps run eagerly,
    never replaying a graph, so the eager decode variants compile too; the graphs' own launches (compiled at
    capture) are members of the set. In the interpreter the backend counts one SM, which never splits: it is
    given 16 here."""
    import shutil

    from sluice_engine.attention.kernel_buckets import attention_launches
    from sluice_engine.entrypoints.llm import LLM
    from sluice_engine.sampling_params import SamplingParams
    from sluice_engine.worker import model_runner

    api = ReplayByRerun()
    if not CUDA:  # as on a GPU: graphs captured when the KV cache is allocated, with 16 SMs' split choices
        monkeypatch.setattr(model_runner, "graphs_off_reason", lambda *a: None)
        monkeypatch.setattr(model_runner.ModelRunner, "_graph_api", lambda self: api)
        init = TritonPagedAttention.__init__

        def sixteen_sms(self, *a, **kw):
            init(self, *a, **kw)
            self.num_sms = 16

        monkeypatch.setattr(TritonPagedAttention, "__init__", sixteen_sms)
    model = tmp_path / "tiny-llama-1k"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    llm = LLM(str(model), device=DEVICE.type, dtype="float32", kv_cache_memory=1 << 20, max_num_seqs=4,
              max_num_batched_tokens=64, attention_backend="triton", warmup="full")
    runner = llm.engine.runner
    backend = runner.backend
    want = attention_launches(3, 2, backend.num_sms, llm.engine.max_model_len)
    assert {x.num_splits for x in want} == {1, 2, 4}
    graphs = runner.graphs
    assert graphs is not None and {s for _, s in graphs.captured} == {1, 2, 4}
    assert backend.issued and backend.issued <= want  # what capture compiled: decode tiles of the set
    replays = 0
    replay = graphs.replay

    def counted(key):
        nonlocal replays
        replays += 1
        return replay(key)

    graphs.replay = counted
    backend.issued.clear()  # from here on: what the warm-up steps themselves launch
    report = llm.engine.warm_up()
    assert replays == 0  # eagerly: a decode batch with no graph, or graphs off, finds its variants compiled
    assert report.launches == backend.issued == want
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3 and replays == 2  # the decode steps replay graphs when serving
    assert backend.issued == want  # serving stays inside the set
