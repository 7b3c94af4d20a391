"""The process environment mlx needs on Linux, read only at start, so ``reexec_with_openblas``
re-runs the command once with it (``PROMPTCACHE_NO_OPENBLAS=1``: never): Debian's OpenBLAS
preloaded (mlx's bundled BLAS is 12-34x slower for float32 matmul) and glibc's malloc asked
for transparent huge pages (mlx's CPU buffers come from malloc; a fresh one faults in at
~1.5 GB/s in 4 KB pages, 4-5x slower than in 2 MB pages)."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

OPT_OUT = "PROMPTCACHE_NO_OPENBLAS"
MARKER = "PROMPTCACHE_OPENBLAS_REEXEC"
HUGEPAGES = "glibc.malloc.hugetlb=1"  # madvise(MADV_HUGEPAGE) on malloc's mappings


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
    """The environment to re-execute with (``LD_PRELOAD`` and ``GLIBC_TUNABLES`` where
    missing, marker set), or None when nothing is missing."""
    library = library if library is not None else library_path()
    if system != "linux" or environ.get(OPT_OUT, "") not in ("", "0") or MARKER in environ:
        return None
    add: dict[str, str] = {}
    preload = environ.get("LD_PRELOAD", "")
    if "libopenblas" not in preload and library.is_file() and \
            not (is_mapped(library) if loaded is None else loaded):
        add["LD_PRELOAD"] = f"{library}:{preload}" if preload else str(library)
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" not in tunables:
        add["GLIBC_TUNABLES"] = f"{tunables}:{HUGEPAGES}" if tunables else HUGEPAGES
    return {**environ, **add, MARKER: "1"} if add else None


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
