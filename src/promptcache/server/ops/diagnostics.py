"""Miss diagnosis against the previous turn (``TurnStore``; Anthropic ``diagnostics`` and
the log line): a divergence is named by where it falls (tools / system / messages), a
repeat the cache did not deliver by the cache's cause (docs/api.md). Token work runs in
the preparation thread; ``Divergence.diagnose`` is O(1)."""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import threading
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...engine.api import CacheMiss, common_prefix
from ...lru import BoundedLRU

log = logging.getLogger(__name__)

BETA = "cache-diagnosis-2026-04-07"

TOOLS_CHANGED = "tools_changed"
SYSTEM_CHANGED = "system_changed"
MESSAGES_CHANGED = "messages_changed"
CHANGED = (TOOLS_CHANGED, SYSTEM_CHANGED, MESSAGES_CHANGED)
NOT_FOUND = "previous_message_not_found"
UNAVAILABLE = "unavailable"
# the cache's causes (cache/miss.py) -> the diagnosis for a repeated prefix
_CACHE_CAUSES = {"evicted": "evicted", "expired": "expired", "cold": "cold",
                 "not_restorable": "not_restorable", "promotion_failed": "evicted",
                 "diverged": MESSAGES_CHANGED, "cache_error": "not_restorable",
                 "restore_error": "not_restorable", "not_stored": "not_stored"}
CONTEXT_TOKENS = 16  # tokens of text shown on each side of a divergence


def wants_diagnostics(beta_header: str | None, body_field: Any) -> bool:
    """The request asked for diagnostics: the beta header or a ``diagnostics`` field."""
    betas = {b.strip() for b in (beta_header or "").split(",")}
    return BETA in betas or body_field is not None


def cache_cause_of(miss: CacheMiss | None) -> str | None:
    """The cause of an engine miss (``not_stored`` without the failed save's cause)."""
    return miss.kind if miss is not None else None


def _digest(value: Any) -> bytes:
    data = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.blake2b(data.encode("utf-8"), digest_size=16).digest()


@dataclass(frozen=True)
class Fingerprint:
    """The structure of a request, as digests: tools, leading system text, messages."""

    tools: bytes
    system: bytes
    messages: tuple[bytes, ...]

    @classmethod
    def of(cls, messages: Sequence[Mapping[str, Any]], tools: Any) -> Fingerprint:
        i = 0
        system: list[Any] = []
        while i < len(messages) and messages[i].get("role") == "system":
            system.append(messages[i].get("content"))
            i += 1
        return cls(_digest(tools or []), _digest(system),
                   tuple(_digest(m) for m in messages[i:]))

    def first_change(self, prev: Fingerprint) -> str:
        """Which part of the request changed first relative to ``prev``."""
        if self.tools != prev.tools:
            return TOOLS_CHANGED
        if self.system != prev.system:
            return SYSTEM_CHANGED
        return MESSAGES_CHANGED


@dataclass(frozen=True)
class TurnKey:
    tenant: str
    session_id: str
    agent_id: str | None = None

    @property
    def activity(self) -> str:
        """This turn's session key for ``mark_active`` (a subagent's includes its agent id)."""
        return self.session_id if self.agent_id is None else f"{self.session_id}\x1f{self.agent_id}"


@dataclass
class Turn:
    """One finished turn: what the next turn should start with."""

    key: TurnKey | None
    fingerprint: Fingerprint
    tokens: array[int]  # prompt + output
    tenant: str | None = None  # whose turn (a message id is looked up within it)


@dataclass(frozen=True)
class Diagnosis:
    type: str
    missed: int | None = None  # cache_missed_input_tokens (None for not_found / unavailable)

    def to_wire(self) -> dict[str, Any]:
        reason: dict[str, Any] = {"type": self.type}
        if self.missed is not None:
            reason["cache_missed_input_tokens"] = self.missed
        return {"cache_miss_reason": reason}


@dataclass(frozen=True)
class Divergence:
    """This request against the previous turn (computed before the request runs)."""

    previous: bool  # a previous turn was found
    not_found: bool = False  # previous_message_id named a turn we do not know
    reachable: int = 0  # previous turn's reusable length within this prompt
    position: int = 0  # first token where the request differs from the previous turn
    changed: str | None = None  # a CHANGED type when position < reachable
    message_index: int | None = None  # rendered chat message of ``position``
    role: str | None = None
    block: str | None = None  # request-body path of the text at ``position``
    common_text: str = ""  # text before the divergence (shared)
    cached_text: str = ""  # the previous turn's text after it
    request_text: str = ""  # this request's text after it

    def diagnose(self, restored: int, cache_cause: str | None, caching: bool = True
                 ) -> Diagnosis | None:
        """The diagnosis once the restored tokens (and the cause) are known; None if no miss."""
        if self.not_found:
            return Diagnosis(NOT_FOUND)
        if not caching:
            return Diagnosis(UNAVAILABLE)
        if not self.previous:
            return None
        if restored >= self.reachable:
            return None
        missed = self.reachable - restored
        if self.changed is not None:
            return Diagnosis(self.changed, missed)
        return Diagnosis(_CACHE_CAUSES.get(cache_cause or "cold", "cold"), missed)

    def log_text(self, diagnosis: Diagnosis, cache_reason: str | None) -> str:
        """The facts of a miss in one line (for the request log line)."""
        parts = [diagnosis.type]
        if diagnosis.missed is not None:
            parts.append(f"{diagnosis.missed} tokens of the previous turn not reused")
        if self.previous and self.position < self.reachable:
            where = f"diverges at token {self.position}"
            if self.message_index is not None:
                where += f" (message {self.message_index}, {self.role})"
            if self.block:
                where += f" in {self.block}"
            parts.append(where)
            parts.append(f"previous {_quote(self.common_text, self.cached_text)} vs "
                         f"request {_quote(self.common_text, self.request_text)}")
        if cache_reason:
            parts.append(f"cache: {cache_reason}")
        return "; ".join(parts)


def _quote(before: str, after: str) -> str:
    return json.dumps(before[-24:] + "|" + after[:24], ensure_ascii=False)


NO_PREVIOUS = Divergence(previous=False)
PREVIOUS_NOT_FOUND = Divergence(previous=False, not_found=True)


def message_at(position: int, starts: Sequence[int]) -> int | None:
    if not starts:
        return None
    i = bisect.bisect_right(list(starts), position) - 1
    return i if i >= 0 else None


def body_texts(body: Any, path: str = "") -> list[tuple[str, str]]:
    """Every string in a body (dict or pydantic model) with its path, in document order."""
    dump = getattr(body, "model_dump", None)
    if callable(dump):
        body = dump(exclude_none=True)
    out: list[tuple[str, str]] = []
    if isinstance(body, str):
        out.append((path, body))
    elif isinstance(body, Mapping):
        for k, v in body.items():
            out.extend(body_texts(v, f"{path}.{k}" if path else str(k)))
    elif isinstance(body, list):
        for i, v in enumerate(body):
            out.extend(body_texts(v, f"{path}[{i}]"))
    return out


def locate(before: str, after: str, texts: Sequence[tuple[str, str]]) -> str | None:
    """The path of the body string holding the text at a divergence: the longest window
    around the point found in one string (>= 4 characters, one after the point)."""
    best: tuple[int, str] | None = None
    b, a = before[-24:], after[:24]
    # every window of >= 4 characters with >= 1 after the point holds one of these
    probes = [w for w in (b[len(b) - k:] + a[:4 - k] for k in range(4)) if len(w) == 4]
    for path, text in texts:
        if len(text) < 4 or not any(p in text for p in probes):
            continue
        for total in range(len(b) + len(a), 3, -1):
            if best is not None and total <= best[0]:
                break
            found = False
            for left in range(min(len(b), total - 1), max(-1, total - len(a) - 1), -1):
                right = total - left
                if right < 1 or right > len(a):
                    continue
                if b[len(b) - left:] + a[:right] in text:
                    found = True
                    break
            if found:
                best = (total, path)
                break
    return best[1] if best else None


class TurnStore:
    """Finished turns by message id and by (tenant, session, agent); LRU past the limits."""

    def __init__(self, max_turns: int = 512, max_tokens: int = 4_000_000) -> None:
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self._turns: BoundedLRU[str, Turn] = BoundedLRU(max_turns)
        self._by_key: dict[TurnKey, str] = {}
        self._tokens = 0
        self._seq = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._turns)

    def add(self, turn: Turn, message_id: str | None = None) -> None:
        with self._lock:
            if message_id is None:
                self._seq += 1
                message_id = f"turn-{self._seq}"
            old = self._turns.pop(message_id)
            if old is not None:
                self._tokens -= len(old.tokens)
            self._tokens += len(turn.tokens)
            if turn.key is not None:
                self._by_key[turn.key] = message_id
            for gone in self._turns.put(message_id, turn):
                self._forget(*gone)
            while self._turns and self._tokens > self.max_tokens:
                self._forget(*self._turns.pop_oldest())

    def _forget(self, message_id: str, turn: Turn) -> None:
        self._tokens -= len(turn.tokens)
        if turn.key is not None and self._by_key.get(turn.key) == message_id:
            del self._by_key[turn.key]

    def replace_tokens(self, key: TurnKey, tokens: Sequence[int]) -> None:
        """The pre-render found what ``key``'s next turn starts with: its reference now."""
        with self._lock:
            mid = self._by_key.get(key)
            turn = self._turns.peek(mid) if mid is not None else None
            if turn is None:
                return
            self._tokens -= len(turn.tokens)
            turn.tokens = array("I", tokens)
            self._tokens += len(turn.tokens)

    def by_id(self, message_id: str, tenant: str | None) -> Turn | None:
        """The turn of that message id if it is ``tenant``'s (no oracle across tenants)."""
        with self._lock:
            turn = self._turns.peek(message_id)
            if turn is None or turn.tenant != tenant:
                return None
            return self._turns.get(message_id)

    def last(self, key: TurnKey) -> Turn | None:
        with self._lock:
            mid = self._by_key.get(key)
            return self._turns.peek(mid) if mid is not None else None


def compare(prev: Turn | None, fingerprint: Fingerprint, tokens: Sequence[int],
            message_starts: Sequence[int], roles: Sequence[str], decode: Any,
            body: Any = None) -> Divergence:
    """This request against ``prev`` (worker thread: reads tokens and decodes text)."""
    if prev is None:
        return NO_PREVIOUS
    n = len(tokens)
    reachable = max(0, min(len(prev.tokens) - 1, n - 1))
    position = common_prefix(prev.tokens, tokens)
    if position >= reachable:
        return Divergence(previous=True, reachable=reachable, position=position)
    idx = message_at(position, message_starts)
    lo = max(0, position - CONTEXT_TOKENS)
    try:
        common = str(decode(list(tokens[lo:position])))
        cached = str(decode(list(prev.tokens[position:position + CONTEXT_TOKENS])))
        request = str(decode(list(tokens[position:position + CONTEXT_TOKENS])))
    except Exception:  # text is a courtesy of the log line; never fails a request
        log.debug("cannot decode the text around a divergence", exc_info=True)
        common = cached = request = ""
    block = locate(common, request, body_texts(body)) if body is not None else None
    return Divergence(
        previous=True, reachable=reachable, position=position,
        changed=fingerprint.first_change(prev.fingerprint),
        message_index=idx, role=roles[idx] if idx is not None and idx < len(roles) else None,
        block=block, common_text=common, cached_text=cached, request_text=request)
