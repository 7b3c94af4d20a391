"""The real CLIs against a real `promptcache serve`, two turns each.

One server subprocess (the "scripted" tiny model: a 128K window that fits Claude Code's
~44K-token prompts, and a fixed short reply that ends with EOS) serves Claude Code
(``claude -p`` then ``--continue``), Codex (``codex exec`` then ``exec resume --last``)
and OpenCode (``opencode run`` then ``--continue``). Each test asserts exit 0, the reply,
that the server recorded the client's own session header, and that the second turn read
>= 90% of its prompt from the cache (the numbers the client itself reports, printed).

The requests are recorded (``--log-requests``); with ``PROMPTCACHE_RECORD_FIXTURES=1``
the run also rewrites the scrubbed fixtures in ``tests/fixtures/traffic/<client>/``
that the Node-free replay tests use. Skipped with a clear message when a pinned CLI is
not installed (``.ci/run`` installs them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from clients_helpers import (
    claude_env,
    cli_path,
    codex_env,
    json_lines,
    missing_message,
    opencode_env,
    run_cli,
    scrub_record,
)
from models.tiny_models import LONG_CONTEXT_LENGTH, SCRIPTED_REPLY
from serve_proc import serve

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "traffic"
MIN_HIT = 0.9


@dataclass
class Server:
    base: str
    requests: Path  # --log-requests folder
    log: Path
    tmp: Path

    def records(self, since: int = 0) -> list[dict[str, Any]]:
        out = []
        for p in sorted(self.requests.glob("*.json")):
            rec = json.loads(p.read_text())
            if rec["seq"] > since:
                out.append(rec)
        return out

    def last_seq(self) -> int:
        recs = self.records()
        return recs[-1]["seq"] if recs else 0


@pytest.fixture(scope="module")
def server(models_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from models.tiny_models import ensure_tiny_model

    model = ensure_tiny_model("scripted", models_root)
    tmp = tmp_path_factory.mktemp("clients")
    log_path = tmp / "server.log"
    env = dict(os.environ)
    openblas = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
    if os.path.exists(openblas) and "LD_PRELOAD" not in env:  # speed only
        env["LD_PRELOAD"] = openblas
    with serve(["--model", str(model), "--block-size", "64", "--no-ssd",
                "--log-requests", str(tmp / "requests"), "--default-max-tokens", "64",
                "--log-level", "info"], log_path, timeout=120, env=env, log_tail=4000) as base:
        yield Server(base, tmp / "requests", log_path, tmp)


def _cli(name: str) -> str:
    exe = cli_path(name)
    if exe is None:
        pytest.skip(missing_message(name))
    return str(exe)


def _save_fixtures(server: Server, client: str, since: int, paths: dict[str, str]) -> None:
    """With PROMPTCACHE_RECORD_FIXTURES=1: the client's requests, scrubbed, as fixtures."""
    if os.environ.get("PROMPTCACHE_RECORD_FIXTURES") != "1":
        return
    out = FIXTURES / client
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    paths = {**paths, str(server.tmp): "/tmp/promptcache-test", str(Path.home()): "/home/user"}
    # Claude Code names a project folder after its path: /a/b_c -> -a-b-c
    paths.update({re.sub(r"[^A-Za-z0-9]", "-", real): re.sub(r"[^A-Za-z0-9]", "-", fake)
                  for real, fake in paths.items()})
    for i, rec in enumerate(r for r in server.records(since) if r["method"] == "POST"):
        name = f"{i + 1:02d}-{rec['path'].strip('/').replace('/', '_')}.json"
        (out / name).write_text(json.dumps(scrub_record(rec, paths), indent=1,
                                           ensure_ascii=False) + "\n")


def _sessions(records: list[dict[str, Any]], header: str) -> set[str]:
    return {r["headers"][header] for r in records
            if r["method"] == "POST" and header in r["headers"]}


def _logged_sources(server: Server) -> str:
    return server.log.read_text()


def test_claude_code_two_turns(server: Server, tmp_path: Path) -> None:
    exe = _cli("claude")
    work, home = tmp_path / "project", tmp_path / "home"
    work.mkdir()
    env = claude_env(home, server.base)
    since = server.last_seq()
    r1 = run_cli([exe, "-p", "say hi", "--output-format", "json"], work, env).check()
    one = json.loads(r1.stdout)
    assert one["is_error"] is False and one["result"] == SCRIPTED_REPLY
    r2 = run_cli([exe, "-p", "--continue", "and now?", "--output-format", "json"], work,
                 env).check()
    two = json.loads(r2.stdout)
    assert two["is_error"] is False and two["result"] == SCRIPTED_REPLY
    assert two["session_id"] == one["session_id"]
    u = two["usage"]
    prompt = u["input_tokens"] + u["cache_creation_input_tokens"] + u["cache_read_input_tokens"]
    hit = u["cache_read_input_tokens"] / prompt
    print(f"claude code turn 2: {u['cache_read_input_tokens']} of {prompt} prompt tokens "
          f"from the cache ({hit:.1%})")
    assert hit >= MIN_HIT
    records = server.records(since)
    assert _sessions(records, "x-claude-code-session-id") == {one["session_id"]}
    assert all(r["status"] == 200 for r in records), [(r["path"], r["status"]) for r in records]
    assert f"session={one['session_id']} (x-claude-code-session-id)" in _logged_sources(server)
    _save_fixtures(server, "claude_code", since, {str(work): "/home/user/project",
                                                  str(home): "/home/user"})


def test_codex_two_turns(server: Server, tmp_path: Path) -> None:
    exe = _cli("codex")
    work, home = tmp_path / "project", tmp_path / "codex-home"
    work.mkdir()
    env = codex_env(home, server.base)
    since = server.last_seq()
    base_argv = [exe, "exec", "--json", "--skip-git-repo-check"]
    r1 = run_cli(base_argv + ["say hi"], work, env).check()
    r2 = run_cli(base_argv + ["resume", "--last", "and now?"], work, env).check()
    usage = []
    for run in (r1, r2):
        events = json_lines(run.stdout)
        replies = [e["item"]["text"] for e in events if e.get("type") == "item.completed"
                   and e["item"].get("type") == "agent_message"]
        assert replies == [SCRIPTED_REPLY], run.stdout[-2000:]
        usage.append(next(e["usage"] for e in events if e.get("type") == "turn.completed"))
    # Codex reports the session's running totals: turn 2 is the difference
    prompt = usage[1]["input_tokens"] - usage[0]["input_tokens"]
    cached = usage[1]["cached_input_tokens"] - usage[0]["cached_input_tokens"]
    print(f"codex turn 2: {cached} of {prompt} prompt tokens from the cache "
          f"({cached / prompt:.1%})")
    assert cached / prompt >= MIN_HIT
    records = server.records(since)
    sessions = _sessions(records, "session-id")
    assert len(sessions) == 1
    assert {r["body"]["prompt_cache_key"] for r in records if r["method"] == "POST"} == sessions
    assert all(r["status"] == 200 for r in records)
    assert f"session={sessions.pop()} (session-id)" in _logged_sources(server)
    _save_fixtures(server, "codex", since, {str(work): "/home/user/project",
                                            str(home): "/home/user/.codex"})


def test_opencode_two_turns(server: Server, tmp_path: Path) -> None:
    exe = _cli("opencode")
    work, home = tmp_path / "project", tmp_path / "home"
    work.mkdir()
    env = opencode_env(home, work, server.base, LONG_CONTEXT_LENGTH)
    since = server.last_seq()
    r1 = run_cli([exe, "run", "--format", "json", "say hi"], work, env).check()
    mid = server.last_seq()
    r2 = run_cli([exe, "run", "--continue", "--format", "json", "and now?"], work,
                 env).check()
    for run in (r1, r2):
        texts = [e["part"]["text"] for e in json_lines(run.stdout) if e.get("type") == "text"]
        assert texts == [SCRIPTED_REPLY], run.stdout[-2000:]
    steps = [e["part"]["tokens"] for e in json_lines(r2.stdout) if e.get("type") == "step_finish"]
    tokens = steps[-1]
    prompt = tokens["input"] + tokens["cache"]["read"] + tokens["cache"]["write"]
    hit = tokens["cache"]["read"] / prompt
    print(f"opencode turn 2: {tokens['cache']['read']} of {prompt} prompt tokens from the "
          f"cache ({hit:.1%})")
    assert hit >= MIN_HIT
    records = server.records(since)
    sessions = _sessions(records, "x-session-id")
    assert len(sessions) == 1
    assert all(r["status"] == 200 for r in records)
    # turn 2 sent only the agent request (the title was made in turn 1)
    assert [r["path"] for r in server.records(mid) if r["method"] == "POST"] == \
        ["/v1/chat/completions"]
    assert f"session={sessions.pop()} (x-session-id)" in _logged_sources(server)
    _save_fixtures(server, "opencode", since, {str(work): "/home/user/project",
                                               str(home): "/home/user"})
