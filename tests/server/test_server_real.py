"""A real `promptcache serve` subprocess (tiny llama model, SSD tier in a temp folder)
driven by the official openai and anthropic SDKs, plain httpx and curl."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from serve_proc import serve

BLOCK = 16


@pytest.fixture(scope="module")
def server(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("serve")
    with serve(["--model", str(tiny_llama_path), "--block-size", str(BLOCK),
                "--cache-dir", str(tmp / "blocks"), "--log-level", "info"],
               tmp / "server.log", timeout=90, log_tail=3000) as base:
        yield base


def oai(base: str, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused",
                         default_headers={"X-Tenant-Id": tenant}, max_retries=0)


def anth(base: str, tenant: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="unused",
                               default_headers={"X-Tenant-Id": tenant}, max_retries=0)


def stats(base: str) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(f"{base}/v1/cache/stats").json()
    return data


def test_openai_sdk_turns(server: str) -> None:
    client = oai(server, "oai")
    messages: list[Any] = [{"role": "system", "content": "You are terse."},
                           {"role": "user", "content": "Tell me about caches."}]
    r1 = client.chat.completions.create(model="default", messages=messages, max_tokens=12)
    assert r1.model == "tiny-llama-v1"
    assert r1.usage is not None and r1.usage.completion_tokens == 12
    assert r1.usage.prompt_tokens_details is not None
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "And more?"}]
    stream = client.chat.completions.create(model="tiny-llama-v1", messages=messages,
                                            max_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens == 12
    cached = usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    print(f"openai turn 2: prompt={usage.prompt_tokens} cached={cached}")
    # turn 1's system + user messages at least (whole blocks of the shared prefix)
    assert cached >= r1.usage.prompt_tokens - 1 - BLOCK
    assert 0 < cached < usage.prompt_tokens
    # same request non-streaming: same greedy text
    r3 = client.chat.completions.create(model="default", messages=messages, max_tokens=12)
    assert r3.choices[0].message.content == text
    comp = client.completions.create(model="default", prompt="Once upon a time", max_tokens=5)
    assert comp.usage is not None and comp.usage.completion_tokens == 5
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=messages, max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        # (a max_tokens past the limit is clamped: test_server_clients.py)
        client.chat.completions.create(model="default", messages=messages, max_tokens=0)


def test_anthropic_sdk_usage_sums(server: str) -> None:
    client = anth(server, "anth")
    msgs: list[Any] = [{"role": "user", "content": "Hello, who are you?"}]
    count = client.messages.count_tokens(model="default", messages=msgs, system="Be kind.")
    m1 = client.messages.create(model="default", max_tokens=10, system="Be kind.", messages=msgs)
    u = m1.usage
    assert (u.input_tokens + (u.cache_creation_input_tokens or 0)
            + (u.cache_read_input_tokens or 0)) == count.input_tokens
    assert (u.cache_read_input_tokens, u.output_tokens) == (0, 10)
    assert u.cache_creation_input_tokens == count.input_tokens
    msgs += [{"role": "assistant", "content": m1.content[0].text},  # type: ignore[union-attr]
             {"role": "user", "content": "Nice."}]
    count2 = client.messages.count_tokens(model="default", messages=msgs, system="Be kind.")
    with client.messages.stream(model="default", max_tokens=10, system="Be kind.",
                                messages=msgs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    u2 = final.usage
    assert final.content[0].text == streamed  # type: ignore[union-attr]
    assert (u2.input_tokens + (u2.cache_creation_input_tokens or 0)
            + (u2.cache_read_input_tokens or 0)) == count2.input_tokens
    assert (u2.cache_read_input_tokens or 0) >= count.input_tokens - 1 - BLOCK
    assert u2.output_tokens == 10
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-x", max_tokens=5, messages=msgs)


def _stream_text(client: openai.OpenAI, messages: list[Any]) -> str:
    out = client.chat.completions.create(model="default", messages=messages, max_tokens=16,
                                         stream=True)
    return "".join(c.choices[0].delta.content or "" for c in out if c.choices)


SYSTEM = ("You are a careful assistant. Follow the house rules: be brief, cite sources, "
          "prefer plain words, and never guess. ") * 6


def _questions() -> list[list[Any]]:
    return [[{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"Question {i}: what is {i} times {i + 3}?"}]
            for i in range(8)]


def test_concurrent_streams_equal_sequential_and_prefix_stored_once(server: str) -> None:
    before = stats(server)["cache"]
    seq_client = oai(server, "seq")
    sequential = [_stream_text(seq_client, q) for q in _questions()]
    mid = stats(server)["cache"]

    async def run_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused",
                                    default_headers={"X-Tenant-Id": "conc"}, max_retries=0)

        async def one(q: list[Any]) -> str:
            out = await client.chat.completions.create(model="default", messages=q,
                                                       max_tokens=16, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in out if c.choices])

        try:
            return await asyncio.gather(*(one(q) for q in _questions()))
        finally:
            await client.close()

    concurrent = asyncio.run(run_all())
    after = stats(server)["cache"]
    assert concurrent == sequential
    seq_blocks = mid["ram_blocks"] - before["ram_blocks"]
    conc_blocks = after["ram_blocks"] - mid["ram_blocks"]
    print(f"blocks stored: sequential {seq_blocks}, 8 concurrent {conc_blocks}; "
          f"dedup {after['dedup_blocks'] - mid['dedup_blocks']}")
    # the same blocks as the sequential run: the shared system prompt is stored once
    assert conc_blocks == seq_blocks
    prompt_len = len(SYSTEM) // 4  # rough floor: the system prompt spans many blocks
    assert conc_blocks < 8 * (prompt_len // BLOCK)


def test_disconnect_mid_stream_then_reuse(server: str) -> None:
    body = {"model": "default", "max_tokens": 3000, "stream": True, "messages": [
        {"role": "user", "content": "Write a very long story about a lighthouse keeper. " * 8}]}
    headers = {"X-Tenant-Id": "disc"}
    with httpx.Client(base_url=server, timeout=30) as hc:
        with hc.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            lines = r.iter_lines()
            for _ in range(8):
                next(lines)
        deadline = time.monotonic() + 10
        cancelled = 0.0
        while time.monotonic() < deadline:
            for line in hc.get("/metrics").text.splitlines():
                if line.startswith('promptcache_requests_total{api="openai",status="cancelled"}'):
                    cancelled = float(line.split()[-1])
            if cancelled:
                break
            time.sleep(0.1)
        assert cancelled == 1.0
        again = hc.post("/v1/chat/completions", headers=headers,
                        json={**body, "stream": False, "max_tokens": 4}).json()
        usage = again["usage"]
        print(f"after disconnect: prompt={usage['prompt_tokens']} "
              f"cached={usage['prompt_tokens_details']['cached_tokens']}")
        # the whole prompt was prefilled and saved before the disconnect
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
        assert hc.get("/health").status_code == 200


def test_claude_code_style_conversation(server: str) -> None:
    client = anth(server, "claude-code")
    tools = [{"name": name, "description": f"{desc} " * 6, "input_schema": {
        "type": "object", "properties": {"path": {"type": "string", "description": "a path"},
                                         "text": {"type": "string"}}, "required": ["path"]}}
             for name, desc in [("Read", "Read a file from the local filesystem."),
                                ("Write", "Write a file to the local filesystem."),
                                ("Edit", "Replace exact text in a file."),
                                ("Bash", "Run a shell command in the project folder."),
                                ("Grep", "Search file contents with a regular expression.")]]
    system = ("You are an interactive CLI coding agent. Use the tools to help the user with "
              "software engineering tasks. Keep answers short. Never invent file contents. ") * 22
    msgs: list[Any] = [{"role": "user", "content": "Fix the failing test in tests/test_app.py"}]
    reads, prompts = [], []
    for turn in range(5):
        m = client.messages.create(model="default", max_tokens=8, system=system, tools=tools,
                                   messages=msgs)  # type: ignore[arg-type]
        u = m.usage
        read = u.cache_read_input_tokens or 0
        reads.append(read)
        prompts.append(u.input_tokens + (u.cache_creation_input_tokens or 0) + read)
        text = m.content[0].text  # type: ignore[union-attr]
        msgs += [
            {"role": "assistant", "content": [
                {"type": "text", "text": text},
                {"type": "tool_use", "id": f"toolu_{turn}", "name": "Read",
                 "input": {"path": f"src/module_{turn}.py"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{turn}",
                 "content": f"def f{turn}(x):\n    return x + {turn}\n" * 3}]},
        ]
    rate = sum(reads) / sum(prompts)
    print(f"claude-code style: prompt tokens {prompts}, cache reads {reads}, "
          f"token hit rate {rate:.1%}")
    assert prompts[0] > 2800  # a ~3k-token system prompt with tool definitions
    assert reads[0] == 0
    assert all(b > a for a, b in zip(reads, reads[1:], strict=False))
    assert rate > 0.6


def test_readme_curl(server: str) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    port = server.rsplit(":", 1)[1]
    # the README snippet, with the test server's port instead of 8080
    cmd = ("curl -s http://127.0.0.1:8080/v1/chat/completions "
           "-H 'Content-Type: application/json' "
           "-d '{\"model\": \"default\", \"messages\": "
           "[{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], "
           "\"max_tokens\": 32}'").replace("8080", port)
    out = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60, check=True)
    body = json.loads(out.stdout)
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] > 0
    assert "cached_tokens" in body["usage"]["prompt_tokens_details"]
    stats_cmd = f"curl -s http://127.0.0.1:{port}/v1/cache/stats"
    data = json.loads(subprocess.run(stats_cmd, shell=True, capture_output=True, text=True,
                                     timeout=30, check=True).stdout)
    assert data["cache"]["lookups"] > 0
