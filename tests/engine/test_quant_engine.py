"""KV quantization through the engine: stored blocks are one (quantized) array in RAM and
on the SSD, the namespace keeps quantized and full-precision blocks apart, restored
output stays close to a full prefill, and the arrays-per-token figure is in the stats."""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest
from models.quant_models import ensure_tiny_llama_hd64
from stepper import Stepper

from promptcache import codec
from promptcache.cli import build_parser
from promptcache.cli.serve_cmd import build_configs
from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig, SSDConfig
from promptcache.engine.api import GenerationRequest, SamplingParams
from promptcache.engine.engine import Engine
from promptcache.engine.payload.blockbuf import BlockPayload
from promptcache.serving_config import EngineConfig

BLOCK, CHUNK = 8, 16
_ids = itertools.count()


@pytest.fixture(scope="module")
def hd64_path(tiny_llama_path, models_root):
    return ensure_tiny_llama_hd64(tiny_llama_path, models_root)


def _engine(path, kv_bits=None, min_tokens=0, ssd_dir=None):
    cc = CacheConfig(block_size=BLOCK, ram_budget_bytes=64 * 1024**2, kv_bits=kv_bits,
                     kv_quant_min_tokens=min_tokens)
    ssd = None if ssd_dir is None else SSDConfig(path=ssd_dir, policy="write_through", fsync=False)
    rec: dict[str, list[np.ndarray]] = defaultdict(list)

    def hook(request_id, step, logits):
        rec[request_id].append(logits)

    eng = Engine.load(path, EngineConfig(restore_plan="load", prefill_chunk_tokens=CHUNK), cc,
                      cache=build_cache(cc, ssd), logits_hook=hook)
    eng.recorded = rec
    return eng


def _prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1000, size=n)]


def _run(eng, tokens, use_cache=True, max_tokens=4):
    rid = f"q-{next(_ids)}"
    req = GenerationRequest(prompt_tokens=tuple(tokens), sampling=SamplingParams(max_tokens=max_tokens),
                            use_cache=use_cache, request_id=rid)
    res = eng.submit(req).result(timeout=120)
    assert res.finish_reason == "length", res.error
    return res, eng.recorded.pop(rid)


def _max_delta(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def test_blocks_are_stored_quantized_as_one_array(hd64_path):
    prompt = _prompt(37, seed=1)
    with _engine(hd64_path, kv_bits=8, min_tokens=16) as eng:
        assert eng.kv_spec == "float32;kv*2;q8g64m16"
        first, _ = _run(eng, prompt)
        blocks = sorted(eng.cache.pool.blocks(), key=lambda b: b.start)
        # 4 full blocks + the end-of-generation tail [32, 40)
        assert [(b.start, b.num_tokens) for b in blocks] == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8)]
        assert all(isinstance(b.payload, BlockPayload) for b in blocks)
        assert [b.payload.layout.quantized for b in blocks] == [False, False, True, True, True]
        assert [b.nbytes for b in blocks] == [16384, 16384, 4608, 4608, 4608]
        # each 16-token chunk's two blocks are rows of one slab (one array), the tail
        # is its own: 3 arrays
        assert [b.payload.row for b in blocks[:4]] == [0, 1, 0, 1]
        assert blocks[0].payload.slab is blocks[1].payload.slab
        assert blocks[2].payload.slab is blocks[3].payload.slab and blocks[4].payload.slab is None
        kv = eng.stats()["kv"]
        assert kv == {
            "kv_quantization": "q8g64m16", "ram_blocks": 5, "ram_tokens": 40, "ram_arrays": 3,
            "ram_quantized_blocks": 3, "arrays_per_cached_token": 3 / 40,
            "bytes_per_cached_token": (2 * 16384 + 3 * 4608) / 40,
        }
        cached, lc = _run(eng, prompt)
        plain, lp = _run(eng, prompt, use_cache=False)
    assert cached.usage.cached_tokens == 36
    assert cached.tokens == plain.tokens == first.tokens
    assert _max_delta(lc, lp) < 0.05  # 8-bit KV from token 16 on


def test_four_bit_blocks_restore_close_to_full_prefill(hd64_path):
    prompt = _prompt(45, seed=2)
    with _engine(hd64_path, kv_bits=4) as eng:
        _run(eng, prompt)
        cached, lc = _run(eng, prompt)
        _, lp = _run(eng, prompt, use_cache=False)
        assert all(b.payload.layout.quantized for b in eng.cache.pool.blocks())
    assert cached.usage.cached_tokens == 44
    assert _max_delta(lc[:1], lp[:1]) < 0.5


def test_quantized_and_full_precision_blocks_never_cross(hd64_path, tmp_path):
    ssd = tmp_path / "blocks"
    prompt = _prompt(30, seed=3)
    with _engine(hd64_path, ssd_dir=ssd) as fp:
        r_fp, _ = _run(fp, prompt)
        fp_ns = fp.namespace()
    with _engine(hd64_path, kv_bits=8, ssd_dir=ssd) as q8:
        q8_ns = q8.namespace()
        miss, _ = _run(q8, prompt)  # the full-precision blocks are on this SSD: not ours
        hit, _ = _run(q8, prompt)
    assert fp_ns.kv_spec == "float32;kv*2" and q8_ns.kv_spec == "float32;kv*2;q8g64m0"
    assert fp_ns.root != q8_ns.root
    assert miss.usage.cached_tokens == 0 and hit.usage.cached_tokens == 29
    with _engine(hd64_path, kv_bits=4, ssd_dir=ssd) as q4:  # other bits: another namespace
        assert _run(q4, prompt)[0].usage.cached_tokens == 0
    # a full-precision engine restores its own blocks from the SSD, bit-exact with a
    # full prefill (the quantized copies of the same tokens are never served to it)
    with _engine(hd64_path, ssd_dir=ssd) as fp2:
        again, la = _run(fp2, prompt)
        plain, lp = _run(fp2, prompt, use_cache=False)
        promoted = [b for b in fp2.cache.pool.blocks() if b.start < 29]
    assert again.usage.cached_by_tier == {"ssd": 29}
    assert again.tokens == plain.tokens == r_fp.tokens
    assert _max_delta(la, lp) < 1e-4
    assert promoted and not any(b.payload.layout.quantized for b in promoted)
    # and a restarted 8-bit engine gets its quantized blocks back from the SSD
    with _engine(hd64_path, kv_bits=8, ssd_dir=ssd) as q8b:
        back, _ = _run(q8b, prompt)
        promoted = [b for b in q8b.cache.pool.blocks() if b.start < 29]
    assert back.usage.cached_by_tier == {"ssd": 29}
    assert promoted and all(b.payload.layout.quantized for b in promoted)


def test_a_block_on_the_ssd_is_one_tensor(hd64_path, tmp_path):
    ssd = tmp_path / "blocks"
    with _engine(hd64_path, kv_bits=8, ssd_dir=ssd) as eng:
        _run(eng, _prompt(24, seed=4))
        eng.cache.persist()
    files = [p for p in ssd.rglob("*.safetensors") if "quarantine" not in p.parts]
    assert files
    for f in files:
        dec = codec.decode(f.read_bytes(), verify=True)
        assert dec.buffer.dtype == np.uint8 and dec.buffer.ndim == 1
        assert dec.desc.layout.startswith("0-1=q8g64:float32:1x2x")
        assert dec.buffer.size in (4608, 2048)  # a full block; the 3-token tail


def test_interleaved_requests_restore_quantized_prefixes(hd64_path):
    shared = _prompt(24, seed=5)
    prompts = [shared + _prompt(9, seed=10 + i) for i in range(3)]
    with _engine(hd64_path, kv_bits=8) as eng:
        _run(eng, shared)
        handles = []
        for i, p in enumerate(prompts):
            req = GenerationRequest(prompt_tokens=tuple(p), sampling=SamplingParams(max_tokens=6),
                                    request_id=f"conc-{i}")
            handles.append(eng.submit(req))
        results = [h.result(timeout=120) for h in handles]
        logits = [eng.recorded.pop(f"conc-{i}") for i in range(3)]
        refs = [_run(eng, p, use_cache=False, max_tokens=6) for p in prompts]
    for res, lc, (ref, lp) in zip(results, logits, refs, strict=True):
        assert res.finish_reason == "length" and res.usage.cached_tokens == 24
        assert res.tokens == ref.tokens
        assert _max_delta(lc, lp) < 0.05


def test_serve_options_for_kv_quantization(tmp_path):
    def configs(*argv):
        return build_configs(build_parser().parse_args(["serve", "--no-ssd", *argv]))

    _, cache, _, _ = configs()
    assert (cache.kv_bits, cache.kv_group_size, cache.kv_quant_min_tokens) == (None, 64, 256)
    _, cache, _, _ = configs("--kv-bits", "4", "--kv-group-size", "32", "--kv-quant-min-tokens", "0")
    assert (cache.kv_bits, cache.kv_group_size, cache.kv_quant_min_tokens) == (4, 32, 0)
    for bad in (["--kv-bits", "6"], ["--kv-group-size", "48"]):
        with pytest.raises(SystemExit):
            configs(*bad)
    with pytest.raises(ValueError, match="kv-quant-min-tokens"):
        configs("--kv-quant-min-tokens", "-1")


def _stepped(eng, seqs, use_cache, batched=True, max_tokens=6):
    """Run ``seqs`` through a Stepper: all in one batch, or one at a time."""
    st = Stepper(eng)
    runs = []
    for i, p in enumerate(seqs):
        runs.append(st.submit(p, max_tokens=max_tokens + i % 3, use_cache=use_cache))
        if not batched:
            st.run()
    st.run()
    return [(r.result, eng.recorded.pop(r.request.request_id)) for r in runs], st


def test_quantized_restores_under_batched_decode(hd64_path):
    """Quantize on store, dequantize on restore: eight requests whose prefixes come
    back from 8-bit blocks decode in one batch; each row equals the same restore
    decoded alone (float tolerance) and a full prefill (greedy, 8-bit tolerance)."""
    rng = np.random.default_rng(9)
    prompts = [[900 + i] + _prompt(int(rng.integers(10, 40)), seed=20 + i) for i in range(8)]
    with _engine(hd64_path, kv_bits=8) as eng:
        first, _ = _stepped(eng, prompts, True)
        assert all(b.payload.layout.quantized for b in eng.cache.pool.blocks())
        turn2 = [p + r.tokens + _prompt(5, seed=40 + i)
                 for i, (p, (r, _)) in enumerate(zip(prompts, first, strict=True))]
        cached, st = _stepped(eng, turn2, True, max_tokens=16)  # long enough that all 8 overlap
        assert st.ctx.counters.max_batch == 8
        plain, _ = _stepped(eng, turn2, False, max_tokens=16)
    with _engine(hd64_path, kv_bits=8) as eng2:  # the same first turn, then turn 2 alone
        again, _ = _stepped(eng2, prompts, True)
        alone, st = _stepped(eng2, turn2, True, batched=False, max_tokens=16)
        assert st.ctx.counters.max_batch == 1
    assert [r.tokens for r, _ in again] == [r.tokens for r, _ in first]
    for p, (r1, _), (rc, lc), (rp, lp), (ra, la) in zip(prompts, first, cached, plain, alone,
                                                        strict=True):
        assert rc.finish_reason == "length", rc.error
        assert rc.usage.cached_tokens == ra.usage.cached_tokens == len(p) + len(r1.tokens) - 1
        assert rc.tokens == ra.tokens and _max_delta(lc, la) < 1e-4  # batched == alone
        assert rc.tokens == rp.tokens and _max_delta(lc, lp) < 0.05  # 8-bit vs full prefill
    # the restores were quantized: they differ from a full prefill beyond float rounding
    assert max(_max_delta(lc, lp) for (_, lc), (_, lp) in zip(cached, plain, strict=True)) > 1e-3
