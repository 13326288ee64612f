"""OpenAI completions and chat completions over the async engine: request -> prompts and sampling
params -> engine streams -> response bodies or SSE chunks."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ...engine.async_engine import AsyncEngine, ServerShuttingDownError
from ...engine.model_info import RequestRejected
from ...engine.output import RequestOutput
from ...kv_transfer.keys import KVKey
from ...kv_transfer.prefill_hop import PrefillHop
from ...sample.token_logprobs import TokenLogprobs
from ...sampling_params import MAX_TOP_K, InvalidParam, SamplingParams, check_priority
from ...structured import (
    CompiledGrammar,
    GrammarError,
    StructuredOutputs,
    ToolCallParser,
    ToolPlan,
    grammar_spec,
    plan_tools,
    render_messages,
    template_renders_tools,
)
from .client_watch import ClientWatch, NoWatch, client_left_error
from .errors import APIError, bad_request
from .protocol import ChatCompletionRequest, CompletionRequest, invalid_text
from .tracing import RequestTrace

# chat_template_kwargs may not name what the request's own fields set (or the renderer's arguments).
RESERVED_TEMPLATE_KWARGS = frozenset({"self", "messages", "tools", "add_generation_prompt"})


@dataclass(slots=True)
class _Choice:
    """Accumulated state of one choice (one engine request)."""

    index: int
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_model_name: str, max_queue_len: int,
                 prefill_hop: PrefillHop | None = None, kv_key: KVKey | None = None):
        self.engine = engine
        self.prefill_hop = prefill_hop  # a decode engine's first hop (--prefill-url), else None
        self.kv_key = kv_key  # the endpoint's KV key (--kv-secret-file): checks kv_transfer_params.hop_token
        self.model_name = served_model_name
        self.tokenizer = engine.tokenizer
        self.max_queue_len = max_queue_len
        info = engine.model_info
        self.structured = StructuredOutputs(self.tokenizer, info.vocab_size, info.eos_token_ids)
        self.template_renders_tools = template_renders_tools(self.tokenizer.chat_template)

    # -- shared checks -------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter the request's `model` names (None: the base model); an unknown model is a 404."""
        if model is None or model == self.model_name:
            return None
        if model in self.engine.model_info.lora_names:
            return model
        served = ", ".join(repr(m) for m in (self.model_name, *self.engine.model_info.lora_names))
        raise APIError(404, f"model '{model}' does not exist; this server serves {served}", param="model",
                       code="model_not_found")

    def check_fields(self, req) -> None:
        """The bounds that need the model or span fields (the rest are in protocol.py and
        SamplingParams): text a tokenizer can take, token ids in the vocabulary, best_of."""
        bad = invalid_text(req)
        if bad is not None:
            raise bad_request(bad[1], param=bad[0])
        vocab = self.engine.model_info.vocab_size
        out_of_vocab = next((t for t in req.stop_token_ids if not 0 <= t < vocab), None)
        if out_of_vocab is not None:
            raise bad_request(f"stop_token_ids holds {out_of_vocab}, outside the vocabulary (0..{vocab - 1})",
                              param="stop_token_ids")
        for key in req.logit_bias or {}:
            if not 0 <= _as_int(key, -1) < vocab:
                raise bad_request(f"logit_bias keys must be token ids in the vocabulary (0..{vocab - 1}), "
                                  f"got {key!r}", param="logit_bias")
        try:
            check_priority(req.priority, self.engine.cfg.scheduling_policy)
        except InvalidParam as e:
            raise bad_request(str(e), param=e.param) from None
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(f"best_of ({req.best_of}) must equal n ({req.n}): ranking extra candidates is not "
                              "supported", param="best_of")
        self.check_push_to(req)

    def check_push_to(self, req) -> None:
        """kv_transfer_params.push_to makes this engine connect to the address it names and send KV there: honoured
        only from the endpoint's own decode engines, whose hop proves it with the endpoint's key (a token over that
        address: kv_transfer/keys.py). Anyone else gets a 400 and no connection is made (docs/security.md)."""
        kvp = req.kv_transfer_params
        if kvp is None:
            return
        if self.kv_key is None:
            raise bad_request("kv_transfer_params.push_to is honoured only by the prefill engines of a disaggregated "
                              "endpoint (started with --kv-secret-file), for their own decode engines",
                              param="kv_transfer_params.push_to")
        if not self.kv_key.check_hop_token(kvp.push_to, kvp.hop_token):
            raise bad_request("kv_transfer_params.push_to is honoured only for the endpoint's own decode engines: "
                              "kv_transfer_params.hop_token is missing, expired or not this endpoint's",
                              param="kv_transfer_params.push_to")

    def check_capacity(self, n_requests: int) -> None:
        if n_requests > self.max_queue_len:
            raise bad_request(f"this request needs {n_requests} sequences (prompts x n) but at most "
                              f"{self.max_queue_len} may wait (--max-queue-len)", param="n")
        if self.engine.num_waiting + n_requests > self.max_queue_len:
            raise APIError(503, f"server overloaded: {self.engine.num_waiting} requests waiting "
                           f"(--max-queue-len {self.max_queue_len}); retry shortly",
                           code="queue_full", headers={"Retry-After": "1"})

    def sampling_params(self, req, max_tokens: int | None, num_prompt_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop):
            raise bad_request("stop strings must be non-empty", param="stop")
        vocab = self.engine.model_info.vocab_size
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else
                self.engine.default_max_tokens(num_prompt_tokens),
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                # top_k at or past the vocabulary keeps every token: the same as off.
                top_k=-1 if req.top_k in (None, 0) or (vocab <= req.top_k <= MAX_TOP_K) else req.top_k,
                min_p=req.min_p, seed=req.seed,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty, stop=stop, stop_token_ids=list(req.stop_token_ids),
                logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
                ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, n=req.n,
                skip_special_tokens=req.skip_special_tokens, speculative=req.speculative,
            )
        except InvalidParam as e:
            # Chat names the top-k count top_logprobs; completions calls it logprobs. Chat's limit may
            # have come as max_completion_tokens.
            param = e.param
            if param == "logprobs" and hasattr(req, "top_logprobs"):
                param = "top_logprobs"
            elif param == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
                param = "max_completion_tokens"
            raise bad_request(str(e).replace(e.param, param, 1), param=param) from None

    async def _constraints(self, req, plan: ToolPlan | None = None, watch: ClientWatch | None = None):
        """The request's grammar (response_format, guided_*, or its tools), compiled off the event
        loop and cached (each choice gets its own constraint from it), or None for free text. A
        malformed schema, regex or grammar is a 400 naming its field."""
        try:
            spec = grammar_spec(req)
            if plan is not None:
                if spec is not None:
                    raise GrammarError(f"{spec.param} cannot be combined with tools (unless tool_choice is "
                                       "'none')", param=spec.param)
                spec = plan.grammar()
            if spec is None:
                return None
            # A client that leaves while its grammar compiles stops waiting for it (a compile not yet
            # started is then dropped: StructuredOutputs counts its waiters).
            compiled = await (watch or NoWatch()).race(self.structured.compile(spec))
        except GrammarError as e:
            if e.status != 400:  # busy compiling others' grammars
                raise APIError(e.status, str(e), param=e.param, code="grammar_queue_full",
                               headers={"Retry-After": "1"}) from None
            raise bad_request(str(e), param=e.param) from None
        return CompiledGrammar(spec, compiled, self.structured)

    def _child_params(self, params: SamplingParams, i: int) -> SamplingParams:
        if i == 0 and params.seed is None:
            return params
        # n > 1: each choice its own request; a seed is offset per choice so they differ yet repeat.
        return dataclasses.replace(params, seed=None if params.seed is None else params.seed + i)

    async def _run_choices(self, prompts: list[list[int]], params_list: list[SamplingParams], n: int,
                           base_id: str, grammar: CompiledGrammar | None = None,
                           watch: ClientWatch | None = None, lora: str | None = None,
                           kv_push_to: str | None = None, priority: int = 0,
                           trace: RequestTrace | None = None) -> AsyncIterator[tuple[_Choice, RequestOutput]]:
        """Runs len(prompts) * n engine requests concurrently; yields (choice, delta) as they come.
        grammar: the request's grammar, or None (each choice gets its own grammar state). trace: the request's
        span when it is traced (tracing.py), which sees every choice's deltas.
        If the client leaves (watch), every unfinished choice is aborted in the engine at once and
        the iteration raises the 499 APIError."""
        watch = watch or NoWatch()
        choices = [_Choice(p_idx * n + i, ids) for p_idx, ids in enumerate(prompts) for i in range(n)]
        params = [self._child_params(params_list[ch.index // n], ch.index % n) for ch in choices]
        for ch, p in zip(choices, params, strict=True):
            try:
                self.engine.check_prompt(ch.prompt_ids, p)
            except RequestRejected as e:
                raise bad_request(str(e), param=e.param, code=e.code) from None
        arrived = None  # the engine's clock starts at submission, or before the hop (TTFT includes it)
        if (self.prefill_hop is not None and lora is None and kv_push_to is None
                and all(p.prompt_logprobs is None for p in params)):
            arrived = time.monotonic()
            # The prompts' blocks computed by a prefill engine and pushed here first (prefill_hop.py). Not for a
            # request that is itself some engine's prefill hop (kv_push_to), nor for LoRA (transfers carry the
            # base model's blocks only), nor for prompt logprobs (computed here in full, never from the cache).
            await watch.race(self.prefill_hop.run(prompts))
        # NOTE: from the queue check to the last submit nothing awaits, so concurrent requests cannot
        # all pass the check before any of them counts as waiting (a burst stays within the bound).
        self.check_capacity(len(choices))
        gens = [self.engine.add(f"{base_id}-{ch.index}", ch.prompt_ids, p, grammar=grammar, lora_name=lora,
                                kv_push_to=kv_push_to if ch.index % n == 0 else None,  # one push per prompt
                                arrival_time=arrived, priority=priority)
                for ch, p in zip(choices, params, strict=True)]
        if trace is not None:
            trace.set_request_id(base_id)
            gens = [trace.wrap(ch.index, n, g) for ch, g in zip(choices, gens, strict=True)]
        queue: asyncio.Queue = asyncio.Queue()

        def client_left(left_at: float) -> None:
            # Abort now, from the event loop, not when the consumer next runs: a waiting request must
            # not be scheduled in between. The time the client left lets the engine count it.
            for ch in choices:
                if ch.finish_reason is None:
                    self.engine.abort(f"{base_id}-{ch.index}", client_left_at=left_at)
            queue.put_nowait((None, client_left_error()))

        unwatch = watch.on_left(client_left)

        async def pump(ch: _Choice, gen: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in gen:
                    await queue.put((ch, out))
            except Exception as e:  # forwarded to the consumer, which raises it
                await queue.put((ch, e))
            finally:
                await queue.put((ch, None))

        tasks = [asyncio.create_task(pump(ch, g)) for ch, g in zip(choices, gens, strict=True)]
        try:
            remaining = len(tasks)
            while remaining:
                ch, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    if isinstance(item, ValueError):
                        raise bad_request(str(item), param=getattr(item, "param", None))
                    raise item
                _accumulate(ch, item)
                yield ch, item
        finally:
            unwatch()
            for t in tasks:
                t.cancel()
            # Cancelling a pump ends its engine stream, whose cleanup aborts the engine request; a pump
            # cancelled before it ever started never ran that cleanup: abort whatever did not finish.
            await asyncio.gather(*tasks, return_exceptions=True)
            for ch in choices:
                if ch.finish_reason is None:
                    self.engine.abort(f"{base_id}-{ch.index}")

    # -- completions ---------------------------------------------------------------------------
    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            prompts = [self.tokenizer.encode(p)]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [self.tokenizer.encode(x) for x in p]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]
        else:
            raise bad_request("prompt must be a non-empty string, list of strings, or list of token ids",
                              param="prompt")
        for ids in prompts:
            if not ids:
                raise bad_request("prompt is empty", param="prompt")
        return prompts

    async def completions(self, req: CompletionRequest, watch: ClientWatch | None = None,
                          trace: RequestTrace | None = None) -> dict | AsyncIterator[str]:
        """A completion: its response body, or (stream) its SSE events. watch: the client's connection; trace: its
        span when traced (the caller ends it)."""
        watch = watch or NoWatch()
        self.check_fields(req)
        lora = self.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        prompts = await _off_loop(self.completion_prompts, req)
        self.check_capacity(len(prompts) * req.n)
        plp = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            plp = max(req.logprobs, plp or 0)
        params = [self.sampling_params(req, req.max_tokens, len(ids), req.logprobs, plp) for ids in prompts]
        grammar = await self._constraints(req, watch=watch)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        choices_iter = self._run_choices(prompts, params, req.n, rid, grammar, watch, lora, _push_to(req),
                                         req.priority, trace)
        if req.stream:
            return await self._stream(rid, created, "text_completion", choices_iter, req, is_chat=False)
        choices = await _collect(choices_iter)
        return {
            "id": rid, "object": "text_completion", "created": created, "model": lora or self.model_name,
            "choices": [self._completion_choice(ch, req) for ch in choices],
            "usage": _usage(choices, req.n),
        }

    def _completion_choice(self, ch: _Choice, req: CompletionRequest) -> dict:
        text = ch.text
        logprobs = None
        if req.logprobs is not None:
            entries = list(ch.logprobs)
            tokens = list(ch.token_ids)
            first_none = False
            if req.echo:
                entries = (ch.prompt_logprobs or []) + entries
                tokens = ch.prompt_ids + tokens
                first_none = True
            logprobs = self._completion_logprobs(tokens, entries, first_none, 0, req.return_tokens_as_token_ids)
        if req.echo:
            text = self.tokenizer.decode(ch.prompt_ids, skip_special_tokens=False) + text
        choice = {"index": ch.index, "text": text, "logprobs": logprobs, "finish_reason": ch.finish_reason,
                  "stop_reason": ch.stop_reason}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(ch)
        return choice

    def _prompt_logprobs(self, ch: _Choice) -> list[dict | None]:
        """vLLM's shape: per prompt token, {token_id: {logprob, decoded_token}} for the token itself and
        the top-k; None for the first token, which nothing predicts."""
        out: list[dict | None] = [None]
        for tid, (lp, top) in zip(ch.prompt_ids[1:], ch.prompt_logprobs or [], strict=False):
            entry = {t: v for t, v in top}
            entry[tid] = lp
            out.append({str(t): {"logprob": v, "decoded_token": self.tokenizer.decode([t], skip_special_tokens=False)}
                        for t, v in entry.items()})
        return out

    def _token_str(self, token_id: int, as_id: bool) -> str:
        return f"token_id:{token_id}" if as_id else self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(self, token_ids: list[int], entries: list[TokenLogprobs], first_none: bool,
                             offset: int, as_ids: bool) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = offset
        for i, tid in enumerate(token_ids):
            tokens.append(self._token_str(tid, as_ids))
            offsets.append(pos)
            pos += len(self.tokenizer.decode([tid], skip_special_tokens=False))
            j = i - 1 if first_none else i
            if j < 0 or j >= len(entries):
                token_lps.append(None)
                tops.append(None)
                continue
            lp, top = entries[j]
            token_lps.append(lp)
            tops.append({self._token_str(t, as_ids): v for t, v in top} if top else {})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    # -- chat ----------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, watch: ClientWatch | None = None,
                   trace: RequestTrace | None = None) -> dict | AsyncIterator[str]:
        """A chat completion: its response body, or (stream) its SSE events. watch: the client's connection;
        trace: its span when traced (the caller ends it)."""
        watch = watch or NoWatch()
        self.check_fields(req)
        lora = self.check_model(req.model)
        clash = sorted(RESERVED_TEMPLATE_KWARGS & set(req.chat_template_kwargs or {}))
        if clash:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(map(repr, clash))}: the request's own "
                              "fields (messages, tools, add_generation_prompt) set those", param="chat_template_kwargs")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
        try:
            plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        except GrammarError as e:
            raise bad_request(str(e), param=e.param) from None
        native_tools = self.template_renders_tools
        def render() -> list[int]:
            messages = render_messages([m.model_dump(exclude_none=True) for m in req.messages], plan, native_tools)
            return self.tokenizer.encode_chat(messages, add_generation_prompt=req.add_generation_prompt,
                                              tools=plan.template_tools() if plan and native_tools else None,
                                              **(req.chat_template_kwargs or {}))

        try:
            prompt_ids = await _off_loop(render)
        except (ValueError, TypeError) as e:  # a template failing on odd content is the request's fault
            raise bad_request(str(e), param="messages") from None
        self.check_capacity(req.n)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        lp = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, len(prompt_ids), lp, None)
        grammar = await self._constraints(req, plan, watch=watch)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        choices_iter = self._run_choices([prompt_ids], [params], req.n, rid, grammar, watch, lora, _push_to(req),
                                         req.priority, trace)
        if req.stream:
            return await self._stream(rid, created, "chat.completion.chunk", choices_iter, req, is_chat=True,
                                      tools=plan is not None)
        choices = await _collect(choices_iter)
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": lora or self.model_name,
            "choices": [
                {"index": ch.index, **_chat_message(ch, plan is not None),
                 "logprobs": self._chat_logprobs(ch.token_ids, ch.logprobs, req.return_tokens_as_token_ids) if req.logprobs else None,
                 "stop_reason": ch.stop_reason}
                for ch in choices
            ],
            "usage": _usage(choices, req.n),
        }

    def _chat_logprobs(self, token_ids: list[int], entries: list[TokenLogprobs], as_ids: bool) -> dict:
        def item(tid: int, lp: float) -> dict:
            s = self._token_str(tid, as_ids)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        content = []
        for tid, (lp, top) in zip(token_ids, entries, strict=False):
            content.append({**item(tid, lp), "top_logprobs": [item(t, v) for t, v in top]})
        return {"content": content}

    # -- streaming -----------------------------------------------------------------------------
    async def _stream(self, rid: str, created: int, obj: str, choices_iter, req, is_chat: bool,
                      tools: bool = False) -> AsyncIterator[str]:
        # Errors found before the first engine output (e.g. a prompt too long) must still be a
        # plain HTTP 400, so take the first delta before the response starts. A client that leaves
        # meanwhile ends the iteration with a 499 (its requests already aborted).
        try:
            first = await anext(choices_iter, None)
        except BaseException:
            await choices_iter.aclose()
            raise

        async def events() -> AsyncIterator[str]:
            seen: set[int] = set()
            all_choices: dict[int, _Choice] = {}
            parsers: dict[int, ToolCallParser] = {}  # per choice, when tools may be called
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def chunk(choices: list[dict], usage: dict | None = None) -> str:
                body = {"id": rid, "object": obj, "created": created, "model": req.model or self.model_name,
                        "choices": choices}
                if include_usage:
                    body["usage"] = usage
                return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

            async def gen():
                if first is not None:
                    yield first
                async for x in choices_iter:
                    yield x

            try:
                async for ch, out in gen():
                    all_choices[ch.index] = ch
                    if is_chat:
                        delta: dict = {}
                        if ch.index not in seen:
                            delta["role"] = "assistant"
                            seen.add(ch.index)
                        finish_reason = out.finish_reason
                        if tools:
                            parser = parsers.setdefault(ch.index, ToolCallParser())
                            content, calls = parser.feed(out.new_text)
                            if out.finished:
                                more_content, more_calls = parser.finish()
                                content, calls = content + more_content, calls + more_calls
                                finish_reason = _tool_finish_reason(out.finish_reason, parser)
                            if content:
                                delta["content"] = content
                            if calls:
                                delta["tool_calls"] = calls
                            if not delta and not out.finished and not req.logprobs:
                                continue  # text held back (maybe the start of a call): nothing to send yet
                        elif out.new_text or not out.finished:
                            delta["content"] = out.new_text
                        c = {"index": ch.index, "delta": delta,
                             "logprobs": self._chat_logprobs(out.new_token_ids, out.logprobs,
                                                            req.return_tokens_as_token_ids) if req.logprobs else None,
                             "finish_reason": finish_reason}
                    else:
                        text = out.new_text
                        if req.echo and ch.index not in seen:
                            text = self.tokenizer.decode(ch.prompt_ids, skip_special_tokens=False) + text
                        seen.add(ch.index)
                        lp = None
                        if req.logprobs is not None:
                            lp = self._completion_logprobs(out.new_token_ids, out.logprobs, False,
                                                           len(ch.text) - len(out.new_text),
                                                           req.return_tokens_as_token_ids)
                        c = {"index": ch.index, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}
                    if out.finished:
                        c["stop_reason"] = out.stop_reason
                    yield chunk([c])
                if include_usage:
                    yield chunk([], _usage(list(all_choices.values()), req.n))
                yield "data: [DONE]\n\n"
            except APIError as e:
                yield e.sse()
            except ServerShuttingDownError as e:  # the drain timed out: say so, and end the stream properly
                yield APIError(503, str(e), code="shutting_down").sse()
                yield "data: [DONE]\n\n"
            except Exception as e:  # e.g. the engine loop died mid-stream: tell the client, do not just hang up
                yield APIError(500, f"generation failed: {e}", code="internal_error").sse()
            finally:
                await choices_iter.aclose()

        return events()


def _as_int(text: str, default: int) -> int:
    try:
        return int(text)
    except ValueError:
        return default


def _chat_message(ch: _Choice, tools: bool) -> dict:
    """A finished chat choice's message and finish_reason; with tools, the calls parsed out."""
    if not tools:
        return {"message": {"role": "assistant", "content": ch.text}, "finish_reason": ch.finish_reason}
    parser = ToolCallParser()
    parser.feed(ch.text)
    parser.finish()
    message: dict = {"role": "assistant", "content": parser.content if parser.content.strip() or not parser.calls
                     else None}
    if parser.calls:
        message["tool_calls"] = [call.openai() for call in parser.calls]
    return {"message": message, "finish_reason": _tool_finish_reason(ch.finish_reason, parser)}


def _tool_finish_reason(reason: str | None, parser: ToolCallParser) -> str | None:
    # OpenAI: a reply that ends in tool calls finishes with "tool_calls"; a cut-off one stays "length".
    return "tool_calls" if reason == "stop" and parser.calls else reason


def _accumulate(ch: _Choice, out: RequestOutput) -> None:
    ch.text += out.new_text
    ch.token_ids.extend(out.new_token_ids)
    ch.logprobs.extend(out.logprobs)
    if out.prompt_logprobs is not None:
        ch.prompt_logprobs = out.prompt_logprobs
    ch.num_cached_tokens = out.num_cached_tokens
    if out.finished:
        ch.finish_reason, ch.stop_reason = out.finish_reason, out.stop_reason


async def _off_loop(fn, *args):
    """Tokenizing or templating a large input takes milliseconds to seconds: in a worker thread, so
    the event loop keeps streaming everyone else's tokens meanwhile."""
    return await asyncio.to_thread(fn, *args)


async def _collect(choices_iter) -> list[_Choice]:
    """Drains a non-streaming request (a 499 APIError if its client leaves meanwhile)."""
    seen: dict[int, _Choice] = {}
    try:
        async for ch, _ in choices_iter:
            seen[ch.index] = ch
    finally:
        await choices_iter.aclose()
    return [seen[i] for i in sorted(seen)]


def _usage(choices: list[_Choice], n: int) -> dict:
    # The prompt is counted once per distinct prompt, not per choice (OpenAI's convention for n > 1).
    prompt = sum(len(ch.prompt_ids) for ch in choices if ch.index % n == 0)
    cached = sum(ch.num_cached_tokens for ch in choices if ch.index % n == 0)
    completion = sum(len(ch.token_ids) for ch in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _push_to(req) -> str | None:
    """Where the request's prompt blocks go when it finishes (kv_transfer_params.push_to), or None."""
    return req.kv_transfer_params.push_to if req.kv_transfer_params is not None else None
