"""Test helpers for the gateway: a tiny fake OpenAI backend (aiohttp, loopback) for tests where a real engine
adds nothing, in-process or as its own process (`python tests/support/gateway_fakes.py NAME`, for SIGKILL and
SIGSTOP), and a `sluice gateway` subprocess for tests that run real engines."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from aiohttp import web

from sluice_autoscaler.config import GatewayConfig
from sluice_autoscaler.gateway import Gateway


class FakeBackend:
    """Answers chat/completions with its own name; streams `chunks` SSE chunks `delay` seconds apart."""

    def __init__(self, name: str, model: str = "m", *, chunks: int = 3, delay: float = 0.0):
        self.name, self.model, self.chunks, self.delay = name, model, chunks, delay
        self.ready = True
        self.status: int | None = None  # answer every completion with this status instead
        self.error_code = "fake"  # ... and this error code (the engine's: request_failed, engine_dead, ...)
        self.requests: list[dict[str, Any]] = []
        self.completed = 0  # answers sent whole
        self.aborted = 0  # answers cut short because the gateway (the client) went away
        self.headers: list[dict[str, str]] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _ready(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ready" if self.ready else "starting"}, status=200 if self.ready else 503)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.status is not None:
            return web.json_response({"error": {"message": f"{self.name} says {self.status}", "type": "x",
                                                "param": None, "code": self.error_code}}, status=self.status,
                                     headers={"Retry-After": "1"})
        done = False
        try:
            if not body.get("stream"):
                await asyncio.sleep(self.delay)
                resp = web.json_response({"id": "x", "object": "chat.completion", "model": self.model,
                                          "backend": self.name, "choices": [{"index": 0, "message": {
                                              "role": "assistant", "content": self.name}, "finish_reason": "stop"}]})
                done = True
                return resp
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(self.chunks):
                await asyncio.sleep(self.delay)
                chunk = {"id": "x", "object": "chat.completion.chunk", "model": self.model, "backend": self.name,
                         "choices": [{"index": 0, "delta": {"content": f"{self.name}{i} "}, "finish_reason": None}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            done = True
            return resp
        finally:  # a write to a gone client raises; a cancelled handler lands here too
            if done:
                self.completed += 1
            else:
                self.aborted += 1

    async def _stats(self, _: web.Request) -> web.Response:
        return web.json_response({"requests": len(self.requests), "completed": self.completed,
                                  "aborted": self.aborted})

    async def start(self, port: int = 0) -> FakeBackend:
        app = web.Application()
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/stats", self._stats)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()


async def start_gateway(**kw: Any) -> Gateway:
    """An in-process gateway on free loopback ports."""
    cfg = GatewayConfig(**{"host": "127.0.0.1", "port": 0, "scaler_port": 0, "health_interval": 0.2,
                           "health_interval_cold": 0.05, "debug_headers": True, **kw})
    gw = Gateway(cfg)
    await gw.start()
    return gw


async def wait_until(cond, timeout: float = 10.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(interval)


def chat(model: str, text: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **kw}


# -- an in-memory Kubernetes API (kmock) ------------------------------------------------------------------------
ENDPOINTS_RESOURCE = "sluice.dev/v1alpha1/inferenceendpoints"


def add_sluice_resources(kmock: Any) -> Any:
    """kmock with the built-in resources and the InferenceEndpoint CRD's."""
    kmock.resources.load_bundled()
    kmock.resources[ENDPOINTS_RESOURCE] = {"kind": "InferenceEndpoint", "namespaced": True,
                                           "verbs": {"get", "list", "watch", "create", "patch", "update", "delete"},
                                           "subresources": {"status"}}
    return kmock


async def kube_call(k8s: Any, method: str, path: str, body: Any = None) -> Any:
    """One call to kmock's API over HTTP, as a client in a cluster makes it."""
    ctype = "application/merge-patch+json" if method == "PATCH" else "application/json"
    async with aiohttp.ClientSession() as s, s.request(method, str(k8s.url).rstrip("/") + path, json=body,
                                                       headers={"Content-Type": ctype}) as r:
        assert r.status < 400, await r.text()
        return await r.json()


def endpoint_slice(name: str, namespace: str, labels: dict[str, str], url: str, ready: bool = True,
                   port_name: str = "http") -> dict[str, Any]:
    """An EndpointSlice with one address and one port: that of `url`."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "addressType": "IPv4",
            "ports": [{"name": port_name, "port": int(port), "protocol": "TCP"}],
            "endpoints": [{"addresses": [host], "conditions": {"ready": ready}}]}


class GatewayProcess:
    """`sluice gateway` as a subprocess (the CLI as deployed), on free loopback ports."""

    def __init__(self, args: list[str], log_path: Path, peer_port: int | None = None):
        from servers import free_port

        self.port, self.scaler_port = free_port(), free_port()
        self.peer_port = peer_port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice_engine.entrypoints.cli", "gateway", "--host", "127.0.0.1", "--port", str(self.port),
             "--scaler-port", str(self.scaler_port), "--peer-port", str(self.peer_port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sluice gateway exited with {self.proc.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"sluice gateway not ready:\n{log_path.read_text()}")
            time.sleep(0.1)

    def metrics(self) -> dict[str, float]:
        """Samples by name with labels, e.g. 'sluice_gateway_pending_requests{endpoint="m"}'."""
        out = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


class FakeBackendProcess:
    """A FakeBackend in its own process: something to SIGKILL or SIGSTOP."""

    def __init__(self, name: str, *, chunks: int = 3, delay: float = 0.0, model: str = "m"):
        from servers import free_port

        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, __file__, name, "--port", str(self.port), "--model", model,
                                      "--chunks", str(chunks), "--delay", str(delay)])
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, f"fake backend {name} exited with {self.proc.returncode}"
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"fake backend {name} not ready"
            time.sleep(0.05)

    def stats(self) -> dict[str, int]:
        return httpx.get(f"{self.url}/stats", timeout=5).json()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)


def _main() -> None:
    p = argparse.ArgumentParser(description="a fake OpenAI backend on 127.0.0.1 (tests only)")
    p.add_argument("name")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="m")
    p.add_argument("--chunks", type=int, default=3)
    p.add_argument("--delay", type=float, default=0.0)
    args = p.parse_args()

    async def serve() -> None:
        await FakeBackend(args.name, args.model, chunks=args.chunks, delay=args.delay).start(args.port)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    _main()
