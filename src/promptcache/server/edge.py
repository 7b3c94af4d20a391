"""The HTTP edge (uvicorn's h11 protocol, ``edge_protocol(limits)``): a head timeout, a
connection cap sized to the file descriptors (idle ones close first, a request in progress
never), 431 for a large head, a body timeout with ``BODY_MIN_RATE``, lingering close."""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import resource
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any, ClassVar

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from ..serving_config import EdgeLimits
from .api.errors import error_body

log = logging.getLogger(__name__)

FD_RESERVE = 256  # descriptors kept for the process's own files (model, SQLite, blocks)
BODY_MIN_RATE = 64 * 1024  # bytes per second that earn a request body one more second
MAX_BACKLOG = 2048  # uvicorn's default


class Phase(enum.Enum):
    HEAD = "head"  # waiting for a request head (a new connection, or a next request)
    BUSY = "busy"  # a request in progress: never closed by the cap
    IDLE = "idle"  # keep-alive, between requests
    LINGER = "linger"  # answered, closing: what still arrives is dropped
    CLOSED = "closed"


class Connections:
    """The open connections by phase (oldest first in each) and the edge's counters."""

    def __init__(self, limits: EdgeLimits) -> None:
        self.limits = limits
        self._by_phase: dict[Phase, dict[EdgeProtocol, None]] = {
            p: {} for p in Phase if p is not Phase.CLOSED}
        self.evicted = 0  # closed to make room for a new connection
        self.refused = 0  # new connections answered 503 (every other one busy)
        self.head_timeouts = 0
        self.oversized_heads = 0
        self.body_timeouts = 0

    def __len__(self) -> int:
        return sum(len(d) for d in self._by_phase.values())

    def move(self, conn: EdgeProtocol, old: Phase, new: Phase) -> None:
        if old is not Phase.CLOSED:
            self._by_phase[old].pop(conn, None)
        if new is not Phase.CLOSED:
            self._by_phase[new][conn] = None

    def victim(self) -> EdgeProtocol | None:
        """The connection to close when one too many is open: one answered and closing,
        else the longest idle, else the longest waiting for its head; None if all busy."""
        for phase in (Phase.LINGER, Phase.IDLE, Phase.HEAD):
            for conn in self._by_phase[phase]:
                return conn
        return None

    def counts(self) -> dict[str, int]:
        return {"open": len(self), **{p.value: len(d) for p, d in self._by_phase.items()},
                "evicted": self.evicted, "refused": self.refused,
                "head_timeouts": self.head_timeouts, "oversized_heads": self.oversized_heads,
                "body_timeouts": self.body_timeouts}


def _every(count: int) -> bool:
    """Log the first event of a kind and then every 1000th (an attack is thousands)."""
    return count == 1 or count % 1000 == 0


class EdgeProtocol(H11Protocol):
    """uvicorn's h11 protocol, tracking its connection's phase in ``edge``."""

    edge: ClassVar[Connections]

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.phase = Phase.CLOSED
        self._timer: asyncio.TimerHandle | None = None
        self._inner: asyncio.Transport | None = None
        self._head = _HeadScan()
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_start = 0.0
        self._body_seen = 0

    def _set_phase(self, new: Phase) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.edge.move(self, self.phase, new)
        self.phase = new

    def _start_head(self) -> None:
        self._head = _HeadScan()
        self._set_phase(Phase.HEAD)
        self._timer = self.loop.call_later(self.edge.limits.header_timeout_s,
                                           self._head_timed_out)

    def _head_timed_out(self) -> None:
        if self.phase is Phase.HEAD:
            self.edge.head_timeouts += 1
            if _every(self.edge.head_timeouts):
                log.warning("closed a connection that sent no request head within %.3g s "
                            "(%d so far; --header-timeout)", self.edge.limits.header_timeout_s,
                            self.edge.head_timeouts)
            self.close_now()

    def _start_body(self) -> None:
        self._body_start = self.loop.time()
        self._body_seen = 0
        self._body_timer = self.loop.call_later(self.edge.limits.body_timeout_s,
                                                self._body_timed_out)

    def _stop_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.phase is not Phase.BUSY or self.conn.their_state is not h11.SEND_BODY:
            return
        limit = self.edge.limits.body_timeout_s
        deadline = self._body_start + limit + self._body_seen / BODY_MIN_RATE
        if self.loop.time() < deadline:  # what arrived since bought it more time
            self._body_timer = self.loop.call_at(deadline, self._body_timed_out)
            return
        self.edge.body_timeouts += 1
        if _every(self.edge.body_timeouts):
            log.warning("closed a connection whose request body did not arrive within "
                        "%.3g s (%d so far; --body-timeout)", limit, self.edge.body_timeouts)
        cycle = self.cycle
        if cycle is None or cycle.response_started:
            self.close_now()
            return
        # the handler waiting for the body gets a disconnect; its answer is dropped
        cycle.disconnected = True
        cycle.message_event.set()
        self.refuse(408, f"the request body did not arrive within {limit:g} s",
                    "request_timeout", self._head.path())

    def close_now(self) -> None:
        """Close at once (what is written is still flushed)."""
        self._stop_body()
        self._set_phase(Phase.CLOSED)
        if self._inner is not None:
            self._inner.close()

    def _close_requested(self) -> None:
        """``transport.close()``: linger while the client is still sending, else close."""
        if self.phase is Phase.LINGER:
            return  # the client's EOF or the linger timer ends it
        sending = (self.phase is Phase.HEAD and self._head.seen > 0) or (
            self.phase is not Phase.CLOSED and self.conn.their_state is h11.SEND_BODY)
        inner = self._inner
        if not sending or inner is None or inner.is_closing() or not inner.can_write_eof() \
                or self.edge.limits.linger_s <= 0:
            self.close_now()
            return
        self._set_phase(Phase.LINGER)
        inner.write_eof()  # after what is written: the client reads the answer, then EOF
        inner.resume_reading()
        self._timer = self.loop.call_later(self.edge.limits.linger_s, self.close_now)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._inner = transport
        super().connection_made(_EdgeTransport(transport, self))
        self._start_head()
        edge = self.edge
        if len(edge) <= edge.limits.max_connections:
            return
        victim = edge.victim()
        if victim is None or victim is self:
            edge.refused += 1
            if _every(edge.refused):
                log.warning("refused a connection: %d open, every one busy (%d so far; "
                            "--max-connections)", len(edge) - 1, edge.refused)
            self.refuse(503, "the server has too many open connections; retry later",
                        "too_many_connections")
        else:
            edge.evicted += 1
            if _every(edge.evicted):
                log.warning("at --max-connections %d: closed a connection %s (%d so far)",
                            edge.limits.max_connections,
                            "idle between requests" if victim.phase is Phase.IDLE
                            else "still sending its request head", edge.evicted)
            victim.close_now()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_body()
        self._set_phase(Phase.CLOSED)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.phase in (Phase.CLOSED, Phase.LINGER):
            return
        if self.phase is Phase.IDLE:
            self._start_head()  # the next request's head must come in time too
        if self._body_timer is not None:
            self._body_seen += len(data)
        if self.phase is Phase.HEAD and not self._head.complete:
            size = self._head.feed(data)
            limit = self.edge.limits.max_header_bytes
            if size > limit:
                self.edge.oversized_heads += 1
                if _every(self.edge.oversized_heads):
                    log.warning("refused a request head of more than %d bytes (431; %d so "
                                "far)", limit, self.edge.oversized_heads)
                self.refuse(431, f"the request's headers are larger than the server's "
                                 f"limit of {limit} bytes", "request_header_fields_too_large",
                            self._head.path())
                return
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.phase in (Phase.HEAD, Phase.IDLE) and self.conn.their_state is not h11.IDLE:
            self._set_phase(Phase.BUSY)  # a whole head came in: a request is running
            if self.conn.their_state is h11.SEND_BODY:
                self._start_body()  # its body must follow in time
        if self._body_timer is not None and self.conn.their_state is not h11.SEND_BODY:
            self._stop_body()  # the whole body is in

    def on_response_complete(self) -> None:
        if self.conn.their_state is h11.SEND_BODY:
            self.transport.close()  # answered before the body ended: linger, then close
        if self.phase is Phase.BUSY and not self.transport.is_closing():
            self._set_phase(Phase.IDLE)
        super().on_response_complete()
        if self.phase is Phase.IDLE and self.conn.trailing_data[0]:
            self._start_head()  # part of a pipelined next request is here

    def refuse(self, status: int, message: str, code: str, path: str = "/v1/") -> None:
        """Answer ``status`` in the API's error shape and close."""
        body = json.dumps(error_body(path, status, message, code)).encode()
        reason = HTTPStatus(status).phrase.encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, reason, len(body), body))
        self.transport.close()


class _HeadScan:
    """Counts a request head's bytes in any chunks: it ends at its first blank line."""

    def __init__(self) -> None:
        self.seen = 0
        self.complete = False
        self._tail = b""
        self._start = b""

    def feed(self, data: bytes) -> int:
        """The head's size so far (its whole size once it is complete)."""
        if len(self._start) < 1024:
            self._start += data[:1024 - len(self._start)]
        window = self._tail + data
        end = window.find(b"\r\n\r\n")
        before = self.seen - len(self._tail)
        self.seen += len(data)
        self._tail = window[-3:]
        if end >= 0:
            self.complete = True
            return before + end + 4
        return self.seen

    def path(self) -> str:
        """The request target's path, to answer in its API's error shape."""
        parts = self._start.split(b"\r\n", 1)[0].split(b" ")
        target = parts[1] if len(parts) > 1 else b"/"
        return target.split(b"?", 1)[0].decode("latin-1")


class _EdgeTransport(asyncio.Transport):
    """The transport uvicorn sees: ``close()`` goes through the protocol (may linger)."""

    def __init__(self, inner: asyncio.Transport, protocol: EdgeProtocol) -> None:
        super().__init__()
        self._inner = inner
        self._protocol = protocol

    def close(self) -> None:
        self._protocol._close_requested()

    def is_closing(self) -> bool:
        return self._inner.is_closing() or self._protocol.phase in (Phase.LINGER,
                                                                     Phase.CLOSED)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._protocol.phase is not Phase.LINGER:  # after write_eof: nothing more
            self._inner.write(data)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        for data in list_of_data:
            self.write(data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._inner.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._inner.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._inner.get_protocol()

    def is_reading(self) -> bool:
        return self._inner.is_reading()

    def pause_reading(self) -> None:
        if self._protocol.phase is not Phase.LINGER:  # lingering drains
            self._inner.pause_reading()

    def resume_reading(self) -> None:
        self._inner.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._inner.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._inner.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._inner.get_write_buffer_limits()

    def write_eof(self) -> None:
        self._inner.write_eof()

    def can_write_eof(self) -> bool:
        return self._inner.can_write_eof()

    def abort(self) -> None:
        self._inner.abort()


def edge_protocol(limits: EdgeLimits) -> type[EdgeProtocol]:
    """The protocol class for one server (uvicorn's ``http=``), with its own ``Connections``."""

    class ServerEdgeProtocol(EdgeProtocol):
        edge = Connections(limits)

    return ServerEdgeProtocol


def fit_to_fd_limit(wanted: int) -> tuple[int, int]:
    """``(max_connections, backlog)`` for a cap of ``wanted``: open connections, one
    accept batch (``backlog``) and ``FD_RESERVE`` must fit RLIMIT_NOFILE; the soft limit
    is raised toward the hard one, and what still does not fit lowers the cap (logged)."""
    need = 2 * wanted + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(hard, need)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.debug("cannot raise RLIMIT_NOFILE to %d: %s", target, e)
    cap = wanted
    if soft != resource.RLIM_INFINITY and soft < need:
        cap = max(1, (soft - FD_RESERVE) // 2)
        log.warning("--max-connections %d does not fit the file descriptor limit %d: "
                    "serving at most %d connections", wanted, soft, cap)
    return cap, min(cap, MAX_BACKLOG)
