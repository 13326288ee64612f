"""A real `sluice serve` process for tests, and the process helpers around it (one place for them: the
fixtures in tests/conftest.py and the tests that start servers themselves use these)."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

SERVED_NAME = "smollm2"


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now and never handed out before by this process. Callers bind it later (often in a
    subprocess), and the kernel may give a closed probe's port to the next probe: a gateway started with three
    ports from three calls in a row once got one port twice and could not bind its second listener (CI)."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no loopback port left that this process has not handed out already")


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path):
        self.port = free_port()
        self.model = SERVED_NAME
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice_engine.entrypoints.cli", "serve", "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def wait_ready(self, timeout: float = 180) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sluice serve exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"sluice serve not ready after {timeout}s:\n{self.log_path.read_text()}")

    def metrics(self) -> dict[str, float]:
        """Scalar metric samples by name (labels dropped; one model per server)."""
        import httpx

        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name_labels, value = line.rsplit(" ", 1)
                out[name_labels.split("{")[0]] = out.get(name_labels.split("{")[0], 0.0) + float(value)
        return out

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


def stop_process(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def engine_core_pid(server: ServerProcess) -> int:
    """The pid of the engine-core process a `sluice serve` started (core_process.py)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for pid in child_pids(server.proc.pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"sluice_engine.engine.core_process" in f.read():
                    return pid
        time.sleep(0.1)
    raise AssertionError("no engine-core process under the server")


def rss_mib(pid: int) -> float:
    """A process's resident memory now, in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def process_gone(pid: int, timeout: float) -> bool:
    """Whether the process exits (or is a zombie) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie (exited, not yet reaped) is gone too
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False
