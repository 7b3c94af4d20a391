"""Chat templates: messages -> prompt token ids (+ each message's start), one render and one
tokenization under one lock. A render runs under a deadline (a loop: ``TemplateRenderError``);
an overlong text is tokenized only up to a bound (``ContextLengthError``)."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

from ...errors import ContextLengthError, RequestError, TemplateRenderError
from .. import mlx_compat

log = logging.getLogger(__name__)

# a render takes milliseconds (a few hundred for a very long chat); past this the template loops
RENDER_LIMIT_S = 5.0
# what Jinja names the code of a template compiled from a string
TEMPLATE_FILE = "<template>"
CHECK_MESSAGES = ({"role": "user", "content": "Hello"},)


class _OverBudget(BaseException):
    """Raised past the deadline (a BaseException: ``except Exception`` cannot swallow it)."""


@contextlib.contextmanager
def render_budget(limit_s: float) -> Iterator[None]:
    """Trace this thread: every call and template line checks the deadline."""
    deadline = time.monotonic() + limit_s

    def check() -> None:
        if time.monotonic() > deadline:
            raise _OverBudget()

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        check()
        return local

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        check()
        return local if frame.f_code.co_filename == TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)


def validate_messages(messages: Any) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise RequestError(f"message {i} must be a mapping with a string 'role'")


def _text_pieces(message: Mapping[str, Any]) -> list[str]:
    """The literal texts of a message a template copies into the prompt, in order."""
    content = message.get("content")
    pieces: list[str] = []
    if isinstance(content, str):
        pieces.append(content)
    elif isinstance(content, (list, tuple)):
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                pieces.append(part["text"])
    for key in ("reasoning_content", "thinking"):
        if isinstance(message.get(key), str):
            pieces.insert(0, message[key])
    return [p.strip() for p in pieces if p and p.strip()]


def content_spans(text: str, messages: Sequence[Mapping[str, Any]]) -> list[tuple[int, int] | None]:
    """Per message, its content's character span in ``text`` (in order), or None if not found."""
    spans: list[tuple[int, int] | None] = []
    cursor = 0
    for m in messages:
        pieces = _text_pieces(m)
        start = end = -1
        pos = cursor
        for piece in pieces:
            at = text.find(piece, pos)
            if at < 0:
                continue
            if start < 0:
                start = at
            end = pos = at + len(piece)
        if start < 0:
            spans.append(None)
        else:
            spans.append((start, end))
            cursor = end
    return spans


def message_starts(text: str, offsets: Sequence[tuple[int, int]],
                   messages: Sequence[Mapping[str, Any]]) -> tuple[int, ...]:
    """Token index where each message starts: the token holding the first character after the
    previous message's content (the markers between two messages count to the later one)."""
    spans = content_spans(text, messages)
    starts: list[int] = [0]
    tok = 0
    n = len(offsets)
    boundary = 0  # character where the current message begins
    for i in range(1, len(messages)):
        prev = spans[i - 1]
        if prev is not None:
            boundary = max(boundary, prev[1])
        # the first token that ends after the boundary holds its first character
        while tok < n and offsets[tok][1] <= boundary:
            tok += 1
        starts.append(max(starts[-1], tok))
    return tuple(starts)


def _is_syntax_error(e: BaseException) -> bool:
    try:
        import jinja2
    except ImportError:  # no Jinja: the tokenizer renders its own way
        return False
    return isinstance(e, jinja2.TemplateSyntaxError)


class ChatTemplate:
    """The tokenizer's chat template, rendered under one lock."""

    def __init__(self, tokenizer: Any, token_limit: int | None = None,
                 render_limit_s: float = RENDER_LIMIT_S) -> None:
        if not render_limit_s > 0:
            raise ValueError(f"render_limit_s must be > 0, got {render_limit_s}")
        self.tokenizer = tokenizer
        self.token_limit = token_limit
        self.render_limit_s = render_limit_s
        self._lock = threading.Lock()
        self._max_token_chars: int | None = None

    def _longest_token_chars(self) -> int:
        """Characters of the longest vocabulary entry (an upper bound on one token's text)."""
        if self._max_token_chars is None:
            vocab: Any = None
            get_vocab = getattr(self.tokenizer, "get_vocab", None)
            if callable(get_vocab):
                try:
                    vocab = get_vocab()
                except Exception:  # a tokenizer without a vocabulary: no bound
                    vocab = None
            longest = max((len(t) for t in vocab), default=0) if isinstance(vocab, dict) else 0
            self._max_token_chars = max(1, longest)
        return self._max_token_chars

    def _check_length(self, text: str) -> None:
        """Raise ``ContextLengthError`` if ``text`` surely exceeds ``token_limit`` (lock held)."""
        limit = self.token_limit
        if limit is None:
            return
        cut = (limit + 1) * self._longest_token_chars()
        if len(text) <= cut:
            return
        n = len(self.tokenizer.encode(text[:cut], add_special_tokens=False))
        margin = max(64, limit // 100)  # the word cut at the end may split differently
        if n > limit + margin:
            raise ContextLengthError(
                f"the prompt has more than {limit + margin} tokens ({len(text)} characters), "
                f"more than the model's context length ({limit})")

    def _render_text(self, messages: Sequence[Mapping[str, Any]], tools: Any, gen: bool,
                     continue_final_message: bool, template_kwargs: Mapping[str, Any] | None
                     ) -> str:
        kwargs = dict(template_kwargs or {})
        if continue_final_message:
            kwargs["continue_final_message"] = True
            gen = False
        try:
            with render_budget(self.render_limit_s):
                out = self.tokenizer.apply_chat_template(
                    list(messages), tools=tools, add_generation_prompt=gen, tokenize=False,
                    **kwargs)
        except _OverBudget:
            raise TemplateRenderError(
                f"the chat template did not finish rendering within {self.render_limit_s:g} "
                "s (does it loop?)", "timeout") from None
        except RecursionError:
            raise TemplateRenderError("the chat template recursed past Python's limit "
                                      "(a recursive macro?)", "recursion") from None
        except Exception as e:
            if _is_syntax_error(e):
                raise TemplateRenderError(f"the chat template is not valid Jinja: {e}",
                                          "syntax") from e
            raise
        if not isinstance(out, str):
            raise RequestError("the chat template did not render to text")
        return out

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
        add_generation_prompt: bool = True, *, continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Prompt token ids of a chat (``continue_final_message``: the last message left open)."""
        validate_messages(messages)
        text = self._render_text(messages, tools, add_generation_prompt,
                                 continue_final_message, template_kwargs)
        with self._lock:
            self._check_length(text)
            return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def check(self) -> None:
        """The startup test render; ``TemplateRenderError`` if it fails, loops or recurses."""
        try:
            self._render_text(CHECK_MESSAGES, None, True, False, None)
        except TemplateRenderError:
            raise
        except Exception as e:
            log.warning("the chat template's test render failed (%s: %s); serving anyway",
                        type(e).__name__, e)

    def encode(self, text: str) -> list[int]:
        """Token ids of a plain prompt (special tokens as ``tokenizer.encode`` adds them)."""
        with self._lock:
            self._check_length(text)
            return [int(t) for t in self.tokenizer.encode(text)]

    def render_with_offsets(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
        add_generation_prompt: bool = True, *, continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], tuple[int, ...]]:
        """``(tokens, message_starts)`` from one render and one tokenization."""
        validate_messages(messages)
        text = self._render_text(messages, tools, add_generation_prompt,
                                 continue_final_message, template_kwargs)
        with self._lock:
            self._check_length(text)
            encoded = mlx_compat.encode_with_offsets(self.tokenizer, text)
            if encoded is None:  # a slow tokenizer: no character offsets
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                return [int(t) for t in ids], ()
        ids, offsets = encoded
        return ids, message_starts(text, offsets, messages)
