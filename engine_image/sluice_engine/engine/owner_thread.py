"""A worker thread that builds what it will run: on CPU, torch's OpenMP workers serve the thread that
first ran parallel work, and a model loaded in one thread and stepped in another measured ~45% slower
per decode step (SmolLM2-135M, batch 1, 2 cores: 48 vs 33 ms)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def start_owner_thread(build: Callable[[], T], run: Callable[[], None], name: str) -> tuple[T, threading.Thread]:
    """Run `build` in a new daemon thread, then `run` in that same thread. Returns what `build` made
    once it is made (its exception is raised here instead, and `run` never starts), and the thread."""
    made: list[T] = []
    failure: list[BaseException] = []
    done = threading.Event()

    def main() -> None:
        try:
            made.append(build())
        except BaseException as e:  # re-raised in the caller's thread
            failure.append(e)
            return
        finally:
            done.set()
        run()

    thread = threading.Thread(target=main, name=name, daemon=True)
    thread.start()
    done.wait()
    if failure:
        raise failure[0]
    return made[0], thread
