"""extproc-gateway (e2e/extproc_gateway) for tests: the data plane that consults an EPP over Envoy's ext-proc
protocol as a GIE-conformant gateway does (we run no Envoy), or round-robins over backends without one.

`extproc_gateway_bin()` is the binary scripts/get-extproc-gateway.sh built (building it where it is missing;
skipping the test, saying why, where Go is missing or the build fails). `run_extproc_gateway(args)` runs it on
a free 127.0.0.1 port for the length of a `with` block and gives its base URL:

    with run_extproc_gateway(["--epp", f"127.0.0.1:{epp_port}"]) as url:
        httpx.post(f"{url}/v1/completions", json=...)
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from dev_cluster import tail
from servers import stop_process

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "get-extproc-gateway.sh"
LISTENING = re.compile(r"^listening on (http://\S+)$", re.MULTILINE)

_built: str | None = None
_skip_reason: str | None = None  # a failed build is not retried for every test of the session


def extproc_gateway_bin() -> str:
    """The path of the extproc-gateway binary for this source; builds it once (a cold build takes a minute or
    two: scripts/test.sh runs the script first). Skips the calling test where it cannot be built."""
    global _built, _skip_reason
    if _built is not None:
        return _built
    if _skip_reason is not None:
        pytest.skip(_skip_reason)
    found = subprocess.run(["bash", str(SCRIPT), "--bin"], capture_output=True, text=True, timeout=60)
    if found.returncode == 0:
        _built = found.stdout.strip().splitlines()[-1]
        return _built
    go = os.environ.get("GO", "go")
    if shutil.which(go) is None:
        _skip_reason = (f"extproc-gateway is not built and '{go}' is not found: install Go >= 1.26 (or run "
                        f"scripts/get-extproc-gateway.sh where Go is); ext-proc tests skipped")
        pytest.skip(_skip_reason)
    build = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=1800)
    if build.returncode != 0 or not build.stdout.strip():
        _skip_reason = (f"extproc-gateway could not be built (scripts/get-extproc-gateway.sh exited "
                        f"{build.returncode}); ext-proc tests skipped. Its output ends:\n{tail(build.stderr)}")
        pytest.skip(_skip_reason)
    _built = build.stdout.strip().splitlines()[-1]
    return _built


def _accepts(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


@contextmanager
def run_extproc_gateway(args: list[str], timeout: float = 15) -> Iterator[str]:
    """Runs extproc-gateway with `args` (e.g. ["--epp", "127.0.0.1:9002"] or ["--round-robin", "--backends",
    "127.0.0.1:8001,127.0.0.1:8002"]) and yields its URL, "http://127.0.0.1:PORT", once it accepts
    connections; stops it on exit. It listens on a port the kernel picks (no race for a "free" port) unless
    `args` has a --listen of its own; the port is read from its "listening on http://ADDR" line."""
    binary = extproc_gateway_bin()
    if not any(a == "--listen" or a.startswith("--listen=") for a in args):
        args = ["--listen", "127.0.0.1:0", *args]
    with tempfile.TemporaryDirectory(prefix="extproc-gateway-") as tmp:
        out_path, err_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen([binary, *args], stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        try:
            url = None
            deadline = time.monotonic() + timeout
            while True:
                if url is None and (m := LISTENING.search(out_path.read_text(errors="replace"))):
                    url = m.group(1)
                if url is not None and _accepts(url):
                    break
                if proc.poll() is not None:
                    raise RuntimeError(f"extproc-gateway {' '.join(args)} exited with {proc.returncode} before it "
                                       f"accepted connections:\n{tail(err_path.read_text(errors='replace'))}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"extproc-gateway {' '.join(args)} did not accept connections within "
                                       f"{timeout}s:\n{tail(err_path.read_text(errors='replace'))}")
                time.sleep(0.05)
            yield url
        finally:
            stop_process(proc, timeout=5)
