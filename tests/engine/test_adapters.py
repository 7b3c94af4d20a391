"""Cache objects <-> block payloads: round trips per cache type, exact restored states."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from promptcache.engine.payload.adapters import (
    BlockSpan,
    extract_block,
    is_truncatable,
    kv_spec,
    payload_nbytes,
    restore,
)
from promptcache.engine.payload.payload import MLXPayloadAdapter
from promptcache.errors import InvariantError

BS = 8


@pytest.fixture(scope="module")
def llama(tiny_llama_path):
    model, tok = load(str(tiny_llama_path))
    return model


@pytest.fixture(scope="module")
def gemma(tiny_gemma_path):
    model, tok = load(str(tiny_gemma_path))
    return model


@pytest.fixture(scope="module")
def hybrid(tiny_hybrid_path):
    model, tok = load(str(tiny_hybrid_path))
    return model


def _tokens(n, seed=0):
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 1000, size=n)]


def _prefill(model, caches, tokens, chunk):
    logits = None
    for i in range(0, len(tokens), chunk):
        logits = model(mx.array(tokens[i : i + chunk])[None], cache=caches)
    mx.eval(logits)
    return logits


def _blocks_of(caches, start, end, snapshot_end=None):
    out = []
    for s in range(start, end, BS):
        e = min(s + BS, end)
        out.append((BlockSpan(s, e), extract_block(caches, s, e, snapshot=(e == snapshot_end))))
    return out


def _next_logits(model, caches, token):
    out = model(mx.array([token])[None], cache=caches)
    mx.eval(out)
    return np.array(out[0, -1])


def test_kvcache_round_trip_at_every_position(llama):
    toks = _tokens(40)
    caches = make_prompt_cache(llama)
    _prefill(llama, caches, toks, 16)
    blocks = _blocks_of(caches, 0, 40)
    assert [(b.start, b.end) for b, _ in blocks] == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40)]
    p0 = blocks[0][1]
    assert sorted(p0) == ["0.k", "0.v", "1.k", "1.v"]
    assert p0["0.k"].shape == (1, 2, 8, 16)
    assert payload_nbytes(p0) == 4 * 2 * 8 * 16 * 4
    for n in (1, 7, 8, 21, 39):
        restored = restore(llama, blocks, n)
        assert [c.offset for c in restored] == [n, n]
        assert restored[0].keys.shape[2] == n
        ref = make_prompt_cache(llama)
        _prefill(llama, ref, toks[:n], 16)
        got = _next_logits(llama, restored, toks[n])
        want = _next_logits(llama, ref, toks[n])
        np.testing.assert_allclose(got, want, atol=1e-4)
        # restore copies the stored KV bit for bit; a prefill of another shape (``ref``)
        # agrees only within float tolerance (multithreaded BLAS splits work by shape)
        assert np.array_equal(np.array(restored[0].keys[..., :n, :]), np.array(caches[0].keys[..., :n, :]))
        np.testing.assert_allclose(np.array(restored[0].keys[..., :n, :]),
                                   np.array(ref[0].keys[..., :n, :]), atol=1e-5)


def test_payload_is_a_copy_not_a_view(llama):
    toks = _tokens(16)
    caches = make_prompt_cache(llama)
    _prefill(llama, caches, toks, 16)
    p = extract_block(caches, 0, 8, snapshot=False)
    before = np.array(p["0.k"])
    caches[0].keys[..., 0:8, :] = mx.zeros_like(caches[0].keys[..., 0:8, :])
    mx.eval(caches[0].keys)
    assert np.array_equal(np.array(p["0.k"]), before)


def test_quantized_round_trip(llama):
    # the tiny llama's head_dim (16) is below mlx's smallest quantization group (32):
    # feed a QuantizedKVCache with head_dim 64 directly (as the attention layers would)
    mx.random.seed(5)
    q = [QuantizedKVCache(group_size=32, bits=8) for _ in range(2)]
    for c in q:
        for n in (13, 1, 1, 15):  # a prefill chunk, two decode steps, another chunk
            k = mx.random.normal((1, 2, n, 64))
            c.update_and_fetch(k, k * 2)
    assert q[0].offset == 30 and q[0].keys[0].shape[2] == 256
    assert is_truncatable(q)
    assert kv_spec(llama, q) == "float32/q8g32;q*2"
    blocks = _blocks_of(q, 0, 30)
    assert sorted(blocks[0][1]) == [f"{layer}.{kv_}.{i}" for layer in "01" for kv_ in "kv" for i in range(3)]
    assert blocks[-1][1]["1.v.1"].shape == (1, 2, 6, 2)
    template = [QuantizedKVCache(group_size=32, bits=8) for _ in range(2)]
    for n in (5, 16, 30):
        restored = restore(template, blocks, n)
        assert all(isinstance(c, QuantizedKVCache) and c.offset == n for c in restored)
        for part_r, part_q in zip(restored[1].keys, q[1].keys, strict=True):
            assert np.array_equal(np.array(part_r), np.array(part_q[..., :n, :]))
        assert (restored[0].bits, restored[0].group_size) == (8, 32)
        # the restored cache keeps working: one more token appends at position n
        k = mx.random.normal((1, 2, 1, 64))
        restored[0].update_and_fetch(k, k)
        assert restored[0].offset == n + 1


def test_rotating_extract_after_rotation_matches_full_prefill(gemma):
    caches = make_prompt_cache(gemma)
    kinds = [type(c).__name__ for c in caches]
    assert kinds == ["RotatingKVCache", "RotatingKVCache", "KVCache"] * 2
    toks = _tokens(45, seed=2)
    # prefill 20, then 25 single-token decode steps: the window buffer rotates
    _prefill(gemma, caches, toks[:20], 20)
    stored = _blocks_of(caches, 0, 16)  # [0, 8), [8, 16): still in the window
    for t in toks[20:45]:
        gemma(mx.array([t])[None], cache=caches)
        mx.eval([c.keys for c in caches])
    rot = caches[0]
    assert rot.offset == 45 and rot.keys.shape[2] == 16 and rot._idx != 16
    # the last 16 tokens are in the window; extract [32, 40) and [40, 45) from the rotated buffer
    ref = make_prompt_cache(gemma)
    _prefill(gemma, ref, toks[:45], 45)  # reference: one concat, temporal order
    for s, e in ((32, 40), (40, 45), (30, 45)):
        got = extract_block(caches, s, e, snapshot=False)
        want = extract_block(ref, s, e, snapshot=False)
        for name in ("0.k", "0.v", "2.k", "4.v"):
            np.testing.assert_allclose(np.array(got[name]), np.array(want[name]), atol=1e-4)
    with pytest.raises(InvariantError, match="no longer in the sliding window"):
        extract_block(caches, 16, 24, snapshot=False)
    # restore at 45 from blocks (the full-attention layers need every block)
    blocks = stored + _blocks_of(ref, 16, 45)
    restored = restore(gemma, blocks, 45)
    assert restored[0].offset == 45 and restored[0].keys.shape[2] == 16
    got = _next_logits(gemma, restored, 7)
    want = _next_logits(gemma, caches, 7)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_rotating_restore_short_and_chunked_continuation(gemma):
    toks = _tokens(60, seed=3)
    caches = make_prompt_cache(gemma)
    _prefill(gemma, caches, toks[:48], 16)
    blocks = _blocks_of(caches, 40, 48)
    full = make_prompt_cache(gemma)
    _prefill(gemma, full, toks[:40], 40)
    blocks = _blocks_of(full, 0, 40) + blocks
    for n in (3, 16, 17, 37, 48):
        restored = restore(gemma, blocks, n)
        assert restored[0].keys.shape[2] == min(n, 16)
        want = _prefill(gemma, make_prompt_cache(gemma), toks[: n + 12], 64)
        got = _prefill(gemma, restored, toks[n : n + 12], 5)
        np.testing.assert_allclose(np.array(got[0, -1]), np.array(want[0, -1]), atol=1e-4)


def test_rotating_keep_tokens():
    c = RotatingKVCache(max_size=8, keep=2)
    ks = mx.arange(20, dtype=mx.float32).reshape(1, 1, 20, 1)
    c.update_and_fetch(ks[..., :10, :], ks[..., :10, :])
    for i in range(10, 20):
        c.update_and_fetch(ks[..., i : i + 1, :], ks[..., i : i + 1, :])
    p = extract_block([c], 0, 2, snapshot=False)
    assert np.array(p["0.k"]).ravel().tolist() == [0.0, 1.0]
    p = extract_block([c], 14, 20, snapshot=False)
    assert np.array(p["0.k"]).ravel().tolist() == [14.0, 15.0, 16.0, 17.0, 18.0, 19.0]
    blocks = [(BlockSpan(s, s + 4), {"0.k": ks[..., s : s + 4, :], "0.v": ks[..., s : s + 4, :]}) for s in range(0, 20, 4)]
    r = restore([RotatingKVCache(max_size=8, keep=2)], blocks, 19)[0]
    assert np.array(r.keys).ravel().tolist() == [0.0, 1.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0]
    assert (r.offset, r.keep, r.max_size) == (19, 2, 8)


def test_hybrid_snapshot_round_trip(hybrid):
    caches = make_prompt_cache(hybrid)
    assert [type(c).__name__ for c in caches] == ["ArraysCache", "KVCache", "ArraysCache", "KVCache"]
    assert not is_truncatable(caches)
    toks = _tokens(30, seed=4)
    _prefill(hybrid, caches, toks[:24], 8)
    blocks = _blocks_of(caches, 0, 24, snapshot_end=24)
    assert sorted(k for k in blocks[-1][1] if ".s." in k) == ["0.s.0", "0.s.1", "2.s.0", "2.s.1"]
    assert not any(".s." in k for k in blocks[0][1])
    restored = restore(hybrid, blocks, 24)
    got = _prefill(hybrid, restored, toks[24:30], 6)
    want = _prefill(hybrid, make_prompt_cache(hybrid), toks[:30], 30)
    np.testing.assert_allclose(np.array(got[0, -1]), np.array(want[0, -1]), atol=1e-4)
    with pytest.raises(ValueError, match="only at a snapshot"):
        restore(hybrid, blocks, 20)
    with pytest.raises(ValueError, match="no state snapshot"):
        restore(hybrid, blocks[:2], 16)


def test_cachelist_names_and_round_trip():
    ks = mx.arange(12, dtype=mx.float32).reshape(1, 1, 12, 1)
    kv = KVCache()
    kv.update_and_fetch(ks, ks)
    arr = ArraysCache(1)
    arr[0] = mx.ones((1, 3))
    caches = [CacheList(kv, arr)]
    assert not is_truncatable(caches)
    p = extract_block(caches, 8, 12, snapshot=True)
    assert sorted(p) == ["0.0.k", "0.0.v", "0.1.s.0"]
    blocks = [(BlockSpan(0, 8), extract_block(caches, 0, 8, snapshot=False)), (BlockSpan(8, 12), p)]
    r = restore([CacheList(KVCache(), ArraysCache(1))], blocks, 12)[0]
    assert isinstance(r, CacheList) and r.caches[0].offset == 12
    assert np.array(r.caches[1][0]).tolist() == [[1.0, 1.0, 1.0]]


def test_bad_ranges_and_non_contiguous_blocks(llama):
    caches = make_prompt_cache(llama)
    _prefill(llama, caches, _tokens(10), 10)
    with pytest.raises(ValueError, match="0 <= start < end"):
        extract_block(caches, 5, 5, snapshot=False)
    with pytest.raises(InvariantError, match="holds 10 tokens"):
        extract_block(caches, 8, 16, snapshot=False)
    b0 = (BlockSpan(0, 8), extract_block(caches, 0, 8, snapshot=False))
    b1 = (BlockSpan(9, 10), extract_block(caches, 9, 10, snapshot=False))
    with pytest.raises(ValueError, match="not contiguous"):
        restore(llama, [b0, b1], 10)
    with pytest.raises(ValueError, match="fewer than num_tokens"):
        restore(llama, [b0], 9)


def test_payload_adapter_bfloat16_round_trip():
    ad = MLXPayloadAdapter()
    payload = {"0.k": mx.arange(6, dtype=mx.bfloat16).reshape(1, 1, 3, 2), "0.v": mx.ones((1, 1, 3, 2))}
    assert ad.nbytes(payload) == 6 * 2 + 6 * 4
    buffer, layout = ad.to_buffer(payload)  # a plain dict is packed into one buffer
    assert buffer.dtype == np.uint8 and layout == "0.k=raw:bfloat16:1x1x3x2;0.v=raw:float32:1x1x3x2"
    back = ad.from_buffer(buffer, layout)
    assert back["0.k"].dtype == mx.bfloat16 and back["0.v"].dtype == mx.float32
    assert np.array(back["0.k"].astype(mx.float32)).ravel().tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="bad layout item"):
        ad.from_buffer(buffer, "0.k=raw:float8:1x1x3x2")


def test_kv_spec_strings(llama, gemma, hybrid):
    assert kv_spec(llama) == "float32;kv*2"
    assert kv_spec(gemma) == "float32;r16k0*2,kv,r16k0*2,kv"
    assert kv_spec(hybrid) == "float32;s2,kv,s2,kv"


def test_restore_reserve_allocates_room_and_keeps_values(llama):
    toks = _tokens(40, seed=9)
    caches = make_prompt_cache(llama)
    _prefill(llama, caches, toks[:30], 16)
    blocks = _blocks_of(caches, 0, 30)
    plain = restore(llama, blocks, 21)
    roomy = restore(llama, blocks, 21, reserve=10)
    assert plain[0].keys.shape[2] == 21
    # the room comes in whole blocks: 21 + 10 -> 4 blocks of 8
    assert roomy[0].keys.shape[2] == 32 and roomy[0].offset == 21
    assert np.array_equal(np.array(roomy[0].keys[..., :21, :]), np.array(plain[0].keys))
    a = _prefill(llama, plain, toks[21:30], 9)
    b = _prefill(llama, roomy, toks[21:30], 9)
    assert roomy[0].keys.shape[2] == 32  # written in place: no reallocation
    # the same values in buffers of another layout (21 -> 277 vs 32 slots): BLAS may
    # take other paths, so agreement within float32 noise, not bit for bit
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="reserve"):
        restore(llama, blocks, 21, reserve=-1)
