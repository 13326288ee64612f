"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import hmac
import json
import os

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

# Largest request body accepted (413 beyond): 8 MiB holds a 128k-token prompt several times over,
# as text or as token ids. SLUICE_MAX_BODY_BYTES overrides it.
MAX_BODY_BYTES = int(os.environ.get("SLUICE_MAX_BODY_BYTES", 8 * 2**20))


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    @property
    def type(self) -> str:
        return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable"}.get(self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": _printable(self.message), "type": self.type, "param": _printable(self.param),
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        return f"data: {json.dumps(self.body())}\n\n"


def _printable(text: str | None) -> str | None:
    """Text that encodes as UTF-8: a lone surrogate from the request (a field name, a model name)
    is written as its escape instead of failing the response."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


async def api_error_handler(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def validation_error_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('msg', '')}", code="invalid_json").response()
    if tuple(first.get("loc", ())) == ("body",):  # no body, or not a JSON object
        what = "missing" if first.get("type") == "missing" else "not a JSON object"
        return bad_request(f"request body is {what}; send a JSON object with Content-Type: application/json",
                           code="invalid_value").response()
    loc = _field_path(first)
    # A union reports each member's failure: prefer one that is not just "wrong type" (a list too
    # long says more than "Input should be a valid string").
    first = next((e for e in errors if not e.get("type", "").endswith("_type") and _field_path(e) == loc), first)
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "missing":
        msg = f"missing required field '{param}'"
    elif param:
        msg = f"invalid value for '{param}': {msg}"
    return bad_request(msg, param=param, code="invalid_value").response()


def _field_path(error: dict) -> list[str]:
    # Drop the body prefix and the type tags pydantic adds inside unions ('str', 'list[int]', ...).
    return [str(p) for p in error.get("loc", ()) if p != "body" and not _is_type_tag(p)]


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "literal"}


def _is_type_tag(part) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)


class BodySizeLimit:
    """ASGI middleware: a request body over max_bytes gets 413 in OpenAI's error shape. A declared
    Content-Length over the limit is refused before any of the body is read; a chunked body is read
    up to the limit, then either refused or handed on whole."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None:  # the server delivers no more than declared
            if length.isdigit() and int(length) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        if b"chunked" not in headers.get(b"transfer-encoding", b""):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        last = None
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app sees it next
                last = message
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        first = last or {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send) -> None:
        err = APIError(413, f"request body is larger than {self.max_bytes} bytes", code="request_too_large",
                       headers={"Connection": "close"})
        await err.response()(scope, receive, send)


# Routes that change what the server serves (and read its disk): with --admin-api-key they need that key, and
# the inference key is not enough.
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# The API's own description: it maps every route, so it is held to the key like the routes are.
SCHEMA_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


class BearerKey:
    """ASGI middleware: with --api-key, every /v1 route and the schema pages (/docs, /redoc, /openapi.json) need
    `Authorization: Bearer <key>` (401 in OpenAI's shape otherwise), as vLLM's server does; with --admin-api-key,
    the adapter routes (ADMIN_PATHS) need that key instead. /health, /ready and /metrics stay open for probes and
    scrapes. Keys are compared in constant time."""

    def __init__(self, app, key: str | None, admin_key: str | None = None):
        self.app = app
        self.key = key.encode() if key else None
        self.admin_key = admin_key.encode() if admin_key else None

    def _required(self, path: str) -> tuple[bytes | None, str]:
        """The key `path` needs (None: open), and what to call it in a refusal."""
        if path.rstrip("/") in ADMIN_PATHS and self.admin_key is not None:
            return self.admin_key, "admin API key (--admin-api-key)"
        if path.startswith("/v1") or path in SCHEMA_PATHS:
            return self.key, "API key"
        return None, ""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key, what = self._required(scope.get("path", ""))
        if key is None:
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key):
            await self.app(scope, receive, send)
            return
        err = APIError(401, f"an {what} is required: send it as 'Authorization: Bearer <key>'" if not given
                       else f"invalid {what}", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await err.response()(scope, receive, send)
