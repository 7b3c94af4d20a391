"""``promptcache cache export / import`` in process: no engine is built (only the model's
identity: fingerprint, KV spec, tokenizer), the namespace is the one a serving engine
uses, ``--model default`` (or no ``--model``) is the embedded default model as for
``serve``, and an export imported into a fresh folder holds the same blocks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from promptcache.cache import PromptCache
from promptcache.cli import main
from promptcache.config import CacheConfig, SSDConfig
from promptcache.engine.engine import Engine
from promptcache.engine.identity import open_identity
from promptcache.engine.models import gguf
from promptcache.engine.speculation import cost as spec_cost
from promptcache.meta import Namespace
from promptcache.serving_config import EngineConfig
from promptcache.tiers.ssd import SSDTier

BS = 16
CONV = list(range(100, 150))  # 3 full blocks of 16 + a 2-token tail


def payload_for(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    k = np.arange(start, end, dtype=np.float32).reshape(1, 1, -1, 1).repeat(4, axis=3)
    return {"0.k": k, "0.v": -k}


def _fill(folder: Path, ns: Namespace) -> None:
    """One conversation (session s1) and another chat (s2) in an SSD folder."""
    tier = SSDTier(SSDConfig(path=folder, fsync=False, policy="write_through"))
    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=1 << 22), lower=[tier],
                        write_through=True)
    cache.store(ns, CONV, len(CONV), payload_for, session_id="s1",
                save_point="end_generation")
    cache.store(ns, list(range(500, 520)), 20, payload_for, session_id="s2")
    assert cache.flush(30)
    cache.close(persist=False)


def _no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a pack command built an engine or measured a cost")

    monkeypatch.setattr(Engine, "__init__", refuse)
    monkeypatch.setattr(Engine, "load", refuse)
    monkeypatch.setattr(spec_cost, "measure_verify_cost", refuse)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    code = main(["cache", *argv])
    out = capsys.readouterr()
    return code, json.loads(out.out) if code == 0 else None, out.err


def test_identity_namespace_is_the_engines(tiny_model_path: Any) -> None:
    """The pack commands' namespace equals a serving engine's, per tenant, for a KV
    model, a sliding-window one and a hybrid (with stored-block quantization too)."""
    for kind in ("llama", "gemma3_text", "hybrid"):
        path = tiny_model_path(kind)
        for cc in (CacheConfig(block_size=BS), CacheConfig(block_size=BS, kv_bits=8)):
            engine = Engine.load(path, EngineConfig(speculation="off"), cc)
            try:
                identity = open_identity(path, cc)
                for tenant in ("default", "alice"):
                    assert identity.namespace(tenant) == engine.namespace(tenant), (kind, cc)
                assert identity.kv_spec == engine.kv_spec and identity.model_id == engine.model_id
                chat = [{"role": "user", "content": "What is the capital of France?"}]
                for gen in (True, False):  # --conversation renders as the engine does
                    assert identity.render_chat(chat, add_generation_prompt=gen) == \
                        engine.render_chat(chat, add_generation_prompt=gen)
            finally:
                engine.close()


def test_export_import_round_trip_builds_no_engine(
        tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    ns = open_identity(tiny_llama_path, CacheConfig(block_size=BS)).namespace()
    src = tmp_path / "src"
    _fill(src, ns)
    _no_engine(monkeypatch)
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps({"tokens": [*CONV, 1, 2, 3]}))
    common = ["--model", str(tiny_llama_path), "--block-size", str(BS)]
    code, summary, err = _run(capsys, "export", "--conversation", str(conv), "-o",
                              str(tmp_path / "conv.pcpack"), "--cache-dir", str(src), *common)
    assert code == 0, err
    assert {k: summary[k] for k in ("blocks", "tokens", "tenant")} == {
        "blocks": 4, "tokens": 50, "tenant": "default"}
    # the lines of the long steps, no engine's
    assert "promptcache: fingerprinting the weights ..." in err
    assert "promptcache: opening the model ..." in err
    assert "speculation" not in err and "loading the weights" not in err
    fresh = tmp_path / "fresh"  # import creates it, as serve does
    code, report, err = _run(capsys, "import", str(tmp_path / "conv.pcpack"), "--cache-dir",
                             str(fresh), *common)
    assert code == 0, err
    assert report == {"blocks": 4, "added": 4, "tokens": 50, "tenant": "default"}
    # the same blocks, byte for byte, in the fresh folder
    tiers = [SSDTier(SSDConfig(path=p), reconcile_on_open=False, read_only=True)
             for p in (src, fresh)]
    try:
        got = [{r.meta.block_hash: t.get(r.meta.block_hash, ns=ns) for r in t.rows("default")}
               for t in tiers]
    finally:
        for t in tiers:
            t.close()
    assert len(got[1]) == 4 and all(got[1][h] == got[0][h] for h in got[1])
    # a whole tenant: both chats
    code, summary, err = _run(capsys, "export", "--tenant", "default", "-o",
                              str(tmp_path / "all.pcpack"), "--cache-dir", str(src), *common)
    assert code == 0 and summary["blocks"] == 6, err


def test_export_takes_the_kv_bits_of_the_blocks_namespace(
        tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Blocks a server stored with ``--kv-bits 8`` are in their own namespace: the pack
    commands take serve's flags for it (block size, bits, group size, min tokens)."""
    ns8 = open_identity(tiny_llama_path, CacheConfig(block_size=BS, kv_bits=8)).namespace()
    src = tmp_path / "src"
    _fill(src, ns8)
    _no_engine(monkeypatch)
    common = ["--model", str(tiny_llama_path), "--block-size", str(BS), "--cache-dir", str(src)]
    code, summary, err = _run(capsys, "export", "--tenant", "default", "-o",
                              str(tmp_path / "kv8.pcpack"), *common, "--kv-bits", "8")
    assert code == 0 and summary["blocks"] == 6, err
    code, summary, err = _run(capsys, "export", "--tenant", "default", "-o",
                              str(tmp_path / "full.pcpack"), *common)
    assert (code, summary["blocks"]) == (0, 0), err  # full precision: another namespace
    code, report, err = _run(capsys, "import", str(tmp_path / "kv8.pcpack"), "--cache-dir",
                             str(tmp_path / "fresh"), "--model", str(tiny_llama_path),
                             "--block-size", str(BS), "--kv-bits", "8")
    assert code == 0 and report["added"] == 6, err
    with pytest.raises(SystemExit):  # argparse: serve's choices
        main(["cache", "export", "--tenant", "t", "-o", "x", "--kv-bits", "5"])


def test_model_default_is_the_embedded_default_as_for_serve(
        tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--model default`` and no ``--model`` resolve through the embedded default model's
    preparation (fetched if need be), as ``serve`` does; here it stands for the tiny
    llama."""
    asked: list[bool] = []

    def default_model(models_dir: Any = None, *, fetch: bool = False, **kw: Any) -> Path:
        asked.append(fetch)
        return tiny_llama_path

    monkeypatch.setattr(gguf, "ensure_default_model", default_model)
    _no_engine(monkeypatch)
    ns = open_identity(tiny_llama_path, CacheConfig(block_size=BS)).namespace()
    src = tmp_path / "src"
    _fill(src, ns)
    for model in (["--model", "default"], []):
        out = tmp_path / f"s1-{len(model)}.pcpack"
        code, summary, err = _run(capsys, "export", "--session", "s1", "-o", str(out),
                                  "--cache-dir", str(src), "--block-size", str(BS), *model)
        assert code == 0, err
        assert summary["blocks"] == 4
        code, report, err = _run(capsys, "import", str(out), "--cache-dir",
                                 str(tmp_path / f"fresh-{len(model)}"), "--block-size",
                                 str(BS), *model)
        assert code == 0 and report["added"] == 4, err
    assert asked == [True] * 4
    from promptcache.cli.serve_config import resolve_model
    from promptcache.engine.steps import no_steps

    assert resolve_model("default", no_steps) == str(tiny_llama_path)
    assert resolve_model(None, no_steps) == str(tiny_llama_path)
    assert resolve_model("some/repo", no_steps) == "some/repo"
    assert asked == [True] * 6


def test_an_unavailable_default_model_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def unavailable(*args: Any, **kwargs: Any) -> Path:
        raise gguf.DefaultModelUnavailable("cannot read PyPI's release (offline)")

    monkeypatch.setattr(gguf, "ensure_default_model", unavailable)
    (tmp_path / "src").mkdir()
    code = main(["cache", "export", "--session", "s", "-o", str(tmp_path / "o.pcpack"),
                 "--cache-dir", str(tmp_path / "src")])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "promptcache: error: cannot read PyPI's release (offline)")
