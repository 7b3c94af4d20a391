"""Speculative decoding as the server shows it: the request log line's
``spec=accepted/drafted``, the engine's acceptance rate, mean accepted length and
tokens per verify forward in ``/v1/cache/stats``, and the dashboard's speculation card
(a deterministic draft source: the same request's tokens decoded without drafts)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from real_engine import tiny_engine

from promptcache.server import create_app
from promptcache.serving_config import ServerConfig

MESSAGES = [{"role": "user", "content": "Count from one to twenty, in words."}]


def test_spec_counts_in_the_log_line_stats_and_dashboard(
        tiny_llama_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = tiny_engine(tiny_llama_path, None, speculation="suffix", spec_max_draft=4,
                         spec_verify_cost=(1.0, 0.0))
    try:
        client = TestClient(create_app(engine, ServerConfig(prerender=False)))
        spec = engine._ctx.speculator
        seen: list[Any] = []

        def no_drafts(r: Any, k: int) -> list[int]:
            seen.append(r)
            return []

        def chat() -> dict[str, Any]:
            r = client.post("/v1/chat/completions", json={
                "model": "default", "max_tokens": 11, "temperature": 0,
                "messages": MESSAGES})
            assert r.status_code == 200, r.text
            out: dict[str, Any] = r.json()
            return out

        spec.source = no_drafts
        with caplog.at_level(logging.INFO, logger="promptcache.server.replies.runner"):
            first = chat()
        truth = list(seen[-1].output)
        assert len(truth) == 11  # no early stop: the counts below are exact
        logged = [rec.getMessage() for rec in caplog.records if "request " in rec.getMessage()]
        assert len(logged) == 1 and " spec=" not in logged[0]  # nothing drafted
        spec.source = lambda r, k: truth[len(r.output):len(r.output) + k]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="promptcache.server.replies.runner"):
            second = chat()
        assert second["choices"][0]["message"]["content"] == \
            first["choices"][0]["message"]["content"]
        logged = [rec.getMessage() for rec in caplog.records if "request " in rec.getMessage()]
        # drafts of 2, 4 and 2 tokens (the source's 11 tokens end), all accepted (see
        # tests/engine/test_speculation.py)
        assert len(logged) == 1 and " spec=8/8 " in logged[0] + " "
        eng = client.get("/v1/cache/stats").json()["engine"]
        assert (eng["spec_verifies"], eng["spec_drafted"], eng["spec_accepted"]) == (3, 8, 8)
        assert eng["spec_acceptance_rate"] == 1.0
        assert eng["spec_mean_accepted"] == round(8 / 3, 4)
        assert eng["spec_tokens_per_forward"] == round(1 + 8 / 3, 4)
        dash = client.get("/v1/dashboard/data").json()["speculation"]
        assert dash == {"verifies": 3, "drafted": 8, "accepted": 8, "pool_drafted": 0,
                        "pool_accepted": 0, "pool_tokens": eng["spec_pool_tokens"],
                        "acceptance_rate": 1.0, "mean_accepted": round(8 / 3, 4),
                        "tokens_per_forward": round(1 + 8 / 3, 4), "paused": 0, "guard_off": 0,
                        "grammar_cut": 0, "fill_drafted": 0, "fill_accepted": 0, "gated": 0,
                        "presync_gated": 0}
        metrics = client.get("/metrics").text
        assert "promptcache_engine_spec_accepted 8.0" in metrics.splitlines()
        assert "promptcache_engine_spec_drafted 8.0" in metrics.splitlines()
        assert "promptcache_engine_spec_guard_off 0.0" in metrics.splitlines()
        assert eng["spec_pool_tokens"] > 0  # both replies joined the default tenant's pool
    finally:
        engine.close()


def test_no_speculation_panel_without_an_engine_that_counts() -> None:
    from promptcache.server.ops.dashboard import speculation_panel

    assert speculation_panel(None) is None
    assert speculation_panel({"active": 1}) is None
