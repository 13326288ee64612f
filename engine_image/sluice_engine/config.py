"""Engine configuration: one slotted dataclass that checks its own invariants."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

from .quant.formats import CHOICES as QUANT_CHOICES
from .quant.formats import check_device as check_quant_device
from .quant.formats import check_kv_cache_dtype

# --warmup: what runs before /ready turns 200 (worker/warmup.py): auto = full on CUDA, minimal elsewhere.
WARMUP_MODES = ("auto", "full", "minimal", "off")
# --numerics: the CPU block-format GEMM's float order (cpu_kernels/quant_gemm.cpp).
NUMERICS = ("exact", "fast")

_SIZE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str | int) -> int:
    """'512MiB', '2G', '1.5GiB', '1048576' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 512MiB, 2GiB, 4G or a number of bytes")
    unit = (m.group(2) or "").lower()
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


DEFAULT_MASTER_PORT = 29500  # torch.distributed's customary rendezvous port, for groups across nodes

@dataclass(slots=True)
class SpeculativeConfig:
    method: str | None = None  # None | "ngram" | "draft"
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    # Above this many running requests, a step does not speculate: the batch already uses the compute
    # that speculation would otherwise fill (see docs/BENCHMARKS.md for where the crossover lies).
    disable_batch_size: int = 8
    draft_model: str | None = None  # an HF directory (or GGUF) of a smaller model with the same tokenizer

    def __post_init__(self) -> None:
        if self.draft_model is not None and self.method is None:
            self.method = "draft"  # --draft-model alone means draft-model speculation
        if self.method not in (None, "ngram", "draft"):
            raise ValueError(f"--speculative-method must be ngram or draft, got {self.method!r}")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("--speculative-method draft needs --draft-model")
        if self.method == "ngram" and self.draft_model is not None:
            raise ValueError("--draft-model is used only with --speculative-method draft")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"--ngram-min/--ngram-max must satisfy 1 <= min <= max, got {self.ngram_min}/{self.ngram_max}"
            )
        if self.disable_batch_size < 1:
            raise ValueError(f"--speculative-disable-batch-size must be >= 1, got {self.disable_batch_size}")


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    served_model_name: str | None = None
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: derived from the device
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # The waiting queue's order (core/scheduler.py): fcfs = arrival; priority = each request's `priority` (lower
    # first, vLLM's rule), then arrival, and a more urgent request may preempt running ones of a worse priority.
    scheduling_policy: str = "fcfs"
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # The KV offload tier (docs/architecture.md, "KV beyond one engine"): bytes of host memory per rank that keep
    # the prefix cache's evicted blocks, loaded back on a hit instead of recomputed; 0: none.
    kv_offload_bytes: int = 0
    # Prefill/decode disaggregation (kv_transfer/): decode and both take prompt blocks pushed by prefill engines
    # (requests with kv_transfer_params.push_to) on a TCP receiver at kv_host:kv_port, into the offload tier.
    kv_role: str | None = None  # None | prefill | decode | both
    # The receiver's address; None: every address with a key (kv_secret_file), loopback only without one.
    kv_host: str | None = None
    # The endpoint's KV key (kv_transfer/keys.py, docs/security.md): seals transfers, keys block names, and is what
    # a decode engine's hop proves itself with to a prefill engine (kv_transfer_params.hop_token).
    kv_secret_file: str | None = None
    kv_port: int = 8100
    kv_push_timeout: float = 30.0  # seconds a push to a receiver may take before it counts as failed
    # A decode engine's first hop (kv_transfer/prefill_hop.py): its requests' prompts are prefilled by the engines at
    # prefill_url first, their blocks pushed to this engine's receiver at kv_host:kv_port; prompts shorter than
    # prefill_min_prompt_tokens stay here; a hop past prefill_timeout seconds means computing here.
    prefill_url: str | None = None
    prefill_min_prompt_tokens: int = 256
    prefill_timeout: float = 120.0
    max_queue_len: int = 1024
    # The watchdog: a step still running after this many seconds while work is pending turns /health
    # to 503 (a hung device or kernel), so the pod's liveness probe restarts it.
    step_timeout: float = 120.0
    # Metrics (docs/metrics.md): the `endpoint` label, the SLO goodput is counted against, the GPU price.
    endpoint_label: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    gpu_hour_usd: float | None = None
    # A JSON file whose values replace the three above, re-read at every metrics scrape (objectives.py).
    objectives_file: str | None = None
    # OpenTelemetry traces (entrypoints/openai/tracing.py, docs/metrics.md "Tracing"): an OTLP/HTTP collector's
    # traces URL (None: off, nothing of the SDK imported) and the share of requests without a traceparent sampled
    # (a traceparent's own sampled flag is always followed).
    otlp_traces_endpoint: str | None = None
    trace_sample_ratio: float = 1.0
    attention_backend: str = "auto"  # auto | cpu | torch | triton
    # CUDA graphs of decode steps (worker/cuda_graphs.py): off with enforce_eager; captured for batch sizes up to
    # min(cuda_graph_max_batch, max_num_seqs).
    enforce_eager: bool = False
    cuda_graph_max_batch: int = 256
    # Weights of the linear layers (quant/formats.py): none = the dtype's; q8_0/q4_0/q4_1 = GGUF blocks on
    # CPU; fp8/awq/gptq = the Triton kernels (a checkpoint quantized so; fp8 also quantizes a dense one);
    # auto = the checkpoint's quantization_config, else none for now (docs/engine-flags.md).
    quantization: str = "auto"
    # The float order of the CPU block-format GEMM (cpu_kernels/quant_gemm.cpp): exact = llama.cpp's vec-dot order,
    # bit for bit (8 roundings per block); fast = one rounding per block (1.4-1.9x the GEMM at batch; last bits
    # differ from llama.cpp). Other paths ignore it.
    numerics: str = "exact"
    # The KV cache's element type (quant/formats.py): auto = the model's dtype; fp8 = e4m3 with per-tensor
    # scales (the Triton attention kernels; half a bf16 cache's bytes per token).
    kv_cache_dtype: str = "auto"
    seed: int = 0
    # LoRA adapters (lora/): off unless enable_lora; lora_modules "name=path" given at start; max_loras adapters
    # resident in device slots at once (more are swapped in and out, least recently used first); ranks up to
    # max_lora_rank.
    enable_lora: bool = False
    lora_modules: list[str] = field(default_factory=list)
    max_loras: int = 4
    max_lora_rank: int = 16
    # Adapters' weights kept on the host (least recently used dropped, re-read from disk when needed); None: all.
    max_cpu_loras: int | None = None
    # A JSON file {"adapters": [{"name", "path"}]} re-read while the engine runs: adapters it lists are loaded,
    # adapters it no longer lists are unloaded (lora/modules_file.py; the operator writes it from spec.adapters).
    lora_modules_file: str | None = None
    # The only directory adapters may be loaded from at run time (POST /v1/load_lora_adapter): the core refuses a
    # load outside it, or any run-time load without it (lora/paths.py). Start-up adapters are not held to it.
    lora_root: str | None = None
    # Async scheduling (engine/llm_engine.py): the next step is scheduled and queued while this one runs on the
    # device, its host work (outputs, scheduling) hidden behind the forward. One rank only (tensor/pipeline
    # parallel groups run their steps one at a time, pipelined by stage); steps that verify drafts run alone.
    # None: on for CUDA, off on CPU (where the forward is the host's own work: docs/BENCHMARKS.md#async-scheduling).
    async_scheduling: bool | None = None
    # Speculative decoding (None: off). See spec_decode/proposer.py.
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    speculative_disable_batch_size: int = 8
    draft_model: str | None = None
    # Parallel layout (docs/engine-flags.md): ranks = tensor x pipeline, spread evenly over nnodes
    # machines; node 0 serves HTTP, the master address is node 0's (torch.distributed's rendezvous).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    # None: 29500 across nodes (the others must know it), else 0. 0: a free port on master_addr, picked when
    # the group starts (two servers on one host, or one restarted at once, never meet on a fixed port).
    master_port: int | None = None
    distributed_timeout: float = 60.0  # seconds a collective may wait before the group is declared dead
    # Dummy steps the server runs before it reports ready (worker/warmup.py; the offline LLM does not warm up).
    warmup: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"--dtype must be auto, float32, float16 or bfloat16, got {self.dtype}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device}")
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError(f"--attention-backend must be auto, cpu, torch or triton, got {self.attention_backend}")
        if self.cuda_graph_max_batch < 1:
            raise ValueError(f"--cuda-graph-max-batch must be >= 1, got {self.cuda_graph_max_batch}")
        if self.quantization not in QUANT_CHOICES:
            raise ValueError(f"--quantization must be one of {', '.join(QUANT_CHOICES)}, got {self.quantization}")
        check_quant_device(self.quantization, self.device, self.attention_backend)
        if self.numerics not in NUMERICS:
            raise ValueError(f"--numerics must be one of {', '.join(NUMERICS)}, got {self.numerics!r}")
        check_kv_cache_dtype(self.kv_cache_dtype, self.device, self.attention_backend)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.max_queue_len < 1:
            raise ValueError("--max-queue-len must be >= 1")
        if not self.step_timeout > 0:
            raise ValueError(f"--step-timeout must be > 0, got {self.step_timeout}")
        for flag, v in (("--slo-ttft-ms", self.slo_ttft_ms), ("--slo-tpot-ms", self.slo_tpot_ms)):
            if v is not None and not v > 0:
                raise ValueError(f"{flag} must be > 0, got {v}")
        if not 0 <= self.trace_sample_ratio <= 1:
            raise ValueError(f"--trace-sample-ratio must be in [0, 1], got {self.trace_sample_ratio}")
        if self.otlp_traces_endpoint is not None and not self.otlp_traces_endpoint.startswith(("http://", "https://")):
            raise ValueError("--otlp-traces-endpoint must be an http:// or https:// URL (OTLP over HTTP, e.g. "
                             f"http://collector:4318/v1/traces), got {self.otlp_traces_endpoint!r}")
        if self.gpu_hour_usd is not None and not self.gpu_hour_usd >= 0:
            raise ValueError(f"--gpu-hour-usd must be >= 0, got {self.gpu_hour_usd}")
        for flag, v in (("--tensor-parallel-size", self.tensor_parallel_size),
                        ("--pipeline-parallel-size", self.pipeline_parallel_size), ("--nnodes", self.nnodes)):
            if v < 1:
                raise ValueError(f"{flag} must be >= 1, got {v}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise ValueError(f"{self.world_size} ranks (--tensor-parallel-size {self.tensor_parallel_size} x "
                             f"--pipeline-parallel-size {self.pipeline_parallel_size}) cannot be spread evenly "
                             f"over --nnodes {self.nnodes}")
        if self.master_port is None:
            self.master_port = DEFAULT_MASTER_PORT if self.nnodes > 1 else 0
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"--master-port must be a TCP port (1..65535, or 0 for a free one), got {self.master_port}")
        if self.master_port == 0 and self.nnodes > 1:
            raise ValueError("--master-port 0 (a free port) works on one node only: with --nnodes > 1 the other "
                             "nodes must be told node 0's port")
        if not self.distributed_timeout > 0:
            raise ValueError(f"--distributed-timeout must be > 0, got {self.distributed_timeout}")
        if self.warmup not in WARMUP_MODES:
            raise ValueError(f"--warmup must be one of {', '.join(WARMUP_MODES)}, got {self.warmup!r}")
        self.speculative_config()  # validates the speculative flags
        self._check_kv_transfer()

    def _check_kv_transfer(self) -> None:
        """The pod network is not a trust boundary (docs/security.md): a KV receiver other hosts can reach, and any
        push between engines, needs the endpoint's key."""
        if self.kv_role not in (None, "prefill", "decode", "both"):
            raise ValueError(f"--kv-role must be prefill, decode or both, got {self.kv_role!r}")
        if self.kv_host is None:
            self.kv_host = "0.0.0.0" if self.kv_secret_file is not None else "127.0.0.1"
        if self.kv_secret_file is not None:
            return
        if self.kv_role in ("decode", "both") and not is_loopback(self.kv_host):
            raise ValueError(f"--kv-host {self.kv_host}: a KV receiver other hosts can reach takes blocks only sealed "
                             "with the endpoint's key: set --kv-secret-file (without one it listens on loopback only)")
        if self.kv_role == "prefill":
            raise ValueError("--kv-role prefill pushes prompt blocks only for the endpoint's own decode engines, "
                             "which prove themselves with the endpoint's key: set --kv-secret-file")
        if self.prefill_url is not None:
            raise ValueError("--prefill-url: the hop proves itself to the prefill engines with the endpoint's key "
                             "and their pushes are sealed with it: set --kv-secret-file")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def speculative_config(self) -> SpeculativeConfig:
        return SpeculativeConfig(self.speculative_method, self.num_speculative_tokens, self.ngram_min,
                                 self.ngram_max, self.speculative_disable_batch_size, self.draft_model)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or "localhost") is this machine's loopback, unreachable from other hosts."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
