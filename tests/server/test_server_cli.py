"""`promptcache serve` option parsing (no model is loaded)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from promptcache.cli import build_parser
from promptcache.cli.serve_cmd import build_configs


def _configs(*argv: str):  # type: ignore[no-untyped-def]
    return build_configs(build_parser().parse_args(["serve", *argv]))


def test_serve_options(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text('{"k": "alice"}')
    eng, cache, ssd, srv = _configs(
        "--port", "9000", "--block-size", "32", "--ram-budget", "512MB", "--cache-dir",
        str(tmp_path / "blocks"), "--ssd-budget", "4GB", "--api-key", "s", "--api-keys-file",
        str(keys), "--hit-rate-window", "7", "--hit-rate-threshold", "0.5")
    assert (cache.block_size, cache.ram_budget_bytes, cache.enabled) == (32, 512 * 1024**2, True)
    assert ssd is not None and ssd.path == tmp_path / "blocks" and ssd.budget_bytes == 4 * 1024**3
    assert ssd.policy == "write_through"  # the server's default: survives kill -9
    assert eng.prefill_chunk_tokens == 256
    assert (srv.port, srv.api_key, srv.api_keys_file) == (9000, "s", keys)
    assert (srv.hit_rate_window, srv.hit_rate_alert_threshold) == (7, 0.5)
    assert (eng.default_max_tokens, srv.context_window, srv.max_tokens_overflow,
            srv.log_requests_dir) == (512, None, "clamp", None)
    eng, _, _, srv = _configs("--default-max-tokens", "2048", "--context-window", "8192",
                              "--max-tokens-overflow", "error", "--log-requests",
                              str(tmp_path / "req"), "--no-ssd")
    assert (eng.default_max_tokens, srv.context_window, srv.max_tokens_overflow,
            srv.log_requests_dir) == (2048, 8192, "error", tmp_path / "req")


def test_serve_percent_budget_and_switches(tmp_path: Path) -> None:
    _, cache, ssd, _ = _configs("--ram-budget", "20%", "--no-ssd")
    assert ssd is None
    assert cache.ram_budget_bytes == pytest.approx(psutil.virtual_memory().available * 0.2,
                                                   rel=0.05)
    _, cache, ssd, _ = _configs("--no-cache", "--cache-dir", str(tmp_path))
    assert ssd is None and cache.enabled is False
    _, _, ssd, _ = _configs("--cache-dir", str(tmp_path), "--ssd-policy", "write_back")
    assert ssd is not None and ssd.policy == "write_back"
    eng, _, _, _ = _configs("--block-size", "48", "--no-ssd")
    assert eng.prefill_chunk_tokens == 240  # a multiple of the block size
    _, cache, _, _ = _configs("--no-ssd")
    assert (cache.protect_share, cache.active_session_s) == (0.25, 600.0)
    _, cache, _, _ = _configs("--no-ssd", "--protect-share", "0.5",
                              "--session-active-minutes", "2.5")
    assert (cache.protect_share, cache.active_session_s) == (0.5, 150.0)
    _, cache, _, _ = _configs("--no-ssd", "--session-active-minutes", "0")
    assert cache.active_session_s is None


@pytest.mark.parametrize("argv", [
    ("--ram-budget", "lots"), ("--ssd-budget=-1GB",), ("--block-size", "0"),
    ("--port", "70000"), ("--api-keys-file", "/nonexistent/keys.json"),
    ("--ram-budget", "150%"), ("--hit-rate-window", "0"), ("--hit-rate-threshold", "2"),
    ("--default-max-tokens", "0"), ("--context-window", "1"), ("--protect-share", "1.5"),
    ("--session-active-minutes", "-1"),
])
def test_serve_bad_options(argv: tuple[str, ...], tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        _configs(*argv, "--cache-dir", str(tmp_path))


def test_serve_speculation_options() -> None:
    eng, *_ = _configs("--speculation", "suffix", "--spec-max-draft", "6",
                       "--spec-pool-tokens", "1000")
    assert (eng.speculation, eng.spec_max_draft, eng.spec_pool_tokens) == ("suffix", 6, 1000)
    eng, *_ = _configs()
    assert (eng.speculation, eng.spec_pool_tokens) == ("suffix", 65_536)  # on by default
    eng, *_ = _configs("--speculation", "off")
    assert eng.speculation == "off"
    with pytest.raises(ValueError, match="--spec-pool-tokens must be >= 0"):
        _configs("--spec-pool-tokens", "-1")
    assert eng.spec_verify_cost == "auto"
    for value in ("0.3", "1.4,1.6,2.1"):
        eng, *_ = _configs("--spec-verify-cost", value)
        assert eng.spec_verify_cost == value
    for bad in ("cheap", "-0.5", "1.4,0.5"):
        with pytest.raises(ValueError, match="--spec-verify-cost"):
            _configs("--spec-verify-cost", bad)
    assert eng.spec_max_slowdown == 0.0
    eng, *_ = _configs("--spec-max-slowdown", "0.1")
    assert eng.spec_max_slowdown == 0.1
    for bad in ("-0.1", "nan", "inf"):
        with pytest.raises(ValueError, match="--spec-max-slowdown must be a number >= 0"):
            _configs("--spec-max-slowdown", bad)


def test_serve_chat_template_option(tmp_path: Path) -> None:
    from promptcache.cli.serve_cmd import read_chat_template

    parse = build_parser().parse_args
    assert read_chat_template(parse(["serve"]).chat_template) is None
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    assert read_chat_template(parse(["serve", "--chat-template", str(f)]).chat_template) \
        == f.read_text(encoding="utf-8")
    inline = "{{ messages[0]['content'] }}"
    assert read_chat_template(inline) == inline
    with pytest.raises(ValueError, match="not a readable template file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match=r"not a valid Jinja template \(line 1"):
        read_chat_template("{% for m in messages %}{{ m }}")
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="the template is empty"):
        read_chat_template(str(empty))


def _occupied_port() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


BUSY = ("promptcache: error: cannot serve on 127.0.0.1:{port}: the address is already in "
        "use (another server?); pick another --port")


def test_serve_checks_the_port_before_loading(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from promptcache.cli import main
    from promptcache.cli.serve_cmd import check_port

    with _occupied_port() as busy:
        port = busy.getsockname()[1]
        # a model that does not exist: reaching the load would fail differently
        assert main(["serve", "--port", str(port), "--no-ssd",
                     "--model", str(tmp_path / "no-model")]) == 2
        assert capsys.readouterr().err.splitlines() == [BUSY.format(port=port)]
    check_port("127.0.0.1", port)  # free again: no error, and nothing left bound
    check_port("127.0.0.1", port)


def test_serve_on_a_busy_port_exits_at_once(tmp_path: Path) -> None:
    with _occupied_port() as busy:
        port = busy.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "promptcache.cli", "serve", "--port", str(port),
             "--no-ssd", "--model", str(tmp_path / "no-model")],
            capture_output=True, text=True, timeout=60)
        took = time.monotonic() - start
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [BUSY.format(port=port)]
    assert took < 30  # secondary: nothing was loaded (a model load takes far longer)


def test_serve_takes_vllm_spellings(tmp_path: Path) -> None:
    from promptcache.cli.serve_cmd import model_of

    parse = build_parser().parse_args
    assert model_of(parse(["serve"])) is None  # the embedded default model
    assert model_of(parse(["serve", "org/model"])) == "org/model"  # vllm serve MODEL
    assert model_of(parse(["serve", "--model", "org/model"])) == "org/model"
    assert model_of(parse(["serve", "--port", "9000", "org/model", "--no-ssd"])) == "org/model"
    assert model_of(parse(["serve", "org/model", "--model", "org/model"])) == "org/model"
    with pytest.raises(ValueError, match=r"two models given \(a/b and --model c/d\)"):
        model_of(parse(["serve", "a/b", "--model", "c/d"]))
    # --served-model-name is --model-alias (a name accepted), --max-model-len --context-window
    args = parse(["serve", "--served-model-name", "gpt-x", "--model-alias", "other",
                  "--max-model-len", "4096"])
    assert (args.model_alias, args.context_window) == (["gpt-x", "other"], 4096)
    _, _, _, srv = _configs("--max-model-len", "8192", "--cache-dir", str(tmp_path))
    assert srv.context_window == 8192


def test_serve_an_unreachable_hub_model_is_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    with _occupied_port() as sock:  # a port nobody listens on once closed
        port = sock.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "promptcache.cli", "serve", "some-org/some-model",
         "--cache-dir", str(tmp_path / "blocks"), "--port", str(port)],
        env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith(
        "promptcache: error: model 'some-org/some-model': not a local folder, and it could "
        "not be downloaded from the Hugging Face hub (LocalEntryNotFoundError: ")
    assert last.endswith(")")
    assert [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()] == [last]


def test_serve_repetition_penalty_is_the_model_s_default() -> None:
    eng, *_ = _configs("--no-ssd")  # the embedded default model: Ollama's defaults
    assert (eng.repetition_penalty, eng.repetition_context_size) == (1.1, 64)
    eng, *_ = _configs("--no-ssd", "--model", "default")
    assert (eng.repetition_penalty, eng.repetition_context_size) == (1.1, 64)
    eng, *_ = _configs("--no-ssd", "--model", "/some/model")  # any other: off
    assert (eng.repetition_penalty, eng.repetition_context_size) == (1.0, 20)
    eng, *_ = _configs("--no-ssd", "--repetition-penalty", "1.0",
                       "--repetition-context-size", "64")
    assert (eng.repetition_penalty, eng.repetition_context_size) == (1.0, 64)
    for argv in (("--repetition-penalty", "0"), ("--repetition-context-size", "0")):
        with pytest.raises(ValueError, match="--repetition-penalty must be in"):
            _configs("--no-ssd", *argv)


def test_serve_ssd_segments_flag(tmp_path: Path) -> None:
    _, _, ssd, _ = _configs("--cache-dir", str(tmp_path))
    assert ssd is not None and ssd.segment_bytes == 256 << 20  # segment files by default
    _, _, ssd, _ = _configs("--cache-dir", str(tmp_path), "--ssd-segment-mb", "0")
    assert ssd is not None and ssd.segment_bytes == 0  # one file per block
    _, _, ssd, _ = _configs("--cache-dir", str(tmp_path), "--ssd-segment-mb", "64")
    assert ssd is not None and ssd.segment_bytes == 64 << 20
    with pytest.raises(ValueError, match="--ssd-segment-mb: must be >= 0 MB, got -1"):
        _configs("--cache-dir", str(tmp_path), "--ssd-segment-mb", "-1")
