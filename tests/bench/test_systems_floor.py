"""Commands of the systems under test, process-group RSS, and the floor's pure parts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import floor, systems


def test_build_command_per_system(tmp_path: Path) -> None:
    ours = systems.build_command("ours", "/m", 4000, cache_dir=tmp_path,
                                 ram_budget_bytes=300 * 2**20)
    assert ours[3:] == ["serve", "--model", "/m", "--host", "127.0.0.1", "--port", "4000",
                        "--cache-dir", str(tmp_path), "--ram-budget", "300MB"]
    assert systems.build_command("nocache", "/m", 1, cache_dir=tmp_path)[-1] == "--no-cache"
    kv8 = systems.build_command("ours_kv8", "/m", 4000, cache_dir=tmp_path)
    assert kv8[3:] == ["serve", "--model", "/m", "--host", "127.0.0.1", "--port", "4000",
                       "--kv-bits", "8", "--kv-quant-min-tokens", "0", "--cache-dir", str(tmp_path)]
    assert systems.parse_systems("ours,ours-kv4") == ["ours", "ours_kv4"]
    spec = systems.build_command("ours_spec", "/m", 4000, cache_dir=tmp_path)
    assert spec[3:] == ["serve", "--model", "/m", "--host", "127.0.0.1", "--port", "4000",
                        "--speculation", "suffix", "--cache-dir", str(tmp_path)]
    assert systems.parse_systems("ours-spec") == ["ours_spec"]
    off = systems.build_command("ours_nospec", "/m", 4000)
    assert off[-2:] == ["--speculation", "off"]
    mlx = systems.build_command("mlx_lm", "/m", 5, ram_budget_bytes=1234)
    assert mlx[1:4] == ["-m", "mlx_lm", "server"]
    assert mlx[-2:] == ["--prompt-cache-bytes", "1234"]
    vllm = systems.build_command("vllm_mlx", "/m", 6, cache_dir=tmp_path,
                                 ram_budget_bytes=3 * 2**20)
    assert vllm[1:4] == ["serve", "/m", "--continuous-batching"]
    assert vllm[-4:] == ["--ssd-cache-dir", str(tmp_path / "ssd"), "--cache-memory-mb", "3"]
    with pytest.raises(ValueError, match="unknown system"):
        systems.build_command("llama_cpp", "/m", 1)


def test_vllm_mlx_gets_its_own_home_and_is_skipped_when_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = systems.build_env("vllm_mlx", tmp_path)
    assert env["HOME"] == str(tmp_path / "home") and (tmp_path / "home").is_dir()
    assert systems.build_env("mlx_lm", tmp_path).get("HOME") == os.environ.get("HOME")
    monkeypatch.setenv(systems.PEERS_DIR_ENV, str(tmp_path / "nowhere"))
    why = systems.unavailable_reason("vllm_mlx")
    assert why is not None and "nowhere/vllm-mlx/bin/vllm-mlx not found" in why
    assert systems.unavailable_reason("mlx_lm") is None


def test_parse_systems_and_free_port() -> None:
    assert systems.parse_systems("ours, vllm-mlx,ours") == ["ours", "vllm_mlx"]
    with pytest.raises(ValueError, match="unknown system 'tgi'"):
        systems.parse_systems("ours,tgi")
    port = systems.free_port()
    assert 1024 < port < 65536


def test_group_rss_counts_children_and_dir_bytes(tmp_path: Path) -> None:
    child = "import subprocess,sys,time; b=bytearray(40<<20); " \
            "p=subprocess.Popen([sys.executable,'-c','import time; b=bytearray(40<<20); " \
            "time.sleep(30)']); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    try:
        deadline = time.time() + 20
        rss = 0
        while time.time() < deadline and rss < 80 << 20:
            time.sleep(0.2)
            rss = systems.group_rss(proc.pid)
        assert rss >= 80 << 20  # both 40 MB buffers
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    assert systems.group_rss(proc.pid) == 0
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"1" * 1000)
    (tmp_path / "y").write_bytes(b"2" * 24)
    assert systems.dir_bytes(tmp_path) == 1024
    assert systems.dir_bytes(tmp_path / "missing") == 0


def test_ideal_cached_is_the_longest_prefix_shared_with_any_earlier_prompt() -> None:
    prompts = [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 9], [7, 8], [1, 2, 3, 4, 5, 6]]
    assert floor.ideal_cached(prompts) == [0, 4, 2, 0, 5]  # exact repeat: len - 1
    assert floor.common_prefix([1, 2], [1, 2, 3]) == 2
    assert floor.common_prefix([], [1]) == 0


def test_kv_bytes_per_token_from_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, '
        '"hidden_size": 576, "torch_dtype": "bfloat16"}')
    assert floor.kv_bytes_per_token(tmp_path) == 30 * 3 * 64 * 2 * 2  # SmolLM2-135M in bf16
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2}')
    with pytest.raises(ValueError, match="missing attention sizes"):
        floor.kv_bytes_per_token(tmp_path)
    with pytest.raises(ValueError, match="cannot read"):
        floor.kv_bytes_per_token(tmp_path / "nope")


def test_floor_meter_on_the_tiny_model(tiny_llama_path: Path) -> None:
    from harness import scenarios

    meter = floor.FloorMeter(str(tiny_llama_path), repeats=1)
    s = scenarios.build("S1", quick=True)
    turns = meter.measure(s)
    prompts = [floor.render(meter.tokenizer, t) for t in s.turns]
    assert [f.prompt_tokens for f in turns] == [len(p) for p in prompts]
    assert [f.cached_tokens for f in turns] == floor.ideal_cached(prompts)
    assert turns[0].cached_tokens == 0 and turns[1].cached_tokens > 0
    assert all(f.new_tokens == f.prompt_tokens - f.cached_tokens for f in turns)
    assert all(f.floor_s > 0 for f in turns)


def test_a_chat_template_goes_to_ours_as_a_file_and_to_mlx_lm_as_text(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    ours = systems.build_command("ours_spec", "/m", 4000, chat_template=template)
    assert ours[3:] == ["serve", "--model", "/m", "--host", "127.0.0.1", "--port", "4000",
                        "--chat-template", str(template), "--speculation", "suffix"]
    mlx = systems.build_command("mlx_lm", "/m", 5, chat_template=template)
    assert mlx[-2:] == ["--chat-template", "{{ messages[0]['content'] }}"]
    with pytest.raises(ValueError, match="vllm_mlx"):
        systems.build_command("vllm_mlx", "/m", 6, chat_template=template)
