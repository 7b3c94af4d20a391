"""``--max-body-bytes``: an ASGI middleware answering a larger ``/v1/*`` body with 413 in
the API's shape (from ``Content-Length`` or at the chunk crossing it)."""

from __future__ import annotations

import json
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import BodyTooLarge, error_body

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # as the hosted APIs' own request limits
EXEMPT_PATHS = ("/v1/cache/import",)


def too_large_message(limit: int) -> str:
    return f"the request body is larger than the server's limit of {limit} bytes " \
           "(--max-body-bytes)"


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (scope["type"] != "http" or not path.startswith("/v1/")
                or path.startswith(EXEMPT_PATHS)):
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        length = _content_length(scope)
        if length is not None and length > limit:
            log.warning("refused %s %s: Content-Length %d > %d", scope.get("method"), path,
                        length, limit)
            await _send_413(path, limit, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    log.warning("refused %s %s: body passed %d bytes", scope.get("method"),
                                path, limit)
                    raise BodyTooLarge(too_large_message(limit))
            return message

        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited, tracked)
        except BodyTooLarge:
            # no exception handler answers a middleware's raise: answer here
            if started:
                raise
            await _send_413(path, limit, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_413(path: str, limit: int, send: Send) -> None:
    body = json.dumps(error_body(path, 413, too_large_message(limit),
                                 "request_too_large")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
