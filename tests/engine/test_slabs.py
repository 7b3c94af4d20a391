"""Runs of blocks as rows of one slab: what a save packs (``extract_run``), what a
restore copies (one strided copy per run and layer array), what a lower tier's run
becomes (``rows_from_host``). Exact bytes and copy counts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from promptcache.engine.payload import blockbuf
from promptcache.engine.payload.adapters import (
    BlockSpan,
    RestoreTally,
    extract_block,
    extract_run,
    restore,
)
from promptcache.engine.payload.blockbuf import BlockPayload, rows_from_host
from promptcache.engine.payload.payload import MLXPayloadAdapter
from promptcache.engine.payload.quant import KVQuant

BS = 8
N = 44  # 5 full blocks and 4 tokens


def _caches(kind: str, n: int = N, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)

    def arr(*shape: int) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    out = []
    for _ in range(2):
        if kind == "mla":  # the latent as keys, the rope key as values: two widths
            c = KVCache()
            c.update_and_fetch(arr(1, 1, n, 32), arr(1, 1, n, 8))
        elif kind == "rotating":  # a window wider than the run
            c = RotatingKVCache(max_size=64, keep=0)
            c.update_and_fetch(arr(1, 2, n, 16), arr(1, 2, n, 16))
        elif kind == "quantized":
            c = QuantizedKVCache(group_size=32, bits=8)
            c.update_and_fetch(arr(1, 2, n, 32), arr(1, 2, n, 32))
        else:
            d = 32 if kind == "wide" else 16
            c = KVCache()
            c.update_and_fetch(arr(1, 2, n, d), arr(1, 2, n, d))
        out.append(c)
    mx.eval([a for c in out for a in c.state if isinstance(a, mx.array)])
    return out


def _bytes(p: BlockPayload) -> bytes:
    return bytes(np.asarray(p.buffer))


@pytest.mark.parametrize("kind", ["plain", "mla", "rotating", "quantized"])
def test_run_rows_are_the_blocks_byte_for_byte(kind):
    caches = _caches(kind)
    run = extract_run(caches, 8, BS, 4)
    assert [p.row for p in run] == [0, 1, 2, 3]
    slab = run[0].slab
    assert slab is not None and all(p.slab is slab for p in run)
    assert slab.shape == (4, run[0].layout.nbytes)
    for i, p in enumerate(run):
        one = extract_block(caches, 8 + i * BS, 16 + i * BS, False)
        assert p.layout is one.layout
        assert _bytes(p) == _bytes(one)


def test_run_rows_quantized_by_spec_and_the_spec_boundary():
    caches = _caches("wide")
    q = KVQuant(bits=8, group_size=32, min_tokens=16)
    run = extract_run(caches, 16, BS, 3, quant=q)
    for i, p in enumerate(run):
        assert p.layout.quantized
        assert _bytes(p) == _bytes(extract_block(caches, 16 + i * BS, 24 + i * BS, False,
                                                 quant=q))
    with pytest.raises(ValueError, match="all be quantized"):
        extract_run(caches, 8, BS, 2, quant=q)


def _spans(payloads, start=0):
    return [(BlockSpan(start + i * BS, start + (i + 1) * BS), p) for i, p in enumerate(payloads)]


@pytest.mark.parametrize("kind", ["plain", "mla"])
def test_restore_from_slabs_equals_restore_from_blocks_with_fewer_copies(kind):
    caches = _caches(kind)
    single = [(BlockSpan(s, min(s + BS, N)), extract_block(caches, s, min(s + BS, N), False))
              for s in range(0, N, BS)]
    # blocks 0-1 one slab, 2-4 another, the partial block on its own
    rows = [*extract_run(caches, 0, BS, 2), *extract_run(caches, 16, BS, 3)]
    slabbed = [*_spans(rows), single[-1]]
    for n, reserve in ((N, 0), (N - 1, 0), (40, 0), (17, 0), (N - 1, 10), (9, 30)):
        t1, t2 = RestoreTally(), RestoreTally()
        a = restore(caches, single, n, reserve=reserve, tally=t1)
        b = restore(caches, slabbed, n, reserve=reserve, tally=t2)
        used = -(-n // BS)
        room = max(0, -(-(n + reserve - used * BS) // BS)) if reserve else 0
        for ca, cb, ref in zip(a, b, caches, strict=True):
            assert ca.offset == cb.offset == n
            assert ca.keys.shape == cb.keys.shape
            assert ca.keys.shape[2] == ((used + room) * BS if reserve else n)
            for x, y, r in zip(ca.state[:2], cb.state[:2], ref.state[:2], strict=True):
                assert np.array_equal(np.asarray(x), np.asarray(y))  # the room too
                assert np.array_equal(np.asarray(x[..., :n, :]), np.asarray(r[..., :n, :]))
        # per layer, k and v: one part per block (or per run of rows) and the room
        slab_parts = (1 if used <= 2 else 2) + (1 if used == 6 else 0)
        assert t1.copies == (used + (1 if room else 0)) * 4 if used + room > 1 else t1.copies == 0
        assert t2.copies == (slab_parts + (1 if room else 0)) * 4
        assert t1.bytes == t2.bytes


@pytest.mark.parametrize("rows", [False, True])
def test_a_wide_head_block_before_narrower_blocks_restores_exactly(rows):
    """A head of 16 tokens as one block (a split: the head prefilled, engine/requests/splice.py)
    before blocks of 8 (slab rows or not): only the last block may be narrower than the
    first, so this takes the general path and the KV is the caches' own."""
    caches = _caches("plain")
    head = (BlockSpan(0, 16), extract_block(caches, 0, 16, False))
    tail = (_spans(extract_run(caches, 16, BS, 3), 16) if rows else
            [(BlockSpan(s, s + BS), extract_block(caches, s, s + BS, False))
             for s in range(16, 40, BS)])
    last = (BlockSpan(40, N), extract_block(caches, 40, N, False))
    for n in (N, 35):
        got = restore(caches, [head, *tail, last], n)
        for c, ref in zip(got, caches, strict=True):
            assert c.offset == n
            for x, r in zip(c.state[:2], ref.state[:2], strict=True):
                assert np.array_equal(np.asarray(x[..., :n, :]), np.asarray(r[..., :n, :]))


def test_rotating_and_quantized_layers_keep_their_own_path():
    for kind in ("rotating", "quantized"):
        caches = _caches(kind)
        rows = extract_run(caches, 0, BS, 5)
        blocks = [*_spans(rows), (BlockSpan(40, N), extract_block(caches, 40, N, False))]
        out = restore(caches, blocks, N)
        for c, ref in zip(out, caches, strict=True):
            assert type(c) is type(ref) and c.offset == N
            def flat(state):
                out = []
                for x in state:
                    out += list(x) if isinstance(x, (list, tuple)) else [x]
                return [a for a in out if isinstance(a, mx.array) and a.ndim == 4]

            got, want = flat(c.state), flat(ref.state)
            assert len(got) == len(want) > 0
            for u, v in zip(got, want, strict=True):
                assert np.array_equal(np.asarray(u)[..., :N, :], np.asarray(v)[..., :N, :])


def _one_run_restores_exactly(rows: list[BlockPayload], blocks: list[BlockPayload],
                              caches: list[KVCache]) -> None:
    """Rows 0-4 of one slab, the blocks' bytes, restored with one copy per layer array."""
    assert len({id(p.slab) for p in rows}) == 1 and [p.row for p in rows] == [0, 1, 2, 3, 4]
    assert [_bytes(p) for p in rows] == [_bytes(p) for p in blocks]
    tally = RestoreTally()
    out = restore(caches, _spans(rows), 40, tally=tally)
    assert tally.copies == 4  # one strided copy per layer array for the five blocks
    for c, ref in zip(out, caches, strict=True):
        assert np.array_equal(np.asarray(c.keys), np.asarray(ref.keys[..., :40, :]))
        assert np.array_equal(np.asarray(c.values), np.asarray(ref.values[..., :40, :]))


def test_rows_from_host_make_one_array_for_the_run():
    caches = _caches("plain")
    blocks = [extract_block(caches, s, s + BS, False) for s in range(0, 40, BS)]
    ad = MLXPayloadAdapter()
    host = [ad.to_buffer(p)[0] for p in blocks]
    rows = rows_from_host(host, blocks[0].layout)
    _one_run_restores_exactly(rows, blocks, caches)
    with pytest.raises(ValueError, match="uint8"):
        rows_from_host([np.zeros(3, dtype=np.uint8)], blocks[0].layout)


def _mapped(host: list[np.ndarray], header: int) -> list[np.ndarray]:
    """The buffers as a segment's mapping holds them: each behind a header of one size."""
    size = host[0].size
    mapped = bytearray(b"h" * header)
    for h in host:
        mapped += h.tobytes() + b"h" * header
    mv = memoryview(bytes(mapped))
    return [np.frombuffer(mv[header + i * (size + header):][:size], np.uint8)
            for i in range(len(host))]


@pytest.mark.parametrize("header", [52, 51])
def test_rows_at_one_step_in_one_buffer_are_copied_once(header: int) -> None:
    # a segment's mapping: the run is one span copied once (rows ``step`` bytes apart), no
    # host copy first; a step that is not a multiple of the dtypes' size takes np.stack's
    # copy. Either way the rows and the restored KV equal the blocks exactly.
    caches = _caches("plain")
    blocks = [extract_block(caches, s, s + BS, False) for s in range(0, 40, BS)]
    ad = MLXPayloadAdapter()
    host = [ad.to_buffer(p)[0] for p in blocks]
    size = host[0].size
    views = _mapped(host, header)
    span = blockbuf._one_step(views, 4)
    rows = rows_from_host(views, blocks[0].layout)
    if header == 52:
        assert span is not None and span[1] == size + header
        assert span[0].size == 4 * (size + header) + size
        assert rows[0].slab is not None and rows[0].slab.ndim == 1
        assert [p.step for p in rows] == [size + header] * 5
    else:
        assert span is None and rows[0].slab is not None and rows[0].slab.ndim == 2
    _one_run_restores_exactly(rows, blocks, caches)
    # other owners, another step, or one buffer alone: no span
    assert blockbuf._one_step([np.array(h) for h in host], 4) is None
    assert blockbuf._one_step([views[0], views[2], views[3]], 4) is None
    assert blockbuf._one_step(views[:1], 4) is None


def test_a_row_travels_to_a_lower_tier_as_its_own_bytes():
    caches = _caches("plain")
    rows = extract_run(caches, 0, BS, 3)
    ad = MLXPayloadAdapter()
    buf, layout = ad.to_buffer(rows[1])
    assert buf.shape == (rows[1].layout.nbytes,)
    assert bytes(buf) == _bytes(extract_block(caches, 8, 16, False))
    back = ad.from_buffer(buf, layout)
    assert _bytes(back) == bytes(buf)


def test_a_fetched_run_becomes_one_slab_and_a_bad_block_only_itself():
    from promptcache import codec
    from promptcache.cache.payloads import Payloads
    from promptcache.errors import CorruptBlockError
    from promptcache.hashing import BlockHash
    from promptcache.meta import BlockMeta

    caches = _caches("plain")
    blocks = [extract_block(caches, s, s + BS, False) for s in range(0, 40, BS)]
    ad = MLXPayloadAdapter()
    items = []
    for i, p in enumerate(blocks):
        h = BlockHash(bytes([i + 1]) * 16)
        meta = BlockMeta(block_hash=h, parent_hash=BlockHash(bytes([i]) * 16),
                         token_ids=tuple(range(i * BS, (i + 1) * BS)), start=i * BS,
                         nbytes=p.nbytes)
        buf, layout = ad.to_buffer(p)
        items.append((codec.encode(meta, ["s"], layout, buf), h))
    payloads = Payloads(ad)
    got = payloads.load_many(items)
    assert [r[1] for r in got] == [p.nbytes for p in blocks]  # type: ignore[index]
    made = [r[0] for r in got]  # type: ignore[index]
    assert len({id(p.slab) for p in made}) == 1 and [p.row for p in made] == [0, 1, 2, 3, 4]
    assert [_bytes(p) for p in made] == [_bytes(p) for p in blocks]
    # another block's bytes: None; damaged bytes: that block's error; the rest made
    items[1] = (items[1][0], BlockHash(b"\xff" * 16))
    items[3] = (b"not a block", items[3][1])
    got = payloads.load_many(items)
    assert got[1] is None and isinstance(got[3], CorruptBlockError)
    made = [got[i][0] for i in (0, 2, 4)]  # type: ignore[index]
    assert len({id(p.slab) for p in made}) == 1
    assert [_bytes(p) for p in made] == [_bytes(blocks[i]) for i in (0, 2, 4)]
