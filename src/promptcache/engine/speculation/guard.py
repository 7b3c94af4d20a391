"""Never slower, measured (``StepGuard``): per batch size, the tokens per second of the
last ``WINDOW`` verify steps, each timed whole, against plain decode steps; a size that
delivers less than ``1 - SLACK`` of decoding, or keeps being gated, decodes without
speculation for a while, doubling on each failed probe. Only with the measured cost."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# verify steps of one batch size judged together
WINDOW = 4
# verifying must deliver at least this share of decoding's tokens per second less this
SLACK = 0.02
OFF_STEPS = 32
MAX_OFF_STEPS = 1024
# gated steps in a row that pause a batch size, and for how long
GATED_RUN = 2
GATED_OFF_STEPS = 4
MAX_GATED_OFF_STEPS = 64
# ... and for steps whose rows found no draft: a copy that starts during the pause
# starts being verified at most this many steps late
MAX_IDLE_OFF_STEPS = 16


@dataclass
class _Size:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    off_left: int = 0
    last_off: int = 0
    gated_run: int = 0
    last_gated_off: int = 0


class StepGuard:
    """Per batch size: speculation allowed or paused, from measured tokens per second
    (module docstring). ``decode_seconds(rows, context)``: a plain decode step of
    ``rows`` rows over ``context`` tokens."""

    def __init__(self, decode_seconds: Callable[[int, int], float]) -> None:
        self._decode_seconds = decode_seconds
        self._sizes: dict[int, _Size] = {}
        self.turned_off = 0
        self.gated_off = 0

    def allows(self, rows: int) -> bool:
        """Whether a batch of ``rows`` rows may speculate this step (a paused size
        counts the step)."""
        s = self._sizes.get(rows)
        if s is None or s.off_left <= 0:
            return True
        s.off_left -= 1
        return False

    def observe_step(self, rows: int, tokens: int, seconds: float, context: int = 0
                     ) -> None:
        """A verify step of ``rows`` rows over ``context`` tokens gave ``tokens`` tokens
        in ``seconds``."""
        if rows <= 0 or seconds <= 0:
            return
        s = self._sizes.setdefault(rows, _Size())
        s.gated_run, s.last_gated_off = 0, 0
        s.tokens += tokens
        s.seconds += seconds
        s.steps += 1
        if s.steps < WINDOW:
            return
        verify_rate = s.tokens / s.seconds
        decode_rate = rows / self._decode_seconds(rows, context)
        s.tokens, s.seconds, s.steps = 0, 0.0, 0
        if verify_rate >= (1.0 - SLACK) * decode_rate:
            s.last_off = 0
            return
        s.last_off = min(MAX_OFF_STEPS, 2 * s.last_off) if s.last_off else OFF_STEPS
        s.off_left = s.last_off
        self.turned_off += 1

    def observe_gated(self, rows: int, *, cap: int = MAX_GATED_OFF_STEPS) -> None:
        """A step of ``rows`` rows had drafts and the gate decoded as usual, or (``cap``
        ``MAX_IDLE_OFF_STEPS``) found no draft."""
        s = self._sizes.setdefault(rows, _Size())
        s.gated_run += 1
        if s.gated_run < GATED_RUN:
            return
        s.gated_run = 0
        s.last_gated_off = min(cap, 2 * s.last_gated_off) \
            if s.last_gated_off else GATED_OFF_STEPS
        s.off_left = max(s.off_left, s.last_gated_off)
        self.gated_off += 1

    def paused(self) -> dict[int, int]:
        """Batch sizes paused now -> the steps left."""
        return {n: s.off_left for n, s in sorted(self._sizes.items()) if s.off_left > 0}
