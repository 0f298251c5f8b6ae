"""The walk of tests/test_flag_walk.py over the two other entry points: `python -m common.evaluate` (EvalArgs) and
`python -m common.rewards serve` (ServeArgs). Each numeric flag at nan, inf and -inf (floats), at the nearest value
outside every bound its declaration gives and at a huge value is one `error:` line naming a flag and exit status 2,
or, where the value is legitimate, a start-up that gets as far as loading a model (evaluate) or binding the address
(serve), here stopped there: never a traceback."""

import dataclasses
import math
import re

import pytest

from common import evaluate as E
from common import rewards
from common.flags import flag_metadata
from tests.test_flag_walk import outside


class Reached(Exception):
    """Start-up got past every check of the flags."""


def numeric_fields(args_type):
    meta = flag_metadata(args_type)
    for f in dataclasses.fields(args_type):
        kind = str(f.type)
        if re.search(r"\b(int|float)\b", kind) and "bool" not in kind:
            yield f.name, "float" not in kind, meta[f.name]


def values(integer: bool, meta) -> list:
    """Each value the walk tries, as the command line gives it."""
    tried = outside(meta, integer) + [10**12 if integer else 1e300]
    tried += [] if integer else [math.nan, math.inf, -math.inf]
    return [str(v) for v in tried]


def run(main, argv, capsys) -> tuple[int | str, str]:
    try:
        main(argv)
    except Reached:
        return "reached", capsys.readouterr().err
    except SystemExit as e:
        return e.code, capsys.readouterr().err
    return "returned", capsys.readouterr().err


def evaluate(monkeypatch):
    from common import flags

    def load_model(*a, **kw):
        raise Reached

    monkeypatch.setattr("common.models.load_model", load_model)

    def main(argv):
        monkeypatch.setattr("sys.argv", ["common/evaluate.py", *argv])
        flags.cli(E.main, E.EvalArgs)

    return main


def serve(monkeypatch):
    from common import remote

    def bound(*a, **kw):
        raise Reached

    monkeypatch.setattr(remote, "serve", bound)
    return lambda argv: rewards.serve_main(["serve", "--reward", "jpeg", "--device", "cpu", *argv])


CASES = [("evaluate", name, integer, meta) for name, integer, meta in numeric_fields(E.EvalArgs)]
CASES += [("serve", name, integer, meta) for name, integer, meta in numeric_fields(rewards.ServeArgs)]


@pytest.mark.parametrize("entry,name,integer,meta", [pytest.param(*c, id=f"{c[0]}-{c[1]}") for c in CASES])
def test_every_numeric_flag_of_the_evaluator_and_the_server_is_one_line_or_a_start_up(
    entry, name, integer, meta, monkeypatch, capsys, tmp_path
):
    main = {"evaluate": evaluate, "serve": serve}[entry](monkeypatch)
    flag = f"--{name.replace('_', '-')}"
    assert any(type(m).__name__ in ("Ge", "Gt", "Le", "Lt") for m in meta), f"{entry}: {flag} declares no range"
    common = ["--out", str(tmp_path / "eval")] if entry == "evaluate" else []
    for value in values(integer, meta):
        code, err = run(main, [*common, flag, value], capsys)
        assert "Traceback" not in err, (flag, value, err)
        if code == "reached":
            assert value in ("1000000000000", "1e+300"), (flag, value)  # only a huge value may be legitimate
            continue
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {flag} "), (flag, value, err)
