"""Request token validation: the fast paths agree exactly with ``validate_tokens``."""

from array import array

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from promptcache.blocks.tokens import to_request_tokens
from promptcache.hashing import validate_tokens


def as_list(tokens):
    return to_request_tokens(tokens).arr.tolist()


def test_lists_tuples_arrays_and_numpy_give_the_same_uint32_bytes():
    ids = [0, 1, 2, 150_000, 2**32 - 1]
    want = np.array(ids, dtype="<u4").tobytes()
    for tokens in (ids, tuple(ids), array("I", ids), np.array(ids, dtype=np.int64),
                   np.array(ids, dtype=np.uint32), [np.int64(t) for t in ids]):
        req = to_request_tokens(tokens)
        assert req.buf == want and req.n == 5 and req.arr.dtype == np.dtype("<u4")
        assert req.arr.tolist() == ids


@pytest.mark.parametrize(
    "tokens, msg",
    [
        ([5, 6, False], "position 2 is not an integer: False"),
        ([True, 6], "position 0 is not an integer: True"),
        ([0, 1, 0, 1, True], "position 4 is not an integer"),
        ([3, np.bool_(True)], "position 1 is not an integer"),
        ([3, 4.0], "position 1 is not an integer: 4.0"),
        ([3, np.float32(4)], "position 1 is not an integer"),
        ((7, -1), "position 1 is out of range"),
        ([7, 2**32], "position 1 is out of range"),
        ([7, 2**70], "position 1 is out of range"),
        ([7, "8"], "position 1 is not an integer"),
    ],
)
def test_bad_lists_are_refused_with_the_exact_message(tokens, msg):
    with pytest.raises(ValueError, match=msg):
        to_request_tokens(tokens)
    with pytest.raises(ValueError, match=msg):
        validate_tokens(tokens)


def test_zeros_and_ones_that_are_real_ints_pass_the_bool_check():
    assert as_list([0, 1] * 1000 + [1]) == [0, 1] * 1000 + [1]


def test_a_large_list_round_trips():
    ids = np.random.default_rng(3).integers(0, 2**32, size=131_072, dtype=np.uint32)
    req = to_request_tokens(ids.tolist())
    assert req.n == 131_072 and req.buf == ids.astype("<u4").tobytes()


values = st.one_of(
    st.integers(min_value=-3, max_value=2**32 + 3),
    st.integers(min_value=0, max_value=3),
    st.booleans(),
    st.floats(allow_nan=False, min_value=0, max_value=5),
)


@given(st.lists(values, min_size=1, max_size=12))
def test_fast_path_agrees_with_validate_tokens(tokens):
    try:
        want = validate_tokens(tokens)
    except ValueError as e:
        with pytest.raises(ValueError) as got:
            to_request_tokens(tokens)
        assert str(got.value) == str(e)
        return
    assert as_list(tokens) == list(want)
    assert as_list(tuple(tokens)) == list(want)
