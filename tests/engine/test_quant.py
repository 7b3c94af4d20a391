"""KV quantization of blocks and one buffer per block: layouts, packing, extract and
restore into every cache kind, the payload adapter and the codec round trip."""

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
from models.quant_models import ensure_tiny_llama_hd64

from promptcache import codec
from promptcache.config import CacheConfig
from promptcache.engine.payload import blocklayout
from promptcache.engine.payload.adapters import (
    BlockSpan,
    extract_block,
    kv_spec,
    payload_arrays,
    payload_nbytes,
    restore,
)
from promptcache.engine.payload.blockbuf import BlockPayload, pack
from promptcache.engine.payload.blocklayout import Item, format_layout, parse_layout
from promptcache.engine.payload.payload import MLXPayloadAdapter
from promptcache.engine.payload.quant import KVQuant, from_config
from promptcache.hashing import hash_block
from promptcache.meta import BlockMeta, Namespace

BS = 8
Q8 = KVQuant(8, 64, 0)
Q4 = KVQuant(4, 64, 0)

_ROOT = Namespace("quant-codec", 4).root
_META = BlockMeta(hash_block(_ROOT, (1, 2, 3)), _ROOT, (1, 2, 3), 8)


@pytest.fixture(scope="module")
def hd64(tiny_llama_path, models_root):
    model, _ = load(str(ensure_tiny_llama_hd64(tiny_llama_path, models_root)))
    return model


@pytest.fixture(scope="module")
def llama(tiny_llama_path):
    model, _ = load(str(tiny_llama_path))
    return model


def _tokens(n, seed=0):
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 1000, size=n)]


def _prefilled(model, tokens):
    caches = make_prompt_cache(model)
    for i in range(0, len(tokens), 16):
        model(mx.array(tokens[i : i + 16])[None], cache=caches)
    mx.eval([c.keys for c in caches])
    return caches


def _blocks(caches, end, quant, bs=BS):
    return [(BlockSpan(s, min(s + bs, end)), extract_block(caches, s, min(s + bs, end), False, quant=quant))
            for s in range(0, end, bs)]


def _roundtrip(x, bits, group=64):
    return mx.dequantize(*mx.quantize(x, group_size=group, bits=bits), group_size=group, bits=bits)


def _logits(model, caches, token):
    out = model(mx.array([[token]]), cache=caches)
    mx.eval(out)
    return np.array(out[0, -1])


# ---------------------------------------------------------------- spec


def test_kv_quant_spec_and_validation():
    q = KVQuant(8)
    assert (q.bits, q.group_size, q.min_tokens, q.spec) == (8, 64, 256, "q8g64m256")
    assert KVQuant(4, 32, 0).spec == "q4g32m0"
    assert [q.group_for(d) for d in (64, 128, 96, 32, 16, 80)] == [64, 64, 32, 32, None, None]
    assert KVQuant(8, 128).group_for(256) == 128
    assert not q.applies_to(192) and q.applies_to(256)
    for bad in ({"bits": 3}, {"bits": True}, {"bits": 8, "group_size": 16}, {"bits": 8, "min_tokens": -1}):
        with pytest.raises(ValueError):
            KVQuant(**bad)
    assert from_config(CacheConfig()) is None
    assert from_config(CacheConfig(kv_bits=4, kv_group_size=32, kv_quant_min_tokens=0)) == KVQuant(4, 32, 0)
    for bad in ({"kv_bits": 6}, {"kv_group_size": 48}, {"kv_quant_min_tokens": -5}):
        with pytest.raises(ValueError):
            CacheConfig(**bad)


def test_kv_spec_carries_the_stored_quantization(llama):
    assert kv_spec(llama) == "float32;kv*2"
    assert kv_spec(llama, quant=KVQuant(8)) == "float32;kv*2;q8g64m256"
    assert kv_spec(llama, quant=KVQuant(4, 32, 0)) == "float32;kv*2;q4g32m0"


# ---------------------------------------------------------------- layouts


def test_layout_text_offsets_and_interning():
    items = [Item(str(i), "kv", "float32", (1, 2, 3, 64)) for i in range(3)]
    items += [Item("3", "q", "bfloat16", (1, 2, 3, 64), bits=8, group_size=64),
              Item("4.0", "s", "float32", (1, 5), index=1), Item("5", "kv", "float32", (1, 2, 3, 64))]
    text = format_layout(items)
    assert text == ("0-2=kv:float32:1x2x3x64;3=q8g64:bfloat16:1x2x3x64;4.0=s1:float32:1x5;"
                    "5=kv:float32:1x2x3x64")
    lay = parse_layout(text)
    assert lay is parse_layout(text)  # equal layouts are one object
    assert lay.items == tuple(items)
    # grouped by class (KV and packed values, scales, biases, snapshots), item order within
    assert list(lay.parts) == ["0.k", "0.v", "1.k", "1.v", "2.k", "2.v", "3.k.0", "3.v.0", "5.k",
                               "5.v", "3.k.1", "3.v.1", "3.k.2", "3.v.2", "4.0.s.1"]
    kv_bytes = 2 * 3 * 64 * 4  # 1536, a multiple of 64
    offsets = {n: p.offset for n, p in lay.parts.items()}
    assert offsets == {"0.k": 0, "0.v": 1536, "1.k": 3072, "1.v": 4608, "2.k": 6144, "2.v": 7680,
                       "3.k.0": 9216, "3.v.0": 9600, "5.k": 9984, "5.v": 11520,
                       "3.k.1": 13056, "3.v.1": 13120, "3.k.2": 13184, "3.v.2": 13248,
                       "4.0.s.1": 13312}
    q = lay.parts["3.k.0"]
    assert (q.nbytes, q.shape, q.dtype, q.strides) == (384, (1, 2, 3, 16), mx.uint32, (96, 48, 16, 1))
    scales = lay.parts["3.k.1"]
    assert (scales.nbytes, scales.shape, scales.dtype, scales.elem_offset) == (
        12, (1, 2, 3, 1), mx.bfloat16, 13056 // 2)
    assert all(p.offset % blocklayout.ALIGN == 0 for p in lay.parts.values())
    assert lay.parts["4.0.s.1"].nbytes == 20 and lay.nbytes == 13376
    # equal neighbours without a gap are one run (one mx.split on restore)
    assert [names for _, names in lay.runs] == [
        ("0.k", "0.v", "1.k", "1.v", "2.k", "2.v"), ("3.k.0", "3.v.0"), ("5.k", "5.v"),
        ("3.k.1",), ("3.v.1",), ("3.k.2",), ("3.v.2",), ("4.0.s.1",)]
    assert kv_bytes == 1536
    assert lay.num_tokens == 3 and lay.quantized
    assert sorted(lay.kv_items) == ["0", "1", "2", "3", "5"]


@pytest.mark.parametrize("text", [
    "0=kv:float32", "0=kv:float99:1x2", "0=zz:float32:1x2x3x4", "3-1=kv:float32:1x2x3x4",
    "0=q8g48:float32:1x2x3x64", "0=q7g64:float32:1x2x3x64", "0=q8g64:float32:1x2x3x48",
    "0=kv:float32:1x2x3", "0=kv:float32:1x2x3x4;0=kv:float32:1x2x3x4", "a b=raw:uint8:4",
    "0=kv:float32:1x2x3x4;1=kv:float32:1x2x5x4", "novalue",
])
def test_malformed_layouts_are_refused(text):
    with pytest.raises(ValueError):
        parse_layout(text)


def test_pack_is_one_buffer_with_exact_views():
    mx.random.seed(1)
    k, v = mx.random.normal((1, 2, 3, 64)), mx.random.normal((1, 2, 3, 64))
    state = mx.arange(5, dtype=mx.int32).reshape(1, 5)
    p = pack([(Item("0", "kv", "float32", (1, 2, 3, 64)), [k, v]),
              (Item("1", "s", "int32", (1, 5), index=0), [state])])
    assert isinstance(p, BlockPayload)
    assert p.buffer.dtype == mx.uint8 and p.buffer.ndim == 1
    assert p.nbytes == p.buffer.nbytes == 2 * 1536 + 64 == payload_nbytes(p)
    assert payload_arrays(p) == 1 and p.num_arrays == 1
    assert sorted(p) == ["0.k", "0.v", "1.s.0"] and len(p) == 3 and "0.k" in p and "0.x" not in p
    assert np.array_equal(np.array(p["0.k"]), np.array(k))
    assert np.array_equal(np.array(p["0.v"]), np.array(v))
    assert np.array(p["1.s.0"]).tolist() == [[0, 1, 2, 3, 4]]
    views = p.arrays()  # all parts at once: the same views
    assert sorted(views) == ["0.k", "0.v", "1.s.0"]
    assert all(np.array_equal(np.array(views[n]), np.array(p[n])) for n in views)
    with pytest.raises(ValueError, match="layout says"):
        pack([(Item("0", "kv", "float32", (1, 2, 3, 64)), [k, v[..., :2, :]])])
    with pytest.raises(ValueError, match="needs 2 arrays"):
        pack([(Item("0", "kv", "float32", (1, 2, 3, 64)), [k])])
    with pytest.raises(ValueError, match="its layout needs"):
        BlockPayload(mx.zeros((10,), dtype=mx.uint8), p.layout)


# ---------------------------------------------------------------- extract / restore


def test_quantized_blocks_bytes_and_layout(hd64):
    caches = _prefilled(hd64, _tokens(19))
    fp = extract_block(caches, 0, 8, False)
    q8 = extract_block(caches, 0, 8, False, quant=Q8)
    q4 = extract_block(caches, 0, 8, False, quant=Q4)
    assert fp.layout.text == "0-1=kv:float32:1x2x8x64"
    assert q8.layout.text == "0-1=q8g64:float32:1x2x8x64"
    assert q4.layout.text == "0-1=q4g64:float32:1x2x8x64"
    # per layer and k/v: fp 2x8x64x4 = 4096 B; q8: 1024 packed + 64 scales + 64 biases;
    # q4: 512 + 64 + 64 (float32 scales: the KV's dtype)
    assert (fp.nbytes, q8.nbytes, q4.nbytes) == (16384, 4608, 2560)
    assert q8.nbytes / fp.nbytes == 0.28125 and q4.nbytes / fp.nbytes == 0.15625
    tail = extract_block(caches, 16, 19, False, quant=Q8)
    assert tail.layout.text == "0-1=q8g64:float32:1x2x3x64" and tail.nbytes == 2048
    # the stored parts are mx.quantize of the KV slice, bit for bit
    wq, scales, biases = mx.quantize(caches[1].keys[..., 0:8, :], group_size=64, bits=8)
    for part, want in zip(("1.k.0", "1.k.1", "1.k.2"), (wq, scales, biases), strict=True):
        assert np.array_equal(np.array(q8[part]), np.array(want))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_ratios_at_group_64(dtype):
    # SmolLM2's KV shape per layer and block: 3 KV heads x 64 tokens x head_dim 64
    c = KVCache()
    x = mx.random.normal((1, 3, 64, 64)).astype(dtype)
    c.update_and_fetch(x, x)
    fp, q8, q4 = (extract_block([c], 0, 64, False, quant=q) for q in (None, Q8, Q4))
    assert fp.nbytes == 2 * 3 * 64 * 64 * 2 == 49152
    assert q8.nbytes / fp.nbytes == 0.53125 and q4.nbytes / fp.nbytes == 0.28125
    assert q8["0.k.1"].dtype == dtype  # scales in the KV's dtype


def test_restore_dequantizes_into_kvcache(hd64):
    toks = _tokens(30, seed=3)
    caches = _prefilled(hd64, toks[:29])
    for quant in (Q8, Q4):
        blocks = _blocks(caches, 29, quant)
        for n in (5, 8, 21, 29):
            r = restore(hd64, blocks, n, reserve=3)
            assert all(type(c) is KVCache and c.offset == n for c in r)
            want = _roundtrip(caches[0].keys[..., :n, :], quant.bits)
            assert np.array_equal(np.array(r[0].keys[..., :n, :]), np.array(want))
            assert r[0].keys.shape[2] == 256  # the reserve still applies
    # the model keeps working on dequantized KV: logits near a full-precision restore
    fp = restore(hd64, _blocks(caches, 29, None), 29)
    want = _logits(hd64, fp, toks[29])
    for quant, tol in ((Q8, 0.05), (Q4, 0.5)):
        got = _logits(hd64, restore(hd64, _blocks(caches, 29, quant), 29), toks[29])
        assert np.abs(got - want).max() < tol


def test_min_tokens_keeps_the_first_blocks_full_precision(hd64):
    toks = _tokens(40, seed=4)
    caches = _prefilled(hd64, toks)
    quant = KVQuant(8, 64, 16)
    blocks = _blocks(caches, 40, quant)
    assert [p.layout.quantized for _, p in blocks] == [False, False, True, True, True]
    r = restore(hd64, blocks, 37)
    k = np.array(r[1].keys[..., :37, :])
    assert np.array_equal(k[..., :16, :], np.array(caches[1].keys[..., :16, :]))  # exact
    assert np.array_equal(k[..., 16:, :], np.array(_roundtrip(caches[1].keys[..., 16:37, :], 8)))


def test_head_dim_without_a_group_stays_full_precision(llama, caplog):
    caches = _prefilled(llama, _tokens(8))
    with caplog.at_level("WARNING", logger="promptcache.engine.payload.adapters"):
        p = extract_block(caches, 0, 8, False, quant=KVQuant(8, 32, 0))  # head_dim 16 < 32
    assert "head_dim 16 cannot be quantized" in caplog.text
    assert p.layout.text == "0-1=kv:float32:1x2x8x16" and not p.layout.quantized
    assert np.array_equal(np.array(p["0.k"]), np.array(caches[0].keys[..., :8, :]))


def test_quantized_kv_cache_is_filled_directly():
    mx.random.seed(6)
    src = [KVCache(), KVCache()]
    for c in src:
        x = mx.random.normal((1, 2, 20, 64))
        c.update_and_fetch(x, x * 3)
    blocks = _blocks(src, 20, Q8)
    stored = [p for _, p in blocks]
    template = [QuantizedKVCache(group_size=64, bits=8) for _ in range(2)]
    r = restore(template, blocks, 20)
    assert all(isinstance(c, QuantizedKVCache) and c.offset == 20 and c.bits == 8 for c in r)
    for i in range(3):  # the stored parts themselves, not a re-quantization
        want = np.concatenate([np.array(p[f"1.v.{i}"]) for p in stored], axis=2)
        assert np.array_equal(np.array(r[1].values[i][..., :20, :]), want)
    # full-precision blocks are quantized on restore; 4-bit blocks re-quantized to 8
    for blocks_from, expect in ((_blocks(src, 20, None), src[0].keys[..., :20, :]),
                                (_blocks(src, 20, Q4), _roundtrip(src[0].keys[..., :20, :], 4))):
        r = restore([QuantizedKVCache(group_size=64, bits=8) for _ in range(2)], blocks_from, 20)
        want = mx.quantize(expect, group_size=64, bits=8)
        for got_part, want_part in zip(r[0].keys, want, strict=True):
            assert np.array_equal(np.array(got_part[..., :20, :]), np.array(want_part))
    # a QuantizedKVCache layer is stored with its own bits, whatever the spec says
    p = extract_block(r, 0, 8, False, quant=Q4)
    assert p.layout.text == "0-1=q8g64:float32:1x2x8x64"


def test_rotating_layers_quantize_and_restore_the_window():
    c = RotatingKVCache(max_size=16, keep=0)
    mx.random.seed(7)
    xs = mx.random.normal((1, 1, 40, 64))
    c.update_and_fetch(xs[..., :8, :], xs[..., :8, :])
    blocks = [(BlockSpan(0, 8), extract_block([c], 0, 8, False, quant=Q8))]
    for i in range(8, 40):
        c.update_and_fetch(xs[..., i : i + 1, :], -xs[..., i : i + 1, :])
        if (i + 1) % 8 == 0:
            blocks.append((BlockSpan(i - 7, i + 1), extract_block([c], i - 7, i + 1, False, quant=Q8)))
    assert blocks[-1][1].layout.text == "0=q8g64:float32:1x1x8x64"
    r = restore([RotatingKVCache(max_size=16, keep=0)], blocks, 37)[0]
    assert (r.offset, r.keys.shape[2]) == (37, 16)
    want = _roundtrip(xs[..., 21:37, :], 8)
    assert np.array_equal(np.array(r.keys), np.array(want))


def test_snapshots_stay_full_precision_next_to_quantized_kv():
    kv = KVCache()
    mx.random.seed(8)
    x = mx.random.normal((1, 2, 12, 64))
    kv.update_and_fetch(x, x)
    arr = ArraysCache(2)
    arr[0] = mx.random.normal((1, 3, 7))
    caches = [CacheList(kv, arr)]
    p = extract_block(caches, 8, 12, True, quant=Q8)
    assert p.layout.text == "0.0=q8g64:float32:1x2x4x64;0.1=s0:float32:1x3x7"
    blocks = [(BlockSpan(0, 8), extract_block(caches, 0, 8, False, quant=Q8)), (BlockSpan(8, 12), p)]
    r = restore([CacheList(KVCache(), ArraysCache(2))], blocks, 12)[0]
    assert np.array_equal(np.array(r.caches[1][0]), np.array(arr[0]))
    assert r.caches[1][1] is None
    assert np.array_equal(np.array(r.caches[0].keys[..., :12, :]), np.array(_roundtrip(x, 8)))


# ---------------------------------------------------------------- adapter + codec


def test_adapter_round_trip_through_the_codec_is_one_array(hd64):
    caches = _prefilled(hd64, _tokens(11))
    ad = MLXPayloadAdapter()
    for quant in (None, Q8, Q4):
        p = extract_block(caches, 8, 11, False, quant=quant)
        buffer, layout = ad.to_buffer(p)
        assert buffer.dtype == np.uint8 and buffer.ndim == 1
        assert buffer.size == p.nbytes == ad.nbytes(p)
        assert layout == p.layout.text
        data = codec.encode(_META, (), layout, buffer)
        dec = codec.decode(data, verify=True)
        back = ad.from_buffer(dec.buffer, dec.desc.layout)
        assert isinstance(back, BlockPayload) and back.layout is p.layout
        assert np.array_equal(np.array(back.buffer), np.array(p.buffer))
        assert ad.num_arrays(back) == 1
    with pytest.raises(ValueError, match="its layout needs"):
        ad.from_buffer(np.zeros(10, np.uint8), layout)
    with pytest.raises(ValueError, match="its layout needs"):
        ad.from_buffer(np.zeros((1, buffer.size), np.uint8), layout)
    with pytest.raises(ValueError):
        ad.from_buffer(buffer, "0=zz:float32:1")


def test_plain_dict_payloads_are_packed_into_one_buffer(hd64):
    ad = MLXPayloadAdapter()
    k = mx.arange(2 * 4 * 64, dtype=mx.bfloat16).reshape(1, 2, 4, 64)
    plain = {"0.k": k, "0.v": -k}  # one array per tensor, in memory (tools, tests)
    back = ad.from_buffer(*ad.to_buffer(plain))
    assert isinstance(back, BlockPayload) and back.layout.text == (
        "0.k=raw:bfloat16:1x2x4x64;0.v=raw:bfloat16:1x2x4x64")
    assert ad.num_arrays(back) == 1
    r = restore([KVCache()], [(BlockSpan(0, 4), back)], 3)[0]
    assert np.array_equal(np.array(r.keys.astype(mx.float32)), np.array(k[..., :3, :].astype(mx.float32)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("bits,group", [(8, 64), (8, 32), (4, 64), (4, 128), (2, 32), (1, 64)])
def test_cpu_dequantize_equals_mx_dequantize_bit_for_bit(dtype, bits, group):
    from promptcache.engine.payload import quant

    mx.random.seed(bits * group)
    x = (mx.random.normal((1, 3, 10, 128)) * 3 + 1).astype(dtype)
    parts = mx.quantize(x, group_size=group, bits=bits)
    want = mx.dequantize(*parts, group_size=group, bits=bits)
    got = quant.dequantize(parts, bits, group)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert np.array_equal(np.array(got.view(mx.uint16 if dtype != mx.float32 else mx.uint32)),
                          np.array(want.view(mx.uint16 if dtype != mx.float32 else mx.uint32)))
