"""`sluice operator` and `sluice render`: their flags (argparse only: the dispatcher imports this module to parse
them) and the commands, which import kopf (the loop) or pydantic and yaml (the renderer) only when they run.
NOTE: the chart renders the operator's flags into its Deployment; they are a contract like the engine's."""

from __future__ import annotations

import argparse

LOG_LEVELS = ["debug", "info", "warning", "error"]


def add_operator_args(p: argparse.ArgumentParser) -> None:
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="watch this namespace (repeatable); default: all namespaces")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)")
    p.add_argument("--resync-seconds", type=float, default=60.0,
                   help="re-apply every endpoint's objects this often (recreates deleted ones, undoes drift)")
    p.add_argument("--liveness", metavar="URL", default=None,
                   help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--leader-election", action="store_true",
                   help="run as one of several replicas: only the holder of a coordination.k8s.io Lease reconciles")
    p.add_argument("--lease-namespace", default=None,
                   help="the Lease's namespace (default: $POD_NAMESPACE, else default)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve the operator's own Prometheus metrics on this port (docs/metrics.md#operator)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)


def run_operator(args: argparse.Namespace) -> int:
    from .main import run  # kopf is imported only when the operator runs

    return run(args.namespace, resync_seconds=args.resync_seconds, liveness=args.liveness,
               leader_election=args.leader_election, lease_namespace=args.lease_namespace,
               metrics_port=args.metrics_port)


def add_render_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--filename", required=True, help="InferenceEndpoint YAML file, or - for stdin")
    p.add_argument("-o", "--output", default="yaml", choices=["yaml", "json"])


def run_render(args: argparse.Namespace) -> int:
    from .render import run  # the models, the reconciler and yaml are imported only when rendering

    return run(args.filename, args.output)
