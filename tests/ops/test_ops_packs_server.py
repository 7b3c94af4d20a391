"""Cache packs end to end with real servers (tiny llama, SSD): export a conversation,
wipe, import, and the next turn hits all of it: through the admin endpoints and
through ``promptcache cache export / import``; damaged or foreign packs are refused
with a clear message and import nothing."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil  # type: ignore[import-untyped]
from ops_server import KeyedServer
from server_proc import PROMPTCACHE, token_prompt

P = token_prompt(300, seed=11)
Q = token_prompt(40, seed=12)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMPTCACHE, "cache", *args], capture_output=True, text=True,
                          timeout=600)


def _cached(r: dict) -> int:  # type: ignore[type-arg]
    return int(r["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_pack_round_trip_through_the_server_and_the_cli(tiny_llama_path: Path,
                                                         tiny_gemma_path: Path,
                                                         tmp_path: Path) -> None:
    folder = tmp_path / "blocks"
    with KeyedServer(tiny_llama_path, folder, tmp_path / "a.log", key="k") as srv:
        assert _cached(srv.complete(P, session="conv-1")) == 0
        r = httpx.post(f"{srv.base}/v1/cache/export", headers=srv.headers,
                       json={"tokens": P}, timeout=120)
        assert r.status_code == 200, r.text
        pack = r.content
        assert r.headers["X-Promptcache-Tokens"] == "303"  # the prompt + 3 of 4 generated tokens
        wiped = httpx.delete(f"{srv.base}/v1/cache", headers=srv.headers, timeout=60).json()
        assert wiped["deleted_blocks"] > 0
        s = srv.wait_written()
        assert (s["ram_blocks"], s["tiers"]["ssd"]["blocks_on_disk"]) == (0, 0)
        # one flipped byte in a block file: refused, nothing imported
        bad = bytearray(pack)
        bad[len(pack) // 2] ^= 0x20
        r = httpx.post(f"{srv.base}/v1/cache/import", headers=srv.headers,
                       content=bytes(bad), timeout=120)
        assert r.status_code == 400 and "refusing the pack" in r.json()["error"]["message"]
        s = srv.wait_written()
        assert (s["ram_blocks"], s["tiers"]["ssd"]["blocks_on_disk"]) == (0, 0)
        # another tenant's scope may not take it
        r = httpx.post(f"{srv.base}/v1/cache/import", content=pack, timeout=120,
                       headers={**srv.headers, "X-Tenant-Id": "other"})
        assert r.status_code == 400 and "belongs to tenant 'default'" in r.text
        r = httpx.post(f"{srv.base}/v1/cache/import", headers=srv.headers, content=pack,
                       timeout=120)
        assert r.status_code == 200, r.text
        assert r.json() == {"blocks": 5, "added": 5, "tokens": 303, "tenant": "default"}
        turn2 = srv.complete(P + Q, session="conv-1")
        assert _cached(turn2) == len(P)  # all of the exported conversation
        assert srv.stop() == 0  # a clean shutdown persists every block to the SSD

    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps({"tokens": P + Q}))
    out = tmp_path / "conv.pcpack"
    done = _cli("export", "--conversation", str(conv), "-o", str(out), "--model",
                str(tiny_llama_path), "--cache-dir", str(folder))
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["tokens"] >= len(P + Q) and summary["tenant"] == "default"
    assert done.stderr.count("\r") == 0  # no progress bars off a terminal

    fresh = tmp_path / "fresh"  # does not exist yet: import creates it, as serve does
    # damaged, or another model's namespace: refused, nothing imported
    raw = out.read_bytes()
    (tmp_path / "bad.pcpack").write_bytes(raw[:1000] + bytes([raw[1000] ^ 1]) + raw[1001:])
    done = _cli("import", str(tmp_path / "bad.pcpack"), "--model", str(tiny_llama_path),
                "--cache-dir", str(fresh))
    assert done.returncode == 2 and "refusing the pack" in done.stderr
    assert not fresh.exists()  # a damaged pack is refused before anything is touched
    done = _cli("import", str(out), "--model", str(tiny_gemma_path), "--cache-dir", str(fresh),
                "--block-size", "16")
    assert done.returncode == 2 and "refusing the pack" in done.stderr
    done = _cli("import", str(out), "--model", str(tiny_gemma_path), "--cache-dir", str(fresh))
    assert done.returncode == 2 and "another model" in done.stderr
    stats = json.loads(_cli("stats", "--cache-dir", str(fresh)).stdout)
    assert stats["blocks"] == 0
    done = _cli("import", str(out), "--model", str(tiny_llama_path), "--cache-dir", str(fresh))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["blocks"] == report["added"] == summary["blocks"]

    with KeyedServer(tiny_llama_path, fresh, tmp_path / "b.log") as srv:
        turn3 = srv.complete(P + Q + token_prompt(20, seed=13), session="conv-1")
        assert _cached(turn3) == len(P + Q)  # every exported token, from the SSD
        assert srv.stats()["cache"]["hit_tokens_by_tier"] == {"ssd": len(P + Q)}


class PeakRSS:
    """The most RSS a process reaches while the ``with`` block runs (sampled every
    5 ms by a thread that stops with the block)."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> PeakRSS:
        self.start = self.proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    @property
    def grown(self) -> int:
        return max(self.peak, self.proc.memory_info().rss) - self.start


def _stream(prefix: bytes, total: int) -> Iterator[bytes]:
    """``prefix``, then zeros: ``total`` bytes in 1 MB pieces, never held at once."""
    yield prefix
    left = total - len(prefix)
    while left > 0:
        n = min(left, 1024**2)
        yield bytes(n)
        left -= n


def test_a_large_import_is_refused_in_bounded_memory(tiny_llama_path: Path,
                                                     tmp_path: Path) -> None:
    """POST /v1/cache/import streams the body to a file within --max-import-bytes: 200
    MB of zeros are refused at once (not a pack), 200 MB that start like a pack are
    refused once past the limit (64 MB), a Content-Length over it before a byte is read;
    the server's RSS grows by less than 64 MB through all of it, and a valid pack
    still imports."""
    total = 200 * 1024**2
    with KeyedServer(tiny_llama_path, tmp_path / "blocks", tmp_path / "s.log",
                     "--max-import-bytes", "64MB", key="k") as srv:
        srv.complete(P, session="conv-1")
        r = httpx.post(f"{srv.base}/v1/cache/export", headers=srv.headers,
                       json={"tokens": P}, timeout=120)
        assert r.status_code == 200, r.text
        pack = r.content
        url = f"{srv.base}/v1/cache/import"
        with PeakRSS(srv.proc.pid) as rss:
            r = httpx.post(url, headers=srv.headers, content=_stream(b"", total), timeout=120)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "invalid_pack"
            assert "does not start like a pack" in r.json()["error"]["message"]
            # the pack's manifest, then zeros: it starts like a pack, then passes 64 MB
            r = httpx.post(url, headers=srv.headers, content=_stream(pack[:-1024], total),
                           timeout=120)
            assert r.status_code == 413, r.text
            assert r.json()["error"] == {
                "message": "the pack is larger than the server's limit of 67108864 bytes "
                           "(--max-import-bytes)", "type": "invalid_request_error",
                "param": None, "code": "request_too_large"}
            # a Content-Length over the limit: answered before the body is sent
            with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
                s.sendall(b"POST /v1/cache/import HTTP/1.1\r\nHost: x\r\nAuthorization: "
                          b"Bearer k\r\nContent-Length: 10000000000\r\n\r\n")
                assert s.recv(65536).startswith(b"HTTP/1.1 413 ")
            assert srv.complete(Q)["choices"]  # a normal request beside it
        print(f"RSS {rss.start / 1e6:.0f} MB, grew {rss.grown / 1e6:.1f} MB while "
              f"{2 * total / 1e6:.0f} MB were posted")
        assert rss.grown < 64 * 1024**2
        # /metrics: the three refusals by reason; their bytes: the Content-Length refused
        # unread, and what arrived of the two streamed bodies before each was refused
        # (the zeros at their first piece, the other once past 64 MB)
        text = httpx.get(f"{srv.base}/metrics", timeout=30).text.splitlines()
        assert 'promptcache_imports_refused_total{reason="invalid_pack"} 1.0' in text
        assert 'promptcache_imports_refused_total{reason="too_large"} 2.0' in text
        refused = float(next(line.split()[1] for line in text
                             if line.startswith("promptcache_import_refused_bytes_total ")))
        assert 10**10 + 64 * 1024**2 < refused <= 10**10 + 64 * 1024**2 + 2 * 1024**2 + (
            len(pack) - 1024) + 1024**2
        wiped = httpx.delete(f"{srv.base}/v1/cache", headers=srv.headers, timeout=60).json()
        assert wiped["deleted_blocks"] > 0
        r = httpx.post(url, headers=srv.headers, content=pack, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json() == {"blocks": 5, "added": 5, "tokens": 303, "tenant": "default"}
        # streamed in small pieces, its start checked across them, it imports too
        r = httpx.post(url, headers=srv.headers, timeout=120,
                       content=(pack[i:i + 1000] for i in range(0, len(pack), 1000)))
        assert r.status_code == 200 and r.json()["added"] == 0, r.text
