"""The dashboard in a real headless Chromium against a real server (tiny model, SSD).

The page is opened before any request; after two requests (the second extends the
first, so it hits) the test waits for the live update and asserts that the page's hit
rate, token and byte figures are exactly those of ``GET /v1/cache/stats``. A screenshot
is written to the artifacts folder. The same page without the key shows the key form:
the data sits behind the API's authentication.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from cdp import Browser, Page, find_chromium
from ops_server import KeyedServer
from server_proc import token_prompt

pytestmark = pytest.mark.skipif(find_chromium() is None, reason="chromium is not installed "
                                "(.ci/run installs Debian's chromium)")

KEY = "dash-key-1"


def _human(n: int) -> str:
    """The dashboard's reading of a byte count: 1024-based units, one decimal."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    v, i = float(n), 0
    while v >= 1024 and i < len(units) - 1:
        v /= 1024
        i += 1
    return f"{v:.1f} {units[i]}" if i else f"{int(v)} B"


def _value(page: Page, el_id: str) -> str:
    return str(page.evaluate(f"document.getElementById({el_id!r}).dataset.value"))


def _text(page: Page, selector: str) -> str:
    return str(page.evaluate(f"document.querySelector({selector!r}).textContent"))


def test_dashboard_live_figures_equal_cache_stats(tiny_llama_path: Path, tmp_path: Path,
                                                  artifacts_dir: Path) -> None:
    with KeyedServer(tiny_llama_path, tmp_path / "blocks", tmp_path / "server.log",
                     key=KEY) as srv, Browser.start(tmp_path) as browser:
        # without the key: the page loads, its data does not
        assert httpx.get(f"{srv.base}/v1/dashboard/data").status_code == 401
        locked = browser.new_page()
        locked.navigate(f"{srv.base}/dashboard?interval=200")
        locked.wait_for("!document.getElementById('keyform').hidden && "
                        "document.getElementById('status').textContent === 'API key needed'")
        assert _value(locked, "lookups") == ""

        page = browser.new_page()
        page.navigate(f"{srv.base}/dashboard?interval=200#key={KEY}")
        page.wait_for("document.getElementById('status').textContent === 'live' && "
                      "document.getElementById('lookups').dataset.value === '0'")
        assert "key" not in str(page.evaluate("location.href"))  # dropped from the URL

        first = token_prompt(300, seed=1)
        r1 = srv.complete(first, session="sess-a")
        r2 = srv.complete(first + token_prompt(90, seed=2), session="sess-a")
        assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        srv.wait_written()
        stats = srv.stats()
        seen = int(_value(page, "updates"))
        # the live update: two more refreshes after the stats settled
        page.wait_for(f"document.getElementById('lookups').dataset.value === '2' && "
                      f"Number(document.getElementById('updates').dataset.value) >= {seen + 2}")
        c = stats["cache"]
        assert srv.stats()["cache"] == c  # nothing moved while the page refreshed
        assert c["lookups"] == 2
        assert float(_value(page, "hit-rate")) == c["token_hit_rate"]
        assert _text(page, "#hit-rate") == f"{c['token_hit_rate'] * 100:.1f}%"
        assert int(_value(page, "hit-tokens")) == c["hit_tokens"]
        assert int(_value(page, "prompt-tokens")) == c["hit_tokens"] + c["miss_tokens"]
        assert float(_value(page, "rolling-rate")) == stats["rolling"]["hit_rate"]
        ssd = c["tiers"]["ssd"]
        for tier, nbytes, nblocks in (("ram", c["ram_bytes"], c["ram_blocks"]),
                                      ("ssd", ssd["bytes_on_disk"], ssd["blocks_on_disk"])):
            assert nbytes > 0 and nblocks > 0
            cell = f"#tier-{tier} td.bytes"
            assert int(page.evaluate(f"document.querySelector({cell!r}).dataset.value")) == nbytes
            assert _text(page, cell) == _human(nbytes)  # 9.2 MiB, the exact count as its title
            assert page.evaluate(f"document.querySelector({cell!r}).title") == f"{nbytes:,} B"
            blocks = f"#tier-{tier} td.blocks"
            assert int(page.evaluate(f"document.querySelector({blocks!r}).dataset.value")) == nblocks
        # the MLX arrays held (RAM tier + live states) and the RAM tier's cap
        eng = stats["engine"]
        assert int(_value(page, "arrays")) == eng["ram_arrays"] + eng["live_arrays"] > 0
        assert int(_value(page, "ram-arrays")) == eng["ram_arrays"]
        assert int(_value(page, "live-arrays")) == eng["live_arrays"]
        assert _text(page, "#max-arrays") == f"{eng['max_arrays']:,}"
        # one request counts for the alert (the new one is skipped): too few to judge yet
        assert _text(page, "#alert") == "hit rate: too few requests yet (1 of 10)"
        # the request panels: two requests of one session, TTFT of both kinds
        assert int(_value(page, "requests")) == 2
        assert _text(page, "#sessions tbody tr td") == "sess-a"
        assert _value(page, "ttft-cached") != "" and _value(page, "ttft-uncached") != ""
        assert int(_value(page, "tokens-saved")) == r2["usage"]["prompt_tokens_details"][
            "cached_tokens"]
        assert page.evaluate("document.querySelectorAll('#chart circle').length") == 2
        shot = page.screenshot(artifacts_dir / "dashboard.png")
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
