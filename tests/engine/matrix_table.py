"""The architecture matrix table of docs/cache.md, generated from the tiny models.

Run ``PYTHONPATH=src python tests/engine/matrix_table.py`` to print it; the test
``test_matrix.test_readme_table_is_generated`` checks docs/cache.md holds it between
``<!-- matrix:start -->`` and ``<!-- matrix:end -->``. The cache columns come from the
model classes themselves (``make_prompt_cache`` after a one-token forward), the
batching and restore columns from the engine's own rules (``mlx_compat.can_batch*``,
``adapters.is_truncatable``), the last column from the matrix's known failures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

START = "<!-- matrix:start -->"
END = "<!-- matrix:end -->"


def _leaf(c: Any) -> str:
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    if isinstance(c, CacheList):
        return "CacheList(" + ", ".join(_leaf(x) for x in c.caches) + ")"
    if isinstance(c, RotatingKVCache):
        return f"Rotating({c.max_size}" + (f", keep {c.keep}" if c.keep else "") + ")"
    if isinstance(c, KVCache):
        k, v = c.state[0], c.state[1]
        kw, vw = int(k.shape[-1]), int(v.shape[-1])
        return "KV" if kw == vw else f"MLA KV (K {kw} / V {vw})"
    if isinstance(c, ArraysCache):
        return "Arrays"
    return type(c).__name__


def _run_length(kinds: Sequence[str]) -> str:
    parts: list[list[Any]] = []
    for k in kinds:
        if parts and parts[-1][0] == k:
            parts[-1][1] += 1
        else:
            parts.append([k, 1])
    return ", ".join(k if n == 1 else f"{k} ×{n}" for k, n in parts)


def family_row(family: str) -> dict[str, str]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from models import tiny_families as tf

    from promptcache.engine import mlx_compat
    from promptcache.engine.payload import adapters

    config = tf.family_config(family)
    model_cls, args_cls = mlx_compat.model_classes(config["model_type"])
    model = model_cls(args_cls.from_dict(config))
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([[1]]), cache=caches))
    return {
        "cache": _run_length([_leaf(c) for c in caches]),
        "prefill": "yes" if mlx_compat.can_batch_prefill(caches, model) else "no",
        "decode": "yes" if mlx_compat.can_batch(caches) else "no",
        "restore": "any token" if adapters.is_truncatable(caches)
        else "state snapshots",
    }


def matrix_table(known: Mapping[tuple[str, str], str], points: Sequence[str]) -> str:
    """The markdown table: one row per family of ``tiny_families.FAMILIES``."""
    from models import tiny_families as tf

    lines = [
        "| Family | Tiny model keeps | Cache per layer | Batched prefill | Batched decode "
        "| Restore at | Tool calls (its template) | Matrix today |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for family in tf.FAMILIES:
        row = family_row(family)
        failing = [p for p in points if (family, p) in known]
        today = (f"{len(points)}/{len(points)} pass" if not failing else
                 f"{len(points) - len(failing)}/{len(points)} pass; xfail: "
                 + ", ".join(failing))
        lines.append(
            f"| `{family}` | {tf.STRUCTURES[family]} | {row['cache']} | {row['prefill']} "
            f"| {row['decode']} | {row['restore']} | {tf.TOOL_FORMATS[family]} | {today} |")
    return "\n".join(lines) + "\n"


def readme_table(readme_text: str) -> str:
    """What docs/cache.md holds between the markers."""
    start = readme_text.index(START) + len(START)
    return readme_text[start:readme_text.index(END, start)].strip("\n") + "\n"


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tiny models
    import test_matrix

    print(matrix_table(test_matrix.KNOWN_FAILURES, test_matrix.POINTS), end="")
