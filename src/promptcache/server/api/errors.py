"""Error bodies in the caller's dialect and the app's exception handlers: Anthropic's shape
under ``/v1/messages``, OpenAI's elsewhere; client mistakes (bad JSON, validation,
``ValueError``) are 4xx, only server faults 5xx."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...errors import ContextLengthError, EngineDeadError, OverloadedError

log = logging.getLogger(__name__)

# HTTP status -> Anthropic error type
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "api_error",
    529: "overloaded_error",
}
# HTTP status -> OpenAI error type
_OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    """An error with an HTTP status, rendered in the dialect of the endpoint."""

    def __init__(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers


class BodyTooLarge(StarletteHTTPException):
    """The body passed ``--max-body-bytes`` (an HTTPException: body parsing passes it on)."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message)


async def json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what it is instead."""
    if not _is_json_content_type(request):
        # a cross-site "simple" request (text/plain, form) never reaches a handler
        raise APIError(415, "Content-Type must be application/json",
                       code="unsupported_media_type")
    try:
        body = await request.json()
    except RecursionError as e:
        raise APIError(400, "the body is nested too deeply") from e
    except ValueError as e:
        raise APIError(400, f"the body must be a JSON object: {e}") from e
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, status: int, message: str, code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    if is_anthropic_path(path):
        etype = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": etype, "message": message}}
    etype = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def error_response(request: Request, status: int, message: str, code: str | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse(
        error_body(request.url.path, status, message, code, param), status_code=status,
        headers=headers,
    )


def overloaded_response(request: Request, exc: OverloadedError) -> JSONResponse:
    """At capacity: OpenAI 429, Anthropic 529, both with ``Retry-After`` (whole seconds)."""
    status = 529 if is_anthropic_path(request.url.path) else 429
    retry = str(max(1, int(round(exc.retry_after_s))))
    return error_response(request, status, str(exc), "overloaded", None,
                          {"Retry-After": retry})


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    parts = []
    param = None
    for err in exc.errors()[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if param is None and where:
            param = where
        if err.get("type") == "json_invalid":
            return "request body is not valid JSON", None
        parts.append(f"{where or 'body'}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts), param


def _is_json_content_type(request: Request) -> bool:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return ctype == "" or ctype == "application/json" or ctype.endswith("+json")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request, exc.status, exc.message, exc.code, exc.param,
                              exc.headers)

    @app.exception_handler(OverloadedError)
    async def _overloaded(request: Request, exc: OverloadedError) -> JSONResponse:
        return overloaded_response(request, exc)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        log.error("request refused: %s", exc)
        return error_response(request, 503, f"the engine is not running: {exc}", "engine_dead")

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if request.method in ("POST", "PUT") and not _is_json_content_type(request):
            return error_response(request, 415, "Content-Type must be application/json",
                                  "unsupported_media_type")
        message, param = _describe_validation(exc)
        return error_response(request, 400, message, "invalid_request", param)

    @app.exception_handler(ContextLengthError)
    async def _context(request: Request, exc: ContextLengthError) -> JSONResponse:
        return error_response(request, 400, str(exc), "context_length_exceeded")

    @app.exception_handler(ValueError)
    async def _value(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(request, 400, str(exc) or "invalid request", "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if isinstance(exc, BodyTooLarge):
            return error_response(request, 413, message, "request_too_large")
        if exc.status_code == 404 and message == "Not Found":
            message = f"unknown endpoint: {request.method} {request.url.path}"
        return error_response(request, exc.status_code, message)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(request, 500, f"internal server error: {type(exc).__name__}",
                              "internal_error")
