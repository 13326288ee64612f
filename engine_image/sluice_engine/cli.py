"""`sluice` command line. Subcommands of other components register here as they land."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .config import EngineConfig, parse_size


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags. NOTE: these are a contract: the operator renders them into pod specs."""
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct, "
                        "fetched and converted once into the user cache)")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: from --model)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights and activations (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="KV cache budget, e.g. 512MiB or 4GiB (default: 1GiB on CPU; on CUDA what "
                        "--gpu-memory-utilization leaves after the weights)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget per step; longer prompts are prefilled in chunks")
    p.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--max-queue-len", type=int, default=1024,
                   help="waiting requests beyond this are refused with 503 and Retry-After")
    p.add_argument("--step-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="watchdog: a step running longer than this turns /health to 503 (a hung engine)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton"])
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler for unseeded requests")
    par = p.add_argument_group("parallelism (docs/engine-flags.md)")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="shard every layer over this many ranks (devices); one process per rank")
    par.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                     help="split the layers into this many stages, one rank (group) each")
    par.add_argument("--nnodes", type=int, default=1, help="machines the ranks are spread over (evenly)")
    par.add_argument("--node-rank", type=int, default=0,
                     help="this machine's index; node 0 serves HTTP, the others run workers and /health only")
    par.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (torch.distributed rendezvous)")
    par.add_argument("--master-port", type=int, default=29500, help="node 0's rendezvous port")
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


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    fields = EngineConfig.__dataclass_fields__
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in fields})


def cmd_serve(args: argparse.Namespace) -> int:
    import threading

    import uvicorn

    from .api.draining_server import DrainingServer
    from .api.server import build_app
    from .async_engine import AsyncEngine
    from .engine import LLMEngine

    cfg = engine_config_from_args(args)
    log = logging.getLogger("sluice")
    if cfg.node_rank > 0:  # a worker node: its ranks and /health, no API
        from .distributed.launcher import run_worker_node
        from .model_fetch import resolve_model

        return run_worker_node(cfg, resolve_model(cfg.model), args.host, args.port)
    async_engine = AsyncEngine.build(lambda: LLMEngine(cfg))
    engine = async_engine.engine
    app = build_app(async_engine)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5), async_engine, args.shutdown_timeout)

    def on_dead(e: BaseException) -> None:
        # /health already says 503; give open streams a moment to carry their error event, then stop
        # so the process exits non-zero and is restarted.
        log.error("the engine cannot serve (%r): stopping", e)
        threading.Timer(1.0, lambda: setattr(server, "should_exit", True)).start()

    async_engine.on_dead = on_dead
    log.info("serving %r on http://%s:%d/v1", engine.served_model_name, args.host, args.port)
    server.run()
    if async_engine.dead is not None:
        engine.executor.shutdown(graceful=False)
        code = 1
    else:
        code = 0
    if cfg.world_size > 1:
        # Skip interpreter teardown: a process group's destructors can wait on ranks that are gone.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)
    return code


def cmd_render(args: argparse.Namespace) -> int:
    from sluice_operator.render import run  # the operator's; imported only when rendering

    return run(args.filename, args.output)


def cmd_operator(args: argparse.Namespace) -> int:
    from sluice_operator.main import run  # kopf is imported only when the operator runs

    return run(args.namespace, resync_seconds=args.resync_seconds, liveness=args.liveness,
               leader_election=args.leader_election, lease_namespace=args.lease_namespace,
               metrics_port=args.metrics_port)


def cmd_gateway(args: argparse.Namespace) -> int:
    from sluice_autoscaler.cli import run  # aiohttp and grpc are imported only when the gateway runs

    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.cli import run  # aiohttp, tqdm and the tokenizer are imported only when a bench runs

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="LLM inference endpoints on Kubernetes")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the engine's OpenAI-compatible server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM, let in-flight requests finish for up to this long (new ones get 503)")
    serve.set_defaults(func=cmd_serve)
    render = sub.add_parser("render", help="print the Kubernetes objects the operator creates for an "
                                           "InferenceEndpoint (offline)")
    render.add_argument("-f", "--filename", required=True, help="InferenceEndpoint YAML file, or - for stdin")
    render.add_argument("-o", "--output", default="yaml", choices=["yaml", "json"])
    render.set_defaults(func=cmd_render)
    op = sub.add_parser("operator", help="run the operator: keeps InferenceEndpoints and their objects converged")
    scope = op.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="watch this namespace (repeatable); default: all namespaces")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)")
    op.add_argument("--resync-seconds", type=float, default=60.0,
                    help="re-apply every endpoint's objects this often (recreates deleted ones, undoes drift)")
    op.add_argument("--liveness", metavar="URL", default=None,
                    help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    op.add_argument("--leader-election", action="store_true",
                    help="run as one of several replicas: only the holder of a coordination.k8s.io Lease reconciles")
    op.add_argument("--lease-namespace", default=None,
                    help="the Lease's namespace (default: $POD_NAMESPACE, else default)")
    op.add_argument("--metrics-port", type=int, default=None,
                    help="serve the operator's own Prometheus metrics on this port (docs/metrics.md#operator)")
    op.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    op.set_defaults(func=cmd_operator)
    from sluice_autoscaler.cli import add_gateway_args  # argparse only

    gateway = sub.add_parser("gateway", help="run the gateway: OpenAI proxy that holds requests while an endpoint "
                                             "scales from zero, routes by prompt prefix, and serves KEDA's "
                                             "external scaler")
    add_gateway_args(gateway)
    gateway.set_defaults(func=cmd_gateway)
    from .bench.cli import add_bench_args  # argparse only

    bench = sub.add_parser("bench", help="load an OpenAI-compatible server (or several, --compare) with a seeded "
                                         "workload; report throughput, TTFT/TPOT/ITL percentiles and goodput")
    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except BrokenPipeError:  # e.g. `sluice render ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ValueError as e:  # configuration errors: one clear line, no traceback
        print(f"sluice {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
