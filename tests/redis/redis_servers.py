"""Real redis-server processes for the tests: standalone and a 3-master Cluster, on
free loopback ports, stopped by PID. Also a TCP proxy that can delay replies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import redis

REDIS_SERVER = shutil.which("redis-server") or shutil.which("valkey-server")
REDIS_CLI = shutil.which("redis-cli") or shutil.which("valkey-cli")
READY_TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(pred: object, timeout: float = READY_TIMEOUT_S, what: str = "condition") -> None:
    """Poll ``pred()`` until true (readiness of an external process, not a test's timing)."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():  # type: ignore[operator]
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

    def start(self) -> RedisServer:
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


class RedisClusterProcs:
    """Three masters, no replicas, slots assigned by ``redis-cli --cluster create``."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = [
            RedisServer(workdir / f"node{i}", "--cluster-enabled", "yes",
                        "--cluster-config-file", "nodes.conf",
                        "--cluster-node-timeout", "2000",
                        # the bus port: else port + 10000, which may be taken or > 65535
                        "--cluster-port", str(free_port()))
            for i in range(3)
        ]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisClusterProcs:
        if REDIS_CLI is None:
            raise RuntimeError("redis-cli is not installed")
        for n in self.nodes:
            n.start()
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )
        wait_until(self._ok, what="cluster_state:ok on every node")
        return self

    def _ok(self) -> bool:
        for n in self.nodes:
            try:
                info = n.client().execute_command("CLUSTER", "INFO")
            except redis.RedisError:
                return False
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text:
                return False
        return True

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


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


@contextlib.contextmanager
def running(server: RedisServer | RedisClusterProcs) -> Iterator[RedisServer | RedisClusterProcs]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


PROMPTCACHE_ARGV = [sys.executable, "-c",
                    "import sys; from promptcache.cli import main; sys.exit(main())"]


class ServeProcess:
    """A real ``promptcache serve`` subprocess on a free port (stopped by PID)."""

    def __init__(self, workdir: Path, model: Path, *args: str) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.argv = [*PROMPTCACHE_ARGV, "serve", "--model", str(model), "--port", str(self.port),
                     "--log-level", "warning", *args]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServeProcess:
        log = open(self.workdir / "server.log", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_until(self._ready, timeout=120, what=f"promptcache serve on {self.port}")
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError("server exited:\n" + self.log())
        try:
            return httpx.get(f"{self.base}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return (self.workdir / "server.log").read_text(errors="replace")[-4000:]

    def stats(self) -> dict[str, Any]:
        """The cache statistics (``/v1/cache/stats``'s ``cache``; {} without a cache)."""
        data: dict[str, Any] = httpx.get(f"{self.base}/v1/cache/stats", timeout=10).json()
        return data.get("cache") or {}

    def redis_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self.stats()["tiers"]["redis"]
        return out

    def wait_redis_written(self) -> None:
        """Until every block this server queued for Redis is written (or dropped)."""
        wait_until(lambda: self.redis_stats()["pending_writes"] == 0,
                   what=f"redis writes of {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
