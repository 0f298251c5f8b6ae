"""Every numeric flag of every training script, walked: nan, inf and -inf on each float flag, and on each flag the
nearest value outside every bound its declaration gives (`Annotated[int, Ge(1)]`: 0), are refused at start-up with
one `error:` line (an InputError naming a flag), never a traceback and never a run; inf only where the declaration
says AllowInf (dancegrpo.py's clips). The bounds are read from the declarations, so a new flag is walked as soon as
it declares its range; a float flag without a declared bound is still walked at nan and inf. Each flag is also
walked at a huge value (10**12, 1e300), alone and in each mode that puts it to use: resolve_and_check refuses it in
one line or takes it, within seconds and a bounded memory (a huge count must not size a list or a loop first)."""

import _thread
import dataclasses
import importlib
import math
import signal
import threading
import time
import tracemalloc
from functools import cache, partial

import pytest
from annotated_types import Ge, Gt, Le, Lt

from common import InputError
from common.flags import AllowInf, flag_metadata, need
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


HUGE = {True: 10**12, False: 1e300}  # an int flag's huge value, a float flag's
SECONDS, MEGABYTES = 5.0, 200  # a call takes about 0.05 s and well under 1 MB here (traced): far below both
MODES = {  # flags that put each script's mode flags to use, so that a huge value reaches its mode's own checks
    "dancegrpo": [dict(sde_window=2, ode_solver="dpm2"), dict(objective="dppo", ema=True), dict(sde_type="cps")],
    "branchgrpo": [
        dict(fusion="path", ema=True),
        dict(pruning="width", width_mode="extreme"),
        dict(pruning="depth"),
        dict(pruning="mix"),
        dict(split_schedule="sparse"),
        dict(split_schedule="late"),
    ],
    "vgrpo": [dict(ema=True, kl_beta=0.1), dict(pair_times="uniform")],
    "rlr": [dict(memory_budget_gb=20.0), dict(terms="fo+ho+zo"), dict(terms="fo+zo")],
}


class Runaway(BaseException):
    """Raised into a call that ran past the walk's time or memory (a BaseException: no `except Exception` of the code
    under test takes it for its own)."""


def bounded(call):
    """(call()'s result or the InputError it raised, its seconds, its peak of Python allocations in bytes). A watcher
    thread stops the call with Runaway, raised in the main thread at its next bytecode, as soon as it passes SECONDS
    or holds more than MEGABYTES: a runaway list is stopped small, not left to fill the machine."""
    done, why = threading.Event(), []

    def stop(signum, frame):
        if not done.is_set():  # a signal raised just as the call returned is dropped
            raise Runaway(why[0])

    def watch(start):
        while not done.wait(0.005):
            held = tracemalloc.get_traced_memory()[0] - base
            if time.monotonic() - start > SECONDS or held > MEGABYTES * 2**20:
                why.append(f"{time.monotonic() - start:.1f} s, {held / 2**20:.0f} MB held")
                _thread.interrupt_main(signal.SIGUSR1)
                return

    previous = signal.signal(signal.SIGUSR1, stop)
    tracing = tracemalloc.is_tracing()  # already on (python -X tracemalloc): left on, its peak measured from here
    if tracing:
        tracemalloc.reset_peak()
    else:
        tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    start = time.monotonic()
    watcher = threading.Thread(target=watch, args=(start,), daemon=True)
    watcher.start()
    try:
        try:
            outcome = call()
        except InputError as e:
            outcome = e
        seconds, peak = time.monotonic() - start, tracemalloc.get_traced_memory()[1] - base
    finally:
        done.set()
        watcher.join()
        if not tracing:
            tracemalloc.stop()
        signal.signal(signal.SIGUSR1, previous)
    return outcome, seconds, peak


def test_bounded_stops_a_runaway_by_memory_or_time_and_passes_a_quick_call(monkeypatch):
    """The watcher itself: a list of megabyte buffers that would grow without end is stopped soon after MEGABYTES (it
    polls every 5 ms), a loop without end at SECONDS (here 0.2); a quick call comes back with its result, its time
    and its peak, and an InputError as its outcome."""
    with pytest.raises(Runaway, match="MB held"):
        bounded(lambda: [bytearray(2**20) for _ in range(10**12)])
    monkeypatch.setattr(f"{__name__}.SECONDS", 0.2)
    started = time.monotonic()
    with pytest.raises(Runaway):
        bounded(lambda: sum(1 for _ in iter(int, 1)))  # int() is never 1: no end
    assert time.monotonic() - started < 2
    result, seconds, peak = bounded(lambda: sum(range(1000)))
    assert result == 499500 and seconds < 1 and peak < 2**20
    refused, _, _ = bounded(partial(need, False, "--x must be >= 1 (got 0)"))
    assert isinstance(refused, InputError) and str(refused) == "--x must be >= 1 (got 0)"


@cache
def warmed(script: str):
    """The script's module, its resolve_and_check called once at the defaults: a first call imports what the checks
    read, which is no cost of the value walked."""
    module = importlib.import_module(script)
    module.resolve_and_check(module.Args())
    return module


@pytest.mark.parametrize("script,name,integer,meta", list(numeric_flags()))
def test_every_numeric_flag_at_a_huge_value_is_refused_or_taken_quickly(script, name, integer, meta):
    """10**12 (an int flag) or 1e300 (a float flag), in the defaults and in each mode of MODES: resolve_and_check
    refuses it in one line naming a flag, or returns, within SECONDS and MEGABYTES of Python allocations."""
    module = warmed(script)
    value = HUGE[integer]
    for mode in [{}, *MODES.get(script, [])]:
        flags = {**mode, name: value}
        try:
            outcome, seconds, peak = bounded(partial(module.resolve_and_check, module.Args(**flags)))
        except Runaway as e:
            pytest.fail(f"{script} {flags}: stopped after {e}")
        if isinstance(outcome, InputError):
            assert "--" in str(outcome) and "\n" not in str(outcome), (flags, str(outcome))
        assert seconds < SECONDS and peak < MEGABYTES * 2**20, (flags, seconds, peak)


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
