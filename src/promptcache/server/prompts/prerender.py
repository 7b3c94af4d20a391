"""Next-turn pre-render: in idle time, prefill the history as the client will send it back
(conversation + reply + a placeholder user message, rendered as a real turn and cut where
the placeholder starts) as a background ``prefill_only`` request where it differs from what
is stored. One per session, at most ``max_pending``, suffixes up to ``max_suffix_tokens``."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from dataclasses import asdict, dataclass
from typing import Any

from ...engine.api import GenerationRequest, GenerationResult, SamplingParams, common_prefix
from ...engine.port import EngineAPI, HandleAPI
from ...errors import OverloadedError
from ..ops.diagnostics import TurnKey
from .prepared import ChatPrompt, Prepared
from .preparer import Preparer

log = logging.getLogger(__name__)

# the renderings of these two part where the next message's content starts (ASCII)
PLACEHOLDERS = ("Alpha (the next message)", "Zulu (the next message)")


@dataclass
class PreRenderStats:
    scheduled: int = 0  # replies handed over
    not_needed: int = 0  # the stored tokens already are the next turn's prefix
    submitted: int = 0  # background prefills submitted
    done: int = 0  # ... that finished and stored their blocks
    cancelled: int = 0  # ... cancelled (a newer turn of the session came first)
    preempted: int = 0  # ... cancelled by the engine: an interactive request needed the slot
    failed: int = 0  # renders or prefills that failed (logged)
    skipped_busy: int = 0  # max_pending reached, or the engine's background queue full
    skipped_long: int = 0  # suffix longer than max_suffix_tokens
    skipped_images: int = 0  # conversations with images (not pre-rendered)
    suffix_tokens: int = 0  # tokens prefilled in the background (submitted suffixes)


class PreRenderer:
    """One per app (see the module docstring); ``preparer`` is the app's ``Preparer``."""

    def __init__(self, engine: EngineAPI, preparer: Preparer, *, enabled: bool = True,
                 max_pending: int = 4, max_suffix_tokens: int = 32768) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.engine = engine
        self.preparer = preparer
        self.enabled = enabled and engine.cache is not None
        self.max_pending = max_pending
        self.max_suffix_tokens = max_suffix_tokens
        self.stats = PreRenderStats()
        self._lock = threading.Condition()
        self._queued = 0  # handed to the worker, not yet submitted or dropped
        self._pending: dict[object, HandleAPI] = {}  # session key -> engine handle
        self._tasks: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)

    def after_reply(self, key: TurnKey | None, tenant: str, session_id: str | None,
                    chat: ChatPrompt, reply: list[dict[str, Any]], prepared: Prepared,
                    result: GenerationResult) -> None:
        """A reply ended: schedule its pre-render (returns at once)."""
        if not self.enabled or result.finish_reason not in ("stop", "length"):
            return
        slot: object = key if key is not None else object()  # no session: a slot of its own
        images = chat.images
        if images is not None and images.sources:
            # a light render carries no images: not pre-rendered
            with self._lock:
                self.stats.skipped_images += 1
            return
        with self._lock:
            if slot not in self._pending and len(self._pending) + self._queued >= self.max_pending:
                self.stats.skipped_busy += 1
                return
            self.stats.scheduled += 1
            self._queued += 1
        loop = asyncio.get_running_loop()
        stored = list(prepared.tokens) + list(result.tokens)
        self.preparer.submit(self._render_and_submit, loop, slot, key, tenant, session_id,
                             chat, reply, stored)

    def cancel(self, key: TurnKey | None) -> None:
        """The session sent its next request: its pending pre-render is moot."""
        if key is None:
            return
        with self._lock:
            handle = self._pending.pop(key, None)
            if handle is not None:
                self.stats.cancelled += 1
                self._lock.notify_all()
        if handle is not None:
            handle.cancel()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"enabled": self.enabled, "pending": len(self._pending),
                    "queued": self._queued, **asdict(self.stats)}

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or running (tests, benchmarks)."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._queued and not self._pending,
                                       timeout)

    def next_prefix(self, chat: ChatPrompt, reply: list[dict[str, Any]]) -> list[int]:
        """The tokens the next request starts with: conversation + ``reply`` (worker thread)."""
        renders: list[list[int]] = []
        for text in PLACEHOLDERS:
            nxt = type(chat)(list(chat.messages) + list(reply) + [{"role": "user",
                                                                   "content": text}],
                             chat.tools, chat.thinking)
            renders.append(self.preparer._prepare(nxt, None, None, light=True).tokens)
        return renders[0][:common_prefix(renders[0], renders[1])]

    def _render_and_submit(self, loop: asyncio.AbstractEventLoop, slot: object,
                           key: TurnKey | None, tenant: str, session_id: str | None,
                           chat: ChatPrompt, reply: list[dict[str, Any]], stored: list[int]) -> None:
        handle: HandleAPI | None = None
        try:
            target = self.next_prefix(chat, reply)
            kept = len(stored) - 1  # the last generated token's state is not stored
            same = common_prefix(stored[:kept], target)
            if same >= kept or same >= len(target) - 1:
                with self._lock:
                    self.stats.not_needed += 1
                return
            if len(target) - same > self.max_suffix_tokens:
                with self._lock:
                    self.stats.skipped_long += 1
                return
            req = GenerationRequest(
                prompt_tokens=tuple(target), sampling=SamplingParams(max_tokens=1),
                tenant=tenant, session_id=session_id,
                agent_id=key.agent_id if key is not None else None, priority="background",
                prefill_only=True, request_id=f"prerender-{next(self._ids)}")
            try:
                handle = self.engine.submit(req)
            except OverloadedError:  # background work waits in a bounded queue of its own
                with self._lock:
                    self.stats.skipped_busy += 1
                return
            if key is not None:  # the cache will hold the next turn's prefix
                self.preparer.turns.replace_tokens(key, target)
            with self._lock:
                old = self._pending.pop(slot, None)
                self._pending[slot] = handle
                self.stats.submitted += 1
                self.stats.suffix_tokens += len(target) - same
                if old is not None:
                    self.stats.cancelled += 1
            if old is not None:
                old.cancel()
            log.debug("pre-render %s: %d of %d tokens stored, prefilling %d in the "
                      "background", req.request_id, same, len(target), len(target) - same)
            try:
                loop.call_soon_threadsafe(self._watch, slot, handle)
            except RuntimeError:  # the app's event loop is gone (shutdown): drop it
                handle.cancel()
                with self._lock:
                    if self._pending.get(slot) is handle:
                        del self._pending[slot]
                        self.stats.cancelled += 1
        except Exception:  # a pre-render is an optimisation: it never fails a request
            log.warning("next-turn pre-render failed", exc_info=True)
            with self._lock:
                self.stats.failed += 1
        finally:
            with self._lock:
                self._queued -= 1
                self._lock.notify_all()

    def _mark_active(self, key: TurnKey, req: GenerationRequest) -> None:
        """The next turn's prefix is the session's latest chain (on the engine thread)."""
        self.engine.cache_port.mark_active(req.prompt_tokens, req.tenant, key.activity)

    def _watch(self, slot: object, handle: HandleAPI) -> None:
        task = asyncio.ensure_future(self._await(slot, handle))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _await(self, slot: object, handle: HandleAPI) -> None:
        result: GenerationResult | None = None
        try:
            async for ev in handle.aevents():
                if isinstance(ev, GenerationResult):
                    result = ev
        finally:
            with self._lock:
                ours = self._pending.get(slot) is handle  # not cancelled by this side
                if ours:
                    del self._pending[slot]
                if result is not None and result.finish_reason == "cancelled" and ours:
                    self.stats.preempted += 1
                elif result is not None and result.finish_reason == "prefilled":
                    self.stats.done += 1
                    if isinstance(slot, TurnKey):  # the next turn's prefix is the latest chain
                        self.preparer.submit(self._mark_active, slot, handle.request)
                elif result is not None and result.finish_reason == "error":
                    self.stats.failed += 1
                    log.warning("pre-render %s failed: %s", handle.request.request_id,
                                result.error)
                self._lock.notify_all()
