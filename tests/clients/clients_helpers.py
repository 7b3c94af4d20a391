"""Running the real CLIs (Claude Code, Codex, OpenCode) against a local server.

The CLIs come from npm, pinned (``.ci/run`` installs them into ``CLIENTS_DIR``, default
``~/.cache/promptcache/clients``, overridable with ``PROMPTCACHE_CLIENTS_DIR``). Every
run gets its own HOME (and CODEX_HOME) in a temporary folder, telemetry and updates off,
the base URL on 127.0.0.1. ``scrub_record`` turns a recorded request (``promptcache serve
--log-requests``) into a fixture: no secrets, no machine paths.
"""

from __future__ import annotations

import json
import os
import re
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
            "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "dummy",
            "ANTHROPIC_MODEL": "default", "ANTHROPIC_SMALL_FAST_MODEL": "default",
            # a random model would otherwise be allowed 32000 tokens
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64"}


def codex_env(home: Path, base: str) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        'model = "default"\nmodel_provider = "promptcache"\nmodel_reasoning_effort = "low"\n'
        "[model_providers.promptcache]\n"
        f'name = "promptcache"\nbase_url = "{base}/v1"\nwire_api = "responses"\n'
        'env_key = "PROMPTCACHE_API_KEY"\n[analytics]\nenabled = false\n')
    return {"HOME": str(home), "CODEX_HOME": str(home), "PROMPTCACHE_API_KEY": "unused"}


def opencode_env(home: Path, work: Path, base: str, window: int) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    config = {"provider": {"promptcache": {
        "npm": "@ai-sdk/openai-compatible", "name": "promptcache",
        "options": {"baseURL": f"{base}/v1", "apiKey": "unused"},
        "models": {"default": {"name": "default",
                               "limit": {"context": window, "output": 512}}}}},
        "model": "promptcache/default", "small_model": "promptcache/default",
        "autoupdate": False, "share": "disabled"}
    (work / "opencode.json").write_text(json.dumps(config))
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
