"""dgpo.py's own copies of the ODE pieces (the sigma grid, DPM-Solver++(2M), the rollout) and its per-image error, at
values where a wrong constant, sign, bound or index shows: each against numbers worked out by hand here."""

from contextlib import nullcontext

import torch

import dgpo as D


def test_sigma_schedule_is_the_float64_formula_rounded_once():
    """s = 1 - i / 10 warped by 3 s / (1 + 2 s), computed in float64 and rounded to float32 once; s = 0.7: 2.1 / 2.4 =
    0.875, s = 0.1: 0.3 / 1.2 = 0.25; shift 1 is the plain linspace."""
    expected = [3 * (1 - i / 10) / (1 + 2 * (1 - i / 10)) for i in range(11)]
    assert torch.equal(D.sigma_schedule(10, 3.0), torch.tensor(expected, dtype=torch.float64).float())
    assert D.sigma_schedule(10, 3.0)[3] == 0.875 and D.sigma_schedule(10, 3.0)[9] == 0.25
    torch.testing.assert_close(D.sigma_schedule(4, 1.0), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))


def test_dpm_solver_2m_step_by_hand():
    """x = 2, x0_hat = 0.5, x0_prev = 0.2 from sigma_prev 0.9 through sigma 0.6 to sigma_next 0.3: ratio s'/s = 1/2,
    lambda(s) = log((1 - s) / s): lambda(0.9) = -2.197225, lambda(0.6) = -0.405465, lambda(0.3) = 0.847298,
    r = 1.791759 / 1.252763 = 1.430246; x' = 1/2 * 2 + 1/2 * (0.5 + 0.3 / (2 r)) = 1 + 0.302439 = 1.302439."""
    x, x0_hat, x0_prev = (torch.tensor([v], dtype=torch.float64) for v in (2.0, 0.5, 0.2))
    torch.testing.assert_close(
        D.dpm_solver_2m_step(x, x0_hat, x0_prev, 0.9, 0.6, 0.3), torch.tensor([1.3024385]).double()
    )
    # first order (x' = 1/2 * 2 + 1/2 * 0.5 = 1.25): no previous prediction, or one made at sigma_prev = 1
    first = torch.tensor([1.25], dtype=torch.float64)
    torch.testing.assert_close(D.dpm_solver_2m_step(x, x0_hat, None, 0.9, 0.6, 0.3), first)
    torch.testing.assert_close(D.dpm_solver_2m_step(x, x0_hat, x0_prev, 1.0, 0.6, 0.3), first)
    # the last step lands on the data prediction (lambda(0) would be infinite)
    torch.testing.assert_close(D.dpm_solver_2m_step(x, x0_hat, x0_prev, 0.9, 0.6, 0.0), x0_hat)


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
    euler = D.rollout(Linear(), "denoiser", cond, x, torch.tensor([1.0, 0.6, 0.0]), "euler", 2.0, nullcontext)
    # image 2: v = -6 + 1 = -5, x = -2 - 0.4 * -5 = 0; v = 0 + 0.6, x = 0 - 0.6 * 0.6 = -0.36
    torch.testing.assert_close(euler, torch.tensor([[-0.32], [-0.36]]))
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    dpm = D.rollout(Linear(), "denoiser", cond, x, sigmas, "dpm2", 2.0, nullcontext)
    # image 2 by the same steps: v = -5, x0_hat = 3, x = -1.5 + 0.75 = -0.75; v = -2.25 + 0.75 = -1.5,
    # x0_hat = -0.75 + 1.125 = 0.375, x = -0.5 + 0.125 = -0.375; v = -1.125 + 0.5 = -0.625, x0_hat = -0.0625,
    # D = -0.0625 + (-0.0625 - 0.375) / 2 = -0.28125, x = -0.1875 - 0.140625 = -0.328125;
    # v = -0.984375 + 0.25 = -0.734375, x = x0_hat = -0.328125 + 0.18359375 = -0.14453125
    torch.testing.assert_close(dpm, torch.tensor([[-0.0859375], [-0.14453125]]))


def test_velocity_error_is_each_images_mean_square():
    """Image 1: v - target = [1, -2, 0, 3] (as 1 x 2 x 2): (1 + 4 + 0 + 9) / 4 = 3.5; image 2: all 0.5: 0.25. A mean
    over the batch (5.5 / 4 / 2) or a sum over the image (14) would differ."""
    v = torch.tensor([[1.0, -2.0, 0.0, 3.0], [1.5, 1.5, 1.5, 1.5]]).view(2, 1, 2, 2)
    target = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]).view(2, 1, 2, 2)
    torch.testing.assert_close(D.velocity_error(v, target), torch.tensor([3.5, 0.25]))


def test_a_group_sum_spans_exactly_its_own_rows():
    """dgpo_loss with 3 groups of 2 where only the middle group is away from its reference (d - d_ref = [0.1, -0.1],
    A = [1, -1]): its margin is 4 / 2 (0.1 + 0.1) = 0.4, the others' 0 (weight 1/2), so the weights are sigmoid(0)
    = 0.5, 0.5, sigmoid(0.4) = 0.5986877, 0.5986877, 0.5, 0.5 (a group taken as interleaved rows, or of another size,
    would mix them)."""
    d = torch.tensor([0.2, 0.2, 0.4, 0.2, 0.3, 0.3])
    d_ref = torch.tensor([0.2, 0.2, 0.3, 0.3, 0.3, 0.3])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    _, figures = D.dgpo_loss(d, d_ref, adv, beta=4.0, group_size=2)
    torch.testing.assert_close(figures["margin"], torch.tensor([0.0, 0.4, 0.0]))
    w = 1 / (1 + torch.exp(torch.tensor(-0.4))).item()
    torch.testing.assert_close(figures["group_weight"], torch.tensor([0.5, 0.5, w, w, 0.5, 0.5]))
