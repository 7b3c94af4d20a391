"""The exact model fingerprint (promptcache.fingerprint): every byte of the weights,
remembered by path + size + mtime + ctime + inode, Hugging Face blob digests as is."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from promptcache import fingerprint as fp
from promptcache.fingerprint import MEMO_NAME, model_fingerprint


def make_model(folder: Path, n: int = 1 << 18, seed: int = 0) -> Path:
    """A model folder: config.json + two safetensors files (~1 MB of float32)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    rng = np.random.default_rng(seed)
    save_file({"w": rng.standard_normal(n, dtype=np.float32)}, str(folder / "model-00001.safetensors"))
    save_file({"v": rng.standard_normal(n // 4, dtype=np.float32)}, str(folder / "model-00002.safetensors"))
    return folder


def flip_byte(path: Path, offset_from_end: int) -> None:
    """Change one byte in place (same size); restore the mtime as a copy tool might.
    Waits until the file's ctime has moved past its old value (file times come from a
    coarse clock: a change within the same tick would be invisible to any stamp)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))
    while path.stat().st_ctime_ns == st.st_ctime_ns:
        os.chmod(path, st.st_mode)  # sets ctime to "now" again, until the clock moved on
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_stable_and_independent_of_location_and_config_formatting(tmp_path):
    a = make_model(tmp_path / "a")
    memo = tmp_path / "memo"
    base = model_fingerprint(a, memo_dir=memo)
    assert len(base) == 64 and base == model_fingerprint(a, memo_dir=memo)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert model_fingerprint(b, memo_dir=memo) == base
    cfg = json.loads((b / "config.json").read_text())
    (b / "config.json").write_text(json.dumps(cfg, indent=4))
    assert model_fingerprint(b, memo_dir=memo) == base
    (b / "config.json").write_text(json.dumps({**cfg, "hidden_size": 9}))
    assert model_fingerprint(b, memo_dir=memo) != base
    assert model_fingerprint(a, memo=False) == base


@pytest.mark.parametrize("where", [1, 1000, 300_000, 1 << 20], ids=lambda w: f"{w}B-from-end")
def test_two_checkpoints_that_differ_in_one_weight_byte_get_different_namespaces(tmp_path, where):
    """Equal configs, equal sizes, equal headers: only one data byte differs (anywhere:
    the old fingerprint sampled 16 x 4 KB and missed most such bytes)."""
    from promptcache.meta import Namespace

    a = make_model(tmp_path / "base")
    b = tmp_path / "finetune"
    shutil.copytree(a, b)
    flip_byte(b / "model-00001.safetensors", where)
    fa = model_fingerprint(a, memo_dir=tmp_path / "memo")
    fb = model_fingerprint(b, memo_dir=tmp_path / "memo")
    assert fa != fb
    assert Namespace(fa, 64).root != Namespace(fb, 64).root


def test_the_memo_makes_later_starts_read_no_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(fp, "RECENT_NS", 0)  # the files were just written
    a = make_model(tmp_path / "a")
    memo = tmp_path / "memo"
    calls: list[str] = []
    real = fp.hash_file

    def counting(path: Path) -> str:
        calls.append(path.name)
        return real(path)

    monkeypatch.setattr(fp, "hash_file", counting)
    first = model_fingerprint(a, memo_dir=memo)
    assert sorted(calls) == ["model-00001.safetensors", "model-00002.safetensors"]
    doc = json.loads((memo / MEMO_NAME).read_text())
    assert doc["version"] == 1 and len(doc["files"]) == 2
    calls.clear()
    assert model_fingerprint(a, memo_dir=memo) == first
    assert calls == []  # remembered: nothing read
    # an in-place change that keeps size and mtime is still seen (ctime moved)
    flip_byte(a / "model-00002.safetensors", 10)
    assert model_fingerprint(a, memo_dir=memo) != first
    assert calls == ["model-00002.safetensors"]


def test_a_recently_changed_file_is_not_remembered(tmp_path):
    a = make_model(tmp_path / "a")  # just written: within RECENT_NS
    model_fingerprint(a, memo_dir=tmp_path / "memo")
    assert not (tmp_path / "memo" / MEMO_NAME).exists()


def test_a_broken_memo_is_ignored_and_rewritten(tmp_path, monkeypatch):
    monkeypatch.setattr(fp, "RECENT_NS", 0)
    a = make_model(tmp_path / "a")
    memo = tmp_path / "memo"
    memo.mkdir()
    (memo / MEMO_NAME).write_text("{not json")
    want = model_fingerprint(a, memo=False)
    assert model_fingerprint(a, memo_dir=memo) == want
    assert json.loads((memo / MEMO_NAME).read_text())["version"] == 1
    # a forged entry with another stamp is not believed
    doc = json.loads((memo / MEMO_NAME).read_text())
    for e in doc["files"].values():
        e["stamp"][0] += 1
        e["digest"] = "xxh3_128:forged"
    (memo / MEMO_NAME).write_text(json.dumps(doc))
    assert model_fingerprint(a, memo_dir=memo) == want


def test_a_hugging_face_blob_digest_is_used_without_reading(tmp_path, monkeypatch):
    """hub cache layout: snapshots/<rev>/file -> ../../blobs/<sha256 of content>."""
    src = make_model(tmp_path / "src")
    repo = tmp_path / "hub" / "models--org--m"
    snap = repo / "snapshots" / ("ab" * 20)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        import hashlib

        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / digest)
        (snap / f.name).symlink_to(Path("../..") / "blobs" / digest)

    def no_reading(path: Path) -> str:
        raise AssertionError(f"{path} was read")

    monkeypatch.setattr(fp, "hash_file", no_reading)
    hub = model_fingerprint(snap, memo=False)
    assert hub == model_fingerprint(snap, memo=False)
    assert hub != "" and len(hub) == 64


def test_bad_model_folders_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="not a model folder"):
        model_fingerprint(tmp_path, memo=False)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        model_fingerprint(tmp_path, memo=False)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no .safetensors"):
        model_fingerprint(tmp_path, memo=False)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8 + b"x")
    with pytest.raises(ValueError, match="not a safetensors file"):
        model_fingerprint(tmp_path, memo=False)


def test_no_mlx_in_the_fingerprint_module():
    import ast

    tree = ast.parse(Path(fp.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(n.startswith("mlx") for n in names)
