"""The hit-rate traces (tests/fixtures/traces) replayed through the server, each as its
client would (trace_replay.py), on the trace's tiny model with the cache in RAM: the
share of each previous turn's prompt + output that the next turn reused is >= 95% on
every trace (strings cut to 300 characters to keep the suite fast; bench/bench_hitrate.py
measures the full traces, before and after, for BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sse_checks
import trace_replay as R
from fastapi.testclient import TestClient
from real_engine import make_cache, tiny_engine

from promptcache.server import create_app
from promptcache.serving_config import ServerConfig

TRIM = 300
BS = 16


Sent = list[tuple[str, dict[str, str], dict[str, Any], str]]


def run(name: str, models_root: Path, sent: Sent | None = None, greedy: bool = False,
        **config: Any) -> R.TraceReport:
    """Replay trace ``name``; ``sent`` collects (path, headers, body, response text)."""
    trace = R.trim(R.load_trace(name), TRIM)
    if greedy:
        trace["base"]["body"]["temperature"] = 0
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
                if sent is not None:
                    sent.append((path, headers, body, r.text))
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


def outputs(path: str, text: str) -> Any:
    """What a streamed reply generated (text, reasoning, tool calls), without ids."""
    if path == R.PATHS["messages"]:
        return [(b["type"], b.get("text"), b.get("thinking"), b.get("name"), b.get("input"))
                for b in sse_checks.anthropic_stream(text)["content"]]
    if path == R.PATHS["chat"]:
        got = sse_checks.chat_stream(text)
        return (got["content"], got["reasoning"],
                [(c["name"], c["arguments"]) for c in got["tool_calls"]])
    return [(o["type"], o.get("content"), o.get("summary"), o.get("name"), o.get("arguments"))
            for o in sse_checks.responses_stream(text)["output"]]


def generated(path: str, text: str) -> bool:
    """The reply carries generated text, reasoning or a tool call."""
    got = outputs(path, text)
    if path == R.PATHS["chat"]:
        content, reasoning, calls = got
        return bool(content or reasoning or calls)
    return any(any(v for v in item[1:]) for item in got)


@pytest.mark.parametrize("name", ["thinking", "claude_code_tool_calls", "codex_tool_calls",
                                  "tools_shuffled"])
def test_greedy_outputs_with_the_cache_equal_outputs_without_it(name: str, models_root: Path
                                                                 ) -> None:
    """Canonicalization + pre-render + the cache on one server; the very same request
    bodies (so the same canonical prompts) on a server without a cache: every turn
    generates the same greedy output."""
    sent: Sent = []
    run(name, models_root, sent, greedy=True)
    model = R.model_path(R.load_trace(name)["model"], models_root)
    engine = tiny_engine(model, None, block_size=BS, chunk=4 * BS)
    try:
        with TestClient(create_app(engine, ServerConfig(prerender=False))) as client:
            for i, (path, headers, body, text) in enumerate(sent):
                r = client.post(path, json=body, headers=headers)
                assert r.status_code == 200, r.text
                assert outputs(path, r.text) == outputs(path, text), f"turn {i}"
        assert any(generated(p, t) for p, _, _, t in sent)  # something was compared
    finally:
        engine.close()
