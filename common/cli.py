"""The command line of every entry point, below the layers that define flags: tyro's parse with its error box as one
`error:` line, and the validator of the ranges each flag declares beside it (annotated-types' Ge, Gt, Le, Lt; AllowInf
where inf means something). common.flags builds the training scripts' checks on it; `python -m common.rewards serve`
and `python -m common.evaluate` use it directly.

parse_flags(Args, argv)   tyro.cli, a flag that does not parse is one `error:` line and exit status 2
check_numbers(args)       every float flag finite (inf where AllowInf), then every number within its declared range
check_ranges(args)        the declared ranges alone (a mode's default filled in later is checked again with it)
need(ok, message)         raise InputError(message) unless ok
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import sys
import typing
from pathlib import Path

import tyro
from annotated_types import Ge, Gt, Le, Lt

from common import InputError


class AllowInf:
    """Annotated[float, AllowInf, Gt(0)]: a float flag whose inf means something (no clip at all); nan never does."""


def need(ok: bool, message: str) -> None:
    """Raise InputError(message) unless ok; the message names the flag to change."""
    if not ok:
        raise InputError(message)


def parse_flags(args_type, argv: list[str] | None = None, command: str | None = None, rules=None):
    """tyro.cli(args_type): --help as tyro prints it; a flag that does not parse (an unknown flag, a value that is not
    of the flag's type or choices) is one `error:` line naming the flag and what it takes, and exit status 2.
    `command`: how --help's usage and the error name the command (default: the script's, from sys.argv[0]); `rules`:
    a context in which tyro parses (common.flags' ordering of a script's own flags first)."""
    box = io.StringIO()
    try:
        with contextlib.redirect_stderr(box), rules or contextlib.nullcontext():
            return tyro.cli(args_type, args=argv, prog=command)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        print(f"error: {tyro_message(box.getvalue(), command)}", file=sys.stderr)
        raise SystemExit(2) from None


def tyro_message(box: str, command: str | None = None) -> str:
    """tyro's error box (drawn in Unicode or ASCII) in one line: its first section, and the flag's usage it suggests."""
    sections, current = [], []
    for raw in box.splitlines():
        line = raw.strip().strip("│|").strip()
        if raw.strip().startswith(("╭", "╰", "+")) or (line and set(line) <= set("─-")):  # a border or a rule
            sections.append(current)
            current = []
        elif line:
            current.append(line)
    sections = [part for part in [*sections, current] if part]
    title = box.strip().splitlines()[0].strip(" │|╭╮+-─") if box.strip() else ""
    sections = sections[1:] if sections and sections[0] == [title] else sections  # a title drawn on a line of its own
    sections = sections or [[]]
    message = " ".join(sections[0]).rstrip(".") if sections[0] else "the flags do not parse"
    rest = sections[1] if len(sections) > 1 else []
    for lead, say in (("Argument helptext:", "expected"), ("Perhaps you meant:", "perhaps you meant")):
        if lead in rest and rest.index(lead) + 1 < len(rest):
            message += f" ({say} {rest[rest.index(lead) + 1]})"
    script = Path(sys.argv[0])
    command = command or (f"python -m common.{script.stem}" if script.parent.name == "common" else script.name)
    return message + f"; `{command} --help` lists every flag"


def flag_metadata(args_type) -> dict[str, tuple]:
    """{field: the metadata of its Annotated declaration} of a flags dataclass (a fork's or a test's too), each
    annotation read in the names of the modules that define the class and its bases (RunArgs' in common.flags')."""
    names = {}
    for c in reversed(args_type.__mro__[:-1]):
        names |= vars(sys.modules[c.__module__]) if c.__module__ in sys.modules else {}
    hints = typing.get_type_hints(args_type, globalns=names, include_extras=True)
    return {f.name: getattr(hints.get(f.name), "__metadata__", ()) for f in dataclasses.fields(args_type)}


def check_numbers(args) -> None:
    """Every float flag a finite number (inf where its declaration has AllowInf), so that nan, which fails every
    comparison and which min() skips unless it comes first, and inf, which passes `> 0`, reach no other check; then
    every number within its declared range (check_ranges), so that no check computes with a huge or negative one."""
    meta = flag_metadata(type(args))
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            need(
                math.isinf(value) and AllowInf in meta[f.name],
                f"--{f.name.replace('_', '-')} must be a finite number (got {value})",
            )
    check_ranges(args)


def check_ranges(args) -> None:
    """Every number a flag holds within the bounds its declaration gives (annotated-types' Ge, Gt, Le, Lt): one
    `error:` line naming the flag, its bound and the value. Flags still None (a mode's default not filled in) and
    the words of a Union (`--shift pipeline`) are not numbers and pass."""
    tests = {Ge: (">=", lambda v, b: v >= b), Gt: (">", lambda v, b: v > b), Le: ("<=", lambda v, b: v <= b)}
    tests[Lt] = ("<", lambda v, b: v < b)
    for name, meta in flag_metadata(type(args)).items():
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        for m in meta:
            if type(m) in tests:
                sign, ok = tests[type(m)]
                bound = getattr(m, type(m).__name__.lower())  # Ge(0).ge, Gt(0).gt, ...
                need(ok(value, bound), f"--{name.replace('_', '-')} must be {sign} {bound} (got {value})")
