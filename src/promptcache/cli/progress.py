"""Progress bars for long command-line operations (rich) on stderr, only on a terminal
(``PROMPTCACHE_PROGRESS=0`` / ``1`` forces off / on), so stdout and logs stay clean:
``with progress_bar("importing") as bar: work(progress=bar)``, ``bar(done, total)``.
``StepLines``: a line when a long step starts and ends (``serve``'s startup)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

Callback = Callable[[int, int], None]


def enabled(stream: IO[str] | None = None) -> bool:
    forced = os.environ.get("PROMPTCACHE_PROGRESS")
    if forced in ("0", "1"):
        return forced == "1"
    s = stream if stream is not None else sys.stderr
    return bool(getattr(s, "isatty", lambda: False)())


def _noop(done: int, total: int) -> None:
    return None


@contextmanager
def progress_bar(description: str, stream: IO[str] | None = None) -> Iterator[Callback]:
    """A ``(done, total)`` callback drawing one bar (or a no-op off a terminal)."""
    if not enabled(stream):
        yield _noop
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = Console(file=stream if stream is not None else sys.stderr)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                  transient=False) as prog:
        task = prog.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            prog.update(task, completed=done, total=max(total, done))

        yield update


class StepLines:
    """``engine.steps.Steps`` as lines on stderr, terminal or not (``promptcache: <step>
    ...``, then ``done in 1.2s`` or ``failed after``). ``clock``: seconds."""

    def __init__(self, stream: IO[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.clock = clock

    def _print(self, line: str) -> None:
        print(f"promptcache: {line}", file=self.stream if self.stream is not None
              else sys.stderr, flush=True)

    @contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        self._print(f"{what} ...")
        start = self.clock()
        try:
            yield
        except BaseException:
            self._print(f"{what}: failed after {self.clock() - start:.1f}s")
            raise
        self._print(f"{what}: done in {self.clock() - start:.1f}s")
