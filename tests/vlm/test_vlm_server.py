"""Images through the three APIs on the tiny VLM: turn 2 hits the cache and makes no
vision call, digests come from pixels (not the encoding), bad images are 400s in each
API's own error shape and store nothing; a text-only model keeps its 400."""

from __future__ import annotations

import base64
import io
import struct
import threading
import zlib
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from PIL import Image
from vlm_helpers import image

from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig
from promptcache.engine.engine import Engine
from promptcache.engine.models.vision_cache import VisionCache
from promptcache.server.app import create_app
from promptcache.serving_config import EngineConfig, ImageLimits, ServerConfig


def encoded(seed: int, fmt: str = "PNG", h: int = 40, w: int = 48) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image(seed, h, w)).save(buf, format=fmt)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{b64(data)}"


def huge_png_header(w: int = 50_000, h: int = 50_000) -> bytes:
    """A PNG whose header claims w x h pixels (the data is a few bytes)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def engine(tiny_vlm_path: Path) -> Iterator[Engine]:
    cc = CacheConfig(block_size=16, ram_budget_bytes=64 << 20)
    eng = Engine.load(tiny_vlm_path, EngineConfig(prefill_chunk_tokens=32), cc,
                      cache=build_cache(cc), vision_cache=VisionCache(8 << 20))
    yield eng
    eng.close()


def app_client(engine: Engine, **limits: Any) -> TestClient:
    return TestClient(create_app(engine, ServerConfig(images=ImageLimits(**limits))))


@pytest.fixture(scope="module")
def client(engine: Engine) -> TestClient:
    return app_client(engine, max_images=3)


def calls(engine: Engine) -> int:
    assert engine.vision_encoder is not None
    return engine.vision_encoder.tower_calls


def oai_user(text: str, *urls: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        *({"type": "image_url", "image_url": {"url": u}}
                                          for u in urls)]}


def test_openai_turn2_with_the_same_image_is_cached_and_skips_the_tower(client, engine):
    turn1 = [oai_user("What is in this picture?", data_url(encoded(11)))]
    r1 = client.post("/v1/chat/completions", json={"messages": turn1, "max_tokens": 4})
    assert r1.status_code == 200, r1.text
    u1 = r1.json()["usage"]
    before = calls(engine)
    turn2 = [*turn1, {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And its colours?"}]
    r2 = client.post("/v1/chat/completions", json={"messages": turn2, "max_tokens": 4})
    assert r2.status_code == 200, r2.text
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= u1["prompt_tokens"]
    assert calls(engine) == before  # turn 2: 0 vision tower calls
    stats = client.get("/v1/cache/stats").json()
    assert stats["vision"]["tower_calls"] == calls(engine)


def test_digest_is_of_the_pixels_not_the_encoding(client, engine):
    """The same pixels as PNG and as BMP: one digest, so the second request reuses the
    whole prompt (image included) and the vision cache is not even asked."""
    msgs = [oai_user("Same pixels, other file:", data_url(encoded(12)))]
    r1 = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    n = r1.json()["usage"]["prompt_tokens"]
    before = calls(engine)
    msgs = [oai_user("Same pixels, other file:", data_url(encoded(12, "BMP"), "image/bmp"))]
    r2 = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r2.status_code == 200, r2.text
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert calls(engine) == before


def test_anthropic_image_blocks(client, engine):
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(encoded(13))}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Describe:"}, block]}]
    r1 = client.post("/v1/messages", json={"messages": msgs, "max_tokens": 4})
    assert r1.status_code == 200, r1.text
    before = calls(engine)
    msgs += [{"role": "assistant", "content": r1.json()["content"][0]["text"] or "ok"},
             {"role": "user", "content": "more"}]
    r2 = client.post("/v1/messages", json={"messages": msgs, "max_tokens": 4})
    assert r2.status_code == 200, r2.text
    u = r2.json()["usage"]
    assert u["cache_read_input_tokens"] >= r1.json()["usage"]["cache_creation_input_tokens"]
    assert calls(engine) == before
    count = client.post("/v1/messages/count_tokens", json={"messages": msgs[:1]})
    assert count.status_code == 200
    assert count.json()["input_tokens"] > engine.vision.tokens_per_image


def test_responses_input_image_and_previous_response(client, engine):
    item = {"role": "user", "content": [
        {"type": "input_text", "text": "What do you see?"},
        {"type": "input_image", "image_url": data_url(encoded(14))}]}
    r1 = client.post("/v1/responses", json={"input": [item], "max_output_tokens": 4})
    assert r1.status_code == 200, r1.text
    before = calls(engine)
    r2 = client.post("/v1/responses", json={"previous_response_id": r1.json()["id"],
                                             "input": "Tell me more.", "max_output_tokens": 4})
    assert r2.status_code == 200, r2.text
    cached = r2.json()["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= r1.json()["usage"]["input_tokens"]
    assert calls(engine) == before


BAD = {
    "corrupt base64": (data_url(b"x")[:-4] + "!!!!", "not valid base64"),
    "50000x50000 header": (data_url(huge_png_header()), "pixels"),
    "unsupported format": ("data:image/tiff;base64," + b64(encoded(15, "TIFF")),
                           "unsupported image type"),
    "not an image": (data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>"),
                     "not a decodable image"),
    "truncated": (data_url(encoded(16)[:60]), "corrupt"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_images_are_400_in_each_api_shape_and_store_nothing(client, engine, case):
    url, words = BAD[case]
    blocks = engine.cache.stats().to_dict()["ram_blocks"]
    entries = client.get("/v1/cache/stats").json()["vision"]["entries"]
    r = client.post("/v1/chat/completions", json={
        "messages": [oai_user("look", url)], "max_tokens": 2})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_image"
    assert err["message"].startswith("messages[0].content[1]") and words in err["message"]
    head, data = url.split(",", 1)
    media = head[5:].split(";")[0]
    block = {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    r = client.post("/v1/messages", json={"max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look"}, block]}]})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert words in body["error"]["message"]
    r = client.post("/v1/responses", json={"max_output_tokens": 2, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": url}]}]})
    assert r.status_code == 400
    assert words in r.json()["error"]["message"]
    assert r.json()["error"]["message"].startswith("input[0].content[0]")
    assert engine.cache.stats().to_dict()["ram_blocks"] == blocks
    assert client.get("/v1/cache/stats").json()["vision"]["entries"] == entries


def test_too_many_images(client):
    urls = [data_url(encoded(20 + i)) for i in range(4)]
    r = client.post("/v1/chat/completions", json={"messages": [oai_user("x", *urls)],
                                                  "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "messages[0].content[4]: too many images (at most 3 per request)")
    r = client.post("/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": u}} for u in urls]}]})
    assert r.status_code == 400 and "too many images" in r.json()["error"]["message"]


def test_image_token_typed_as_text_is_a_400(client):
    r = client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [
        {"role": "user", "content": "a literal <image> here"}]})
    assert r.status_code == 400
    r = client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [
        oai_user("and <image> here", data_url(encoded(30)))]})
    assert r.status_code == 400 and "2 image tokens" in r.json()["error"]["message"]


def test_local_files_only_behind_the_flag(engine, tmp_path, client):
    path = tmp_path / "cat.png"
    path.write_bytes(encoded(31))
    msgs = [oai_user("file:", f"file://{path}")]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == 400 and "--allow-local-images" in r.json()["error"]["message"]
    allowed = app_client(engine, allow_local_files=True)
    r = allowed.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = allowed.post("/v1/chat/completions", json={
        "messages": [oai_user("file:", str(tmp_path / "missing.png"))], "max_tokens": 2})
    assert r.status_code == 400 and "no such image file" in r.json()["error"]["message"]


def test_urls_fetched_only_behind_the_flag_within_the_byte_limit(engine, tmp_path, client):
    (tmp_path / "a.png").write_bytes(encoded(32))
    (tmp_path / "big.png").write_bytes(encoded(33, h=200, w=200))
    handler = partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        msgs = [oai_user("url:", f"{base}/a.png")]
        r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
        assert r.status_code == 400 and "--allow-image-urls" in r.json()["error"]["message"]
        allowed = app_client(engine, allow_urls=True, max_bytes=len(encoded(32)) + 10)
        r = allowed.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = allowed.post("/v1/chat/completions", json={
            "messages": [oai_user("url:", f"{base}/big.png")], "max_tokens": 2})
        assert r.status_code == 400 and "larger than" in r.json()["error"]["message"]
        r = allowed.post("/v1/chat/completions", json={
            "messages": [oai_user("url:", f"{base}/missing.png")], "max_tokens": 2})
        assert r.status_code == 400 and "fetching the image failed" in r.json()["error"]["message"]
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_a_text_only_model_keeps_its_400(tiny_llama_path):
    eng = Engine.load(tiny_llama_path, cache=None)
    try:
        assert eng.vision is None
        c = TestClient(create_app(eng, ServerConfig()))
        url = data_url(encoded(40))
        r = c.post("/v1/chat/completions", json={"messages": [oai_user("x", url)],
                                                 "max_tokens": 2})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            "messages[0].content[1]: content type 'image_url' is not supported (text-only model)")
        r = c.post("/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": url.split(",", 1)[1]}}]}]})
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "messages[0].content[0]: content type 'image' is not supported (text-only model)")
        r = c.post("/v1/responses", json={"max_output_tokens": 2, "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": url}]}]})
        assert r.status_code == 400 and "(text-only model)" in r.json()["error"]["message"]
        assert "vision" not in c.get("/v1/cache/stats").json()
    finally:
        eng.close()
