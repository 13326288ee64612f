"""The HTTP server: FastAPI routes over OpenAIServing, health/readiness, Prometheus metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ...engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError, ServerShuttingDownError
from ...kv_transfer.keys import KVKey, load_key
from ...kv_transfer.prefill_hop import PrefillHop
from ...lora.paths import LoRAPathRefused, resolve_under_root
from ...metrics import PrometheusExporter
from .client_watch import ClientWatch
from .errors import (
    APIError,
    BearerKey,
    BodySizeLimit,
    api_error_handler,
    bad_request,
    validation_error_handler,
)
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from .serving import OpenAIServing
from .tracing import EngineTracer, RequestTrace

if TYPE_CHECKING:
    from ...engine.llm_engine import LLMEngine

log = logging.getLogger("sluice.api")


def prefill_hop(cfg, served_model_name: str, kv_key: KVKey | None, api_key: str | None) -> PrefillHop | None:
    """A decode engine's first hop to the prefill engines (--prefill-url), or None. It proves itself with the
    endpoint's KV key and sends the API key the prefill engines share with this one (both pools run one spec)."""
    if getattr(cfg, "prefill_url", None) is None:
        return None
    assert kv_key is not None  # EngineConfig refuses --prefill-url without --kv-secret-file
    host = f"[{cfg.kv_host}]" if ":" in cfg.kv_host else cfg.kv_host
    return PrefillHop(cfg.prefill_url, f"{host}:{cfg.kv_port}", served_model_name, kv_key, api_key=api_key,
                      block_size=cfg.block_size, min_prompt_tokens=cfg.prefill_min_prompt_tokens,
                      timeout=cfg.prefill_timeout)


def check_lora_update_flags(allow_runtime_lora_updates: bool, lora_root: str | None, api_key: str | None,
                            admin_api_key: str | None) -> None:
    """The run-time adapter routes read the server's disk: ValueError (naming the flag) unless they are held to a
    directory and, where the API has a key, to a key of their own."""
    if admin_api_key and api_key and admin_api_key == api_key:
        raise ValueError("--admin-api-key must differ from --api-key: with the same key, every client could load "
                         "adapters")
    if not allow_runtime_lora_updates:
        return
    if not lora_root:
        raise ValueError("--allow-runtime-lora-updates needs --lora-root DIR: the directory adapters may be loaded "
                         "from at run time (any path the server can read otherwise)")
    if api_key and not admin_api_key:
        raise ValueError("--allow-runtime-lora-updates with --api-key needs --admin-api-key (or "
                         "$SLUICE_ADMIN_API_KEY): loading an adapter takes a key of its own, not the inference key")


def build_app(engine: LLMEngine | AsyncEngine, *, api_key: str | None = None, admin_api_key: str | None = None,
              allow_runtime_lora_updates: bool = False) -> FastAPI:
    """The OpenAI server over an engine: an AsyncEngine.spawn(...) one runs it in its own process (what
    `sluice serve` does), an AsyncEngine.build(...) one in the thread that loaded it, a plain LLMEngine in a
    thread of its own. api_key: every /v1 route and the schema pages (/docs, /redoc, /openapi.json) need it as a
    bearer token (as vLLM's --api-key); the probes and /metrics stay open. allow_runtime_lora_updates: the
    /v1/load_lora_adapter and /v1/unload_lora_adapter routes load and unload adapters (404 otherwise), loads only
    from under the engine's --lora-root; admin_api_key: the key those two routes need instead of api_key."""
    async_engine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
    engine = async_engine.engine  # None when the engine runs in its own process
    info = async_engine.model_info
    cfg = async_engine.cfg
    check_lora_update_flags(allow_runtime_lora_updates, cfg.lora_root, api_key, admin_api_key)
    kv_key = load_key(getattr(cfg, "kv_secret_file", None))  # the endpoint's KV key (kv_transfer/keys.py)
    hop = prefill_hop(cfg, info.served_model_name, kv_key, api_key)
    serving = OpenAIServing(async_engine, info.served_model_name, cfg.max_queue_len, prefill_hop=hop, kv_key=kv_key)
    # Renders the engine's snapshots (docs/metrics.md), and this process's prefill hops.
    metrics = PrometheusExporter(engine, async_engine, prefill_hops=hop.counts if hop is not None else None)
    tracer = EngineTracer.from_config(cfg, info.served_model_name)  # None unless --otlp-traces-endpoint
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            if hop is not None:
                await hop.close()
            async_engine.shutdown()
            if tracer is not None:
                tracer.shutdown()

    app = FastAPI(title="Sluice engine", lifespan=lifespan)
    app.state.engine = engine
    app.state.async_engine = async_engine
    app.add_middleware(BodySizeLimit)  # 413 before a huge body is read
    if api_key or admin_api_key:
        app.add_middleware(BearerKey, key=api_key, admin_key=admin_api_key)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's own errors (a body that is not UTF-8 or JSON at all, 404, 405) in OpenAI's shape.
        code = {400: "invalid_request_error", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return APIError(500, str(exc), code="engine_dead").response()

    @app.exception_handler(ServerShuttingDownError)
    async def _shutting_down(_: Request, exc: ServerShuttingDownError) -> JSONResponse:
        return APIError(503, str(exc), code="shutting_down", headers={"Retry-After": "1"}).response()

    def refuse_while_draining() -> None:
        if async_engine.draining:  # another replica takes it: the client (or the gateway) retries
            raise ServerShuttingDownError("server is shutting down; retry on another replica")

    @app.exception_handler(RequestFailedError)
    async def _request_failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        return APIError(500, str(exc), code="request_failed").response()

    async def respond(request: Request, serve, trace: RequestTrace | None = None):
        # The client's connection is watched from here until the response is complete: a client
        # that leaves aborts its engine requests at once (client_watch.py). A traced request's span ends with it.
        watch = ClientWatch(request.receive)
        try:
            result = await serve(watch)
        except BaseException as e:
            watch.close()
            if trace is not None:
                trace.end(e)
            raise
        if isinstance(result, dict):
            watch.close()
            if trace is not None:
                trace.end()
            return JSONResponse(result)

        async def events():
            error = None
            try:
                async for event in result:
                    yield event
            except BaseException as e:
                error = e
                raise
            finally:
                watch.close()
                if trace is not None:
                    trace.end(error)
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        refuse_while_draining()
        trace = tracer.start(request.headers, "text_completion", body) if tracer is not None else None
        return await respond(request, lambda watch: serving.completions(body, watch, trace), trace)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        refuse_while_draining()
        trace = tracer.start(request.headers, "chat", body) if tracer is not None else None
        return await respond(request, lambda watch: serving.chat(body, watch, trace), trace)

    @app.get("/v1/models")
    async def models():
        # NOTE: vLLM's root is the --model as given: for a hub id (`--model org/name`, what most vLLM users pass)
        # that is the name the client also sees as the id. Our --model is always a path on the server's disk
        # (the operator fetches hub models into its cache), which is the server's business, not a client's: the
        # root is the served name, as a vLLM user of a hub id sees it. An adapter's root is its own name (vLLM's
        # is its path).
        base = {"id": info.served_model_name, "object": "model", "created": started, "owned_by": "sluice",
                "root": info.served_model_name, "parent": None, "max_model_len": info.max_model_len}
        # Each LoRA adapter is a model of its own, its parent the base (as vLLM lists them); the set changes as
        # adapters are loaded and unloaded.
        adapters = [{**base, "id": name, "root": name, "parent": info.served_model_name}
                    for name in async_engine.model_info.lora_names]
        return {"object": "list", "data": [base, *adapters]}

    def check_lora_updates(field: str) -> None:
        if not allow_runtime_lora_updates:
            raise APIError(404, "loading and unloading LoRA adapters at run time is off: start the server with "
                           "--allow-runtime-lora-updates (and --enable-lora)", param=field, code="not_found")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        check_lora_updates("lora_name")
        try:
            # Refused before anything reads the path, one message whether it exists or not (lora/paths.py).
            path = resolve_under_root(body.lora_path, cfg.lora_root)
        except LoRAPathRefused as e:
            raise bad_request(str(e), param="lora_path", code="invalid_lora_adapter") from None
        try:
            message = await async_engine.load_lora(body.lora_name, path)
        except ValueError as e:  # the core's reason: LoRA off, the name taken, a bad adapter
            raise bad_request(str(e), param=getattr(e, "param", None) or None, code="invalid_lora_adapter") from None
        return Response(f"Success: {message}.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        check_lora_updates("lora_name")
        try:
            message = await async_engine.unload_lora(body.lora_name)
        except LookupError as e:
            raise APIError(404, str(e.args[0]), param="lora_name", code="lora_adapter_not_found") from None
        return Response(f"Success: {message}.", media_type="text/plain")

    # The probes are open to anyone who reaches the port: their bodies say a status word and a fixed reason, never
    # an exception's text (paths, addresses, library internals). The detail is in the log: once per process here,
    # and on_dead (serve_cli.py) logs it when the engine dies.
    logged_dead = False

    def dead() -> bool:
        nonlocal logged_dead
        if async_engine.dead is None:
            return False
        if not logged_dead:
            logged_dead = True
            log.error("the engine is dead: %r", async_engine.dead)
        return True

    @app.get("/health")
    async def health():
        if dead():
            return JSONResponse({"status": "dead", "error": "engine dead"}, status_code=503)
        if async_engine.hung_for() is not None:
            return JSONResponse({"status": "hung", "error": "step hung"}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        # The model is loaded before the app exists; ready means warmed up and the engine loop alive too.
        if dead():
            return JSONResponse({"status": "not ready", "error": "engine dead"}, status_code=503)
        if async_engine.hung_for() is not None:
            return JSONResponse({"status": "not ready", "error": "step hung"}, status_code=503)
        if async_engine.draining:
            return JSONResponse({"status": "not ready", "error": "shutting down"}, status_code=503)
        if async_engine.warming_up:  # compiling and running the kernels' shapes once (--warmup)
            return JSONResponse({"status": "not ready", "error": "warming up"}, status_code=503)
        return {"status": "ready", "model": info.served_model_name}

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app
