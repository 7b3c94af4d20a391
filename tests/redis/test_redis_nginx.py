"""docs/deploy.md's nginx config (deploy/nginx/promptcache.conf), run for real in front of
two servers sharing one Redis: a session sticks to one server; sessions spread over
both; streaming passes through; when a session's server goes down the session moves
and its next turn is a Redis hit on the other server."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis_servers import RedisServer, ServeProcess, free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "deploy" / "nginx" / "promptcache.conf"
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)

pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed")


class Nginx:
    def __init__(self, workdir: Path, backends: list[int]) -> None:
        self.workdir = workdir
        self.port = free_port()
        conf = CONF.read_text()
        for default, port in zip(("127.0.0.1:8081", "127.0.0.1:8082"), backends, strict=True):
            assert default in conf
            conf = conf.replace(default, f"127.0.0.1:{port}")
        assert "listen 127.0.0.1:8080;" in conf
        conf = conf.replace("listen 127.0.0.1:8080;", f"listen 127.0.0.1:{self.port};")
        (workdir / "promptcache.conf").write_text(conf)
        temps = "\n".join(f"    {k}_temp_path {workdir}/{k};"
                          for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        user = "user root;\n" if os.geteuid() == 0 else ""
        (workdir / "nginx.conf").write_text(
            f"{user}daemon off;\nworker_processes 1;\npid {workdir}/nginx.pid;\n"
            f"error_log {workdir}/error.log warn;\nevents {{ worker_connections 256; }}\n"
            f"http {{\n    access_log off;\n{temps}\n    include {workdir}/promptcache.conf;\n}}\n")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Nginx:
        assert NGINX is not None
        cmd = [NGINX, "-p", str(self.workdir), "-c", str(self.workdir / "nginx.conf")]
        subprocess.run([*cmd, "-t"], check=True, capture_output=True)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_until(self._ready, what="nginx")
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError((self.workdir / "error.log").read_text())
        try:
            httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1)
            return True
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGQUIT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def front(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("nginx")
    redis_srv = RedisServer(tmp / "redis").start()
    args = ["--block-size", "16", "--no-ssd", "--ram-budget", "64MB", "--redis-url", redis_srv.url,
            "--redis-timeout-ms", "1000"]  # no timeouts on a CPU-starved CI machine
    servers = [ServeProcess(tmp / f"s{i}", tiny_llama_path, *args) for i in range(2)]
    started: list[Any] = []
    try:
        for s in servers:  # launched side by side, then each waited for
            started.append(s.launch())
        for s in servers:
            s.wait_ready()
        nginx = Nginx(tmp, [s.port for s in servers])
        started.append(nginx.start())
        yield {"nginx": nginx, "servers": servers, "redis": redis_srv}
    finally:
        for s in reversed(started):
            s.stop()
        redis_srv.stop()


def ask(front: dict[str, Any], session: str, text: str, *, header: str = "X-Session-Id",
        history: list[dict[str, str]] | None = None) -> tuple[str, dict[str, Any]]:
    msgs = [*(history or []), {"role": "user", "content": text}]
    r = httpx.post(f"http://127.0.0.1:{front['nginx'].port}/v1/chat/completions", timeout=120,
                   headers={header: session},
                   json={"model": "default", "messages": msgs, "max_tokens": 4,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    return r.headers["X-Promptcache-Upstream"], r.json()


def route(front: dict[str, Any], header: str, session: str,
          client: httpx.Client | None = None) -> str:
    """The server nginx sends this session to (a cheap GET, routed like every request)."""
    r = (client or httpx).get(f"http://127.0.0.1:{front['nginx'].port}/health", timeout=30,
                              headers={header: session})
    assert r.status_code == 200
    return str(r.headers["X-Promptcache-Upstream"])


def test_sessions_stick_and_spread(front: dict[str, Any]) -> None:
    # a real request lands where the cheap routing probe says
    upstream, _ = ask(front, "session-0", "hello there")
    assert upstream == route(front, "X-Session-Id", "session-0")
    # 24 sessions per header: each always lands on one server, and together they use
    # both (ketama points depend on the servers' ports; 24 keys all on one side: 2^-23)
    with httpx.Client() as client:
        for header in ("X-Session-Id", "X-Claude-Code-Session-Id", "session-id",
                       "x-session-affinity"):
            routes = [{route(front, header, f"{header}-{i}", client) for _ in range(2)}
                      for i in range(24)]
            assert all(len(r) == 1 for r in routes), header
            assert len(set().union(*routes)) == 2, header


def test_streaming_passes_through(front: dict[str, Any]) -> None:
    with httpx.stream("POST", f"http://127.0.0.1:{front['nginx'].port}/v1/chat/completions",
                      timeout=120, headers={"X-Session-Id": "stream-1"},
                      json={"model": "default", "stream": True, "max_tokens": 4,
                            "messages": [{"role": "user", "content": "stream please"}]}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3


def test_a_moved_session_hits_redis_on_its_new_server(front: dict[str, Any]) -> None:
    servers: list[ServeProcess] = front["servers"]
    history = [{"role": "system", "content": "You are terse."}]
    upstream, body = ask(front, "moving", "tell me about shared caches " * 8, history=history)
    history += [{"role": "user", "content": "tell me about shared caches " * 8},
                {"role": "assistant", "content": body["choices"][0]["message"]["content"]}]
    home = next(s for s in servers if upstream.endswith(f":{s.port}"))
    other = next(s for s in servers if s is not home)
    home.wait_redis_written()
    before = other.stats()["hit_tokens_by_tier"].get("redis", 0)
    home.stop()  # the session's server goes away
    upstream2, body2 = ask(front, "moving", "and then?", history=history)
    assert upstream2.endswith(f":{other.port}")
    cached = body2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0  # the history came from Redis, not from a cold prefill
    assert other.stats()["hit_tokens_by_tier"].get("redis", 0) - before == cached
