"""The concurrent benchmark plans: each scenario's streams and requests (``build``).

The scenarios themselves (C1, C2, E2, E3, E4) are described in ``concurrency``, which
runs these plans against the systems.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .scenarios import THINK_CLOSE, THINK_OPEN, TextGen, _code_file, _tool_defs, edit_request
from .tool_template import TOOLS_TEMPLATE

# new names go at the end: a plan's seed stream is its index here
CONCURRENT_NAMES = ("C1", "C2", "E2", "E3", "E4", "E5")
# the speculation plans (decode-bound, greedy; run only when named)
SPEC_NAMES = ("E2", "E3", "E4", "E5")
DEFAULT_CONCURRENT = ("C1", "C2")
SPEC_STREAMS = (1, 8)
STREAM_COUNTS = (1, 4, 8, 16)

Messages = tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Job:
    """One request of a concurrent round: its stream and its full history."""

    stream: int
    index: int
    messages: Messages
    tools: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class ConcurrentPlan:
    name: str
    title: str
    api: str
    # C1: one round per entry (all jobs of a round at once); C2: one round of
    # conversations whose turns run in order within a conversation
    rounds: tuple[tuple[tuple[Job, ...], ...], ...]
    labels: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    # tokens generated per request when ``--max-tokens`` is not given (None: the default)
    max_tokens: int | None = None
    # a chat template every system is started with (None: the model's own)
    chat_template: str | None = None


def _sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"prompt": 60, "output": 8, "system": 200, "tools": 2, "steps": 2, "result": 40,
                "counts": 2, "functions": 3, "spec_output": 32, "spec_streams": 2, "spec_tool_desc": 8}
    return {"prompt": 200, "output": 64, "system": 1500, "tools": 6, "steps": 3, "result": 200,
            "counts": len(STREAM_COUNTS), "functions": 12, "spec_output": 160,
            "spec_streams": SPEC_STREAMS[-1], "spec_tool_desc": 24}


def build(name: str, *, quick: bool = False, seed: int = 0,
          streams: Sequence[int] | None = None) -> ConcurrentPlan:
    """``streams``: C1's stream counts, one round each (default 1/4/8/16; --quick 1/4)."""
    key = name.strip().upper()
    sz = _sizes(quick)
    g = TextGen(seed * 1000 + 100 + CONCURRENT_NAMES.index(key)) if key in CONCURRENT_NAMES \
        else None
    if key == "C1" and g is not None:
        counts = STREAM_COUNTS[: sz["counts"]] if not quick else (1, 4)
        if streams:
            counts = tuple(streams)
        rounds = []
        for n in counts:
            jobs = []
            for s in range(n):
                msgs = ({"role": "system", "content": f"You are writer number {s}."},
                        {"role": "user", "content": "Write a long, detailed story that continues "
                                                    "this text: " + g.text(sz["prompt"])})
                jobs.append((Job(s, 0, msgs),))
            rounds.append(tuple(jobs))
        return ConcurrentPlan(
            "C1", f"{'/'.join(str(n) for n in counts)} concurrent streams (~{sz['prompt']}-token prompts, "
                  f"{sz['output']} output tokens each)", "openai", tuple(rounds),
            labels=tuple(str(n) for n in counts))
    if key == "C2" and g is not None:
        tools = tuple(_tool_defs(g, sz["tools"], max(20, sz["system"] // (3 * sz["tools"]))))
        system = "You are a coding agent working in a repository. " + g.text(sz["system"])
        convs = []
        for c in range(4):
            role = "main agent" if c == 0 else f"subagent {c}"
            task = {"role": "user", "content": f"[{role}] Task: " + g.text(100)}
            history: list[dict[str, Any]] = [{"role": "system", "content": system}, task]
            turns = []
            for k in range(sz["steps"]):
                turns.append(Job(c, k, tuple(dict(m) for m in history), tools))
                fn = tools[k % len(tools)]["function"]["name"]
                call = g.ident("call")
                history.append({
                    "role": "assistant",
                    "content": f"{THINK_OPEN}{g.text(40)}{THINK_CLOSE}\n{g.text(20)}",
                    "tool_calls": [{"id": call, "type": "function", "function": {
                        "name": fn, "arguments": f'{{"path": "src/{g.ident("mod")}.py"}}'}}]})
                history.append({"role": "tool", "tool_call_id": call, "name": fn,
                                "content": g.text(sz["result"])})
            convs.append(tuple(turns))
        return ConcurrentPlan(
            "C2", f"main + 3 subagents: 4 concurrent agent conversations sharing a "
                  f"~{sz['system']}-token system prompt + {sz['tools']} tools, "
                  f"{sz['steps']} tool steps each", "anthropic", (tuple(convs),),
            labels=("4 agents",))
    if key in SPEC_NAMES and g is not None:
        counts = tuple(streams) if streams else (1, sz["spec_streams"])
        return _spec_plan(key, g, sz, counts)
    raise ValueError(f"unknown concurrent scenario {name!r}; expected one of "
                     f"{', '.join(CONCURRENT_NAMES)}")


def _spec_plan(key: str, g: TextGen, sz: dict[str, int], counts: Sequence[int]
               ) -> ConcurrentPlan:
    """E2 / E3 / E4 (module docstring): one round per stream count, each stream its own
    conversation; the same streams' texts in every round (round n's first streams are
    round 1's), so rounds differ only in concurrency."""
    out = sz["spec_output"]
    if key == "E5":
        return _followup_plan(g, sz, counts)
    most = max(counts)
    make = {"E2": _edit_stream, "E3": _replay_stream, "E4": _chat_stream}[key]
    streams = [make(s, g, sz) for s in range(most)]
    rounds = tuple(tuple(streams[:n]) for n in counts)
    title = {
        "E2": f"edit: a {sz['functions']}-function file returned with one identifier renamed",
        "E3": "agentic replay with tool calls: read a file, write it back changed through a "
              "tool call, report on a test run that quotes it",
        "E4": "chat with nothing to copy: a story from a random prompt",
    }[key]
    return ConcurrentPlan(
        key, f"{title} ({'/'.join(str(n) for n in counts)} streams, {out} tokens, greedy)",
        "openai", rounds, labels=tuple(str(n) for n in counts), max_tokens=out,
        notes=("speculative decoding's case: compare ours (speculation on by default) with "
               "ours_nospec and mlx_lm",),
        # SmolLM2's template drops tools: every system gets one that renders them
        chat_template=TOOLS_TEMPLATE if key == "E3" else None)


def _edit_stream(s: int, g: TextGen, sz: dict[str, int]) -> tuple[Job, ...]:
    return (Job(s, 0, edit_request(g, sz["functions"])[0]),)


def _followup_plan(g: TextGen, sz: dict[str, int], counts: Sequence[int]) -> ConcurrentPlan:
    """E5, the edit's next turn: per stream count, two rounds over streams of their own
    (no text shared with another count's). Turn 1 shows a code file and asks for one
    identifier renamed; turn 2 shows the same file and asks for another name for it (an
    agent that reads the file again and asks for a different change). The file comes
    first, so a server with a prompt cache prefills only turn 2's request: its decode is
    what is measured."""
    rounds: list[tuple[tuple[Job, ...], ...]] = []
    labels: list[str] = []
    for n in counts:
        first: list[tuple[Job, ...]] = []
        second: list[tuple[Job, ...]] = []
        for s in range(n):
            old = "_".join(g.words(2)) + "_state"
            code = _code_file(g, sz["functions"], old)
            path = f"src/{g.ident('mod')}.py"
            shown = f"Here is `{path}`:\n\n```python\n{code}```\n\n"
            for turn, out in ((0, first), (1, second)):
                new = "_".join(g.words(2)) + ("_record" if turn == 0 else "_entry")
                ask = (f"Return this file with the identifier `{old}` renamed to `{new}` "
                       "everywhere. Change nothing else; reply with the whole file in one "
                       "Python code block and no other text.")
                out.append((Job(s, turn, (
                    {"role": "system", "content": "You are a careful coding assistant."},
                    {"role": "user", "content": shown + ask})),))
        rounds += [tuple(first), tuple(second)]
        labels += [f"{n} turn 1", f"{n} turn 2"]
    out_tokens = sz["spec_output"]
    return ConcurrentPlan(
        "E5", f"the edit's next turn: a file, then the same file with another rename asked "
              f"({'/'.join(str(n) for n in counts)} streams, {out_tokens} tokens, greedy)",
        "openai", tuple(rounds), labels=tuple(labels), max_tokens=out_tokens,
        notes=("speculative decoding's case with a cached prompt: turn 2 is decode-bound",))


def _replay_stream(s: int, g: TextGen, sz: dict[str, int]) -> tuple[Job, ...]:
    """An agent's turns (each a request; the assistant's earlier calls are scripted)."""
    # read_file, write_file, edit_file, run_shell, ...: the calls below need the first
    # two and run_tests (the eighth)
    tools = _canonical_tools(_tool_defs(g, 8, sz["spec_tool_desc"]))
    old = "_".join(g.words(2)) + "_state"
    new = "_".join(g.words(2)) + "_record"
    path = f"src/{g.ident('mod')}.py"
    code = _code_file(g, sz["functions"], old)
    system = ("You are a coding agent working in a repository. Use the tools; to change a "
              "file, call write_file with its whole new content. " + g.text(60))
    history: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"In `{path}`, rename `{old}` to `{new}` everywhere. "
                                    "Read the file, write it back changed, then run the "
                                    "tests and tell me what failed."}]
    jobs: list[Job] = []

    def call(fn: str, args: dict[str, Any], result: str) -> None:
        cid = g.ident("call")
        history.append({"role": "assistant", "content": "", "tool_calls": [{
            "id": cid, "type": "function",
            "function": {"name": fn, "arguments": json.dumps(args)}}]})
        history.append({"role": "tool", "tool_call_id": cid, "name": fn, "content": result})

    call("read_file", {"path": path}, code)
    jobs.append(Job(s, 0, tuple(dict(m) for m in history), tools))  # the write_file call
    changed = code.replace(old, new)
    call("write_file", {"path": path, "content": changed}, f"wrote {len(changed)} bytes")
    lines = changed.splitlines()
    quoted = "\n".join(f"{path}:{i + 1}: {line}" for i, line in enumerate(lines)
                       if new in line)
    call("run_tests", {"path": "tests/"}, "FAILED tests/test_mod.py - NameError: name "
         f"'{old}' is not defined\nLines that use the new name:\n{quoted}")
    jobs.append(Job(s, 1, tuple(dict(m) for m in history), tools))  # the report
    return tuple(jobs)


def _canonical_tools(tools: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """The tools in the form ours renders any tools in (``server/prompts/canon.py``:
    sorted by name, the conventional key order, property names sorted), so that every
    server E3 compares, given the same template, prefills the same text."""
    out = []
    for t in sorted(tools, key=lambda t: str(t["function"]["name"])):
        params = t["function"]["parameters"]
        props = params["properties"]
        out.append({**t, "function": {**t["function"], "parameters": {
            **params, "properties": {k: props[k] for k in sorted(props)}}}})
    return tuple(out)


def _chat_stream(s: int, g: TextGen, sz: dict[str, int]) -> tuple[Job, ...]:
    topic = " ".join(g.words(6))
    msgs = ({"role": "system", "content": "You are a creative writer."},
            {"role": "user", "content": f"Write an original short story about {topic}. "
                                        "Do not repeat any sentence."})
    return (Job(s, 0, msgs),)


def output_tokens(quick: bool) -> int:
    return _sizes(quick)["output"]

