"""Constrained decoding: a ``Constraint`` (engine/api.py) -> an mlx-lm logits processor over
llguidance's ``LLMatcher`` (JSON Schema, regex, Lark), masking forbidden tokens to ``-inf``.
``validate`` checks a grammar alone (``RequestError``, a 400); ``prepare`` compiles it for a
tokenizer in the preparation thread (kept in a small LRU); ``logits_processor`` copies a matcher.
Speculation cuts drafts at the first rejected token (``grammar_prefix``); JSON whitespace is bounded."""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from ...errors import RequestError
from ...lru import BoundedLRU
from .. import mlx_compat
from ..api import Constraint

logger = logging.getLogger(__name__)

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

# whitespace between JSON tokens: none, a space, or a newline + indentation (bounded)
JSON_OPTIONS: dict[str, Any] = {"whitespace_pattern": r"(?: |\n[ \t]{0,16})?"}
_COMPILED_MAX = 64


def _llg() -> Any:
    import llguidance

    return llguidance


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint``; RequestError when it cannot be read."""
    matcher = _llg().LLMatcher
    if constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.spec)
        except json.JSONDecodeError as e:
            raise RequestError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise RequestError("the JSON schema must be an object")
        try:
            return str(matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
        except ValueError as e:
            raise RequestError(f"invalid JSON schema: {e}") from None
    if constraint.kind == "regex":
        return str(matcher.grammar_from_regex(constraint.spec))
    return str(matcher.grammar_from_lark(constraint.spec))


def _check(grammar: str, tokenizer: Any, what: str) -> None:
    error = _llg().LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise RequestError(f"invalid {what}: {error}")


def validate(constraint: Constraint) -> None:
    """Check the grammar without a tokenizer; RequestError with the reason."""
    _check(grammar_of(constraint), None, _what(constraint))


def _what(constraint: Constraint) -> str:
    return {"json_schema": "JSON schema", "regex": "regular expression",
            "lark": "grammar"}[constraint.kind]


# --- the tokenizer bridge and compiled matchers (shared, thread-safe) ---------------------

class _Bridge:
    """llguidance's tokenizer for one (tokenizer, vocab size) and its compiled matchers
    (an LRU; they live and die with the tokenizer)."""

    def __init__(self, ll: Any) -> None:
        self.ll = ll
        self.compiled: BoundedLRU[tuple[str, str, str], Any] = BoundedLRU(_COMPILED_MAX)


_lock = threading.Lock()
_bridges: weakref.WeakKeyDictionary[Any, dict[int, _Bridge]] = weakref.WeakKeyDictionary()


def _eos_ids(tokenizer: Any) -> list[int]:
    ids = getattr(tokenizer, "eos_token_ids", None) or ()
    out = sorted(int(t) for t in ids)
    if not out and getattr(tokenizer, "eos_token_id", None) is not None:
        out = [int(tokenizer.eos_token_id)]
    return out


def _bridge(tokenizer: Any, vocab_size: int) -> _Bridge:
    with _lock:
        per = _bridges.get(tokenizer)
        if per is not None and vocab_size in per:
            return per[vocab_size]
    fast = mlx_compat.fast_tokenizer(tokenizer)
    if fast is None:
        raise RequestError("constrained decoding needs a fast (tokenizer.json) tokenizer")
    backend = fast.backend_tokenizer
    eos = _eos_ids(tokenizer)
    if not eos:
        raise RequestError("constrained decoding needs the model's EOS token")
    size = max(int(vocab_size), len(tokenizer)) if hasattr(tokenizer, "__len__") else vocab_size
    bridge = _Bridge(_llg().LLTokenizer(backend.to_str(), n_vocab=size, eos_token=eos))
    with _lock:
        return _bridges.setdefault(tokenizer, {}).setdefault(vocab_size, bridge)


def compiles_for(tokenizer: object) -> bool:
    """Whether a constraint can be compiled for ``tokenizer`` (``prepare``): an mlx-lm
    ``TokenizerWrapper`` around a fast Hugging Face tokenizer (``mlx_compat``)."""
    return mlx_compat.fast_tokenizer(tokenizer) is not None


def ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's ``LLTokenizer`` for an mlx-lm ``TokenizerWrapper`` (a fast HF
    tokenizer underneath), sized to the model's logits; built once, then cached."""
    return _bridge(tokenizer, vocab_size).ll


def _compiled_matcher(constraint: Constraint, tokenizer: Any, vocab_size: int) -> Any:
    """The compiled matcher for ``constraint`` with its prefix consumed (cached; copy
    it before use)."""
    bridge = _bridge(tokenizer, vocab_size)
    key = (constraint.kind, constraint.spec, constraint.prefix)
    with _lock:
        hit = bridge.compiled.get(key)
        if hit is not None:
            return hit
    ll = bridge.ll
    grammar = grammar_of(constraint)
    _check(grammar, ll, _what(constraint))
    matcher = _llg().LLMatcher(ll, grammar, log_level=0)
    if matcher.is_error():
        raise RequestError(f"invalid {_what(constraint)}: {matcher.get_error()}")
    if constraint.prefix:
        tokens = ll.tokenize_str(constraint.prefix)
        if not matcher.consume_tokens(tokens):
            raise RequestError(f"the assistant prefill {constraint.prefix[:80]!r} does not "
                               f"match the {_what(constraint)}")
    with _lock:
        bridge.compiled.put(key, matcher)
    return matcher


def prepare(constraint: Constraint, tokenizer: Any, vocab_size: int) -> None:
    """Compile ``constraint`` for this tokenizer ahead of ``logits_processor`` (off the
    event loop); RequestError when the grammar or the prefix is invalid."""
    _compiled_matcher(constraint, tokenizer, vocab_size)


class GrammarProcessor:
    """One request's matcher as an mlx-lm logits processor ``(tokens, logits) -> logits``: the
    first call sees the prompt; later calls feed the tokens sampled since to the matcher."""

    def __init__(self, matcher: Any, vocab_size: int, eos: list[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._eos = eos
        self._seen: int | None = None
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self.failed = False

    def _feed(self, tokens: mx.array) -> None:
        n = int(tokens.size)
        if self._seen is None:  # the first call: the prompt (the prefix is fed already)
            self._seen = n
            return
        if n <= self._seen:
            return
        new = np.array(tokens.reshape(-1)[self._seen:]).astype(np.int64).tolist()
        self._seen = n
        if self.failed:
            return
        for tok in new:
            if not self.matcher.consume_token(tok):
                self.failed = True
                logger.warning("constrained decoding: token %d rejected (%s); ending the "
                               "reply", tok, self.matcher.get_error())
                return

    def allowed(self) -> np.ndarray:
        """A bool mask over the vocabulary of the tokens allowed next."""
        if self.failed:
            mask = np.zeros(self.vocab_size, dtype=np.bool_)
            mask[[t for t in self._eos if t < self.vocab_size]] = True
            return mask
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].astype(np.bool_)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # feed first: reading ``tokens`` waits only for the previous step's token, while
        # after a launched forward pass it would wait for that pass (one stream, in
        # order); then launch this step's forward pass and compute the mask while it runs
        self._feed(tokens)
        mx.async_eval(logits)  # type: ignore[no-untyped-call]
        mask = mx.array(self.allowed())
        width = int(logits.shape[-1])
        if width > self.vocab_size:  # logits wider than the matcher's vocabulary
            mask = mx.concatenate([mask, mx.zeros(width - self.vocab_size, dtype=mx.bool_)])
        elif width < self.vocab_size:
            mask = mask[:width]
        return mx.where(mask, logits, mx.array(-float("inf"), dtype=logits.dtype))


class TokenProcessor:
    """An mlx-lm logits processor that is a pure function of the tokens so far (logit
    bias, repetition / presence / frequency penalties): a verify applies it position
    by position with the draft tokens before it, as decoding one at a time would."""

    def __init__(self, fn: LogitsProcessor) -> None:
        self.fn = fn

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return self.fn(tokens, logits)


def sparing(fn: LogitsProcessor, ids: Iterable[int]) -> LogitsProcessor:
    """``fn`` (a repetition / presence / frequency penalty) leaving the logits of
    ``ids`` (the end-of-turn tokens) as they were: every earlier turn of a chat ends
    with one, so a penalty over the context would keep a reply from ending."""
    keep = mx.array(sorted(ids), dtype=mx.int32)
    if keep.size == 0:
        return fn

    def spared(tokens: mx.array, logits: mx.array) -> mx.array:
        before = logits[:, keep]  # (``fn`` may assign into ``logits``)
        out = fn(tokens, logits)
        out[:, keep] = before
        return out
    return spared


def speculates(processors: Sequence[object]) -> bool:
    """Whether a row with these logits processors can verify drafts: grammar
    constraints (``GrammarProcessor``) and pure ``TokenProcessor``s are checked draft by
    draft."""
    return all(isinstance(p, (GrammarProcessor, TokenProcessor)) for p in processors)


def grammar_prefix(processors: Sequence[object], pending: int, draft: Sequence[int]) -> int:
    """How many tokens of ``draft`` every grammar accepts after ``pending`` (the token the
    row feeds next, not consumed by its matcher yet), the matchers unchanged; 0 for a
    matcher that failed or processors that are not grammars."""
    n = len(draft)
    for p in processors:
        if isinstance(p, TokenProcessor):
            continue
        if not isinstance(p, GrammarProcessor) or p.failed:
            return 0
        ok = int(p.matcher.validate_tokens([int(pending), *(int(t) for t in draft[:n])]))
        n = max(0, min(n, ok - 1))
        if n == 0:
            break
    return n


def logits_processor(constraint: Constraint, tokenizer: Any, vocab_size: int) -> LogitsProcessor:
    """A fresh processor (it keeps per-request matcher state) for ``constraint``."""
    matcher = _compiled_matcher(constraint, tokenizer, vocab_size).deep_copy()
    size = int(ll_tokenizer(tokenizer, vocab_size).vocab_size)
    return GrammarProcessor(matcher, size, _eos_ids(tokenizer))
