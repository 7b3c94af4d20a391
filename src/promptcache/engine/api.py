"""Plain data that crosses the engine boundary (no MLX here): the server submits a
``GenerationRequest`` and reads ``TokenEvent``s, then one ``GenerationResult``, from its handle."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..blocks.tokens import common_prefix as common_prefix  # for the server's prompt diffs
from ..cache.miss import CacheMiss as CacheMiss  # the engine's miss type (re-exported)
from ..meta import DEFAULT_TENANT, ExtraKeySpan

IMAGE_DIGEST_VERSION = 1


@dataclass(frozen=True)
class VisionInfo:
    """What the server needs to know about a vision-language model (``Engine.vision``):
    the image token the template renders, how many placeholder tokens each image
    covers, and the preprocessing settings that go into every image digest.

    ``image_text`` is what stands for one image in a message's text (default: the
    image token; Qwen's ``<|vision_start|><|image_pad|><|vision_end|>``). Each rendered
    ``image_token_id`` becomes ``before + [placeholder] * tokens_per_image + after``
    (``placeholder_token_id`` defaults to the image token; Gemma 3 renders
    ``<start_of_image>`` and expands it to ``\\n\\n<start_of_image>``, 256
    ``<image_soft_token>``, ``<end_of_image>\\n\\n``)."""

    model_type: str
    image_token: str
    image_token_id: int
    tokens_per_image: int
    settings_key: str
    image_text: str = ""
    placeholder_token_id: int = -1
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()

    @property
    def text(self) -> str:
        """The text that stands for one image in a message."""
        return self.image_text or self.image_token

    @property
    def placeholder_id(self) -> int:
        """The token id of the placeholders the image's features replace."""
        return self.placeholder_token_id if self.placeholder_token_id >= 0 else self.image_token_id


def image_digest(pixels: np.ndarray, settings_key: str) -> bytes:
    """The cache key of one image: sha256 over the decoded RGB pixels (shape included)
    and the model's preprocessing settings -- never over the URL or the base64 text."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"pixels must be uint8 [H, W, 3], got {pixels.dtype} {pixels.shape}")
    h = hashlib.sha256(f"promptcache-image-v{IMAGE_DIGEST_VERSION}\0".encode())
    h.update(settings_key.encode("utf-8") + b"\0")
    h.update(f"{pixels.shape[0]}x{pixels.shape[1]}\0".encode())
    h.update(np.ascontiguousarray(pixels).data)
    return h.digest()


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt: its digest, its decoded RGB pixels ``[H, W, 3]`` uint8 and
    the placeholder tokens ``[start, start + length)`` it covers in ``prompt_tokens``."""

    digest: bytes
    pixels: np.ndarray
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def expand_placeholders(tokens: Sequence[int], message_starts: Sequence[int],
                        info: VisionInfo, images: Sequence[tuple[bytes, np.ndarray]]
                        ) -> tuple[list[int], tuple[int, ...], tuple[ImageInput, ...]]:
    """A rendered prompt whose every image is one ``info.image_token_id`` -> each
    expanded to ``info.tokens_per_image`` placeholder tokens (between ``info.before`` and
    ``info.after``), in order; returns
    ``(tokens, message_starts, images)`` with the offsets shifted. ``images``:
    ``(digest, pixels)`` in the order the image tokens appear. ValueError when the
    rendered prompt holds another number of image tokens (the template dropped an
    image, or the text itself contains the image token)."""
    tid, n = info.image_token_id, info.tokens_per_image
    pid, before, after = info.placeholder_id, list(info.before), list(info.after)
    where = [i for i, t in enumerate(tokens) if t == tid]
    if len(where) != len(images):
        raise ValueError(
            f"the rendered prompt has {len(where)} image tokens ({info.image_token!r}) for "
            f"{len(images)} images: the text may not contain {info.image_token!r}, and "
            "images go only where the chat template renders them (user messages)")
    if pid != tid and any(t == pid for t in tokens):
        raise ValueError(f"the rendered prompt contains the image placeholder token {pid}")
    out: list[int] = []
    placed: list[ImageInput] = []
    prev = 0
    for pos, (digest, pixels) in zip(where, images, strict=True):
        out.extend(tokens[prev:pos])
        out.extend(before)
        placed.append(ImageInput(digest, pixels, len(out), n))
        out.extend([pid] * n)
        out.extend(after)
        prev = pos + 1
    out.extend(tokens[prev:])
    grow = len(before) + n + len(after) - 1
    starts = tuple(s + grow * sum(1 for w in where if w < s) for s in message_starts)
    return out, starts, tuple(placed)


def image_extra_keys(images: Sequence[ImageInput]) -> tuple[ExtraKeySpan, ...]:
    """The extra keys of a prompt's images, in prompt order (order matters: every block
    overlapping an image's placeholders hashes that image's digest)."""
    return tuple(ExtraKeySpan(im.start, im.end, b"img:" + im.digest) for im in images)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # 0 = off; otherwise sample among the k most likely tokens
    top_k: int = 0
    # None = no log-probabilities; k >= 0 = the chosen token's logprob plus the k most
    # likely alternatives on every TokenEvent (OpenAI ``top_logprobs``, at most 20)
    logprobs: int | None = None
    # OpenAI ``logit_bias``: (token id, bias in [-100, 100]) added to the logits before
    # sampling (mlx-lm's logits processor); the ids are checked against the vocabulary
    # at submit (``engine/context.py``)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # mlx-lm's penalties over the last ``penalty_context`` tokens (prompt included):
    # repetition (multiplicative, > 0, 1 = off; mlx_lm.server / vLLM ``repetition_penalty``),
    # OpenAI's presence and frequency penalties (additive, in [-2, 2], 0 = off)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_context: int = 20

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**64
        ):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop token ids must be non-negative integers, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= 20
        ):
            raise ValueError(f"logprobs must be None or an integer in [0, 20], got {self.logprobs!r}")
        for item in self.logit_bias:
            if not isinstance(item, tuple) or len(item) != 2:
                raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {item!r}")
            tid, bias = item
            if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
                raise ValueError(f"logit_bias token ids must be non-negative integers, got {tid!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                    or not -100.0 <= float(bias) <= 100.0:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r}")
        if not 0.0 < float(self.repetition_penalty) <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= float(getattr(self, name)) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if isinstance(self.penalty_context, bool) or not isinstance(self.penalty_context, int) \
                or not 1 <= self.penalty_context <= 4096:
            raise ValueError(f"repetition_context_size must be an integer in [1, 4096], got "
                             f"{self.penalty_context!r}")

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 \
            or self.frequency_penalty != 0.0


ConstraintKind = Literal["json_schema", "regex", "lark"]


@dataclass(frozen=True)
class Constraint:
    """Constrained decoding: the output must match ``spec``.

    ``json_schema``: a JSON Schema document (as a JSON string; ``{"type": "object"}``
    for OpenAI ``json_object``); ``regex``: a regular expression; ``lark``: a Lark
    grammar (llguidance dialect: it may embed ``%json{...}`` schemas), e.g. a forced
    tool call in the model's own tool-call format. The engine turns it into a logits
    processor (``engine/formats/constrained.py``). ``prefix``: text the reply already holds (an
    assistant prefill the model continues); prefix + output must match.
    """

    kind: ConstraintKind
    spec: str
    prefix: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "regex", "lark"):
            raise ValueError(f"constraint kind must be json_schema, regex or lark, got {self.kind!r}")
        if not isinstance(self.spec, str) or not self.spec:
            raise ValueError("constraint spec must be a non-empty string")
        if not isinstance(self.prefix, str):
            raise ValueError("constraint prefix must be a string")


Priority = Literal["interactive", "background"]


@dataclass(frozen=True)
class GenerationRequest:
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = DEFAULT_TENANT
    session_id: str | None = None
    # the client's (sub)agent (Claude Code's x-claude-code-agent-id), recorded on the
    # blocks the request stores next to the session
    agent_id: str | None = None
    extra_keys: tuple[ExtraKeySpan, ...] = ()
    use_cache: bool = True
    # for miss explanations: token offsets where each chat message starts
    message_starts: tuple[int, ...] = ()
    request_id: str = ""
    constraint: Constraint | None = None
    # "background" work (next-turn pre-render, shadow verification) runs only when no
    # interactive request is waiting and yields to one at the next chunk boundary
    priority: Priority = "interactive"
    # compute and store the prompt's blocks, generate nothing (pre-render): the result
    # has finish_reason "prefilled" and no tokens
    prefill_only: bool = False
    # the images of a vision-language prompt, in prompt order; their digests are added
    # to ``extra_keys`` by the engine (``image_extra_keys``)
    images: tuple[ImageInput, ...] = ()

    def cache_extra_keys(self) -> tuple[ExtraKeySpan, ...]:
        """``extra_keys`` plus the images' spans, ordered by position."""
        if not self.images:
            return self.extra_keys
        return tuple(sorted((*self.extra_keys, *image_extra_keys(self.images)),
                            key=lambda s: (s.start, s.end)))


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0
    # blocks stored at each of the three save points
    saved_mid_prefill: int = 0
    saved_end_prefill: int = 0
    saved_end_generation: int = 0
    # speculative decoding: draft tokens verified, and accepted, for this request
    spec_drafted: int = 0
    spec_accepted: int = 0
    # the restore-or-recompute plan taken (``Plan.describe``; "" when none was needed),
    # and the cached tokens it prefilled again instead of loading them
    restore_plan: str = ""
    recomputed_tokens: int = 0

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def served_by_tier(self) -> dict[str, int]:
        """What the cache served: its tiers' tokens, and those it chose to recompute
        (``recompute``): the request's outcome (a planned recompute is no miss)."""
        extra = {"recompute": self.recomputed_tokens} if self.recomputed_tokens else {}
        return {**self.cached_by_tier, **extra}

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_by_tier": dict(self.cached_by_tier),
            "completion_tokens": self.completion_tokens,
            "saved_mid_prefill": self.saved_mid_prefill,
            "saved_end_prefill": self.saved_end_prefill,
            "saved_end_generation": self.saved_end_generation,
            "spec_drafted": self.spec_drafted,
            "spec_accepted": self.spec_accepted,
        }


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # the newly decodable text (may be "" while a multi-byte char is pending)
    # with SamplingParams.logprobs set: this token's log-probability (after the logits
    # processors, before temperature) and the top alternatives as (token_id, logprob)
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled" | "error" | "prefilled"
    usage: Usage
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    lookup_s: float = 0.0
    restore_s: float = 0.0
    error: str | None = None
    # the stop string that ended generation (finish_reason "stop"); None for EOS,
    # a stop token id, a length cut or a cancellation
    stop_sequence: str | None = None
    # why the prompt was not (fully) served from the cache; None on a full hit or
    # when the request did not use the cache
    miss: CacheMiss | None = None
    # seconds the request waited for admission (active-request / KV-byte limits)
    queue_s: float = 0.0

    @property
    def miss_reason(self) -> str | None:
        """The miss's log line (``CacheMiss.describe``)."""
        return self.miss.describe() if self.miss is not None else None

    @property
    def decode_tps(self) -> float:
        return (len(self.tokens) / self.decode_s) if self.decode_s > 0 else 0.0
