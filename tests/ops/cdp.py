"""A small Chrome DevTools Protocol client: headless Debian Chromium driven over its
``--remote-debugging-port`` websocket (no playwright / selenium: nothing to download).

``Browser.start(tmp)`` launches ``chromium --headless`` with a throwaway profile on a
free port chosen by Chromium itself (``--remote-debugging-port=0``; the port is read from
its ``DevToolsActivePort`` file, the browser websocket URL from ``/json/version``),
``browser.new_page()`` opens a tab, and a ``Page`` navigates, evaluates JavaScript, waits
for a condition and takes screenshots.

Chromium runs without ``LD_PRELOAD``: the Makefile preloads the pthread OpenBLAS for mlx,
and inherited by Chromium that library starts its thread pool in every Chromium process
(zygote, GPU process); a forked child then hangs ("Did not receive ping from zygote
child"), the GPU process cannot launch ("GPU process isn't usable. Goodbye.") and the
browser exits under the test, which saw only a DevTools websocket closed without a close
frame. A browser that dies is reported as ``BrowserDied`` with its exit status and log.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

# chromium's own noise on a box without D-Bus, GPU or cpufreq: left out of failure messages
_NOISE = ("dbus/", "cpufreq", "unexpected operator")


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class CDPError(RuntimeError):
    """A CDP command answered with an error (or not within its deadline)."""


class BrowserDied(RuntimeError):
    """The DevTools connection closed under a command: the message carries Chromium's exit
    status and the end of its log. Not a ``CDPError``: ``Page.wait_for`` never waits it out."""


class _Conn:
    def __init__(self, url: str, diagnose: Callable[[], str]) -> None:
        # entered as a context manager (websockets >= 17.1 wants that), closed in close()
        # no keepalive pings: on a loaded machine a ping Chromium answers late would close
        # the connection (the browser is local; a dead one ends the process anyway);
        # max_size well above a full-page screenshot (the default 1 MiB closes with 1009)
        self.diagnose = diagnose
        self.ws: ClientConnection = connect(url, max_size=64 * 1024 * 1024, open_timeout=120,
                                            ping_interval=None).__enter__()
        self._ids = itertools.count(1)

    def call(self, method: str, timeout: float = 120.0, **params: Any) -> dict[str, Any]:
        try:
            return self._call(method, timeout, params)
        except ConnectionClosed as e:
            raise BrowserDied(f"{method}: DevTools connection closed ({e}); "
                              f"{self.diagnose()}") from e

    def _call(self, method: str, timeout: float, params: dict[str, Any]) -> dict[str, Any]:
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CDPError(f"{method}: no answer within {timeout} s; {self.diagnose()}")
            msg = json.loads(self.ws.recv(timeout=left))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise CDPError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result

    def close(self) -> None:
        self.ws.close()


class Page:
    def __init__(self, conn: _Conn) -> None:
        self.conn = conn
        conn.call("Page.enable")
        conn.call("Runtime.enable")

    def navigate(self, url: str) -> None:
        self.conn.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        r = self.conn.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in r:
            raise CDPError(f"{expression!r}: {r['exceptionDetails']}")
        return r.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 180.0) -> Any:
        """Evaluate ``expression`` until it is truthy (returns that value); a condition
        wait with a deadline, not a sleep standing in for synchronisation."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = self.evaluate(expression)
            except CDPError as e:  # the page may still be loading
                last = e
            if last and not isinstance(last, CDPError):
                return last
            time.sleep(0.05)
        raise AssertionError(f"page condition {expression!r} not met within {timeout} s "
                             f"(last: {last!r})")

    def screenshot(self, path: Path) -> Path:
        r = self.conn.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(r["data"]))
        return path


def _version(port: int) -> dict[str, Any] | None:
    """``/json/version`` of a just-started browser, None while it does not answer yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/version", timeout=10) as r:
            info: dict[str, Any] = json.load(r)
            return info
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


class Browser:
    def __init__(self, proc: subprocess.Popen[bytes], profile: Path, log: Path, port: int,
                 ws_url: str) -> None:
        self.proc = proc
        self.profile = profile
        self.log = log
        self.port = port
        self.conn = _Conn(ws_url, self.diagnose)
        self._pages: list[_Conn] = []

    def diagnose(self) -> str:
        """Chromium's state for a failure message: running or its exit status, and the
        last meaningful lines of its log."""
        try:  # a browser that closed its socket is usually exiting: give it a moment
            code: int | None = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        state = "chromium still running" if code is None else f"chromium exited ({code})"
        return f"{state}; its log ends:\n{_log_tail(self.log)}"

    @classmethod
    def start(cls, tmp: Path, timeout: float = 180.0) -> Browser:
        exe = find_chromium()
        if exe is None:
            raise FileNotFoundError("chromium is not installed")
        profile = tmp / "chromium-profile"
        profile.mkdir(parents=True, exist_ok=True)
        log_path = tmp / "chromium.log"
        log = open(log_path, "ab")  # noqa: SIM115 - owned by the process
        # root (CI containers) needs --no-sandbox; no LD_PRELOAD (see the module docstring)
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--window-size=1280,1000", f"--user-data-dir={profile}",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             "about:blank"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        log.close()
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        info: dict[str, Any] | None = None
        port = 0
        # wait (a condition with a deadline) for the port file, then for /json/version to
        # answer: only then is the browser ready for a websocket
        while info is None:
            if proc.poll() is not None:
                raise BrowserDied(f"chromium exited ({proc.returncode}) before DevTools "
                                  f"answered; its log ends:\n{_log_tail(log_path)}")
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait(10)
                raise BrowserDied(f"chromium did not answer on its DevTools port within "
                                  f"{timeout} s; its log ends:\n{_log_tail(log_path)}")
            lines = port_file.read_text().split() if port_file.exists() else []
            if len(lines) >= 2 and lines[0].isdigit():
                port = int(lines[0])
                info = _version(port)
            if info is None:
                time.sleep(0.05)
        try:
            return cls(proc, profile, log_path, port, str(info["webSocketDebuggerUrl"]))
        except BaseException:
            proc.kill()
            proc.wait(10)
            raise

    def new_page(self) -> Page:
        target = self.conn.call("Target.createTarget", url="about:blank")["targetId"]
        page = _Conn(f"ws://127.0.0.1:{self.port}/devtools/page/{target}", self.diagnose)
        self._pages.append(page)
        return Page(page)

    def close(self) -> None:
        for p in self._pages:
            try:
                p.close()
            except Exception:
                pass
        try:
            self.conn.call("Browser.close", timeout=10)
        except Exception:
            pass
        self.conn.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    kept = [ln for ln in text.splitlines() if ln.strip() and not any(n in ln for n in _NOISE)]
    return "\n".join(kept[-lines:]) or "(nothing but D-Bus / cpufreq noise)"
