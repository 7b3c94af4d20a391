"""Tiny models for the hit-rate traces, derived from the "scripted" tiny model.

The "scripted" model (``tests/models/tiny_models.py``) answers a fixed sentence whatever the
prompt: after the newline that ends the generation prompt, each reply token's embedding
carries a large value in a dimension of its own and the output row of the next token
reads it. The chain needs every reply token to be distinct, so the two variants here add
tokens of their own (the vocabulary grows by a few rows, zero-initialised) and script a
different reply:

- ``thinking``: ``<think>`` and ``</think>`` become tokens (mlx-lm recognises them as
  reasoning markers), the reply is ``<think>Let me see</think>`` and a 48-token
  answer, and the chat template is Qwen3-like: it drops the reasoning of assistant
  turns before the last user message (``content.split('</think>')[-1]``);
- ``agent``: the scripted reply (``Hello from the tiny model.``) with the Qwen3-like
  template below, which renders the system prompt first and the tools after it (the
  tiny models' ChatML template puts the tools first: a changing system prompt would
  then cost only what follows the tools);
- ``toolcall``: ``<tool_call>``, ``</tool_call>`` and the whole call JSON
  ``{"name":"Read","arguments":{"file_path":"README.md"}}`` become tokens, so the model
  emits a compact Hermes call; the template (the same Qwen3-like one) renders calls
  back as ``<tool_call>\\n{"name": "Read", "arguments": {...}}\\n</tool_call>``: other
  tokens than the model generated, as with real models.

Both are built once into the test models folder (``.models/trace-<kind>-v2``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

TRACE_MODELS_VERSION = 2
ANSWER = ("Paris is the capital of France while Berlin Rome Madrid are other large old cities "
          "near a river under mountains read drink water write code test data and answer "
          "every question today.")  # 48 distinct tokens
THINK_REPLY = ("<think>", "Let me see", "</think>", ANSWER)
CALL_JSON = '{"name":"Read","arguments":{"file_path":"README.md"}}'
TOOLCALL_REPLY = ("<tool_call>", CALL_JSON, "</tool_call>")
ADDED: dict[str, tuple[str, ...]] = {"agent": (), "thinking": ("<think>", "</think>"),
                                     "toolcall": ("<tool_call>", "</tool_call>", CALL_JSON)}
REPLIES = {"agent": ("Hello from the tiny model.",), "thinking": THINK_REPLY,
           "toolcall": TOOLCALL_REPLY}

# Qwen3-like ChatML: system (+ tools), reasoning dropped from assistant turns before the
# last user message, Hermes tool calls and tool responses.
AGENT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'user' or m.role == 'system' %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content or '' %}"
    "{%- if '</think>' in content and loop.index0 < ns.last_user %}"
    "{%- set content = content.split('</think>')[-1] %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for tc in m.tool_calls or [] %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' }}"
    "{{- tc.function.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def trace_model_dirname(kind: str) -> str:
    return f"trace-{kind}-v{TRACE_MODELS_VERSION}"


def _build(kind: str, scripted: Path, out: Path) -> None:
    import mlx.core as mx
    import numpy as np
    from tokenizers import Tokenizer

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"):
        shutil.copy(scripted / name, out / name)
    config = json.loads((out / "config.json").read_text())
    vocab = int(config["vocab_size"])
    added = ADDED[kind]
    tok_doc = json.loads((out / "tokenizer.json").read_text())
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    for i, content in enumerate(added):
        entry = {"id": vocab + i, "content": content, "single_word": False, "lstrip": False,
                 "rstrip": False, "normalized": False, "special": False}
        tok_doc["added_tokens"].append(entry)
        tcfg["added_tokens_decoder"][str(vocab + i)] = {
            k: v for k, v in entry.items() if k not in ("id",)}
    config["vocab_size"] = vocab + len(added)
    tcfg["chat_template"] = AGENT_TEMPLATE
    (out / "tokenizer.json").write_text(json.dumps(tok_doc))
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    reply: list[int] = []
    for piece in REPLIES[kind]:
        reply += tok.encode(piece, add_special_tokens=False).ids
    eos = tok.token_to_id("<|im_end|>")
    chain = [tok.token_to_id("Ċ"), *reply]
    if len(set(chain)) != len(chain):
        raise RuntimeError(f"the {kind} reply repeats a token: {chain}")
    loaded = mx.load(str(scripted / "model.safetensors"))
    assert isinstance(loaded, dict)  # a safetensors file: name -> array
    weights = dict(loaded.items())
    emb = np.array(weights["model.embed_tokens.weight"])
    head = np.array(weights["lm_head.weight"])
    pad = np.zeros((len(added), emb.shape[1]), dtype=emb.dtype)
    emb, head = np.concatenate([emb, pad]), np.concatenate([head, pad])
    k = max(16, len(chain))  # the scripted model's own chain lives in the first dimensions
    if k > emb.shape[1]:
        raise RuntimeError(f"a reply of {len(chain)} tokens does not fit {emb.shape[1]} dims")
    emb[:, :k] = 0.0
    head[:, :k] = 0.0
    for dim, (cur, nxt) in enumerate(zip(chain, chain[1:] + [eos], strict=True)):
        emb[cur, dim] = 50.0
        head[nxt, dim] = 8.0
    weights["model.embed_tokens.weight"] = mx.array(emb)
    weights["lm_head.weight"] = mx.array(head)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


def ensure_trace_model(kind: str, scripted: Path, root: Path) -> Path:
    """``root/trace-<kind>-v<N>``, built from the scripted model folder if missing."""
    if kind not in ADDED:
        raise ValueError(f"unknown trace model {kind!r}")
    final = root / trace_model_dirname(kind)
    if (final / "config.json").is_file():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        _build(kind, scripted, tmp)
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def reply_text(kind: str) -> str:
    return "".join(REPLIES[kind])


__all__: list[Any] = ["ensure_trace_model", "reply_text", "AGENT_TEMPLATE"]
