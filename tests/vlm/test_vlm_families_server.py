"""Gemma 3, Qwen3-VL and Qwen3.5 end to end through the server: an image in an OpenAI chat
request (the collector writes the family's image text, the template renders it, the
engine expands it), turn 2 restores the prefix with the image and makes no tower call,
the reply equals the engine's uncached one, and text-only requests work."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_vlm_server import data_url, encoded, oai_user

from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig
from promptcache.engine.engine import Engine
from promptcache.engine.models.vision_cache import VisionCache
from promptcache.server.app import create_app
from promptcache.serving_config import EngineConfig, ImageLimits, ServerConfig


@pytest.fixture(scope="module", params=("gemma3", "qwen3_vl", "qwen3_5", "qwen3_5_moe"))
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, Engine, TestClient, Path]]:
    name = str(request.param)
    path = Path(request.getfixturevalue({"gemma3": "tiny_gemma3_vlm_path",
                                         "qwen3_vl": "tiny_qwen3_vl_path",
                                         "qwen3_5": "tiny_qwen3_5_vlm_path",
                                         "qwen3_5_moe": "tiny_qwen3_5_moe_vlm_path"}[name]))
    cc = CacheConfig(block_size=16, ram_budget_bytes=64 << 20)
    eng = Engine.load(path, EngineConfig(prefill_chunk_tokens=32), cc, cache=build_cache(cc),
                      vision_cache=VisionCache(8 << 20))
    client = TestClient(create_app(eng, ServerConfig(images=ImageLimits(max_images=3))))
    yield name, eng, client, path
    eng.close()


def chat(client: TestClient, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    r = client.post("/v1/chat/completions",
                    json={"messages": messages, "max_tokens": 5, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_image_turn2_is_cached_skips_the_tower_and_equals_uncached(served):
    name, eng, client, path = served
    assert eng.vision is not None and eng.vision.model_type == name
    assert eng.vision.tokens_per_image == 36
    turn1 = [oai_user("What is in this picture?", data_url(encoded(21)))]
    r1 = chat(client, turn1)
    u1 = r1["usage"]
    # the prompt holds the image's 36 placeholder tokens (Gemma: between "\n\n" +
    # <start_of_image> and <end_of_image> + "\n\n"; Qwen: between vision start / end)
    assert u1["prompt_tokens"] == {"gemma3": 60, "qwen3_vl": 56, "qwen3_5": 56,
                                  "qwen3_5_moe": 56}[name]
    assert eng.vision_encoder is not None and eng.vision_encoder.tower_calls == 1
    reply = r1["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": reply},
             {"role": "user", "content": "And its colours?"}]
    r2 = chat(client, turn2)
    # + the reply re-tokenized (5 tokens; the tiny Qwen3.5 MoE's random reply: 10, the
    # tiny Gemma 3's: 7) + the new user message
    assert r2["usage"]["prompt_tokens"] == u1["prompt_tokens"] + {
        "gemma3": 27, "qwen3_5_moe": 30}.get(name, 25)
    # turn 1's prompt and image from the cache (Qwen3-VL: its end-of-generation snapshot;
    # Qwen3.5: its end-of-prefill snapshot, its random reply re-tokenizes otherwise)
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == {
        "gemma3": 60, "qwen3_vl": 60, "qwen3_5": 56, "qwen3_5_moe": 56}[name]
    assert eng.vision_encoder.tower_calls == 1  # turn 2: no tower call
    # the same turn without the prompt cache (the image's features are recomputed)
    fresh = Engine.load(path, EngineConfig(prefill_chunk_tokens=4096), cache=None)
    try:
        ref_client = TestClient(create_app(fresh, ServerConfig(images=ImageLimits(max_images=3))))
        ref = chat(ref_client, turn2)
    finally:
        fresh.close()
    assert ref["usage"]["prompt_tokens"] == r2["usage"]["prompt_tokens"]
    assert ref["choices"][0]["message"]["content"] == r2["choices"][0]["message"]["content"]
    stats = client.get("/v1/cache/stats").json()
    assert stats["vision"]["tower_calls"] == 1


def test_text_only_request_on_a_vision_model(served):
    _name, _eng, client, _path = served
    r = chat(client, [{"role": "user", "content": "Just words, no picture at all."}])
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 5
