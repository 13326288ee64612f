"""The `sluice` command: a dispatcher that knows each subcommand's name and the component module that owns it
(its flags and the command), and imports only the one on the command line. So `sluice serve` never loads kopf
or grpc, and `sluice operator` or `sluice gateway` never loads torch (the operator's image has no torch).

It lives in the engine's package because the console script and `python -m sluice_engine.entrypoints.cli` have always
pointed here; it imports nothing of the engine (sluice_engine/__init__.py is empty), so it is a dispatcher
only. The contract module is no home for it: that one holds names, not behaviour.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Subcommand:
    module: str  # the component module that owns the subcommand; argparse only at import time
    add_args: str  # its function(parser) that defines the flags
    run: str  # its function(args) -> exit status
    help: str  # the line `sluice --help` lists: here, so that listing the subcommands imports no component

    def function(self, name: str) -> Callable:
        return getattr(importlib.import_module(self.module), name)


SUBCOMMANDS = {
    "serve": Subcommand("sluice_engine.entrypoints.serve_cli", "add_serve_args", "run",
                        "run the engine's OpenAI-compatible server"),
    "render": Subcommand("sluice_operator.cli", "add_render_args", "run_render",
                         "print the Kubernetes objects the operator creates for an InferenceEndpoint (offline)"),
    "operator": Subcommand("sluice_operator.cli", "add_operator_args", "run_operator",
                           "run the operator: keeps InferenceEndpoints and their objects converged"),
    "gateway": Subcommand("sluice_autoscaler.cli", "add_gateway_args", "run",
                          "run the gateway: OpenAI proxy that holds requests while an endpoint scales from zero, "
                          "routes by prompt prefix, and serves KEDA's external scaler"),
    "usage": Subcommand("sluice_operator.usage_report", "add_usage_args", "run_usage",
                        "a tenant's requests, tokens and cost per endpoint over a window, from Prometheus"),
    "bench": Subcommand("sluice_engine.bench.cli", "add_bench_args", "run",
                        "load an OpenAI-compatible server (or several, --compare) with a seeded workload; report "
                        "throughput, TTFT/TPOT/ITL percentiles and goodput"),
}


def build_parser(commands: Iterable[str] = tuple(SUBCOMMANDS)) -> argparse.ArgumentParser:
    """Every subcommand is listed; those in `commands` get their flags, which imports their modules. main()
    passes the one on its command line; tests and docs that read the whole CLI take the default, all."""
    parser = argparse.ArgumentParser(prog="sluice", description="LLM inference endpoints on Kubernetes")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=command.help)
        if name in commands:
            command.function(command.add_args)(p)
    return parser


def command_in(argv: list[str]) -> str | None:
    """The subcommand a command line names: its first word that is not an option (`sluice` itself has -h only,
    which takes no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser([command_in(argv)]).parse_args(argv)  # an unknown name: argparse's usage error
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command = SUBCOMMANDS[args.command]
    try:
        return command.function(command.run)(args)
    except BrokenPipeError:  # e.g. `sluice render ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ValueError as e:  # configuration errors: one clear line, no traceback
        print(f"sluice {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
