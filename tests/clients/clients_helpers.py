"""Running the real CLIs (Claude Code, Codex, OpenCode) against a local server.

The CLIs come from npm, pinned (``.ci/run`` installs them into ``CLIENTS_DIR``, default
``~/.cache/promptcache/clients``, overridable with ``PROMPTCACHE_CLIENTS_DIR``). Every
run gets its own HOME (and CODEX_HOME) in a temporary folder, telemetry and updates off,
the base URL on 127.0.0.1. ``scrub_record`` turns a recorded request (``promptcache serve
--log-requests``) into a fixture: no secrets, no machine paths.

The configs and exports are the documented ones (``docs/clients/``, shown in README.md
and docs/api.md, kept equal by ``tests/server/test_client_docs.py``), written for a test
server by ``localize``: the one substitution of the documented base URL and window.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PINS = {"claude": ("@anthropic-ai/claude-code", "2.1.197"),
        "codex": ("@openai/codex", "0.171.0"),
        "opencode": ("opencode-ai", "1.18.33")}
CLIENTS_DIR = Path(os.environ.get("PROMPTCACHE_CLIENTS_DIR")
                   or Path.home() / ".cache" / "promptcache" / "clients")
CLI_TIMEOUT_S = 600

DOCS_CLIENTS = Path(__file__).resolve().parents[2] / "docs" / "clients"
DOC_BASE = "http://127.0.0.1:8080"  # `make serve`
DOC_WINDOW = 32768  # the default model's window


def documented(name: str) -> str:
    """A documented config or export block: ``docs/clients/<name>``."""
    return (DOCS_CLIENTS / name).read_text()


def localize(text: str, base: str, window: int = DOC_WINDOW) -> str:
    """A documented block for a server at ``base`` (``http://HOST:PORT``) with a window of
    ``window`` tokens: the documented base URL and window replaced, nothing else."""
    return text.replace(DOC_BASE, base).replace(str(DOC_WINDOW), str(window))


def exports(text: str) -> dict[str, str]:
    """The variables of a block's ``export K=V ...`` lines."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["export"]:
            for word in words[1:]:
                name, _, value = word.partition("=")
                out[name] = value
    return out


def documented_env(base: str, prefix: str) -> dict[str, str]:
    """The documented exports (``env.sh``) whose names start with ``prefix``, for ``base``."""
    return {k: v for k, v in exports(localize(documented("env.sh"), base)).items()
            if k.startswith(prefix)}


def cli_path(name: str) -> Path | None:
    """The installed CLI, if its pinned version is there."""
    package, version = PINS[name]
    manifest = CLIENTS_DIR / "node_modules" / package / "package.json"
    exe = CLIENTS_DIR / "node_modules" / ".bin" / name
    if not exe.exists() or not manifest.is_file():
        return None
    if json.loads(manifest.read_text()).get("version") != version:
        return None
    return exe


def missing_message(name: str) -> str:
    package, version = PINS[name]
    return (f"{package}@{version} is not installed under {CLIENTS_DIR} (.ci/run installs it: "
            f"npm install --prefix {CLIENTS_DIR} {package}@{version}; it skips this test "
            "only when npm is unreachable)")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    def check(self) -> Run:
        if self.returncode != 0:
            raise AssertionError(f"exit {self.returncode}\nstdout:\n{self.stdout[-4000:]}\n"
                                 f"stderr:\n{self.stderr[-4000:]}")
        return self


def run_cli(argv: list[str], cwd: Path, env: dict[str, str]) -> Run:
    full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
                "TERM": "dumb", "NO_COLOR": "1", **env}
    proc = subprocess.run(argv, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False)
    return Run(proc.returncode, proc.stdout, proc.stderr)


def claude_env(home: Path, base: str) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    (home / ".claude.json").write_text(json.dumps({"hasCompletedOnboarding": True}))
    return {"HOME": str(home), "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1", "DISABLE_BUG_COMMAND": "1",
            **documented_env(base, "ANTHROPIC_"), **documented_env(base, "CLAUDE_"),
            # a random model would otherwise be allowed 32000 tokens
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64"}


def codex_env(home: Path, base: str) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(localize(documented("codex.toml"), base))
    return {"HOME": str(home), "CODEX_HOME": str(home), **documented_env(base, "PROMPTCACHE_")}


def opencode_env(home: Path, work: Path, base: str, window: int) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    (work / "opencode.json").write_text(localize(documented("opencode.json"), base, window))
    return {"HOME": str(home), "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1"}


def json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


# --- fixtures from recorded traffic ----------------------------------------------------

# headers that identify this machine or run, or change with the body
_DROP_HEADERS = {"host", "content-length", "x-codex-turn-metadata"}
_HEX_ID = re.compile(r'(\\?"(?:device_id|installation_id)\\?"\s*:\s*\\?")[0-9a-f-]{16,}')


def scrub_text(text: str, paths: dict[str, str]) -> str:
    """Machine paths -> neutral ones (longest first), device / installation ids -> zeros."""
    for real, fake in sorted(paths.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(real, fake)
    return _HEX_ID.sub(lambda m: m.group(1) + "0" * 16, text)


def scrub_record(record: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    headers = {k: v for k, v in record.get("headers", {}).items()
               if k.lower() not in _DROP_HEADERS}
    out = {"method": record["method"], "path": record["path"], "query": record["query"],
           "headers": headers, "body": record["body"], "status": record["status"]}
    return dict(json.loads(scrub_text(json.dumps(out, ensure_ascii=False), paths)))
