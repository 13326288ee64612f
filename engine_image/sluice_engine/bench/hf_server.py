"""A peer for `sluice bench --compare`: HF transformers `generate` with static batching, behind a minimal
OpenAI-compatible API on loopback (POST /v1/completions and /v1/chat/completions, streaming or not;
GET /v1/models, /health).

    python -m sluice_engine.bench.hf_server --port 8001 --max-batch-size 32 --threads 2

Static batching, as serving stacks did before continuous batching: a batch starts when --max-batch-size
requests are waiting, or --batch-wait-ms after the oldest waiting one arrived; its prompts are left-padded
into one `generate` call that runs until every row is done; requests arriving meanwhile wait for the next
batch. Rows finish on their own terms (their max_tokens, or EOS unless ignore_eos), but the batch runs as
long as its longest row: that is the waste continuous batching removes.

Tokens are streamed per step as they are generated (one SSE chunk per token), so a streaming client measures
TTFT honestly: the wait for the previous batch, the batching window, and this batch's padded prefill. A
finished row's stream ends at once, though its batch runs on. Not honoured: stop strings, logprobs, n > 1;
a batch samples with its first request's temperature/top_p (the bench sends one temperature to all).

Same weights as `sluice serve` (fp32 by default) and the same tokenizer and chat template (the engine's
Tokenizer), so both servers see identical prompt ids.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import os
import queue
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("sluice.bench.hf_server")


@dataclass(slots=True)
class Job:
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    temperature: float
    top_p: float
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue  # (text, finish_reason or None); then None when the job is done
    arrived: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    detok: Any = None
    done: bool = False

    def emit(self, text: str, finish_reason: str | None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (text, finish_reason))


class StaticBatcher:
    """Owns the model; one worker thread runs one static batch at a time."""

    def __init__(self, model_dir: Path, max_batch_size: int, batch_wait_s: float, threads: int, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        from ..engine.owner_thread import start_owner_thread
        from ..models.gguf_checkpoint import hf_dense_dir
        from ..tokenizer import Tokenizer

        self.torch = torch
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.threads = threads
        self.waiting: queue.Queue[Job] = queue.Queue()
        self.batches = 0
        # The model loads in the thread that runs generate(), as `sluice serve`'s does (see engine/owner_thread.py),
        # so the peer is not slowed by stepping from another thread.
        def build() -> None:
            torch.set_num_threads(threads)
            dense = hf_dense_dir(model_dir)  # a directory converted from a GGUF has no safetensors of its own
            self._load(AutoModelForCausalLM.from_pretrained(str(dense), dtype=getattr(torch, dtype)).eval())

        start_owner_thread(build, self._loop, "hf-static-batcher")

    def _load(self, model) -> None:
        self.model = model
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        pad = self.model.generation_config.pad_token_id
        if pad is None:
            pad = self.model.config.eos_token_id
        self.pad_id = int(pad[0] if isinstance(pad, list) else pad)
        self.eos_ids = set(self.tokenizer.eos_token_ids)
        # EOS is handled per row by the step hook (ignore_eos rows must not stop): generate() never sees it.
        # NOTE: [] and not None: generate() fills a None from the model's defaults, and would stop rows at EOS.
        self.gen_config = copy.deepcopy(self.model.generation_config)
        self.gen_config.eos_token_id = []
        self.gen_config.pad_token_id = self.pad_id

    def submit(self, job: Job) -> None:
        if len(job.prompt_ids) + job.max_tokens > self.max_len:
            raise ValueError(f"prompt ({len(job.prompt_ids)} tokens) + max_tokens ({job.max_tokens}) exceeds the "
                             f"model's {self.max_len}")
        from ..tokenizer import IncrementalDetokenizer

        job.detok = IncrementalDetokenizer(self.tokenizer, job.prompt_ids)
        self.waiting.put(job)

    def _collect(self) -> list[Job]:
        batch = [self.waiting.get()]
        deadline = batch[0].arrived + self.batch_wait_s
        while len(batch) < self.max_batch_size:
            try:
                batch.append(self.waiting.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return batch

    def _loop(self) -> None:
        self.torch.set_num_threads(self.threads)  # per thread in torch
        while True:
            batch = self._collect()
            try:
                self._run(batch)
            except Exception as e:  # a failed batch fails its requests, not the server
                log.exception("batch failed")
                for job in batch:
                    if not job.done:
                        job.done = True
                        job.emit(f"generation failed: {e}", "error")
            for job in batch:
                job.loop.call_soon_threadsafe(job.events.put_nowait, None)

    def _run(self, batch: list[Job]) -> None:
        from transformers import StoppingCriteria, StoppingCriteriaList

        torch = self.torch
        width = max(len(j.prompt_ids) for j in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, j in enumerate(batch):  # left padding: every row's next token is at the same position
            ids[row, width - len(j.prompt_ids):] = torch.tensor(j.prompt_ids)
            mask[row, width - len(j.prompt_ids):] = 1
        steps = max(j.max_tokens for j in batch)
        batcher = self

        class StepHook(StoppingCriteria):
            """Called after every step with the new tokens in the last column: stream them, say which rows
            are done (generate stops when all are)."""

            def __call__(self, input_ids, scores, **kwargs):
                new = input_ids[:, -1].tolist()
                for job, tok in zip(batch, new, strict=True):
                    if not job.done:
                        batcher._step(job, tok)
                return torch.tensor([j.done for j in batch], dtype=torch.bool)

        first = batch[0]
        config = copy.deepcopy(self.gen_config)
        config.max_new_tokens = steps
        config.do_sample = first.temperature > 0
        config.temperature = first.temperature if config.do_sample else None
        config.top_p = first.top_p if config.do_sample else None
        config.top_k = None
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                stopping_criteria=StoppingCriteriaList([StepHook()]))
        self.batches += 1
        useful = sum(len(j.output_ids) for j in batch)
        log.info("batch %d: %d requests, prompt width %d, %d steps, %.2fs; %d of %d computed tokens requested",
                 self.batches, len(batch), width, max(len(j.output_ids) for j in batch), time.perf_counter() - t0,
                 useful, len(batch) * max(len(j.output_ids) for j in batch))

    def _step(self, job: Job, tok: int) -> None:
        job.output_ids.append(tok)
        if not job.ignore_eos and tok in self.eos_ids:
            job.done = True
            job.emit(job.detok.flush(), "stop")
            return
        text = job.detok.step([tok])
        if len(job.output_ids) >= job.max_tokens:
            job.done = True
            job.emit(text + job.detok.flush(), "length")
        else:
            job.emit(text, None)


# -- HTTP ----------------------------------------------------------------------------------------
def _error(status: int, message: str):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=status)


def build_app(batcher: StaticBatcher, served_name: str):
    from aiohttp import web

    async def models(_request):
        return web.json_response({"object": "list", "data": [{"id": served_name, "object": "model",
                                                              "owned_by": "hf-static"}]})

    async def health(_request):
        return web.json_response({"status": "ok", "batches": batcher.batches})

    async def completions(request):
        return await _generate(request, chat=False)

    async def chat(request):
        return await _generate(request, chat=True)

    async def _generate(request, chat: bool):
        try:
            body = await request.json()
            if chat:
                prompt_ids = batcher.tokenizer.encode_chat(body["messages"])
            else:
                prompt = body["prompt"]
                if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                    prompt_ids = list(prompt)
                elif isinstance(prompt, str):
                    prompt_ids = batcher.tokenizer.encode(prompt)
                else:
                    raise ValueError("prompt must be one string or one list of token ids")
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
            temperature = 1.0 if body.get("temperature") is None else float(body["temperature"])
            job = Job(prompt_ids, max_tokens, bool(body.get("ignore_eos", False)), temperature,
                      float(body.get("top_p") or 1.0), asyncio.get_running_loop(), asyncio.Queue())
            if max_tokens < 1 or not prompt_ids:
                raise ValueError("need a non-empty prompt and max_tokens >= 1")
            batcher.submit(job)
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
            return _error(400, f"bad request: {e}")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def usage() -> dict:
            n = len(job.output_ids)
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}

        if not body.get("stream"):
            parts, reason = [], None
            while (ev := await job.events.get()) is not None:
                parts.append(ev[0])
                reason = ev[1] or reason
            if reason == "error":
                return _error(500, "".join(parts))
            text = "".join(parts)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
                      if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": reason})
            return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                      "created": created, "model": served_name, "choices": [choice],
                                      "usage": usage()})

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(payload: dict) -> None:
            await resp.write(f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode())

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        first = True
        try:
            while (ev := await job.events.get()) is not None:
                text, reason = ev
                if reason == "error":
                    await send({"error": {"message": text, "type": "internal_error"}})
                    break
                if chat:
                    delta = {"role": "assistant", "content": text} if first else {"content": text}
                    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
                first = False
                await send({"id": rid, "object": obj, "created": created, "model": served_name,
                            "choices": [choice]})
            if include_usage:
                await send({"id": rid, "object": obj, "created": created, "model": served_name, "choices": [],
                            "usage": usage()})
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # the client left; its row runs on with the batch
            pass
        return resp

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.add_routes([web.get("/v1/models", models), web.get("/health", health), web.get("/ready", health),
                    web.post("/v1/completions", completions), web.post("/v1/chat/completions", chat)])
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sluice_engine.bench.hf_server",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model dir or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--served-model-name", default=None, help="default: the model directory's name")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--max-batch-size", type=int, default=32, help="most requests in one static batch")
    ap.add_argument("--batch-wait-ms", type=float, default=50.0,
                    help="a batch starts this long after its oldest request arrived, if not full before")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from aiohttp import web

    from ..model_fetch import resolve_model

    model_dir = resolve_model(args.model)
    t0 = time.perf_counter()
    batcher = StaticBatcher(model_dir, args.max_batch_size, args.batch_wait_ms / 1e3, args.threads, args.dtype)
    name = args.served_model_name or model_dir.name
    log.info("HF static batching (max batch %d, window %g ms, %d threads, %s) of %s loaded in %.1fs; serving %r "
             "on http://%s:%d/v1", args.max_batch_size, args.batch_wait_ms, args.threads, args.dtype, model_dir,
             time.perf_counter() - t0, name, args.host, args.port)
    web.run_app(build_app(batcher, name), host=args.host, port=args.port, print=None, access_log=None)
    # The batcher thread may be inside generate(): leave without unwinding it (torch would abort).
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
