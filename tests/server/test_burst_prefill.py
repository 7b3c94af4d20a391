"""A burst of requests prepared one after the other by the server still prefills as one
batch: every generation request is announced to the engine while it is being prepared
(``Preparer.prepare(generate=True)`` -> ``Engine.announce``), and an idle engine woken
by the first submit waits for the announced ones (engine/requests/arrivals.py).

Driven by steps, not by timing: every preparation is held until all eight requests are
announced; then the test lets them finish ONE at a time, the next only after the
previous one was submitted to the engine and more than the engine's gathering window
has passed (so arrivals alone would split the burst): the engine still runs ONE
batched prefill forward with all eight rows. Probes (``POST /v1/cache/probe``) are
not announced."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from promptcache.engine.api import GenerationRequest, SamplingParams
from promptcache.engine.engine import Engine
from promptcache.server import create_app
from promptcache.serving_config import EngineConfig, ServerConfig

N = 8
WINDOW = 0.01


def _body(i: int) -> tuple[str, dict[str, Any]]:
    msgs = [{"role": "user", "content": f"question number {i}: " + "word " * (6 + i)}]
    if i % 3 == 0:
        return "/v1/messages", {"model": "default", "max_tokens": 4, "messages": msgs}
    if i % 3 == 1:
        return "/v1/responses", {"model": "default", "max_output_tokens": 4,
                                 "input": msgs[0]["content"]}
    return "/v1/chat/completions", {"model": "default", "max_tokens": 4, "messages": msgs,
                                    "stream": True}


def _burst(eng: Engine) -> list[int]:
    """The N requests through the server, their preparations held until all N are
    announced and then let go one at a time (the next once the previous was submitted
    and 3 gathering windows have passed); the status codes (+ 200 for the releaser)."""
    app = create_app(eng, ServerConfig())
    gates = [threading.Event() for _ in range(N)]
    calls = iter(range(N))
    render = eng.render_chat_with_offsets

    def held_render(*args: Any, **kwargs: Any) -> Any:
        i = next(calls)  # the preparations run in turn, in the order they start
        assert gates[i].wait(120), f"preparation {i} was never released"
        return render(*args, **kwargs)

    eng.render_chat_with_offsets = held_render  # type: ignore[method-assign]

    async def release_one_by_one() -> int:
        while eng._control.incoming < N:
            await asyncio.sleep(0.005)
        for i in range(N):
            gates[i].set()
            while eng.admission.interactive_submits < i + 1:  # request i was submitted
                await asyncio.sleep(0.005)
            await asyncio.sleep(3 * WINDOW)  # longer than a gathering window
        return 200

    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=300) as c:
            async def one(i: int) -> int:
                path, body = _body(i)
                r = await c.post(path, json=body)
                return r.status_code

            return await asyncio.gather(*(one(i) for i in range(N)), release_one_by_one())

    return asyncio.run(run())


def test_a_burst_prepared_one_by_one_prefills_as_one_batch(tiny_llama_path: Path) -> None:
    # the hard end of the gathering (the most allowed) is far past the ~0.3 s of the steps
    cfg = EngineConfig(prefill_chunk_tokens=64, batch_window_s=WINDOW, burst_gather_max_s=10.0)
    with Engine.load(tiny_llama_path, cfg) as eng:
        assert _burst(eng) == [200] * (N + 1)
        c = eng.counters
        assert c.prefill_batches == 1 and c.max_prefill_batch == N
        assert eng._control.incoming == 0


def test_a_burst_behind_background_work_prefills_as_one_batch(tiny_llama_path: Path) -> None:
    """The engine is running only background work (a next-turn pre-render: prefill-only,
    ``priority="background"``) when the burst comes: it gathers the burst as an idle
    engine does, instead of starting the first request alone at its next step and
    prefilling the seven others while that one decodes. Driven by steps: once the
    background request is prefilling, an ``Engine.call`` holds the engine thread between
    two of its steps until the burst's first request is submitted."""
    cfg = EngineConfig(prefill_chunk_tokens=64, batch_window_s=WINDOW, burst_gather_max_s=10.0)
    with Engine.load(tiny_llama_path, cfg) as eng:
        background = eng.submit(GenerationRequest(
            tuple(10 + i % 1000 for i in range(4000)), SamplingParams(max_tokens=1),
            priority="background", prefill_only=True))
        for _ in range(60_000):
            if any(r.background for r in eng.scheduler.requests()):
                break
            time.sleep(0.001)
        busy: list[bool] = []

        def hold() -> None:
            busy.append(any(r.background for r in eng.scheduler.requests()))
            for _ in range(60_000):  # until the burst's first request is submitted
                if eng.admission.interactive_submits:
                    return
                time.sleep(0.001)
            raise AssertionError("the burst's first request never came")

        holder = threading.Thread(target=eng.call, args=(hold,), kwargs={"timeout": 120})
        holder.start()
        assert _burst(eng) == [200] * (N + 1)
        holder.join(60)
        assert busy == [True]  # the hold came between two steps of the background prefill
        assert background.result().finish_reason == "prefilled"
        c = eng.counters
        assert c.prefill_batches == 1 and c.max_prefill_batch == N
        assert eng._control.incoming == 0


def test_probes_and_token_counts_are_not_announced(tiny_llama_path: Path) -> None:
    with Engine.load(tiny_llama_path, EngineConfig(prefill_chunk_tokens=64)) as eng:
        app = create_app(eng, ServerConfig())
        seen: list[int] = []
        render = eng.render_chat_with_offsets

        def watching(*args: Any, **kwargs: Any) -> Any:
            seen.append(eng._control.incoming)
            return render(*args, **kwargs)

        eng.render_chat_with_offsets = watching  # type: ignore[method-assign]
        from fastapi.testclient import TestClient

        client = TestClient(app)
        msgs = [{"role": "user", "content": "hello there"}]
        r = client.post("/v1/messages/count_tokens", json={"model": "default",
                                                            "messages": msgs})
        assert r.status_code == 200, r.text
        r = client.post("/v1/cache/probe?api=chat", json={"messages": msgs})
        assert r.status_code == 200, r.text
        assert seen and all(n == 0 for n in seen)
        r = client.post("/v1/chat/completions", json={"model": "default", "max_tokens": 2,
                                                      "messages": msgs})
        assert r.status_code == 200, r.text
        assert seen[-1] == 1 and eng._control.incoming == 0
