"""A chat template that loops, recurses or does not parse (issue 42): the startup test
render refuses it (``ChatTemplate.check``, ``Engine``, ``promptcache serve`` with a one-
line message); one that fails only for some messages answers those requests with a 500
naming the chat template (``server_error`` / ``api_error``, never the client's 400),
within the render's time limit, while other requests and endpoints go on answering;
SIGTERM ends a server whose preparation thread is stuck within 10 s."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from real_engine import tiny_engine
from serve_proc import PROMPTCACHE, wait_healthy

from harness.systems import free_port
from promptcache.engine.engine import Engine
from promptcache.engine.formats.templates import ChatTemplate
from promptcache.engine.models.loader import load_model
from promptcache.errors import TemplateRenderError
from promptcache.server import create_app
from promptcache.serving_config import ServerConfig

NESTED = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
RECURSIVE = "{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}"
BROKEN = "{% for m in messages %}{{ m.content }"
# loops only when the last message says "loop": passes the startup test render
LOOPS_ON_DEMAND = ("{% if messages[-1].content == 'loop' %}" + NESTED + "{% endif %}"
                   "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                   "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
LIMIT_S = 0.5
CHAT = {"model": "default", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
LOOP = {**CHAT, "messages": [{"role": "user", "content": "loop"}]}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path: Path) -> Any:
    return load_model(tiny_llama_path)[1]


@pytest.mark.parametrize("template,message", [
    (NESTED, f"the chat template did not finish rendering within {LIMIT_S:g} s (does it loop?)"),
    (RECURSIVE, "the chat template recursed past Python's limit (a recursive macro?)"),
    (BROKEN, "the chat template is not valid Jinja: unexpected '}'"),
])
def test_the_startup_render_refuses_a_template_that_loops_or_breaks(
        tokenizer: Any, template: str, message: str) -> None:
    original = tokenizer.chat_template
    ct = ChatTemplate(tokenizer, render_limit_s=LIMIT_S)
    ct.check()  # the model's own template renders
    tokenizer.chat_template = template
    try:
        t0 = time.monotonic()
        with pytest.raises(TemplateRenderError) as got:
            ct.check()
        assert str(got.value) == message
        assert time.monotonic() - t0 < LIMIT_S + 5  # secondary: bounded
    finally:
        tokenizer.chat_template = original
    assert ct.render([{"role": "user", "content": "Hi"}])  # a normal render still works


@pytest.fixture
def looping(tiny_llama_path: Path) -> Iterator[tuple[Engine, TestClient]]:
    engine = tiny_engine(tiny_llama_path, None)
    engine.templates.tokenizer.chat_template = LOOPS_ON_DEMAND
    engine.templates.render_limit_s = LIMIT_S
    try:
        yield engine, TestClient(create_app(engine, ServerConfig(prerender=False)))
    finally:
        engine.close()


def _ok(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = client.post("/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert client.get("/health").json()["status"] == "ok"


def test_a_template_that_loops_on_a_request_is_a_500_and_blocks_nothing(
        looping: tuple[Engine, TestClient]) -> None:
    _, client = looping
    _ok(client)
    message = ("cannot render the chat template: the chat template did not finish "
               f"rendering within {LIMIT_S:g} s (does it loop?)")
    r = client.post("/v1/chat/completions", json=LOOP)
    assert r.status_code == 500
    assert r.json() == {"error": {"message": message, "type": "server_error", "param": None,
                                  "code": "template_error"}}
    r = client.post("/v1/messages", json=LOOP)
    assert r.status_code == 500
    assert r.json() == {"type": "error", "error": {"type": "api_error", "message": message}}
    # while one request's render loops, the others answer (after at most its limit)
    statuses: list[int] = []
    stuck = threading.Thread(target=lambda: statuses.append(
        client.post("/v1/chat/completions", json=LOOP).status_code))
    stuck.start()
    t0 = time.monotonic()
    _ok(client)
    assert time.monotonic() - t0 < LIMIT_S + 10  # secondary: bounded by the limit
    stuck.join(timeout=30)
    assert statuses == [500]
    _ok(client)
    # each render past its limit counted in /metrics (chat, messages, the stuck one)
    assert _template_errors(client) == {"timeout": 3.0}


def _template_errors(client: TestClient) -> dict[str, float]:
    prefix = 'promptcache_template_render_errors_total{cause="'
    return {line.removeprefix(prefix).split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in client.get("/metrics").text.splitlines() if line.startswith(prefix)}


def test_a_template_syntax_error_per_request_is_a_500_not_a_400(
        looping: tuple[Engine, TestClient]) -> None:
    engine, client = looping
    engine.templates.tokenizer.chat_template = BROKEN  # (changed after the startup check)
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 500
    assert r.json()["error"] == {
        "message": "cannot render the chat template: the chat template is not valid Jinja: "
                   "unexpected '}'", "type": "server_error", "param": None,
        "code": "template_error"}
    engine.templates.tokenizer.chat_template = LOOPS_ON_DEMAND
    _ok(client)
    assert _template_errors(client) == {"syntax": 1.0}


def _serve(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "promptcache.cli", "serve", "--no-ssd",
                           "--port", str(free_port()), *args], capture_output=True, text=True,
                          timeout=timeout)


def test_serve_refuses_to_start_with_a_looping_or_broken_template(
        tiny_llama_path: Path, tmp_path: Path) -> None:
    looped = _serve(["--model", str(tiny_llama_path), "--chat-template", NESTED])
    assert looped.returncode == 2, looped.stderr
    assert looped.stderr.strip().splitlines()[-1] == (
        "promptcache: error: --chat-template: the chat template did not finish rendering "
        "within 5 s (does it loop?)")
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_path, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = RECURSIVE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    recursed = _serve(["--model", str(folder)])
    assert recursed.returncode == 2, recursed.stderr
    assert recursed.stderr.strip().splitlines()[-1] == (
        f"promptcache: error: the chat template of {folder}: the chat template recursed "
        "past Python's limit (a recursive macro?)")


def test_sigterm_ends_a_server_whose_preparation_thread_is_stuck(
        tiny_llama_path: Path, tmp_path: Path) -> None:
    """A real server whose template loops on one request, with a render limit far past
    the test (the preparation thread stays stuck): SIGTERM ends the process within 10 s
    (serve's exit watchdog, ``SHUTDOWN_LIMIT_S``); before it, other endpoints answered."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [PROMPTCACHE, "serve", "--port", str(port), "--model", str(tiny_llama_path),
             "--no-ssd", "--chat-template", LOOPS_ON_DEMAND, "--template-render-limit", "600"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, base, log_path, 90)
        r = httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        stuck = threading.Thread(target=lambda: _swallow(
            lambda: httpx.post(f"{base}/v1/chat/completions", json=LOOP, timeout=120)),
            daemon=True)
        stuck.start()
        time.sleep(1.0)  # the render has started looping
        assert httpx.get(f"{base}/health", timeout=10).json()["status"] == "ok"
        assert proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - t0
        assert took < 10, f"{took:.1f} s\n" + log_path.read_text(errors="replace")
        assert code == 0  # the engine was closed before the watchdog ended the process
        assert "exiting now (0)" in log_path.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _swallow(call: Any) -> None:
    try:
        call()
    except httpx.HTTPError:
        pass  # the server went away under it
