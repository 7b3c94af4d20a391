"""The systems under test: start, stop, restart and kill -9 each on a free 127.0.0.1 port.

- ``ours``: ``promptcache serve`` (RAM + SSD cache in a per-run cache dir)
- ``ours_kv8`` / ``ours_kv4``: ``ours`` with ``--kv-bits 8`` / ``4`` and
  ``--kv-quant-min-tokens 0`` (every block quantized; not run by default)
- ``ours_nospec``: ``ours`` with ``--speculation off`` (speculation is on by default: the
  baseline speculation's scenarios E1-E5 compare with; not run by default)
- ``ours_spec``: ``ours`` with ``--speculation suffix`` named explicitly (runs before the
  default changed compared ``ours_spec`` with ``ours``; not run by default)
- ``nocache``: ``promptcache serve --no-cache``
- ``mlx_lm``: ``mlx_lm server`` from the project venv (in-RAM LRUPromptCache)
- ``vllm_mlx``: ``vllm-mlx serve --continuous-batching`` from the separate peers venv
  (``bench/peers.sh``); skipped with a reason when that venv is missing.

Each server runs in its own process group; ``ServerProcess`` samples the group's RSS
(psutil) in a background thread and keeps the peak over the process's lifetimes.
The environment is inherited as is: LD_PRELOAD / OPENBLAS_* are whatever the bench
was started with (recorded in the results, never set here).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil  # type: ignore[import-untyped]

log = logging.getLogger(__name__)

SYSTEM_NAMES = ("ours", "mlx_lm", "vllm_mlx", "nocache")
# ours with quantized cached blocks (--kv-bits): on request only
KV_BITS = {"ours_kv8": 8, "ours_kv4": 4}
# ours with other options: on request only
VARIANTS = {"ours_spec": ("--speculation", "suffix"), "ours_nospec": ("--speculation", "off")}
OURS = ("ours", *KV_BITS, *VARIANTS)  # the systems that are promptcache serve with a cache
PEERS_DIR_ENV = "PROMPTCACHE_PEERS_DIR"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peers_dir() -> Path:
    env = os.environ.get(PEERS_DIR_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".peers"


def vllm_mlx_binary() -> Path:
    return peers_dir() / "vllm-mlx" / "bin" / "vllm-mlx"


@dataclass(frozen=True)
class SystemSpec:
    name: str
    anthropic: bool  # speaks POST /v1/messages
    reports_cached: bool  # reports cached prompt tokens in usage
    description: str


SPECS = {
    "ours": SystemSpec("ours", True, True, "promptcache serve (RAM + SSD)"),
    "ours_kv8": SystemSpec("ours_kv8", True, True, "promptcache serve --kv-bits 8 --kv-quant-min-tokens 0 (RAM + SSD)"),
    "ours_kv4": SystemSpec("ours_kv4", True, True, "promptcache serve --kv-bits 4 --kv-quant-min-tokens 0 (RAM + SSD)"),
    "ours_spec": SystemSpec("ours_spec", True, True, "promptcache serve --speculation suffix (RAM + SSD)"),
    "ours_nospec": SystemSpec("ours_nospec", True, True, "promptcache serve --speculation off (RAM + SSD)"),
    "nocache": SystemSpec("nocache", True, True, "promptcache serve --no-cache"),
    "mlx_lm": SystemSpec("mlx_lm", False, True, "mlx_lm server (in-RAM LRUPromptCache)"),
    "vllm_mlx": SystemSpec("vllm_mlx", True, True, "vllm-mlx serve --continuous-batching"),
}


def parse_systems(spec: str) -> list[str]:
    out: list[str] = []
    for part in spec.split(","):
        part = part.strip().lower().replace("-", "_")
        if not part:
            continue
        if part not in SPECS:
            raise ValueError(f"unknown system {part!r}; expected some of "
                             f"{','.join((*SYSTEM_NAMES, *KV_BITS, *VARIANTS))}")
        if part not in out:
            out.append(part)
    if not out:
        raise ValueError("no system given")
    return out


def unavailable_reason(name: str) -> str | None:
    """Why a system cannot run here, or None."""
    if name == "vllm_mlx" and not vllm_mlx_binary().exists():
        return f"{vllm_mlx_binary()} not found (run `make peers` / bench/peers.sh)"
    return None


def build_command(name: str, model: str, port: int, *, cache_dir: Path | None = None,
                  ram_budget_bytes: int | None = None, extra_args: tuple[str, ...] = (),
                  chat_template: Path | None = None) -> list[str]:
    """The argv that starts system ``name`` serving ``model`` on 127.0.0.1:``port``
    (``extra_args``: more options for ours, e.g. ``--redis-url``; ``chat_template``: a
    template file that replaces the model's, for ours and mlx_lm.server)."""
    if chat_template is not None:
        if name == "vllm_mlx":
            raise ValueError("vllm_mlx: the bench does not pass it a chat template")
        extra_args = (*extra_args, "--chat-template", str(chat_template))
    if name in ("nocache", *OURS):
        cmd = [sys.executable, "-c", "import sys; from promptcache.cli import main; sys.exit(main())",
               "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
               *extra_args]
        if name == "nocache":
            return cmd + ["--no-cache"]
        if name in KV_BITS:
            # every block quantized (the server's default keeps the first 256 tokens at
            # full precision): what a RAM budget holds with quantized blocks
            cmd += ["--kv-bits", str(KV_BITS[name]), "--kv-quant-min-tokens", "0"]
        cmd += VARIANTS.get(name, ())
        if cache_dir is not None:
            cmd += ["--cache-dir", str(cache_dir)]
        if ram_budget_bytes is not None:
            cmd += ["--ram-budget", f"{max(1, ram_budget_bytes // 2**20)}MB"]
        return cmd
    if name == "mlx_lm":
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", model,
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
        if ram_budget_bytes is not None:
            cmd += ["--prompt-cache-bytes", str(ram_budget_bytes)]
        if chat_template is not None:  # mlx_lm.server takes the template's text
            cmd += ["--chat-template", chat_template.read_text(encoding="utf-8")]
        return cmd
    if name == "vllm_mlx":
        cmd = [str(vllm_mlx_binary()), "serve", model, "--continuous-batching",
               "--host", "127.0.0.1", "--port", str(port)]
        if cache_dir is not None:  # its SSD tier, the counterpart of ours
            cmd += ["--ssd-cache-dir", str(cache_dir / "ssd")]
        if ram_budget_bytes is not None:
            cmd += ["--cache-memory-mb", str(max(1, ram_budget_bytes // 2**20))]
        return cmd
    raise ValueError(f"unknown system {name!r}")


def build_env(name: str, cache_dir: Path | None) -> dict[str, str]:
    """The server's environment: ours, plus for vllm-mlx a HOME inside the run's cache dir.

    vllm-mlx persists its prefix cache at shutdown under ``~/.cache/vllm-mlx``; a per-run
    HOME keeps runs independent and lets its bytes on disk be measured.
    """
    env = dict(os.environ)
    if name == "vllm_mlx" and cache_dir is not None:
        home = cache_dir / "home"
        home.mkdir(parents=True, exist_ok=True)
        env["HOME"] = str(home)
    return env


def group_rss(pid: int) -> int:
    """RSS of a process and all its descendants, in bytes (0 if gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def dir_bytes(path: Path | None) -> int:
    """Bytes of the regular files under ``path`` (0 if missing)."""
    if path is None or not path.exists():
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


@dataclass
class ServerProcess:
    name: str
    model: str
    log_path: Path
    cache_dir: Path | None = None
    ram_budget_bytes: int | None = None
    extra_args: tuple[str, ...] = ()
    chat_template: Path | None = None
    ready_timeout_s: float = 600.0
    sample_interval_s: float = 0.2
    port: int = 0
    model_id: str = ""
    peak_rss: int = 0
    starts: int = 0
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _stop_sampling: threading.Event = field(default_factory=threading.Event, repr=False)
    _sampler: threading.Thread | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> float:
        """Start the server and wait until it answers GET /v1/models; returns the startup time."""
        if self._proc is not None:
            raise RuntimeError(f"{self.name} is already running")
        self.model_id = ""
        self.port = free_port()
        cmd = build_command(self.name, self.model, self.port, cache_dir=self.cache_dir,
                            ram_budget_bytes=self.ram_budget_bytes, extra_args=self.extra_args,
                            chat_template=self.chat_template)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting %s: %s", self.name, " ".join(cmd))
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n==== start: {' '.join(cmd)}\n".encode())
            logf.flush()
            self._proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          env=build_env(self.name, self.cache_dir))
        self.starts += 1
        self._stop_sampling = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name=f"rss-{self.name}", daemon=True)
        self._sampler.start()
        try:
            self._wait_ready(t0)
        except Exception:
            self.kill()
            raise
        return time.perf_counter() - t0

    def _wait_ready(self, t0: float) -> None:
        deadline = t0 + self.ready_timeout_s
        while time.perf_counter() < deadline:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                code = None if proc is None else proc.returncode
                raise RuntimeError(f"{self.name} exited with code {code} during startup; "
                                   f"see {self.log_path}: {self.log_tail()}")
            if self._probe():
                return
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {self.ready_timeout_s:.0f}s; "
                           f"see {self.log_path}")

    def _probe(self) -> bool:
        """Ready when GET /health or GET /v1/models answers 200; learns the model id.

        The model id falls back to the model path the server was given.
        """
        ready = False
        # mlx_lm.server's /v1/models scans the Hugging Face cache (a traceback without one)
        paths = ("/health",) if self.name == "mlx_lm" else ("/health", "/v1/models")
        for path in paths:
            try:
                r = httpx.get(f"{self.base_url}{path}", timeout=5.0)
            except httpx.HTTPError:
                continue
            if r.status_code != 200:
                continue
            ready = True
            if path == "/v1/models":
                try:
                    data = r.json().get("data") or []
                    self.model_id = str(data[0]["id"])
                except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                    pass
        if ready and not self.model_id:
            self.model_id = self.model
        return ready

    def _sample(self) -> None:
        proc = self._proc
        while proc is not None and not self._stop_sampling.is_set():
            self.peak_rss = max(self.peak_rss, group_rss(proc.pid))
            self._stop_sampling.wait(self.sample_interval_s)

    def _end_sampling(self) -> None:
        self._stop_sampling.set()
        if self._sampler is not None:
            self._sampler.join(timeout=5)
        self._sampler = None

    def stop(self, timeout_s: float = 60.0) -> None:
        """A clean shutdown: SIGTERM to the group, SIGKILL if it does not exit in time."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self.peak_rss = max(self.peak_rss, group_rss(proc.pid))
            self._signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs: SIGKILL", self.name, timeout_s)
                self._signal(signal.SIGKILL)
                proc.wait(timeout=30)
        self._end_sampling()
        self._proc = None

    def kill(self) -> None:
        """kill -9 of the whole server process group (no chance to flush anything)."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self._signal(signal.SIGKILL)
            proc.wait(timeout=30)
        self._end_sampling()
        self._proc = None

    def _signal(self, sig: int) -> None:
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass

    def current_rss(self) -> int:
        return group_rss(self._proc.pid) if self._proc is not None else 0

    def disk_bytes(self) -> int:
        return dir_bytes(self.cache_dir)

    def log_tail(self, n: int = 600) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""
