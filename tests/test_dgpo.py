"""dgpo.py: the advantages, DGPO's surrogate against its objective, Diffusion-DPO's loss and its pair, the PPO-style
clip, the shared timesteps, the old policy's and the EMA's decays, the direction of an update (a toy and ShapesBench),
the flags refused at start-up, main()'s training step (timesteps, shared noise, advantages, the gradient's scale),
every flag of the script applied in main(), and the script end to end on ShapesBench (both objectives), through
preemption, a full disk and kills, and on 2 processes."""

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from safetensors.torch import load_file

import dgpo as D
from common import InputError
from common import models as M
from common.models import load_model, trainable_denoiser
from common.runs import Run
from common.sampling import keyed_randn
from tests.helpers import LORA_WEIGHTS, assert_final_loads, assert_survives_kills, find_run, metrics, replace_flags
from tests.helpers import run_script as run

TINY_RUN = [
    "--iterations",
    "2",
    "--samples-per-device",
    "8",
    "--group-size",
    "4",
    "--rollout-batch-size",
    "4",
    "--train-batch-size",
    "4",
    "--samples-per-update",
    "4",
    "--num-steps",
    "4",
    "--train-timesteps",
    "2",
    "--trunc-steps",
    "2",
    "--eval-every",
    "2",
    "--eval-samples-per-prompt",
    "1",
    "--eval-steps",
    "4",
    "--eval-max-prompts",
    "12",
    "--sample-every",
    "2",
]  # fmt: skip  (2 groups of 4, 2 optimizer steps per iteration, 2 of the grid's first 3 timesteps)
PROMPTS = ["a red circle on a blue background", "a green square on a white background"]


def run_script(args, tmp_path, *rest, **kw):
    return run("dgpo.py", args, tmp_path, *rest, **kw)


def train_rows(run_dir):
    return [r for r in metrics(run_dir) if "charts/lr" in r]


# ---------------------------------------------------------------- advantages
def test_group_advantages_by_hand():
    """Group [1, 2, 3, 6]: mean 3, deviations -2, -1, 0, 3, population variance (4 + 1 + 0 + 9) / 4 = 3.5, std
    1.8708287, so A = dev / 1.8709287 = -1.0689878, -0.5344939, 0, 1.6034817; a group of equal rewards [5, 5, 5, 5]
    gets 0 (0 / (0 + 1e-4)). --global-std: the population std of all 8, mean 4, deviations -3 -2 -1 2 1 1 1 1, variance
    22 / 8 = 2.75, std 1.6583124, the means still the groups' (3 and 5)."""
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0])
    adv = D.group_advantages(rewards, group_size=4, global_std=False, clip=5.0)
    s = math.sqrt(3.5) + 1e-4
    torch.testing.assert_close(adv, torch.tensor([-2 / s, -1 / s, 0.0, 3 / s, 0.0, 0.0, 0.0, 0.0]))
    assert adv.dtype == torch.float32 and torch.all(adv[4:] == 0)
    g = math.sqrt(2.75) + 1e-4
    adv = D.group_advantages(rewards, group_size=4, global_std=True, clip=5.0)
    torch.testing.assert_close(adv, torch.tensor([-2 / g, -1 / g, 0.0, 3 / g, 0.0, 0.0, 0.0, 0.0]))
    # groups of 2 instead: [1, 2] [3, 6] [5, 5] [5, 5]: std 0.5 and 1.5, A = -+0.5 / 0.5001, -+1.5 / 1.5001, 0
    adv = D.group_advantages(rewards, group_size=2, global_std=False, clip=5.0)
    a, b = 0.5 / 0.5001, 1.5 / 1.5001
    torch.testing.assert_close(adv, torch.tensor([-a, a, -b, b, 0.0, 0.0, 0.0, 0.0]))
    assert torch.all(D.group_advantages(torch.full((8,), 0.7), group_size=4, global_std=True, clip=5.0) == 0)


def test_group_advantages_are_clamped_at_the_clip():
    """49 zeros and one 1 in a group of 50: mean 0.02, std sqrt(0.02 x 0.98) = 0.14, so the 1 gets 0.98 / 0.1401 =
    6.995, clamped to 5, and each 0 gets -0.02 / 0.1401 = -0.1427552 (inside). At clip 1 the group [1, 2, 3, 6] above
    loses its tails: 1.6034817 -> 1 and -1.0689878 -> -1, -0.5344939 stays."""
    rewards = torch.zeros(50)
    rewards[7] = 1.0
    adv = D.group_advantages(rewards, group_size=50, global_std=False, clip=5.0)
    assert adv[7] == 5.0
    torch.testing.assert_close(adv[:7], torch.full((7,), -0.02 / 0.1401))
    adv = D.group_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), group_size=4, global_std=False, clip=1.0)
    torch.testing.assert_close(adv, torch.tensor([-1.0, -1 / (math.sqrt(3.5) + 1e-4), 0.0, 1.0]))


# ---------------------------------------------------------------- DGPO's surrogate
def test_dgpo_loss_by_hand_on_two_groups():
    """G = 2, beta = 10. Group 1: A = [1, -1], d = [0.3, 0.5], d_ref = [0.4, 0.4]: margin = 10 / 2 (1 x -0.1 + -1 x
    0.1) = -1, w = sigmoid(-1) = 0.2689414. Group 2: A = [0.5, -0.5], d = [0.2, 0.1], d_ref = [0.1, 0.3]: margin =
    5 (0.5 x 0.1 + -0.5 x -0.2) = 0.75, w = sigmoid(0.75) = 0.6791787. The loss is the mean of w A d over the 4 rows:
    (0.2689414 (0.3 - 0.5) + 0.6791787 (0.1 - 0.05)) / 4 = (-0.0537883 + 0.0339589) / 4 = -0.0049573. Its gradient in
    d is w A / 4 with w a constant (0.0672354, -0.0672354, 0.0848973, -0.0848973): a weight with a gradient would add
    sigmoid' x 5 A_i x sum(A d) terms."""
    d = torch.tensor([0.3, 0.5, 0.2, 0.1], requires_grad=True)
    d_ref, adv = torch.tensor([0.4, 0.4, 0.1, 0.3]), torch.tensor([1.0, -1.0, 0.5, -0.5])
    loss, figures = D.dgpo_loss(d, d_ref, adv, beta=10.0, group_size=2)
    w1, w2 = 1 / (1 + math.exp(1.0)), 1 / (1 + math.exp(-0.75))
    assert loss.item() == pytest.approx((w1 * -0.2 + w2 * 0.05) / 4, rel=1e-5)
    assert loss.item() == pytest.approx(-0.0049573, abs=1e-7)
    torch.testing.assert_close(figures["margin"], torch.tensor([-1.0, 0.75]))
    torch.testing.assert_close(figures["group_weight"], torch.tensor([w1, w1, w2, w2]))
    assert not figures["group_weight"].requires_grad and not figures["margin"].requires_grad
    loss.backward()
    torch.testing.assert_close(d.grad, torch.tensor([w1, -w1, w2 * 0.5, -w2 * 0.5]) / 4)
    # one group alone: the loss is w (0.3 - 0.5) / 2 = -0.0268941
    one, _ = D.dgpo_loss(torch.tensor([0.3, 0.5]), torch.tensor([0.4, 0.4]), torch.tensor([1.0, -1.0]), beta=10.0,
                         group_size=2)  # fmt: skip
    assert one.item() == pytest.approx(w1 * -0.2 / 2, rel=1e-6)


def dgpo_objective(d, d_ref, adv, beta, group_size):
    """DGPO's objective as the paper writes it: the mean over groups of -log sigmoid(-beta / G sum_i A_i (d_i -
    d_ref,i))."""
    inside = -beta / group_size * (adv * (d - d_ref)).view(-1, group_size).sum(1)
    return -F.logsigmoid(inside).mean()


def test_the_surrogates_gradient_is_dgpos_objectives_divided_by_beta():
    """Two groups of 3, beta 10, advantages away from +-1 and d away from d_ref (margins of either sign, weights away
    from 1/2): d/dd_i of the surrogate (w_g detached) = d/dd_i of the objective / beta, in float64."""
    g = torch.Generator().manual_seed(0)
    d = (0.5 + 0.2 * torch.randn(6, generator=g, dtype=torch.float64)).requires_grad_()
    d_ref = 0.5 + 0.2 * torch.randn(6, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.2, -0.3, -0.9, 0.4, 0.6, -1.0], dtype=torch.float64)
    loss, figures = D.dgpo_loss(d, d_ref, adv, beta=10.0, group_size=3)
    (surrogate,) = torch.autograd.grad(loss, d)
    (objective,) = torch.autograd.grad(dgpo_objective(d, d_ref, adv, 10.0, 3), d)
    torch.testing.assert_close(surrogate, objective / 10.0, rtol=1e-12, atol=0)
    assert (figures["margin"].abs() > 0.1).all() and (figures["group_weight"] - 0.5).abs().min() > 0.02
    # at beta 0.5 as well (a beta missing from the weight, or in the gradient, would break one of the two)
    loss, _ = D.dgpo_loss(d, d_ref, adv, beta=0.5, group_size=3)
    (surrogate,) = torch.autograd.grad(loss, d)
    (objective,) = torch.autograd.grad(dgpo_objective(d, d_ref, adv, 0.5, 3), d)
    torch.testing.assert_close(surrogate, objective / 0.5, rtol=1e-12, atol=0)


# ---------------------------------------------------------------- Diffusion-DPO
def diffusion_dpo(d_w, d_l, ref_w, ref_l, beta):
    """Diffusion-DPO's loss per pair (arXiv 2311.12908, as its training code computes it)."""
    return -F.logsigmoid(-0.5 * beta * ((d_w - ref_w) - (d_l - ref_l)))


def test_dpo_loss_is_diffusion_dpos_with_a_pair_without_preference_weighted_0():
    """3 pairs (winner, loser), beta 50; the third pair has no preference: its term is 0, and the mean is still over 3
    pairs. Pair 1 by hand: -0.5 x 50 ((0.30 - 0.32) - (0.40 - 0.38)) = -25 x -0.04 = 1, -log sigmoid(1) =
    0.3132617; the model prefers the winner there, not in pair 2: dpo_accuracy counts the pairs with a preference only
    (1, 0), not the third, whose "winner" is arbitrary."""
    d = torch.tensor([0.30, 0.40, 0.25, 0.20, 0.11, 0.13], requires_grad=True)
    d_ref = torch.tensor([0.32, 0.38, 0.24, 0.22, 0.10, 0.10])
    has_pref = torch.tensor([1.0, 1.0, 0.0])
    loss, figures = D.dpo_loss(d, d_ref, has_pref, beta=50.0)
    per_pair = diffusion_dpo(d[0::2], d[1::2], d_ref[0::2], d_ref[1::2], 50.0)
    assert per_pair[0].item() == pytest.approx(-math.log(1 / (1 + math.exp(-1.0))), rel=1e-5)
    torch.testing.assert_close(loss, (per_pair * has_pref).sum() / 3)
    # pair 2: -25 ((0.25 - 0.24) - (0.20 - 0.22)) = -25 x 0.03 = -0.75; pair 3: -25 (0.01 - 0.03) = 0.5
    torch.testing.assert_close(figures["dpo_margin"], torch.tensor([1.0, -0.75, 0.5]))
    torch.testing.assert_close(figures["dpo_accuracy"], torch.tensor([1.0, 0.0]))
    loss.backward()
    assert torch.all(d.grad[4:] == 0) and torch.all(d.grad[:4] != 0)  # no gradient from the pair without preference
    assert d.grad[0] > 0 and d.grad[1] < 0  # descending lowers the winner's error and raises the loser's


def test_dgpo_on_groups_of_two_is_dpo_with_beta_scaled_by_the_advantage():
    """Groups of 2 with per-group std: A = +-(delta / 2) / (delta / 2 + 1e-4) = +-1 / (1 + 2e-4 / delta) for a reward
    gap delta (here 0.5 in both groups: A_w = 1 / 1.0004 = 0.9996002), and DGPO's objective -log sigmoid(-beta / 2
    (A_w (d_w - d_ref,w) - A_w (d_l - d_ref,l))) is Diffusion-DPO's at beta A_w, the pair taken by best_and_worst (the
    first group's winner is its second image)."""
    rewards = torch.tensor([0.2, 0.7, 0.9, 0.4])
    adv = D.group_advantages(rewards, group_size=2, global_std=False, clip=5.0)
    a_w = 1 / (1 + 2e-4 / 0.5)
    torch.testing.assert_close(adv, torch.tensor([-a_w, a_w, a_w, -a_w]))
    g = torch.Generator().manual_seed(1)
    d, d_ref = 0.4 + 0.1 * torch.rand(4, generator=g), 0.4 + 0.1 * torch.rand(4, generator=g)
    winner, loser, has_pref = D.best_and_worst(rewards, 2)
    pairs = torch.stack([winner, loser], 1).flatten()
    assert pairs.tolist() == [1, 0, 2, 3] and has_pref.tolist() == [True, True]
    beta = 20.0
    dpo, _ = D.dpo_loss(d[pairs], d_ref[pairs], has_pref.float(), beta=beta * a_w)
    torch.testing.assert_close(dpo, dgpo_objective(d, d_ref, adv, beta, 2), rtol=1e-6, atol=1e-7)


def test_best_and_worst_by_hand_with_ties():
    """Groups of 4: [0.1, 0.9, 0.9, 0.1] -> the first best (1) and the first worst (0); [0.3, 0.2, 0.5, 0.2] -> 6 and
    5 (the first of the tied worst); [0.4] x 4 -> no preference (winner = loser = its first image, 8); [0.0, 0.0,
    0.0, 1.0] -> 15 and 12."""
    rewards = torch.tensor([0.1, 0.9, 0.9, 0.1, 0.3, 0.2, 0.5, 0.2, 0.4, 0.4, 0.4, 0.4, 0.0, 0.0, 0.0, 1.0])
    winner, loser, has_pref = D.best_and_worst(rewards, 4)
    assert winner.tolist() == [1, 6, 8, 15] and loser.tolist() == [0, 5, 8, 12]
    assert has_pref.tolist() == [True, True, False, True]
    winner, loser, has_pref = D.best_and_worst(rewards, 8)  # groups of 8: 1 (first 0.9) and 0 (first 0.1); 15, 12
    assert winner.tolist() == [1, 15] and loser.tolist() == [0, 12] and has_pref.tolist() == [True, True]


# ---------------------------------------------------------------- the PPO-style clip
def test_ppo_clip_each_case_by_hand():
    """eps 0.1, ratio = exp(d_old - d) with d = 1: log ratios 0.2 (ratio 1.2214 > 1.1), -0.2 (0.8187 < 0.9), 0.05
    (1.0513, inside), for A > 0 (rows 0-2) and A < 0 (rows 3-5). Clipped: A > 0 above (row 0), A < 0 below (row 4);
    the other four keep their gradient, and no row changes value."""
    d = torch.ones(6, requires_grad=True)
    log_ratio = torch.tensor([0.2, -0.2, 0.05, 0.2, -0.2, -0.05])
    adv = torch.tensor([1.0, 2.0, 0.5, -1.0, -2.0, -0.5])
    out, clipped, ratio = D.ppo_clip(d, 1 + log_ratio, adv, 0.1)
    assert clipped.tolist() == [True, False, False, False, True, False]
    torch.testing.assert_close(out, torch.ones(6))
    torch.testing.assert_close(ratio, log_ratio.exp())  # 1.2214, 0.8187, 1.0513, 1.2214, 0.8187, 0.9512
    assert not ratio.requires_grad
    (out * torch.arange(1.0, 7.0)).sum().backward()
    assert d.grad.tolist() == [0.0, 2.0, 3.0, 4.0, 0.0, 6.0]
    # at eps 0.3 every row is inside (0.8187 > 0.7, 1.2214 < 1.3): nothing clipped
    _, clipped, _ = D.ppo_clip(torch.ones(6), 1 + log_ratio, adv, 0.3)
    assert not clipped.any()


# ---------------------------------------------------------------- timesteps, decays
def test_shared_timesteps_are_distinct_keyed_and_within_the_truncation():
    """M = 4 distinct grid indices of 0 .. 6; the same for the same (seed, iteration), others at another iteration or
    seed; over 30 iterations at trunc 2 every index 0, 1, 2 is drawn and none above; M = trunc + 1 is all of them."""
    steps = D.shared_timesteps(6, 4, (3, 5))
    assert len(steps) == 4 and len(set(steps)) == 4 and all(0 <= j <= 6 for j in steps)
    assert D.shared_timesteps(6, 4, (3, 5)) == steps
    assert D.shared_timesteps(6, 4, (3, 6)) != steps and D.shared_timesteps(6, 4, (4, 5)) != steps
    drawn = [D.shared_timesteps(2, 2, (0, it)) for it in range(30)]
    assert set().union(*drawn) == {0, 1, 2} and all(len(set(s)) == 2 for s in drawn)
    assert len({tuple(s) for s in drawn}) > 1
    assert sorted(D.shared_timesteps(3, 4, (1, 0))) == [0, 1, 2, 3]


def test_ref_decay_ema_decay_and_soft_update_by_hand():
    """The old policy: min(0.3, 0.001 s); the EMA: min((1 + s) / (10 + s), max): 0.1 at 0, 2/11 at 1, 0.55 at 10,
    the cap 0.9 from 80 (81 / 90 = 0.9); soft_update: decay x target + (1 - decay) x source, decay 0 a bitwise copy."""
    for s, decay in {0: 0.0, 1: 0.001, 150: 0.15, 299: 0.299, 300: 0.3, 301: 0.3, 10_000: 0.3}.items():
        assert D.ref_decay(s) == pytest.approx(decay, abs=1e-12)
    for s, decay in {0: 0.1, 1: 2 / 11, 10: 0.55, 80: 0.9, 81: 0.9, 10_000: 0.9}.items():
        assert D.ema_decay(s, 0.9) == pytest.approx(decay)
    assert D.ema_decay(1, 0.15) == 0.15 and D.ema_decay(0, 0.15) == pytest.approx(0.1)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, generator=g), torch.randn(5, generator=g)
    target = [a.clone()]
    D.soft_update(target, [b], 0.3)
    torch.testing.assert_close(target[0], 0.3 * a + 0.7 * b)
    D.soft_update(target, [b * 2], 0.0)
    assert torch.equal(target[0], b * 2)
    with pytest.raises(ValueError):
        D.soft_update([a.clone()], [a, b], 0.5)


# ---------------------------------------------------------------- the direction of an update
def test_a_step_on_the_surrogate_lowers_d_of_positive_and_raises_d_of_negative_advantages():
    """d_i = mean((theta - c_i)^2) with c_i orthonormal (4 unit vectors, theta = 0 in R^4): grad d_i = -2 c_i / 4, so
    the surrogate's gradient is -sum_i w_g A_i c_i / 2 / 4 and one SGD step moves theta by lr w_g A_i / 8 along each
    c_i: d_i falls where A_i > 0 and rises where A_i < 0. Two groups of 2, A = [1, -1, 0.5, -0.5], beta 10, d_ref
    away from d (weights sigmoid(+-5 x ...) away from 1/2)."""
    c = torch.eye(4)
    theta = torch.zeros(4, requires_grad=True)

    def errors():
        return (theta - c).square().mean(1)  # (4,): 1/4 each at theta = 0

    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    d_ref = torch.tensor([0.2, 0.3, 0.35, 0.1])
    before = errors().detach()
    loss, figures = D.dgpo_loss(errors(), d_ref, adv, beta=10.0, group_size=2)
    loss.backward()
    with torch.no_grad():
        theta -= 0.5 * theta.grad
    change = errors().detach() - before
    assert change[0] < 0 and change[2] < 0 and change[1] > 0 and change[3] > 0, change
    # by hand: theta_i = 0.5 w A_i / 8, d_i = ((theta_i - 1)^2 + sum_{j != i} theta_j^2) / 4
    w = figures["group_weight"]
    step = 0.5 * w * adv / 8
    expected = ((step - 1) ** 2 + (step.square().sum() - step.square())) / 4
    torch.testing.assert_close(errors().detach(), expected)


@pytest.fixture(scope="module")
def shapes():
    return load_model("shapesbench")


def test_an_update_on_shapesbench_lowers_d_of_positive_advantages_and_raises_it_of_negative_ones(shapes):
    """ShapesBench's transformer, one group of 2 images sharing their noise and timestep (t = 0.8), d_ref away from d
    at the start (+0.02 and -0.05: group weights sigmoid(beta / 2 sum A (d - d_ref)) away from 1/2, the sign of no
    step depending on them): one SGD step on the surrogate with A = [1, 1] lowers both errors, with A = [-1, -1]
    raises both, with A = [1, -1] lowers the first against the second; at beta 100 (the official) and 5."""
    model = shapes
    tr = model.transformer
    start = {k: v.clone() for k, v in tr.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, *model.latent_shape(), generator=g).clamp(-1, 1)
    eps = torch.randn(1, *model.latent_shape(), generator=g).expand(2, -1, -1, -1)
    t = torch.full((2,), 0.8)
    x_t, target = 0.2 * x0 + 0.8 * eps, eps - x0
    cond = model.encode_prompts(PROMPTS)

    def errors():
        return D.velocity_error(model.velocity(tr, x_t, t, cond), target)

    with torch.no_grad():
        d_start = errors()
    d_ref = d_start + torch.tensor([0.02, -0.05])
    try:
        for beta in (100.0, 5.0):
            change = {}
            for adv in ((1.0, 1.0), (-1.0, -1.0), (1.0, -1.0)):
                tr.load_state_dict(start)
                tr.zero_grad()
                loss, figures = D.dgpo_loss(errors(), d_ref, torch.tensor(adv), beta=beta, group_size=2)
                assert abs(figures["group_weight"][0] - 0.5) > 0.01
                loss.backward()
                with torch.no_grad():
                    for p in tr.parameters():
                        if p.grad is not None:
                            p -= 1e-3 * p.grad
                    change[adv] = errors() - d_start
            assert torch.all(change[1.0, 1.0] < 0) and torch.all(change[-1.0, -1.0] > 0), (beta, change)
            assert change[1.0, -1.0][0] < change[1.0, -1.0][1], (beta, change)
    finally:
        tr.load_state_dict(start)


# ---------------------------------------------------------------- start-up refusals
REFUSED = [  # (flags, the flag the one line must name)
    (dict(train_batch_size=12), "--train-batch-size 12 must be a multiple of 8 (whole groups)"),
    (dict(group_size=4, samples_per_update=8, train_batch_size=6), "--train-batch-size 6 must be a multiple of 4"),
    (dict(objective="dpo", train_batch_size=3), "--train-batch-size 3 must be a multiple of 2 (whole pairs)"),
    # dpo: the 16 images of an update (the default) in groups of 8 are 4 rows (2 pairs): 8 divides none of them
    (dict(objective="dpo", train_batch_size=8), "divide the 4 training rows of an update"),
    (dict(train_timesteps=8), "--train-timesteps 8"),  # 8 distinct of 0 .. 6: 7 exist
    (dict(num_steps=4, trunc_steps=4, train_timesteps=2), "--trunc-steps 4"),  # indices 0 .. 3 exist at 4 steps
    (dict(objective="dpo", clip_range=0.05), "--clip-range only applies with --objective dgpo"),
    (dict(objective="dpo", clip_range=math.inf), "--clip-range only applies with --objective dgpo"),
    (dict(objective="dpo", adv_clip_max=2.0), "--adv-clip-max only applies with --objective dgpo"),
    (dict(objective="dpo", global_std=True), "--global-std only applies with --objective dgpo"),
    (dict(ema=False, ema_every=8), "--ema-every only applies with --ema"),
    (dict(ema=False, ema_max_decay=0.5), "--ema-max-decay only applies with --ema"),
    (dict(group_size=1), "--group-size must be >= 2 (got 1)"),
    (dict(beta=0.0), "--beta must be > 0 (got 0.0)"),
    (dict(clip_range=0.0), "--clip-range must be > 0 (got 0.0)"),
    (dict(ema_max_decay=1.0), "--ema-max-decay must be < 1 (got 1.0)"),
    (dict(samples_per_update=12), "--samples-per-update must be a multiple of --group-size"),
    (dict(rollout_batch_size=24), "--samples-per-device must be a multiple of --rollout-batch-size"),
]
ACCEPTED = [
    dict(objective="dpo"),  # the default command of online DPO: 2 pairs per micro-batch
    dict(),  # and DGPO's
    dict(num_steps=4, trunc_steps=3, train_timesteps=4),  # every index of the grid but t = 0
    dict(trunc_steps=0, train_timesteps=1),  # pure noise only
    dict(objective="dpo", train_batch_size=2),  # one pair per micro-batch
    dict(objective="dpo", train_batch_size=4),  # the 2 pairs of an update at once
    dict(clip_range=math.inf),  # no clip, no old-policy forward
    dict(ema=False),
    dict(kl_beta=0.0, ema_every=8, global_std=True, switch_ema_ref=0),
]


@pytest.mark.parametrize("flags,message", REFUSED)
def test_each_refused_flag_is_one_line_naming_it(flags, message):
    with pytest.raises(InputError) as e:
        D.resolve_and_check(D.Args(**flags))
    text = str(e.value)
    assert message in text and "\n" not in text and text.startswith("--"), text


@pytest.mark.parametrize("flags", ACCEPTED)
def test_each_bound_itself_is_accepted_and_the_run_named_by_objective(flags):
    args = D.Args(**flags)
    D.resolve_and_check(args)
    assert args.exp_name == ("dgpo_dpo" if args.objective == "dpo" else "dgpo")


def test_a_refusal_at_start_up_is_one_error_line_and_no_run(tmp_path):
    out = run_script([*TINY_RUN, "--objective", "dpo", "--clip-range", "0.05"], tmp_path, check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == "error: --clip-range only applies with --objective dgpo"
    assert "Traceback" not in out.stderr and not list(tmp_path.glob("*__*"))


# ---------------------------------------------------------------- main()'s training step, recorded
STEP = [
    "--seed",
    "3",
    "--samples-per-device",
    "8",
    "--group-size",
    "4",
    "--rollout-batch-size",
    "4",
    "--train-batch-size",
    "4",
    "--samples-per-update",
    "8",
    "--num-steps",
    "4",
    "--train-timesteps",
    "2",
    "--trunc-steps",
    "3",
    "--beta",
    "7",
    "--kl-beta",
    "0.1",
    "--clip-range",
    "0.05",
    "--learning-rate",
    "1e-3",
    "--max-grad-norm",
    "1e9",
]  # fmt: skip  (one iteration: 2 groups, 1 optimizer step of 2 micro-batches x 2 timesteps)


@pytest.fixture(scope="module")
def dgpo_step(tmp_path_factory):
    """main() for one iteration (tests/test_direction.py's run_main: the functions below and the velocities with
    gradients recorded); at the optimizer step, the accumulated gradient and the weights it was taken at."""
    from tests import test_direction

    at_step = {}
    real_clip = Accelerator.clip_grad_norm_

    def clip(self, params, max_norm):
        params = list(params)
        if not at_step:
            at_step["grads"] = [p.grad.detach().clone() for p in params]
            at_step["weights"] = [p.detach().clone() for p in params]
            at_step["params"] = params
        return real_clip(self, params, max_norm)

    names = ["group_advantages", "shared_timesteps", "velocity_error", "ppo_clip", "dgpo_loss"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Accelerator, "clip_grad_norm_", clip)
        tape, model = test_direction.run_main(D, mp, tmp_path_factory.mktemp("dgpo_step"), STEP, names)
    tape.calls = {k: list(v) for k, v in tape.calls.items()}  # main()'s calls only, not the tests' own forwards
    return tape, model, at_step


def step_calls(tape):
    """Per (micro-batch, timestep), in order: the trained forward (args, kwargs, v), the target eps - x0, d_old, the
    advantages and dgpo_loss's call. velocity_error runs 3 times per timestep: trained, base, old."""
    errors = tape.calls["velocity_error"]
    out = []
    for n, (velocity, clip, loss) in enumerate(zip(tape.calls["velocity"], tape.calls["ppo_clip"],
                                                   tape.calls["dgpo_loss"], strict=True)):  # fmt: skip
        (v_theta, target), _, _ = errors[3 * n]
        (v_ref, _), _, d_ref = errors[3 * n + 1]
        assert torch.equal(v_theta, velocity[2].float()) and torch.equal(errors[3 * n + 2][0][1], target)
        out.append(dict(velocity=velocity, target=target, v_ref=v_ref, d_ref=d_ref, d_old=clip[0][1], adv=clip[0][2],
                        clip=clip, loss=loss))  # fmt: skip
    return out


def test_main_trains_the_shared_timesteps_of_the_truncated_grid(dgpo_step):
    """M = 2 grid indices of 0 .. 3 (--trunc-steps 3 of --num-steps 4), drawn once for the iteration and keyed on
    (seed 3, iteration 0): each micro-batch trains both, every image at the same t = sigmas[j] (shift 3)."""
    tape, _, _ = dgpo_step
    ((a, _, t_idx),) = tape.calls["shared_timesteps"]
    assert a == (3, 2, (3, 0)) and t_idx == D.shared_timesteps(3, 2, (3, 0))
    sigmas = D.sigma_schedule(4, 3.0)
    calls = step_calls(tape)
    assert len(calls) == 2 * 2  # micro-batches x timesteps
    for n, c in enumerate(calls):
        t = c["velocity"][0][2]
        assert t.shape == (4,) and torch.equal(t, sigmas[t_idx[n % 2]].expand(4))


def test_main_forms_x_t_from_the_rollouts_with_noise_shared_by_each_group(dgpo_step):
    """x_t = (1 - t) x0 + t eps, target = eps - x0, so eps = x_t + (1 - t) target: each row's eps is the one keyed on
    (seed 3, iteration 0, 'eps', group, grid index), the same for the 4 images of a group (micro-batch m holds group
    m); x0 = x_t - t target is the same rollout latent at both timesteps, and differs between images."""
    tape, model, _ = dgpo_step
    (t_idx,) = [out for _, _, out in tape.calls["shared_timesteps"]]
    shape = model.latent_shape()
    x0_first = {}
    for n, c in enumerate(step_calls(tape)):
        m, j = n // 2, t_idx[n % 2]
        x_t, t = c["velocity"][0][1], c["velocity"][0][2].view(-1, 1, 1, 1)
        eps = x_t + (1 - t) * c["target"]
        torch.testing.assert_close(eps, keyed_randn(shape, 3, 0, "eps", m, j).expand(4, *shape), rtol=0, atol=1e-5)
        x0 = x_t - t * c["target"]
        torch.testing.assert_close(x0, x0_first.setdefault(m, x0), rtol=0, atol=1e-5)
        assert all((x0[i] - x0[0]).abs().max() > 1e-3 for i in range(1, 4))


def test_main_passes_each_groups_clamped_advantages_in_order(dgpo_step):
    """group_advantages on the 8 gathered rewards in groups of 4 (the group's std, clamp 5, the defaults), the
    numbers worked out here from the rewards; micro-batch m gets rows 4m .. 4m + 3 at both timesteps."""
    tape, _, _ = dgpo_step
    ((rewards,), kw, adv) = tape.calls["group_advantages"][0]
    assert kw == dict(group_size=4, global_std=False, clip=5.0)
    r = rewards.double().view(2, 4)
    expected = ((r - r.mean(1, keepdim=True)) / (r.std(1, correction=0, keepdim=True) + 1e-4)).clamp(-5, 5)
    torch.testing.assert_close(adv, expected.flatten().float())
    for n, c in enumerate(step_calls(tape)):
        m = n // 2
        assert torch.equal(c["adv"], adv[4 * m : 4 * m + 4]) and torch.equal(c["loss"][0][2], c["adv"])
        assert c["clip"][0][3] == 0.05 and c["loss"][1] == dict(beta=7.0, group_size=4)


def test_main_step_gradient_is_the_mean_of_the_per_timestep_gradients(dgpo_step):
    """The gradient at the optimizer step against one computed here from the recorded inputs: per (micro-batch,
    timestep), d = the velocity MSE to eps - x0 through ppo_clip (d_old, eps 0.05) into dgpo_loss (beta 7, G 4), plus
    0.1 x the velocity MSE to the base model; averaged over the 2 x 2 of them (a sum over timesteps or micro-batches
    would be 2 x it)."""
    tape, model, at_step = dgpo_step
    params = at_step["params"]
    updated = [p.detach().clone() for p in params]
    per_call = []
    try:
        with torch.no_grad():
            for p, w in zip(params, at_step["weights"]):
                p.copy_(w)
        for c in step_calls(tape):
            va, vkw, _ = c["velocity"]
            v = model.velocity(*va, **vkw).float()
            d, _, _ = D.ppo_clip(D.velocity_error(v, c["target"]), c["d_old"], c["adv"], 0.05)
            loss, _ = D.dgpo_loss(d, c["d_ref"], c["adv"], beta=7.0, group_size=4)
            loss = loss + 0.1 * (v - c["v_ref"]).square().flatten(1).mean(1).mean()
            per_call.append(torch.autograd.grad(loss, params, allow_unused=True))
    finally:  # the updated weights back, for the other tests of the fixture
        with torch.no_grad():
            for p, w in zip(params, updated):
                p.copy_(w)
    total = 0.0
    for k, (p, g) in enumerate(zip(params, at_step["grads"])):
        mean = sum(c[k] if c[k] is not None else torch.zeros_like(p) for c in per_call) / len(per_call)
        torch.testing.assert_close(g, mean, rtol=1e-4, atol=1e-9)
        total += mean.abs().sum().item()
    assert total > 0


def test_main_update_lowers_the_surrogate_and_d_of_positive_advantages_against_negative_ones(dgpo_step):
    """After main()'s one optimizer step, each recorded row's d again under the new weights: sum_i w_i A_i (d_new -
    d_old) < 0 (the surrogate falls: Adam's first step is a descent direction), and so does sum_i A_i (d_new - d_old):
    the rows of positive advantage lose error against those of negative advantage."""
    tape, model, _ = dgpo_step
    weighted = plain = 0.0
    for c in step_calls(tape):
        va, vkw, v_before = c["velocity"]
        with torch.no_grad():
            v_new = model.velocity(*va, **vkw).float()
        change = D.velocity_error(v_new, c["target"]) - D.velocity_error(v_before.detach().float(), c["target"])
        w = c["loss"][2][1]["group_weight"]
        weighted += float((w * c["adv"] * change).sum())
        plain += float((c["adv"] * change).sum())
    assert weighted < 0 and plain < 0, (weighted, plain)


# ---------------------------------------------------------------- every flag applied in main()
def recorded_finals(monkeypatch):
    finals = []
    save_final = Run.save_final

    def recorded_save_final(self, model, prepared, lora):
        finals.append([p.detach().clone() for p in prepared.parameters() if p.requires_grad])
        return save_final(self, model, prepared, lora)

    monkeypatch.setattr(Run, "save_final", recorded_save_final)
    return finals


def recorded_rollout_adapters(monkeypatch):
    """The adapter active in each rollout call's denoiser: 'default' (the trained weights) or 'old' (the old policy)."""
    adapters, rollout = [], D.rollout

    def recorded(model, denoiser, *a, **kw):
        adapters.append(tuple(denoiser.active_adapters()))
        return rollout(model, denoiser, *a, **kw)

    monkeypatch.setattr(D, "rollout", recorded)
    return adapters


def test_main_applies_the_sampling_advantage_clip_kl_switch_and_ema_flags(monkeypatch, tmp_path):
    """2 iterations of 8 samples in groups of 4, rolled out 2 at a time with Euler on the shift-2 grid, trained 4 at
    a time at 2 of the grid's first 3 timesteps with the training guidance 2; advantages over the global std clamped
    at 0.5 (by hand); beta 7 and clip 0.05 reach the loss, KL 0.1 the logged loss; 2 optimizer steps an iteration;
    the old policy 0.001 of the way back after step 2; rollouts from the old policy once past --switch-ema-ref 1
    step; the EMA updated every 2nd step with its decay capped at 0.2, handed to final/."""
    from tests.test_flags_applied import QUIET, SHIFT2_4, run_flags
    from tests.test_flags_applied import train_rows as rows_of

    finals, adapters = recorded_finals(monkeypatch), recorded_rollout_adapters(monkeypatch)
    argv = ["--iterations", "2", "--samples-per-device", "8", "--group-size", "4", "--rollout-batch-size", "2",
            "--train-batch-size", "4", "--samples-per-update", "4", "--num-steps", "4", "--train-timesteps", "2",
            "--trunc-steps", "2", "--shift", "2", "--solver", "euler", "--beta", "7", "--clip-range", "0.05",
            "--kl-beta", "0.1", "--adv-clip-max", "0.5", "--global-std", "--switch-ema-ref", "1",
            "--train-guidance-scale", "2", "--ema-max-decay", "0.2", "--ema-every", "2", "--learning-rate", "1e-2",
            *QUIET]  # fmt: skip
    names = ["rollout", "group_advantages", "shared_timesteps", "ppo_clip", "dgpo_loss"]
    tape, record = run_flags(D, monkeypatch, tmp_path, argv, names)  # also: every flag passed by name as its value
    rollouts = tape.calls["rollout"]
    assert [len(c[0][3]) for c in rollouts] == [2] * 8  # 2 iterations x 4 chunks of --rollout-batch-size 2
    assert all(c[0][5] == "euler" and torch.equal(c[0][4], torch.tensor(SHIFT2_4)) for c in rollouts)
    assert adapters == [("default",)] * 4 + [("old",)] * 4  # 2 steps > --switch-ema-ref 1 before iteration 2
    prompts = record["encode"][0]
    assert len(prompts) == 8 and all(prompts[k] == prompts[4 * (k // 4)] for k in range(8))  # groups of 4
    # advantages by hand: the groups' means over the population std of all 8, clamped at 0.5
    losses = tape.calls["dgpo_loss"]
    assert len(losses) == 2 * 2 * 2  # iterations x micro-batches x timesteps
    for it in range(2):
        ((rewards,), kw, _) = tape.calls["group_advantages"][it]
        assert kw["clip"] == 0.5 and kw["global_std"] is True and kw["group_size"] == 4
        rw = rewards.double().tolist()
        mean, means = sum(rw) / 8, [sum(rw[:4]) / 4, sum(rw[4:]) / 4]
        std = math.sqrt(sum((x - mean) ** 2 for x in rw) / 8)
        adv = [max(-0.5, min(0.5, (x - means[k // 4]) / (std + 1e-4))) for k, x in enumerate(rw)]
        for n in range(4):  # micro-batch n // 2 holds group n // 2
            a, kw, _ = losses[4 * it + n]
            assert kw == dict(beta=7.0, group_size=4)
            assert a[2].tolist() == pytest.approx(adv[4 * (n // 2) : 4 * (n // 2) + 4], abs=1e-6)
        t_idx = tape.calls["shared_timesteps"][it][2]
        assert tape.calls["shared_timesteps"][it][0] == (2, 2, (0, it)) and set(t_idx) <= {0, 1, 2}
    assert any(abs(x) == 0.5 for c in losses for x in c[0][2].tolist())  # the clamp acts
    assert [c[0][3] for c in tape.calls["ppo_clip"]] == [0.05] * 8
    train = [(gs, n) for gs, n, grad in record["velocity"] if n == 4]  # training forwards: trained, base, old
    assert len(train) == 2 * 2 * 2 * 3 and all(gs == 2.0 for gs, _ in train)
    assert all(gs == record["args"].guidance_scale != 2.0 for gs, n, _ in record["velocity"] if n == 2)
    steps = record["steps"]
    assert len(steps) == 4  # --samples-per-update 4 of 8, 2 iterations
    first, second = rows_of(record)
    assert [r["dgpo/rollouts_from_old"] for r in (first, second)] == [0.0, 1.0]
    assert all(r["perf/nfe_per_image"] == 4 + 2 * 3 for r in (first, second))
    # the old policy after step 2: decay ref_decay(1) = 0.001, old = 0.001 p1 + 0.999 p2, 0.001 |p1 - p2| from p2
    p1, p2 = steps[0]["after"], steps[1]["after"]
    gap = math.sqrt(sum(float((a - b).double().square().sum()) for a, b in zip(p1, p2)))
    assert first["dgpo/old_distance"] == pytest.approx(0.001 * gap, rel=1e-2)
    # the logged loss: the DGPO surrogate's mean + 0.1 x the logged KL
    for it, row in enumerate((first, second)):
        surrogate = sum(c[2][0].detach().item() for c in losses[4 * it : 4 * it + 4]) / 4
        assert row["losses/loss"] == pytest.approx(surrogate + 0.1 * row["losses/kl"], rel=1e-4, abs=1e-8)
    assert second["losses/kl"] > 0
    # the EMA: updated after steps 1 and 3 ((s + 1) % 2 == 0) with decay min(2/11, 0.2) = 2/11, then min(4/13, 0.2)
    (final,) = finals
    p0, p3, p4 = steps[0]["before"], steps[2]["after"], steps[3]["after"]
    for a0, a1, a3, f in zip(p0, p1, p3, final):
        torch.testing.assert_close(f, 0.2 * (2 / 11 * a0 + 9 / 11 * a1) + 0.8 * a3, rtol=0, atol=1e-6)
    assert any(not torch.equal(f, p) for f, p in zip(final, p4))


def test_main_without_clip_reads_no_old_policy_and_without_ema_saves_the_live_weights(monkeypatch, tmp_path):
    """--clip-range inf: no ppo_clip and no old-policy forward (2 forwards per trained timestep: 4 + 2 x 2 per image),
    no clipfrac; --no-ema: final/ gets the weights of the last step; --kl-beta 0: no KL figure."""
    from tests.test_flags_applied import QUIET, run_flags
    from tests.test_flags_applied import train_rows as rows_of

    finals = recorded_finals(monkeypatch)
    argv = ["--iterations", "1", "--samples-per-device", "4", "--group-size", "2", "--rollout-batch-size", "2",
            "--train-batch-size", "4", "--samples-per-update", "4", "--num-steps", "4", "--train-timesteps", "2",
            "--trunc-steps", "2", "--clip-range", "inf", "--kl-beta", "0", "--no-ema", *QUIET]  # fmt: skip
    tape, record = run_flags(D, monkeypatch, tmp_path, argv, ["ppo_clip", "dgpo_loss"])
    assert tape.calls["ppo_clip"] == [] and len(tape.calls["dgpo_loss"]) == 2
    assert len([n for _, n, _ in record["velocity"] if n == 4]) == 2 * 2  # timesteps x (trained, base)
    (row,) = rows_of(record)
    assert row["perf/nfe_per_image"] == 4 + 2 * 2 and "losses/clipfrac" not in row and "losses/kl" not in row
    (step,) = record["steps"]
    (final,) = finals
    assert all(torch.equal(f, p) for f, p in zip(final, step["after"], strict=True))
    assert any(not torch.equal(p0, p1) for p0, p1 in zip(step["before"], step["after"]))


def test_main_with_objective_dpo_trains_each_groups_best_against_its_worst(monkeypatch, tmp_path):
    """--objective dpo, groups of 4, beta 30: best_and_worst on the iteration's rewards; each micro-batch of 2 rows is
    one group's (winner, loser), its x0 those two rollouts (eps = x_t + (1 - t) target is the group's noise, x0 =
    x_t - t target differs between the two); 2 trained rows per group: 4 + 2 x 2 x 2 / 4 = 6 forwards per image."""
    from tests.test_flags_applied import QUIET, run_flags
    from tests.test_flags_applied import train_rows as rows_of

    argv = ["--objective", "dpo", "--iterations", "1", "--samples-per-device", "8", "--group-size", "4",
            "--rollout-batch-size", "4", "--train-batch-size", "2", "--samples-per-update", "8", "--num-steps", "4",
            "--train-timesteps", "2", "--trunc-steps", "2", "--beta", "30", *QUIET]  # fmt: skip
    tape, record = run_flags(
        D, monkeypatch, tmp_path, argv, ["best_and_worst", "velocity_error", "dpo_loss", "rollout"]
    )
    ((rewards, g), _, (winner, loser, has_pref)) = tape.calls["best_and_worst"][0]
    assert g == 4 and len(rewards) == 8
    r = rewards.view(2, 4)
    assert winner.tolist() == [4 * k + int(r[k].argmax()) for k in range(2)]
    x = torch.cat([out for _, _, out in tape.calls["rollout"]])  # (8, *L) the iteration's final latents
    losses = tape.calls["dpo_loss"]
    assert len(losses) == 2 * 2  # a micro-batch per group x 2 timesteps
    for n, (a, kw, _) in enumerate(losses):
        k = n // 2
        assert kw == dict(beta=30.0) and a[2].tolist() == [float(has_pref[k])]
        (v, target), _, _ = tape.calls["velocity_error"][2 * n]  # trained, then base, per timestep
        assert len(v) == 2
        eps = target + x[[int(winner[k]), int(loser[k])]]
        torch.testing.assert_close(eps[0], eps[1], rtol=0, atol=1e-6)
    (row,) = rows_of(record)
    assert row["perf/nfe_per_image"] == 6 and 0 <= row["losses/dpo_accuracy"] <= 1
    assert "losses/group_weight" not in row and "losses/clipfrac" not in row


# ---------------------------------------------------------------- the script
def test_end_to_end_shapesbench(tmp_path):
    run_script(TINY_RUN + ["--exp-name", "e2e", "--save-every", "1"], tmp_path)
    run_dir = find_run(tmp_path / "e2e")
    rows = metrics(run_dir)
    train = [r for r in rows if "charts/lr" in r]
    assert [r["iteration"] for r in train] == [1, 2]
    for r in train:
        assert {"losses/group_weight", "losses/clipfrac", "losses/margin", "losses/d", "losses/d_ref",
                "losses/kl", "advantages/abs_mean"} <= set(r)  # fmt: skip
        assert 0 < r["losses/group_weight"] < 1 and 0 <= r["losses/clipfrac"] <= 1 and r["advantages/abs_mean"] > 0
        assert r["perf/nfe_per_image"] == 4 + 2 * 3 and r["dgpo/rollouts_from_old"] == 0  # switch at 200 steps
        assert r["charts/optimizer_steps"] == 2 * r["iteration"]
    # step 1 sees the old policy equal to theta (a copy), step 2 too (ref_decay(0) = 0 copies): nothing clipped
    assert train[0]["losses/clipfrac"] == 0 and train[0]["losses/first_ratio_max_dev"] == 0
    assert train[0]["dgpo/old_distance"] > 0  # 0.001 |p1 - p2| after step 2
    assert train[1]["losses/first_ratio_max_dev"] > 0  # step 3: the old policy 0.001 of the way back to p1
    evals = [r for r in rows if "eval/shape_acc" in r]
    assert [r["iteration"] for r in evals] == [0, 2]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["iter_000001", "iter_000002"]
    carried = torch.load(run_dir / "checkpoints" / "iter_000002" / "custom_checkpoint_1.pkl", weights_only=False)
    trained = load_file(run_dir / "checkpoints" / "iter_000002" / "model.safetensors")
    assert len(carried["old"]) == len(carried["ema"]) == len(trained)
    final = load_file(run_dir / "final" / LORA_WEIGHTS)
    policy = trainable_denoiser(load_model("shapesbench"), D.Args())
    M.add_old_policy(policy, True)
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    ema = dict(zip(names, carried["ema"]))
    for k, v in final.items():  # final/ holds the EMA weights
        assert torch.equal(v, ema[k.removeprefix("transformer.").replace(".weight", ".default.weight")]), k
    assert not all(torch.equal(ema[k], trained[k]) for k in names if "lora_B" in k)
    assert_final_loads(run_dir)
    assert (run_dir / "samples" / "samples_000002.png").is_file()


def test_end_to_end_shapesbench_dpo(tmp_path):
    flags = replace_flags(TINY_RUN, {"--train-batch-size": "2", "--eval-every": "0", "--sample-every": "0"})
    run_script([*flags, "--objective", "dpo", "--beta", "50", "--exp-name", "dpo"], tmp_path)
    run_dir = find_run(tmp_path / "dpo")
    train = train_rows(run_dir)
    assert [r["iteration"] for r in train] == [1, 2]
    for r in train:
        assert {"losses/dpo_accuracy", "losses/dpo_margin", "losses/d", "losses/d_ref", "losses/kl"} <= set(r)
        assert not {"losses/group_weight", "losses/clipfrac", "advantages/abs_mean"} & set(r)
        assert 0 <= r["losses/dpo_accuracy"] <= 1 and r["perf/nfe_per_image"] == 4 + 2 * 2 * 2 / 4
    assert_final_loads(run_dir)


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_tiny_sd3_and_flux_train_and_diffusers_loads_their_final_weights(kind, tmp_path):
    """A real model's path on a tiny random SD3 (CFG 2 in the rollouts, the conditional branch alone in training, as
    the official) and FLUX.1 (embedded guidance 3.5, given to the training forwards too): the base and the old
    policy through the adapters, the JPEG reward; 3 + 2 x 3 = 9 forwards per image (CFG rows are one forward);
    final/ (the EMA) read by the pipeline's load_lora_weights."""
    from tests.tiny import BUILDERS, RES

    BUILDERS[kind](tmp_path / kind)
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS) + "\n")
    guidance = (
        ["--guidance-scale", "2"] if kind == "sd3" else ["--guidance-scale", "3.5", "--train-guidance-scale", "3.5"]
    )
    flags = replace_flags(TINY_RUN, {"--eval-max-prompts": "2", "--sample-every": "0", "--num-steps": "3"})
    flags += ["--model-id", str(tmp_path / kind), "--resolution", str(RES), "--prompts", str(tmp_path / "p.txt"),
              "--eval-prompts", str(tmp_path / "p.txt"), "--reward", "jpeg", "--kl-beta", "0.1", "--lora-rank", "4",
              *guidance, "--exp-name", kind]  # fmt: skip
    run_script(flags, tmp_path, env={"HF_HUB_OFFLINE": "1"})
    run_dir = find_run(tmp_path / kind)
    train = train_rows(run_dir)
    assert len(train) == 2 and all(r["perf/nfe_per_image"] == 3 + 2 * 3 and r["losses/kl"] >= 0 for r in train)
    assert train[0]["losses/first_ratio_max_dev"] == 0 and all(math.isfinite(r["rewards/jpeg"]) for r in train)
    assert_final_loads(run_dir, str(tmp_path / kind))


def test_preempted_full_disk_and_killed_runs_resume_to_the_uninterrupted_weights(tmp_path):
    """SIGTERM, a full disk while checkpointing, SIGKILL twice, each followed by --resume-from latest: the trained
    adapter, the optimiser, the old policy and the EMA all come back, so the last resume ends with the weights (the
    EMA's, in final/) and the carried state of an uninterrupted run; the logged figures are the same."""
    small = {"--samples-per-device": "4", "--group-size": "2", "--rollout-batch-size": "4", "--train-batch-size": "4"}
    args = replace_flags(TINY_RUN, small) + ["--eval-every", "0", "--sample-every", "0"]
    assert_survives_kills("dgpo.py", args, tmp_path)
    a, b = (find_run(tmp_path / n) / "checkpoints" / "iter_000006" for n in ("straight", "faulty"))
    ca, cb = (torch.load(d / "custom_checkpoint_1.pkl", weights_only=False) for d in (a, b))
    assert all(torch.equal(x, y) for k in ("old", "ema") for x, y in zip(ca[k], cb[k], strict=True))
    keys = ("rewards/mean", "losses/loss", "losses/group_weight", "dgpo/old_distance")
    ra, rb = ([[r[k] for k in keys] for r in train_rows(tmp_path / n)] for n in ("straight", "faulty"))
    assert ra == rb


def test_two_processes_match_one(tmp_path):
    """Groups of 4 with --global-std (the std of both processes' rewards): 2 CPU processes x one group each against
    1 process x both groups, one optimizer step per iteration in both: the same rewards and advantages, the same
    gradient up to the order of sums, identical weights on both ranks, and final weights equal to the one-process
    run's up to that rounding."""
    quiet = TINY_RUN + ["--eval-every", "0", "--sample-every", "0", "--global-std"]
    one = ["--samples-per-device", "8", "--rollout-batch-size", "4", "--samples-per-update", "8"]
    run_script([*quiet, *one, "--exp-name", "one"], tmp_path)
    two = ["--samples-per-device", "4", "--rollout-batch-size", "4", "--samples-per-update", "4"]
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2")
    run_script([*quiet, *two, "--exp-name", "two"], tmp_path, launcher, {"ACCELERATE_USE_CPU": "1"})
    rows = {n: train_rows(tmp_path / n) for n in ("one", "two")}
    assert [len(v) for v in rows.values()] == [2, 2]
    for a, b in zip(rows["one"], rows["two"]):
        assert a["rewards/mean"] == pytest.approx(b["rewards/mean"], rel=1e-6)
        assert a["charts/grad_norm"] == pytest.approx(b["charts/grad_norm"], rel=1e-4)  # all-reduced: global
        assert a["charts/optimizer_steps"] == b["charts/optimizer_steps"]
    assert rows["two"][-1]["charts/rank_weight_spread"] == 0
    fa, fb = (load_file(find_run(tmp_path / n) / "final" / LORA_WEIGHTS) for n in ("one", "two"))
    moved = max(float(fa[k].abs().max()) for k in fa if "lora_B" in k)  # how far B moved from its start, 0
    assert fa.keys() == fb.keys() and moved > 0
    # Adam's first steps (close to lr x the gradient's sign) magnify the rounding of sums taken in another order:
    # the two runs differ by about 3e-3 of the distance moved (a wrong scale of the gradient shows in grad_norm above,
    # advantages or rows that differ between the runs in the direction of the step, a good part of the distance)
    assert max(float((fa[k] - fb[k]).abs().max()) for k in fa) < 1e-2 * moved
