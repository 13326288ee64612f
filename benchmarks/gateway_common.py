"""Helpers shared by the gateway benchmarks: engine and gateway subprocesses, a streaming client that
times the first token, Prometheus scrapes. Everything runs on loopback, as the tests do."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from server_process import free_port, stop_process

SERVED_NAME = "smollm2"
ENDPOINT = "default/smollm2"


class Proc:
    """A `sluice ...` subprocess with its log file."""

    def __init__(self, args: list[str], log_path: Path, port: int, quiet: bool = False,
                 env: dict[str, str] | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "sluice_engine.entrypoints.cli", *args]
        if not quiet:
            print(f"  starting: sluice {shlex.join(args)}", flush=True)
        with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def wait_ready(self, timeout: float = 300) -> float:
        """Seconds until GET /ready answers 200."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{self.url} not ready after {timeout}s")

    def stop(self) -> None:
        stop_process(self.proc)


def start_engine(model_dir: str, log_dir: Path, name: str, extra: list[str] = (), quiet: bool = False,
                 threads: int | None = None) -> Proc:
    port = free_port()
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else None
    return Proc(["serve", "--model", model_dir, "--served-model-name", SERVED_NAME, "--port", str(port),
                 "--log-level", "warning", *extra], log_dir / f"{name}.log", port, quiet, env)


def start_gateway(log_dir: Path, args: list[str]) -> Proc:
    port = free_port()
    gw = Proc(["gateway", "--host", "127.0.0.1", "--port", str(port), "--scaler-port", str(free_port()),
               "--debug-headers", "--log-level", "warning", *args], log_dir / "gateway.log", port)
    gw.wait_ready(30)
    return gw


def write_backends(path: Path, serving: list[str], standby: list[str] = ()) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"endpoints": [{"model": SERVED_NAME, "name": ENDPOINT, "serving": list(serving),
                                              "standby": list(standby)}]}))
    tmp.replace(path)


async def stream_chat(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int,
                      t0: float | None = None) -> dict:
    """One streaming chat completion: TTFT (first content token, from t0), total time, output tokens, and
    the backend's role (the gateway's debug header)."""
    t0 = time.perf_counter() if t0 is None else t0
    body = {"model": SERVED_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    ttft, usage = None, {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        role, backend = r.headers.get("x-sluice-role", ""), r.headers.get("x-sluice-backend", "")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
    return {"ttft": ttft, "total": time.perf_counter() - t0, "role": role, "backend": backend,
            "output_tokens": usage.get("completion_tokens", 0), "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def scrape(url: str) -> dict[str, float]:
    """Metric samples summed over labels, by name."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f}s (min {min(values):.2f}, max {max(values):.2f})"


def load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"
