"""A small Chrome DevTools Protocol client: headless Debian Chromium driven over its
``--remote-debugging-port`` websocket (no playwright / selenium: nothing to download).

``Browser.start(tmp)`` launches ``chromium --headless`` with a throwaway profile on a
free port chosen by Chromium itself (``--remote-debugging-port=0``; the websocket URL is
read from its ``DevToolsActivePort`` file), ``browser.new_page()`` opens a tab, and a
``Page`` navigates, evaluates JavaScript, waits for a condition and takes screenshots.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class CDPError(RuntimeError):
    pass


class _Conn:
    def __init__(self, url: str) -> None:
        # entered as a context manager (websockets >= 17.1 wants that), closed in close()
        # no keepalive pings: on a loaded machine a ping Chromium answers late would close
        # the connection (the browser is local; a dead one ends the process anyway)
        self.ws: ClientConnection = connect(url, max_size=64 * 1024 * 1024, open_timeout=120,
                                            ping_interval=None).__enter__()
        self._ids = itertools.count(1)

    def call(self, method: str, timeout: float = 120.0, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CDPError(f"{method}: no answer within {timeout} s")
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


class Browser:
    def __init__(self, proc: subprocess.Popen[bytes], profile: Path, ws_url: str) -> None:
        self.proc = proc
        self.profile = profile
        self.conn = _Conn(ws_url)
        self._pages: list[_Conn] = []

    @classmethod
    def start(cls, tmp: Path, timeout: float = 180.0) -> Browser:
        exe = find_chromium()
        if exe is None:
            raise FileNotFoundError("chromium is not installed")
        profile = tmp / "chromium-profile"
        profile.mkdir(parents=True, exist_ok=True)
        log = open(tmp / "chromium.log", "ab")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--window-size=1280,1000", f"--user-data-dir={profile}",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             "about:blank"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"chromium exited ({proc.returncode}): "
                                   f"{(tmp / 'chromium.log').read_text(errors='replace')[-2000:]}")
            lines = port_file.read_text().split() if port_file.exists() else []
            if len(lines) >= 2:
                break
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait(10)
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.05)
        return cls(proc, profile, f"ws://127.0.0.1:{lines[0]}{lines[1]}")

    def new_page(self) -> Page:
        target = self.conn.call("Target.createTarget", url="about:blank")["targetId"]
        port = self.conn.ws.remote_address[1]
        page = _Conn(f"ws://127.0.0.1:{port}/devtools/page/{target}")
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
