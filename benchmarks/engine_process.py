"""Issue 25's throughput check, in one sitting: the engine core in its own process (the default) against the
engine in a thread of the API server (`--no-engine-process`), and, with `--before REV`, against the code of an
earlier commit (a git worktree of it, run from its own sources), loaded by one client (`sluice bench
--compare`) with the same prompts at concurrency 1, 8 and 32. Default flags otherwise (the bundled model in
its Q4_1 blocks on CPU).

    .venv/bin/python benchmarks/engine_process.py --before 7d7c94a          # ~8 min on 2 cores
    .venv/bin/python benchmarks/engine_process.py --concurrency 1,8 --num-requests 16
    .venv/bin/python benchmarks/engine_process.py --servers core-process,async --before 7d7c94a   # async scheduling

All servers stay up for the whole sitting; the idle ones wait while another is measured (an idle engine wakes
twice a second). Every server gets the same threads (OMP_NUM_THREADS, default the machine's cores).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from server_process import compare_servers

ROOT = Path(__file__).resolve().parent.parent


def worktree(rev: str) -> Path:
    """A checkout of `rev` under bench-results/ (made once), whose engine_image/ the 'before' server imports."""
    path = ROOT / "bench-results" / f"before-{rev}"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                       stdout=subprocess.DEVNULL)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--before", default=None, metavar="REV", help="also serve this commit's engine (a worktree)")
    p.add_argument("--servers", default="core-process,in-thread",
                   help="which of this tree's servers: core-process (the default flags), in-thread "
                        "(--no-engine-process), no-async (--no-async-scheduling), async (--async-scheduling)")
    p.add_argument("--port", type=int, default=18400, help="first of the servers' ports")
    p.add_argument("--json", help="the bench's JSON results")
    p.add_argument("--log-dir", default=str(ROOT / "bench-results" / "engine-process-logs"))
    a = p.parse_args()

    from sluice_engine.bench.machine import cpu_name

    logs = Path(a.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    serve = [sys.executable, "-m", "sluice_engine.entrypoints.cli", "serve", "--host", "127.0.0.1", "--log-level", "warning"]
    variants = {"core-process": [], "in-thread": ["--no-engine-process"], "no-async": ["--no-async-scheduling"],
                "async": ["--async-scheduling"]}
    servers: dict[str, tuple[list[str], dict[str, str], str]] = {}
    for i, name in enumerate(a.servers.split(",")):
        servers[name] = ([*serve, "--port", str(a.port + i), *variants[name]], env, "/ready")
    if a.before:
        old = worktree(a.before)
        # The command line's module as that commit has it (it moved to entrypoints/ in the re-layout).
        cli = ("sluice_engine.entrypoints.cli" if (old / "engine_image/sluice_engine/entrypoints/cli.py").exists()
               else "sluice_engine.cli")
        old_serve = [sys.executable, "-m", cli, *serve[3:]]
        servers[f"before-{a.before}"] = ([*old_serve, "--port", str(a.port + len(servers))],
                                         {**env, "PYTHONPATH": str(old / "engine_image")}, "/ready")
    print(f"CPU: {cpu_name()}, {a.threads} threads per server", flush=True)
    bench = ["--max-concurrency", a.concurrency, "--num-requests", str(a.num_requests), "--seed", str(a.seed),
             "--no-progress"]
    if a.json:
        bench += ["--json", a.json]
    sys.exit(compare_servers(servers, a.port, logs, bench, env))

if __name__ == "__main__":
    main()
