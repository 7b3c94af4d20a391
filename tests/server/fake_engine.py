"""A tokenizer-free stand-in Engine (docs/INTERFACES.md, the port) for fast protocol tests.

``FakeEngine`` implements ``promptcache.engine.port.EngineAPI``: mypy checks it (this
file is in pyproject's mypy ``files``; see ``_implements_the_port`` at the end), so it
cannot drift from what the server uses of an engine.

Tokens are the UTF-8 bytes of the text. The chat "template" is
``<|role|>content\\n`` per message (+ tools as JSON) and ``<|assistant|>`` as the
generation prompt. Generation is deterministic: it emits ``reply`` (default
"Hello world!"; set ``engine.reply`` to script the next replies) byte by byte, up to
max_tokens. Stop strings work as in the engine: the first one found (earliest, then
first listed) ends the reply after its bytes were generated, the text stops before it
and ``GenerationResult.stop_sequence`` names it. The "cache" remembers every prompt
(+ output) per tenant and reports the longest common prefix with them as cached
tokens (at most len(prompt) - 1), all from the "ram" tier.

Knobs for the protocol tests: ``renders_tools=False`` makes the "template" drop tools
(as SmolLM2's does); ``think=True`` gives it ``<think>`` / ``</think>`` reasoning markers
and an ``enable_thinking`` switch (True opens ``<think>`` in the generation prompt);
with ``SamplingParams.logprobs`` each token's logprob is ``-(id % 7) / 10`` and the
alternatives are the next ids; ``before_first_token`` (an async callable) runs before
the first token is sent (a slow prefill). Background requests (the next-turn pre-render,
``prefill_only``) go to ``engine.background``, not ``engine.submitted``; they store their
prompt and finish with "prefilled".
"""

from __future__ import annotations

import asyncio
import codecs
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from promptcache.engine.api import (
    CacheMiss,
    GenerationRequest,
    GenerationResult,
    TokenEvent,
    Usage,
)
from promptcache.engine.formats.chat_format import ChatFormat
from promptcache.engine.port import CachePrediction, CacheProbe, EngineAPI, TunableCacheAPI
from promptcache.meta import DEFAULT_TENANT, ExtraKeySpan, Namespace
from promptcache.packfile import ImportReport, Pack, PackError
from promptcache.serving_config import EngineConfig


class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


@dataclass
class FakeStats:
    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)


@dataclass
class FakeMatch:
    num_tokens: int


class FakeCache:
    def __init__(self) -> None:
        self.seqs: dict[str, list[tuple[tuple[int, ...], str | None]]] = {}
        self.evicted: dict[str, list[tuple[int, ...]]] = {}
        self.lock = threading.Lock()
        self.deleted: list[Any] = []
        self.protected: list[tuple[Any, int, float, str | None, bool]] = []
        self.active: list[tuple[Any, int, str]] = []
        self.pinned: list[tuple[str | None, float | None]] = []  # (key, pin_s) per protect

    def match(self, tokens: tuple[int, ...], tenant: str, *, clamp: bool = True) -> int:
        """The longest common prefix with a stored sequence (``clamp``: at most
        ``len(tokens) - 1``, what a request restores)."""
        best = 0
        with self.lock:
            for seq, _ in self.seqs.get(tenant, []):
                n = 0
                for a, b in zip(seq, tokens, strict=False):
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
        return min(best, max(0, len(tokens) - 1)) if clamp else best

    def miss_kind(self, tokens: tuple[int, ...], tenant: str, cached: int) -> str | None:
        """Like the real cache's miss: None for a full hit, ``diverged`` where a stored
        sequence goes on differently after the ``cached`` tokens, else ``cold``."""
        if cached >= len(tokens) - 1:
            return None
        with self.lock:
            for seq in self.evicted.get(tenant, []):
                if len(seq) > cached and seq[:cached + 1] == tokens[:cached + 1]:
                    return "evicted"
            for seq, _ in self.seqs.get(tenant, []):
                if len(seq) > cached and seq[:cached] == tokens[:cached] \
                        and seq[cached] != tokens[cached]:
                    return "diverged"
        return "cold"

    def evict(self) -> None:
        """Drop every sequence, remembering it (a later miss on it is ``evicted``)."""
        with self.lock:
            for tenant, seqs in self.seqs.items():
                self.evicted.setdefault(tenant, []).extend(seq for seq, _ in seqs)
            self.seqs.clear()

    def store(self, tokens: tuple[int, ...], tenant: str, session: str | None) -> None:
        with self.lock:
            self.seqs.setdefault(tenant, []).append((tokens, session))

    def protect(self, tokens: Any, ns: Any, num_tokens: int, ttl_s: float, *,
                key: str | None = None, persist: bool = True, pin_s: float | None = None,
                extra_keys: Any = ()) -> int:
        """Records the protection a client asked for (PromptCache.protect)."""
        with self.lock:
            self.protected.append((ns, num_tokens, ttl_s, key, persist))
            self.pinned.append((key, pin_s))
        return 0

    def mark_active(self, tokens: Any, ns: Any, session: str, *, extra_keys: Any = ()) -> int:
        """Records a session's latest chain (PromptCache.mark_active)."""
        with self.lock:
            self.active.append((ns, len(tokens), session))
        return 0

    def lookup(self, tokens: Any, ns: Any) -> FakeMatch:
        return FakeMatch(self.match(tuple(tokens), ns))

    def sessions(self, tenant: str | None = None) -> list[dict[str, Any]]:
        return []  # no session lists

    def stats(self) -> FakeStats:
        with self.lock:
            n = sum(len(v) for v in self.seqs.values())
        return FakeStats({
            "sequences": n, "hit_tokens": 30, "miss_tokens": 70,
            "hit_tokens_by_tier": {"ram": 20, "ssd": 10}, "misses_by_cause": {"cold": 2},
            "saves": {"end_prefill": n}, "ram_bytes": 100 * n,
            "tiers": {"ssd": {"name": "ssd", "spills": 2, "quarantined": 1,
                              "bytes_on_disk": 4096, "dropped_spills": {"queue_full": 3},
                              "degraded": False, "degraded_reason": None,
                              "reload_latency_ms": {"buckets": [1, 2], "count": 0}}}})

    def delete(self, tenant: str | None = None) -> int:
        with self.lock:
            self.deleted.append(("tenant", tenant))
            if tenant is None:
                n = sum(len(v) for v in self.seqs.values())
                self.seqs.clear()
            else:
                n = len(self.seqs.pop(tenant, []))
        return n

    def delete_session(self, session_id: str, tenant: str | None = None) -> int:
        with self.lock:
            self.deleted.append(("session", session_id) if tenant is None
                                else ("session", session_id, tenant))
            n = 0
            for t, seqs in self.seqs.items():
                if tenant is not None and t != tenant:
                    continue
                keep = [s for s in seqs if s[1] != session_id]
                n += len(seqs) - len(keep)
                self.seqs[t] = keep
        return n


@dataclass
class FakeHandle:
    engine: FakeEngine
    request: GenerationRequest
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()
        self.engine.cancelled.append(self.request.request_id)

    def _run(self) -> Iterator[TokenEvent | GenerationResult]:
        eng = self.engine
        prompt = self.request.prompt_tokens
        cached = eng.cache.match(prompt, self.request.tenant) if eng.cache else 0
        if self.request.prefill_only:
            if eng.cache is not None:
                eng.cache.store(prompt, self.request.tenant, self.request.session_id)
            yield GenerationResult(tokens=[], text="", finish_reason="prefilled",
                                   usage=Usage(prompt_tokens=len(prompt), cached_tokens=cached))
            return
        sampling = self.request.sampling
        reply = eng.reply
        full = list(reply.encode("utf-8"))
        text_len, stop_seq = len(full), None
        found = [(i, k) for k, i in enumerate(reply.find(s) for s in sampling.stop) if i >= 0]
        if found:
            at, which = min(found)
            end = len(reply[: at + len(sampling.stop[which])].encode("utf-8"))
            if end <= sampling.max_tokens:
                full, stop_seq = full[:end], sampling.stop[which]
                text_len = len(reply[:at].encode("utf-8"))
        out = full[: sampling.max_tokens]
        finish = "length" if len(out) < len(full) else "stop"
        emitted: list[int] = []
        k = sampling.logprobs
        # like a real detokenizer: a multi-byte character is emitted once it is complete
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        for t in out:
            if self.cancelled.is_set():
                finish, stop_seq = "cancelled", None
                break
            emitted.append(t)
            text = utf8.decode(bytes([t])) if len(emitted) <= text_len else ""
            if k is None:
                yield TokenEvent(t, text)
            else:
                top = tuple(((t + j) % 256, -((t + j) % 7) / 10 - j) for j in range(k))
                yield TokenEvent(t, text, logprob=-(t % 7) / 10, top_logprobs=top)
        saved = 0
        if eng.cache is not None:
            # like the real cache: a prompt already stored whole saves no new block
            whole = eng.cache.match(prompt, self.request.tenant, clamp=False) >= len(prompt)
            saved = 0 if whole else 1
            eng.cache.store(prompt + tuple(emitted), self.request.tenant,
                            self.request.session_id)
        usage = Usage(prompt_tokens=len(prompt), cached_tokens=cached,
                      cached_by_tier={"ram": cached} if cached else {},
                      completion_tokens=len(emitted), saved_end_prefill=saved)
        kind = eng.cache.miss_kind(prompt, self.request.tenant, cached) if eng.cache else None
        miss = None if kind is None else CacheMiss(kind, cached, cached, len(prompt))
        yield GenerationResult(tokens=emitted,
                               text=bytes(emitted[:text_len]).decode("utf-8", "replace"),
                               finish_reason=finish, usage=usage, ttft_s=0.001,
                               decode_s=0.01, miss=miss, stop_sequence=stop_seq)

    def events(self) -> Iterator[TokenEvent | GenerationResult]:
        return self._run()

    async def aevents(self) -> AsyncIterator[TokenEvent | GenerationResult]:
        if self.engine.before_first_token is not None:
            await self.engine.before_first_token()
        for ev in self._run():
            if self.engine.delay:
                await asyncio.sleep(self.engine.delay)
            yield ev


class FakeEngine:
    model_id = "fake-model"
    vocab_size = 256  # byte tokens
    vision = None  # text only
    shadow = None  # no shadow verification
    alive = True
    failure: str | None = None

    def __init__(self, *, context_length: int = 4096, reply: str = "Hello world!",
                 use_cache: bool = True, delay: float = 0.0, renders_tools: bool = True,
                 think: bool = False) -> None:
        self.context_length = context_length
        self.reply = reply
        self.delay = delay
        self.renders_tools = renders_tools
        self.chat_format = ChatFormat("<think>", "</think>", "enable_thinking") if think \
            else ChatFormat()
        self.before_first_token: Callable[[], Awaitable[None]] | None = None
        self.template_kwargs: list[Mapping[str, Any] | None] = []
        self.tokenizer = FakeTokenizer()
        self.cache: FakeCache | None = FakeCache() if use_cache else None
        self.config = EngineConfig(max_tokens_limit=1000, default_max_tokens=64)
        self.submitted: list[GenerationRequest] = []
        self.background: list[GenerationRequest] = []
        self._render_lock = threading.RLock()
        self.cancelled: list[str] = []
        self.rendered: list[tuple[Sequence[Mapping[str, Any]], Any]] = []

    @property
    def engine_config(self) -> EngineConfig:
        return self.config

    @property
    def tunable_cache(self) -> TunableCacheAPI | None:
        """A real PromptCache a test put in ``cache`` (the advisor watches it)."""
        cache: Any = self.cache
        return cache if hasattr(cache, "observers") else None

    @property
    def cache_port(self) -> FakeEngine:
        """The fake's cache calls are its own methods (``CachePortAPI``)."""
        return self

    def namespace(self, tenant: str = DEFAULT_TENANT) -> Namespace:
        return Namespace("fake-model", 16, tenant=tenant)

    def announce(self) -> Callable[[], None]:
        return lambda: None

    # the cache's calls (the real engine runs them on its thread): the fake cache keys
    # its chains by tenant; a real PromptCache a test put in ``cache`` fails them, which
    # degrades as the engine's calls do (None / 0)
    def predict_cached(self, tokens: Sequence[int], tenant: str,
                       extra_keys: Sequence[ExtraKeySpan] = ()) -> CachePrediction | None:
        if self.cache is None:
            return None
        try:
            match = self.cache.lookup(list(tokens), tenant)
            whole = getattr(self.cache, "match", None)  # a FakeCache (tests may set another)
            stored = whole(tuple(tokens), tenant, clamp=False) if whole is not None else 0
        except Exception:
            return None
        return CachePrediction(max(0, min(int(match.num_tokens), len(tokens) - 1)),
                               whole=stored >= len(tokens) > 0)

    def probe_cache(self, tokens: Sequence[int], tenant: str,
                    extra_keys: Sequence[ExtraKeySpan] = (),
                    context_tokens: int = 0) -> CacheProbe | None:
        if self.cache is None:
            return None
        try:
            n = self.cache.lookup(list(tokens), tenant).num_tokens
        except Exception:
            return None
        return CacheProbe(n, n, {"ram": n} if n else {},
                          None if n else CacheMiss("cold", 0, 0, len(tokens)))

    def protect(self, tokens: Sequence[int], tenant: str, num_tokens: int, ttl_s: float, *,
                key: str | None = None, persist: bool = True, pin_s: float | None = None,
                extra_keys: Sequence[ExtraKeySpan] = ()) -> int:
        if self.cache is None:
            return 0
        try:
            return self.cache.protect(tokens, tenant, num_tokens, ttl_s, key=key,
                                      persist=persist, pin_s=pin_s, extra_keys=extra_keys)
        except Exception:
            return 0

    def mark_active(self, tokens: Sequence[int], tenant: str, session: str, *,
                    extra_keys: Sequence[ExtraKeySpan] = ()) -> int:
        if self.cache is None:
            return 0
        try:
            return self.cache.mark_active(tokens, tenant, session, extra_keys=extra_keys)
        except Exception:
            return 0

    def export_pack(self, tenant: str, selection: dict[str, Any], *,
                    tokens: Sequence[int] | None = None,
                    session_id: str | None = None) -> tuple[bytes, dict[str, Any]]:
        raise PackError("the fake engine stores no blocks")

    def import_pack(self, pack: Pack) -> ImportReport:
        raise PackError("the fake engine stores no blocks")

    def engine_stats(self) -> dict[str, Any] | None:
        return None  # no admission control: the server counts requests in flight

    def kv_stats(self) -> dict[str, Any] | None:
        return None

    def vision_stats(self) -> dict[str, Any] | None:
        return None

    def cache_stats(self) -> dict[str, Any] | None:
        cache: Any = self.cache
        if cache is None:
            return None
        data: dict[str, Any] = dict(cache.stats().to_dict())
        if hasattr(cache, "levels_snapshot"):  # a real PromptCache
            data["levels"] = cache.levels_snapshot()
        return data

    def tier_health(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for tier in getattr(self.cache, "lower", None) or ():  # a real PromptCache's
            health = getattr(tier, "health", None)
            if callable(health):
                out[str(tier.name)] = dict(health())
        return out

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def render_chat_with_offsets(self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
                                 add_generation_prompt: bool = True, *,
                                 continue_final_message: bool = False,
                                 template_kwargs: Mapping[str, Any] | None = None,
                                 ) -> tuple[list[int], list[int]]:
        self.rendered.append((messages, tools))
        self.template_kwargs.append(template_kwargs)
        return self._render(messages, tools, add_generation_prompt,
                            continue_final_message=continue_final_message,
                            template_kwargs=template_kwargs)

    def _render(self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
                add_generation_prompt: bool = True, *, continue_final_message: bool = False,
                template_kwargs: Mapping[str, Any] | None = None,
                ) -> tuple[list[int], list[int]]:
        text, starts = "", []
        if tools and self.renders_tools:
            text += "<|tools|>" + json.dumps(tools, sort_keys=True) + "\n"
        for i, m in enumerate(messages):
            starts.append(len(text.encode("utf-8")))
            if m["content"] == "EXPLODE":
                raise RuntimeError("template exploded")
            text += f"<|{m['role']}|>{m['content']}"
            for tc in m.get("tool_calls", []):
                text += "<tool_call>" + json.dumps(tc["function"], sort_keys=True) + "</tool_call>"
            if not (continue_final_message and i == len(messages) - 1):
                text += "\n"
        if add_generation_prompt and not continue_final_message:
            text += "<|assistant|>"
            if (template_kwargs or {}).get("enable_thinking"):
                text += "<think>"
        return list(text.encode("utf-8")), starts

    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: Any = None,
                    add_generation_prompt: bool = True, *, continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Tokens only, not recorded in ``rendered`` (the server's side renders: template
        probes, the next-turn pre-render); a subclass's ``render_chat_with_offsets``
        still decides what renders."""
        with self._render_lock:
            n = len(self.rendered)
            out = self.render_chat_with_offsets(
                messages, tools, add_generation_prompt,
                continue_final_message=continue_final_message,
                template_kwargs=template_kwargs)[0]
            del self.rendered[n:]
            del self.template_kwargs[n:]
        return out

    def submit(self, request: GenerationRequest) -> FakeHandle:
        if any(t > 255 for t in request.prompt_tokens):
            raise ValueError("token id out of range for the fake vocabulary")
        if request.priority == "background":
            self.background.append(request)  # next-turn pre-renders
        else:
            self.submitted.append(request)
        return FakeHandle(self, request)


if TYPE_CHECKING:
    def _implements_the_port(engine: FakeEngine) -> EngineAPI:
        return engine  # mypy: the fake implements EngineAPI (engine/port.py)
