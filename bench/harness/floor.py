"""The physical floor per turn, measured in-process with mlx-lm.

For each turn of a scenario: the part of its prompt that an ideal cache could hold is
the longest common prefix with any earlier prompt of the scenario (capped at
``len - 1``: the last token always runs, for the logits). The floor is the time to
prefill only the rest, at that context: the history is prefilled untimed into a
KVCache, then the new tokens are prefilled (chunked like mlx-lm's ``generate_step``)
and the first token is sampled, timed; the best of ``repeats`` runs counts.

Prompts are rendered with the model's own chat template from the OpenAI-format
history (``tools`` passed through); the servers render theirs, so the token counts are
recorded next to the ones the servers report.

The mlx work itself is ``prefill.PrefillTimer``; it is imported lazily, so the rest of
the harness (and its tests) never loads mlx.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from promptcache.blocks.tokens import common_prefix

from .scenarios import Scenario, Turn

log = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class FloorTurn:
    conversation: int
    index: int
    prompt_tokens: int
    cached_tokens: int  # what an ideal cache holds
    new_tokens: int
    floor_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def kv_bytes_per_token(model_dir: str | Path) -> int:
    """KV bytes one token takes in a full-attention cache, from config.json (no mlx)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the model config {path}: {e}") from e
    cfg = cfg.get("text_config", cfg)
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: missing attention sizes ({e})") from e
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    return layers * kv_heads * head_dim * 2 * _DTYPE_BYTES.get(dtype, 4)


def ideal_cached(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Per prompt: the longest prefix shared with any earlier prompt, capped at len - 1."""
    out = []
    for i, p in enumerate(prompts):
        best = max((common_prefix(p, q) for q in prompts[:i]), default=0)
        out.append(max(0, min(best, len(p) - 1)))
    return out


def render(tokenizer: Any, turn: Turn) -> list[int]:
    """The turn's prompt tokens through the model's chat template."""
    messages = [dict(m) for m in turn.messages]
    kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": True}
    if turn.tools:
        kwargs["tools"] = [dict(t) for t in turn.tools]
    try:
        out = tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as e:  # noqa: BLE001 - templates raise anything; fall back to plain text
        log.warning("chat template failed (%s); rendering without tools", e)
        plain = [{"role": m["role"] if m["role"] != "tool" else "user",
                  "content": str(m.get("content") or "")} for m in messages]
        out = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
    if not isinstance(out, list) and hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]  # transformers 5 returns a BatchEncoding
    return [int(t) for t in out]


class FloorMeter:
    """Loads the model once; measures the floor of each scenario's turns."""

    def __init__(self, model_path: str, *, prefill_step: int = 2048, repeats: int = 2) -> None:
        if prefill_step <= 0 or repeats <= 0:
            raise ValueError("prefill_step and repeats must be > 0")
        from .prefill import PrefillTimer

        self.timer = PrefillTimer(model_path, prefill_step=prefill_step)
        self.tokenizer: Any = self.timer.tokenizer
        self.repeats = repeats
        self._warm = False

    def _run(self, tokens: list[int], cache: list[Any], sample: bool) -> None:
        self.timer.run(tokens, cache, sample)

    def measure(self, scenario: Scenario,
                progress: Callable[[str], None] | None = None) -> list[FloorTurn]:
        prompts = [render(self.tokenizer, t) for t in scenario.turns]
        targets = ideal_cached(prompts)
        cache = self.timer.new_cache()
        held: list[int] = []
        if not self._warm:  # first-call compilation is not part of any turn
            self._run(prompts[0][: min(64, len(prompts[0]))], self.timer.new_cache(), True)
            self._warm = True
        out: list[FloorTurn] = []
        for n, (turn, prompt, c) in enumerate(zip(scenario.turns, prompts, targets, strict=True)):
            base = min(common_prefix(held, prompt), c)
            if len(held) > base:
                self.timer.trim(cache, len(held) - base)
            if c > base:
                self._run(prompt[base:c], cache, sample=False)
            best = float("inf")
            for r in range(self.repeats):
                t0 = time.perf_counter()
                self._run(prompt[c:], cache, sample=True)
                best = min(best, time.perf_counter() - t0)
                if r + 1 < self.repeats:
                    self.timer.trim(cache, len(prompt) - c)
            held = prompt
            out.append(FloorTurn(turn.conversation, turn.index, len(prompt), c, len(prompt) - c, best))
            if progress is not None and (n + 1) % 10 == 0:
                progress(f"floor {scenario.name}: {n + 1}/{len(prompts)} turns")
        return out
