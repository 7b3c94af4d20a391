"""The HTTP edge: uvicorn's h11 protocol with the limits a server facing untrusted
clients needs, so that the server outlives a client that opens sockets and never
finishes a request (issue 42).

- **Head timeout.** A connection that has not sent a whole request head within
  ``header_timeout_s`` of opening (or of the first byte of its next request on a
  keep-alive connection) is closed. uvicorn's own ``timeout_keep_alive`` closes
  connections idle between requests.
- **Connection cap.** At most ``max_connections`` connections stay open. A connection
  past the cap closes another: an idle keep-alive one first, else the one that has
  waited longest for its head; a request in progress is never cut. With every other
  connection busy, the new one is answered 503 and closed. ``fit_to_fd_limit`` sizes
  the cap and uvicorn's accept batch (``backlog``) to the process's file descriptors, so
  ``accept`` never fails with EMFILE.

``edge_protocol(limits)`` gives the protocol class uvicorn is handed (``http=``): one
class per server, sharing its ``Connections``.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import resource
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
MAX_BACKLOG = 2048  # uvicorn's default


class Phase(enum.Enum):
    HEAD = "head"  # waiting for a request head (a new connection, or a next request)
    BUSY = "busy"  # a request in progress: never closed by the cap
    IDLE = "idle"  # keep-alive, between requests
    CLOSED = "closed"


class Connections:
    """The open connections of one server by phase, each phase in the order its
    connections entered it (the oldest first), and the edge's counters."""

    def __init__(self, limits: EdgeLimits) -> None:
        self.limits = limits
        self._by_phase: dict[Phase, dict[EdgeProtocol, None]] = {
            p: {} for p in Phase if p is not Phase.CLOSED}
        self.evicted = 0  # closed to make room for a new connection
        self.refused = 0  # new connections answered 503 (every other one busy)
        self.head_timeouts = 0

    def __len__(self) -> int:
        return sum(len(d) for d in self._by_phase.values())

    def move(self, conn: EdgeProtocol, old: Phase, new: Phase) -> None:
        if old is not Phase.CLOSED:
            self._by_phase[old].pop(conn, None)
        if new is not Phase.CLOSED:
            self._by_phase[new][conn] = None

    def victim(self) -> EdgeProtocol | None:
        """The connection to close when one too many is open: the longest idle, else
        the one waiting longest for its head; None when every one is busy."""
        for phase in (Phase.IDLE, Phase.HEAD):
            for conn in self._by_phase[phase]:
                return conn
        return None

    def counts(self) -> dict[str, int]:
        return {"open": len(self), **{p.value: len(d) for p, d in self._by_phase.items()},
                "evicted": self.evicted, "refused": self.refused,
                "head_timeouts": self.head_timeouts}


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

    # --- phases

    def _set_phase(self, new: Phase) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.edge.move(self, self.phase, new)
        self.phase = new

    def _start_head(self) -> None:
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

    def close_now(self) -> None:
        """Close at once (what is written is still flushed)."""
        self._set_phase(Phase.CLOSED)
        self.transport.close()

    # --- asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
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
        self._set_phase(Phase.CLOSED)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.phase is Phase.CLOSED:
            return
        if self.phase is Phase.IDLE:
            self._start_head()  # the next request's head must come in time too
        super().data_received(data)

    # --- uvicorn's H11Protocol

    def handle_events(self) -> None:
        super().handle_events()
        if self.phase in (Phase.HEAD, Phase.IDLE) and self.conn.their_state is not h11.IDLE:
            self._set_phase(Phase.BUSY)  # a whole head came in: a request is running

    def on_response_complete(self) -> None:
        if self.phase is Phase.BUSY and not self.transport.is_closing():
            self._set_phase(Phase.IDLE)
        super().on_response_complete()
        if self.phase is Phase.IDLE and self.conn.trailing_data[0]:
            self._start_head()  # part of a pipelined next request is here

    # --- answers the app never sees

    def refuse(self, status: int, message: str, code: str, path: str = "/v1/") -> None:
        """Answer ``status`` in the API's error shape (OpenAI's, or Anthropic's for
        ``/v1/messages``) and close."""
        body = json.dumps(error_body(path, status, message, code)).encode()
        reason = HTTPStatus(status).phrase.encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, reason, len(body), body))
        self.close_now()


def edge_protocol(limits: EdgeLimits) -> type[EdgeProtocol]:
    """The protocol class for one server (uvicorn's ``http=``), with its own
    ``Connections``."""

    class ServerEdgeProtocol(EdgeProtocol):
        edge = Connections(limits)

    return ServerEdgeProtocol


def fit_to_fd_limit(wanted: int) -> tuple[int, int]:
    """``(max_connections, backlog)`` for a cap of ``wanted`` connections: the open
    connections, one accept batch (``backlog``: asyncio accepts up to that many sockets
    before any closes) and ``FD_RESERVE`` must fit the process's RLIMIT_NOFILE. The
    soft limit is raised toward the hard one when short; what still does not fit lowers
    the cap (logged)."""
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
