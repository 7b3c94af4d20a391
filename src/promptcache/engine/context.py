"""What every request of one engine shares (``EngineContext``), the engine's counters
(``EngineCounters``), the check of a request before anything runs or is stored
(``validate_request``) and the cause a failed save is counted under
(``store_error_cause``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from ..blocks.tokens import to_request_tokens
from ..errors import ContextLengthError, InvariantError, RequestError, TierError
from ..meta import Namespace
from ..serving_config import EngineConfig
from .api import GenerationRequest, SamplingParams
from .cache_like import RequestCache
from .mlx_compat import LanguageModel, Tokenizer
from .models.vision import VisionEncoder, validate_images
from .payload.planner import Planner
from .payload.quant import KVQuant

if TYPE_CHECKING:
    from .payload.live import LiveStates
    from .speculation import Speculator


LogitsHook = Callable[[str, int, np.ndarray], None]
Processor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class EngineCounters:
    """Counters of one engine (read by the stats endpoints)."""

    requests: int = 0
    cache_errors: int = 0
    restore_errors: int = 0
    store_errors: int = 0
    # failed saves by cause (``store_error_cause``): layout | tier | budget | invariant |
    # other; the next request that would have hit those blocks misses as
    # ``not_stored: <cause>``
    store_errors_by_cause: dict[str, int] = field(default_factory=dict)
    cancelled: int = 0
    errors: int = 0
    prefilled: int = 0
    prefill_chunks: int = 0
    prefill_batches: int = 0  # batched prefill forwards (engine/requests/prefill.py)
    max_prefill_batch: int = 0  # most rows in one of them
    # a request that waited a step because the prefill batch's attention workspace
    # would not fit in the KV budget next to the admitted requests' reservations
    prefill_workspace_waits: int = 0
    # requests that waited for another's prefill of the prompt prefix they share
    # (scheduler: they reuse its stored blocks instead of computing them again)
    shared_prefix_waits: int = 0
    # saves given up: a request's next unsaved block had already left its sliding window
    # (a block before it could not be stored, e.g. no room), so nothing after it can be
    window_gaps: int = 0
    # non-truncatable states (SSM / hybrid): state snapshots taken for block payloads,
    # those taken at message starts (where a conversation branches), their bytes, and the
    # bytes of the last one (a snapshot's size is fixed by the model: memory per snapshot)
    snapshots: int = 0
    message_snapshots: int = 0
    snapshot_bytes: int = 0
    bytes_per_snapshot: int = 0
    # restores from blocks (request_saves.lookup_and_restore): how many, the blocks they
    # read, the array copies their concatenations issued and the bytes those wrote
    restores: int = 0
    restored_blocks: int = 0
    restore_copies: int = 0
    restore_copy_bytes: int = 0
    # the restore-or-recompute planner (engine/payload/planner.py): its plans by kind (load |
    # recompute | split) and by why (auto | forced | stateful | unmeasured), the cached
    # tokens prefilled again by its plans, and the samples its rates were fed
    restore_plans_by_kind: dict[str, int] = field(default_factory=dict)
    restore_plans_by_why: dict[str, int] = field(default_factory=dict)
    recomputed_tokens: int = 0
    # splits run (engine/requests/splice.py): tails spliced in and their tokens, reads not in
    # at the split point (the head prefilled on), tails given up (prefilled instead)
    splices: int = 0
    spliced_tokens: int = 0
    splices_late: int = 0
    splices_given_up: int = 0
    rate_prefill_samples: int = 0
    rate_read_samples: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # sum of batch sizes over decode steps
    solo_steps: int = 0  # decode steps of requests mlx-lm cannot batch
    max_batch: int = 0
    active_kv_bytes: int = 0
    peak_active_kv_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {k: dict(v) if isinstance(v, dict) else v for k, v in self.__dict__.items()}


@dataclass
class EngineContext:
    """What every request of one engine shares: the model, the tokenizer, the cache."""

    model: LanguageModel
    tokenizer: Tokenizer
    config: EngineConfig
    context_length: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    cache: RequestCache | None = None  # PromptCache, or a fake (tests)
    namespace_for: Callable[[str], Namespace] | None = None
    block_size: int = 64
    counters: EngineCounters = field(default_factory=EngineCounters)
    logits_hook: LogitsHook | None = None
    vision: VisionEncoder | None = None  # of a vision-language model
    kv_quant: KVQuant | None = None  # how stored blocks are quantized (None: full precision)
    speculator: Speculator | None = None  # --speculation suffix (engine/speculation/)
    live: LiveStates | None = None  # the last turns' states (engine/payload/live.py)
    planner: Planner = field(default_factory=Planner)  # restore or recompute (planner.py)

    def timed_prefill(self, chunks: list[tuple[int, int]], seconds: float) -> float:
        """A prefill forward over ``(first position, tokens)`` chunks took ``seconds``:
        the planner's prefill rate learns it; returns ``seconds``."""
        self.planner.rates.record_prefill(chunks, seconds)
        self.counters.rate_prefill_samples += 1
        return seconds


def validate_request(req: GenerationRequest, ctx: EngineContext) -> np.ndarray:
    """Check a request before anything runs or is stored; raise ``RequestError``.
    Returns the prompt as a uint32 array (the fast validator of ``blocks.tokens``)."""
    if not isinstance(req, GenerationRequest):
        raise RequestError(f"expected a GenerationRequest, got {type(req).__name__}")
    sp = req.sampling
    if not isinstance(sp, SamplingParams):
        raise RequestError(f"sampling must be SamplingParams, got {type(sp).__name__}")
    try:
        arr = to_request_tokens(req.prompt_tokens).arr
    except ValueError as e:
        raise RequestError(f"invalid prompt: {e}") from None
    top = int(arr.max())
    if top >= ctx.vocab_size:
        bad = int(arr[int(np.argmax(arr >= ctx.vocab_size))])
        raise RequestError(f"prompt token id {bad} is outside the vocabulary (size {ctx.vocab_size})")
    bad_bias = [t for t, _ in sp.logit_bias if t >= ctx.vocab_size]
    if bad_bias:
        raise RequestError(f"logit_bias token id {bad_bias[0]} is outside the vocabulary "
                           f"(size {ctx.vocab_size})")
    if not isinstance(sp.stop, (tuple, list)) or not all(isinstance(s, str) and s for s in sp.stop):
        raise RequestError(f"stop must be a sequence of non-empty strings, got {sp.stop!r}")
    if not isinstance(sp.stop_token_ids, (tuple, list)) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in sp.stop_token_ids
    ):
        raise RequestError(f"stop_token_ids must be a sequence of token ids, got {sp.stop_token_ids!r}")
    if isinstance(sp.max_tokens, bool) or not isinstance(sp.max_tokens, int) or sp.max_tokens <= 0:
        raise RequestError(f"max_tokens must be a positive integer, got {sp.max_tokens!r}")
    if req.priority not in ("interactive", "background"):
        raise RequestError(f"priority must be 'interactive' or 'background', got {req.priority!r}")
    if sp.max_tokens > ctx.config.max_tokens_limit:
        raise RequestError(f"max_tokens {sp.max_tokens} exceeds the limit {ctx.config.max_tokens_limit}")
    validate_images(req.images, arr, ctx.vision.info if ctx.vision is not None else None)
    n = int(arr.shape[0])
    budget = 0 if req.prefill_only else sp.max_tokens
    if n + budget > ctx.context_length:
        raise ContextLengthError(
            f"prompt ({n} tokens) + max_tokens ({sp.max_tokens}) exceeds the "
            f"model's context length ({ctx.context_length})"
        )
    return arr


def store_error_cause(exc: BaseException) -> str:
    """The short name of why a save failed: ``tier`` (a cache tier failed),
    ``invariant`` (a broken invariant: a bug), ``budget`` (out of memory), ``layout``
    (the caches' state did not fit the block format: an unsupported or inconsistent
    cache layout, a payload the cache refused), ``other``."""
    if isinstance(exc, TierError):
        return "tier"
    if isinstance(exc, InvariantError):
        return "invariant"
    if isinstance(exc, MemoryError):
        return "budget"
    if isinstance(exc, (ValueError, TypeError, KeyError, IndexError)):
        return "layout"
    return "other"
