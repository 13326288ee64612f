"""`sluice serve`: the engine's flags (argparse only: the dispatcher imports this module to parse them) and the
command, which imports uvicorn, torch and the engine only when it runs."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..config import NUMERICS, SCHEDULING_POLICIES, WARMUP_MODES, EngineConfig, parse_size
from ..quant.formats import CHOICES as QUANT_CHOICES
from ..quant.formats import KV_CACHE_DTYPES


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags. NOTE: these are a contract: the operator renders them into pod specs."""
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct, "
                        "fetched and converted once into the user cache)")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: from --model)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights and activations (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--quantization", default="auto", choices=list(QUANT_CHOICES),
                   help="weights of the linear layers: none (the dtype's), q8_0/q4_0/q4_1 (GGUF blocks, CPU; "
                        "a GGUF's own blocks are kept, other weights quantized at load); auto: none for now; "
                        "fp8/awq/gptq (CUDA, Triton kernels): a checkpoint quantized so (auto serves a "
                        "config.json quantization_config in its format); fp8 also quantizes a dense one at load")
    p.add_argument("--numerics", default="exact", choices=list(NUMERICS),
                   help="CPU GGUF block formats' GEMM: exact = llama.cpp's x86 float order bit for bit (the same "
                        "greedy tokens as llama-server on the same file); fast = one float rounding per block of 32 "
                        "instead of 8 (as llama.cpp's repacked kernels): 1.4-1.9x the GEMM at batch on AVX-512, "
                        "outputs differ in the last bits")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache elements: auto (the model's dtype) or fp8 (e4m3 with a per-tensor scale per "
                        "layer for K and V: the checkpoint's k_scale/v_scale, else 1.0; half a bf16 cache's bytes, "
                        "so twice the tokens; CUDA, Triton attention kernels)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="KV cache budget (target and draft caches together), e.g. 512MiB or 4GiB (default: "
                        "1GiB on CPU; on CUDA what --gpu-memory-utilization leaves after the weights and the "
                        "profiled activation peak)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory the engine may fill: weights, activations, KV cache (CUDA)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget per step; longer prompts are prefilled in chunks")
    p.add_argument("--scheduling-policy", default="fcfs", choices=list(SCHEDULING_POLICIES),
                   help="order of the waiting queue: fcfs (arrival) or priority (the requests' `priority`, lower "
                        "first, then arrival; a more urgent request may preempt running ones of a worse priority)")
    p.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--kv-role", choices=["prefill", "decode", "both"], default=None,
                   help="prefill/decode disaggregation: decode (or both) takes prompt KV blocks pushed by prefill "
                        "engines on a TCP receiver (--kv-host/--kv-port) into the offload tier (needs "
                        "--kv-offload-bytes); any engine pushes a request's prompt blocks when it finishes if the "
                        "request has kv_transfer_params.push_to")
    p.add_argument("--kv-host", default=None, help="address of the KV receiver (--kv-role decode|both); default: "
                   "every address with --kv-secret-file, loopback only without it (a key is required elsewhere)")
    p.add_argument("--kv-secret-file", default=None, metavar="PATH",
                   help="the endpoint's KV key (at least 32 bytes; the operator mounts one Secret into both pools): "
                        "seals KV transfers, keys block names, and proves a decode engine's prefill hop "
                        "(docs/security.md); required by --kv-role prefill, --prefill-url and a non-loopback "
                        "--kv-host")
    p.add_argument("--kv-port", type=int, default=8100, help="port of the KV receiver (--kv-role decode|both)")
    p.add_argument("--prefill-url", default=None, metavar="URL",
                   help="with --kv-role decode|both: send each request's prompts to the prefill engines at this "
                        "OpenAI base URL first (e.g. http://NAME-prefill), which push their KV blocks to this "
                        "engine's receiver (--kv-host must then be an address they reach, not 0.0.0.0); a failed "
                        "hop means computing the prompt here")
    p.add_argument("--prefill-min-prompt-tokens", type=int, default=256, metavar="N",
                   help="with --prefill-url: shorter prompts are prefilled here (a hop costs more than it saves)")
    p.add_argument("--prefill-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="with --prefill-url: a hop taking longer counts as failed and the prompt is computed here")
    p.add_argument("--kv-offload-bytes", type=parse_size, default=0, metavar="SIZE",
                   help="host memory per rank, e.g. 4GiB, for the KV offload tier: prompt blocks the prefix cache "
                        "evicts are kept there (LRU) and loaded back on a later hit instead of recomputed "
                        "(default 0: off; needs prefix caching)")
    p.add_argument("--max-queue-len", type=int, default=1024,
                   help="waiting requests beyond this are refused with 503 and Retry-After")
    p.add_argument("--step-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="watchdog: a step running longer than this turns /health to 503 (a hung engine)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton"])
    p.add_argument("--enforce-eager", action="store_true",
                   help="never replay CUDA graphs: every step launches its kernels one by one")
    p.add_argument("--cuda-graph-max-batch", type=int, default=256, metavar="N",
                   help="capture decode CUDA graphs for batches of up to N requests (capped to --max-num-seqs)")
    p.add_argument("--warmup", default="auto", choices=list(WARMUP_MODES),
                   help="dummy steps before /ready turns 200, so no kernel compiles on the serving path: full "
                        "(every prefill chunk, decode batch and attention launch bucket), minimal (one prefill "
                        "and one decode step), off; auto: full on CUDA, minimal on CPU")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler for unseeded requests")
    lora = p.add_argument_group("LoRA adapters (docs/engine-flags.md)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters beside the base model")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                      help="PEFT adapters to serve, each as a model of its own name (a request's `model` selects it)")
    lora.add_argument("--max-loras", type=int, default=4, help="adapters resident in device slots at once (more are "
                      "swapped in and out, least recently used first)")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted")
    lora.add_argument("--max-cpu-loras", type=int, default=None, help="adapters whose weights stay in host memory "
                      "(least recently used dropped and read from disk again when needed; default: all)")
    lora.add_argument("--lora-modules-file", default=None, metavar="PATH",
                      help='a JSON file {"adapters": [{"name": ..., "path": ...}]} re-read while the server runs: '
                           "adapters it lists are loaded, those it stops listing unloaded (the operator writes it "
                           "from spec.adapters)")
    lora.add_argument("--lora-root", default=None, metavar="DIR",
                      help="the only directory POST /v1/load_lora_adapter may load adapters from (the path is "
                           "resolved, symlinks followed, and must lie under it); needed by "
                           "--allow-runtime-lora-updates. Adapters given at start are not held to it")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and queue the next step while this one runs on the device, hiding the host's "
                        "work behind the forward (one rank; the same tokens either way); default: on for CUDA, "
                        "off on CPU")
    par = p.add_argument_group("parallelism (docs/engine-flags.md)")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="shard every layer over this many ranks (devices); one process per rank")
    par.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                     help="split the layers into this many stages, one rank (group) each")
    par.add_argument("--nnodes", type=int, default=1, help="machines the ranks are spread over (evenly)")
    par.add_argument("--node-rank", type=int, default=0,
                     help="this machine's index; node 0 serves HTTP, the others run workers and /health only")
    par.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (torch.distributed rendezvous)")
    par.add_argument("--master-port", type=int, default=None,
                     help="node 0's rendezvous port (default: 29500 with --nnodes > 1, else a free port)")
    par.add_argument("--distributed-timeout", type=float, default=60.0, metavar="SECONDS",
                     help="a collective that waits longer than this stops the whole group")
    obs = p.add_argument_group("metrics (docs/metrics.md)")
    obs.add_argument("--endpoint-label", default=os.environ.get("SLUICE_ENDPOINT") or None, metavar="NAME",
                     help="add endpoint=NAME to every metric (default: $SLUICE_ENDPOINT)")
    obs.add_argument("--slo-ttft-ms", type=float, default=None,
                     help="time-to-first-token objective; goodput counts requests that meet every objective set")
    obs.add_argument("--slo-tpot-ms", type=float, default=None, help="time-per-output-token objective")
    obs.add_argument("--gpu-hour-usd", type=float, default=None,
                     help="price of one GPU-hour, exported so Prometheus can compute cost per token")
    obs.add_argument("--objectives-file", default=None, metavar="PATH",
                     help='JSON {"slo-ttft-ms", "slo-tpot-ms", "gpu-hour-usd"} replacing the three flags above, '
                          "re-read while running (the operator mounts it from the endpoint's ConfigMap)")
    tr = p.add_argument_group("tracing (docs/metrics.md#tracing)")
    tr.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                    help="send an OpenTelemetry span per request (queue, prefill, decode) to this OTLP/HTTP "
                         "collector, e.g. http://collector:4318/v1/traces (a URL without a path gets /v1/traces); "
                         "an incoming W3C traceparent is its parent (default: off)")
    tr.add_argument("--trace-sample-ratio", type=float, default=1.0, metavar="RATIO",
                    help="share of requests without a traceparent that are traced; a traceparent's sampled flag "
                         "is always followed (default 1.0)")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-method", default=None, choices=["ngram", "draft"],
                      help="propose draft tokens and verify them in one forward (default: off; --draft-model "
                           "alone means draft)")
    spec.add_argument("--draft-model", default=None, metavar="PATH",
                      help="a smaller model with the target's tokenizer (HF directory or GGUF) that drafts greedily")
    spec.add_argument("--num-speculative-tokens", type=int, default=4, help="draft tokens per step (k)")
    spec.add_argument("--ngram-min", type=int, default=2, help="shortest n-gram matched by prompt lookup")
    spec.add_argument("--ngram-max", type=int, default=4, help="longest n-gram matched by prompt lookup")
    spec.add_argument("--speculative-disable-batch-size", type=int, default=8,
                      help="do not speculate in steps with more running requests than this")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags and the server's own (address, logging, draining)."""
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, let in-flight requests finish for up to this long (new ones get 503)")
    p.add_argument("--api-key", default=os.environ.get("SLUICE_API_KEY"), metavar="KEY",
                   help="every /v1 route needs 'Authorization: Bearer KEY' (default: $SLUICE_API_KEY; none: open)")
    p.add_argument("--admin-api-key", default=os.environ.get("SLUICE_ADMIN_API_KEY"), metavar="KEY",
                   help="/v1/load_lora_adapter and /v1/unload_lora_adapter need 'Authorization: Bearer KEY', the "
                        "--api-key is not enough (default: $SLUICE_ADMIN_API_KEY; needed with --api-key and "
                        "--allow-runtime-lora-updates)")
    p.add_argument("--allow-runtime-lora-updates", action="store_true",
                   help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter load and unload LoRA adapters "
                        "while the server runs (with --enable-lora and --lora-root; behind --admin-api-key)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core (scheduler, model runner) in its own process, fed by messages "
                        "(docs/architecture.md); --no-engine-process runs it in a thread of the API server")


# Idle keep-alive connections stay open this long. uvicorn's default (5 s) is shorter than what clients keep
# pooled connections for (aiohttp, the gateway's client: 15 s; httpx: 5 s, the same instant), so a request sent
# on a connection the server was closing met "Server disconnected without sending a response" (seen in the
# structured-output suite under load). A server outlives its clients' idle timeout (the load balancers' rule).
KEEP_ALIVE_S = 75


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    fields = EngineConfig.__dataclass_fields__
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in fields})


def run(args: argparse.Namespace) -> int:
    from ..omp_wait import default_omp_wait

    default_omp_wait(os.environ)  # before torch loads libgomp, here and in the engine processes started from here
    import threading

    import uvicorn

    from ..engine.async_engine import AsyncEngine
    from .openai.draining_server import DrainingServer
    from .openai.server import build_app, check_lora_update_flags

    cfg = engine_config_from_args(args)
    log = logging.getLogger("sluice")
    if cfg.node_rank > 0:  # a worker node: its ranks and /health, no API
        from ..executor.launcher import run_worker_node
        from ..model_fetch import resolve_model

        return run_worker_node(cfg, resolve_model(cfg.model), args.host, args.port)
    if cfg.prefill_url is not None:
        if cfg.kv_role not in ("decode", "both"):
            raise ValueError("--prefill-url sends prompts to prefill engines that push their blocks to this engine's "
                             "KV receiver: it needs --kv-role decode (or both)")
        if cfg.kv_host in ("0.0.0.0", "::", "") or cfg.kv_port == 0:
            raise ValueError("--prefill-url: the prefill engines push to --kv-host:--kv-port, so --kv-host must be "
                             "an address they reach (the pod's IP), not a wildcard, and --kv-port not 0")
    if args.allow_runtime_lora_updates and not cfg.enable_lora:
        raise ValueError("--allow-runtime-lora-updates needs --enable-lora")
    check_lora_update_flags(args.allow_runtime_lora_updates, cfg.lora_root, args.api_key, args.admin_api_key)
    if args.engine_process:
        async_engine = AsyncEngine.spawn(cfg, args.log_level)
    else:
        from ..engine.llm_engine import LLMEngine  # torch: only where the engine runs in this process

        async_engine = AsyncEngine.build(lambda: LLMEngine(cfg))
    app = build_app(async_engine, api_key=args.api_key, admin_api_key=args.admin_api_key,
                    allow_runtime_lora_updates=args.allow_runtime_lora_updates)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S),
                            async_engine, args.shutdown_timeout)

    def on_dead(e: BaseException) -> None:
        # /health already says 503; give open streams a moment to carry their error event, then stop
        # so the process exits non-zero and is restarted.
        log.error("the engine cannot serve (%r): stopping", e)
        threading.Timer(1.0, lambda: setattr(server, "should_exit", True)).start()

    async_engine.on_dead = on_dead
    log.info("serving %r on http://%s:%d/v1", async_engine.model_info.served_model_name, args.host, args.port)
    server.run()
    if async_engine.dead is not None:
        if async_engine.engine is not None:  # an engine core process stops its own ranks
            async_engine.engine.executor.shutdown(graceful=False)
        code = 1
    else:
        code = 0
    if cfg.world_size > 1:
        # Skip interpreter teardown: a process group's destructors can wait on ranks that are gone.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)
    return code
