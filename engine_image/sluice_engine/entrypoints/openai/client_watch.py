"""Notice a client leaving the moment its connection closes, not at the next poll.

A request's ASGI `receive` has nothing more to deliver once its body is read, except
`http.disconnect` when the client closes the connection: a task waiting on it learns of the departure
as soon as the server does. The request is then aborted in the engine at once, so a request that was
still waiting is never prefilled for nobody (vLLM #11190), and the time the client left travels
with the abort so the engine can count what an abandoned request cost (docs/metrics.md).

Polling `Request.is_disconnected()` instead left up to a poll interval in which an abandoned request
could still be scheduled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .errors import APIError

T = TypeVar("T")


def client_left_error() -> APIError:
    # 499 is nginx's "client closed request": nobody reads it, but logs and the gateway do.
    return APIError(499, "client disconnected", code="client_closed_request")


class ClientWatch:
    """Watches one request's connection. `left_at` is the time.monotonic() the server noticed the
    client leave (None while it is there); callbacks registered with on_left run then, once."""

    def __init__(self, receive: Callable[[], Awaitable[dict]] | None):
        self.left_at: float | None = None
        self.left = asyncio.Event()
        self._callbacks: list[Callable[[float], None]] = []
        self._task = asyncio.ensure_future(self._watch(receive)) if receive is not None else None

    async def _watch(self, receive) -> None:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                self._mark_left()
                return

    def _mark_left(self) -> None:
        if self.left_at is not None:
            return
        self.left_at = time.monotonic()
        self.left.set()
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self.left_at)

    def on_left(self, callback: Callable[[float], None]) -> Callable[[], None]:
        """Run callback(left_at) when the client leaves (at once if it has left). Returns a function
        that unregisters it."""
        if self.left_at is not None:
            callback(self.left_at)
            return lambda: None
        self._callbacks.append(callback)

        def unregister() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)
        return unregister

    async def race(self, aw: Awaitable[T]) -> T:
        """Await aw unless the client leaves first; then cancel it and raise the 499 APIError."""
        if self.left_at is not None:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise client_left_error()
        task = asyncio.ensure_future(aw)
        gone = asyncio.ensure_future(self.left.wait())
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this request's handler was cancelled: so is what it awaited
            task.cancel()
            raise
        finally:
            gone.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise client_left_error()

    def close(self) -> None:
        """The response is complete: stop watching (after it, `receive` reports a disconnect that
        is no departure)."""
        self._callbacks.clear()
        if self._task is not None:
            self._task.cancel()
            self._task = None


class NoWatch(ClientWatch):
    """For callers without a connection (tests calling OpenAIServing directly)."""

    def __init__(self) -> None:
        super().__init__(None)
