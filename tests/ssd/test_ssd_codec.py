"""Block format 3 (``codec``): one raw buffer behind a self-describing header."""

import gc
import json
import struct

import numpy as np
import pytest
import xxhash
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from promptcache.codec import ALIGN, checksum, checksum_matches, decode, encode, read_header
from promptcache.errors import CorruptBlockError, UnsupportedFormatError
from promptcache.hashing import hash_block
from promptcache.meta import BlockMeta, Namespace

NS = Namespace("codec-model", 4, tenant="carol")


def meta_of(tokens=(1, 2, 3, 4), extra=(b"img",)) -> BlockMeta:  # type: ignore[no-untyped-def]
    h = hash_block(NS.root, tokens, extra)
    return BlockMeta(h, NS.root, tuple(tokens), 0, extra_keys=extra, nbytes=100,
                     truncatable=True, snapshot=False, namespace_key=NS.key, tenant=NS.tenant)


def buf(n: int = 100) -> np.ndarray:
    return (np.arange(n) % 251).astype(np.uint8)


def test_round_trip_of_description_layout_and_buffer():
    m = meta_of()
    data = encode(m, ["s2", "s1"], "0-3=kv:float32:1x2x4x8", buf())
    d = decode(data, verify=True)
    assert d.desc.meta == m
    assert d.desc.sessions == ("s1", "s2")
    assert d.desc.layout == "0-3=kv:float32:1x2x4x8"
    assert d.desc.checksum == xxhash.xxh3_128_hexdigest(buf().tobytes())
    assert np.array_equal(d.buffer, buf()) and d.buffer.dtype == np.uint8
    assert read_header(data)["block_hash"] == m.block_hash.hex()


def test_the_buffer_is_aligned_and_the_file_is_a_one_tensor_safetensors_file():
    data = encode(meta_of(), [], "x", buf(1000))
    (n,) = struct.unpack_from("<Q", data, 0)
    assert (8 + n) % ALIGN == 0 and len(data) == 8 + n + 1000
    assert data[8 + n:] == buf(1000).tobytes()  # the buffer's bytes, as they are
    loaded = st_load(data)
    assert list(loaded) == ["block"] and np.array_equal(loaded["block"], buf(1000))


def test_an_empty_buffer_round_trips():
    d = decode(encode(meta_of(), [], "", np.zeros(0, dtype=np.uint8)), verify=True)
    assert d.buffer.shape == (0,) and d.desc.layout == ""


def test_checksum_is_hex_xxh3_128_and_old_sha256_digests_still_verify():
    assert checksum(b"") == "99aa06d3014798d86001c324468d497f"
    assert checksum(b"abc") != checksum(b"abd")
    assert checksum_matches(b"abc", checksum(b"abc"))
    sha = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # sha256("abc")
    assert checksum_matches(b"abc", sha) and not checksum_matches(b"abd", sha)
    assert not checksum_matches(b"abd", checksum(b"abc"))


def test_decode_is_zero_copy_and_read_only_for_every_buffer_type():
    data = encode(meta_of(), [], "x", buf())
    for b in (data, bytearray(data), memoryview(bytearray(data))):
        d = decode(b)
        assert np.array_equal(d.buffer, buf())
        assert np.shares_memory(d.buffer, np.frombuffer(b, dtype=np.uint8))
        assert d.buffer.flags.writeable is False


def test_decode_views_keep_the_buffer_alive():
    d = decode(bytearray(encode(meta_of(), [], "x", buf(1000))))
    gc.collect()
    assert int(d.buffer.sum()) == int(buf(1000).astype(np.int64).sum())


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
    data = encode(meta_of(), [], "x", buf())
    with pytest.raises(CorruptBlockError):
        decode(mangle(data))


def test_non_bytes_input_is_corrupt():
    with pytest.raises(CorruptBlockError):
        decode("not bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize("buffer", [np.ones(4, dtype=np.float32), np.ones((2, 2), dtype=np.uint8)])
def test_a_buffer_that_is_not_1d_uint8_is_refused(buffer):
    with pytest.raises(ValueError):
        encode(meta_of(), [], "x", buffer)


def test_verify_catches_a_flipped_buffer_byte_and_a_broken_chain():
    data = bytearray(encode(meta_of(), [], "x", buf()))
    data[-1] ^= 0xFF
    decode(bytes(data))  # a tier verified the bytes already: not checked again
    with pytest.raises(CorruptBlockError, match="xxh3"):
        decode(bytes(data), verify=True)
    forged = meta_of()
    forged = BlockMeta(forged.block_hash, forged.parent_hash, (9, 9, 9, 9), 0,
                       namespace_key=NS.key, tenant=NS.tenant)
    with pytest.raises(CorruptBlockError, match="block hash"):
        decode(encode(forged, [], "x", buf()), verify=True)


def _with_header(data: bytes, edit) -> bytes:  # type: ignore[no-untyped-def]
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h: h["block"].update(dtype="F32"), "does not cover"),
        (lambda h: h["block"].update(shape=[5]), "does not cover"),
        (lambda h: h["block"].update(data_offsets=[0, 4]), "does not cover"),
        (lambda h: h.update(other={"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}),
         "one tensor"),
        (lambda h: h.pop("block"), "one tensor"),
        (lambda h: h["__metadata__"].update({"pc.nbytes": 1}), "__metadata__"),
        (lambda h: h["__metadata__"].update({"pc.tokens": "abc"}), "malformed"),
        (lambda h: h["__metadata__"].pop("layout"), "lacks"),
        (lambda h: h["__metadata__"].pop("pc.xxh3"), "lacks"),
    ],
)
def test_malformed_headers_are_corrupt(edit, message):
    with pytest.raises(CorruptBlockError, match=message):
        decode(_with_header(encode(meta_of(), [], "x", buf()), edit))


def test_older_block_formats_are_unsupported_not_misread():
    k = np.ones((1, 2, 4, 8), dtype=np.float32)
    fmt1 = st_save({"0.k": k, "0.v": -k}, metadata={"block_hash": "ab", "start": "0"})
    fmt2 = st_save({"block": buf()}, metadata={"block_hash": "ab", "layout": "x", "pc.v": "2",
                                               "pc.sha256": "00" * 32})
    for data, version in ((fmt1, "1"), (fmt2, "2")):
        with pytest.raises(UnsupportedFormatError, match=f"block format {version} "):
            decode(data)
        assert issubclass(UnsupportedFormatError, CorruptBlockError)
    assert read_header(fmt2)["pc.v"] == "2"  # headers of any format stay readable
    with pytest.raises(UnsupportedFormatError, match="block format 9 "):  # a later one
        decode(st_save({"block": buf()}, metadata={"block_hash": "ab", "pc.v": "9"}))
    not_a_block = st_save({"w": np.ones(4, dtype=np.float32)}, metadata={"format": "mlx"})
    with pytest.raises(CorruptBlockError, match="no block") as e:
        decode(not_a_block)
    assert not isinstance(e.value, UnsupportedFormatError)
