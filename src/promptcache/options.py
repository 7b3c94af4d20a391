"""Command-line flags declared on the config dataclasses' fields (``opt``): each
setting's flag, help and default written once, beside the field whose ``__post_init__``
validates it. ``add_options`` makes the argparse flags, ``from_args`` the config."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
_SAME = object()  # the flag's default is the field's
_TYPES: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "Path": Path}


@dataclasses.dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    help: str | None
    default: Any
    type: Callable[[str], Any] | None
    parse: Callable[[Any], Any] | None  # the flag's value (not None) -> the field's
    choices: Sequence[Any] | None
    metavar: str | None
    action: str | None

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


def opt(*names: str, default: Any = dataclasses.MISSING,
        factory: Callable[[], Any] | None = None, help: str | None = None,
        flag_default: Any = _SAME, parse: Callable[[Any], Any] | None = None,
        type: Callable[[str], Any] | None = None, choices: Sequence[Any] | None = None,
        metavar: str | None = None, switch: bool = False, append: bool = False) -> Any:
    """A dataclass field with a flag: ``names`` (the first is the flag, the rest
    aliases); ``flag_default`` when the flag's differs from the field's (a size as text:
    ``parse`` turns it into the field's value); ``switch``: a store_true flag."""
    flag = Flag(names, help, flag_default, type, parse, choices, metavar,
                "store_true" if switch else "append" if append else None)
    meta = {"flag": flag}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _flags(cls: type) -> list[tuple[dataclasses.Field[Any], Flag]]:
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def add_options(parser: argparse._ActionsContainer, cls: type,
                only: Sequence[str] | None = None) -> None:
    """One argparse flag per field of ``cls`` declared with ``opt`` (or of the fields
    ``only`` names), in field order."""
    for f, flag in _flags(cls):
        if only is not None and f.name not in only:
            continue
        default = flag.default
        if default is _SAME:
            default = None if f.default is dataclasses.MISSING else f.default
        kwargs: dict[str, Any] = {"default": default, "help": flag.help}
        if flag.action == "store_true":
            kwargs["default"] = False
        if flag.action is not None:
            kwargs["action"] = flag.action
        if flag.action != "store_true":
            base = str(f.type).split(" | ")[0]
            kwargs["type"] = flag.type or (None if flag.parse else _TYPES.get(base))
            kwargs.update(choices=flag.choices, metavar=flag.metavar)
        parser.add_argument(*flag.names, **kwargs)


def from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """``cls`` from the flags in ``args`` (and the fields ``given``); a bad value is a
    ValueError in the words of the flags."""
    kwargs: dict[str, Any] = {}
    for f, flag in _flags(cls):
        value = getattr(args, flag.dest, None)  # None: a flag the command lacks
        if f.name in given or value is None:
            continue
        try:
            kwargs[f.name] = flag.parse(value) if flag.parse is not None else value
        except ValueError as e:
            raise ValueError(f"{flag.names[0]}: {e}") from None
    try:
        return cls(**kwargs, **given)
    except ValueError as e:  # the fields it names (snake_case, or first) as their flags
        flags = {f.name: flag.names[0] for f, flag in _flags(cls)}
        raise ValueError(re.sub(r"^\w+|\b\w+_\w+\b",
                                lambda m: flags.get(m.group(), m.group()), str(e))) from None
