"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    @property
    def type(self) -> str:
        return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                429: "rate_limit_error", 503: "service_unavailable"}.get(self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


async def api_error_handler(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def validation_error_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('msg', '')}", code="invalid_json").response()
    # Drop the body prefix and the type tags pydantic adds inside unions ('str', 'list[int]', ...).
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_tag(p)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "missing":
        msg = f"missing required field '{param}'"
    elif param:
        msg = f"invalid value for '{param}': {msg}"
    return bad_request(msg, param=param, code="invalid_value").response()


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "literal"}


def _is_type_tag(part) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)
