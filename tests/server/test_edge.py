"""The HTTP edge (server/edge.py) against a real ``promptcache serve`` (tiny llama, RAM
cache): sockets that never finish a request (head or body), too many connections,
oversized heads. Every case also asserts that a normal request beside the attack is
still answered, and the edge's counters in ``/metrics`` with exact values."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil  # type: ignore[import-untyped]
import pytest
from serve_proc import PROMPTCACHE, stop, wait_healthy

from harness.systems import free_port
from promptcache.serving_config import EdgeLimits

CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2, "temperature": 0}
SLOW_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"  # never finished
BUSY_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: "
             b"application/json\r\ncontent-length: 100\r\n\r\n")  # a body that never comes


@dataclass
class Served:
    base: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path


@contextlib.contextmanager
def serve(model: Path, tmp_path: Path, *args: str) -> Iterator[Served]:
    """``promptcache serve`` on a free loopback port, stopped by its PID."""
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([PROMPTCACHE, "serve", "--model", str(model), "--no-ssd",
                                 "--port", str(port), *args],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, log, timeout=120)
        yield Served(base, port, proc, log)
    finally:
        stop(proc)


def chat(base: str) -> tuple[int, float]:
    """A normal chat request on a fresh connection: its status and seconds taken."""
    t0 = time.monotonic()
    r = httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code != 200 or r.json()["choices"][0]["message"]["content"] is not None
    return r.status_code, time.monotonic() - t0


def edge_events(base: str) -> dict[str, float]:
    """``promptcache_edge_events_total`` from ``/metrics``, by event."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith('promptcache_edge_events_total{event="'):
            name, value = line.removeprefix('promptcache_edge_events_total{event="').split(
                '"} ')
            out[name] = float(value)
    return out


def no_events(**got: int) -> dict[str, float]:
    """Every edge event at 0 but ``got``."""
    return {**{k: 0.0 for k in ("evicted", "refused", "head_timeouts", "oversized_heads",
                                "body_timeouts")}, **{k: float(v) for k, v in got.items()}}


def ensure_nofile(n: int) -> None:
    """Raise this test process's own RLIMIT_NOFILE to ``n`` (skip if the hard limit
    is lower)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            pytest.skip(f"needs {n} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


def is_closed(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closed ``sock`` (EOF or reset) within ``timeout`` s; data it
    sent first is read and dropped."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection."""
    sock.settimeout(10)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def connect(port: int, first: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if first:
        s.sendall(first)
    return s


def test_2160_slow_and_idle_sockets_leave_room_for_a_normal_request(
        tiny_llama_path: Path, tmp_path: Path) -> None:
    """The probe's attack: 2,160 sockets from one client, half of them sending a head
    that never ends, half nothing, against a server whose descriptors mlx-lm limits to
    2,048 (soft; 4,096 hard) when imported. The server raises the soft limit to fit the
    default cap of 1,024 connections plus one accept batch; past the cap it closes the
    oldest waiting connections, so accept never fails with EMFILE and a normal chat
    answers at once. (The head timeout is set long, so only the cap is at work.)"""
    n = 2160
    ensure_nofile(n + 512)
    with serve(tiny_llama_path, tmp_path, "--header-timeout", "120") as srv:
        socks: list[socket.socket] = []
        try:
            for i in range(n):
                s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
                socks.append(s)
                if i % 2:
                    with contextlib.suppress(OSError):  # the cap may have closed it
                        s.sendall(SLOW_HEAD)
            status, seconds = chat(srv.base)
            proc = psutil.Process(srv.proc.pid)
            fds, (soft, _) = proc.num_fds(), proc.rlimit(psutil.RLIMIT_NOFILE)
            print(f"{n} sockets: a normal chat answered {status} in {seconds:.3f} s; "
                  f"the server holds {fds} of {soft} file descriptors")
            assert status == 200
            assert seconds < 2.0
            assert soft == 2 * 1024 + 256 and fds < soft
            log = srv.log.read_text(errors="replace")
            assert "Too many open files" not in log and "out of system resource" not in log
            assert "at --max-connections 1024: closed a connection" in log
        finally:
            for s in socks:
                s.close()


def test_a_connection_without_a_whole_head_is_closed_after_the_header_timeout(
        tiny_llama_path: Path, tmp_path: Path) -> None:
    with serve(tiny_llama_path, tmp_path, "--header-timeout", "1") as srv:
        silent = connect(srv.port)
        partial = connect(srv.port, SLOW_HEAD)
        trickle = connect(srv.port, b"GET /health HTTP/1.1\r\n")
        t0 = time.monotonic()
        closed = False
        for _ in range(50):  # a header line every 0.2 s: still not a whole head in time
            try:
                trickle.sendall(b"x-pad: 1\r\n")
            except OSError:
                closed = True
                break
            if is_closed(trickle, 0.2):
                closed = True
                break
        assert closed, "a head trickling in forever was never cut"
        assert time.monotonic() - t0 < 8.0
        assert is_closed(silent, 10.0) and is_closed(partial, 10.0)
        assert chat(srv.base)[0] == 200
        # a keep-alive connection's next request is held to the same timeout
        s = connect(srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(10)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.sendall(SLOW_HEAD)
        assert is_closed(s, 10.0)
        assert "sent no request head within 1 s" in srv.log.read_text()
        assert edge_events(srv.base) == no_events(head_timeouts=4)
        for sock in (silent, partial, trickle, s):
            sock.close()


def test_at_the_cap_idle_connections_go_first_and_busy_ones_are_kept(
        tiny_llama_path: Path, tmp_path: Path) -> None:
    with serve(tiny_llama_path, tmp_path, "--max-connections", "8") as srv:
        idle = []
        for _ in range(8):  # 8 keep-alive connections, each answered once, now idle
            s = connect(srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            s.settimeout(10)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
            idle.append(s)
        slow = [connect(srv.port, SLOW_HEAD) for _ in range(3)]
        assert all(is_closed(s, 10.0) for s in idle[:3])  # the 3 oldest idle ones
        assert chat(srv.base)[0] == 200  # closes the 4th idle one
        assert is_closed(idle[3], 10.0)
        assert not any(is_closed(s, 0.3) for s in idle[4:] + slow)
        # 8 requests waiting for their bodies: busy, never cut; a 9th connection first
        # closes the idle and slow ones, then is refused
        busy = [connect(srv.port, BUSY_HEAD) for _ in range(8)]
        assert all(is_closed(s, 10.0) for s in idle[4:] + slow)
        extra = connect(srv.port)
        reply = read_all(extra)
        assert reply.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), reply
        assert reply.endswith(b'{"error": {"message": "the server has too many open '
                              b'connections; retry later", "type": "server_error", '
                              b'"param": null, "code": "too_many_connections"}}')
        assert not any(is_closed(s, 0.3) for s in busy)
        busy[0].close()
        refused_chats = 0
        for _ in range(50):  # once the server has seen it go, a normal request answers
            status = chat(srv.base)[0]
            if status != 503:
                break
            refused_chats += 1
            time.sleep(0.1)
        assert status == 200
        # 3 + 1 idle ones, then 4 idle and 3 slow ones closed; the 9th connection refused,
        # and the normal requests refused until the server saw busy[0] go
        assert edge_events(srv.base) == no_events(evicted=11, refused=1 + refused_chats)
        for s in idle + slow + busy + [extra]:
            s.close()


def head_of(size: int, path: str = "/health") -> bytes:
    """A GET request head of exactly ``size`` bytes (padded by one header; a keep-alive
    request that asks to be closed after its answer)."""
    start = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nx-pad: ".encode()
    pad = size - len(start) - 4
    return start + b"a" * pad + b"\r\n\r\n"


def test_an_oversized_head_is_a_431_in_the_api_error_shape(tiny_llama_path: Path,
                                                           tmp_path: Path) -> None:
    with serve(tiny_llama_path, tmp_path, "--max-body-bytes", "1MB") as srv:
        # a 1 MB header through a real client: the 431 is read, not a reset
        r = httpx.post(f"{srv.base}/v1/chat/completions", json=CHAT, timeout=30,
                       headers={"x-big": "a" * 1_000_000})
        assert r.status_code == 431
        assert r.json() == {"error": {
            "message": "the request's headers are larger than the server's limit of "
                       "16384 bytes", "type": "invalid_request_error", "param": None,
            "code": "request_header_fields_too_large"}}
        # Anthropic's path, Anthropic's shape
        r = httpx.post(f"{srv.base}/v1/messages", json=CHAT, timeout=30,
                       headers={"x-big": "a" * 100_000})
        assert r.status_code == 431 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"
        # the limit is exact whatever the chunks: 16,384 bytes pass, 16,385 do not
        for size, status in ((16384, b"200"), (16385, b"431")):
            for step in (size, 1000):
                s = connect(srv.port)
                head = head_of(size)
                for i in range(0, len(head), step):
                    with contextlib.suppress(OSError):
                        s.sendall(head[i:i + step])
                assert read_all(s).startswith(b"HTTP/1.1 " + status), (size, step)
                s.close()
        # a body past --max-body-bytes, streamed without a length: the 413 is read too
        def body() -> Iterator[bytes]:
            for _ in range(64):
                yield b"x" * 1024**2

        r = httpx.post(f"{srv.base}/v1/chat/completions", content=body(), timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert chat(srv.base)[0] == 200
        assert "refused a request head of more than 16384 bytes" in srv.log.read_text()
        # the two clients' heads and the two one byte over, each sent whole and in pieces
        assert edge_events(srv.base) == no_events(oversized_heads=4)


def test_a_body_that_trickles_or_stops_is_a_408_in_the_api_error_shape(
        tiny_llama_path: Path, tmp_path: Path) -> None:
    """A client that sends a request head, then its body slowly or not at all, holds its
    connection (and the handler waiting for the body) for at most --body-timeout: it is
    answered 408 in its API's error shape and closed, while a normal request answers and
    a body that arrives in pieces within the time is served."""
    with serve(tiny_llama_path, tmp_path, "--body-timeout", "1") as srv:
        stopped = connect(srv.port, BUSY_HEAD)  # 100 bytes announced, none sent
        anthropic = connect(srv.port, BUSY_HEAD.replace(b"/v1/chat/completions",
                                                        b"/v1/messages") + b'{"model"')
        trickle = connect(srv.port, BUSY_HEAD)
        t0 = time.monotonic()
        got = b""
        trickle.settimeout(0.2)
        for _ in range(50):  # a byte every 0.2 s: 100 bytes would take 20 s
            with contextlib.suppress(OSError):
                trickle.sendall(b" ")
            try:
                got += trickle.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if got.endswith(b"}}"):
                break
        assert time.monotonic() - t0 < 5.0
        assert chat(srv.base)[0] == 200  # beside them, a normal request answers
        openai_408 = (b'{"error": {"message": "the request body did not arrive within 1 s", '
                      b'"type": "invalid_request_error", "param": null, '
                      b'"code": "request_timeout"}}')
        assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), got
        assert got.endswith(openai_408)
        reply = read_all(stopped)
        assert reply.startswith(b"HTTP/1.1 408 Request Timeout\r\n") and reply.endswith(
            openai_408), reply
        reply = read_all(anthropic)
        assert reply.startswith(b"HTTP/1.1 408 ") and reply.endswith(
            b'{"type": "error", "error": {"type": "invalid_request_error", "message": "the '
            b'request body did not arrive within 1 s"}}'), reply
        # a body sent in two pieces 0.5 s apart arrives within the time: served
        body = json.dumps(CHAT).encode()
        s = connect(srv.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    b"content-type: application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body[:10]))
        time.sleep(0.5)
        s.sendall(body[10:])
        assert read_all(s).startswith(b"HTTP/1.1 200 OK\r\n")
        assert edge_events(srv.base) == no_events(body_timeouts=3)
        log = srv.log.read_text()
        assert "request body did not arrive within 1 s" in log
        assert "Traceback" not in log and "Exception in ASGI application" not in log
        for sock in (stopped, anthropic, trickle, s):
            sock.close()


@pytest.mark.parametrize("kw,message", [
    ({"body_timeout_s": 0}, "body_timeout_s must be > 0, got 0"),
    ({"header_timeout_s": -1.0}, "header_timeout_s must be > 0, got -1.0"),
])
def test_edge_limits_refuse_a_timeout_that_is_not_positive(kw: dict[str, float],
                                                          message: str) -> None:
    with pytest.raises(ValueError) as got:
        EdgeLimits(**kw)  # type: ignore[arg-type]
    assert str(got.value) == message
