"""A real ``promptcache serve`` subprocess for the durability tests (tiny model, SSD
tier in a temp folder): start, wait until it answers, send token-id prompts, read
stats, stop it cleanly (SIGTERM) or kill it (SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from harness.systems import free_port

PROMPTCACHE = str(Path(sys.executable).parent / "promptcache")
VOCAB = 1024  # the tiny models' vocabulary


def token_prompt(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids of the tiny vocabulary, distinct per ``seed``."""
    return [5 + (i * 7919 + seed * 104729) % (VOCAB - 10) for i in range(n)]


class Server:
    def __init__(self, model: Path, cache_dir: Path, log: Path, *args: str,
                 ready: bool = True, timeout: float = 120.0) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "ab")  # noqa: SIM115 - closed in wait()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [PROMPTCACHE, "serve", "--model", str(model), "--port", str(self.port),
             "--cache-dir", str(cache_dir), "--log-level", "info", *args,
             # the restore planner pinned: tests never depend on timing
             *([] if "--restore-plan" in args else ["--restore-plan", "load"])],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)
        if ready:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start:\n" + self.log()[-4000:])
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def complete(self, prompt: list[int], max_tokens: int = 4, timeout: float = 300.0,
                 tenant: str | None = None, **extra: Any) -> dict[str, Any]:
        headers = {"X-Tenant-Id": tenant} if tenant is not None else {}
        r = httpx.post(f"{self.base}/v1/completions", timeout=timeout, headers=headers, json={
            "model": "default", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, **extra})
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data

    def stats(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(f"{self.base}/v1/cache/stats", timeout=30).json()
        return data

    def wait_written(self, timeout: float = 120.0) -> dict[str, Any]:
        """Wait until no block waits for the SSD (none unwritten, none queued)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()["cache"]
            if s["unwritten_blocks"] == 0 and s["tiers"]["ssd"]["queue_depth"] == 0:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"blocks still unwritten after {timeout} s: {s}")
            time.sleep(0.05)

    def stop(self, timeout: float = 180.0) -> int:
        """A clean shutdown (SIGTERM): returns the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.wait(60)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.kill()
