"""Helpers of the server tests: SSE parsing, an in-thread uvicorn server."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from harness.systems import free_port


def sse_events(text: str) -> list[tuple[str | None, Any]]:
    """Parse an SSE body into (event name, parsed data) pairs ("[DONE]" stays a string)."""
    out: list[tuple[str | None, Any]] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                raw = line[len("data: "):]
                data = raw if raw == "[DONE]" else json.loads(raw)
        out.append((name, data))
    return out


@contextmanager
def uvicorn_thread(app: Any) -> Iterator[str]:
    """Serve ``app`` with a real uvicorn on a free port in a thread; yields the base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def assert_streamed_equals_whole(reply: str, cuts: list[int], names: Any, fmt: Any,
                                 tools: Any) -> None:
    """``reply`` fed to a ``ToolCallStream`` in the pieces ``cuts`` makes gives the text
    and calls of parsing it whole."""
    from promptcache.server.replies.toolcalls import ParsedReply, ToolCallStream, parse_tool_calls

    points = sorted({min(c, len(reply)) for c in cuts} | {0, len(reply)})
    stream = ToolCallStream(names, fmt, tools)
    out = "".join(stream.feed(reply[a:b]) for a, b in zip(points, points[1:], strict=False))
    tail, calls = stream.finish()
    assert ParsedReply(out + tail, calls) == parse_tool_calls(reply, names, fmt, tools)
