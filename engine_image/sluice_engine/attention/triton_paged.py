"""Attention over the paged KV cache with the Triton kernels in `triton_kernels.py` (the CUDA path).

On CPU the kernels run only in Triton's interpreter (TRITON_INTERPRET=1 set before this module is
imported): slow, and there for tests. Each step's launch (split count, tiles) comes from the fixed set in
attention/kernel_buckets.py, so warm-up can compile every variant before the server is ready. The backend keeps the
launches it has issued (`issued`): eager steps' and those captured into CUDA graphs, i.e. what is compiled;
warm-up reports that set rather than a prediction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from ..forward_context import AttentionMetadata
from . import triton_kernels as tk
from .kernel_buckets import SPLIT_MAX_QUERY_LEN, AttentionLaunch, block_m_for, choose_attention_launch

log = logging.getLogger(__name__)

# Prefill launches the engine times at start-up on CUDA (tune_prefill): (query rows per tile, warps, pipeline
# stages); None is the kernel's default (kernel_buckets.PREFILL_BLOCK_M rows, its warps, 2 stages). What a Hopper
# wants (128-row tiles, 8 warps, 3-4 stages) is among them; the fastest on the card serves every prompt.
PREFILL_CANDIDATES: tuple[tuple[int, int, int] | None, ...] = (None, (64, 8, 3), (128, 8, 2), (128, 8, 3), (128, 8, 4))
TUNE_PROMPT_TOKENS = 2048


def prefill_launch_kwargs(cfg: tuple[int, int, int] | None, group: int) -> dict:
    """paged_attention's keywords (launch, num_warps, num_stages) for one of PREFILL_CANDIDATES-style configs (rows
    per tile, warps, stages); None: {} (the defaults). Also benchmarks/attention_kernels.py --prefill-sweep's."""
    if cfg is None:
        return {}
    block_m, warps, stages = cfg
    return {"launch": AttentionLaunch(1, max(block_m, group)), "num_warps": warps, "num_stages": stages}


class TritonPagedAttention:
    name = "triton"

    def __init__(self, device: torch.device, num_splits: int | None = None):
        """num_splits: a fixed split count (one of kernel_buckets.SPLIT_CHOICES) for short-query batches
        (tests); None chooses from the batch (kernel_buckets.choose_attention_launch)."""
        if device.type != "cuda" and not tk.INTERPRETER_READY:
            raise ValueError(
                f"--attention-backend triton on {device.type} runs only in Triton's interpreter: set "
                "TRITON_INTERPRET=1 in the environment before triton is first imported (slow; meant for "
                "tests), or use --attention-backend torch"
            )
        self.num_splits = num_splits
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 1)
        # Every launch attend() has issued, eager or while a CUDA graph captured it: the variants compiled.
        # Written by the thread that runs the forward; read after warm-up.
        self.issued: set[AttentionLaunch] = set()
        self.prefill_config: tuple[int, int, int] | None = None  # tune_prefill's choice; None: the default

    def tune_prefill(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
                     device: torch.device, max_tokens: int, timer: Callable[[Callable[[], object]], float] | None = None,
                     ) -> dict[str, float]:
        """Times each of PREFILL_CANDIDATES on one prompt of min(TUNE_PROMPT_TOKENS, max_tokens) tokens with this
        rank's heads (random K/V in a shuffled paged cache) and keeps the fastest for every prefill launch; logs
        the times. timer: fn -> ms (default: CUDA events). Returns the times by config."""
        from ..quant.gemm_paths import cuda_ms

        timer = timer or cuda_ms
        group = num_heads // num_kv_heads
        t = max(SPLIT_MAX_QUERY_LEN + 1, min(TUNE_PROMPT_TOKENS, max_tokens))
        blocks = -(-t // block_size)
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(t, num_heads, head_dim, generator=g, device=device).to(dtype)
        cache = torch.randn(2, blocks, block_size, num_kv_heads, head_dim, generator=g, device=device).to(dtype)
        table = torch.randperm(blocks, generator=g, device=device).to(torch.int32)[None, :]
        starts = torch.tensor([0, t], dtype=torch.int32, device=device)
        lens = torch.tensor([t], dtype=torch.int32, device=device)
        times = {}
        for cfg in PREFILL_CANDIDATES:
            kw = prefill_launch_kwargs(cfg, group)
            launch = kw.pop("launch", AttentionLaunch(1, block_m_for(t, group)))
            times[cfg] = timer(lambda launch=launch, kw=kw: tk.paged_attention(
                q, cache[0], cache[1], starts, lens, table, t, head_dim**-0.5, launch=launch, **kw))
        self.prefill_config = min(times, key=times.get)
        log.info("prefill attention launch: %s, the fastest of %s on one %d-token prompt (ms)",
                 self.prefill_config or "the default",
                 ", ".join(f"{c or 'default'}: {ms:.3f}" for c, ms in times.items()), t)
        return {str(c or "default"): ms for c, ms in times.items()}

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                 kv_scale: torch.Tensor | None = None) -> None:
        tk.store_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping, kv_scale)

    def launch(self, meta: AttentionMetadata, group: int, num_kv_heads: int) -> AttentionLaunch:
        """The step's launch, chosen once per step (every layer has the same batch and heads)."""
        launch = meta.per_step.get("triton_launch")
        if launch is None:
            launch = self.choose(meta.max_query_len, meta.seq_lens_cpu, group, num_kv_heads)
            meta.per_step["triton_launch"] = launch
        return launch

    def choose(self, max_query_len: int, seq_lens: Sequence[int], group: int, num_kv_heads: int) -> AttentionLaunch:
        """The launch for a batch (max_query_len new tokens at most, contexts seq_lens after the step). The
        model runner asks it too, to pick the CUDA graph of a decode step: graph and eager steps agree."""
        if self.num_splits is not None and max_query_len <= SPLIT_MAX_QUERY_LEN:
            return AttentionLaunch(self.num_splits, block_m_for(max_query_len, group))
        return choose_attention_launch(max_query_len, seq_lens, group, num_kv_heads, self.num_sms)

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
               kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        hkv = kv_cache.shape[3]
        group = q.shape[1] // hkv
        ws = meta.workspace
        if ws is not None:  # a captured graph's batch: its split count and buffers, fixed at capture
            t = q.shape[0]
            launch = AttentionLaunch(ws.num_splits, block_m_for(meta.max_query_len, group))
            self.issued.add(launch)
            return tk.paged_attention(
                q, kv_cache[0], kv_cache[1], meta.query_start_loc, meta.seq_lens, meta.block_tables,
                meta.max_query_len, scale, launch=launch, out=ws.out[:t], mid=(ws.mid_o[:t], ws.mid_lse[:t]),
                kv_scale=kv_scale,
            )
        launch = self.launch(meta, group, hkv)
        kw = {}
        if self.prefill_config is not None and launch.num_splits == 1 and meta.max_query_len > SPLIT_MAX_QUERY_LEN:
            kw = prefill_launch_kwargs(self.prefill_config, group)  # tune_prefill's launch for every prompt chunk
            launch = kw.pop("launch")
        self.issued.add(launch)
        return tk.paged_attention(
            q, kv_cache[0], kv_cache[1], meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale, launch=launch, kv_scale=kv_scale, **kw,
        )
