"""One rank's part of a step: its shard of the model weights and of the paged KV cache, and the
forward of a SchedulerOutput (prepare -> forward -> logits). Every rank runs the same step from the
same plain data; pipeline stages pass hidden states on, and the logits reach rank 0, which samples
(sample/step_sampler.py). With one rank this is the whole model and every collective is a no-op."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..attention.backend import select_backend
from ..config import EngineConfig
from ..core.sched_output import PLACEHOLDER, SchedulerOutput
from ..device_io import upload
from ..distributed import parallel_state as ps
from ..distributed.layout import RankShard, rank_shard
from ..forward_context import ForwardContext, forward_context
from ..model_config import ModelConfig
from ..model_fetch import OfflineError, gguf_source
from ..models.loader import (
    checkpoint_quantization,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_quantization,
)
from ..quant.formats import CPU_FORMATS, GPU_FORMATS, check_kv_cache_dtype
from ..sample.step_sampler import SampledTokens
from ..step_timeline import StepTimeline, span
from .cuda_graphs import (
    DecodeGraphs,
    GraphState,
    TorchCudaGraphs,
    capture_sizes,
    decode_workspaces,
    graphs_off_reason,
)
from .host_memory import lazy_zeros
from .input_buffers import InputBuffers
from .model_input import ModelInput

log = logging.getLogger("sluice.engine")


# A step with more runs of adapter tokens than this takes the grouped torch path (lora/ops.py: tokens gathered by
# slot, a batched product per projection); with fewer, a product per run over slices of the batch gathers nothing.
MAX_LORA_RUNS_UNGROUPED = 2
# Whether an fp32 model on CPU runs LoRA through the C++ kernel when it is built (lora/cpu_ops.py); a benchmark
# turns it off to time the torch paths beside it.
LORA_CPU_KERNEL = True


def max_model_len(cfg: EngineConfig, mc: ModelConfig) -> int:
    limit = mc.max_position_embeddings
    if mc.sliding_window is not None and mc.sliding_window < limit:
        log.warning("sliding-window attention is not implemented: context capped to the window (%d)",
                    mc.sliding_window)
        limit = mc.sliding_window
    if cfg.max_model_len is not None and cfg.max_model_len > limit:
        raise ValueError(f"--max-model-len {cfg.max_model_len} exceeds what this model supports ({limit} tokens)")
    return cfg.max_model_len or limit


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_dir: Path, rank: int = 0, local_rank: int = 0):
        self.cfg = cfg
        self.device = resolve_device(cfg.device, local_rank)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.model_config = mc = ModelConfig.from_dir(model_dir)
        self.shard: RankShard = rank_shard(mc, cfg.tensor_parallel_size, cfg.pipeline_parallel_size, rank)
        self.max_model_len = max_model_len(cfg, mc)
        self.backend = select_backend(cfg.attention_backend, self.device)
        check_kv_cache_dtype(cfg.kv_cache_dtype, self.device.type, self.backend.name)  # auto now resolved
        # fp8: e4m3 elements, one scale per layer for K and one for V (models/llama.py Attention.kv_scale).
        # NOTE: a draft model's cache stays in the model dtype (spec_decode/draft_model.py): it is small, and
        # its drafts are verified by the target anyway.
        self.kv_cache_dtype = torch.float8_e4m3fn if cfg.kv_cache_dtype == "fp8" else self.dtype
        gguf = self._gguf(cfg)
        self.quantization = resolve_quantization(cfg, self.device, self.dtype, self.backend,
                                                 checkpoint_quantization(model_dir), gguf,
                                                 unsharded=self.shard.tp * self.shard.pp == 1)
        self._say_dense_gguf_dir(cfg, model_dir, gguf)
        if self.quantization in (*CPU_FORMATS, "auto") and self.backend.name == "cpu":
            # A GGUF served in its own blocks on CPU computes as llama.cpp does, bit for bit (attention/ggml_cpu.py:
            # int8 activations make any other rounding a different answer at near-ties), in an fp16 cache.
            from ..attention.ggml_cpu import KV_DTYPE, GgmlCpuAttention
            from ..cpu_kernels import load as load_kernels

            lib = load_kernels()
            if lib.sluice_ggml_attention_supports_head_dim(mc.head_dim):
                self.backend = GgmlCpuAttention(lib)
                self.kv_cache_dtype = KV_DTYPE
            else:
                log.warning("head dim %d: the llama.cpp-exact attention takes multiples of 16 up to 256; serving "
                            "with the cpu backend (right to float rounding, not llama.cpp's bit for bit)", mc.head_dim)
        self.model = load_model(model_dir, mc, self.backend, self.device, self.dtype, self.max_model_len, self.shard,
                                quantization=self.quantization, numerics=cfg.numerics,
                                gguf_path=gguf if self.quantization in (*CPU_FORMATS, "auto") else None)
        if cfg.kv_cache_dtype == "fp8":
            self._log_kv_scales()
        if self.device.type == "cuda" and self.backend.name == "triton":
            # The prefill launch (tile rows, warps, stages) that is fastest on this card, timed once here
            # (attention/triton_paged.py) before warm-up compiles it.
            self.backend.tune_prefill(self.shard.num_heads, self.shard.num_kv_heads, mc.head_dim, self.dtype,
                                      cfg.block_size, self.device, cfg.max_num_batched_tokens)
        if self.device.type == "cuda" and self.quantization in GPU_FORMATS:
            # Which GEMM each quantized layer's shape takes at each M bucket, timed here once (quant/gemm_paths.py)
            # before warm-up compiles and captures the paths chosen.
            from ..quant.gemm_paths import measure_model

            measure_model(self.model, cfg.max_num_batched_tokens, self.dtype, self.device)
        self.lora = None  # the LoRA layers and adapters (lora/model.py), with --enable-lora
        if cfg.enable_lora:
            from ..lora.model import LoRAModel

            # Adapters are registered by the engine (LLMEngine.load_lora), at start and while it runs.
            self.lora = LoRAModel(self.model, mc, self.shard, cfg.max_loras, cfg.max_lora_rank, self.dtype,
                                  self.device, cfg.max_cpu_loras)
        if self.lora is None and self.backend.name == "ggml":
            # A GGUF served in its blocks on CPU: its layer loop in one C++ call (the same floats, less Python).
            from ..cpu_kernels import load as load_kernels
            from ..models.ggml_decoder import GgmlDecoderStack

            self.model.fused_layers = GgmlDecoderStack.build(self.model, load_kernels(), cfg.max_num_batched_tokens)
        self._lora_cpu_kernel = False  # LoRA through cpu_kernels/lora.cpp (an fp32 model on CPU, kernels built)
        if cfg.enable_lora and self.device.type == "cpu" and self.dtype == torch.float32:
            from ..lora.cpu_ops import cpu_kernel

            self._lora_cpu_kernel = cpu_kernel() is not None
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.kv_tier = None  # the offload tier's memory (worker/kv_tier.py), with --kv-offload-bytes
        self.inputs: InputBuffers | None = None  # the step's persistent inputs, once the KV cache is allocated
        self.graphs: DecodeGraphs | None = None  # captured decode graphs (CUDA only)
        self.graph_state = GraphState("off", "the KV cache is not allocated yet")
        self._eager_only = False  # set by eager_steps(): every step runs eagerly, graphs or not
        # Async scheduling: the previous step's sampled tokens, still on the device, where this step's
        # PLACEHOLDER inputs come from (set by the engine once it has queued that step's sampling).
        self.placeholder_source: SampledTokens | None = None
        self.timeline: StepTimeline | None = None  # where a step's time goes (a benchmark sets it)
        self._lora_segments = None  # the current step's tokens by LoRA slot (set by execute_model)
        # With LoRA, a decode graph's input: each row's adapter slot (0 = none, padding rows too), read by the
        # captured shrink/expand kernels; a replay fills its first rows (_prepare_lora).
        self._lora_graph_slots = (torch.zeros(cfg.max_num_seqs, dtype=torch.int64, device=self.device)
                                  if cfg.enable_lora else None)

    # -- the KV cache --------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in this rank's layers and KV heads. How many blocks the budget holds
        is memory_profile.plan_kv_cache's to say (with the draft's cache, out of the same budget)."""
        sh = self.shard
        return 2 * sh.num_layers * sh.num_kv_heads * self.model_config.head_dim * self.kv_cache_dtype.itemsize

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.cfg.block_size

    def offload_blocks_wanted(self) -> int:
        """Blocks of this rank's KV that --kv-offload-bytes holds (0: no tier; it keeps the prefix cache's
        evictions, so none without prefix caching)."""
        if not self.cfg.kv_offload_bytes or not self.cfg.enable_prefix_caching:
            return 0
        return self.cfg.kv_offload_bytes // self.kv_bytes_per_block

    def allocate_kv_cache(self, num_blocks: int, offload_blocks: int = 0) -> None:
        """Every rank allocates the same number of blocks (the smallest rank's capacity): block ids
        mean the same slots on every rank; the same for the offload tier's slots."""
        sh = self.shard
        # One block more than the KV manager hands out: the scratch block (id num_blocks), where the padding
        # rows of a CUDA graph's batch write and read (worker/cuda_graphs.py).
        self.kv_caches = self._new_kv_cache(num_blocks + 1)
        self.num_blocks = num_blocks
        on_rank = "" if sh.tp * sh.pp == 1 else f" on rank {sh.rank}"
        log.info("KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB%s)", num_blocks, self.cfg.block_size,
                 num_blocks * self.cfg.block_size, self.kv_cache_bytes / 2**20, on_rank)
        if offload_blocks:
            from .kv_tier import KVTier

            self.kv_tier = KVTier(offload_blocks, self.kv_caches)
            log.info("KV offload tier: %d blocks = %d tokens (%.1f MiB of host memory%s)", offload_blocks,
                     offload_blocks * self.cfg.block_size, self.kv_tier.nbytes / 2**20, on_rank)
        self._setup_step_inputs()

    def _say_dense_gguf_dir(self, cfg: EngineConfig, model_dir: Path, gguf: Path | None) -> None:
        """A directory converted from a GGUF, named by --model, is served as its fp32 weights (dequantized from the
        GGUF) under --quantization auto, where the .gguf file itself, or the bundled model with --model left out,
        would serve the GGUF's own blocks: 5x fewer bytes per step and llama.cpp's numbers. Said at start-up
        because the two look alike from outside (benchmarks/vllm_bench_serve.py measured the fp32 path as
        Sluice's default until 2026-12-08)."""
        if (cfg.quantization != "auto" or self.quantization != "none" or gguf is not None or self.device.type != "cpu"
                or self.shard.tp * self.shard.pp != 1):  # sharded, even the .gguf file is served dense
            return
        from ..models.gguf_checkpoint import gguf_checkpoint

        source = gguf_checkpoint(model_dir)
        if source is not None and not any(Path(model_dir).glob("*.safetensors")):
            log.info("%s was converted from %s: serving its fp32 weights; to serve the GGUF's own blocks on CPU, "
                     "name the .gguf file with --model (or leave --model out for the bundled model)", model_dir,
                     source.name)

    @staticmethod
    def _gguf(cfg: EngineConfig) -> Path | None:
        """The GGUF behind --model (quantization auto serves its own blocks on CPU); for auto, None rather than
        a failed start where the bundled model's GGUF is not kept and cannot be fetched (offline)."""
        try:
            return gguf_source(cfg.model)
        except OfflineError:
            if cfg.quantization != "auto":
                raise
            log.warning("the bundled model's GGUF is not here (offline): serving its fp32 weights")
            return None

    @contextmanager
    def scratch_kv_cache(self, num_blocks: int) -> Iterator[None]:
        """A throwaway cache for the memory profile's dummy step, before the real one is sized."""
        assert not self.kv_caches, "the memory profile runs before the KV cache is allocated"
        self.kv_caches = self._new_kv_cache(num_blocks)
        self.inputs = self._new_inputs(scratch_block=None)  # the dummy step's rows go with it
        try:
            yield
        finally:
            self.kv_caches = []
            self.inputs = None

    def _new_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        sh = self.shard
        shape = (2, num_blocks, self.cfg.block_size, sh.num_kv_heads, self.model_config.head_dim)
        if self.device.type == "cpu":
            return [lazy_zeros(shape, self.kv_cache_dtype) for _ in range(sh.num_layers)]
        return [torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device) for _ in range(sh.num_layers)]

    def _log_kv_scales(self) -> None:
        layers = [layer.self_attn for layer in self.model.layers]
        loaded = sum(a.kv_scale_source == "checkpoint" for a in layers)
        if loaded:
            k, v = torch.stack([a.kv_scale for a in layers]).cpu().T.tolist()
            log.info("KV cache fp8 (e4m3): the checkpoint's k_scale/v_scale for %d of %d layers (k %.3g..%.3g, "
                     "v %.3g..%.3g), 1.0 elsewhere", loaded, len(layers), min(k), max(k), min(v), max(v))
        else:
            # Without calibrated scales, 1.0 (as vLLM): K/V as bf16 models make them sit well inside e4m3's +-448
            # (larger values saturate), at e4m3's relative precision of 2^-4 from 2^-6 up; below 2^-6 the steps are
            # 2^-9 absolute, coarser relative to the value (a layer whose values are mostly that small loses most).
            log.info("KV cache fp8 (e4m3): no k_scale/v_scale in the checkpoint; scales 1.0")

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.kv_bytes_per_block

    # -- persistent inputs and CUDA graphs ------------------------------------------------------
    def _setup_step_inputs(self) -> None:
        cfg = self.cfg
        self.inputs = self._new_inputs(scratch_block=self.num_blocks)
        self.graphs = None
        reason = graphs_off_reason(cfg.enforce_eager, self.device, self.backend.name, cfg.world_size)
        if reason is not None:
            self.graph_state = GraphState("off", reason)
            if self.device.type == "cuda":
                log.info("CUDA graphs off: %s", reason)
            return
        try:
            plan = self.graph_plan()
            workspaces = decode_workspaces(plan, self.shard.num_heads, self.model_config.head_dim, self.dtype,
                                           self.device)
            graphs = DecodeGraphs(plan, self.inputs, self.graph_forward, workspaces, self._graph_api(),
                                  self.decode_splits)
            graphs.capture()
        except Exception as e:
            # A capture that fails (a driver, a kernel that is not capturable) costs speed, not service:
            # every step runs eagerly, over fresh buffers (capture froze the first ones). Logged with why, the
            # traceback as an error and a one-line warning that says what it costs; the metrics show it.
            log.exception("CUDA graph capture failed: every step runs eagerly (--enforce-eager skips capture)")
            self.graph_state = GraphState("failed", f"{type(e).__name__}: {e}")
            log.warning("CUDA graphs failed (%s): decode steps run eagerly, several times slower",
                        self.graph_state.reason)
            self.inputs = self._new_inputs(scratch_block=self.num_blocks)
            return
        self.graphs = graphs
        self.graph_state = GraphState("on", captured=len(graphs.captured))

    def graph_plan(self) -> dict[int, list[int]]:
        """Decode graphs to capture: batch size -> split counts. Per size, every count the backend's chooser can
        return for the batches that replay it (more than the next smaller size holds): worker/cuda_graphs.py."""
        from ..attention.kernel_buckets import decode_split_choices

        sizes = capture_sizes(min(self.cfg.cuda_graph_max_batch, self.cfg.max_num_seqs))
        fixed = self.backend.num_splits  # tests fix it: every short-query batch gets that count
        return {n: [fixed] if fixed else decode_split_choices(prev + 1, self.shard.num_kv_heads, self.backend.num_sms,
                                                             self.max_model_len)
                for prev, n in zip([0, *sizes], sizes, strict=False)}

    def decode_splits(self, seq_lens: list[int]) -> int:
        """The split count the attention backend launches for a decode batch of these contexts (a step's real
        rows): a replayed graph has the count an eager step of the same batch would choose."""
        sh = self.shard
        return self.backend.choose(1, seq_lens, sh.num_heads // sh.num_kv_heads, sh.num_kv_heads).num_splits

    @contextmanager
    def eager_steps(self) -> Iterator[None]:
        """Steps inside run eagerly even where a graph holds their batch (warm-up: the eager variants of the
        decode kernels compile too; the graphs' compiled at capture)."""
        prev, self._eager_only = self._eager_only, True
        try:
            yield
        finally:
            self._eager_only = prev

    def _graph_api(self) -> TorchCudaGraphs:
        return TorchCudaGraphs(self.device)

    def _new_inputs(self, scratch_block: int | None) -> InputBuffers:
        cfg = self.cfg
        # Requests that may hold a block-table row at once: every virtual engine's running batch.
        pp = cfg.pipeline_parallel_size
        return InputBuffers(max_tokens=cfg.max_num_batched_tokens, max_rows=-(-cfg.max_num_seqs // pp) * pp,
                            max_model_len=self.max_model_len, block_size=cfg.block_size, device=self.device,
                            scratch_block=scratch_block)

    # -- one step ------------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput, pad_to: int | None = None) -> ModelInput:
        """The step's inputs, written into the persistent buffers (views of them are returned)."""
        assert self.inputs is not None, "allocate_kv_cache() first"
        rows, _ = sched.logits_layout()
        return self.inputs.prepare(sched.scheduled, rows, sched.freed_req_ids, pad_to)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """Run this rank's part of the step. Returns the logits ([rows of logits_layout(), vocab],
        float32) when this rank is rank 0 and holds the last stage; None otherwise (a stage hands its
        hidden states on; the last stage sends its logits to rank 0, which collects them: executor.py)."""
        graph = self.graphs.key(sched) if self.graphs is not None and not self._eager_only else None
        with span(self.timeline, "prepare"):
            inp = self.prepare(sched, graph[0] if graph is not None else None)
            self._fill_placeholders(sched, inp.input_ids)
            self._lora_segments = self._prepare_lora(sched, graph[0] if graph is not None else None)
        with span(self.timeline, "forward"):
            return self._forward_step(sched, inp, graph)

    def _forward_step(self, sched: SchedulerOutput, inp: ModelInput, graph) -> torch.Tensor | None:
        if sched.kv_stores or sched.kv_loads:  # first: a store saves a block before anything here reuses it
            self.kv_tier.move(self.kv_caches, sched.kv_stores, sched.kv_loads)
        if sched.block_copies:
            self._copy_blocks(sched.block_copies)
        sh = self.shard
        hidden_in = None
        if not sh.is_first_stage:
            hidden_in = ps.recv_hidden((inp.num_tokens, self.model_config.hidden_size), self.dtype, self.device)
        hidden = self.graphs.replay(graph) if graph is not None else self.forward(inp, hidden_in)
        if not sh.is_last_stage:
            ps.send_hidden(hidden)
            return None
        rows = inp.logits_rows.numel()
        if not rows:
            return torch.empty(0, self.model_config.vocab_size, device=self.device) if sh.rank == 0 else None
        logits = self.model.compute_logits(hidden[inp.logits_rows])  # on the stage's first TP rank only
        if logits is None or sh.rank == 0:
            return logits
        ps.send_logits(logits)
        return None

    def _fill_placeholders(self, sched: SchedulerOutput, input_ids: torch.Tensor) -> None:
        """Async scheduling: a request's token sampled by the step before this one was a PLACEHOLDER when this
        step was scheduled. It is copied from that step's sampled tokens on the device, behind the step's inputs,
        so the host never waits for the sampling (the token reaches the host later, with its step's outputs)."""
        at: list[int] = []
        rows: list[int] = []
        gone: list[int] = []
        base = 0
        src = self.placeholder_source
        for s in sched.scheduled:
            known = s.num_tokens - s.num_drafts
            if known and s.token_ids[known - 1] == PLACEHOLDER:
                if src is not None and s.request_id in src.row_of:
                    at.append(base + known - 1)
                    rows.append(src.row_of[s.request_id])
                else:  # the request ended before that step sampled: its row here is computed for nobody
                    gone.append(base + known - 1)
            base += s.num_tokens
        if gone:
            input_ids.index_fill_(0, upload(self.device, {"gone": gone})["gone"], 0)
        if not at:
            return
        idx = upload(self.device, {"at": at, "rows": rows})
        input_ids.index_copy_(0, idx["at"], src.tokens.index_select(0, idx["rows"]).to(input_ids.dtype))

    def _prepare_lora(self, sched: SchedulerOutput, graph_size: int | None = None):
        """Load the adapters this step needs into their slots, and the step's tokens by slot (for a graph replay:
        written into the graph's slot input instead)."""
        if self.lora is None:
            return None
        from ..lora.cpu_ops import rows_by_slot
        from ..lora.ops import LoRASegments, kernels_run_on

        for ref in sched.lora_drops:
            self.lora.forget(ref)
        for slot, ref in sched.lora_loads:
            self.lora.load_slot(slot, ref)
        sizes, slots = [s.num_tokens for s in sched.scheduled], [s.lora_slot for s in sched.scheduled]
        if graph_size is not None:  # a decode step: one token per request, padding rows on slot 0
            rows = [slot for n, slot in zip(sizes, slots, strict=True) for _ in range(n)]
            rows += [0] * (graph_size - len(rows))
            self._lora_graph_slots[:graph_size].copy_(upload(self.device, {"slots": rows})["slots"])
            return None
        segs = LoRASegments.from_requests(sizes, slots)
        if not segs:
            return segs
        if kernels_run_on(self.device):  # the Triton kernels read every token's slot
            per_token = [slot for n, slot in zip(sizes, slots, strict=True) for _ in range(n)]
            segs.token_slots = upload(self.device, {"slots": per_token})["slots"]
            return segs
        if self._lora_cpu_kernel and LORA_CPU_KERNEL:  # one C++ call per LoRA layer, whatever the runs (lora/cpu_ops.py)
            rows, row_slots = rows_by_slot(sizes, slots)
            segs.by_slot = (torch.tensor(rows, dtype=torch.int64), torch.tensor(row_slots, dtype=torch.int64))
            return segs
        if len(segs.slots) > MAX_LORA_RUNS_UNGROUPED:  # else a product per run, over slices (no gathers)
            segs.groups = self._lora_groups(sizes, slots)
        return segs

    def _lora_groups(self, sizes: list[int], slots: list[int]):
        """The torch path's buckets of tokens by slot (lora/ops.py), on the device."""
        from ..lora.ops import LoRAGroup, group_tokens

        groups = []
        for b_slots, b_rows in group_tokens(sizes, slots):
            length = len(b_rows[0])
            rows = [r for toks in b_rows for r in (*toks, *[0] * (length - len(toks)))]
            short = [[i >= len(toks) for i in range(length)] for toks in b_rows]
            dev = upload(self.device, {"rows": rows, "slots": b_slots})
            pad = None
            if any(len(toks) < length for toks in b_rows):
                pad = torch.tensor(short, dtype=torch.bool).view(len(b_slots), length, 1).to(self.device)
            groups.append(LoRAGroup(dev["rows"], dev["slots"], pad, len(b_slots), length))
        return groups

    def graph_forward(self, inp: ModelInput) -> torch.Tensor:
        """The forward a decode graph captures: with LoRA, every row goes through the adapters' shrink/expand by
        the slots in the graph's slot input (rows on slot 0 get nothing added), whatever the step holds."""
        if self._lora_graph_slots is not None:
            from ..lora.ops import LoRASegments

            n = inp.num_tokens
            self._lora_segments = LoRASegments([0], [n], [1], token_slots=self._lora_graph_slots[:n])
        return self.forward(inp)

    def forward(self, inp: ModelInput, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        with forward_context(ForwardContext(inp.attn, self.kv_caches, self._lora_segments)):
            return self.model(inp.input_ids, inp.positions, hidden_in)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Cache blocks as one host tensor, [blocks, layers, 2, block_size, kv_heads, head_dim] (a KV export)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        fp8 = self.kv_cache_dtype == torch.float8_e4m3fn  # index ops take no float8: move the bytes
        per_layer = [(cache.view(torch.uint8) if fp8 else cache).index_select(1, ids).transpose(0, 1)
                     for cache in self.kv_caches]
        out = torch.stack(per_layer, dim=1).cpu().contiguous()
        return out.view(self.kv_cache_dtype) if fp8 else out

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([a for a, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([b for _, b in copies], dtype=torch.long, device=self.device)
        for cache in self.kv_caches:  # [2, num_blocks, ...]: K and V of each block in one copy
            if cache.dtype == torch.float8_e4m3fn:  # torch's index_copy_ takes no float8: copy the bytes
                cache = cache.view(torch.uint8)
            cache.index_copy_(1, dst, cache.index_select(1, src))
