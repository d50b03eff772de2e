"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, whatever raised them.

Malformed JSON and fields that fail validation are 400 (as vLLM answers them, not FastAPI's 422); poot's own
request errors (a bad sampler value, a template that refuses the messages, a prompt that can never fit) are
400 too; anything unexpected is a 500 in the same shape, so a client always gets an object it can read.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from poot_core.errors import PootError

log = logging.getLogger("poot.server")

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An HTTP error the server answers on purpose."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.type = type_ or TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def from_poot(exc: PootError) -> APIError:
    """poot's typed errors raised while reading a request are the caller's to fix: 400."""
    return APIError(400, str(exc), code=type(exc).__name__)


def _validation(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "the request body is not valid")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg', '')}", code="json_invalid")
    where = ".".join(loc)
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    message = f"{where}: {first.get('msg', 'invalid')}{more}" if where else f"{first.get('msg', 'invalid')}{more}"
    return APIError(400, message, param=where or None, code=str(first.get("type")) or None)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        return APIError(exc.status_code, str(exc.detail), headers=headers).response()

    @app.exception_handler(PootError)
    async def _poot(_: Request, exc: PootError) -> JSONResponse:
        return from_poot(exc).response()

    @app.exception_handler(UnicodeError)
    async def _unicode(_: Request, exc: UnicodeError) -> JSONResponse:  # e.g. a lone surrogate in a string
        return APIError(400, f"a text is not valid Unicode: {exc}", code="invalid_text").response()

    @app.exception_handler(RecursionError)
    async def _deep(_: Request, exc: RecursionError) -> JSONResponse:
        return APIError(400, "the request nests too deeply", code="too_deep").response()

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()
