"""`promptcache cache export | import`: cache packs (``packs.py``) of an SSD folder for
``--model``; only the model's identity is opened, and import verifies the whole pack
first (a running server's RAM: over HTTP)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import packfile, packs
from ..config import CacheConfig, SSDConfig
from ..meta import DEFAULT_TENANT
from ..options import add_options, from_args
from .progress import StepLines, progress_bar

if TYPE_CHECKING:
    from ..engine.identity import ModelIdentity


def register(csub: Any, add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    ex = add("export", "write a portable pack of cached blocks")
    what = ex.add_mutually_exclusive_group(required=True)
    what.add_argument("--session", help="the blocks of this session")
    what.add_argument("--tenant", help="every block of this tenant")
    what.add_argument("--conversation", type=Path,
                      help='JSON file: {"messages": [...]} or {"tokens": [...]}')
    ex.add_argument("--session-tenant", default=DEFAULT_TENANT,
                    help="the tenant of --session / --conversation (default: default)")
    ex.add_argument("-o", "--output", type=Path, required=True, help="the pack file to write")
    imp = add("import", "verify a pack and add its blocks to the cache")
    imp.add_argument("pack", type=Path)
    for p in (ex, imp):
        p.add_argument("--model", default=None,
                       help="model folder (or repo id) of the blocks, as serve's --model "
                            "(default: the embedded default model)")
        # the settings that make the blocks' namespace, as serve takes them
        add_options(p, CacheConfig, only=NAMESPACE_FIELDS)
        p.set_defaults(func=run)


NAMESPACE_FIELDS = ("block_size", "kv_bits", "kv_group_size", "kv_quant_min_tokens")


def open_model(model: str | None, config: CacheConfig) -> ModelIdentity:
    """The identity of the blocks' model (``serve``'s resolution of ``--model``)."""
    from ..engine.identity import open_identity
    from .serve_config import resolve_model

    steps = StepLines()
    return open_identity(resolve_model(model, steps), config, steps=steps)


def _conversation_tokens(path: Path, model: ModelIdentity) -> list[int]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the conversation {path}: {e}") from e
    if isinstance(doc, dict) and isinstance(doc.get("tokens"), list):
        return [int(t) for t in doc["tokens"]]
    if isinstance(doc, dict) and isinstance(doc.get("messages"), list):
        msgs = doc["messages"]
        gen = not (msgs and msgs[-1].get("role") == "assistant")
        return model.render_chat(msgs, tools=doc.get("tools"), add_generation_prompt=gen)
    raise ValueError(f'{path}: expected {{"messages": [...]}} or {{"tokens": [...]}}')


def run(args: argparse.Namespace) -> int:
    from ..cache import PromptCache
    from ..tiers.ssd import SSDTier

    cache_dir: Path = args.cache_dir
    if args.cache_command == "import":
        with progress_bar("verifying the pack") as bar:
            pack = packfile.read_pack(args.pack, progress=bar)
    if args.cache_command == "import":
        try:  # as serve does: an import is what fills a new folder
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create the cache folder {cache_dir}: {e}") from e
    elif not cache_dir.is_dir():
        raise ValueError(f"cache folder {cache_dir} does not exist")
    tenant = pack.namespace.tenant if args.cache_command == "import" else (
        args.tenant or args.session_tenant)
    config = from_args(CacheConfig, args, ram_budget_bytes=0)
    model = open_model(args.model, config)
    ns = model.namespace(tenant)
    tier = SSDTier(SSDConfig(path=cache_dir))
    if args.cache_command == "import":
        try:
            with progress_bar("importing") as bar:
                report = packs.import_into_tier(tier, pack, ns, progress=bar)
        finally:
            tier.close()
        print(json.dumps({**report.to_dict(), "tenant": tenant}))
        return 0
    cache = PromptCache(config, lower=[tier])
    try:
        tokens = _conversation_tokens(args.conversation, model) if args.conversation else None
        with progress_bar("collecting blocks") as bar:
            blocks = packs.collect(cache, ns, tokens=tokens, session_id=args.session,
                                   progress=bar)
        selection: dict[str, Any] = (
            {"conversation_tokens": len(tokens)} if tokens is not None else
            {"session_id": args.session} if args.session else {"tenant": tenant})
        with progress_bar("writing the pack") as bar:
            summary = packfile.write_pack(args.output, ns, blocks, selection, progress=bar)
    finally:
        cache.close(persist=False)
    print(json.dumps({**summary, "tenant": tenant, "pack": str(args.output)}))
    if not blocks:
        print("promptcache: nothing matched: the pack is empty", file=sys.stderr)
    return 0
