"""redis-server processes and a delaying TCP proxy, for the S6 benchmark and the tests.

``RedisServer`` runs one redis-server (no persistence) on a free loopback port and
stops it by PID; ``DelayProxy`` is an asyncio TCP proxy (on its own thread) that can
hold every reply from the server for ``delay_s`` seconds. ``free_port`` is
``systems.free_port`` (re-exported: the tests import it from here).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis

from .systems import free_port

REDIS_SERVER = shutil.which("redis-server") or shutil.which("valkey-server")
REDIS_CLI = shutil.which("redis-cli") or shutil.which("valkey-cli")
READY_TIMEOUT_S = 20.0


def wait_until(pred: Callable[[], object], timeout: float = READY_TIMEOUT_S,
               what: str = "condition") -> None:
    """Poll ``pred()`` until true (readiness of an external process)."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


class RedisServer:
    """One redis-server process; ``restart`` keeps the port."""

    def __init__(self, workdir: Path, *args: str, port: int | None = None,
                 unix_socket: bool = False) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed")
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.args = list(args)
        self.port = port or free_port()
        self.socket_path = str(workdir / "redis.sock") if unix_socket else None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> RedisServer:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server (or valkey-server) is not installed")
        cmd = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
               "--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning",
               *self.args]
        if self.socket_path:
            cmd += ["--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     cwd=self.workdir)
        log.close()
        wait_until(self._ready, what=f"redis-server on port {self.port}")
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited: {(self.workdir / 'redis.log').read_text()}")
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def kill(self) -> None:
        """SIGKILL (by PID) and wait."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()


class DelayProxy:
    """A TCP proxy (asyncio, on its own thread) in front of ``target_port``. While
    ``delay_s`` > 0 every chunk from the server is held that long before it is
    forwarded; ``delay_s = 0`` passes replies straight through."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.delay_s = 0.0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> DelayProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delayed: bool) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while True:
                    data = await src.read(65536)
                    if not data:
                        break
                    if delayed and self.delay_s > 0:
                        await asyncio.sleep(self.delay_s)
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pipe(reader, up_w, False), pipe(up_r, writer, True))

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
