"""A next-turn pre-render never delays a request: the background prefill the pre-renderer
submits (for a thinking template that strips reasoning from history) yields to a new
interactive request at the next prefill chunk, counted in scheduler steps (the engine's
Stepper: no engine thread, no timing)."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trace_replay as R
from fastapi.testclient import TestClient
from real_engine import make_cache, tiny_engine

from promptcache.engine.api import GenerationRequest
from promptcache.server import create_app
from promptcache.serving_config import ServerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from stepper import Stepper  # noqa: E402

BS = 8
CHUNK = 2 * BS


class Held:
    """The handle of a captured background request: it never runs by itself."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.done = threading.Event()

    def cancel(self) -> None:
        self.done.set()

    async def aevents(self) -> Any:
        while not self.done.is_set():
            await asyncio.sleep(0.01)
        return
        yield


class Capturing:
    """The real engine, except that background requests are kept for the test."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.background: list[GenerationRequest] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def submit(self, req: GenerationRequest) -> Any:
        if req.priority == "background":
            self.background.append(req)
            return Held(req)
        return self._engine.submit(req)


@pytest.fixture
def engine(models_root: Path) -> Iterator[Any]:
    model = R.model_path("thinking", models_root)
    eng = tiny_engine(model, make_cache(block_size=BS), block_size=BS, chunk=CHUNK)
    yield eng
    eng.close()


def test_a_new_request_starts_within_one_chunk_of_a_running_prerender(engine: Any) -> None:
    trace = R.load_trace("thinking")
    cap = Capturing(engine)
    body = {**trace["base"]["body"], **trace["turns"][0]["body"], "stream": False}
    with TestClient(create_app(cap, ServerConfig())) as client:  # type: ignore[arg-type]
        r = client.post("/v1/messages", json=body, headers=trace["base"]["headers"])
        assert r.status_code == 200, r.text
        pre = client.app.state.pc_prerender  # type: ignore[attr-defined]
        deadline = 600.0
        while not cap.background and deadline > 0:  # the worker thread renders it
            pre.wait_idle(timeout=0.05)
            deadline -= 0.05
        [bg_req] = cap.background
        assert (bg_req.priority, bg_req.prefill_only) == ("background", True)
        pre.cancel(next(iter(pre._pending)))  # the test runs it below instead
    prefix = list(bg_req.prompt_tokens)
    st = Stepper(engine)
    # the pre-render's very request, without the cache so that its prefill is long
    bg = st.submit(prefix, prefill_only=True, background=True, use_cache=False)
    steps = 0
    while bg.req is None or bg.req.pos < 2 * CHUNK:
        assert st.step()
        steps += 1
    assert bg.req.pos == 2 * CHUNK and len(prefix) > 4 * CHUNK  # still far from done
    nxt = prefix + [int(t) for t in engine.tokenizer.encode("and the README?")][-5:]
    ia = st.submit(nxt, max_tokens=2, use_cache=False)
    st.step()  # the very next step prefills the interactive request, not the pre-render
    assert st.scheduler.last_prefilled is ia.req
    assert ia.req.pos == CHUNK and bg.req.pos == 2 * CHUNK
    chunks = -(-len(nxt) // CHUNK)
    for _ in range(chunks - 1):
        st.step()
        assert bg.req.pos == 2 * CHUNK  # the pre-render waits while the turn prefills
    assert ia.req.pos == len(nxt) and len(ia.tokens) == 1
    st.run()
    assert bg.result is not None and bg.result.finish_reason == "prefilled"
    assert ia.result is not None and ia.result.finish_reason in ("length", "stop")


def test_at_the_limit_a_new_request_takes_the_prerenders_slot(engine: Any) -> None:
    """With every admission slot taken (one by a pre-render), a new interactive request
    is not refused nor left waiting behind it: the pre-render is preempted and the
    request's first chunk runs in the very next step (main's Scheduler and Admission)."""
    st = Stepper(engine, max_active_requests=2, max_queued_requests=0)
    tok = engine.tokenizer
    long_prompt = [int(t) for t in tok.encode("the history of the session " * 40)]
    bg = st.submit(long_prompt, prefill_only=True, background=True, use_cache=False)
    st.step()
    assert bg.req is not None and 0 < bg.req.pos < len(long_prompt)
    first = st.submit([int(t) for t in tok.encode("a first question")], max_tokens=8,
                      use_cache=False)  # the last slot: interactive requests may take it
    while first.req is None or first.req.phase != "decode":
        st.step()
    assert bg.result is None and not bg.cancelled
    second = st.submit([int(t) for t in tok.encode("a second question")], max_tokens=2,
                       use_cache=False)  # max_queued 0: it would be refused if it waited
    assert bg.cancelled  # preempted at once
    st.step()
    assert bg.result is not None and bg.result.finish_reason == "cancelled"
    assert st.scheduler.last_prefilled is second.req
    snap = st.admission.snapshot()
    assert (snap["rejected"], snap["queued_total"], snap["background_preempted"],
            snap["background_active"]) == (0, 1, 1, 0)
    st.run()
    assert second.result is not None and second.result.finish_reason in ("length", "stop")
    assert first.result is not None and first.result.finish_reason in ("length", "stop")
