"""Endpoint pickers side by side behind one GIE data plane: Sluice's picker vs GIE's reference EPP vs
round-robin, the same engine pods, the same shared-prefix chats (issue 41, acceptance 2).

    .venv/bin/python benchmarks/gie_pickers.py                    # ~15 min on 2 cores; needs root (pod IPs)
    .venv/bin/python benchmarks/gie_pickers.py --modes sluice round-robin --groups 8 --per-group 4   # quicker

The stack: a dev cluster (real kube-apiserver, kwok nodes) whose engine pods serve for real
(tests/support/engine_pods.py, scripts/pod_runner.py): one InferenceEndpoint with --replicas engines, one torch
thread each, a KV cache (--kv-cache) with room for about 6 of the prompts' prefixes. The data plane is
e2e/extproc_gateway (a gateway built from Envoy's go-control-plane types, as GIE's conformant gateways speak
ext-proc: full-duplex streamed bodies), which asks a picker for every request:
  - `sluice@load-floor=8`: `sluice gateway --endpoint-picker --kubernetes --pool default/<name> --load-floor 8`
    (through `kubectl proxy`), as the operator renders it for these engines (half their --max-num-seqs 16):
    prefix affinity (CHWBL) that holds while a pod runs under 8 requests; `sluice`: the same with the plain
    CHWBL bound (--load-floor 0, the gateway's default);
  - `gie-epp`: GIE v1.5.0's reference picker (scripts/get-gie-epp.sh; cmd/epp, standalone mode: pods by label
    selector), its default profile: queue-depth, KV-utilisation and prefix-cache scorers, reading the engines'
    vllm:* metrics;
  - `round-robin`: no picker; the gateway rotates over the pods.
Each mode gets fresh engines (the pods are deleted and the Deployment's replacements served: cold caches).

Workload (benchmarks/gateway_prefix_routing.py's, seed 0): GROUPS system prompts of ~500 tokens, PER_GROUP
questions behind each, shuffled, CONCURRENCY streaming chats at a time (greedy, max_tokens 8). Reported:
prefix-cache hit rate over all engines (sluice_prefix_cache_hits / _queries), TTFT p50/p99 at the client,
throughput (requests and output tokens per second over the wall time), requests per engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from dev_cluster import SCRIPTS, Cluster, wait_until  # noqa: E402
from engine_pods import Runner, apply_endpoint, endpoint_pods, engines_cluster, is_ready, pod_cidr, why_not  # noqa: E402
from gateway_common import SERVED_NAME, pct, scrape, stream_chat  # noqa: E402
from gateway_prefix_routing import MAX_TOKENS, workload  # noqa: E402
from server_process import free_port, stop_process  # noqa: E402

from sluice_engine.bench.machine import cpu_name, load_average  # noqa: E402

NAME, NAMESPACE = "bench", "default"
ENGINE_PORT = 8000


def endpoint(replicas: int, kv_cache: str) -> dict:
    return {"apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceEndpoint",
            "metadata": {"name": NAME, "namespace": NAMESPACE},
            "spec": {"model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "servedName": SERVED_NAME},
                     "engine": {"dtype": "float32", "maxModelLen": 2048,
                                "args": {"kv-cache-memory": kv_cache, "max-num-seqs": 16}},
                     "accelerator": {"type": "cpu"}, "replicas": replicas, "startupGraceSeconds": 300,
                     "pod": {"env": [{"name": "OMP_NUM_THREADS", "value": "1"},
                                     {"name": "MKL_NUM_THREADS", "value": "1"}],
                             "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}}}


def serving_ips(c: Cluster, replicas: int, runner: Runner, timeout: float = 300) -> list[str]:
    def ready() -> list[str] | None:
        pods = endpoint_pods(c, NAMESPACE, NAME)
        ips = sorted(p["status"]["podIP"] for p in pods if is_ready(p) and p["status"].get("podIP"))
        return ips if len(ips) == replicas and len(pods) == replicas else None
    assert runner.proc.poll() is None, runner.log()
    return wait_until(f"{replicas} ready engine pods", ready, timeout)


def fresh_engines(c: Cluster, replicas: int, runner: Runner) -> list[str]:
    """Delete the pods; the Deployment's replacements start with empty caches."""
    c.kubectl("delete", "pods", "-n", NAMESPACE, "-l", f"sluice.dev/endpoint={NAME}", "--wait=true", timeout=180)
    return serving_ips(c, replicas, runner)


class Proc:
    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None):
        self.log = log_dir / f"{name}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        stop_process(self.proc)


def gateway_bin() -> str:
    out = subprocess.run(["bash", str(SCRIPTS / "get-extproc-gateway.sh")], capture_output=True, text=True,
                         check=True, timeout=1800)
    return out.stdout.strip().splitlines()[-1]


def start_data_plane(log_dir: Path, args: list[str]) -> tuple[Proc, str]:
    port = free_port()
    gw = Proc("extproc-gateway", [gateway_bin(), "--listen", f"127.0.0.1:{port}", *args], log_dir)
    url = f"http://127.0.0.1:{port}"
    wait_until("the ext-proc gateway to listen", lambda: "listening on" in gw.text(), 30)
    return gw, url


def start_picker(mode: str, c: Cluster, log_dir: Path, procs: list[Proc]) -> list[str]:
    """The picker of `mode`, started; the data plane's arguments to reach it."""
    if mode == "round-robin":
        return []
    assert mode.startswith("sluice") or mode == "gie-epp", mode
    grpc_port = free_port()
    if mode.startswith("sluice"):
        # sluice@load-floor=8: the picker with --load-floor 8 (any picker flag, `@flag=value`, repeatable)
        extra = [a for opt in mode.split("@")[1:] for a in (f"--{opt.split('=')[0]}", opt.split("=", 1)[1])]
        proxy_port = free_port()
        procs.append(Proc("kubectl-proxy", [c.kubectl_path, f"--kubeconfig={c.kubeconfig}", "proxy",
                                            "--address=127.0.0.1", f"--port={proxy_port}"], log_dir))
        http_port = free_port()
        procs.append(Proc("sluice-picker", [
            sys.executable, "-m", "sluice_engine.entrypoints.cli", "gateway", "--endpoint-picker", "--kubernetes",
            "--kube-api", f"http://127.0.0.1:{proxy_port}", "-n", NAMESPACE, "--pool", f"{NAMESPACE}/{NAME}",
            "--host", "127.0.0.1", "--port", str(http_port), "--picker-port", str(grpc_port),
            "--scaler-port", str(free_port()), "--peer-port", str(free_port()), "--log-level", "warning", *extra],
            log_dir))
        wait_until("the Sluice picker to be ready", lambda: _ok(f"http://127.0.0.1:{http_port}/ready"), 60)
    else:
        epp_dir = subprocess.run(["bash", str(SCRIPTS / "get-gie-epp.sh"), "--bin"], capture_output=True,
                                 text=True, check=True).stdout.strip().splitlines()[-1]
        # GIE's picker reads its pool from the InferencePool (v1.5.0's standalone mode, --endpoint-selector,
        # refuses to start: it passes the empty --pool-name on as the pool's name).
        install_gie_crds(c)
        c.apply({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                 "metadata": {"name": NAME, "namespace": NAMESPACE},
                 "spec": {"selector": {"matchLabels": {"sluice.dev/endpoint": NAME}},
                          "targetPorts": [{"number": ENGINE_PORT}],
                          "endpointPickerRef": {"name": f"{NAME}-epp", "port": {"number": 9002}}}})
        health = free_port()
        procs.append(Proc("gie-epp", [
            f"{epp_dir}/epp", "--pool-name", NAME, "--pool-namespace", NAMESPACE,
            "--grpc-port", str(grpc_port), "--grpc-health-port", str(health), "--metrics-port", str(free_port()),
            "--secure-serving=false", "--tracing=false", "--refresh-metrics-interval", "50ms"], log_dir,
            env={"KUBECONFIG": str(c.kubeconfig), "POD_NAMESPACE": NAMESPACE}))
        time.sleep(5)  # it lists the pods and scrapes their metrics first
        assert procs[-1].proc.poll() is None, procs[-1].text()[-3000:]
    return ["--epp", f"127.0.0.1:{grpc_port}"]


def install_gie_crds(c: Cluster) -> None:
    """GIE's CRDs from its own module (the version scripts/get-gie-epp.sh builds)."""
    out = subprocess.run(["go", "mod", "download", "-json", "sigs.k8s.io/gateway-api-inference-extension@v1.5.0"],
                         capture_output=True, text=True, check=True, cwd=tempfile.gettempdir(),
                         env={**os.environ, "GOFLAGS": "-mod=mod"})
    bases = Path(json.loads(out.stdout)["Dir"]) / "config" / "crd" / "bases"
    for crd in sorted(bases.glob("*.yaml")):
        c.kubectl("apply", "--server-side", "-f", str(crd))
    c.wait_established("inferencepools.inference.networking.k8s.io")


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def drive(url: str, reqs: list[list[dict]], concurrency: int) -> tuple[list[dict], float]:
    queue = list(enumerate(reqs))
    results: list[dict] = [{}] * len(reqs)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker() -> None:
            while queue:
                i, messages = queue.pop(0)
                results[i] = await stream_chat(client, url, messages, MAX_TOKENS)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


def run_mode(mode: str, c: Cluster, runner: Runner, args: argparse.Namespace, log_dir: Path,
             reqs: list[list[dict]]) -> dict:
    ips = fresh_engines(c, args.replicas, runner)
    procs: list[Proc] = []
    try:
        (log_dir / mode).mkdir()
        plane_args = start_picker(mode, c, log_dir / mode, procs)
        if mode == "round-robin":
            plane_args = ["--round-robin", "--backends", ",".join(f"{ip}:{ENGINE_PORT}" for ip in ips)]
        gw, url = start_data_plane(log_dir / mode, plane_args)
        procs.append(gw)
        load0 = load_average()
        results, wall = asyncio.run(drive(url, reqs, args.concurrency))
        metrics = [scrape(f"http://{ip}:{ENGINE_PORT}") for ip in ips]
    finally:
        for p in reversed(procs):
            p.stop()
    queries = sum(m.get("sluice_prefix_cache_queries_total", 0.0) for m in metrics)
    hits = sum(m.get("sluice_prefix_cache_hits_total", 0.0) for m in metrics)
    ttfts = [r["ttft"] for r in results]
    return {"mode": mode, "hit_rate": hits / queries if queries else 0.0, "ttft_p50": statistics.median(ttfts),
            "ttft_p99": pct(ttfts, 99), "ttft_mean": statistics.mean(ttfts), "wall": wall,
            "req_per_s": len(results) / wall, "out_tok_per_s": sum(r["output_tokens"] for r in results) / wall,
            "per_engine": [m.get("sluice_request_success_total", 0.0) for m in metrics],
            "load_avg": f"{load0} -> {load_average()}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["sluice@load-floor=8", "sluice", "gie-epp", "round-robin"],
                    help="sluice (picker flags as sluice@flag=value@...; the operator renders --load-floor as half "
                         "the engines' max-num-seqs: 8 here), gie-epp, round-robin")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-cache", default="160MiB", help="per engine: room for ~6 prefixes of ~530 tokens")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cidr = pod_cidr()
    why = why_not(cidr)
    if why:
        sys.exit(f"gie_pickers: {why}")
    if "gie-epp" in args.modes:
        built = subprocess.run(["bash", str(SCRIPTS / "get-gie-epp.sh"), "--bin"], capture_output=True, text=True)
        if built.returncode != 0:
            sys.exit(f"gie_pickers: {built.stderr.strip()} (or leave gie-epp out of --modes)")
    gateway_bin()
    log_dir = Path(tempfile.mkdtemp(prefix="gie_pickers-"))
    reqs = workload(args.groups, args.per_group)
    print(f"logs in {log_dir}; CPU: {cpu_name()}; {len(reqs)} requests, {args.groups} prefixes, "
          f"concurrency {args.concurrency}, {args.replicas} engines", flush=True)
    rows = []
    with engines_cluster(log_dir / "cluster", cidr) as c:
        runner = Runner(c, log_dir / "pods", "--max-engines", str(args.replicas))
        try:
            apply_endpoint(c, endpoint(args.replicas, args.kv_cache), log_dir)
            serving_ips(c, args.replicas, runner)
            for mode in args.modes:
                row = run_mode(mode, c, runner, args, log_dir, reqs)
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            runner.stop()
    print(f"\n{len(reqs)} shared-prefix chats ({args.groups} system prompts x {args.per_group}), concurrency "
          f"{args.concurrency}, {args.replicas} engines, CPU {cpu_name()}:\n")
    print("| picker | prefix-cache hit rate | TTFT p50 | TTFT p99 | requests/s | output tokens/s | requests per engine |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['mode']} | {100 * r['hit_rate']:.1f}% | {r['ttft_p50']:.2f} s | {r['ttft_p99']:.2f} s | "
              f"{r['req_per_s']:.2f} | {r['out_tok_per_s']:.1f} | {' / '.join(f'{n:.0f}' for n in r['per_engine'])} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
