"""Turns a schedule into one forward pass: builds the batch tensors and the forward context, runs
the model, samples. Owns the model weights and the KV cache tensors."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from .attention.backend import select_backend
from .config import EngineConfig
from .forward_context import AttentionMetadata, ForwardContext, forward_context
from .kv_cache import KVCacheManager
from .models.llama import LlamaForCausalLM
from .models.model_config import ModelConfig
from .request import Request
from .sampler import Sampler, TokenLogprobs, top_logprobs
from .scheduler import SchedulerOutput

log = logging.getLogger("sluice.engine")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # fp32 on CPU: bf16 matmuls are several times slower for prefill on common x86 CPUs.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass(slots=True)
class StepResult:
    """What one forward produced for one scheduled request."""

    request: Request
    num_scheduled: int
    # New tokens: [] for a prompt chunk that did not reach the end of the prompt, one token normally,
    # accepted drafts + one more with speculative decoding.
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[TokenLogprobs] | None
    # Draft tokens computed this step but rejected: their KV slots hold garbage until overwritten.
    num_rejected: int = 0


def load_model(model_dir: Path, mc: ModelConfig, backend, device: torch.device, dtype: torch.dtype,
               max_positions: int) -> LlamaForCausalLM:
    """The model of an HF directory, built directly in `dtype` on `device` (no fp32 copy of the
    weights ever exists), in eval mode."""
    t0 = time.perf_counter()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(mc, backend, max_positions=max_positions)
    finally:
        torch.set_default_dtype(default_dtype)
    tensors = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f), device=str(device)))
    if not tensors:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    model.load_hf_weights(tensors)
    del tensors
    log.info("loaded %s (%s, %d layers, %.1fM params) on %s in %.1fs", model_dir, mc.architecture, mc.num_layers,
             sum(p.numel() for p in model.parameters()) / 1e6, device, time.perf_counter() - t0)
    if backend.name == "cpu" and dtype == torch.float32:  # the C++ CPU path: linear layers too
        from .cpu_kernels.linear import pack_linears

        pack_linears(model)
    return model.eval()


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_dir: Path):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.model_config = ModelConfig.from_dir(model_dir)
        mc = self.model_config
        self.max_model_len = self._max_model_len(cfg, mc)
        self.backend = select_backend(cfg.attention_backend, self.device)

        self.model = load_model(model_dir, mc, self.backend, self.device, self.dtype, self.max_model_len)
        self.num_blocks = self._num_kv_blocks()
        shape = (2, self.num_blocks, cfg.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_layers)]
        log.info("KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB)", self.num_blocks, cfg.block_size,
                 self.num_blocks * cfg.block_size, self.kv_cache_bytes / 2**20)
        self.sampler = Sampler(self.device, cfg.seed)

    @staticmethod
    def _max_model_len(cfg: EngineConfig, mc: ModelConfig) -> int:
        limit = mc.max_position_embeddings
        if mc.sliding_window is not None and mc.sliding_window < limit:
            log.warning("sliding-window attention is not implemented: context capped to the window (%d)",
                        mc.sliding_window)
            limit = mc.sliding_window
        if cfg.max_model_len is not None and cfg.max_model_len > limit:
            raise ValueError(f"--max-model-len {cfg.max_model_len} exceeds what this model supports ({limit} tokens)")
        return cfg.max_model_len or limit

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.cfg.block_size * self.model_config.kv_bytes_per_token(self.dtype.itemsize)

    def _num_kv_blocks(self) -> int:
        per_block = self.cfg.block_size * self.model_config.kv_bytes_per_token(self.dtype.itemsize)
        budget = self.cfg.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # memory the allocator holds but does not use is free for the KV cache
                free, total = torch.cuda.mem_get_info(self.device)
                used = total - free
                # Leave headroom for activations of a full token budget (generous for small models).
                budget = int(total * self.cfg.gpu_memory_utilization) - used - (1 << 30)
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        blocks = budget // per_block
        if blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes is less than one block ({per_block} bytes)")
        return int(blocks)

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> list[StepResult]:
        bs = self.cfg.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []  # rows of the hidden states to project to logits
        row_plan: list[tuple[int, int, bool]] = []  # per request: (first logits row, count, samples?)
        for req, n in sched.scheduled:
            start = req.num_computed_tokens
            end = start + n
            block_ids = kv.block_ids(req.request_id)
            input_ids.extend(req.all_token_ids[start:end])
            if req.spec_token_ids:
                input_ids.extend(req.spec_token_ids)  # all_token_ids ends where the drafts begin
            positions.extend(range(start, end))
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            base = query_start[-1]
            query_start.append(base + n)
            seq_lens.append(end)
            tables.append(block_ids)
            num_drafts = len(req.spec_token_ids)
            samples = end == req.num_tokens + num_drafts
            if num_drafts:
                row_plan.append((len(logits_rows), num_drafts + 1, samples))
                logits_rows.extend(range(base + n - num_drafts - 1, base + n))
            elif req.params.prompt_logprobs is not None and start < req.num_prompt_tokens:
                first = len(logits_rows)
                logits_rows.extend(range(base, base + n))
                row_plan.append((first, n, samples))
            else:
                row_plan.append((len(logits_rows), 1, samples))
                logits_rows.append(base + n - 1)

        dev = self.device
        meta = AttentionMetadata.build([n for _, n in sched.scheduled], seq_lens, tables, slots, bs, dev)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        if sched.block_copies:
            src = torch.tensor([a for a, _ in sched.block_copies], dtype=torch.long, device=dev)
            dst = torch.tensor([b for _, b in sched.block_copies], dtype=torch.long, device=dev)
            for cache in self.kv_caches:  # [2, num_blocks, ...]: K and V of each block in one copy
                cache.index_copy_(1, dst, cache.index_select(1, src))
        with forward_context(ForwardContext(meta, self.kv_caches)):
            hidden = self.model(ids_t, pos_t)
        logits = self.model.compute_logits(hidden[torch.tensor(logits_rows, device=dev)])

        plain = [(req, first + count - 1) for (req, _), (first, count, s) in zip(sched.scheduled, row_plan, strict=True)
                 if s and not req.spec_token_ids]
        sampled = self.sampler(logits[[i for _, i in plain]], [r for r, _ in plain]) if plain else None
        spec = [(req, first, count) for (req, _), (first, count, _) in zip(sched.scheduled, row_plan, strict=True)
                if req.spec_token_ids]
        verified = None
        if spec:
            rows = [i for _, first, count in spec for i in range(first, first + count)]
            verified = self.sampler.verify(logits[rows], [r for r, _, _ in spec])

        results: list[StepResult] = []
        k = v = 0
        for (req, n), (first, count, samples) in zip(sched.scheduled, row_plan, strict=True):
            tokens: list[int] = []
            lps: list[TokenLogprobs | None] = []
            rejected = 0
            if req.spec_token_ids:
                assert verified is not None
                tokens, lps = verified[v]
                rejected = len(req.spec_token_ids) + 1 - len(tokens)
                v += 1
            elif samples:
                assert sampled is not None
                tokens, lps = [sampled.token_ids[k]], [sampled.logprobs[k]]
                k += 1
            plp = None
            if req.params.prompt_logprobs is not None and req.num_computed_tokens < req.num_prompt_tokens:
                plp = self._prompt_logprobs(req, logits[first : first + count], req.num_computed_tokens)
            results.append(StepResult(req, n, tokens, lps, plp, rejected))
        return results

    def _prompt_logprobs(self, req: Request, rows: torch.Tensor, start: int) -> list[TokenLogprobs]:
        """Logprobs of the prompt tokens that rows predict (row j predicts token start + j + 1)."""
        lps = torch.log_softmax(rows, dim=-1)
        out = []
        for j in range(rows.shape[0]):
            target_pos = start + j + 1
            if target_pos >= req.num_prompt_tokens:
                break
            if target_pos <= len(req.prompt_logprobs):
                continue  # recomputed after a preemption: already recorded
            out.append(top_logprobs(lps[j], req.all_token_ids[target_pos], req.params.prompt_logprobs or 0))
        return out
