"""Every numeric flag of every training script, walked: nan, inf and -inf on each float flag, and on each flag the
nearest value outside every bound its declaration gives (`Annotated[int, Ge(1)]`: 0), are refused at start-up with
one `error:` line (an InputError naming a flag), never a traceback and never a run; inf only where the declaration
says AllowInf (dancegrpo.py's clips). The bounds are read from the declarations, so a new flag is walked as soon as
it declares its range; a float flag without a declared bound is still walked at nan and inf."""

import dataclasses
import importlib
import math

import pytest
from annotated_types import Ge, Gt, Le, Lt

from common import InputError
from common.flags import AllowInf, flag_metadata
from tests.helpers import algorithm_scripts


def numeric_flags():
    """(script, flag, integer, declaration metadata) per int or float field of each script's Args."""
    for script in algorithm_scripts():
        stem = script.removesuffix(".py")
        Args = importlib.import_module(stem).Args
        meta = flag_metadata(Args)
        for f in dataclasses.fields(Args):
            kind = str(f.type)
            if ("int" in kind or "float" in kind) and "bool" not in kind and "Literal" not in kind:
                yield pytest.param(stem, f.name, "float" not in kind, meta[f.name], id=f"{stem}-{f.name}")


def outside(meta, integer: bool) -> list:
    """The nearest values outside each declared bound."""
    step = 1 if integer else 1e-9
    out = []
    for m in meta:
        if isinstance(m, Ge):
            out.append(m.ge - step)
        elif isinstance(m, Gt):
            out.append(m.gt)  # the bound itself is outside
        elif isinstance(m, Le):
            out.append(m.le + step)
        elif isinstance(m, Lt):
            out.append(m.lt)
    return out


@pytest.mark.parametrize("script,name,integer,meta", list(numeric_flags()))
def test_every_numeric_flag_outside_its_range_is_one_line(script, name, integer, meta):
    module = importlib.import_module(script)
    values = outside(meta, integer) + (
        [] if integer else [math.nan, -math.inf] + ([] if AllowInf in meta else [math.inf])
    )
    assert values, f"{script}: --{name} declares no range"
    for value in values:
        with pytest.raises(InputError, match="--") as e:
            module.resolve_and_check(module.Args(**{name: value}))
        assert "\n" not in str(e.value)


def test_the_shared_flags_that_ended_in_tracebacks_or_trained_the_wrong_way_are_refused():
    """Before their declarations: --max-grad-norm -1 multiplied every gradient by -1/norm (the reward trained down),
    0 zeroed them; --lora-rank 0, --seed -1, --weight-decay -1 and nan/inf learning rates ended in tracebacks."""
    D = importlib.import_module("dancegrpo")
    cases = {"max_grad_norm": (-1.0, 0.0), "lora_rank": (0,), "seed": (-1,), "weight_decay": (-1.0,)}
    cases |= {"learning_rate": (math.inf, math.nan, 2.0), "kl_beta": (math.inf,), "guidance_scale": (math.nan,)}
    for name, values in cases.items():
        for value in values:
            with pytest.raises(InputError) as e:
                D.resolve_and_check(D.Args(**{name: value}))
            assert str(e.value).startswith(f"--{name.replace('_', '-')} must be"), str(e.value)


def test_check_ranges_takes_each_bound_and_refuses_the_next_value_past_it():
    """Each kind of bound by hand: Ge(1) takes 1 and refuses 0, Gt(0.5) refuses 0.5, Le(5) takes 5 and refuses 6,
    Lt(2.0) refuses 2.0; a flag still None (a mode's default) is no number and passes."""
    from dataclasses import dataclass
    from typing import Annotated, Optional

    from common.flags import check_ranges

    @dataclass
    class Flags:
        count: Annotated[int, Ge(1), Le(5)] = 1
        rate: Annotated[float, Gt(0.5), Lt(2.0)] = 1.0
        later: Annotated[Optional[int], Ge(3)] = None

    check_ranges(Flags(count=1, rate=1.999))
    check_ranges(Flags(count=5, rate=0.501))
    refused = {
        (0, 1.0): "--count must be >= 1 (got 0)",
        (6, 1.0): "--count must be <= 5 (got 6)",
        (1, 0.5): "--rate must be > 0.5 (got 0.5)",
        (1, 2.0): "--rate must be < 2.0 (got 2.0)",
    }
    for (count, rate), message in refused.items():
        with pytest.raises(InputError) as e:
            check_ranges(Flags(count=count, rate=rate))
        assert str(e.value) == message
