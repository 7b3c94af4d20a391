"""`promptcache cache sessions --server`: list (sizes per tier, last use, expiry under
--session-ttl) and delete on a running server (tiny llama, SSD, an API key)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
from ops_server import KeyedServer
from server_proc import PROMPTCACHE, token_prompt


def test_sessions_list_and_delete_on_a_running_server(tiny_llama_path: Path,
                                                      tmp_path: Path) -> None:
    a, b = token_prompt(200, seed=21), token_prompt(150, seed=22)
    with KeyedServer(tiny_llama_path, tmp_path / "blocks", tmp_path / "s.log",
                     "--session-ttl", "1h", key="k") as srv:
        srv.complete(a, session="sess-a")
        srv.complete(b, session="sess-b")
        srv.wait_written()

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([PROMPTCACHE, "cache", "sessions", "--server", srv.base,
                                   "--api-key", "k", *args], capture_output=True, text=True,
                                  timeout=120)

        done = cli("--json")
        assert done.returncode == 0, done.stderr
        rows = {r["session_id"]: r for r in json.loads(done.stdout)["sessions"]}
        assert set(rows) == {"sess-a", "sess-b"}
        for sid, n in (("sess-a", 200), ("sess-b", 150)):
            r = rows[sid]
            assert r["tenant"] == "default" and r["blocks"] == (n + 3 + 63) // 64
            assert r["tiers"]["ram"]["bytes"] > 0 and r["tiers"]["ssd"]["bytes"] > 0
            assert r["expires_at"] == r["last_use"] + 3600
        assert "sess-a" in cli().stdout
        assert httpx.get(f"{srv.base}/v1/cache/sessions").status_code == 401
        done = cli("--delete", "sess-a")
        assert done.returncode == 0 and json.loads(done.stdout)["deleted_blocks"] > 0
        rows = json.loads(cli("--json").stdout)["sessions"]
        assert [r["session_id"] for r in rows] == ["sess-b"]
        cached = lambda r: r["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
        assert cached(srv.complete(a + [5], session="sess-a")) == 0
        assert cached(srv.complete(b + [5], session="sess-b")) == 150
