"""OpenAI request parameters checked as OpenAI checks them, each a 400 naming it
(``logit_bias``, legacy ``logprobs``, ``best_of``), and the legacy logprobs object of a
completion choice built from chat logprob entries."""

from __future__ import annotations

import math
from typing import Any

from ..replies.runner import Penalties
from .errors import APIError
from .schemas import ResponsesRequest, _OAISampling

MAX_COMPLETION_LOGPROBS = 5


def logit_bias(raw: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}`` -> ``((id, bias), ...)`` sorted by id; 400 for a key that is
    not a token id of the vocabulary or a bias that is not a number in [-100, 100]."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise APIError(400, "logit_bias must be an object mapping token ids to biases",
                       param="logit_bias")
    out: dict[int, float] = {}
    for key, value in raw.items():
        text = str(key).strip()
        if not text.isdigit() or not text.isascii():
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}",
                           param="logit_bias")
        tid = int(text)
        if tid >= vocab_size:
            raise APIError(400, f"logit_bias token id {tid} is outside the vocabulary "
                                f"(size {vocab_size})", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or not -100 <= value <= 100:
            raise APIError(400, f"logit_bias values must be numbers in [-100, 100], got "
                                f"{value!r} for token {tid}", param="logit_bias")
        out[tid] = float(value)
    return tuple(sorted(out.items()))


def completion_logprobs(raw: Any, echo: bool) -> int | None:
    """/v1/completions ``logprobs``: None or an int in [0, 5]; with ``echo`` a 400."""
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) \
            or not 0 <= raw <= MAX_COMPLETION_LOGPROBS:
        raise APIError(400, f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}], "
                            f"got {raw!r}", param="logprobs")
    if echo:
        raise APIError(400, "logprobs with echo is not supported (the prompt's logprobs are "
                            "not computed)", param="logprobs")
    return raw


def best_of(raw: Any) -> None:
    """``best_of``: only one completion is generated per request, so only 1 (or absent)."""
    if raw is not None and (isinstance(raw, bool) or raw != 1):
        raise APIError(400, f"only best_of=1 is supported, got {raw!r}", param="best_of")


def legacy_logprobs(entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    """A completion choice's ``logprobs`` from chat logprob entries: per token its text,
    logprob, up to k + 1 alternatives (with the chosen one, as OpenAI's) and its
    character offset from ``offset``."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top: list[dict[str, float]] = []
    offsets: list[int] = []
    for e in entries:
        tokens.append(e["token"])
        token_logprobs.append(e["logprob"])
        alts = {a["token"]: a["logprob"] for a in e["top_logprobs"]}
        alts.setdefault(e["token"], e["logprob"])
        top.append(alts)
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def penalties(body: _OAISampling | ResponsesRequest) -> Penalties:
    """The request's penalties (ranges checked by ``SamplingParams``: a 400 naming the field)."""
    return Penalties(repetition=body.repetition_penalty, presence=body.presence_penalty,
                     frequency=body.frequency_penalty, context=body.repetition_context_size)
