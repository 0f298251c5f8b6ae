"""`python SCRIPT.py --help` lists the script's own flags (its algorithm's, and a shared flag whose default it
changes) before the shared ones, and parsing gives the same values whatever the order."""

import ast
import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from common.flags import RunArgs, parse_flags

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [
    p.stem
    for p in sorted(ROOT.glob("*.py"))
    if {"Args", "main"}
    <= {n.name for n in ast.parse(p.read_text()).body if isinstance(n, ast.ClassDef | ast.FunctionDef)}
]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_the_scripts_own_flags_first(script, capsys):
    Args = importlib.import_module(script).Args
    with pytest.raises(SystemExit) as done:
        parse_flags(Args, ["--help"])
    assert done.value.code == 0
    listed = re.findall(r"^(?:[│|] |  )(--[a-z][a-z0-9-]*)", capsys.readouterr().out, re.M)
    own = {f"--{n.replace('_', '-')}" for c in Args.__mro__[: Args.__mro__.index(RunArgs)] for n in c.__annotations__}
    flags = {f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(Args)}
    assert sorted(listed) == sorted(flags)  # each flag once
    assert set(listed[: len(own)]) == own and len(own) >= 5, listed[: len(own) + 1]


def test_a_fork_subclassing_args_lists_its_flags_then_the_scripts_then_the_shared_ones(capsys):
    base = importlib.import_module("dancegrpo").Args

    @dataclasses.dataclass
    class ForkArgs(base):
        nll_coef: float = 0.5
        """weight of a negative log-likelihood term"""

    with pytest.raises(SystemExit):
        parse_flags(ForkArgs, ["--help"])
    listed = re.findall(r"^(?:[│|] |  )(--[a-z][a-z0-9-]*)", capsys.readouterr().out, re.M)
    shared = {f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(RunArgs)} - {"--learning-rate"}
    assert not shared & set(listed[: len(listed) - len(shared)])  # the shared flags come last
    args = parse_flags(ForkArgs, ["--nll-coef", "2", "--seed", "3", "--num-steps", "5"])
    assert (args.nll_coef, args.seed, args.num_steps, args.group_size) == (2.0, 3, 5, base().group_size)
