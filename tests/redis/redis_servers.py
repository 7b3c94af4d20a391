"""Real redis-server processes for the tests: standalone and a 3-master Cluster, on
free loopback ports, stopped by PID. Also a TCP proxy that can delay replies."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import redis

from harness.redisproc import (  # noqa: F401 - re-exported for the tests
    REDIS_CLI,
    REDIS_SERVER,
    DelayProxy,
    RedisServer,
    free_port,
    wait_until,
)


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


@contextlib.contextmanager
def running(server: RedisServer | RedisClusterProcs) -> Iterator[RedisServer | RedisClusterProcs]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


PROMPTCACHE_ARGV = [sys.executable, "-c",
                    "import sys; from promptcache.cli import main; sys.exit(main())"]


def pinned_plan(args: tuple[str, ...] | list[str]) -> list[str]:
    """``args`` with ``--restore-plan load`` unless they name one (the restore planner's choice is pinned: tests never depend on timing (test_restore_plan tests auto))."""
    return [*args] if "--restore-plan" in args else [*args, "--restore-plan", "load"]


class ServeProcess:
    """A real ``promptcache serve`` subprocess on a free port (stopped by PID)."""

    def __init__(self, workdir: Path, model: Path, *args: str) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.argv = [*PROMPTCACHE_ARGV, "serve", "--model", str(model), "--port", str(self.port),
                     "--log-level", "warning", *pinned_plan(args)]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServeProcess:
        return self.launch().wait_ready()

    def launch(self) -> ServeProcess:
        """Start the process, not waiting for it (several servers start side by side)."""
        log = open(self.workdir / "server.log", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def wait_ready(self) -> ServeProcess:
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

    def prerender_idle(self) -> bool:
        """No next-turn pre-render queued or running (``/v1/cache/stats`` ``prerender``)."""
        pre = httpx.get(f"{self.base}/v1/cache/stats", timeout=10).json().get("prerender") or {}
        return not pre.get("queued") and not pre.get("pending")

    def wait_redis_written(self) -> None:
        """Until the reply's next-turn pre-render (a background prefill: its blocks go to
        Redis too) has ended and every block this server queued for Redis is written (or
        dropped); what a turn leaves in Redis does not then depend on timing."""
        wait_until(self.prerender_idle, what=f"the pre-render of {self.port}")
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
