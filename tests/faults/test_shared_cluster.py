"""Fault suite, issue 39 (safe on a shared cluster), the engine API's part: the pod network is not a trust
boundary, so what anyone who reaches the port can learn or do is bounded.

- Run-time adapter loads read only from under --lora-root, and a path outside it is refused with one message
  whether it exists or not (no probing the disk through error texts).
- The adapter routes need --admin-api-key: the inference key is not enough.
- The API's schema pages (/docs, /redoc, /openapi.json) are behind --api-key like the /v1 routes.
- /health and /ready say a status word and a fixed reason, never an exception's text; /v1/models shows no
  filesystem path.
- The flags that open the adapter routes refuse to start without the root and the admin key, naming them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from servers import engine_core_pid

pytestmark = pytest.mark.slow

KEY, ADMIN_KEY = "inference-key", "admin-key"
AUTH, ADMIN = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory):
    """A root with a symlink that leads out of it (to /etc) and a directory that is not an adapter."""
    root = tmp_path_factory.mktemp("lora-root")
    (root / "escape").symlink_to("/etc")
    (root / "empty").mkdir()
    return root


@pytest.fixture(scope="module")
def server(start_server, lora_root):
    return start_server("--max-model-len", "256", "--kv-cache-memory", "64M", "--enable-lora",
                        "--api-key", KEY, "--admin-api-key", ADMIN_KEY,
                        "--allow-runtime-lora-updates", "--lora-root", str(lora_root))


def load(server, path: str, headers=ADMIN) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "probe", "lora_path": path},
                      headers=headers, timeout=60)


def test_a_path_outside_the_root_is_refused_the_same_whether_it_exists_or_not(server, lora_root):
    outside = ["/etc", "/nonexistent-xyz", "/etc/passwd", str(lora_root / "escape"), str(lora_root / "escape" / "x"),
               str(lora_root / ".." / "elsewhere"), "../../etc", str(lora_root.parent)]
    answers = {path: load(server, path) for path in outside}
    for path, r in answers.items():
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == "lora_path", (path, r.text)
    bodies = {r.content for r in answers.values()}
    assert len(bodies) == 1, bodies  # byte for byte: nothing tells /etc from /nonexistent-xyz
    message = answers["/etc"].json()["error"]["message"]
    assert "--lora-root" in message and "/etc" not in message and str(lora_root) not in message
    # Under the root, the loader's own reasons come back (the admin placed what is there).
    r = load(server, str(lora_root / "empty"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path" and r.content not in bodies, r.text
    r = load(server, "empty")  # a relative path is taken under the root
    assert r.status_code == 400 and r.content not in bodies, r.text
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_the_adapter_routes_need_the_admin_key(server):
    for headers in ({}, AUTH, {"Authorization": "Bearer wrong"}):
        r = load(server, "/etc", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
        assert "--admin-api-key" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=headers)
        assert r.status_code == 401, (headers, r.text)
    assert load(server, "/etc").status_code == 400  # the admin key passes (and the path is refused)
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name", r.text
    # The inference routes still take the inference key alone.
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH).status_code == 200


def test_the_schema_pages_are_behind_the_api_key(server):
    for path in ("/openapi.json", "/docs", "/redoc"):
        r = httpx.get(f"{server.url}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        assert httpx.get(f"{server.url}{path}", headers=AUTH).status_code == 200, path
    for path in ("/health", "/ready", "/metrics"):  # probes and scrapes stay open
        assert httpx.get(f"{server.url}{path}").status_code == 200, path


def test_models_shows_no_local_path(server, model_dir):
    r = httpx.get(f"{server.url}/v1/models", headers=AUTH)
    assert r.status_code == 200
    (base,) = r.json()["data"]
    assert base["id"] == base["root"] == server.model
    assert str(model_dir) not in r.text and os.path.realpath(model_dir) not in r.text


def test_a_dead_engine_says_so_without_its_exception(start_server):
    """The core dies (SIGKILL): both probes answer 503 with a fixed reason; the exception's text (here "engine
    core process exited ...") goes to the log, not to whoever probes."""
    server = start_server("--max-model-len", "256", "--kv-cache-memory", "64M")
    os.kill(engine_core_pid(server), signal.SIGKILL)
    bodies = {}
    deadline = time.monotonic() + 5
    while len(bodies) < 2 and time.monotonic() < deadline:  # the server stops about a second after the death
        for path in ("/health", "/ready"):
            try:
                r = httpx.get(f"{server.url}{path}", timeout=2)
            except httpx.HTTPError:
                break
            if r.status_code == 503:
                bodies[path] = r.json()
        time.sleep(0.02)
    assert bodies.get("/health") == {"status": "dead", "error": "engine dead"}, bodies
    if "/ready" in bodies:
        assert bodies["/ready"] == {"status": "not ready", "error": "engine dead"}, bodies
    assert server.proc.wait(timeout=30) != 0
    assert "engine core process exited" in server.log_path.read_text()  # the detail is logged


def serve_exits(model_dir, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SLUICE_API_KEY", "SLUICE_ADMIN_API_KEY")}
    return subprocess.run([sys.executable, "-m", "sluice_engine.entrypoints.cli", "serve", "--model", str(model_dir),
                           "--port", "0", "--enable-lora", "--allow-runtime-lora-updates", *flags],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("flags, named", [
    ((), "--lora-root"),
    (("--lora-root", "/tmp", "--api-key", KEY), "--admin-api-key"),
    (("--lora-root", "/tmp", "--api-key", KEY, "--admin-api-key", KEY), "--admin-api-key must differ"),
])
def test_runtime_lora_updates_refuse_to_start_unguarded(model_dir, flags, named):
    r = serve_exits(model_dir, *flags)
    assert r.returncode != 0 and named in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
