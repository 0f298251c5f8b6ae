"""dancegrpo.py's functions at values where a wrong constant, sign, bound or index shows: each against numbers worked
out by hand here. Written for the mutants benchmarks/testing/mutation.py generated that the other tests let pass."""

import inspect
import math
from contextlib import nullcontext

import pytest
import torch

import dancegrpo as D
from common import InputError


class Linear:
    """A model whose velocity is v = guidance * cond * x + t: every step of a rollout can be done by hand."""

    def velocity(self, denoiser, x, t, cond, guidance_scale):
        assert denoiser == "denoiser"
        return guidance_scale * cond * x + t.view(-1, 1)


def test_rollout_by_hand_an_sde_step_then_an_euler_step():
    """sigmas (0.8, 0.4, 0), g = 0.5, the SDE at step 0 only, guidance 2.
    Image 1 (x = 1, cond = 1, noise 0.5): v = 2.8, x0_hat = 1 - 0.8 * 2.8 = -1.24,
    score = -(1 - 0.2 * -1.24) / 0.64 = -1.95, mean = 1 - 0.4 (2.8 + 0.125 * 1.95) = -0.2175, std = 0.5 sqrt(0.4) =
    0.316228, x = -0.2175 + 0.5 * 0.316228 = -0.059386, log-density -0.5^2 / 2 - log 0.316228 - log(2 pi) / 2 = 0.107354;
    then Euler: v = -0.118772 + 0.4 = 0.281228, x = -0.059386 - 0.4 * 0.281228 = -0.171877.
    Image 2 (x = -1, cond = 0.5, noise -1): v = -0.2, x0_hat = -0.84, score = 1.3, mean = -1 + 0.4 * 0.3625 = -0.855,
    x = -0.855 - 0.316228 = -1.171228, log-density -1/2 + 1.151293 - 0.918939 = -0.267646; Euler: v = -0.771228,
    x = -1.171228 + 0.308491 = -0.862737."""
    x, cond = torch.tensor([[1.0], [-1.0]]), torch.tensor([[1.0], [0.5]])
    noise = torch.tensor([[[0.5], [9.0]], [[-1.0], [9.0]]])  # (B, T, 1): step 1 is an ODE step, its noise unused
    sigmas, g = torch.tensor([0.8, 0.4, 0.0]), torch.tensor([0.5, 0.5])
    step = {"step": D.sde_step} if "step" in inspect.signature(D.rollout).parameters else {}  # the SDE step to use
    latents, log_probs = D.rollout(Linear(), "denoiser", cond, x, noise, sigmas, g, [0], 2.0, nullcontext, **step)[:2]
    expected = torch.tensor([[[1.0], [-0.059386], [-0.171877]], [[-1.0], [-1.171228], [-0.862737]]])
    torch.testing.assert_close(latents, expected, atol=2e-6, rtol=0)
    torch.testing.assert_close(log_probs, torch.tensor([[0.107354, 0.0], [-0.267646, 0.0]]), atol=2e-6, rtol=0)


def test_sigma_schedule_is_the_float64_formula_rounded_once():
    """s = 1 - i / 10 warped by 3 s / (1 + 2 s), computed in float64 and rounded to float32 once; s = 0.7:
    2.1 / 2.4 = 0.875."""
    expected = [3 * (1 - i / 10) / (1 + 2 * (1 - i / 10)) for i in range(11)]
    assert torch.equal(D.sigma_schedule(10, 3.0), torch.tensor(expected, dtype=torch.float64).float())
    assert D.sigma_schedule(10, 3.0)[3] == 0.875


def test_flow_noise_by_hand():
    """Flow-GRPO's g = a sqrt(s / (1 - s)) at sigmas (1, 0.75, 0.5, 0): a = 0.5 gives 0.5 sqrt(3) = 0.866025 at 0.75,
    0.5 at 0.5, and at s = 1 the second sigma stands in for the denominator: 0.5 sqrt(1 / 0.25) = 1."""
    g = D.noise_g(torch.tensor([1.0, 0.75, 0.5, 0.0]), "flow", 0.5)
    torch.testing.assert_close(g, torch.tensor([1.0, 0.5 * math.sqrt(3), 0.5]))


def test_a_near_tie_is_scaled_by_the_floor_of_the_std():
    """Rewards (0, 2e-8, 0, 0) in double: mean 5e-9, deviations (-5e-9, 1.5e-8, -5e-9, -5e-9), sum of squares 3e-16,
    unbiased std sqrt(3e-16 / 3) = 1e-8; plus the floor 1e-8 the advantages are the deviations over 2e-8:
    (-0.25, 0.75, -0.25, -0.25). A floor of another size gives other numbers."""
    adv = D.group_advantages(torch.tensor([0.0, 2e-8, 0.0, 0.0], dtype=torch.float64), 4)
    torch.testing.assert_close(adv, torch.tensor([-0.25, 0.75, -0.25, -0.25]))


def test_combined_advantages_weigh_each_reward_and_leave_zero_weights_out():
    """Two groups of 2: a's advantages are (-1, 1) / sqrt(2) per group (unbiased std of two values d apart is
    d / sqrt(2), deviations d / 2), b's the same with the sign of its order; weight 2 on a, 0.5 on b, 0 on c (whose
    NaN scores must never enter)."""
    scores = {
        "a": torch.tensor([1.0, 3.0, 5.0, 4.0]),
        "b": torch.tensor([2.0, 1.0, 0.0, 10.0]),
        "c": torch.tensor([float("nan")] * 4),
    }
    r = 1 / math.sqrt(2)
    expected = 2 * torch.tensor([-r, r, r, -r]) + 0.5 * torch.tensor([r, -r, -r, r])
    torch.testing.assert_close(
        D.combined_advantages(scores, {"a": 2.0, "b": 0.5, "c": 0.0}, group_size=2, adv_clip_max=math.inf), expected
    )


def test_sde_step_at_a_mid_sigma_by_hand():
    """x = 1, v = 0.5 from sigma 0.6 to 0.2 with g = 0.4: x0_hat = 0.7, score = -(1 - 0.4 * 0.7) / 0.36 = -2,
    mean = 1 - 0.4 (0.5 + 0.08 * 2) = 0.736, std = 0.4 sqrt(0.4) = 0.252982; noise 1: x' = 0.988982,
    log-density -1/2 - log 0.252982 - 0.918939 = -0.044502."""
    x_next, log_prob, mean, std = D.sde_step(
        torch.tensor([[1.0]]), torch.tensor([[0.5]]), 0.6, 0.2, 0.4, noise=torch.tensor([[1.0]])
    )
    torch.testing.assert_close(mean, torch.tensor([[0.736]]))
    torch.testing.assert_close(std.flatten(), torch.tensor([0.252982]), atol=1e-6, rtol=0)
    torch.testing.assert_close(x_next, torch.tensor([[0.988982]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(log_prob, torch.tensor([-0.044502]), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- flags: every bound at its edge, each message naming it
STEPS = "--samples-per-update must be a multiple of --rollout-batch-size and divide --samples-per-device"
CPS_LOG_DENSITY = (
    "--objective guard needs a Gaussian log-density: --sde-type cps's log-prob drops its constants (the official "
    "GRPO-Guard and Flow-DPPO refuse it too); pass --sde-type flow or dance"
)
FLASH = dict(sde_window=4, ode_solver="dpm2")
REFUSED = [  # each message whole: a constant bound is the declaration's message, one that reads another flag its own
    (dict(num_steps=1), "--num-steps must be >= 2 (got 1)"),
    (dict(num_steps=4, sde_window=4), "--sde-window must be in [0, 3] (= --num-steps - 1)"),
    (dict(sde_window=-1), "--sde-window must be >= 0 (got -1)"),
    (dict(timestep_fraction=0.0), "--timestep-fraction must be > 0 (got 0.0)"),
    (dict(timestep_fraction=1.5), "--timestep-fraction must be <= 1 (got 1.5)"),
    (dict(noise_level=0.0), "--noise-level must be > 0 (got 0.0)"),
    (dict(sde_window=2, window_shift_every=0), "--window-shift-every must be >= 1 (got 0)"),
    (dict(group_size=1), "--group-size must be >= 2 (got 1)"),
    (
        dict(samples_per_device=12, rollout_batch_size=8),
        "--samples-per-device must be a multiple of --rollout-batch-size",
    ),
    (dict(samples_per_update=6, rollout_batch_size=4), STEPS),
    (dict(samples_per_update=8, samples_per_device=12, rollout_batch_size=4), STEPS),
    (dict(kl_beta=-0.1), "--kl-beta must be >= 0 (got -0.1)"),
    (dict(clip_range=0.0), "--clip-range must be > 0 (got 0.0)"),
    (dict(adv_clip_max=0.0), "--adv-clip-max must be > 0 (got 0.0)"),
    (dict(objective="dppo", kl_mask_threshold=0.0), "--kl-mask-threshold must be > 0 (got 0.0)"),
    (dict(sde_type="cps", objective="guard"), CPS_LOG_DENSITY),
    (dict(sde_type="cps", noise_level=1.0), "--noise-level must be < 1 with --sde-type cps (sin(eta pi/2))"),
    (dict(**FLASH, post_window_compress=0.0), "--post-window-compress must be > 0 (got 0.0)"),
    (dict(**FLASH, post_window_compress=1.5), "--post-window-compress must be <= 1 (got 1.5)"),
    (
        dict(**FLASH, shift="pipeline"),
        "--ode-solver dpm2 re-grids the steps after the window with a static shift: pass a number as --shift",
    ),
]
ACCEPTED = [  # each bound itself, and the run's name the mode gives
    (dict(num_steps=2, timestep_fraction=1.0), "dancegrpo"),
    (dict(num_steps=4, sde_window=3), "dancegrpo_mix"),
    (dict(timestep_fraction=1.0), "dancegrpo"),
    (dict(kl_beta=0.0), "dancegrpo"),
    (dict(sde_window=2, window_shift_every=1), "dancegrpo_mix"),
    (dict(group_size=2), "dancegrpo"),
    (dict(**FLASH, post_window_compress=1.0), "dancegrpo_flash"),
    (dict(sde_type="cps", noise_level=0.99), "dancegrpo_cps"),
]


@pytest.mark.parametrize("flags,message", REFUSED)
def test_each_refused_flag_is_one_message_that_starts_with_it(flags, message):
    with pytest.raises(InputError) as e:
        D.resolve_and_check(D.Args(**flags))
    assert str(e.value) == message


@pytest.mark.parametrize("flags,name", ACCEPTED)
def test_each_bound_itself_is_accepted_and_the_mode_sets_its_defaults(flags, name):
    args = D.Args(**flags)
    D.resolve_and_check(args)
    assert args.exp_name == name


def test_the_modes_defaults_by_hand():
    """DanceGRPO's SDE (dance) noise 0.3, Flow-GRPO's (flow) 0.7; a MixGRPO window trains every windowed step
    (fraction 1), DanceGRPO 0.6 of them; a name given is kept."""
    dance, flow = D.Args(sde_type="dance"), D.Args(sde_type="flow", sde_window=2, exp_name="mine")
    D.resolve_and_check(dance)
    D.resolve_and_check(flow)
    assert (dance.noise_level, dance.timestep_fraction, dance.exp_name) == (0.3, 0.6, "dancegrpo")
    assert (flow.noise_level, flow.timestep_fraction, flow.exp_name) == (0.7, 1.0, "mine")
    given = D.Args(noise_level=0.45, timestep_fraction=0.25)
    D.resolve_and_check(given)
    assert (given.noise_level, given.timestep_fraction) == (0.45, 0.25)


def clipped_loss(log_prob, old_log_prob, adv, clip_range):
    """policy_loss's PPO clip without a KL term (the rollout's and the policy's step means equal, where its signature
    takes them)."""
    if "old_mean" not in inspect.signature(D.policy_loss).parameters:
        return D.policy_loss(log_prob, old_log_prob, adv, None, None, None, clip_range=clip_range, kl_beta=0.0)
    mean, std = torch.zeros(len(adv), 1, dtype=log_prob.dtype), torch.ones(len(adv), 1, dtype=log_prob.dtype)
    flags = {"objective": "clip", "clip_range": clip_range, "kl_mask_threshold": 1e-5, "kl_beta": 0.0}
    return D.policy_loss(log_prob, old_log_prob, adv, mean, mean, None, std, 0.1, **flags)


def test_the_policy_figures_by_hand():
    """log-ratios d = (log 1.25, 0, -log 2) on old log-probs of -0.7 (not 0: a figure that reads a sum of the two
    log-probs would agree at 0): approx_kl = mean(0.5 d^2) = (0.5 * 0.049793 + 0 + 0.5 * 0.480453) / 3 = 0.088374;
    with eps = 0.25 the ratio 1.25 sits exactly on the clip edge, which is not clipped (clip(1.25) = 1.25): clipfrac
    counts only the 0.5, so 1/3."""
    d = [math.log(1.25), 0.0, -math.log(2.0)]
    old = torch.full((3,), -0.7, dtype=torch.float64)
    log_prob = old + torch.tensor(d, dtype=torch.float64)
    edge = float(torch.exp(log_prob[0] - old[0])) - 1  # 0.25 as the ratio computes it
    _, figures = clipped_loss(log_prob, old, torch.ones(3), edge)
    assert figures["approx_kl"].item() == pytest.approx(sum(0.5 * x * x for x in d) / 3, rel=1e-12)
    assert figures["approx_kl"].item() == pytest.approx(0.088374, abs=1e-6)
    assert figures["clipfrac"].item() == pytest.approx(1 / 3)


def test_an_sde_step_in_float64_is_exact_to_float64():
    """sigma 0.7 -> 0.3 (not float32 numbers), g = 0.3, x = 1, v = 0.2: x0_hat = 0.86, score = -(1 - 0.3 * 0.86) / 0.49,
    mean = 1 - 0.4 (0.2 - 0.045 score), std = 0.3 sqrt(0.4): computed in float64 throughout, as the inputs are."""
    x, v = torch.tensor([[1.0]], dtype=torch.float64), torch.tensor([[0.2]], dtype=torch.float64)
    _, _, mean, std = D.sde_step(x, v, 0.7, 0.3, 0.3, noise=torch.zeros(1, 1, dtype=torch.float64))
    score = -(1 - 0.3 * 0.86) / 0.49
    assert mean.dtype == torch.float64
    assert mean.item() == pytest.approx(1 - 0.4 * (0.2 - 0.045 * score), rel=1e-13)
    assert std.item() == pytest.approx(0.3 * math.sqrt(0.4), rel=1e-13)
