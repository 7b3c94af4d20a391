"""`promptcache serve | bench | cache ... | model ...`: wires the subcommands, each a
module with ``register(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .. import __version__

_COMMANDS = ("serve_cmd", "model_cmd", "cache_cmd", "bench_cmd")


DESCRIPTION = """\
A local OpenAI- and Anthropic-compatible server (MLX) whose prompt cache keeps every
conversation's prefix in RAM, on the SSD and optionally in Redis, so each turn costs
only its new tokens.

  promptcache serve                      serve the embedded default model on :8080
  promptcache serve --model PATH_OR_ID   serve an MLX model (a folder or a Hugging Face id)
  promptcache cache stats                what the SSD cache holds
  promptcache model prepare              fetch and convert the embedded default model

`promptcache COMMAND --help` lists a command's options; docs/cli.md lists them all."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="promptcache", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command; ``argv=None``: this process's (re-executed with OpenBLAS on Linux)."""
    if argv is None:
        from .openblas import reexec_with_openblas

        reexec_with_openblas()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:
        print(f"promptcache: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
