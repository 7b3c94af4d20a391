"""Cache packs on the cache core (numpy payloads, the real codec, a real SSD tier):
export a conversation / session / tenant, wipe, import, hit everything; fail closed on
any damaged byte, a foreign model or block size, a swapped payload."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from promptcache import packfile, packs
from promptcache.cache import PromptCache
from promptcache.config import CacheConfig, SSDConfig
from promptcache.meta import Namespace
from promptcache.tiers.ssd import SSDTier

BS = 4
NS = Namespace("model-a", BS, tenant="alice")


def payload_for(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    k = (np.arange(start, end, dtype=np.float32) * 1.5).reshape(1, 1, -1, 1).repeat(3, axis=3)
    return {"0.k": k, "0.v": -k}


def make(tmp: Path, name: str = "ssd") -> PromptCache:
    tier = SSDTier(SSDConfig(path=tmp / name, fsync=False, policy="write_through"))
    return PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=1 << 20), lower=[tier],
                       write_through=True)


CONV = list(range(100, 122))  # 5 full blocks + a 2-token tail
NEXT = CONV + [7, 8, 9, 10, 11]


def _exported(tmp: Path) -> tuple[PromptCache, Path]:
    cache = make(tmp)
    cache.store(NS, CONV, len(CONV), payload_for, session_id="s1", save_point="end_generation")
    cache.store(NS, list(range(500, 509)), 9, payload_for, session_id="s2")  # another chat
    assert cache.flush(30)
    blocks = packs.collect(cache, NS, tokens=NEXT)
    assert [b.meta.start for b in blocks] == [0, 4, 8, 12, 16, 20]
    out = tmp / "conv.pcpack"
    summary = packfile.write_pack(out, NS, blocks, {"conversation_tokens": len(NEXT)})
    assert summary == {"blocks": 6, "tokens": 22, "bytes": sum(len(b.data) for b in blocks)}
    return cache, out


def _counts(cache: PromptCache) -> tuple[int, int]:
    s = cache.stats()
    return s.ram_blocks, s.tiers["ssd"]["blocks_on_disk"]


def test_export_wipe_import_next_turn_hits_all_of_it(tmp_path: Path) -> None:
    cache, out = _exported(tmp_path)
    assert cache.delete() > 0
    assert _counts(cache) == (0, 0)
    assert cache.lookup(NEXT, NS).num_tokens == 0
    pack = packfile.read_pack(out)
    assert pack.namespace == NS and pack.num_tokens == 22 and len(pack.blocks) == 6
    assert all(b.sessions == ("s1",) for b in pack.blocks)
    report = packs.import_into(cache, pack, NS)
    assert report.to_dict() == {"blocks": 6, "added": 6, "tokens": 22}
    hit = cache.acquire(NEXT, NS, session_id="s1")
    assert hit.num_tokens == len(CONV)  # all of the conversation
    for meta, payload in hit.blocks:
        np.testing.assert_array_equal(payload["0.k"], payload_for(meta.start, meta.end, False)["0.k"])
    cache.release(hit)
    assert cache.flush(30)
    assert _counts(cache) == (6, 6)  # written through to the SSD as well
    # the sessions came along: deleting s1 removes the imported blocks everywhere
    assert cache.delete_session("s1", "alice") >= 6
    assert cache.lookup(NEXT, NS).num_tokens == 0
    # importing twice adds nothing
    packs.import_into(cache, pack, NS)
    assert packs.import_into(cache, pack, NS).added == 0
    cache.close()


def test_session_and_tenant_exports_bring_their_parents(tmp_path: Path) -> None:
    cache = make(tmp_path)
    shared = list(range(50, 58))
    cache.store(NS, shared + [1, 2, 3, 4], 12, payload_for, session_id="a")
    cache.store(NS, shared + [9, 9, 9, 9, 9], 13, payload_for, session_id="b")
    cache.store(NS.with_tenant("bob"), shared, 8, payload_for, session_id="b")
    assert cache.flush(30)
    cache.evict()  # now every block lives only on the SSD
    assert cache.stats().ram_blocks == 0
    b = packs.collect(cache, NS, session_id="b")
    assert [(x.meta.start, x.meta.num_tokens) for x in b] == [(0, 4), (4, 4), (8, 4), (12, 1)]
    assert all(x.meta.tenant == "alice" for x in b)
    everything = packs.collect(cache, NS)
    assert len(everything) == 5  # 2 shared + 1 of a + 2 of b
    cache.close()


def _flip(data: bytes, i: int) -> bytes:
    return data[:i] + bytes([data[i] ^ 0x41]) + data[i + 1:]


def _import_file(cache: PromptCache, data: bytes, target: Namespace) -> None:
    pack = packfile.read_pack(data)
    packs.import_into(cache, pack, target)


def test_any_flipped_byte_is_refused_and_nothing_is_imported(tmp_path: Path) -> None:
    cache, out = _exported(tmp_path)
    cache.delete()
    raw = out.read_bytes()
    tar = tarfile.open(fileobj=io.BytesIO(raw))
    members = tar.getmembers()
    offsets = {0, len(raw) - 1}
    for m in members:  # every header's first / last / checksum bytes, data first / last
        offsets |= {m.offset, m.offset + 150, m.offset + 511, m.offset_data,
                    m.offset_data + m.size - 1, m.offset_data + m.size}  # + padding
    offsets |= set(range(0, len(raw), max(1, len(raw) // 400)))  # and ~400 spread out
    for i in sorted(o for o in offsets if o < len(raw)):
        with pytest.raises(packfile.PackError, match="refusing the pack"):
            _import_file(cache, _flip(raw, i), NS)
    assert _counts(cache) == (0, 0)
    last = members[-1]
    for cut in (last.offset_data + last.size - 10, last.offset_data + last.size + 100):
        with pytest.raises(packfile.PackError, match="refusing the pack"):
            _import_file(cache, raw[:cut], NS)  # truncated
    with pytest.raises(packfile.PackError):
        _import_file(cache, raw + b"x", NS)
    assert _counts(cache) == (0, 0)
    _import_file(cache, raw, NS)  # the intact pack still imports
    assert cache.lookup(NEXT, NS).num_tokens == len(CONV)
    cache.close()


def test_another_model_block_size_or_kv_spec_is_refused(tmp_path: Path) -> None:
    cache, out = _exported(tmp_path)
    cache.delete()
    pack = packfile.read_pack(out)
    for target, msg in ((Namespace("model-b", BS, tenant="alice"), "another model"),
                        (Namespace("model-a", 8, tenant="alice"), "block size"),
                        (Namespace("model-a", BS, "bfloat16", tenant="alice"), "KV spec")):
        with pytest.raises(packfile.PackError, match=msg):
            packs.import_into(cache, pack, target)
    assert _counts(cache) == (0, 0)
    cache.close()


def _rewrite(raw: bytes, edit) -> bytes:  # type: ignore[no-untyped-def]
    """Rebuild a pack with a consistent manifest digest after ``edit(members, manifest)``."""
    tar = tarfile.open(fileobj=io.BytesIO(raw))
    members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    man = json.loads(members["manifest.json"])
    edit(members, man)
    mb = json.dumps(man).encode()
    members["manifest.json"] = mb
    members["manifest.sha256"] = hashlib.sha256(mb).hexdigest().encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_consistent_forgeries_are_refused(tmp_path: Path) -> None:
    cache, out = _exported(tmp_path)
    cache.delete()
    raw = out.read_bytes()

    def swap_payload(members, man):  # type: ignore[no-untyped-def]
        a, b = man["blocks"][0], man["blocks"][1]
        members[a["file"]] = members[b["file"]]
        a["sha256"], a["size"] = b["sha256"], b["size"]

    def change_token(members, man):  # type: ignore[no-untyped-def]
        man["blocks"][2]["tokens"][0] += 1

    def orphan(members, man):  # type: ignore[no-untyped-def]
        del man["blocks"][1]
        del members[f"blocks/{json.loads(members['manifest.json'])['blocks'][1]['hash']}.safetensors"]

    def smuggle(members, man):  # type: ignore[no-untyped-def]
        members["blocks/evil.safetensors"] = b"x"

    for edit, msg in ((swap_payload, "another block's payload"), (change_token, "hash does not"),
                      (orphan, "does not continue a chain"), (smuggle, "not in the manifest")):
        with pytest.raises(packfile.PackError, match=msg):
            _import_file(cache, _rewrite(raw, edit), NS)
    assert _counts(cache) == (0, 0)
    with pytest.raises(packfile.PackError, match="not a readable tar|no manifest"):
        packfile.read_pack(b"not a pack at all" * 100)
    cache.close()


def test_pack_start_checks_an_upload_as_it_arrives(tmp_path: Path) -> None:
    """``PackStart``: a real pack passes in any pieces; a body that does not start like
    a pack is refused by its first 512 bytes (or its manifest); ``read_pack`` reads the
    same pack from a file object as from its bytes."""
    cache, out = _exported(tmp_path)
    raw = out.read_bytes()
    for step in (1, 511, 512, 513, len(raw)):
        start = packfile.PackStart()
        for i in range(0, len(raw), step):
            start.feed(raw[i:i + step])
        assert start.done
    for body, msg in ((bytes(4096), "not a tar archive"),
                      (b"{" * 4096, "not a tar archive"),
                      (_flip(raw, 10), "not a tar archive"),  # the header's checksum
                      (_flip(raw, 600), "manifest is not JSON|not a promptcache pack")):
        start = packfile.PackStart()
        with pytest.raises(packfile.PackError, match=msg):
            start.feed(body)
    other = io.BytesIO()
    with tarfile.open(fileobj=other, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("blocks/x.safetensors")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    with pytest.raises(packfile.PackError, match="the first member is 'blocks/x.safetensors'"):
        packfile.PackStart().feed(other.getvalue())
    with open(out, "rb") as f:
        from_file = packfile.read_pack(f)
    assert from_file == packfile.read_pack(raw)
    cache.close()
