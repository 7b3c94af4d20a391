"""The architecture matrix: every family users run, in process (Engine + PromptCache).

For each tiny model of ``tiny_families`` one scenario runs once (``_run_family``), on
an engine over RAM + an SSD tier (write-back: the close persists every RAM block):

- a sequential 3-turn chat whose turns each add 1-3 chunks of tokens, replies sent
  back as assistant messages (re-tokenized by the family's chat template);
- 4 concurrent 2-turn conversations;
- a branch that shares a long prefix with an earlier prompt;
- an exact repeat of a prompt;
- a restart: a fresh engine over the same SSD folder runs the sequential chat's 4th turn.

The next turns of the sequential chat and of the concurrent conversations continue from
their live state (``engine/payload/live.py``: the previous turn's caches, kept as the model's own
objects; nothing restored), and so does the branch where every layer can be trimmed; the
repeat and the restart restore from blocks.

Each prompt ends where the family's template writes the text of the reply that follows
(``_prompt``): the tiny models write only words, while a real model writes what its
template puts before the answer itself (harmony's ``<|channel|>final<|message|>``), or
reasoning that the template drops from earlier replies (an open ``<think>``).

Every reply is compared with a full prefill (``use_cache=False``) of the same prompt:
greedy tokens identical, logits within float32 noise (``TOL``, relative) at every step.
The tests below read the recorded run, one point each, so a known failure is marked
``xfail(strict=True)`` on exactly the point that fails (``KNOWN_FAILURES``).
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matrix_table import matrix_table, readme_table
from models.tiny_families import (
    FAMILIES,
    ensure_family_model,
    word_token_ids,
)

from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig, SSDConfig
from promptcache.engine import mlx_compat
from promptcache.engine.api import GenerationRequest, SamplingParams
from promptcache.engine.engine import Engine
from promptcache.engine.formats.templates import message_starts
from promptcache.serving_config import EngineConfig

BLOCK = 8
CHUNK = 16
REPLY = 6  # max_tokens of every reply
TOL = 1e-4  # relative |logits of a restored prefill - of a full one|: float32 noise
SYSTEM = "You are a tiny model."

POINTS = ("retokenize", "equal", "sequential", "concurrent", "branch", "repeat",
          "store_errors", "ssd_restart", "live")

# (family, point) -> the known bug; each is xfail(strict=True) on that point only: a
# point that starts passing turns the test red, and its entry goes
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


def families_for(point: str) -> list[Any]:
    out = []
    for f in FAMILIES:
        reason = KNOWN_FAILURES.get((f, point))
        marks = ([pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)]
                 if reason else [])
        out.append(pytest.param(f, marks=marks, id=f))
    return out


@dataclass
class Turn:
    prompt: list[int]
    starts: tuple[int, ...]  # where each message starts (token index)
    tokens: list[int]
    ref: list[int]  # greedy tokens of a full prefill
    cached: int
    by_tier: dict[str, int]
    logits: list[np.ndarray] = field(default_factory=list)  # one per sampling step
    # the largest |logits - the full prefill's logits| / max(1, |the full prefill's|)
    max_delta: float = 0.0


@dataclass
class Run:
    family: str
    truncatable: bool
    sequential: list[Turn] = field(default_factory=list)
    # (the ids the next prompt holds where the reply went, prompt + reply ids)
    retokenized: list[tuple[list[int], list[int]]] = field(default_factory=list)
    concurrent: list[list[Turn]] = field(default_factory=list)
    branch_base: Turn | None = None
    branch: Turn | None = None
    repeat: Turn | None = None
    restart: Turn | None = None
    counters: list[dict[str, int]] = field(default_factory=list)


def _words(rng: random.Random, n: int, vocab: list[str]) -> str:
    return " ".join(rng.choice(vocab) for _ in range(n))


class _Logits:
    """The engine's logits hook: the last-position logits of every step, per request."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[np.ndarray]] = defaultdict(list)
        self.ids = itertools.count()

    def __call__(self, request_id: str, step: int, logits: np.ndarray) -> None:
        self.by_request[request_id].append(np.asarray(logits, dtype=np.float32).reshape(-1))


ANSWER = "ANSWERHERE"  # where the template writes a reply's text


def _prompt(eng: Engine, msgs: list[dict[str, str]]) -> tuple[list[int], tuple[int, ...]]:
    """(tokens, message starts) of the prompt of the reply to ``msgs``: the messages and a
    reply, followed by a user turn, rendered by the family's template and cut where the
    reply's text starts (see the module docstring). Call it while no request runs (the
    tokenizer is not shared between threads)."""
    text = eng.tokenizer.apply_chat_template(
        [*msgs, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "next"}],
        tokenize=False, add_generation_prompt=False)
    assert isinstance(text, str) and text.count(ANSWER) == 1
    cut = text[:text.index(ANSWER)]
    encoded = mlx_compat.encode_with_offsets(eng.tokenizer, cut)
    assert encoded is not None
    ids, offsets = encoded
    return [int(t) for t in ids], message_starts(cut, offsets, msgs)


def _generate_many(eng: Engine, rec: _Logits, convs: list[list[dict[str, str]]],
                   use_cache: bool = True) -> list[Turn]:
    """Submit every conversation's prompt at once (they run concurrently), then wait."""
    handles, prompts = [], []
    rendered = [_prompt(eng, msgs) for msgs in convs]
    for tokens, starts in rendered:
        rid = f"matrix-{next(rec.ids)}"
        prompts.append((list(tokens), starts, rid))
        req = GenerationRequest(prompt_tokens=tuple(tokens),
                                sampling=SamplingParams(max_tokens=REPLY),
                                use_cache=use_cache, message_starts=starts, request_id=rid)
        handles.append(eng.submit(req))
    out = []
    for (prompt, starts, rid), h in zip(prompts, handles, strict=True):
        r = h.result()
        assert r.finish_reason == "length", r
        out.append(Turn(prompt, starts, list(r.tokens), [], r.usage.cached_tokens,
                        dict(r.usage.cached_by_tier), rec.by_request.pop(rid)))
    return out


def _turns(eng: Engine, convs: list[list[dict[str, str]]]) -> list[Turn]:
    """Cached turns, then each prompt's full prefill for reference."""
    rec = eng.matrix_logits  # type: ignore[attr-defined]
    turns = _generate_many(eng, rec, convs)
    for t, ref in zip(turns, _generate_many(eng, rec, convs, use_cache=False), strict=True):
        t.ref = ref.tokens
        assert len(t.logits) == len(ref.logits) == REPLY
        # relative to the logits' size: float32 noise grows with them
        t.max_delta = max(float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))
                          for a, b in zip(t.logits, ref.logits, strict=True))
        t.logits = []
    return turns


def _reply(run: Run, eng: Engine, msgs: list[dict[str, str]], turn: Turn, user: str
           ) -> list[dict[str, str]]:
    """The next turn's messages: the reply as the assistant's text, then ``user``;
    records how the reply re-tokenizes."""
    nxt = [*msgs, {"role": "assistant", "content": eng.tokenizer.decode(turn.tokens)},
           {"role": "user", "content": user}]
    n = len(turn.prompt) + len(turn.tokens)
    rendered = _prompt(eng, nxt)[0]
    run.retokenized.append((list(rendered[:n]), turn.prompt + turn.tokens))
    return nxt


def _engine(path: Path, ssd: Path) -> Engine:
    cc = CacheConfig(block_size=BLOCK, ram_budget_bytes=64 * 1024**2)
    # segment files, serve's default layout (a restored run is one span of the mapping)
    sc = SSDConfig(path=ssd, policy="write_back", fsync=False, segment_bytes=1 << 20)
    rec = _Logits()
    eng = Engine.load(path, EngineConfig(restore_plan="load", prefill_chunk_tokens=CHUNK, snapshot_every_blocks=1),
                      cc, cache=build_cache(cc, sc), logits_hook=rec)
    eng.matrix_logits = rec  # type: ignore[attr-defined]
    return eng


def _run_family(family: str, path: Path, ssd: Path) -> Run:
    from mlx_lm.models.cache import make_prompt_cache

    from promptcache.engine.payload import adapters

    rng = random.Random(f"matrix-{family}")
    eng = _engine(path, ssd)
    vocab = [eng.tokenizer.decode([t]).strip() for t in word_token_ids()]
    run = Run(family, adapters.is_truncatable(make_prompt_cache(eng.model)))
    try:
        # sequential: user turns of 2, 1, 3 chunks of words (one token each)
        msgs = opening = [{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": _words(rng, 2 * CHUNK, vocab)}]
        for n_chunks in (1, 3):
            turn = _turns(eng, [msgs])[0]
            run.sequential.append(turn)
            msgs = _reply(run, eng, msgs, turn, _words(rng, n_chunks * CHUNK, vocab))
        run.sequential.append(_turns(eng, [msgs])[0])
        restart_msgs = _reply(run, eng, msgs, run.sequential[-1], _words(rng, CHUNK, vocab))
        # 4 concurrent conversations, 2 turns each
        convs = [[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": f"conversation {i}: "
                   + _words(rng, (i % 3 + 1) * CHUNK, vocab)}] for i in range(4)]
        first = _turns(eng, convs)
        convs = [_reply(run, eng, c, t, _words(rng, CHUNK, vocab))
                 for c, t in zip(convs, first, strict=True)]
        run.concurrent = [first, _turns(eng, convs)]
        # a branch: [system, A, B] then [system, A, B'] (the client edits its last
        # message); A is lengthened until B starts between two chunk ends, so the
        # message boundary is not a chunk snapshot
        long_words = [rng.choice(vocab) for _ in range(5 * CHUNK + 15)]
        last = _words(rng, 4, vocab)
        for n in range(5 * CHUNK, 5 * CHUNK + 16):
            base = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": " ".join(long_words[:n])},
                    {"role": "user", "content": last}]
            if 2 <= _prompt(eng, base)[1][2] % CHUNK <= 8:
                break
        run.branch_base = _turns(eng, [base])[0]
        other = [*base[:2], {"role": "user", "content": "branch " + _words(rng, 6, vocab)}]
        run.branch = _turns(eng, [other])[0]
        # an exact repeat of the first prompt of the sequential chat
        run.repeat = _turns(eng, [opening])[0]
        run.counters.append(eng.engine_stats())
    finally:
        eng.close()
    eng = _engine(path, ssd)  # a restart over the same SSD folder
    try:
        run.restart = _turns(eng, [restart_msgs])[0]
        run.counters.append(eng.engine_stats())
    finally:
        eng.close()
    return run


@pytest.fixture(scope="module")
def matrix(models_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """``family -> Run``: each family's scenario runs once per module."""
    runs: dict[str, Run] = {}

    def get(family: str) -> Run:
        if family not in runs:
            path = ensure_family_model(family, models_root)
            runs[family] = _run_family(family, path, tmp_path_factory.mktemp(f"ssd-{family}"))
        return runs[family]

    return get


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _all_turns(run: Run) -> list[Turn]:
    turns = [*run.sequential, *run.concurrent[0], *run.concurrent[1]]
    return turns + [t for t in (run.branch_base, run.branch, run.repeat, run.restart) if t]


def _assert_next_turn_reuses(prev: Turn, turn: Turn) -> None:
    """The next turn restores the previous prompt + its reply but the reply's last token
    (never run through the model): the end-of-generation save, a snapshot for every
    cache kind."""
    assert turn.prompt[: len(prev.prompt) + len(prev.tokens)] == prev.prompt + prev.tokens
    assert turn.cached / (len(prev.prompt) + len(prev.tokens)) >= 0.95
    n = len(prev.prompt) + len(prev.tokens)
    # n with a full window's live state (test_next_turns_continue_from_the_live_state)
    assert turn.cached in (n - 1, n)


@pytest.mark.parametrize("family", families_for("retokenize"))
def test_replies_are_whole_words_that_retokenize(matrix: Callable[[str], Run], family: str
                                                 ) -> None:
    run = matrix(family)
    words = set(word_token_ids())
    assert all(t in words for turn in _all_turns(run) for t in turn.tokens)
    assert len(run.retokenized) == 7  # 3 sequential replies + 4 concurrent ones
    for rendered, sent in run.retokenized:
        assert rendered == sent


@pytest.mark.parametrize("family", families_for("equal"))
def test_greedy_equals_full_prefill(matrix: Callable[[str], Run], family: str) -> None:
    turns = _all_turns(matrix(family))
    assert len(turns) == 3 + 8 + 2 + 1 + 1
    for turn in turns:
        assert len(turn.tokens) == REPLY
        assert turn.tokens == turn.ref
    assert max(t.max_delta for t in turns) <= TOL


@pytest.mark.parametrize("family", families_for("sequential"))
def test_sequential_turns_reuse_the_previous_turn(matrix: Callable[[str], Run], family: str
                                                  ) -> None:
    run = matrix(family)
    first, second, third = run.sequential
    assert first.cached == 0
    _assert_next_turn_reuses(first, second)
    _assert_next_turn_reuses(second, third)
    # each turn added 1-3 chunks past the previous prompt + reply
    assert [(len(b.prompt) - len(a.prompt) - REPLY) // CHUNK for a, b in
            ((first, second), (second, third))] == [1, 3]


@pytest.mark.parametrize("family", families_for("concurrent"))
def test_concurrent_conversations_reuse_their_own_turn(matrix: Callable[[str], Run],
                                                       family: str) -> None:
    run = matrix(family)
    first, second = run.concurrent
    for prev, turn in zip(first, second, strict=True):
        _assert_next_turn_reuses(prev, turn)


@pytest.mark.parametrize("family", families_for("branch"))
def test_branch_reuses_the_shared_prefix(matrix: Callable[[str], Run], family: str) -> None:
    run = matrix(family)
    base, branch = run.branch_base, run.branch
    assert base is not None and branch is not None
    boundary = branch.starts[2]  # the edited message starts here
    lcp = _lcp(base.prompt, branch.prompt)
    assert lcp >= 5 * CHUNK and boundary <= lcp < boundary + CHUNK // 2
    assert 2 <= boundary % CHUNK <= 8  # not a chunk end
    if run.truncatable:
        assert branch.cached == lcp
    else:  # the state snapshot at the edited message's start
        assert branch.cached == boundary


@pytest.mark.parametrize("family", families_for("repeat"))
def test_exact_repeat_reuses_all_but_the_last_token(matrix: Callable[[str], Run],
                                                    family: str) -> None:
    run = matrix(family)
    repeat, first = run.repeat, run.sequential[0]
    assert repeat is not None and repeat.prompt == first.prompt
    n = len(repeat.prompt)
    if run.truncatable:
        assert repeat.cached == n - 1  # the last token re-runs for its logits
    else:  # the last chunk snapshot before it (the end-of-prompt one is at n)
        assert (n - 1) // CHUNK * CHUNK <= repeat.cached <= n - 1


@pytest.mark.parametrize("family", families_for("store_errors"))
def test_no_store_errors(matrix: Callable[[str], Run], family: str) -> None:
    run = matrix(family)
    assert len(run.counters) == 2  # the first engine and the restarted one
    for c in run.counters:
        assert (c["store_errors"], c["restore_errors"], c["cache_errors"], c["errors"]
                ) == (0, 0, 0, 0)


@pytest.mark.parametrize("family", families_for("ssd_restart"))
def test_restarted_engine_hits_the_ssd(matrix: Callable[[str], Run], family: str) -> None:
    run = matrix(family)
    assert run.restart is not None
    _assert_next_turn_reuses(run.sequential[-1], run.restart)
    assert run.restart.by_tier == {"ssd": run.restart.cached}


@pytest.mark.parametrize("family", families_for("live"))
def test_next_turns_continue_from_the_live_state(matrix: Callable[[str], Run], family: str
                                                 ) -> None:
    """Where the live state serves (the tokens each turn took are checked above, its
    greedy tokens and logits against a full prefill by ``test_greedy_equals_full_prefill``)."""
    run = matrix(family)
    first, second, third = run.sequential
    assert first.by_tier == {}
    # a full sliding window cannot give back the reply's last token (fed by the step in
    # flight when the reply ended): its state is kept with it, and the next turn, which
    # holds it too, takes one token more than the blocks would give
    windowed = family in ("gemma3_text", "gpt_oss")
    for prev, turn in ((first, second), (second, third),
                       *zip(run.concurrent[0], run.concurrent[1], strict=True)):
        assert turn.by_tier == {"live": turn.cached}  # the next turns, alone and batched
        assert turn.cached == len(prev.prompt) + len(prev.tokens) - 1 + int(windowed)
    for turn in run.concurrent[0]:  # a new conversation takes no other's state
        assert "live" not in turn.by_tier
    base, branch, repeat = run.branch_base, run.branch, run.repeat
    assert base is not None and branch is not None and repeat is not None
    # the branch trims the base's state where every layer can be trimmed; an array state
    # (SSM) or a full window cannot be: the blocks serve it (its snapshot)
    trims = run.truncatable and family not in ("gemma3_text", "gpt_oss")
    assert ("live" in branch.by_tier) is trims
    assert repeat.by_tier.get("live", 0) == 0  # the first turn's state went on to turn 2
    c = run.counters[0]
    assert c["live_taken"] == 2 + 4 + int(trims)
    assert c["live_trimmed"] == int(trims)
    assert c["live_errors"] == c["live_not_kept"] == 0
    assert c["live_kept"] == 3 + 8 + 3  # every reply: sequential, concurrent, the rest
    assert run.counters[1]["live_taken"] == 0  # the restarted engine has none


def test_readme_table_is_generated() -> None:
    """docs/cache.md's matrix table is the generated one (regenerate with
    ``PYTHONPATH=src:tests/engine python tests/engine/matrix_table.py``)."""
    readme = Path(__file__).resolve().parents[2] / "docs" / "cache.md"
    assert readme_table(readme.read_text()) == matrix_table(KNOWN_FAILURES, POINTS)


def test_family_builds_are_deterministic(tmp_path: Path) -> None:
    """The on-disk cache is keyed by a version only: two builds give the same bytes."""
    from models.tiny_families import build_family_model

    a = build_family_model("kimi_linear", tmp_path / "a")
    b = build_family_model("kimi_linear", tmp_path / "b")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_quantized_family_loads_with_4bit_weights(models_root: Path) -> None:
    import mlx.nn as nn
    from mlx_lm import load

    model, _ = load(str(ensure_family_model("qwen3_4bit", models_root)))
    quantized = [m for _, m in model.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    # q, k, v, o, gate, up, down x 2 layers + the embedding + the lm head
    assert len(quantized) == 7 * 2 + 2
    assert {(m.bits, m.group_size) for m in quantized} == {(4, 32)}
