"""ASGI middleware: every 4xx / 5xx logged with its reason and session, and with
``--log-requests DIR`` every ``/v1`` request written to ``DIR/<seq>-<api>.json`` (secret
headers left out) in a worker thread."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

SECRET_HEADERS = frozenset({"authorization", "x-api-key", "cookie", "proxy-authorization"})
_MAX_ERROR_BODY = 16 * 1024


def api_name(path: str) -> str:
    for prefix, name in (("/v1/messages", "messages"), ("/v1/responses", "responses"),
                         ("/v1/chat/completions", "chat"), ("/v1/completions", "completions")):
        if path.startswith(prefix):
            return name
    return path.strip("/").replace("/", "_") or "root"


def _error_reason(body: bytes) -> str:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body[:300].decode("utf-8", "replace")
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return str(err["message"])
    return json.dumps(data)[:300]


def _write(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, ensure_ascii=False, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def first_sequence_number(directory: Path) -> int:
    """Create ``directory``; the next sequence number there (not on the event loop)."""
    directory.mkdir(parents=True, exist_ok=True)
    existing = [int(p.name.split("-")[0]) for p in directory.glob("*-*.json")
                if p.name.split("-")[0].isdigit()]
    return max(existing, default=0) + 1


class RequestLog:
    def __init__(self, app: ASGIApp, directory: Path | None = None, first_seq: int = 1
                 ) -> None:
        self.app = app
        self.directory = directory
        self._seq = itertools.count(first_seq)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = self.directory is not None and scope["path"].startswith("/v1/")
        chunks: list[bytes] = []
        if record:
            while True:  # read the whole body, then replay it
                msg = await receive()
                if msg["type"] != "http.request":
                    break
                chunks.append(msg.get("body", b""))
                if not msg.get("more_body", False):
                    break
            body = b"".join(chunks)
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            inner_receive: Receive = replay
        else:
            inner_receive = receive
        status = 0
        error_body: list[bytes] = []

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and status >= 400:
                if sum(len(b) for b in error_body) < _MAX_ERROR_BODY:
                    error_body.append(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, inner_receive, watch)
        finally:
            if status >= 400:
                self._log_error(scope, status, b"".join(error_body))
            if record:
                await self._record(scope, b"".join(chunks), status)

    @staticmethod
    def _log_error(scope: Scope, status: int, body: bytes) -> None:
        pc_scope = (scope.get("state") or {}).get("pc_scope")
        who = pc_scope.describe() if pc_scope is not None else "session=-"
        log.warning("%s %s -> %d: %s (%s)", scope.get("method"), scope.get("path"), status,
                    _error_reason(body), who)

    async def _record(self, scope: Scope, body: bytes, status: int) -> None:
        if self.directory is None:
            return
        headers = {k.decode("latin-1"): v.decode("latin-1")
                   for k, v in scope.get("headers", [])
                   if k.decode("latin-1").lower() not in SECRET_HEADERS}
        try:
            parsed: Any = json.loads(body) if body else None
        except (ValueError, UnicodeDecodeError):
            parsed = body.decode("utf-8", "replace")
        seq = next(self._seq)
        rec = {"seq": seq, "time": time.time(), "method": scope.get("method"),
               "path": scope.get("path"), "query": scope.get("query_string", b"").decode(),
               "headers": headers, "body": parsed, "status": status}
        path = self.directory / f"{seq:06d}-{api_name(str(scope.get('path')))}.json"
        try:
            await asyncio.to_thread(_write, path, rec)
        except OSError:
            log.warning("cannot record request %d into %s", seq, self.directory, exc_info=True)
