"""OpenBLAS for mlx on Linux: mlx's CPU wheel ships a BLAS 12-34x slower for float32 matmul
and ``LD_PRELOAD`` is read only at start, so ``reexec_with_openblas`` re-runs the command
once with Debian's OpenBLAS preloaded (``PROMPTCACHE_NO_OPENBLAS=1``: never)."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

OPT_OUT = "PROMPTCACHE_NO_OPENBLAS"
MARKER = "PROMPTCACHE_OPENBLAS_REEXEC"


def library_path(machine: str | None = None) -> Path:
    """Debian's pthread OpenBLAS for this machine's multiarch folder."""
    machine = machine or platform.machine()
    return Path(f"/usr/lib/{machine}-linux-gnu/openblas-pthread/libopenblas.so.0")


def is_mapped(library: Path, maps: Path = Path("/proc/self/maps")) -> bool:
    try:
        return os.path.realpath(library) in maps.read_text()
    except OSError:
        return False


def preload_environment(environ: Mapping[str, str], *, library: Path | None = None,
                        system: str = sys.platform, loaded: bool | None = None
                        ) -> dict[str, str] | None:
    """The environment to re-execute with (``LD_PRELOAD``, marker set), or None."""
    library = library if library is not None else library_path()
    if system != "linux" or environ.get(OPT_OUT, "") not in ("", "0") or MARKER in environ:
        return None
    preload = environ.get("LD_PRELOAD", "")
    if "libopenblas" in preload or not library.is_file():
        return None
    if loaded is None:
        loaded = is_mapped(library)
    if loaded:
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = f"{library}:{preload}" if preload else str(library)
    env[MARKER] = "1"
    return env


def reexec_with_openblas() -> None:
    """Re-execute this command with OpenBLAS preloaded; returns only when not needed/possible."""
    env = preload_environment(os.environ)
    if env is None or not sys.executable or not sys.orig_argv:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        return  # serve on the bundled BLAS; ``serve`` says so


def missing_warning(*, library: Path | None = None, system: str = sys.platform) -> str | None:
    """The one line to print when mlx runs on its slow bundled BLAS because OpenBLAS is
    not installed (None otherwise: not Linux, installed, or preloaded from elsewhere)."""
    library = library if library is not None else library_path()
    if system != "linux" or library.is_file() or "libopenblas" in os.environ.get("LD_PRELOAD", ""):
        return None
    return ("promptcache: warning: OpenBLAS is not installed, so mlx runs on its bundled "
            "reference BLAS (float32 matmul 12-34x slower); install it with "
            "`apt-get install libopenblas0-pthread` and promptcache preloads it")
