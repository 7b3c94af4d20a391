"""A verify's repair moves rows' first positions into their rejected tails instead of
shifting whole rows (mlx_compat.drop_row_tails with RowMoves): what a row reads back
(``row_caches``, the save path) equals what the shifting repair leaves, position for
position, through verifies, rows leaving and joining (Hypothesis)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import BatchKVCache, KVCache

from promptcache.engine import mlx_compat

H, D = 2, 3


def kv(rows: int, n: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(size=(rows, H, n, D)).astype(np.float32))


def batch(lengths: list[int], seed: int) -> list[BatchKVCache]:
    """Two layers of rows of ``lengths`` positions (merged per-request caches)."""
    layers = []
    for layer in range(2):
        per = []
        for i, n in enumerate(lengths):
            c = KVCache()
            x = kv(1, n, seed + 17 * i + layer)
            c.update_and_fetch(x, x + 1)
            per.append(c)
        layers.append(mlx_compat.merge(per))
    return layers


def rows(layers: list[BatchKVCache], moves: list[mlx_compat.RowMoves] | None
         ) -> list[list[tuple[np.ndarray, np.ndarray, int]]]:
    n = int(layers[0].left_padding.shape[0])
    out = []
    for i in range(n):
        views = mlx_compat.row_caches(layers, i, moves=moves[i] if moves else None)
        out.append([(np.array(c.keys), np.array(c.values), int(c.offset)) for c in views])
    return out


steps = st.lists(st.tuples(st.integers(1, 5), st.lists(st.integers(0, 4), min_size=4,
                                                        max_size=4), st.booleans()),
                 min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(4, 30), min_size=1, max_size=4), steps, st.integers(0, 1000))
def test_moved_rows_read_back_as_the_shifted_ones(lengths: list[int], plan: list[
        tuple[int, list[int], bool]], seed: int) -> None:
    shifted, moved = batch(lengths, seed), batch(lengths, seed)
    moves = [mlx_compat.RowMoves() for _ in lengths]
    for step, (width, keeps, leave) in enumerate(plan):
        n = int(shifted[0].left_padding.shape[0])
        x = kv(n, width, seed + 1000 + step)
        for a, b in zip(shifted, moved, strict=True):
            a.update_and_fetch(x, x * 2)
            b.update_and_fetch(x, x * 2)
        drop = [width - min(width, 1 + keeps[i % 4]) for i in range(n)]
        mlx_compat.drop_row_tails(shifted, drop)
        mlx_compat.drop_row_tails(moved, drop, moves)
        for a, b in zip(shifted, moved, strict=True):  # the rotary positions agree
            assert a.offset.tolist() == b.offset.tolist()
        got, want = rows(moved, moves), rows(shifted, None)
        for g, w in zip(got, want, strict=True):
            for (gk, gv, go), (wk, wv, wo) in zip(g, w, strict=True):
                assert go == wo
                np.testing.assert_array_equal(gk, wk)
                np.testing.assert_array_equal(gv, wv)
        if leave and n > 1:  # the first row leaves the batch, a new one joins
            keep = list(range(1, n))
            for a, b in zip(shifted, moved, strict=True):
                mlx_compat.filter_rows(a, keep)
                mlx_compat.filter_rows(b, keep)
            moves = moves[1:]
            new_a, new_b = batch([7], seed + step), batch([7], seed + step)
            for a, b, na, nb in zip(shifted, moved, new_a, new_b, strict=True):
                mlx_compat.extend(a, na)
                mlx_compat.extend(b, nb)
            moves.append(mlx_compat.RowMoves())


def test_a_row_too_short_for_its_move_is_shifted_instead() -> None:
    """A row holding less than twice what it moves: the batch takes the shifting
    repair (nothing moved, nothing recorded)."""
    layers = batch([1, 20], 5)
    moves = [mlx_compat.RowMoves(), mlx_compat.RowMoves()]
    x = kv(2, 4, 9)
    for c in layers:
        c.update_and_fetch(x, x)
    # row 0 holds 1 + 4 fed after 19 padding; it keeps 1 of the 4: 3 rejected, 2 real
    mlx_compat.drop_row_tails(layers, [3, 0], moves)
    assert [m.shift for m in moves] == [0, 0] and not moves[0].keys
    mlx_compat.drop_row_tails(layers, [0, 2], moves)  # row 1 holds 22: moved
    assert [m.shift for m in moves] == [0, 2] and moves[1].keys == {22: 0, 23: 1}
