"""One real ``promptcache serve`` subprocess for the end-to-end tests: start it on a
free loopback port, wait until ``/health`` answers, stop it by its PID (SIGTERM, then
SIGKILL) when the ``with`` block ends. Importable from every test folder (pytest puts
``tests/`` on ``sys.path`` for the top-level conftest)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from harness.systems import free_port

PROMPTCACHE = str(Path(sys.executable).parent / "promptcache")


def wait_healthy(proc: subprocess.Popen[bytes], base: str, log_path: Path,
                 timeout: float) -> None:
    """Poll ``/health`` until it answers 200; RuntimeError (with the server's log) if
    the process exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + log_path.read_text(errors="replace"))
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("server did not start:\n" + log_path.read_text(errors="replace"))
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM (a clean shutdown: queued writes are flushed), SIGKILL if it takes
    longer than ``timeout`` seconds; returns once the process is gone."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextmanager
def serve(args: Sequence[str], log_path: Path, *, timeout: float = 90.0,
          env: Mapping[str, str] | None = None, log_tail: int = 0) -> Iterator[str]:
    """``promptcache serve --port <free> *args`` with its output in ``log_path``;
    yields the base URL once healthy. On exit the server is stopped (``stop``) and the
    last ``log_tail`` characters of its log are printed (shown by pytest on failure)."""
    port = free_port()
    with open(log_path, "w") as log:
        # the restore planner pinned: tests never depend on timing
        plan = [] if "--restore-plan" in args else ["--restore-plan", "load"]
        proc = subprocess.Popen([PROMPTCACHE, "serve", "--port", str(port), *args, *plan],
                                stdout=log, stderr=subprocess.STDOUT,
                                env=None if env is None else dict(env))
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, log_path, timeout)
        yield base
    finally:
        stop(proc)
        if log_tail:
            print(log_path.read_text(errors="replace")[-log_tail:])
