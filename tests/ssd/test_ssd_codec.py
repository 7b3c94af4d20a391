import numpy as np
import pytest

from promptcache.codec import checksum, decode, encode, read_metadata
from promptcache.errors import CorruptBlockError


def test_round_trip_dtypes_shapes_and_metadata():
    arrays = {
        "0.k": np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4),
        "0.v": np.arange(6, dtype=np.float16).reshape(2, 3),
        "1.k.0": np.array([1, 2, 3], dtype=np.uint32),
        "1.s.0": np.array([[7]], dtype=np.int8),
        "2.k": np.array([0x3F80, 0x4000], dtype=np.uint16),  # bf16 1.0, 2.0 as uint16
    }
    meta = {"dtype.2.k": "bfloat16", "start": "64"}
    data = encode(arrays, meta)
    out, out_meta = decode(data)
    assert out_meta == meta
    assert sorted(out) == sorted(arrays)
    for name, arr in arrays.items():
        assert out[name].dtype == arr.dtype
        assert out[name].shape == arr.shape
        assert np.array_equal(out[name], arr)
    assert read_metadata(data) == meta


def test_non_contiguous_input_is_stored_by_value():
    a = np.arange(12, dtype=np.float32).reshape(3, 4).T
    out, _ = decode(encode({"x": a}, {}))
    assert np.array_equal(out["x"], a)


def test_empty_payload_round_trips():
    assert decode(encode({}, {})) == ({}, {})


def test_checksum_is_hex_sha256():
    assert checksum(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert checksum(b"abc") != checksum(b"abd")


@pytest.mark.parametrize(
    "mangle",
    [
        lambda d: d[:-1],  # truncated data
        lambda d: d[:4],  # truncated header length
        lambda d: b"\xff" * 8 + d[8:],  # absurd header length
        lambda d: d[:8] + b"}" + d[9:],  # broken JSON
        lambda d: b"",
    ],
)
def test_corrupt_input_raises_corrupt_block_error(mangle):
    data = encode({"x": np.ones((4, 4), dtype=np.float32)}, {"a": "b"})
    with pytest.raises(CorruptBlockError):
        decode(mangle(data))


def test_non_bytes_input_is_corrupt():
    with pytest.raises(CorruptBlockError):
        decode("not bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "arrays, meta",
    [
        ({"x": [1, 2]}, {}),
        ({"": np.ones(2)}, {}),
        ({"x": np.array([object()], dtype=object)}, {}),
        ({"x": np.ones(2)}, {"k": 3}),
    ],
)
def test_bad_input_raises_value_error(arrays, meta):
    with pytest.raises(ValueError):
        encode(arrays, meta)
