"""rlr.py's functions at values where a wrong constant, sign, bound or index shows: each against numbers worked
out by hand here. Written for the mutants benchmarks/mutation.py generated that the other tests let pass."""

import pytest
import torch

import rlr as R
from common import InputError


def test_sigma_schedule_is_the_float64_formula_rounded_once():
    """s = 1 - i / 10 warped by 3 s / (1 + 2 s), computed in float64 and rounded to float32 once; s = 0.7:
    2.1 / 2.4 = 0.875."""
    expected = [3 * (1 - i / 10) / (1 + 2 * (1 - i / 10)) for i in range(11)]
    assert torch.equal(R.sigma_schedule(10, 3.0), torch.tensor(expected, dtype=torch.float64).float())
    assert R.sigma_schedule(10, 3.0)[3] == 0.875


# ---------------------------------------------------------------- flags: every bound at its edge, each message naming it
REFUSED = [
    (dict(num_steps=1), "--num-steps must be at least 2"),
    (dict(subchain_len=0), "h = 0: --subchain-len must be in [1, 9]"),
    (dict(subchain_len=10), "h = 10: --subchain-len must be in [1, 9]"),
    (dict(subchain_stage="fine", subchain_len=3), "--subchain-stage fine: no window of 3 steps"),
    (dict(memory_budget_gb=20.0, subchain_len=2), "give --subchain-len or --memory-budget-gb, not both"),
    (dict(memory_budget_gb=1.0), "h = -1 (h* of --memory-budget-gb 1.0): --subchain-len must be in [1, 9]"),
    (dict(memory_budget_gb=20.0, zo_step_gb=0.0), "--ho-step-gb > --zo-step-gb > 0"),
    (dict(memory_budget_gb=20.0, variance_ratio=-0.1), "--ho-step-gb > --zo-step-gb > 0"),
    (dict(noise_level=0.0), "--noise-level must be > 0"),
    (dict(group_size=1), "--group-size must be >= 2"),
    (dict(rollout_batch_size=5), "--samples-per-device must be a multiple of --rollout-batch-size"),
    (dict(terms="fo+ho+zo", zo_perturbations=3), "--zo-perturbations must divide --samples-per-device"),
    (dict(terms="fo+ho+zo", zo_perturbations=16), "--zo-perturbations must divide --samples-per-device"),
    (dict(terms="fo+ho+zo", zo_scale=0.0), "--zo-scale must be > 0"),
]
ACCEPTED = [
    dict(num_steps=2, subchain_len=1),
    dict(subchain_len=9),
    dict(subchain_stage="fine", subchain_len=2),
    dict(terms="fo+zo"),
    dict(terms="fo+ho+zo", zo_perturbations=8),
    dict(memory_budget_gb=20.0, variance_ratio=0.0),
]


@pytest.mark.parametrize("flags,message", REFUSED)
def test_each_refused_flag_is_one_message_that_starts_with_it(flags, message):
    with pytest.raises(InputError) as e:
        R.resolve_and_check(R.Args(**flags))
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("flags", ACCEPTED)
def test_each_bound_itself_is_accepted(flags):
    R.resolve_and_check(R.Args(**flags))


def test_the_defaults_by_hand():
    """h = min(2, T - 1); one perturbation block per rollout chunk (32 / 4 = 8); flow noise 0.7, dance 0.3; h* of a
    20 GB budget: min(floor((20 - 0.24 * 9) / (8 - 0.24)) = floor(2.299) = 2, floor(10 / 2 - 1) = 4, 9) = 2."""
    flow, dance, short = R.Args(), R.Args(sde_type="dance", exp_name="mine"), R.Args(num_steps=2)
    for a in (flow, dance, short):
        R.resolve_and_check(a)
    assert (flow.subchain_len, flow.zo_perturbations, flow.noise_level, flow.exp_name) == (2, 8, 0.7, "rlr")
    assert (dance.noise_level, dance.exp_name, short.subchain_len) == (0.3, "mine", 1)
    budget = R.Args(memory_budget_gb=20.0)
    R.resolve_and_check(budget)
    assert budget.subchain_len == 2


@pytest.mark.parametrize("flags", [dict(ho_step_gb=0.24), dict(variance_ratio=1.0)])
def test_the_h_star_rules_inputs_are_checked_before_it_divides_by_them(flags):
    """--ho-step-gb equal to --zo-step-gb (0.24) or --variance-ratio 1 makes h*'s denominators 0: one error line
    naming the flags is expected, not a ZeroDivisionError."""
    with pytest.raises(InputError, match="--ho-step-gb > --zo-step-gb > 0"):
        R.resolve_and_check(R.Args(memory_budget_gb=20.0, **flags))


# ---------------------------------------------------------------- the survivors of the generated mutants
def test_a_ddim_step_in_float64_is_exact_to_float64():
    """alphabar given as Python floats is taken in x's dtype: at float64 the step is the float64 formula, not one with
    a_t = 0.3 rounded to float32 first (1.2e-8 away). a 0.3 -> a_prev 0.5, eta 0.5."""
    x = torch.tensor([[0.7, -1.3]], dtype=torch.float64)
    eps = torch.tensor([[0.2, 0.9]], dtype=torch.float64)
    a, ap, eta = 0.3, 0.5, 0.5
    x0 = (x - (1 - a) ** 0.5 * eps) / a**0.5
    std = eta * ((1 - ap) / (1 - a) * (1 - a / ap)) ** 0.5
    mean, s = R.ddim_step(x, eps, a, ap, eta)
    assert mean.dtype == torch.float64 and s.dtype == torch.float64
    torch.testing.assert_close(mean, ap**0.5 * x0 + (1 - ap - std**2) ** 0.5 * eps, rtol=0, atol=1e-15)
    assert abs(s.item() - std) < 1e-15


def test_h_star_is_capped_at_the_steps_before_the_first_order_step():
    """Both of h*'s bounds above T - 1: over 10 steps a budget of 100 GB at 1 GB a sub-chain step and 0.0001 GB a ZO
    step (by memory floor(99.9991 / 0.9999) = 100) and V_h = 0.95 V_z (by variance floor(10 / 0.1 - 1) = 99) give
    T - 1 = 9, the last step being the FO term's; below the cap, the smaller bound (by variance floor(10 / 2 - 1) = 4
    under by memory floor(2.55 / 0.2) = 12)."""
    assert R.optimal_subchain_len(100.0, 10, 1.0, 0.0001, 0.95) == 9
    assert R.optimal_subchain_len(3.0, 10, 0.25, 0.05, 0.0) == 4


def test_zo_perturbations_are_keyed_on_the_block_and_the_step():
    """zo_perturbed(params, key, scale, i) adds scale x the standard normals of the generator seeded by key_seed(*key,
    i): equal for the same key and step, different for another step or another key's block."""
    p = torch.nn.Parameter(torch.zeros(5))

    def seen(key, i):
        with R.zo_perturbed([p], key, 0.5, i):
            return p.detach().clone()

    expected = 0.5 * torch.randn(5, generator=torch.Generator().manual_seed(R.key_seed(0, 3, 1, 2)))
    assert torch.equal(seen((0, 3, 1), 2), expected) and torch.equal(p.detach(), torch.zeros(5))
    assert not torch.equal(seen((0, 3, 1), 1), expected)  # another step
    assert not torch.equal(seen((0, 3, 0), 2), expected)  # another block
