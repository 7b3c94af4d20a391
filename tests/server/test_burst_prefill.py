"""A burst of requests prepared one after the other by the server still prefills as one
batch: every generation request is announced to the engine while it is being prepared
(``Preparer.prepare(generate=True)`` -> ``Engine.announce``), and an idle engine woken
by the first submit waits for the announced ones (engine/arrivals.py).

The preparations are held until all eight requests are announced, then each takes
longer than the engine's gathering window (so arrivals alone would split the burst):
the engine still runs ONE batched prefill forward with all eight rows. Probes
(``POST /v1/cache/probe``) are not announced."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from promptcache.config import EngineConfig, ServerConfig
from promptcache.engine.engine import Engine
from promptcache.server import create_app

N = 8
WINDOW = 0.01
PREP_S = 0.05  # each preparation takes five windows


def _body(i: int) -> tuple[str, dict[str, Any]]:
    msgs = [{"role": "user", "content": f"question number {i}: " + "word " * (6 + i)}]
    if i % 3 == 0:
        return "/v1/messages", {"model": "default", "max_tokens": 4, "messages": msgs}
    if i % 3 == 1:
        return "/v1/responses", {"model": "default", "max_output_tokens": 4,
                                 "input": msgs[0]["content"]}
    return "/v1/chat/completions", {"model": "default", "max_tokens": 4, "messages": msgs,
                                    "stream": True}


def test_a_burst_prepared_one_by_one_prefills_as_one_batch(tiny_llama_path: Path) -> None:
    cfg = EngineConfig(prefill_chunk_tokens=64, batch_window_s=WINDOW, burst_gather_max_s=10.0)
    with Engine.load(tiny_llama_path, cfg) as eng:
        app = create_app(eng, ServerConfig())
        gate = threading.Event()
        render = eng.render_chat_with_offsets

        def slow_render(*args: Any, **kwargs: Any) -> Any:
            assert gate.wait(60), "the requests were never all announced"
            time.sleep(PREP_S)
            return render(*args, **kwargs)

        eng.render_chat_with_offsets = slow_render  # type: ignore[method-assign]

        async def run() -> list[int]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                         timeout=120) as c:
                async def one(i: int) -> int:
                    path, body = _body(i)
                    r = await c.post(path, json=body)
                    return r.status_code

                async def open_gate() -> int:
                    while eng._control.incoming < N:
                        await asyncio.sleep(0.005)
                    gate.set()
                    return 200

                return await asyncio.gather(*(one(i) for i in range(N)), open_gate())

        codes = asyncio.run(run())
        assert codes == [200] * (N + 1)
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
