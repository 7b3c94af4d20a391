"""The ``promptcache`` command preloads Debian's OpenBLAS on Linux by re-executing itself
once (``promptcache/cli/openblas.py``): a real subprocess through the entry point
``main()``, with ``/proc/self/maps`` read after the command ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from promptcache.cli.openblas import (
    HUGEPAGES,
    MARKER,
    OPT_OUT,
    library_path,
    missing_warning,
    preload_environment,
)

LIB = library_path()
needs_openblas = pytest.mark.skipif(
    sys.platform != "linux" or not LIB.is_file(), reason="needs Linux and Debian's OpenBLAS")

# a sitecustomize that reports, when the process ends, whether OpenBLAS is mapped (the
# process that was replaced by exec never gets there)
REPORT = f"""
import atexit, json, os, sys

def _report():
    mapped = os.path.realpath({str(LIB)!r}) in open("/proc/self/maps").read()
    print("REPORT " + json.dumps({{"mapped": mapped, "preload": os.environ.get("LD_PRELOAD"),
                                   "tunables": os.environ.get("GLIBC_TUNABLES"),
                                   "marker": os.environ.get({MARKER!r})}}), file=sys.stderr)

atexit.register(_report)
"""
# the console script's body (what pyproject's entry point runs)
CONSOLE_SCRIPT = "import sys; from promptcache.cli import main; sys.exit(main())"


def _run(tmp_path: Path, *, module: bool = False, **env: str) -> tuple[dict[str, object], str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(REPORT)
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES", OPT_OUT, MARKER)}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), base.get("PYTHONPATH")) if p)
    entry = ["-m", "promptcache.cli"] if module else ["-c", CONSOLE_SCRIPT]
    proc = subprocess.run([sys.executable, *entry, "cache", "stats", "--cache-dir",
                           str(tmp_path)], env={**base, **env}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    reports = [ln for ln in proc.stderr.splitlines() if ln.startswith("REPORT ")]
    assert len(reports) == 1, proc.stderr
    return json.loads(reports[0].removeprefix("REPORT ")), proc.stdout


@needs_openblas
@pytest.mark.parametrize("module", [False, True], ids=["console-script", "python-m"])
def test_the_command_runs_once_with_openblas_preloaded(tmp_path: Path, module: bool) -> None:
    report, out = _run(tmp_path, module=module)
    assert report == {"mapped": True, "preload": str(LIB), "tunables": HUGEPAGES, "marker": "1"}
    # the command itself ran once: one JSON document on stdout
    assert json.loads(out)["cache_dir"] == str(tmp_path)


@needs_openblas
def test_the_opt_out_and_the_marker_keep_the_bundled_blas(tmp_path: Path) -> None:
    report, out = _run(tmp_path, **{OPT_OUT: "1"})
    assert report == {"mapped": False, "preload": None, "tunables": None, "marker": None}
    assert json.loads(out)["cache_dir"] == str(tmp_path)
    report, out = _run(tmp_path, **{MARKER: "1"})  # the re-executed process never loops
    assert report == {"mapped": False, "preload": None, "tunables": None, "marker": "1"}
    assert json.loads(out)["cache_dir"] == str(tmp_path)


@needs_openblas
def test_an_existing_preload_is_kept_after_openblas(tmp_path: Path) -> None:
    libm = "/lib/x86_64-linux-gnu/libm.so.6"
    if not Path(libm).is_file():
        pytest.skip("no libm at the Debian path")
    report, _ = _run(tmp_path, LD_PRELOAD=libm, GLIBC_TUNABLES="glibc.malloc.arena_max=2")
    assert report == {"mapped": True, "preload": f"{LIB}:{libm}",
                      "tunables": f"glibc.malloc.arena_max=2:{HUGEPAGES}", "marker": "1"}


def test_when_nothing_is_to_be_done(tmp_path: Path) -> None:
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    env = preload_environment({"PATH": "/bin"}, library=lib, system="linux", loaded=False)
    assert env == {"PATH": "/bin", "LD_PRELOAD": str(lib), "GLIBC_TUNABLES": HUGEPAGES,
                   MARKER: "1"}
    # huge pages alone: OpenBLAS missing, already mapped or preloaded from elsewhere
    for kw in ({"library": tmp_path / "missing.so"}, {"loaded": True}):
        args = {"library": lib, "system": "linux", "loaded": False, **kw}
        assert preload_environment({}, **args) == {"GLIBC_TUNABLES": HUGEPAGES, MARKER: "1"}
    assert preload_environment({"LD_PRELOAD": "/opt/libopenblas.so"}, library=lib,
                               system="linux", loaded=False) == {
        "LD_PRELOAD": "/opt/libopenblas.so", "GLIBC_TUNABLES": HUGEPAGES, MARKER: "1"}
    # OpenBLAS alone: the tunable already set (by the user, with a value of theirs)
    hugetlb0 = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert preload_environment(hugetlb0, library=lib, system="linux", loaded=False) == {
        **hugetlb0, "LD_PRELOAD": str(lib), MARKER: "1"}
    done = {"GLIBC_TUNABLES": HUGEPAGES}
    for environ, kw in (({}, {"system": "darwin"}),
                        (done, {"library": tmp_path / "missing.so"}),
                        (done, {"loaded": True}),
                        ({OPT_OUT: "1"}, {}),
                        ({MARKER: "1"}, {}),
                        ({**done, "LD_PRELOAD": "/opt/libopenblas.so"}, {})):
        args = {"library": lib, "system": "linux", "loaded": False, **kw}
        assert preload_environment(environ, **args) is None, (environ, kw)
    assert preload_environment({OPT_OUT: "0"}, library=lib, system="linux",
                               loaded=False) is not None


def test_the_warning_when_openblas_is_missing(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    line = missing_warning(library=tmp_path / "missing.so", system="linux")
    assert line is not None and "apt-get install libopenblas0-pthread" in line
    assert "\n" not in line
    assert missing_warning(library=tmp_path / "missing.so", system="darwin") is None
    (tmp_path / "here.so").write_bytes(b"")
    assert missing_warning(library=tmp_path / "here.so", system="linux") is None
