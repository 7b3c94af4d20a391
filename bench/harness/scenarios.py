"""Deterministic benchmark scenarios S1..S5 and E1.

Every scenario is plain data: an ordered list of ``Turn`` requests, each carrying the
full message history in OpenAI chat format (the neutral form; ``client`` converts it to
Anthropic messages where a scenario runs over that API). Texts come from a seeded
word generator, so the same (name, quick, seed) always yields byte-identical requests.

Assistant replies in the history are scripted, not the model's output: every system
under test then sees byte-identical prompts, and the floor is the same for all of them.
Generated text is measured (TTFT, total time) and discarded.

E1 ("edit") asks for a given code file back with one identifier renamed: the reply is
mostly a copy of the prompt, what speculative decoding drafted from history
(``--speculation suffix``) is for; it carries its own output length (``max_tokens``).

Lengths are given in approximate tokens (``TOKENS_PER_WORD`` words -> tokens for a
BPE tokenizer on plain English); the real prompt sizes come back in ``usage``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

# new names go at the end: a scenario's seed stream is its index here
SCENARIO_NAMES = ("S1", "S2", "S3", "S4", "S5", "E1")
TOKENS_PER_WORD = 1.12  # measured with the SmolLM2 tokenizer on this vocabulary
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not "
    "which but all they one can has more were their there been if would will some when what "
    "time about into only other new these two may first any then could like also after well "
    "over such where most through back much before because good each those people state "
    "system cache model token layer memory block request server answer question value order "
    "result file function test build change update design value number string list table "
    "write read load store index search match prefix suffix context history message reply "
    "user agent tool call input output error retry check limit budget disk page queue thread "
    "lock batch chunk step turn round session tenant network client stream event data small "
    "large fast slow early late simple clear exact short long next last same different "
    "local remote shared private open close start stop keep drop move copy sort merge split"
).split()


@dataclass(frozen=True)
class Turn:
    """One request: the whole history of one conversation at that point."""

    conversation: int
    index: int  # turn number within its conversation, from 0
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()
    before: str | None = None  # "restart" | "kill": done to the server before this turn


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    api: str  # "openai" | "anthropic" (systems without it fall back to openai)
    turns: tuple[Turn, ...]
    # S3: the RAM budget as a fraction of the scenario's total KV bytes
    ram_budget_fraction: float | None = None
    # S5: report bytes held by the cache / unique KV bytes
    measure_bytes: bool = False
    # tokens generated per turn when ``--max-tokens`` is not given (None: the bench's default)
    max_tokens: int | None = None
    # E1: report decode speed (completion tokens / time after the first token)
    measure_decode: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def num_conversations(self) -> int:
        return len({t.conversation for t in self.turns})


class TextGen:
    """Seeded pseudo-English text of an approximate token length."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def words(self, n: int) -> list[str]:
        return [self._rng.choice(_WORDS) for _ in range(n)]

    def text(self, approx_tokens: int) -> str:
        n = max(1, round(approx_tokens / TOKENS_PER_WORD))
        words = self.words(n)
        out: list[str] = []
        i = 0
        while i < n:
            k = min(n - i, self._rng.randint(6, 16))
            sentence = " ".join(words[i : i + k])
            out.append(sentence[:1].upper() + sentence[1:] + ".")
            i += k
        return " ".join(out)

    def pick(self, n: int) -> int:
        """A number in [0, n)."""
        return self._rng.randrange(n)

    def ident(self, prefix: str) -> str:
        return f"{prefix}_{self._rng.randrange(16**8):08x}"


def _sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {
            "s1_turns": 3, "s1_user": 60, "reply": 24,
            "s2_system": 300, "s2_tools": 3, "s2_steps": 3, "s2_result": 80,
            "s3_convs": 4, "s3_turns": 2, "s3_user": 80,
            "s4_turns": 4, "s4_user": 60,
            "s5_convs": 8, "s5_system": 300, "s5_user": 30,
            "e1_functions": 6, "e1_max_tokens": 160,
        }  # fmt: skip
    return {
        "s1_turns": 10, "s1_user": 270, "reply": 80,
        "s2_system": 2500, "s2_tools": 8, "s2_steps": 8, "s2_result": 300,
        "s3_convs": 20, "s3_turns": 3, "s3_user": 250,
        "s4_turns": 6, "s4_user": 270,
        "s5_convs": 100, "s5_system": 2000, "s5_user": 40,
        "e1_functions": 32, "e1_max_tokens": 160,
    }  # fmt: skip


def build(name: str, *, quick: bool = False, seed: int = 0) -> Scenario:
    """The scenario ``name`` (S1..S5, E1); ValueError for an unknown name."""
    key = name.strip().upper()
    builders = {"S1": _s1, "S2": _s2, "S3": _s3, "S4": _s4, "S5": _s5, "E1": _e1}
    if key not in builders:
        raise ValueError(f"unknown scenario {name!r}; expected one of {', '.join(SCENARIO_NAMES)}")
    # each scenario has its own seed stream, so S1 does not change when S2 does
    return builders[key](_sizes(quick), TextGen(seed * 1000 + SCENARIO_NAMES.index(key)))


def parse_names(spec: str) -> list[str]:
    """'S1,s3' -> ['S1', 'S3'] (validated, order kept, duplicates dropped)."""
    out: list[str] = []
    for part in spec.split(","):
        part = part.strip().upper()
        if not part:
            continue
        if part not in SCENARIO_NAMES:
            raise ValueError(f"unknown scenario {part!r}; expected some of {','.join(SCENARIO_NAMES)}")
        if part not in out:
            out.append(part)
    if not out:
        raise ValueError("no scenario given")
    return out


def _chat(conv: int, n_turns: int, user_tokens: int, reply_tokens: int, g: TextGen,
          system: str) -> list[Turn]:
    """One chat conversation: turn k sends system + k (user, reply) pairs + a new user."""
    history: list[dict[str, Any]] = [{"role": "system", "content": system}]
    turns: list[Turn] = []
    for k in range(n_turns):
        history.append({"role": "user", "content": g.text(user_tokens)})
        turns.append(Turn(conversation=conv, index=k, messages=tuple(dict(m) for m in history)))
        history.append({"role": "assistant", "content": g.text(reply_tokens)})
    return turns


def _s1(sz: dict[str, int], g: TextGen) -> Scenario:
    system = "You are a helpful assistant. " + g.text(40)
    turns = _chat(0, sz["s1_turns"], sz["s1_user"], sz["reply"], g, system)
    new = sz["s1_user"] + sz["reply"]
    return Scenario("S1", f"{sz['s1_turns']}-turn chat (~{new} new tokens per turn)",
                    "openai", tuple(turns))


def _tool_defs(g: TextGen, n: int, desc_tokens: int) -> list[dict[str, Any]]:
    names = ["read_file", "write_file", "edit_file", "run_shell", "search_code", "list_dir",
             "web_fetch", "run_tests", "git_diff", "ask_user"]
    tools = []
    for i in range(n):
        name = names[i % len(names)] + ("" if i < len(names) else f"_{i}")
        tools.append({
            "type": "function",
            "function": {
                "name": name,
                "description": g.text(desc_tokens),
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": g.text(12)},
                        "argument": {"type": "string", "description": g.text(12)},
                    },
                    "required": ["path"],
                },
            },
        })
    return tools


def _s2(sz: dict[str, int], g: TextGen) -> Scenario:
    """An agentic trace: tool_use / tool_result steps; only the latest reasoning is kept."""
    n_tools = sz["s2_tools"]
    # the tool definitions come on top of the prose (templates without tool support drop them)
    tools = _tool_defs(g, n_tools, max(20, sz["s2_system"] // (3 * n_tools)))
    system = "You are a coding agent working in a repository. " + g.text(sz["s2_system"])
    task = {"role": "user", "content": "Task: " + g.text(120)}
    steps: list[tuple[dict[str, Any], dict[str, Any], str]] = []  # (assistant, tool, reasoning)
    turns: list[Turn] = []
    for k in range(sz["s2_steps"]):
        history: list[dict[str, Any]] = [{"role": "system", "content": system}, dict(task)]
        for j, (asst, tool, reasoning) in enumerate(steps):
            a = dict(asst)
            if j == len(steps) - 1:  # thinking-style template: earlier reasoning is dropped
                a["content"] = f"{THINK_OPEN}{reasoning}{THINK_CLOSE}\n{asst['content']}"
            history += [a, dict(tool)]
        turns.append(Turn(conversation=0, index=k, messages=tuple(history),
                          tools=tuple(tools)))
        fn = tools[k % n_tools]["function"]["name"]
        call_id = g.ident("call")
        asst = {
            "role": "assistant",
            "content": g.text(30),
            "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": fn,
                             "arguments": f'{{"path": "src/{g.ident("mod")}.py"}}'},
            }],
        }
        tool = {"role": "tool", "tool_call_id": call_id, "name": fn,
                "content": g.text(sz["s2_result"])}
        steps.append((asst, tool, g.text(60)))
    return Scenario(
        "S2", f"agentic trace over the Anthropic API ({sz['s2_steps']} tool steps, "
              f"~{sz['s2_system']}-token system prompt + {n_tools} tools)",
        "anthropic", tuple(turns),
        notes=("the latest assistant turn carries <think> reasoning; earlier turns drop it",),
    )


def _s3(sz: dict[str, int], g: TextGen) -> Scenario:
    convs = [
        _chat(c, sz["s3_turns"], sz["s3_user"], sz["reply"], g,
              f"You are assistant number {c}. " + g.text(30))
        for c in range(sz["s3_convs"])
    ]
    order = [convs[c][k] for k in range(sz["s3_turns"]) for c in range(sz["s3_convs"])]
    return Scenario("S3", f"{sz['s3_convs']} conversations interleaved round-robin, "
                          "RAM budget 1/4 of their total KV",
                    "openai", tuple(order), ram_budget_fraction=0.25)


def _s4(sz: dict[str, int], g: TextGen) -> Scenario:
    n = sz["s4_turns"]
    turns = _chat(0, n, sz["s4_user"], sz["reply"], g, "You are a helpful assistant. " + g.text(40))
    events = {max(1, n // 3): "restart", max(2, 2 * n // 3): "kill"}
    out = [Turn(t.conversation, t.index, t.messages, t.tools, events.get(t.index)) for t in turns]
    return Scenario("S4", f"{n}-turn chat with a clean restart (before turn {max(1, n // 3) + 1}) "
                          f"and a kill -9 (before turn {max(2, 2 * n // 3) + 1})",
                    "openai", tuple(out))


def _s5(sz: dict[str, int], g: TextGen) -> Scenario:
    system = "You are the support assistant of a software company. " + g.text(sz["s5_system"])
    turns = [
        Turn(conversation=c, index=0, messages=(
            {"role": "system", "content": system},
            {"role": "user", "content": g.text(sz["s5_user"])},
        ))
        for c in range(sz["s5_convs"])
    ]
    return Scenario("S5", f"{sz['s5_convs']} conversations sharing a ~{sz['s5_system']}-token "
                          "system prompt", "openai", tuple(turns), measure_bytes=True)


_E1_BODIES = (  # (return type, body lines); {t}: the identifier to rename
    ("list[int]", ("out: list[int] = []",
                   "for item in {t}.items[:limit]:",
                   "    if item.value > limit:",
                   "        out.append(item.value)",
                   "return out")),
    ("int", ("total = 0",
             "for key, value in {t}.values.items():",
             "    total += len(key) * value",
             "return total % (limit + 1)")),
    ("int", ("if {t} is None:",
             "    raise ValueError(\"no {t} given\")",
             "{t}.count = min({t}.count + 1, limit)",
             "return {t}.count")),
    ("int", ("seen = set()",
             "for name in sorted({t}.names):",
             "    if name not in seen and len(seen) < limit:",
             "        seen.add(name)",
             "return len(seen)")),
)


def _code_file(g: TextGen, n_functions: int, target: str) -> str:
    """A Python module whose every function takes and uses ``target``."""
    lines = ['"""' + g.text(16) + '"""', "", "from __future__ import annotations", "",
             "from typing import Any", ""]
    used: set[str] = set()
    for i in range(n_functions):
        name = "_".join(g.words(2))
        if name in used:
            name += f"_{i}"
        used.add(name)
        returns, body = _E1_BODIES[g.pick(len(_E1_BODIES))]
        lines += ["", f"def {name}({target}: Any, limit: int) -> {returns}:",
                  '    """' + g.text(10) + '"""']
        lines += ["    " + b.format(t=target) for b in body]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def edit_request(g: TextGen, n_functions: int) -> tuple[tuple[dict[str, Any], ...], str, str]:
    """E1's request (system + user): a ``n_functions``-function file to return with one
    identifier renamed; with the old and the new name."""
    old = "_".join(g.words(2)) + "_state"
    new = "_".join(g.words(2)) + "_record"
    code = _code_file(g, n_functions, old)
    user = (f"Return the following file with the identifier `{old}` renamed to `{new}` "
            "everywhere. Change nothing else; reply with the whole file in one Python "
            f"code block and no other text.\n\n```python\n{code}```")
    return ({"role": "system", "content": "You are a careful coding assistant."},
            {"role": "user", "content": user}), old, new


def _e1(sz: dict[str, int], g: TextGen) -> Scenario:
    """One turn: return a code file with one identifier renamed (greedy)."""
    messages, _, _ = edit_request(g, sz["e1_functions"])
    turn = Turn(conversation=0, index=0, messages=messages)
    return Scenario("E1", f"edit: a {sz['e1_functions']}-function file returned with one "
                          f"identifier renamed ({sz['e1_max_tokens']} tokens, greedy)",
                    "openai", (turn,), max_tokens=sz["e1_max_tokens"], measure_decode=True,
                    notes=("the reply copies the prompt: speculative decoding's case",))
