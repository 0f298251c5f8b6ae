"""vgrpo.py's functions at values where a wrong constant, sign, bound or index shows: each against numbers worked
out by hand here. Written for the mutants benchmarks/testing/mutation.py generated that the other tests let pass."""

from contextlib import nullcontext

import pytest
import torch

import vgrpo as V
from common import InputError


def test_sigma_schedule_is_the_float64_formula_rounded_once():
    """s = 1 - i / 10 warped by 3 s / (1 + 2 s), computed in float64 and rounded to float32 once; s = 0.7:
    2.1 / 2.4 = 0.875."""
    expected = [3 * (1 - i / 10) / (1 + 2 * (1 - i / 10)) for i in range(11)]
    assert torch.equal(V.sigma_schedule(10, 3.0), torch.tensor(expected, dtype=torch.float64).float())
    assert V.sigma_schedule(10, 3.0)[3] == 0.875


class Linear:
    """A model whose velocity is v = guidance * cond * x + t: every step of a rollout can be done by hand."""

    def velocity(self, denoiser, x, t, cond, guidance_scale):
        assert denoiser == "denoiser"
        return guidance_scale * cond * x + t.view(-1, 1)


def test_rollout_by_hand_with_both_solvers():
    """Image 1: x = 1, cond = 1, guidance 2, so v = 2 x + t.
    Euler on sigmas (1, 0.6, 0): v = 3, x = 1 - 0.4 * 3 = -0.2; v = -0.4 + 0.6 = 0.2, x = -0.2 - 0.6 * 0.2 = -0.32.
    DPM-Solver++(2M) on (1, 0.75, 0.5, 0.25, 0): v = 3, x0_hat = -2, x = 0.75 - 0.25 * 2 = 0.25 (first order);
    v = 1.25, x0_hat = 0.25 - 0.9375 = -0.6875, x = 2/3 * 0.25 - 1/3 * 0.6875 = -0.0625 (first order: s_prev = 1);
    v = 0.375, x0_hat = -0.25, r = (0 - log 1/3) / (log 3 - 0) = 1, D = -0.25 + 0.4375 / 2 = -0.03125,
    x = 0.5 * -0.0625 + 0.5 * -0.03125 = -0.046875 (second order);
    v = 0.15625, x = x0_hat = -0.046875 - 0.0390625 = -0.0859375 (the last step).
    Image 2: x = -2, cond = 1.5, so v = 3 x + t (below)."""
    x, cond = torch.tensor([[1.0], [-2.0]]), torch.tensor([[1.0], [1.5]])
    euler = V.rollout(Linear(), "denoiser", cond, x, torch.tensor([1.0, 0.6, 0.0]), "euler", 2.0, nullcontext)
    # image 2: v = -6 + 1 = -5, x = -2 - 0.4 * -5 = 0; v = 0 + 0.6, x = 0 - 0.6 * 0.6 = -0.36
    torch.testing.assert_close(euler, torch.tensor([[-0.32], [-0.36]]))
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    dpm = V.rollout(Linear(), "denoiser", cond, x, sigmas, "dpm++2m", 2.0, nullcontext)
    # image 2 by the same steps: v = -5, x0_hat = 3, x = -1.5 + 0.75 = -0.75; v = -2.25 + 0.75 = -1.5,
    # x0_hat = -0.75 + 1.125 = 0.375, x = -0.5 + 0.125 = -0.375; v = -1.125 + 0.5 = -0.625, x0_hat = -0.0625,
    # D = -0.0625 + (-0.0625 - 0.375) / 2 = -0.28125, x = -0.1875 - 0.140625 = -0.328125;
    # v = -0.984375 + 0.25 = -0.734375, x = x0_hat = -0.328125 + 0.18359375 = -0.14453125
    torch.testing.assert_close(dpm, torch.tensor([[-0.0859375], [-0.14453125]]))


# ---------------------------------------------------------------- flags: every bound at its edge, each message naming it
REFUSED = [  # each message whole: a constant bound is the declaration's message, one that reads another flag its own
    (dict(num_steps=0, n_mc=1), "--num-steps must be >= 1 (got 0)"),
    (dict(n_mc=0), "--n-mc must be >= 1 (got 0)"),
    (
        dict(num_steps=4, n_mc=5),
        "--n-mc 5 must be <= --num-steps 4 with stratified timesteps on the rollout grid (one per chunk of the schedule); pass --pair-times uniform or --no-stratified",
    ),
    (dict(group_size=1), "--group-size must be >= 2 (got 1)"),
    (dict(rollout_batch_size=24), "--samples-per-device must be a multiple of --rollout-batch-size"),
    (
        dict(samples_per_update=12),
        "--samples-per-update must be a multiple of --train-batch-size and divide --samples-per-device",
    ),
    (
        dict(samples_per_update=48),
        "--samples-per-update must be a multiple of --train-batch-size and divide --samples-per-device",
    ),
    (dict(kl_beta=-0.1), "--kl-beta must be >= 0 (got -0.1)"),
    (dict(clip_range=0.0), "--clip-range must be > 0 (got 0.0)"),
    (dict(adv_clip_max=0.0), "--adv-clip-max must be > 0 (got 0.0)"),
    (dict(adv_soft_clip=-0.1), "--adv-soft-clip must be >= 0 (got -0.1)"),
    (dict(ema=True, ema_max_decay=1.0), "--ema-max-decay must be < 1 (got 1.0)"),
    (dict(ema=True, ema_max_decay=2.0), "--ema-max-decay must be < 1 (got 2.0)"),
]
ACCEPTED = [
    dict(num_steps=1, n_mc=1),
    dict(num_steps=4, n_mc=4),
    dict(num_steps=4, n_mc=5, stratified=False),
    dict(num_steps=4, n_mc=5, pair_times="uniform"),
    dict(kl_beta=0.0, adv_soft_clip=0.0),
    dict(group_size=2),
    dict(adv_clip_max=0.5),
    dict(ema=True, ema_max_decay=0.0),
]


@pytest.mark.parametrize("flags,message", REFUSED)
def test_each_refused_flag_is_one_message_that_starts_with_it(flags, message):
    with pytest.raises(InputError) as e:
        V.resolve_and_check(V.Args(**flags))
    assert str(e.value) == message


@pytest.mark.parametrize("flags", ACCEPTED)
def test_each_bound_itself_is_accepted(flags):
    args = V.Args(**flags)
    V.resolve_and_check(args)
    assert args.exp_name == "vgrpo"
    named = V.Args(exp_name="mine", **flags)
    V.resolve_and_check(named)
    assert named.exp_name == "mine"


def test_surrogate_noises_each_pair_by_the_forward_process_and_passes_its_settings():
    """Two images, two pairs each: the model sees z = (1 - t) x + t eps at each pair's t (x 1 and 2, eps 0.5 and -1,
    t 0.25 / 0.75 and 0.5 / 0.1: z = 0.875, 0.625, 0.5, 1.7), the pair's t, the image's conditioning repeated and
    the guidance scale 3; the values are pair_values' of that velocity, with its defaults (x prediction, self-normalised)."""
    seen = {}

    class Model:
        def velocity(self, denoiser, z, t, cond, guidance_scale):
            seen.update(z=z.flatten().tolist(), t=t.tolist(), cond=cond["c"].flatten().tolist(), scale=guidance_scale)
            return 0.5 * z  # any velocity that depends on z

    x = torch.tensor([[1.0], [2.0]])
    t = torch.tensor([[0.25, 0.75], [0.5, 0.1]])
    eps = torch.tensor([[[0.5], [0.5]], [[-1.0], [-1.0]]])
    values, x0_hat = V.surrogate(Model(), None, x, {"c": torch.tensor([[7.0], [8.0]])}, t, eps, 3.0, nullcontext)
    assert seen["z"] == pytest.approx([0.875, 0.625, 0.5, 1.7]) and seen["t"] == pytest.approx([0.25, 0.75, 0.5, 0.1])
    assert seen["cond"] == [7.0, 7.0, 8.0, 8.0] and seen["scale"] == 3.0
    z, rows, eps_rows = (
        torch.tensor([[0.875], [0.625], [0.5], [1.7]]),
        torch.tensor([[1.0], [1.0], [2.0], [2.0]]),
        eps.reshape(4, 1),
    )
    expected, expected_x0 = V.pair_values(0.5 * z, rows, z, eps_rows, t.reshape(4), "x", True)
    torch.testing.assert_close(values, expected.view(2, 2))
    torch.testing.assert_close(x0_hat, expected_x0.view(2, 2, 1))
    assert not torch.allclose(expected, V.pair_values(0.5 * z, rows, z, eps_rows, t.reshape(4), "x", False)[0])
    # off the defaults: the settings reach pair_values (the eps prediction, without self-normalisation)
    values, _ = V.surrogate(
        Model(), None, x, {"c": torch.tensor([[7.0], [8.0]])}, t, eps, 3.0, nullcontext, "eps", False
    )
    expected = V.pair_values(0.5 * z, rows, z, eps_rows, t.reshape(4), "eps", False)[0]
    torch.testing.assert_close(values, expected.view(2, 2))
    assert not torch.allclose(expected, V.pair_values(0.5 * z, rows, z, eps_rows, t.reshape(4), "eps", True)[0])
    assert not torch.allclose(expected, V.pair_values(0.5 * z, rows, z, eps_rows, t.reshape(4), "x", False)[0])


def test_draw_pairs_are_keyed_draws_of_t_and_eps_shared_or_per_image():
    """Timesteps from keyed_generator(*key, 'pairs_t', *k), noise from keyed_generator(*key, 'pairs_eps', *k), k empty
    when shared, the image's index otherwise. On a grid of 10 timesteps, stratified: one index in each of the chunks
    0-3, 4-6, 7-9 (tensor_split), else 3 uniform indices; without a grid, u ~ U(0, 1)^3, stratified (i + u_i) / 3."""
    from common.sampling import keyed_generator as rng

    grid, key = torch.linspace(0.95, 0.05, 10), (3, 5)

    def eps(*k):
        return torch.randn((3, 2), generator=rng(*key, "pairs_eps", *k))

    def strata(*k):
        g = rng(*key, "pairs_t", *k)
        return [lo + int(torch.randint(n, (1,), generator=g)[0]) for lo, n in ((0, 4), (4, 3), (7, 3))]

    t, e = V.draw_pairs(grid, 3, (2,), key, [4, 7])  # stratified and shared: one draw for both images
    assert t.tolist() == [grid[strata()].tolist()] * 2 and torch.equal(e, torch.stack([eps(), eps()]))
    t, e = V.draw_pairs(grid, 3, (2,), key, [4, 7], stratified=False, shared=False)
    idx = [torch.randint(10, (3,), generator=rng(*key, "pairs_t", k)) for k in (4, 7)]
    assert t.tolist() == [grid[i].tolist() for i in idx] and torch.equal(e, torch.stack([eps(4), eps(7)]))
    u = [torch.rand(3, generator=rng(*key, "pairs_t", k)) for k in (4, 7)]
    t, e = V.draw_pairs(None, 3, (2,), key, [4, 7], shared=False)
    torch.testing.assert_close(t, torch.stack([(torch.arange(3) + v) / 3 for v in u]))
    assert torch.equal(e, torch.stack([eps(4), eps(7)]))  # the same noise whatever the timesteps' draw
    t, _ = V.draw_pairs(None, 3, (2,), key, [4, 7], stratified=False, shared=False)
    assert torch.equal(t, torch.stack(u))


def test_stratified_indices_draw_one_index_per_chunk_in_turn():
    """grid 10, 3 chunks (0-3, 4-6, 7-9): one randint(len(chunk), (1,)) per chunk from the one generator, in order."""
    from common.sampling import keyed_generator as rng

    g = rng(1, "strata")
    expected = [lo + int(torch.randint(n, (1,), generator=g)[0]) for lo, n in ((0, 4), (4, 3), (7, 3))]
    assert V.stratified_indices(10, 3, rng(1, "strata")).tolist() == expected


def test_group_advantages_by_hand_each_group_by_its_own_std_and_its_floor():
    """Groups (0, 2e-6) and (1, 4): unbiased stds sqrt(2) 1e-6 and 3 / sqrt(2); A = +-1e-6 / (sqrt(2) 1e-6 + 1e-8) =
    +-0.702137 (the 1e-8 floor added, not subtracted: +-0.712121) and +-1.5 / (3 / sqrt(2) + 1e-8) = +-0.707107."""
    adv = V.group_advantages(torch.tensor([0.0, 2e-6, 1.0, 4.0], dtype=torch.float64), 2)
    near = 1e-6 / (2**0.5 * 1e-6 + 1e-8)
    assert adv.tolist() == pytest.approx([-near, near, -(0.5**0.5), 0.5**0.5], rel=1e-6)


def test_the_policy_figures_by_hand():
    """Two pairs per image whose values move by d +- 0.1 (mean d = log 1.25, 0, -log 2), so the ratios are 1.25, 1,
    0.5 and the clip 0.25: ratio_max_dev = 0.5, log_ratio_max_abs = log 2, clipfrac counts |r - 1| > 0.25 strictly
    (1.25 sits on the edge: 1/3), approx_kl = 0.5 d^2 per image: 0.024897, 0, 0.240227."""
    import math

    d = torch.tensor([math.log(1.25), 0.0, -math.log(2.0)], dtype=torch.float64)
    old = torch.tensor([[-0.7, -0.5]] * 3, dtype=torch.float64)
    values = old + d[:, None] + torch.tensor([0.1, -0.1], dtype=torch.float64)
    edge = float(torch.exp(values[0].mean() - old[0].mean())) - 1  # 0.25 as the ratio computes it
    _, figures = V.policy_loss(values, old, torch.ones(3), None, None, clip_range=edge, kl_beta=0.0)
    assert set(figures) == {"policy", "ratio_mean", "ratio_max_dev", "log_ratio_max_abs", "clipfrac", "approx_kl"}
    assert figures["ratio_mean"].tolist() == pytest.approx([1.25, 1.0, 0.5])
    assert figures["ratio_max_dev"].item() == pytest.approx(0.5)
    assert figures["log_ratio_max_abs"].item() == pytest.approx(math.log(2.0))
    assert figures["clipfrac"].item() == pytest.approx(1 / 3)
    assert figures["approx_kl"].tolist() == pytest.approx([0.024897, 0.0, 0.240227], abs=1e-6)
