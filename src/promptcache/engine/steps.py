"""Named long steps (fetch, conversion, fingerprint, weight load, the speculation cost
fit): ``with steps("loading the weights"): ...``. The caller decides what a step shows
(``cli/progress.StepLines`` prints a line when it starts and when it ends, with its
seconds); the library only names them. ``no_steps`` shows nothing."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

Steps = Callable[[str], AbstractContextManager[object]]


def no_steps(what: str) -> AbstractContextManager[object]:
    return nullcontext()
