"""Vision-language prompts through the engine: image digests in the block keys, the
vision-embedding cache, cached == uncached (tiny random-weight llava via mlx-vlm)."""

from __future__ import annotations

import numpy as np
import pytest
from vlm_helpers import LogitsRecorder, image, request, run

from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig, SSDConfig
from promptcache.engine.api import GenerationRequest, ImageInput, image_digest
from promptcache.engine.engine import Engine
from promptcache.engine.models.vision_cache import VisionCache
from promptcache.errors import RequestError
from promptcache.serving_config import EngineConfig

BLOCK, CHUNK = 16, 32
A, B, C = image(1), image(2, 64, 30), image(3)
TURN1 = [{"role": "user", "content": "Look at this picture <image> and tell me what you see."}]


def make(path, *, cache=True, vision=True, ssd=None, vision_dir=None, budget=64 << 20,
         chunk=CHUNK):
    cc = CacheConfig(block_size=BLOCK, ram_budget_bytes=budget)
    rec = LogitsRecorder()
    eng = Engine.load(path, EngineConfig(restore_plan="load", prefill_chunk_tokens=chunk), cc,
                      cache=build_cache(cc, ssd) if cache else None, logits_hook=rec,
                      vision_cache=VisionCache(8 << 20, vision_dir) if vision else None)
    eng.recorder = rec  # type: ignore[attr-defined]
    return eng


@pytest.fixture(scope="module")
def reference(tiny_vlm_path):
    """No prompt cache, no vision cache, the whole prompt in one prefill chunk (so no
    chunk starts inside an image): every request computed in full."""
    eng = make(tiny_vlm_path, cache=False, vision=False, chunk=4096)
    yield eng
    eng.close()


def conversation(engine, reference, rid):
    """Three turns (one image, then two, then none new); asserts cached == uncached
    for each (tokens exact, logits within float tolerance); returns the results."""
    msgs = list(TURN1)
    turns = [(msgs, [A])]
    results = []
    for i in range(3):
        messages, images = turns[-1]
        got = run(engine, messages, images, request_id=f"{rid}-{i}")
        ref = run(reference, messages, images, request_id=f"{rid}-ref-{i}")
        assert got.error is None and ref.error is None
        assert got.tokens == ref.tokens
        mine = engine.recorder.by_request[f"{rid}-{i}"]
        theirs = reference.recorder.by_request[f"{rid}-ref-{i}"]
        assert len(mine) == len(theirs) == len(got.tokens)
        for x, y in zip(mine, theirs, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-4)
        results.append(got)
        nxt = [*messages, {"role": "assistant", "content": got.text}]
        if i == 0:
            turns.append(([*nxt, {"role": "user", "content": "Now compare with <image> ok"}],
                          [A, B]))
        else:
            turns.append(([*nxt, {"role": "user", "content": "Which came first?"}], [A, B]))
    return results


def test_tiny_vlm_loads_through_mlx_vlm(tiny_vlm_path):
    eng = make(tiny_vlm_path, cache=False)
    try:
        info = eng.vision
        assert info is not None and info.model_type == "llava"
        assert info.image_token == "<image>" and info.tokens_per_image == 64
        assert type(eng.vision_encoder.tower.vlm).__module__.startswith("mlx_vlm.models.llava")
        # the image changes the output distribution (the features reach the model)
        ra = run(eng, TURN1, [A], request_id="a")
        rc = run(eng, TURN1, [C], request_id="c")
        assert ra.error is None and rc.error is None
        la, lc = eng.recorder.by_request["a"][0], eng.recorder.by_request["c"][0]
        assert float(np.abs(la - lc).max()) > 1e-3
    finally:
        eng.close()


def test_cached_equals_uncached_one_and_two_images_from_ram(tiny_vlm_path, reference):
    eng = make(tiny_vlm_path)
    try:
        r1, r2, r3 = conversation(eng, reference, "ram")
        n1 = r1.usage.prompt_tokens
        assert r1.usage.cached_tokens == 0
        assert r2.usage.cached_tokens >= n1  # turn 1's prompt and image, from RAM
        assert r3.usage.cached_tokens >= r2.usage.prompt_tokens
        assert set(r2.usage.cached_by_tier) == {"ram"}
        # A encoded in turn 1, B in turn 2, nothing in turn 3
        assert eng.vision_encoder.tower_calls == 2
    finally:
        eng.close()


def test_cached_equals_uncached_from_ssd_after_restart(tiny_vlm_path, reference, tmp_path):
    ssd = SSDConfig(path=tmp_path / "blocks", policy="write_through", fsync=False)
    vdir = tmp_path / "vision"
    first = make(tiny_vlm_path, ssd=ssd, vision_dir=vdir)
    try:
        conversation(first, reference, "ssd1")
        first.vision_encoder.cache.flush()
        assert first.stats()["vision"]["ssd_writes"] == 2
    finally:
        first.close()
    second = make(tiny_vlm_path, ssd=ssd, vision_dir=vdir)
    try:
        r1, r2, r3 = conversation(second, reference, "ssd2")
        assert r1.usage.cached_by_tier == {"ssd": r1.usage.prompt_tokens - 1}
        assert "ssd" in r3.usage.cached_by_tier
        assert second.vision_encoder.tower_calls == 0  # every image inside a cached prefix
        # the same image after other text: the prompt cache stops before it, the
        # vision features come back from the SSD folder
        other = [{"role": "user", "content": "Other words first, then <image>"}]
        got = run(second, other, [B], request_id="x")
        ref = run(reference, other, [B], request_id="x-ref")
        assert got.tokens == ref.tokens
        v = second.stats()["vision"]
        assert second.vision_encoder.tower_calls == 0 and v["ssd_hits"] == 1
    finally:
        second.close()


def test_turn2_with_the_same_image_makes_no_vision_call(tiny_vlm_path):
    """Without the vision cache: the image lies in the cached prefix, so turn 2 does
    not even need its features."""
    eng = make(tiny_vlm_path, vision=False)
    try:
        r1 = run(eng, TURN1, [A])
        assert eng.vision_encoder.tower_calls == 1
        turn2 = [*TURN1, {"role": "assistant", "content": r1.text},
                 {"role": "user", "content": "And the colours?"}]
        r2 = run(eng, turn2, [A])
        assert r2.usage.cached_tokens >= r1.usage.prompt_tokens
        assert eng.vision_encoder.tower_calls == 1  # 0 calls in turn 2
    finally:
        eng.close()


def test_vision_cache_skips_the_tower_for_a_repeated_image(tiny_vlm_path):
    eng = make(tiny_vlm_path)
    try:
        run(eng, TURN1, [A])
        other = [{"role": "user", "content": "Something else entirely: <image>"}]
        r = run(eng, other, [A])
        assert r.error is None
        assert eng.vision_encoder.tower_calls == 1
        v = eng.stats()["vision"]
        assert v["ram_hits"] == 1 and v["misses"] == 1 and v["entries"] == 1
        assert v["bytes"] == 64 * 64 * 4  # 64 features x hidden 64, float32
    finally:
        eng.close()


def _image_starts(req: GenerationRequest) -> list[int]:
    return [im.start for im in req.images]


def test_a_different_image_stops_reuse_at_its_first_placeholder(tiny_vlm_path, reference):
    eng = make(tiny_vlm_path)
    try:
        run(eng, TURN1, [A])
        req = request(eng, TURN1, [C], request_id="c")
        (start,) = _image_starts(req)
        assert start % BLOCK != 0  # the image starts inside a block
        got = eng.submit(req).result()
        assert got.usage.cached_tokens == start  # exactly: not the block boundary before
        assert got.miss is not None and got.miss.position == start
        ref = run(reference, TURN1, [C])
        assert got.tokens == ref.tokens
    finally:
        eng.close()


def test_swapped_images_miss_at_the_first_image(tiny_vlm_path, reference):
    two = [{"role": "user", "content": "First <image> then <image> compare."}]
    eng = make(tiny_vlm_path)
    try:
        run(eng, two, [A, B])
        swapped = request(eng, two, [B, A])
        first, second = _image_starts(swapped)
        got = eng.submit(swapped).result()
        assert got.usage.cached_tokens == first
        assert got.tokens == run(reference, two, [B, A]).tokens
        # the same first image, another second one: reuse up to the second image
        other = request(eng, two, [A, C])
        got = eng.submit(other).result()
        assert got.usage.cached_tokens == second
        assert got.tokens == run(reference, two, [A, C]).tokens
    finally:
        eng.close()


def test_bad_image_requests_are_refused_and_store_nothing(tiny_vlm_path, tiny_llama_path):
    eng = make(tiny_vlm_path)
    try:
        good = request(eng, TURN1, [A])
        info = eng.vision
        im = good.images[0]
        cases = [
            GenerationRequest(prompt_tokens=good.prompt_tokens),  # placeholders, no image
            GenerationRequest(prompt_tokens=good.prompt_tokens, images=(
                ImageInput(im.digest, im.pixels, im.start + 1, im.length),)),
            GenerationRequest(prompt_tokens=good.prompt_tokens, images=(
                ImageInput(im.digest, im.pixels, im.start, im.length - 1),)),
            GenerationRequest(prompt_tokens=good.prompt_tokens, images=(
                ImageInput(b"short", im.pixels, im.start, im.length),)),
            GenerationRequest(prompt_tokens=good.prompt_tokens, images=(
                ImageInput(im.digest, im.pixels[:, :, :2], im.start, im.length),)),
        ]
        for bad in cases:
            with pytest.raises(RequestError):
                eng.submit(bad)
        assert eng.cache.stats().to_dict()["ram_blocks"] == 0
        assert info.tokens_per_image == im.length
    finally:
        eng.close()
    text = Engine.load(tiny_llama_path, cache=None)
    try:
        assert text.vision is None
        px = A
        with pytest.raises(RequestError, match="text-only"):
            text.submit(GenerationRequest(prompt_tokens=(1, 2, 3, 4), images=(
                ImageInput(image_digest(px, "x"), px, 0, 4),)))
    finally:
        text.close()


def test_digest_depends_on_pixels_and_settings_not_encoding():
    a = image(7)
    assert image_digest(a, "s") == image_digest(a.copy(), "s")
    assert image_digest(a, "s") != image_digest(a, "t")
    b = a.copy()
    b[0, 0, 0] ^= 1
    assert image_digest(a, "s") != image_digest(b, "s")
    assert image_digest(a, "s") != image_digest(a.reshape(48, 40, 3), "s")


def test_image_requests_batched_together_equal_alone(tiny_vlm_path, reference):
    """Three image prompts in flight at once (prefill interleaved, decode batched)."""
    eng = make(tiny_vlm_path)
    try:
        prompts = [(TURN1, [A]), ([{"role": "user", "content": "Two: <image> <image>"}], [B, C]),
                   ([{"role": "user", "content": "Just text, no picture."}], [])]
        handles = [eng.submit(request(eng, m, ims, max_tokens=8)) for m, ims in prompts]
        results = [h.result() for h in handles]
        assert eng.engine_stats()["max_batch"] >= 2
        for (m, ims), got in zip(prompts, results, strict=True):
            assert got.error is None
            assert got.tokens == run(reference, m, ims, max_tokens=8).tokens
    finally:
        eng.close()


def test_other_vlm_types_are_refused_at_load(tmp_path):
    from promptcache.engine.models.vlm import load_vlm

    with pytest.raises(ValueError, match="'qwen2_vl' is not supported yet"):
        load_vlm(tmp_path, {"model_type": "qwen2_vl", "vision_config": {"depth": 2}})


def test_a_prefix_that_ends_inside_an_image(tiny_vlm_path, reference):
    """A request stopped after two prefill chunks (32 + 32 tokens: both boundaries
    inside the image at 12..76) leaves blocks up to 64; the next request restores them
    and prefills the rest of the image from the features' matching rows."""
    from promptcache.engine.requests.request import Request, validate_request

    msgs = [{"role": "user", "content": "Look at this picture <image> and tell me."}]
    eng = make(tiny_vlm_path)
    try:
        req = request(eng, msgs, [A])
        (im,) = req.images
        assert im.start < 2 * CHUNK < im.end
        # driven on the test thread while the engine thread is idle
        first = Request(eng._ctx, req, validate_request(req, eng._ctx), lambda ev: None)
        first.start()
        assert not first.prefill_chunk() and not first.prefill_chunk()
        first.finish("cancelled")
        assert first.usage.saved_mid_prefill == 2 * CHUNK // BLOCK
        calls = eng.vision_encoder.tower_calls
        assert calls == 1
        got = run(eng, msgs, [A], request_id="mid")
        assert got.usage.cached_tokens == 2 * CHUNK
        assert eng.vision_encoder.tower_calls == calls  # features from the vision cache
        ref = run(reference, msgs, [A], request_id="mid-ref")
        assert got.tokens == ref.tokens
        for x, y in zip(eng.recorder.by_request["mid"], reference.recorder.by_request["mid-ref"],
                        strict=True):
            np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-4)
    finally:
        eng.close()


def test_engine_logits_equal_mlx_vlm_own_forward(tiny_vlm_path):
    """The first token's logits of an image prompt, chunked prefill (chunks of 32 start
    inside the image) vs mlx-vlm's own get_input_embeddings + language model over the
    whole prompt: our placeholder merge is mlx-vlm's."""
    import mlx.core as mx

    eng = make(tiny_vlm_path, cache=False)
    try:
        two = [{"role": "user", "content": "First <image> then <image> compare."}]
        req = request(eng, two, [A, B], max_tokens=1, request_id="own")
        assert any(im.start % CHUNK and im.start // CHUNK != (im.end - 1) // CHUNK
                   for im in req.images)
        assert eng.submit(req).result().error is None
        ours = eng.recorder.by_request["own"][0]
        tower = eng.vision_encoder.tower
        vlm = tower.vlm
        ids = mx.array([list(req.prompt_tokens)])
        feats = mx.concatenate([tower.encode(A), tower.encode(B)])[None]
        emb = vlm.get_input_embeddings(ids, mx.zeros((1, 3, 32, 32)),
                                       cached_image_features=feats).inputs_embeds
        theirs = np.array(vlm.language_model(ids, inputs_embeds=emb).logits[0, -1])
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    finally:
        eng.close()
