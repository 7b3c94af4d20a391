"""Gemma 3, Qwen3-VL and Qwen3.5 dense and MoE (tiny random-weight models of mlx-vlm's
classes) through the engine: images through mlx-vlm, the prompt cache exact (restored
== full prefill: greedy tokens identical, logits within 1e-4), logits equal mlx-vlm's
own forward, a turn that keeps its image reuses the cached prefix and makes no tower
call, text-only requests, batched decode; Qwen's M-RoPE positions equal mlx-vlm's
``get_rope_index`` and travel with the cached state. Qwen3.5 is a hybrid (gated delta
net + attention): mlx-lm's linear-attention layers, mlx-vlm's attention layers."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from vlm_helpers import LogitsRecorder, image, request, run

from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig
from promptcache.engine.engine import Engine
from promptcache.engine.models.loader import load_model_or_vlm
from promptcache.engine.models.vision_cache import VisionCache
from promptcache.engine.models.vlm_text import HybridMRopeTextModel, mrope_positions
from promptcache.serving_config import EngineConfig

BLOCK, CHUNK = 16, 32
A, B, C = image(1), image(2, 64, 30), image(3)
FAMILIES = ("gemma3", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
QWEN = ("qwen3_vl", "qwen3_5", "qwen3_5_moe")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> tuple[str, Path]:
    name = str(request.param)
    fixture = {"gemma3": "tiny_gemma3_vlm_path", "qwen3_vl": "tiny_qwen3_vl_path",
               "qwen3_5": "tiny_qwen3_5_vlm_path",
               "qwen3_5_moe": "tiny_qwen3_5_moe_vlm_path"}[name]
    return name, Path(request.getfixturevalue(fixture))


def turn1(name: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Look at this picture {text(name)} and tell me "
                                        "what you see."}]


def text(name: str) -> str:
    return ("<start_of_image>" if name == "gemma3"
            else "<|vision_start|><|image_pad|><|vision_end|>")


def make(path: Path, *, cache: bool = True, vision: bool = True, chunk: int = CHUNK) -> Engine:
    cc = CacheConfig(block_size=BLOCK, ram_budget_bytes=64 << 20)
    rec = LogitsRecorder()
    eng = Engine.load(path, EngineConfig(restore_plan="load", prefill_chunk_tokens=chunk, snapshot_every_blocks=1),
                      cc, cache=build_cache(cc) if cache else None, logits_hook=rec,
                      vision_cache=VisionCache(8 << 20) if vision else None)
    eng.recorder = rec  # type: ignore[attr-defined]
    return eng


@pytest.fixture(scope="module")
def reference(family: tuple[str, Path]) -> Any:
    """No prompt cache, no vision cache, each prompt in one prefill chunk."""
    eng = make(family[1], cache=False, vision=False, chunk=4096)
    yield eng
    eng.close()


def same(engine: Engine, reference: Engine, got: Any, ref: Any, rid: str) -> None:
    assert got.error is None and ref.error is None
    assert got.tokens == ref.tokens
    mine = engine.recorder.by_request[rid]  # type: ignore[attr-defined]
    theirs = reference.recorder.by_request[rid + "-ref"]  # type: ignore[attr-defined]
    assert len(mine) == len(theirs) == len(got.tokens)
    for x, y in zip(mine, theirs, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-4)


def both(engine: Engine, reference: Engine, messages: list[dict[str, Any]],
         images: list[np.ndarray], rid: str, **kw: Any) -> Any:
    got = run(engine, messages, images, request_id=rid, **kw)
    ref = run(reference, messages, images, request_id=rid + "-ref", **kw)
    same(engine, reference, got, ref, rid)
    return got


# ---------------------------------------------------------------- loading


def test_loads_images_through_mlx_vlm_and_says_so(family, caplog):
    name, path = family
    with caplog.at_level(logging.INFO, logger="promptcache.engine.models.loader"):
        model, _tok, info, tower = load_model_or_vlm(path)
    assert tower is not None and info.model_type == name
    assert any(f"family '{name}'" in r.getMessage()
               and "images through mlx-vlm" in r.getMessage() for r in caplog.records)
    assert type(tower.vlm).__module__ == f"mlx_vlm.models.{name}.{name}"
    vi = tower.info
    assert vi.tokens_per_image == 36
    caches = make_prompt_cache(model)
    if name == "gemma3":
        assert (vi.image_token, vi.text) == ("<start_of_image>", "<start_of_image>")
        assert vi.placeholder_id == vi.image_token_id + 1  # <image_soft_token>
        assert vi.before == (201, 201, vi.image_token_id)  # "\n\n" + <start_of_image>
        assert vi.after == (vi.image_token_id + 2, 201, 201)  # <end_of_image> + "\n\n"
        assert [type(c) for c in caches] == [RotatingKVCache, KVCache]
        assert caches[0].max_size == 512 and tower.side == 0
        assert tower.encode(A).shape == (36, 64)
    else:
        assert vi.image_token == "<|image_pad|>" and vi.placeholder_id == vi.image_token_id
        assert vi.text == "<|vision_start|><|image_pad|><|vision_end|>"
        assert (vi.before, vi.after) == ((), ())
        assert tower.side == 48 and model.grid == (1, 6, 6)
    if name == "qwen3_vl":
        assert [type(c) for c in caches] == [KVCache, KVCache, ArraysCache]
        assert model.deepstack_layers == 2
        assert tower.encode(A).shape == (36, 64 * 3)  # features + 2 deepstack layers
    elif name != "gemma3":
        # 3 gated delta nets (mlx-lm's layers and ArraysCache) + 1 attention layer
        # (mlx-vlm's, M-RoPE), then the position delta
        assert isinstance(model, HybridMRopeTextModel) and model.deepstack_layers == 0
        assert [type(c) for c in caches] == [ArraysCache] * 3 + [KVCache, ArraysCache]
        assert type(model.text).__module__ == "mlx_lm.models.qwen3_5"
        assert not model.text.training  # eval mode, as mlx-lm loads it
        assert [type(x).__module__ for x in model.layers] == ["mlx_lm.models.qwen3_5"] * 4
        # the attention layer that runs is mlx-vlm's (it takes M-RoPE position ids)
        vlm_module = f"mlx_vlm.models.{name}.language"
        assert type(model.vlm_layers[3]).__module__ == vlm_module
        assert not model.layers[3].is_linear and model.offset_layer == 3
        assert tower.encode(A).shape == (36, 64)  # no deepstack
        # the weights are the VLM's arrays, shared, not copied
        ours = dict(tree_flatten(model.text.parameters()))
        theirs = dict(tree_flatten(tower.vlm.language_model.parameters()))
        assert ours.keys() == theirs.keys()
        assert all(ours[k] is theirs[k] for k in ours)


def test_image_changes_the_output(family):
    name, path = family
    eng = make(path, cache=False)
    try:
        ra = run(eng, turn1(name), [A], request_id="a")
        rc = run(eng, turn1(name), [C], request_id="c")
        assert ra.error is None and rc.error is None
        la, lc = eng.recorder.by_request["a"][0], eng.recorder.by_request["c"][0]
        assert float(np.abs(la - lc).max()) > 1e-3
    finally:
        eng.close()


# ---------------------------------------------------------------- exactness


def test_engine_logits_equal_mlx_vlm_own_forward(family):
    """Chunked prefill (chunks start inside the images), then batched decode, vs
    mlx-vlm's own ``get_input_embeddings`` + language model over the whole sequence
    (for Qwen with mlx-vlm's own M-RoPE positions, and Qwen3-VL's deepstack merge): the
    logits of the first token and of the three decode steps after it (positions
    continue from the image's delta)."""
    name, path = family
    eng = make(path, cache=False)
    try:
        two = [{"role": "user", "content": f"First {text(name)} then {text(name)} compare."}]
        req = request(eng, two, [A, B], max_tokens=4, request_id="own")
        assert all(im.start // CHUNK != (im.end - 1) // CHUNK for im in req.images)
        got = eng.submit(req).result()
        assert got.error is None and len(got.tokens) == 4
        ours = np.stack(eng.recorder.by_request["own"])
        tower = eng.vision_encoder.tower
        vlm = tower.vlm
        seq = [*req.prompt_tokens, *got.tokens[:-1]]
        ids = mx.array([seq])
        procs = [tower.preprocess(px) for px in (A, B)]
        pv = mx.array(np.concatenate([p["pixel_values"] for p in procs]).astype(np.float32))
        if name == "gemma3":
            feats = vlm.get_input_embeddings(ids, pv, mask=mx.ones_like(ids))
            out = vlm.language_model(ids, inputs_embeds=feats.inputs_embeds)
        else:
            grid = mx.array(np.concatenate([p["image_grid_thw"] for p in procs]))
            feats = vlm.get_input_embeddings(ids, pv, image_grid_thw=grid)
            extra = ({} if name != "qwen3_vl" else
                     {"visual_pos_masks": feats.visual_pos_masks,
                      "deepstack_visual_embeds": feats.deepstack_visual_embeds})
            out = vlm.language_model(ids, inputs_embeds=feats.inputs_embeds,
                                     position_ids=feats.position_ids, **extra)
        theirs = np.array(out.logits[0, len(req.prompt_tokens) - 1:])
        assert theirs.shape == ours.shape
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    finally:
        eng.close()


@pytest.fixture(params=QWEN[:2])
def qwen(request: pytest.FixtureRequest) -> tuple[str, Path]:
    name = str(request.param)
    fixture = "tiny_qwen3_vl_path" if name == "qwen3_vl" else "tiny_qwen3_5_vlm_path"
    return name, Path(request.getfixturevalue(fixture))


def test_mrope_positions_equal_mlx_vlm_get_rope_index(qwen):
    """Ours against mlx-vlm's ``get_rope_index`` of Qwen3-VL and of Qwen3.5 (each
    family's own copy)."""
    name, path = qwen
    eng = make(path, cache=False)
    try:
        t = text(name)
        eng_req = request(eng, [{"role": "user", "content": f"First {t} then {t} compare."}],
                          [A, B])
        tower = eng.vision_encoder.tower
    finally:
        eng.close()
    ids = list(eng_req.prompt_tokens)
    n = len(ids)
    grid = mx.array([[1, 12, 12], [1, 12, 12]])
    theirs, deltas = tower.vlm.language_model.get_rope_index(mx.array([ids]), grid)
    theirs = np.array(theirs)[:, 0, :]
    ours, delta = mrope_positions(eng_req.images, (1, 6, 6), 0, n)
    np.testing.assert_array_equal(ours, theirs)
    assert delta == int(np.array(deltas)[0, 0]) == 2 * (6 - 36)
    # any chunking gives the same positions, and the delta after a chunk is what the
    # text after it would add
    a, b = eng_req.images
    for cut in (a.start, a.start + 7, a.end, b.start + 35, b.end, n - 1):
        left, d_left = mrope_positions(eng_req.images, (1, 6, 6), 0, cut)
        right, _ = mrope_positions(eng_req.images, (1, 6, 6), cut, n)
        np.testing.assert_array_equal(np.concatenate([left, right], axis=1), theirs)
        assert d_left == {a.start: 0, a.start + 7: 0, a.end: -30, b.start + 35: -30,
                          b.end: -60, n - 1: -60}[cut]


@pytest.fixture(params=QWEN[1:])
def hybrid(request: pytest.FixtureRequest) -> tuple[str, Path]:
    name = str(request.param)
    fixture = "tiny_qwen3_5_vlm_path" if name == "qwen3_5" else "tiny_qwen3_5_moe_vlm_path"
    return name, Path(request.getfixturevalue(fixture))


def test_qwen3_5_text_equals_mlx_lm_text_only(hybrid):
    """Text through the vision model's language model (chunked, on its caches) equals
    mlx-lm's own Qwen3.5 loaded text-only from the same folder (what promptcache served
    before images), within 1e-4; its gated-delta-net layers are mlx-lm's."""
    from promptcache.engine.models.loader import load_model

    _name, path = hybrid
    model, _tok, _info, _tower = load_model_or_vlm(path)
    lm, _tok2, info = load_model(path)
    assert type(lm).__module__.startswith("mlx_lm.models.qwen3_5")
    ids = mx.array([list(range(40, 80))])
    caches = make_prompt_cache(model)
    ours = mx.concatenate([model(ids[:, :13], cache=caches), model(ids[:, 13:30], cache=caches),
                           *[model(ids[:, i:i + 1], cache=caches) for i in range(30, 40)]],
                          axis=1)
    theirs = lm(ids)
    np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=1e-4, rtol=1e-4)


def test_qwen3_5_with_4_bit_weights(tiny_qwen3_5_vlm_path, tmp_path):
    """A 4-bit Qwen3.5 (language model quantized, as mlx-vlm writes it): mlx-lm's layers
    are quantized as mlx-vlm's are before the weights are shared, and the logits equal
    mlx-vlm's own forward."""
    import json
    import shutil

    from mlx.nn.layers.quantized import QuantizedLinear, quantize
    from mlx_vlm.utils import load_model

    folder = tmp_path / "q4"
    shutil.copytree(tiny_qwen3_5_vlm_path, folder)
    vlm = load_model(folder)
    quantize(vlm.language_model, 32, 4)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(vlm.parameters())),
                        metadata={"format": "mlx"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    model, _tok, _info, tower = load_model_or_vlm(folder)
    assert isinstance(model.text.model.layers[0].linear_attn.in_proj_qkv, QuantizedLinear)
    assert isinstance(model.text.lm_head, QuantizedLinear)
    ids = mx.array([list(range(40, 80))])
    ours = model(ids, cache=make_prompt_cache(model))
    theirs = tower.vlm.language_model(ids).logits
    np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- the cache


def test_conversation_cached_equals_full_prefill(family, reference):
    """Three turns (one image; then a second one; then text only): every turn equal to
    a full prefill; turns 2 and 3 restore the previous turn (image included) and the
    tower runs once per new image only."""
    name, path = family
    eng = make(path)
    try:
        msgs = turn1(name)
        r1 = both(eng, reference, msgs, [A], "t1")
        assert r1.usage.cached_tokens == 0 and eng.vision_encoder.tower_calls == 1
        msgs2 = [*msgs, {"role": "assistant", "content": r1.text},
                 {"role": "user", "content": f"Now compare with {text(name)} ok"}]
        r2 = both(eng, reference, msgs2, [A, B], "t2")
        # Gemma 3 and Qwen3.5: turn 1's prompt (their random replies re-tokenize to
        # other tokens from the first one on; Qwen3.5, a hybrid: its end-of-prefill
        # snapshot); Qwen3-VL: prompt + reply[:-1], its end-of-generation snapshot
        assert (r1.usage.prompt_tokens, r2.usage.cached_tokens) == {
            "gemma3": (66, 66), "qwen3_vl": (62, 67), "qwen3_5": (62, 62),
            "qwen3_5_moe": (62, 62)}[name]
        assert eng.vision_encoder.tower_calls == 2  # B only
        msgs3 = [*msgs2, {"role": "assistant", "content": r2.text},
                 {"role": "user", "content": "Which came first?"}]
        r3 = both(eng, reference, msgs3, [A, B], "t3")
        assert (r2.usage.prompt_tokens, r3.usage.cached_tokens) == {
            "gemma3": (137, 137), "qwen3_vl": (126, 131), "qwen3_5": (129, 129),
            "qwen3_5_moe": (128, 128)}[name]
        assert eng.vision_encoder.tower_calls == 2  # nothing new
        assert set(r3.usage.cached_by_tier) == {"ram"}
        stats = eng.stats()["engine"]
        assert (stats["store_errors"], stats["restore_errors"]) == (0, 0)
    finally:
        eng.close()


def test_turn2_keeping_the_image_makes_no_tower_call(family, reference):
    """No vision cache: turn 2's image lies in the restored prefix, so its features are
    never needed."""
    name, path = family
    eng = make(path, vision=False)
    try:
        r1 = both(eng, reference, turn1(name), [A], "k1")
        msgs = [*turn1(name), {"role": "assistant", "content": r1.text},
                {"role": "user", "content": "And the colours?"}]
        r2 = both(eng, reference, msgs, [A], "k2")
        assert r2.usage.cached_tokens == {"gemma3": 66, "qwen3_vl": 67, "qwen3_5": 62,
                                          "qwen3_5_moe": 62}[name]
        assert eng.vision_encoder.tower_calls == 1
    finally:
        eng.close()


def test_a_prefix_that_ends_inside_an_image(family, reference):
    """A request stopped after its first prefill chunk (its end inside the image) leaves
    blocks up to 32; the next one restores them and prefills the rest of the image."""
    from promptcache.engine.requests.request import Request, validate_request

    name, path = family
    msgs = [{"role": "user", "content": f"A picture {text(name)} here."}]
    eng = make(path)
    try:
        req = request(eng, msgs, [A])
        (im,) = req.images
        assert im.start < CHUNK < im.end
        first = Request(eng._ctx, req, validate_request(req, eng._ctx), lambda ev: None)
        first.start()
        assert not first.prefill_chunk()
        first.finish("cancelled")
        assert first.usage.saved_mid_prefill == CHUNK // BLOCK
        got = run(eng, msgs, [A], request_id="mid")
        assert got.usage.cached_tokens == CHUNK
        assert eng.vision_encoder.tower_calls == 1  # features from the vision cache
        ref = run(reference, msgs, [A], request_id="mid-ref")
        same(eng, reference, got, ref, "mid")
    finally:
        eng.close()


def test_a_branch_restores_to_the_last_shared_message(family, reference):
    """Two follow-ups to the same image turn: the second restores the first one's state
    up to the start of the user message where they part (Qwen: the message-start
    snapshot; Gemma 3, truncatable: the first differing token)."""
    name, path = family
    eng = make(path)
    try:
        r1 = run(eng, turn1(name), [A], request_id="b0")
        base = [*turn1(name), {"role": "assistant", "content": r1.text}]
        both(eng, reference, [*base, {"role": "user", "content": "And the colours?"}], [A],
             "ba")
        req = request(eng, [*base, {"role": "user", "content": "Any shapes?"}], [A],
                      request_id="bb")
        got = eng.submit(req).result()
        ref = run(reference, [*base, {"role": "user", "content": "Any shapes?"}], [A],
                  request_id="bb-ref")
        same(eng, reference, got, ref, "bb")
        start = req.message_starts[-1]  # the last user message
        assert start == {"gemma3": 75, "qwen3_vl": 68, "qwen3_5": 71, "qwen3_5_moe": 70}[name]
        # Gemma 3 also reuses the shared tokens after the message start
        assert got.usage.cached_tokens == (80 if name == "gemma3" else start)
    finally:
        eng.close()


def test_a_different_image_stops_reuse_before_it(family, reference):
    name, path = family
    eng = make(path)
    try:
        run(eng, turn1(name), [A])
        req = request(eng, turn1(name), [C], request_id="c")
        (im,) = req.images
        got = eng.submit(req).result()
        # Gemma 3: exactly the image's first placeholder; Qwen (non-truncatable: the
        # position state is an array cache) the last snapshot (block boundary) before it
        assert got.usage.cached_tokens == (im.start if name == "gemma3"
                                           else im.start // BLOCK * BLOCK)
        ref = run(reference, turn1(name), [C], request_id="c-ref")
        same(eng, reference, got, ref, "c")
    finally:
        eng.close()


def test_image_and_text_requests_batched_equal_alone(family, reference):
    """Image prompts and a text-only one in flight together (decode batched: for Qwen
    each row with its own M-RoPE delta: -30, -60 and 0)."""
    name, path = family
    eng = make(path)
    try:
        t = text(name)
        prompts = [(turn1(name), [A]), ([{"role": "user", "content": f"Two: {t} {t}"}], [B, C]),
                   ([{"role": "user", "content": "Just text, no picture."}], [])]
        reqs = [request(eng, m, ims, max_tokens=8, request_id=f"b{i}")
                for i, (m, ims) in enumerate(prompts)]
        results = [h.result() for h in [eng.submit(r) for r in reqs]]
        assert eng.engine_stats()["max_batch"] == 3
        for i, ((m, ims), got) in enumerate(zip(prompts, results, strict=True)):
            ref = run(reference, m, ims, max_tokens=8, request_id=f"b{i}-ref")
            same(eng, reference, got, ref, f"b{i}")
    finally:
        eng.close()


def test_text_only_requests_cache_and_equal_a_full_prefill(family, reference):
    name, path = family
    eng = make(path)
    try:
        msgs = [{"role": "user", "content": "No images here, only words and more words "
                                            "to fill a few blocks of the prompt cache."}]
        r1 = both(eng, reference, msgs, [], "x1")
        r2 = both(eng, reference, msgs, [], "x2")
        n = r1.usage.prompt_tokens
        # an exact repeat re-runs the last token: Gemma 3 restores n - 1 tokens, Qwen
        # (non-truncatable) the last block-boundary snapshot before it
        assert n == 41
        assert r2.usage.cached_tokens == (40 if name == "gemma3" else 32)
        assert eng.vision_encoder.tower_calls == 0
    finally:
        eng.close()


def test_turn2_after_a_restart_restores_from_ssd(family, reference, tmp_path):
    """The restored state (for Qwen: KV and the position delta snapshot) comes back from
    the SSD tier after a restart and continues exactly."""
    from promptcache.config import SSDConfig

    name, path = family
    ssd = SSDConfig(path=tmp_path / "blocks", policy="write_through", fsync=False)
    cc = CacheConfig(block_size=BLOCK, ram_budget_bytes=64 << 20)

    def load() -> Engine:
        rec = LogitsRecorder()
        eng = Engine.load(path, EngineConfig(restore_plan="load", prefill_chunk_tokens=CHUNK,
                                             snapshot_every_blocks=1),
                          cc, cache=build_cache(cc, ssd), logits_hook=rec)
        eng.recorder = rec  # type: ignore[attr-defined]
        return eng

    first = load()
    try:
        r1 = both(first, reference, turn1(name), [A], "s1")
    finally:
        first.close()
    second = load()
    try:
        msgs = [*turn1(name), {"role": "assistant", "content": r1.text},
                {"role": "user", "content": "And the colours?"}]
        r2 = both(second, reference, msgs, [A], "s2")
        assert r2.usage.cached_by_tier == {"ssd": {"gemma3": 66, "qwen3_vl": 67, "qwen3_5": 62,
                                                   "qwen3_5_moe": 62}[name]}
        assert second.vision_encoder.tower_calls == 0
    finally:
        second.close()
