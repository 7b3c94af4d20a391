"""The documented client configs are the ones the real-client tests run, and they work.

``docs/clients/`` holds the one copy of each block (the exports, Codex's config.toml,
OpenCode's opencode.json); README.md and docs/api.md show them after a
``<!-- docs/clients/NAME -->`` line, and ``clients_helpers`` writes them for a test server
through ``localize`` (the documented base URL and window replaced, nothing else). No Node:
the Python SDKs run the exports against a real ``promptcache serve``, whose last startup
lines are checked on the way.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from clients_helpers import (
    DOC_BASE,
    DOC_WINDOW,
    DOCS_CLIENTS,
    claude_env,
    codex_env,
    documented,
    exports,
    localize,
    opencode_env,
)
from models.tiny_models import SCRIPTED_REPLY, ensure_tiny_model

from promptcache.cli.serve_cmd import client_lines
from promptcache.engine.models.gguf import DEFAULT_CONTEXT_LENGTH
from promptcache.server.replies.runner import BASE_ALIASES

REPO = Path(__file__).resolve().parents[2]
MARKED = re.compile(r"^<!-- docs/clients/([\w.-]+) -->\n```\w+\n(.*?)^```$", re.M | re.S)
TEST_BASE = "http://127.0.0.1:9"


def shown(doc: str) -> dict[str, list[str]]:
    """The marked blocks of a markdown file: file name -> the blocks' texts."""
    out: dict[str, list[str]] = {}
    for name, text in MARKED.findall((REPO / doc).read_text()):
        out.setdefault(name, []).append(text)
    return out


def test_the_documented_blocks_are_the_files() -> None:
    files = sorted(p.name for p in DOCS_CLIENTS.iterdir())
    assert files == ["codex.toml", "env.sh", "opencode.json"]
    readme, api = shown("README.md"), shown("docs/api.md")
    assert sorted(readme) == ["env.sh"] and sorted(api) == files
    for blocks in (readme, api):
        for name, texts in blocks.items():
            assert texts == [documented(name)], name


def test_the_blocks_point_at_make_serve_and_a_served_name() -> None:
    makefile = (REPO / "Makefile").read_text()
    host = re.search(r"^HOST \?= (\S+)$", makefile, re.M)
    port = re.search(r"^PORT \?= (\S+)$", makefile, re.M)
    assert host and port and DOC_BASE == f"http://{host[1]}:{port[1]}"
    assert DOC_WINDOW == DEFAULT_CONTEXT_LENGTH
    env = exports(documented("env.sh"))
    assert env == {
        "OPENAI_BASE_URL": f"{DOC_BASE}/v1", "OPENAI_API_KEY": "unused",
        "ANTHROPIC_BASE_URL": DOC_BASE, "ANTHROPIC_API_KEY": "unused",
        "ANTHROPIC_MODEL": "default", "ANTHROPIC_SMALL_FAST_MODEL": "default",
        # Claude Code drops a stream with no content for 5 minutes (its minimum) and
        # retries: a first prefill of its ~20K-token prompt takes longer on a small CPU
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000",
        "PROMPTCACHE_API_KEY": "unused"}
    codex = tomllib.loads(documented("codex.toml"))
    provider = codex["model_providers"][codex["model_provider"]]
    assert provider == {"name": "promptcache", "base_url": f"{DOC_BASE}/v1",
                        "wire_api": "responses", "env_key": "PROMPTCACHE_API_KEY",
                        "stream_idle_timeout_ms": 1800000}
    assert provider["env_key"] in env
    opencode = json.loads(documented("opencode.json"))
    provider_id, model = opencode["model"].split("/")
    assert opencode["provider"][provider_id]["options"]["baseURL"] == f"{DOC_BASE}/v1"
    assert opencode["provider"][provider_id]["models"][model]["limit"]["context"] == DOC_WINDOW
    # every model name in the blocks is one any server answers to
    names = {codex["model"], model, opencode["small_model"].split("/")[1],
             env["ANTHROPIC_MODEL"], env["ANTHROPIC_SMALL_FAST_MODEL"]}
    assert names == {"default"} and "default" in BASE_ALIASES


def test_the_real_client_tests_write_the_documented_blocks(tmp_path: Path) -> None:
    env = exports(localize(documented("env.sh"), TEST_BASE))
    claude = claude_env(tmp_path / "claude", TEST_BASE)
    assert {k: v for k, v in claude.items() if k.startswith("ANTHROPIC_")} == {
        k: v for k, v in env.items() if k.startswith("ANTHROPIC_")}
    assert claude["ANTHROPIC_BASE_URL"] == TEST_BASE
    codex = codex_env(tmp_path / "codex", TEST_BASE)
    assert codex["PROMPTCACHE_API_KEY"] == env["PROMPTCACHE_API_KEY"]
    assert (tmp_path / "codex" / "config.toml").read_text() == \
        documented("codex.toml").replace(DOC_BASE, TEST_BASE)
    work = tmp_path / "work"
    work.mkdir()
    opencode_env(tmp_path / "home", work, TEST_BASE, 131072)
    assert (work / "opencode.json").read_text() == \
        documented("opencode.json").replace(DOC_BASE, TEST_BASE).replace('"context": 32768',
                                                                         '"context": 131072')


def test_serve_client_lines() -> None:
    assert client_lines("127.0.0.1", 8080, ["SmolLM2-135M-Instruct", "default", "promptcache"]) == [
        "promptcache: OpenAI clients (OPENAI_BASE_URL): http://127.0.0.1:8080/v1",
        "promptcache: Anthropic clients (ANTHROPIC_BASE_URL): http://127.0.0.1:8080",
        "promptcache: model names: SmolLM2-135M-Instruct, default, promptcache",
        "promptcache: dashboard: http://127.0.0.1:8080/dashboard",
    ]
    assert client_lines("::1", 9000, ["m"])[0] == \
        "promptcache: OpenAI clients (OPENAI_BASE_URL): http://[::1]:9000/v1"


@pytest.fixture(scope="module")
def served(models_root: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, str, str]]:
    """``promptcache serve`` on the scripted tiny model: (base URL, its log so far, the
    model id)."""
    from serve_proc import serve

    model = ensure_tiny_model("scripted", models_root)
    log = tmp_path_factory.mktemp("docs") / "server.log"
    with serve(["--model", str(model), "--no-ssd", "--model-alias", "alias-x",
                "--log-level", "warning"], log, timeout=120) as base:
        yield base, log.read_text(), model.name


def test_serve_ends_with_what_a_client_needs(served: tuple[str, str, str]) -> None:
    base, log, model_id = served
    port = int(base.rsplit(":", 1)[1])
    lines = log.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("promptcache: serving "))
    assert lines[at + 1:at + 5] == client_lines(
        "127.0.0.1", port, [model_id, "alias-x", "default", "promptcache"])


def test_the_sdks_work_from_the_documented_exports(served: tuple[str, str, str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Constructed with no arguments, the SDKs read the exported variables; the model
    name is the documented one. Without ANTHROPIC_API_KEY the Anthropic SDK sends
    nothing (the reason the export carries one)."""
    import anthropic
    import openai

    from harness.systems import free_port

    base = served[0]
    for name in [k for k in os.environ if k.startswith(("OPENAI_", "ANTHROPIC_"))]:
        monkeypatch.delenv(name)
    env = exports(localize(documented("env.sh"), base))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    model = env["ANTHROPIC_MODEL"]
    chat = openai.OpenAI().chat.completions.create(
        model=model, max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == SCRIPTED_REPLY
    message = anthropic.Anthropic().messages.create(
        model=model, max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    assert [b.text for b in message.content if b.type == "text"] == [SCRIPTED_REPLY]
    monkeypatch.delenv("ANTHROPIC_API_KEY")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", f"http://127.0.0.1:{free_port()}")  # nothing there
    with pytest.raises(TypeError, match="authentication"):
        anthropic.Anthropic().messages.create(
            model=model, max_tokens=64, messages=[{"role": "user", "content": "hi"}])
