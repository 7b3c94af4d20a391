"""A real ``promptcache serve`` with an API key (``server_proc.Server`` + auth headers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from server_proc import Server


class KeyedServer(Server):
    def __init__(self, model: Path, cache_dir: Path, log: Path, *args: str,
                 key: str | None = None, **kw: Any) -> None:
        self.key = key
        extra = ("--api-key", key) if key else ()
        super().__init__(model, cache_dir, log, *extra, *args, **kw)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def complete(self, prompt: list[int], max_tokens: int = 4, timeout: float = 300.0,
                 tenant: str | None = None, session: str | None = None,
                 **extra: Any) -> dict[str, Any]:
        headers = dict(self.headers)
        if tenant is not None:
            headers["X-Tenant-Id"] = tenant
        if session is not None:
            headers["X-Session-Id"] = session
        r = httpx.post(f"{self.base}/v1/completions", timeout=timeout, headers=headers, json={
            "model": "default", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, **extra})
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(f"{self.base}{path}", headers=self.headers, timeout=60, **kw)

    def stats(self) -> dict[str, Any]:
        r = self.get("/v1/cache/stats")
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data
