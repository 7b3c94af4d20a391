"""`promptcache serve` on a vision-language model folder: the VLM path is chosen from
the folder itself; image options; vision features persisted beside the SSD tier."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import pytest
from PIL import Image
from serve_proc import serve
from vlm_helpers import image

from promptcache.cli import build_parser
from promptcache.cli.serve_cmd import build_configs, build_vision_cache


def test_image_options(tmp_path):
    args = build_parser().parse_args([
        "serve", "--cache-dir", str(tmp_path / "blocks"), "--allow-local-images",
        "--allow-image-urls", "--max-images", "3", "--max-image-bytes", "1MB",
        "--max-image-pixels", "1000000", "--vision-cache-budget", "64MB"])
    _, _, ssd, server = build_configs(args)
    lim = server.images
    assert (lim.allow_local_files, lim.allow_urls, lim.max_images, lim.max_bytes,
            lim.max_pixels) == (True, True, 3, 1024**2, 1_000_000)
    vc = build_vision_cache(args, ssd)
    assert vc is not None and vc.budget_bytes == 64 * 1024**2
    assert vc.base == Path(str(tmp_path / "blocks") + "-vision")
    defaults = build_parser().parse_args(["serve", "--no-ssd"])
    _, _, ssd, server = build_configs(defaults)
    assert not server.images.allow_local_files and not server.images.allow_urls
    vc = build_vision_cache(defaults, ssd)
    assert vc is not None and vc.base is None
    off = build_parser().parse_args(["serve", "--no-ssd", "--vision-cache-budget", "0"])
    assert build_vision_cache(off, None) is None


def test_serve_a_vlm_folder(tiny_vlm_path, tmp_path):
    with serve(["--model", str(tiny_vlm_path), "--block-size", "16",
                "--cache-dir", str(tmp_path / "blocks")], tmp_path / "server.log",
               timeout=120) as base:
        buf = io.BytesIO()
        Image.fromarray(image(5)).save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        msgs = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                              {"type": "image_url", "image_url": {"url": url}}]}]
        r = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                       json={"messages": msgs, "max_tokens": 3})
        assert r.status_code == 200, r.text
        stats = httpx.get(f"{base}/v1/cache/stats", timeout=10).json()
        assert stats["vision"]["tower_calls"] == 1 and stats["vision"]["misses"] == 1
    # written by the writer thread, flushed at shutdown at the latest
    files = list((tmp_path / "blocks-vision").glob("*/*.safetensors"))
    assert len(files) == 1


@pytest.mark.parametrize("fixture", ["tiny_vlm_path", "tiny_qwen3_5_vlm_path"])
def test_a_vlm_identity_reads_no_weight_and_is_the_engine_s(
        fixture: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pack commands' identity of a vision-language model (mlx-vlm, lazily): no array
    evaluated while it opens, the namespace and the chat rendering a serving engine's."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from promptcache.config import CacheConfig
    from promptcache.engine.engine import Engine
    from promptcache.engine.identity import open_identity
    from promptcache.serving_config import EngineConfig

    path = request.getfixturevalue(fixture)
    cc = CacheConfig(block_size=16)
    evaluated: list[int] = []
    real_eval = mx.eval
    with monkeypatch.context() as m:
        def counting(*args: object) -> None:  # a model's init may evaluate a rope table
            evaluated.extend(int(a.nbytes) for _, a in tree_flatten(list(args))
                             if isinstance(a, mx.array))
            real_eval(*args)

        m.setattr(mx, "eval", counting)
        identity = open_identity(path, cc)
    weights = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    assert sum(evaluated) < weights / 100, (sum(evaluated), weights)
    engine = Engine.load(path, EngineConfig(speculation="off"), cc)
    try:
        assert identity.namespace("alice") == engine.namespace("alice")
        assert identity.kv_spec == engine.kv_spec
        chat = [{"role": "user", "content": "What is in the picture?"}]
        assert identity.render_chat(chat) == engine.render_chat(chat)
    finally:
        engine.close()
