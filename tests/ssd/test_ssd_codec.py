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


def _with_header(data: bytes, edit) -> bytes:
    """Re-encode ``data`` with its JSON header changed by ``edit(dict)``."""
    import json
    import struct

    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


def test_decode_is_zero_copy_and_read_only_for_every_buffer_type():
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.int64)}
    data = encode(arrays, {"m": "1"})
    for buf in (data, bytearray(data), memoryview(bytearray(data))):
        out, meta = decode(buf)
        assert meta == {"m": "1"}
        for name, arr in arrays.items():
            assert np.array_equal(out[name], arr)
            assert out[name].dtype == arr.dtype
            assert np.shares_memory(out[name], np.frombuffer(buf, dtype=np.uint8))
            assert out[name].flags.writeable is False


def test_decode_views_keep_the_buffer_alive():
    out, _ = decode(bytearray(encode({"x": np.arange(1000, dtype=np.float32)}, {})))
    import gc

    gc.collect()
    assert out["x"].sum() == sum(range(1000))


def test_decode_of_a_zero_size_and_a_scalar_tensor():
    arrays = {"e": np.zeros((0, 3), dtype=np.float16), "s": np.array(7, dtype=np.int32)}
    out, _ = decode(encode(arrays, {}))
    assert out["e"].shape == (0, 3)
    assert out["s"].shape == () and int(out["s"]) == 7


def _two():
    return encode({"a": np.ones(4, dtype=np.float32), "b": np.ones(4, dtype=np.float32)}, {})


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h: h["a"].update(dtype="BF16"), "unsupported dtype"),
        (lambda h: h["a"].update(dtype="X9"), "unsupported dtype"),
        (lambda h: h["a"].update(shape=[5]), "does not match"),
        (lambda h: h["a"].update(shape=[-4]), "bad shape"),
        (lambda h: h["a"].update(shape="4"), "bad shape"),
        (lambda h: h["a"].update(data_offsets=[0]), "bad data_offsets"),
        (lambda h: h["a"].update(data_offsets=[8, 4]), "bad data_offsets"),
        (lambda h: h["b"].update(data_offsets=[0, 16]), "gap or overlap"),  # overlaps a
        (lambda h: h["a"].update(data_offsets=[4, 20]), "gap or overlap"),  # a gap before a
        (lambda h: h.pop("b"), "tensors cover 16"),  # trailing bytes nobody owns
        (lambda h: h.update(a=[1, 2]), "not an object"),
        (lambda h: h.update(__metadata__={"k": 1}), "__metadata__"),
    ],
)
def test_malformed_headers_are_corrupt(edit, message):
    with pytest.raises(CorruptBlockError, match=message):
        decode(_with_header(_two(), edit))
