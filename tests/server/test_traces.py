"""The hit-rate traces (tests/fixtures/traces) replayed through the server, each as its
client would (trace_replay.py), on the trace's tiny model with the cache in RAM: the
share of each previous turn's prompt + output that the next turn reused is >= 95% on
every trace (strings cut to 300 characters to keep the suite fast; bench/bench_hitrate.py
measures the full traces, before and after, for BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trace_replay as R
from fastapi.testclient import TestClient
from real_engine import make_cache, tiny_engine

from promptcache.config import ServerConfig
from promptcache.server import create_app

TRIM = 300
BS = 16


def run(name: str, models_root: Path, **config: Any) -> R.TraceReport:
    trace = R.trim(R.load_trace(name), TRIM)
    model = R.model_path(trace["model"], models_root)
    engine = tiny_engine(model, make_cache(block_size=BS), block_size=BS, chunk=4 * BS)
    probe_engine = tiny_engine(model, None, block_size=BS, chunk=4 * BS)
    try:
        with TestClient(create_app(engine, ServerConfig(**config))) as client, \
                TestClient(create_app(probe_engine, ServerConfig(
                    prerender=False,
                    canonicalize_off=config.get("canonicalize_off", ())))) as renderer:
            pre = client.app.state.pc_prerender  # type: ignore[attr-defined]

            def post(path: str, headers: dict[str, str], body: dict[str, Any]
                     ) -> tuple[int, str]:
                r = client.post(path, json=body, headers=headers)
                return r.status_code, r.text

            def probe(api: str, headers: dict[str, str], body: dict[str, Any]) -> list[int]:
                r = renderer.post(f"/v1/cache/probe?api={api}&tokens=true", json=body,
                                  headers=headers)
                assert r.status_code == 200, r.text
                tokens: list[int] = r.json()["tokens"]
                return tokens

            def settle() -> None:
                assert pre.wait_idle(timeout=600)

            return R.replay(trace, post, probe, settle)
    finally:
        engine.close()
        probe_engine.close()


@pytest.mark.parametrize("name", R.trace_names())
def test_trace_reuses_95_percent_of_every_previous_turn(name: str, models_root: Path) -> None:
    report = run(name, models_root)
    assert report.share >= 0.95, report.table()
    assert report.min_share >= 0.95, report.table()
