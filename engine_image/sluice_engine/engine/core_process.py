"""The engine-core process: the scheduler, the executor (rank 0's model shard, the other ranks' launcher) and
the engine loop, fed by plain messages (engine/messages.py) over ZMQ from the API process.

`sluice serve` starts it (`python -m sluice_engine.engine.core_process --commands ADDR --outputs ADDR --clock FILE`),
sends the EngineConfig as the first message, and from then on only commands; the core answers CoreReady
once the model is loaded (or CoreDead with why not), then one CoreOutputs per step. The API process keeps
the HTTP server, tokenization, chat templates, grammar checks and response building, so neither waits on
the other's Python (they share no GIL).

The core exits when told (Shutdown), when its loop fails (after CoreDead), or when the API process is
gone (its parent pid changes): it never outlives the server that started it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import msgspec
import zmq

from ..config import EngineConfig
from .core_loop import EngineLoop
from .llm_engine import LLMEngine
from .messages import (
    CoreDead,
    CoreOutputs,
    CoreReady,
    CoreWarmedUp,
    LoRAUpdated,
    Shutdown,
    command_codec,
    core_message_codec,
    refusal,
)
from .output import RequestOutput
from .step_clock import MappedStepClock

log = logging.getLogger("sluice.engine")



class ZmqInbox:
    def __init__(self, sock: zmq.Socket, parent_pid: int):
        self.sock = sock
        self.parent_pid = parent_pid
        _, self.decoder = command_codec()

    def get(self, timeout: float | None):
        if os.getppid() != self.parent_pid:  # the API process is gone: nobody will read what we make
            log.error("the API process (pid %d) is gone: the engine core stops", self.parent_pid)
            return Shutdown()
        if timeout is not None and not self.sock.poll(int(timeout * 1000)):
            return None
        try:
            frame = self.sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self.decoder.decode(frame.buffer)


class ZmqOutbox:
    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.encoder, _ = core_message_codec()

    def _send(self, msg) -> None:
        self.sock.send(self.encoder.encode(msg), copy=False)

    def send(self, items, stats) -> None:
        if not items and stats is None:
            return
        outputs = [o for _, o in items if isinstance(o, RequestOutput)]
        refused = [refusal(rid, e) for rid, e in items if not isinstance(e, RequestOutput)]
        self._send(CoreOutputs(outputs, refused, stats))

    def warmed_up(self, report) -> None:
        self._send(CoreWarmedUp(report.mode, report.steps, report.seconds))

    def lora_updated(self, msg: LoRAUpdated) -> None:
        self._send(msg)

    def dead(self, e: BaseException) -> None:
        self._send(CoreDead(f"{e!r}"))


def ready_message(engine: LLMEngine, stats) -> CoreReady:
    info = engine.model_info
    return CoreReady(info.served_model_name, str(info.model_dir), info.max_model_len, info.vocab_size,
                     sorted(info.eos_token_ids), stats, list(info.lora_names))


def serve_core(commands: str, outputs: str, clock_path: str, parent_pid: int) -> int:
    # Ctrl-C reaches the whole process group; the API process then shuts the core down in order (drain).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(commands)
    push = ctx.socket(zmq.PUSH)
    push.connect(outputs)
    outbox = ZmqOutbox(push)
    try:
        cfg = msgspec.msgpack.decode(pull.recv(), type=EngineConfig)
        engine = LLMEngine(cfg)
        engine.detokenize = False  # token deltas only: the API process makes the text (engine/output_processor.py)
    except BaseException as e:  # noqa: BLE001 - told to the API process, which reports it and exits
        if not isinstance(e, ValueError):
            log.exception("the engine did not start")
        outbox._send(CoreDead(str(e) if isinstance(e, ValueError) else f"the engine did not start: {e!r}",
                              config_error=isinstance(e, ValueError)))
        _close(ctx, pull, push)
        return 2 if isinstance(e, ValueError) else 1
    loop = EngineLoop(engine, ZmqInbox(pull, parent_pid), outbox, MappedStepClock(clock_path),
                      objectives_file=cfg.objectives_file, lora_modules_file=cfg.lora_modules_file)
    outbox._send(ready_message(engine, loop.snapshot()))
    loop.run()
    code = 0 if loop.dead is None else 1
    try:
        if loop.dead is None:
            engine.shutdown()  # the other ranks stop with it
        else:
            engine.executor.shutdown(graceful=False)
    finally:
        _close(ctx, pull, push)
    return code


def _close(ctx: zmq.Context, pull: zmq.Socket, push: zmq.Socket) -> None:
    pull.close(linger=0)
    push.close(linger=2000)  # what is queued (the last outputs, CoreDead) still leaves, if anyone reads it
    ctx.term()  # waits for every socket of the context to be closed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sluice_engine.engine.core_process")
    p.add_argument("--commands", required=True, help="ZMQ address the API process sends commands on")
    p.add_argument("--outputs", required=True, help="ZMQ address the core sends outputs to")
    p.add_argument("--clock", required=True, help="the shared step-clock file")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    code = serve_core(args.commands, args.outputs, args.clock, args.parent_pid)
    # Skip interpreter teardown: a process group's destructors can wait on ranks that are gone.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
