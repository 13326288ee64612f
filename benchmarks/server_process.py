"""A server under benchmark as a subprocess: started with its output in a log file, waited on until its
readiness path answers 200 (or it exits, with its log's tail in the error), and stopped (terminate, then kill
after 20 s). Shared by the benchmark scripts that start sluice and its peers (llama-server) themselves;
`compare_servers` runs one `sluice bench --compare` sitting over several of them."""

from __future__ import annotations

import contextlib
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path, url: str, ready_path: str):
        self.name, self.cmd, self.url, self.log_path, self.ready_path = name, cmd, url, log_path, ready_path
        print(f"starting {name}: {shlex.join(cmd)}  (log: {log_path})", flush=True)
        with open(log_path, "w") as logf:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before ready:\n"
                                   f"{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name}: {self.url}{self.ready_path} not 200 within {timeout:.0f}s")

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen) -> None:
    """Terminate proc (20 s to exit, then kill) unless it has exited."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def compare_servers(servers: dict[str, tuple[list[str], dict[str, str], str]], first_port: int, log_dir: Path,
                    bench_args: list[str], env: dict[str, str]) -> int:
    """One sitting: start every server (name -> (command, environment, readiness path); the i-th listens on
    first_port + i, as its command says), wait until all are ready, load them with one `sluice bench --compare`
    (bench_args appended) and stop them. Returns the bench's exit code."""
    urls = {name: f"http://127.0.0.1:{first_port + i}" for i, name in enumerate(servers)}
    with contextlib.ExitStack() as stack:
        started = []
        for name, (cmd, server_env, ready_path) in servers.items():
            started.append(server := Server(name, cmd, server_env, log_dir / f"{name}.log", urls[name], ready_path))
            stack.callback(server.stop)
        for server in started:
            server.wait_ready(600)
        bench = [sys.executable, "-m", "sluice_engine.entrypoints.cli", "bench", "--compare",
                 *(f"{n}={u}" for n, u in urls.items()), *bench_args]
        print("$ " + " ".join(bench[2:]), flush=True)
        return subprocess.run(bench, env=env).returncode
