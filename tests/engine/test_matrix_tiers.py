"""The architecture matrix through the tiers and paths ``test_matrix`` does not take:
one tiny model per cache kind (plain KV, sliding window + sinks, hybrid SSM state, MLA,
CacheList) through the shared Redis tier and with 8-bit stored KV, and three families
end to end through a real ``promptcache serve``.

Every scenario is the matrix's chat (``test_matrix``'s helpers): turn 2 = turn 1 + the
reply + a new user message; it restores turn 1's prompt + reply but the reply's last
token (the end-of-generation save), and its reply is compared with a full prefill.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from models.tiny_families import (
    TINY_FAMILIES_VERSION,
    build_family_model,
    ensure_family_model,
    word_token_ids,
)
from models.tiny_models import ensure_built
from serve_proc import serve
from test_matrix import (
    BLOCK,
    CHUNK,
    REPLY,
    SYSTEM,
    TOL,
    Run,
    Turn,
    _Logits,
    _reply,
    _turns,
    _words,
)

from harness.redisproc import REDIS_SERVER, RedisServer, wait_until
from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig, RedisConfig
from promptcache.engine.engine import Engine
from promptcache.engine.payload import adapters
from promptcache.engine.payload.blockbuf import BlockPayload
from promptcache.serving_config import EngineConfig

# one family per cache kind
KINDS = {"llama": "plain KV", "gpt_oss": "sliding window + sinks",
         "nemotron_h": "hybrid SSM state", "deepseek_v3": "MLA", "falcon_h1": "CacheList"}
TRUNCATABLE = {"llama": True, "gpt_oss": True, "nemotron_h": False, "deepseek_v3": True,
               "falcon_h1": False}
QUANT_TOL = 0.05  # |logits| delta of 8-bit KV restores (test_quant_engine's bound)
ERRORS = ("store_errors", "restore_errors", "cache_errors", "errors")


def _errors(eng: Engine) -> tuple[int, ...]:
    c = eng.engine_stats()
    return tuple(int(c[k]) for k in ERRORS)


def _engine(path: Path, cc: CacheConfig, cache: Any) -> Engine:
    rec = _Logits()
    # each tier's blocks are what these tests restore: no live state
    eng = Engine.load(path, EngineConfig(restore_plan="load", prefill_chunk_tokens=CHUNK, snapshot_every_blocks=1,
                                         live_states=0),
                      cc, cache=cache, logits_hook=rec)
    eng.matrix_logits = rec  # type: ignore[attr-defined]
    return eng


def _two_turns(eng: Engine, family: str) -> tuple[Turn, list[dict[str, str]]]:
    """Turn 1 run on ``eng`` (greedy, REPLY tokens), and turn 2's messages."""
    rng = random.Random(f"tiers-{family}")
    vocab = [eng.tokenizer.decode([t]).strip() for t in word_token_ids()]
    first = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": _words(rng, 2 * CHUNK, vocab)}]
    turn = _turns(eng, [first])[0]
    assert turn.cached == 0 and turn.tokens == turn.ref
    return turn, _reply(Run(family, TRUNCATABLE[family]), eng, first, turn,
                         _words(rng, CHUNK, vocab))


def _assert_restores_turn_1(first: Turn, second: Turn) -> None:
    n = len(first.prompt) + len(first.tokens)
    assert second.prompt[:n] == first.prompt + first.tokens
    assert second.cached == n - 1


# ---------------------------------------------------------------- Redis


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if REDIS_SERVER is None:  # as tests/redis: CI installs it, a laptop without it skips
        pytest.skip("redis-server is not installed")
    srv = RedisServer(tmp_path_factory.mktemp("redis"), unix_socket=True).start()
    try:
        yield srv.url
    finally:
        srv.stop()


def _redis_engine(path: Path, url: str) -> Engine:
    cc = CacheConfig(block_size=BLOCK, ram_budget_bytes=64 * 1024**2)
    return _engine(path, cc, build_cache(
        cc, None, RedisConfig(url=url, prefix=f"pc-{path.name}", timeout_s=5.0,
                              connect_timeout_s=5.0)))


@pytest.mark.parametrize("family", list(KINDS))
def test_second_engine_restores_the_next_turn_from_redis(models_root: Path, redis_url: str,
                                                         family: str) -> None:
    path = ensure_family_model(family, models_root)
    with _redis_engine(path, redis_url) as a:
        first, msgs = _two_turns(a, family)
        tier = a.cache.lower[0]
        assert tier.name == "redis" and tier.flush(timeout=60)
        a_errors = _errors(a)
        a_redis = tier.stats()
    with _redis_engine(path, redis_url) as b:  # no SSD, empty RAM
        assert len(b.cache.pool) == 0
        second = _turns(b, [msgs])[0]
        b_errors = _errors(b)
        b_redis = b.cache.lower[0].stats()
    _assert_restores_turn_1(first, second)
    assert second.by_tier == {"redis": second.cached}
    assert second.tokens == second.ref and len(second.tokens) == REPLY
    assert second.max_delta <= TOL
    assert a_errors == b_errors == (0, 0, 0, 0)
    assert a_redis["writes"] > 0 and b_redis["hits"] > 0
    for s in (a_redis, b_redis):
        assert (s["dropped_writes_total"], s["unexpected_errors"], s["corrupt"]) == (0, 0, 0)


# ---------------------------------------------------------------- --kv-bits 8

# head_dim 64: mx.quantize's groups divide it (the matrix's 16 does not, so its KV would
# be stored at full precision); the MLA family keeps its widths (latent 32, rope 8)
HD64 = {"head_dim": 64}


@pytest.fixture(scope="module")
def quant_model(models_root: Path) -> Callable[[str], Path]:
    def get(family: str) -> Path:
        if family == "deepseek_v3":
            return ensure_family_model(family, models_root)
        return ensure_built(models_root / f"tiny-matrix-{family}-hd64-v{TINY_FAMILIES_VERSION}",
                            lambda tmp: build_family_model(family, tmp, HD64))

    return get


def _quant_engine(path: Path) -> Engine:
    cc = CacheConfig(block_size=BLOCK, ram_budget_bytes=64 * 1024**2, kv_bits=8,
                     kv_quant_min_tokens=0)
    return _engine(path, cc, build_cache(cc))


def _kv_blocks(eng: Engine) -> list[BlockPayload]:
    """The payloads of the RAM blocks that hold KV (a block of an SSM snapshot only
    holds none)."""
    out = []
    for b in eng.cache.pool.blocks():
        assert isinstance(b.payload, BlockPayload)
        if b.payload.layout.kv_items:
            out.append(b.payload)
    return out


@pytest.mark.parametrize("family", [f for f in KINDS if f != "deepseek_v3"])
def test_eight_bit_blocks_restore_the_next_turn(quant_model: Callable[[str], Path],
                                                family: str) -> None:
    with _quant_engine(quant_model(family)) as eng:
        assert eng.kv_spec.endswith(";q8g64m0")
        first, msgs = _two_turns(eng, family)
        blocks = _kv_blocks(eng)
        second = _turns(eng, [msgs])[0]
        again = _turns(eng, [msgs])[0]  # the same request, restored again
        errors = _errors(eng)
    # every stored KV item is 8-bit, in groups of 64
    assert blocks and all(p.layout.quantized for p in blocks)
    assert {(i.bits, i.group_size) for p in blocks for i in p.layout.kv_items.values()
            } == {(8, 64)}
    _assert_restores_turn_1(first, second)
    assert second.by_tier == {"ram": second.cached}
    n = len(second.prompt)
    if TRUNCATABLE[family]:
        assert again.cached == n - 1
    else:  # the last chunk snapshot before the last token
        assert (n - 1) // CHUNK * CHUNK <= again.cached <= n - 1
    # test_quant_engine's property: greedy tokens of the full prefill, logits within
    # the 8-bit bound
    for t in (second, again):
        assert t.tokens == t.ref and len(t.tokens) == REPLY
        assert t.max_delta < QUANT_TOL
    assert again.tokens == second.tokens
    # ... and the restores were quantized: beyond float32 noise from a full prefill
    assert max(second.max_delta, again.max_delta) > TOL
    assert errors == (0, 0, 0, 0)


def test_eight_bit_mla_of_rope_width_8_is_stored_at_full_precision(
        quant_model: Callable[[str], Path], caplog: pytest.LogCaptureFixture) -> None:
    """No group size divides both MLA widths (latent 32, rope key 8): the engine loads,
    warns once, and stores those layers at full precision; restores are then exact."""
    adapters._warn_unquantizable.cache_clear()
    with caplog.at_level(logging.WARNING, logger="promptcache.engine.payload.adapters"), \
            _quant_engine(quant_model("deepseek_v3")) as eng:
        assert eng.kv_spec.endswith(";q8g64m0")
        first, msgs = _two_turns(eng, "deepseek_v3")
        second = _turns(eng, [msgs])[0]
        blocks = _kv_blocks(eng)
        errors = _errors(eng)
    assert [r.getMessage() for r in caplog.records if "cannot be quantized" in r.getMessage()
            ] == ["KV of head_dim 8 cannot be quantized in groups of <= 64 (mx.quantize "
                  "supports (32, 64, 128)): those layers are stored at full precision"]
    assert blocks and not any(p.layout.quantized for p in blocks)
    assert {(i.kind, i.shape[-1], i.vshape[-1]) for p in blocks
            for i in p.layout.kv_items.values()} == {("kv", 32, 8)}
    _assert_restores_turn_1(first, second)
    assert second.tokens == second.ref and second.max_delta <= TOL
    assert errors == (0, 0, 0, 0)


# ---------------------------------------------------------------- promptcache serve

SERVE_FAMILIES = ("llama", "gpt_oss", "nemotron_h")


def _chat(base: str, messages: list[dict[str, str]]) -> tuple[str, dict[str, Any]]:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": messages, "max_tokens": REPLY, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    return str(body["choices"][0]["message"]["content"]), dict(body["usage"])


def _stats(url: str) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(f"{url}/v1/cache/stats", timeout=10).json()
    return data


def _prerender_idle(url: str) -> bool:
    pre = _stats(url).get("prerender") or {}
    return not pre.get("queued") and not pre.get("pending")


def _conversation(url: str, path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Two chat turns of whole words: turn 2 = turn 1 + its reply + a new user message."""
    from tokenizers import Tokenizer

    rng = random.Random(f"serve-{path.name}")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    vocab = [tok.decode([t]).strip() for t in word_token_ids()]
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": _words(rng, 3 * CHUNK, vocab)}]
    first = _chat(url, msgs)
    # the next-turn pre-render (a background prefill of the history as the client will
    # send it back) has ended: what turn 2 finds does not depend on timing
    wait_until(lambda: _prerender_idle(url), timeout=60, what="the pre-render")
    msgs += [{"role": "assistant", "content": first[0]},
             {"role": "user", "content": _words(rng, CHUNK, vocab)}]
    second = _chat(url, msgs)
    engine = _stats(url)["engine"]
    assert tuple(engine[k] for k in ERRORS) == (0, 0, 0, 0)
    return [first, second]


@pytest.mark.parametrize("family", SERVE_FAMILIES)
def test_serve_two_turns_hit_the_cache(models_root: Path, tmp_path: Path, family: str
                                       ) -> None:
    path = ensure_family_model(family, models_root)
    # blocks of 8 tokens: gpt_oss's window is 16 (a block must fit in it)
    cached_args = ["--cache-dir", str(tmp_path / "blocks"), "--block-size", str(BLOCK)]
    with ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        # both servers start at once (their start-up is most of this test's time)
        starts = [pool.submit(stack.enter_context, serve(
            ["--model", str(path), *args, "--log-level", "warning"], tmp_path / f"{name}.log",
            log_tail=2000)) for name, args in (("cached", cached_args), ("plain", ["--no-cache"]))]
        cached_url, plain_url = (f.result() for f in starts)
        cached = _conversation(cached_url, path)
        plain = _conversation(plain_url, path)
    (text1, u1), (text2, u2) = cached
    assert u1["completion_tokens"] == u2["completion_tokens"] == REPLY
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    hit = u2["prompt_tokens_details"]["cached_tokens"]
    n = u1["prompt_tokens"] + u1["completion_tokens"]
    assert hit >= 0.95 * n
    # at least turn 1's end-of-generation save (all it ran: the reply's last token never
    # went through the model); the pre-render may add the turn's closing tokens
    assert n - 1 <= hit < u2["prompt_tokens"]
    assert [t for t, _ in plain] == [text1, text2]
    assert [u["prompt_tokens"] for _, u in plain] == [u1["prompt_tokens"], u2["prompt_tokens"]]
