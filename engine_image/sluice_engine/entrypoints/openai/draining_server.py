"""uvicorn's server, with a graceful drain on SIGTERM (what Kubernetes sends before it kills a pod).

On the first SIGTERM: /ready turns 503 and new requests get 503 at once (so the Service and the gateway
move traffic elsewhere), in-flight requests run on until they finish or `--shutdown-timeout` passes;
streams still open then end with an error event and `[DONE]`, never a silent cut. Then the server
stops and the process exits 0. A second signal (or SIGINT) stops at once, as plain uvicorn does.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import uvicorn

from ...engine.async_engine import AsyncEngine

log = logging.getLogger("sluice.api")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, drain_timeout: float):
        super().__init__(config)
        self.async_engine = async_engine
        self.drain_timeout = drain_timeout
        self._draining = False

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self._draining and not self.should_exit:
            self._draining = True  # not recorded as captured: uvicorn would re-raise it and exit -15
            self.async_engine.begin_drain()
            threading.Thread(target=self._drain, name="sluice-drain", daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        engine = self.async_engine
        open_at_signal = engine.num_open
        log.info("SIGTERM: draining %d open requests (up to %g s)", open_at_signal, self.drain_timeout)
        deadline = time.monotonic() + self.drain_timeout
        while engine.num_open and time.monotonic() < deadline and engine.dead is None:
            time.sleep(0.05)
        left = engine.num_open
        if left:
            log.warning("drain timeout: ending %d open requests", left)
            engine.end_open_requests(f"server shutting down: the drain timeout ({self.drain_timeout:g} s) passed")
            end = time.monotonic() + 5  # let their error events reach the clients
            while engine.num_open and time.monotonic() < end:
                time.sleep(0.05)
        log.info("drained (%d of %d requests finished); stopping", open_at_signal - left, open_at_signal)
        self.should_exit = True
