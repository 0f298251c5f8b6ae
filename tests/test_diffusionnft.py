"""diffusionnft.py: the loss against its closed form and its minimiser, r, the schedules, the EMA, the direction of an
update, the old adapter (never optimised, soft-updated, checkpointed), --help, the script end to end on ShapesBench
and on a tiny SD3 with CFG (a video model refused), through preemption, a full disk and kills, and on 2 processes."""

import math
import sys

import pytest
import torch
import tyro
from safetensors.torch import load_file

import diffusionnft as N
from common import InputError
from common import models as M  # the old policy and the weight swap (model plumbing)
from common.checkpoints import Carried
from common.models import base_weights, load_model, trainable_denoiser
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
    "--timestep-fraction",
    "0.5",
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
]
PROMPTS = ["a red circle on a blue background", "a green square on a white background"]


def run_script(args, tmp_path, *rest, **kw):
    return run("diffusionnft.py", args, tmp_path, *rest, **kw)


def sample(seed=0, shape=(3, 4, 2, 2)):
    g = torch.Generator().manual_seed(seed)
    x0, eps, v_old, v_theta, v_ref = (torch.randn(shape, generator=g) for _ in range(5))
    return x0, eps, v_old, v_theta, v_ref


# ---------------------------------------------------------------- the objective
@pytest.mark.parametrize("self_normalize", [True, False])
def test_policy_loss_is_the_closed_form(self_normalize):
    x0, eps, v_old, v_theta, v_ref = sample()
    t, r, beta, kl_beta = torch.tensor([1.0, 0.6, 0.1]), torch.tensor([0.9, 0.5, 0.2]), 0.3, 0.01
    c = 2.0  # --adv-clip-max: the official code multiplies the NFT term by it (5 in its configs)
    tv = t.view(-1, 1, 1, 1)
    x_t = (1 - tv) * x0 + tv * eps
    # written in velocity space: x0_hat - x0 = t (v - v_pred) with the target v = eps - x0
    v = eps - x0
    expected = []
    for b in range(3):
        tb = float(t[b])
        e_pos = (v[b] - (beta * v_theta[b] + (1 - beta) * v_old[b])).flatten()
        e_neg = (v[b] - ((1 + beta) * v_old[b] - beta * v_theta[b])).flatten()
        if self_normalize:
            pos = tb * (e_pos**2).mean() / (e_pos.abs().mean())
            neg = tb * (e_neg**2).mean() / (e_neg.abs().mean())
        else:
            pos, neg = tb**2 * (e_pos**2).mean(), tb**2 * (e_neg**2).mean()
        kl = ((v_theta[b] - v_ref[b]) ** 2).mean()
        expected.append(c * (r[b] * pos + (1 - r[b]) * neg) / beta + kl_beta * kl)
    v_theta = v_theta.clone().requires_grad_()
    v_old_g = v_old.clone().requires_grad_()
    loss, figures = N.policy_loss(
        v_theta, v_old_g, v_ref, x0, x_t, t, r, beta=beta, adv_clip_max=c, kl_beta=kl_beta,
        self_normalize=self_normalize,
    )  # fmt: skip
    torch.testing.assert_close(loss, torch.stack(expected), rtol=1e-5, atol=1e-6)
    assert set(figures) == {"policy", "pos", "neg", "old_deviation", "kl"}
    assert all(not f.requires_grad for f in figures.values())
    torch.testing.assert_close(figures["old_deviation"], ((v_theta - v_old) ** 2).flatten(1).mean(1).detach())
    loss.sum().backward()
    assert v_old_g.grad is None and v_theta.grad.abs().sum() > 0  # v_old is a constant of the loss
    # without the KL term there is no kl figure, and at v_theta = v_old pos = neg: r makes no difference
    loss0, figures0 = N.policy_loss(
        v_old, v_old, None, x0, x_t, t, r, beta=beta, adv_clip_max=5.0, kl_beta=1.0, self_normalize=True
    )
    assert "kl" not in figures0 and torch.equal(figures0["pos"], figures0["neg"])


def test_weights_are_detached_and_clamped():
    x0, eps, v_old, _, _ = sample(1, (1, 2, 2, 2))
    t, r = torch.tensor([0.5]), torch.tensor([1.0])
    x_t = (1 - t) * x0 + t * eps
    v_exact = (eps - x0).clone().requires_grad_()  # x0_hat = x0 exactly: the weight is clamped at 1e-5, no NaN
    loss, _ = N.policy_loss(
        v_exact, v_exact.detach(), None, x0, x_t, t, r, beta=1.0, adv_clip_max=5.0, kl_beta=0, self_normalize=True
    )
    loss.sum().backward()
    assert loss.item() < 1e-6 and torch.isfinite(v_exact.grad).all()
    # the gradient is that of mean(err^2) / w with w a constant: 2 err / (N w) d err / d v. At v_theta = v_old both
    # policies are v_old, so with d v+ / d v_theta = beta and d v- / d v_theta = -beta the factor 5 (r - (1 - r)) beta
    # / beta = 5 (2 r - 1): 3 for r = 0.8, -2.5 for r = 0.25 (r = 1 would hide the negative term); t 0.3 and 0.7
    x0, eps, v_old, _, _ = sample(3, (2, 2, 2, 2))
    t, r = torch.tensor([0.3, 0.7]), torch.tensor([0.8, 0.25])
    x_t = (1 - t.view(2, 1, 1, 1)) * x0 + t.view(2, 1, 1, 1) * eps
    v_theta = v_old.clone().requires_grad_()
    loss, _ = N.policy_loss(
        v_theta, v_old, None, x0, x_t, t, r, beta=0.4, adv_clip_max=5.0, kl_beta=0, self_normalize=True
    )
    loss.sum().backward()
    for b, factor in enumerate((3.0, -2.5)):
        err = (x_t[b] - t[b] * v_old[b] - x0[b]).flatten()
        expected = factor * 2 * err / 8 / err.abs().mean() * (-t[b])
        torch.testing.assert_close(v_theta.grad[b].flatten(), expected)


def minimise(r, beta, self_normalize, steps=800):
    """v_theta minimising the loss of one sample (Adam, a decaying rate scaled to the step 1 / beta)."""
    x0, eps, v_old, _, _ = sample(2, (1, 4, 2, 2))
    t = torch.tensor([0.7])
    x_t = (1 - t) * x0 + t * eps
    v_theta = v_old.clone().requires_grad_()
    opt = torch.optim.Adam([v_theta], lr=0.05 / beta)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.995**k)
    for _ in range(steps):
        loss, _ = N.policy_loss(
            v_theta,
            v_old,
            None,
            x0,
            x_t,
            t,
            torch.tensor([r]),
            beta=beta,
            adv_clip_max=5.0,
            kl_beta=0,
            self_normalize=self_normalize,
        )
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
        sched.step()
    return v_theta.detach(), v_old, eps - x0


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_minimiser_is_v_old_plus_2r_minus_1_over_beta_times_the_step(beta):
    """With equal weights (--no-self-normalize) the per-sample minimiser is v_old + (2r - 1)(v - v_old) / beta; with
    the official adaptive weight, whose normaliser follows each error, it is v+ = v (r > 1/2) or v- = v (r < 1/2):
    v_old +- (v - v_old) / beta (deviation 7 of the docstring)."""
    for r in (0.9, 0.5, 0.3):
        v_star, v_old, v = minimise(r, beta, self_normalize=False)
        scale = ((v - v_old) / beta).abs().max()
        torch.testing.assert_close(v_star, v_old + (2 * r - 1) * (v - v_old) / beta, atol=1e-3 * scale, rtol=0)
    for r in (0.9, 0.3):
        v_star, v_old, v = minimise(r, beta, self_normalize=True)
        scale = ((v - v_old) / beta).abs().max()
        sign = 1 if r > 0.5 else -1
        torch.testing.assert_close(v_star, v_old + sign * (v - v_old) / beta, atol=1e-3 * scale, rtol=0)


# ---------------------------------------------------------------- r, schedules, EMA
def test_optimality_probability_by_hand():
    adv = torch.tensor([0.0, 5.0, 7.0, -2.5, -5.0, -9.0, 1.0])
    torch.testing.assert_close(N.optimality(adv, 5.0), torch.tensor([0.5, 1.0, 1.0, 0.25, 0.0, 0.0, 0.6]))
    torch.testing.assert_close(N.optimality(torch.tensor([1.0]), 2.0), torch.tensor([0.75]))


def test_advantages_use_the_prompt_mean_and_the_global_population_std():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0])
    # groups of 4: means 3 and 5; population std of all 8 rewards
    mean = rewards.mean()
    std = math.sqrt(((rewards - mean) ** 2).mean().item())
    expected = torch.tensor([-2.0, -1.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0]) / (std + 1e-4)
    torch.testing.assert_close(N.nft_advantages(rewards, group_size=4), expected)
    assert torch.all(N.nft_advantages(torch.ones(8), group_size=4) == 0)  # all equal: every r is 1/2


def test_old_policy_schedules_by_hand():
    linear = {0: 0.0, 1: 0.001, 250: 0.25, 500: 0.5, 501: 0.5, 10_000: 0.5}
    delayed = {0: 0.0, 74: 0.0, 75: 0.0, 76: 0.0075, 100: 0.1875, 208: 0.9975, 209: 0.999, 10_000: 0.999}
    for s, eta in linear.items():
        assert N.old_decay(s, "linear") == pytest.approx(eta)
    for s, eta in delayed.items():
        assert N.old_decay(s, "delayed") == pytest.approx(eta)
    # --old-decay-speed k reads the schedule at k s: 40 steps at 12.5 are the official run's 500 (linear's cap)
    assert N.old_decay(20, "linear", 12.5) == pytest.approx(0.25) and N.old_decay(40, "linear", 12.5) == 0.5
    assert N.old_decay(3, "delayed", 25) == 0 and N.old_decay(4, "delayed", 25) == pytest.approx(0.1875)


def test_ema_decay_and_soft_update():
    for s, d in {0: 0.1, 1: 2 / 11, 10: 0.55, 80: 0.9, 81: 0.9, 10_000: 0.9}.items():
        assert N.ema_decay(s, 0.9) == pytest.approx(d)
    assert N.ema_decay(10_000, 0.5) == 0.5
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, generator=g), torch.randn(5, generator=g)
    target = [a.clone()]
    N.soft_update(target, [b], 0.25)
    torch.testing.assert_close(target[0], 0.25 * a + 0.75 * b)
    N.soft_update(target, [b], 0.0)  # decay 0 copies bitwise (the delayed schedule's first 75 steps)
    assert torch.equal(target[0], b)


# ---------------------------------------------------------------- the training step's inputs
def test_forward_process_forms_x_t_at_each_images_own_t():
    """x_t = (1 - t) x0 + t eps at t = 0.3 and 0.8 (image 0: x0 = 2, eps = -1; image 1: x0 = -0.5, eps = 3): 1.4 -
    0.3 = 1.1 and -0.1 + 2.4 = 2.3; a swapped t and 1 - t (-0.1, 0.35) or one image's t for both would differ."""
    x0 = torch.tensor([2.0, -0.5]).view(2, 1, 1, 1).expand(2, 4, 2, 2)
    eps = torch.tensor([-1.0, 3.0]).view(2, 1, 1, 1).expand(2, 4, 2, 2)
    x_t = N.noised(x0, eps, torch.tensor([0.3, 0.8]))
    assert x_t.shape == (2, 4, 2, 2)
    torch.testing.assert_close(x_t[0], torch.full((4, 2, 2), 1.1))
    torch.testing.assert_close(x_t[1], torch.full((4, 2, 2), 2.3))
    x_t = N.noised(x0[:1], eps[:1], torch.tensor([1.0]))  # t = 1 is pure noise (the grid's first point)
    torch.testing.assert_close(x_t, eps[:1])


def test_trained_timesteps_differ_between_images_and_are_keyed_on_seed_iteration_and_image():
    t_idx = N.train_timesteps(10, 9, (3, 5), [0, 1, 2, 3])
    assert t_idx.shape == (4, 9)
    for row in t_idx.tolist():  # 9 distinct grid points of sigma_0 .. sigma_9: t = 0 (index 10) never
        assert len(set(row)) == 9 and all(0 <= i <= 9 for i in row)
    assert not torch.equal(t_idx[0], t_idx[1])  # two images, two orders
    assert len({tuple(r) for r in t_idx.tolist()}) == 4
    # a function of (seed, iteration, image) alone: the same again, and image 2 alone or in another batch
    assert torch.equal(N.train_timesteps(10, 9, (3, 5), [0, 1, 2, 3]), t_idx)
    assert torch.equal(N.train_timesteps(10, 9, (3, 5), [2]), t_idx[2:3])
    assert torch.equal(N.train_timesteps(10, 9, (3, 5), [7, 2])[1], t_idx[2])
    assert not torch.equal(N.train_timesteps(10, 9, (4, 5), [0, 1, 2, 3]), t_idx)  # another seed
    assert not torch.equal(N.train_timesteps(10, 9, (3, 6), [0, 1, 2, 3]), t_idx)  # another iteration
    assert torch.equal(N.train_timesteps(10, 4, (3, 5), [0, 1, 2, 3]), t_idx[:, :4])  # a prefix of one permutation


def test_timestep_fraction_truncates_as_the_official_code():
    """The official count is int(T x fraction): 0.99 of 10 is 9 (rounding would give 10), 0.35 of 10 is 3, 0.4 of 10
    is 4, 0.25 of 8 is 2, 0.5 of 4 is 2."""
    assert N.n_train_timesteps(10, 0.99) == 9
    assert N.n_train_timesteps(10, 0.35) == 3 and N.n_train_timesteps(10, 0.4) == 4
    assert N.n_train_timesteps(8, 0.25) == 2 and N.n_train_timesteps(4, 0.5) == 2
    N.resolve_and_check(N.Args(num_steps=10, timestep_fraction=0.15))  # 1 of 10: allowed
    with pytest.raises(InputError, match="--timestep-fraction"):
        N.resolve_and_check(N.Args(num_steps=10, timestep_fraction=0.09))  # 0 of 10


# ---------------------------------------------------------------- the update on the real (tiny) model
@pytest.fixture(scope="module")
def shapes():
    return load_model("shapesbench")


def velocities(model, module, x, t, cond):
    with torch.no_grad():
        return model.velocity(module, x, t, cond)


def test_an_update_lowers_the_x0_error_of_high_r_images_against_low_r_ones(shapes):
    """The same image and noise, once with r = 1 and once with r = 0: one SGD step on each lowers the x0 error of
    the image with r = 1 and raises it for r = 0, for the official beta of 1 and the OCR beta of 0.1."""
    model = shapes
    tr = model.transformer
    start = {k: v.clone() for k, v in tr.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, *model.latent_shape(), generator=g).clamp(-1, 1)
    eps, t = torch.randn(2, *model.latent_shape(), generator=g), torch.tensor([0.8, 0.5])
    tv = t.view(-1, 1, 1, 1)
    x_t = (1 - tv) * x0 + tv * eps
    cond = model.encode_prompts(PROMPTS)
    v_old = velocities(model, tr, x_t, t, cond)
    error = lambda v: (x_t - tv * v - x0).square().flatten(1).mean(1)  # noqa: E731
    before = error(v_old)
    for beta in (1.0, 0.1):
        change = {}
        for r in (1.0, 0.0):
            tr.load_state_dict(start)
            tr.zero_grad()
            v_theta = model.velocity(tr, x_t, t, cond)
            loss, _ = N.policy_loss(
                v_theta,
                v_old,
                None,
                x0,
                x_t,
                t,
                torch.full((2,), r),
                beta=beta,
                adv_clip_max=5.0,
                kl_beta=0,
                self_normalize=True,
            )
            loss.mean().backward()
            with torch.no_grad():
                for p in tr.parameters():
                    if p.grad is not None:
                        p -= 1e-4 * p.grad
            change[r] = error(velocities(model, tr, x_t, t, cond)) - before
        assert torch.all(change[1.0] < 0) and torch.all(change[0.0] > 0), (beta, change)
    tr.load_state_dict(start)


def test_old_adapter_is_never_optimised_only_soft_updated_and_checkpointed(tmp_path):
    model = load_model("shapesbench")
    args = N.Args(lora_rank=4)
    policy = trainable_denoiser(model, args)
    assert M.add_old_policy(policy, True) is None
    params = M.trained_weights(policy)
    old = M.old_weights(policy, None, True)
    assert len(old) == len(params) and all(not o.requires_grad for o in old)
    assert all(torch.equal(o, p) and o.data_ptr() != p.data_ptr() for o, p in zip(old, params))
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    assert {id(p) for g in optimizer.param_groups for p in g["params"]}.isdisjoint({id(o) for o in old})
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, *model.latent_shape(), generator=g), torch.tensor([0.9, 0.4])
    cond = model.encode_prompts(PROMPTS)
    old_before = [o.clone() for o in old]
    for _ in range(2):  # two optimizer steps with the old policy's velocity in the loss
        with M.old_policy(policy, None, True) as pi_old:
            v_old = velocities(model, pi_old, x, t, cond)
        assert all(p.requires_grad for p in params) and not any(o.requires_grad for o in old)  # restored
        v_theta = model.velocity(policy, x, t, cond)
        loss, _ = N.policy_loss(
            v_theta,
            v_old,
            None,
            x,
            x,
            t,
            torch.tensor([1.0, 0.0]),
            beta=1.0,
            adv_clip_max=5.0,
            kl_beta=0,
            self_normalize=True,
        )
        loss.mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.equal(o, b) for o, b in zip(old, old_before))  # bitwise untouched by the optimiser
    assert any(not torch.equal(p, b) for p, b in zip(params, old_before))  # while the trained adapter moved
    with M.old_policy(policy, None, True) as pi_old:  # the old adapter still gives the start's velocity: the base's
        v_old = velocities(model, pi_old, x, t, cond)
    with base_weights(policy, True) as base:
        torch.testing.assert_close(v_old, velocities(model, base, x, t, cond), atol=0, rtol=0)
    assert not torch.allclose(velocities(model, policy, x, t, cond), v_old)
    N.soft_update(old, params, 0.3)  # only the soft update moves it
    for o, b, p in zip(old, old_before, params):
        torch.testing.assert_close(o, 0.3 * b + 0.7 * p)
    # a checkpoint carries it: saved, scrambled, loaded back bitwise
    carried = Carried(old=old, ema=[p.detach().clone() for p in params])
    state = carried.state_dict()
    saved = [o.clone() for o in old]
    N.soft_update(old, params, 0.0)
    carried.load_state_dict(state)
    assert all(torch.equal(o, s) for o, s in zip(old, saved))


def test_validation_names_the_flag(tmp_path):
    with pytest.raises(InputError, match="--timestep-fraction"):
        N.resolve_and_check(N.Args(num_steps=4, timestep_fraction=0.2))
    with pytest.raises(InputError, match="--beta"):
        N.resolve_and_check(N.Args(beta=0.0))
    with pytest.raises(InputError, match="--ema-max-decay only applies with --ema"):
        N.resolve_and_check(N.Args(ema=False, ema_max_decay=0.5))
    with pytest.raises(InputError, match="--samples-per-update"):
        N.resolve_and_check(N.Args(samples_per_update=24))


def test_help_gives_the_official_value_beside_each_shapesbench_default(capsys):
    with pytest.raises(SystemExit):
        tyro.cli(N.Args, args=["--help"])
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    for official in ("official: 24)", "0.99, so 9 of 10)", "(official: 1e-4, its `train.beta`)", "(official: 9)",
                     "1.0; 0.1 for OCR and multi-reward)", "(official: 0.9)", "(official: 10)"):  # fmt: skip
        assert official in text, official
    for default in ("(default: 30)", "(default: 8)", "(default: 0.4)", "(default: 64)", "(default: 0.0001)"):
        assert default in text, default


# ---------------------------------------------------------------- the script
def test_end_to_end_shapesbench(tmp_path):
    run_script(TINY_RUN + ["--exp-name", "e2e", "--save-every", "1"], tmp_path)
    run = find_run(tmp_path / "e2e")
    rows = metrics(run)
    train = [r for r in rows if "losses/policy" in r]
    assert [r["iteration"] for r in train] == [1, 2]
    first, second = train
    assert first["losses/first_old_deviation"] == 0  # the old adapter starts as a copy of the trained one
    assert first["losses/old_deviation"] > 0  # the second optimizer step of iteration 1 sees a moved policy
    assert second["losses/first_old_deviation"] > 0  # eta = min(0.001 s, 0.5) > 0: old lags behind theta
    assert [r["nft/old_eta"] for r in train] == pytest.approx([0.002, 0.004])  # 2 optimizer steps per iteration
    assert [r["nft/ema_decay"] for r in train] == pytest.approx([3 / 12, 5 / 14])
    assert all(r["losses/kl"] > 0 and 0 < r["nft/r_abs_dev"] <= 0.5 and r["nft/old_distance"] > 0 for r in train)
    assert all(r["perf/nfe_per_image"] == 4 + 2 * 3 for r in train)  # 4 rollout + 2 timesteps x (old, theta, base)
    assert 0 < first["charts/lr"] < second["charts/lr"] <= 3e-4
    evals = [r for r in rows if "eval/shape_acc" in r]
    assert [r["iteration"] for r in evals] == [0, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000001", "iter_000002"]
    # the checkpoint carries the old adapter and the EMA; final/ holds the EMA weights, loadable by diffusers
    carried = torch.load(run / "checkpoints" / "iter_000002" / "custom_checkpoint_1.pkl", weights_only=False)
    trained = load_file(run / "checkpoints" / "iter_000002" / "model.safetensors")
    assert len(carried["old"]) == len(carried["ema"]) == len(trained)
    final = load_file(run / "final" / LORA_WEIGHTS)
    policy = trainable_denoiser(load_model("shapesbench"), N.Args())
    M.add_old_policy(policy, True)
    names = [n for n, p in policy.named_parameters() if p.requires_grad]  # the order of Carried's lists
    assert sorted(names) == sorted(trained)
    ema = dict(zip(names, carried["ema"]))
    for k, v in final.items():
        key = k.removeprefix("transformer.").replace(".weight", ".default.weight")
        assert torch.equal(v, ema[key]), k
    assert not all(torch.equal(ema[k], trained[k]) for k in names if "lora_B" in k)
    assert_final_loads(run)
    assert (run / "samples" / "samples_000002.png").is_file()


def test_tiny_sd3_with_cfg_and_kl_trains_and_diffusers_loads_its_final_weights_and_video_is_refused(tmp_path):
    """A real model's path: a tiny random SD3 (tests/tiny.py), guidance 2 in the rollout and in every training
    velocity (CFG rows: one forward each), the KL term through the adapters switched off, the JPEG reward; final/
    (the EMA weights) read by diffusers' load_lora_weights. A video model stops at start-up, before it loads."""
    from tests.tiny import BUILDERS, RES

    BUILDERS["sd3"](tmp_path / "sd3")
    BUILDERS["wan"](tmp_path / "wan")
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS) + "\n")
    real = ["--resolution", str(RES), "--prompts", str(tmp_path / "p.txt"), "--eval-prompts", str(tmp_path / "p.txt"),
            "--reward", "jpeg", "--guidance-scale", "2", "--kl-beta", "0.1", "--lora-rank", "4"]  # fmt: skip
    flags = replace_flags(TINY_RUN, {"--eval-max-prompts": "2", "--sample-every": "0"}) + real
    run_script(
        [*flags, "--model-id", str(tmp_path / "sd3"), "--exp-name", "sd3"], tmp_path, env={"HF_HUB_OFFLINE": "1"}
    )
    run_dir = find_run(tmp_path / "sd3")
    train = [r for r in metrics(run_dir) if "losses/policy" in r]
    assert len(train) == 2 and all(r["perf/nfe_per_image"] == 4 + 2 * 3 and r["losses/kl"] > 0 for r in train)
    assert train[0]["losses/first_old_deviation"] == 0 < train[1]["losses/first_old_deviation"]
    assert all(math.isfinite(r["rewards/jpeg"]) for r in train)
    assert_final_loads(run_dir, str(tmp_path / "sd3"))
    out = run_script([*flags, "--model-id", str(tmp_path / "wan"), "--exp-name", "wan"], tmp_path, check=False,
                     env={"HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert out.returncode == 2 and "video model" in out.stderr and "diffusionnft.py trains image models" in out.stderr
    assert not list(tmp_path.glob("wan__*"))  # no run folder


def test_preempted_full_disk_and_killed_runs_resume_to_the_uninterrupted_weights(tmp_path):
    """SIGTERM, a full disk while checkpointing, SIGKILL twice, each followed by --resume-from latest: the trained
    adapter, the optimiser, the old adapter and the EMA all come back, so the last resume ends with the weights (the
    EMA's, in final/) and the carried state of an uninterrupted run (without the old adapter in the checkpoint the
    next rollout would differ)."""
    small = {"--samples-per-device": "4", "--group-size": "2", "--rollout-batch-size": "4", "--train-batch-size": "4"}
    args = replace_flags(TINY_RUN, small) + ["--eval-every", "0", "--sample-every", "0"]
    assert_survives_kills("diffusionnft.py", args, tmp_path)
    a, b = (find_run(tmp_path / n) / "checkpoints" / "iter_000006" for n in ("straight", "faulty"))
    ca, cb = (torch.load(d / "custom_checkpoint_1.pkl", weights_only=False) for d in (a, b))
    assert all(torch.equal(x, y) for k in ("old", "ema") for x, y in zip(ca[k], cb[k], strict=True))
    keys = ("rewards/mean", "losses/policy", "losses/first_old_deviation", "nft/old_distance")
    ra, rb = (
        [[r[k] for k in keys] for r in metrics(tmp_path / n) if "losses/policy" in r] for n in ("straight", "faulty")
    )
    assert ra == rb


def test_two_processes_match_one_with_the_delayed_schedule(tmp_path):
    """Groups of 4 over 2 CPU processes x 2 samples (every group spans both) against 1 process x 4: the same rollouts
    and rewards, the same gradients up to the order of sums (the losses logged are rank 0's own), identical weights on both ranks. --old-decay delayed has
    eta = 0 for 75 steps, so the old adapter is theta bitwise after each iteration: no deviation at its start."""
    quiet = TINY_RUN + ["--eval-every", "0", "--sample-every", "0", "--old-decay", "delayed", "--no-save"]
    one = ["--samples-per-device", "8", "--rollout-batch-size", "2", "--train-batch-size", "2"]
    run_script([*quiet, *one, "--samples-per-update", "8", "--exp-name", "one"], tmp_path)  # 1 step / iteration
    two = ["--samples-per-device", "4", "--rollout-batch-size", "2", "--train-batch-size", "2"]
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2")
    env = {"ACCELERATE_USE_CPU": "1"}
    run_script([*quiet, *two, "--samples-per-update", "4", "--exp-name", "two"], tmp_path, launcher, env)
    rows = {n: [r for r in metrics(tmp_path / n) if "losses/policy" in r] for n in ("one", "two")}
    assert [len(v) for v in rows.values()] == [2, 2]
    for a, b in zip(rows["one"], rows["two"]):
        assert a["rewards/mean"] == pytest.approx(b["rewards/mean"], rel=1e-5)
        assert a["nft/r_abs_dev"] == pytest.approx(b["nft/r_abs_dev"], rel=1e-5)
        assert a["charts/grad_norm"] == pytest.approx(b["charts/grad_norm"], rel=1e-4)  # all-reduced: global
        assert a["losses/first_old_deviation"] == b["losses/first_old_deviation"] == 0 and a["nft/old_eta"] == 0
    assert rows["two"][-1]["charts/rank_weight_spread"] == 0


# ---------------------------------------------------------------- the training step of main(), recorded
NFT_STEP = [
    "--seed",
    "3",
    "--num-steps",
    "10",
    "--timestep-fraction",
    "0.99",
    "--samples-per-device",
    "4",
    "--group-size",
    "2",
    "--rollout-batch-size",
    "4",
    "--train-batch-size",
    "2",
    "--samples-per-update",
    "4",
    "--beta",
    "0.5",
    "--kl-beta",
    "0.1",
    "--max-grad-norm",
    "1e9",
]  # fmt: skip  (2 micro-batches, 1 step)


@pytest.fixture(scope="module")
def nft_step(tmp_path_factory):
    """main() for two iterations (tests/test_direction.py's run_main: policy_loss and the velocities with gradients
    recorded); at the first optimizer step, the accumulated gradient and the weights it was taken at."""
    from accelerate import Accelerator

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

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Accelerator, "clip_grad_norm_", clip)
        mp.setattr(test_direction, "QUICK", replace_flags(test_direction.QUICK, {"--iterations": "2"}))
        tmp = tmp_path_factory.mktemp("nft_step")
        tape, model = test_direction.run_main(N, mp, tmp, NFT_STEP, ["policy_loss"])
    return tape, model, at_step


def test_main_trains_9_of_10_timesteps_at_fraction_0_99(nft_step):
    tape, _, _ = nft_step
    calls = tape.calls["policy_loss"]
    assert len(calls) == 2 * 2 * 9  # 2 iterations x 2 micro-batches x int(10 x 0.99) timesteps
    assert len(tape.calls["velocity"]) == 2 * 2 * 9  # one trained forward each


def test_main_forms_x_t_from_x0_keyed_noise_and_each_images_t(nft_step):
    """Each recorded loss call: x_t = (1 - t) x0 + t eps, with eps keyed on (seed 3, iteration, 'eps', image k,
    timestep j), t per image; x0 is the same rollout latent at every timestep of a micro-batch. Micro-batch m holds
    the images sample_order puts at 2m, 2m + 1 (iteration 0: 0, 2 then 3, 1; iteration 1: 2, 3 then 0, 1)."""
    from common.sampling import keyed_randn

    tape, model, _ = nft_step
    shape = model.latent_shape()
    for n, (a, _, _) in enumerate(tape.calls["policy_loss"]):
        it, (m, j) = n // 18, divmod(n % 18, 9)
        x0, x_t, t = a[3], a[4], a[5]
        images = N.sample_order(4, 3, it, 0)[2 * m : 2 * m + 2].tolist()
        eps = torch.stack([keyed_randn(shape, 3, it, "eps", k, j) for k in images])
        tv = t.view(2, 1, 1, 1)
        torch.testing.assert_close(x_t, (1 - tv) * x0 + tv * eps, rtol=0, atol=1e-6)
        assert torch.equal(x0, tape.calls["policy_loss"][18 * it + 9 * m][0][3])
        assert 0 < t.min() and t.max() <= 1 and not torch.equal(x_t, x0)


def test_main_trains_each_image_at_its_keyed_timesteps(nft_step):
    """Image k's 9 timesteps at iteration i are sigmas[train_timesteps(10, 9, (seed 3, i), k)], in that order; the
    two images of a micro-batch are at different timesteps, and so is one image at its two iterations."""
    tape, _, _ = nft_step
    sigmas = N.sigma_schedule(10, 3.0)
    ts = torch.stack([a[5] for a, _, _ in tape.calls["policy_loss"]])  # (36, 2): iteration, micro-batch, timestep
    got = ts.view(2, 2, 9, 2).permute(0, 1, 3, 2).reshape(2, 4, 9)  # (iteration, place in the order, timestep)
    for it in range(2):
        order = N.sample_order(4, 3, it, 0)  # the images in the order they were trained
        expected = sigmas[N.train_timesteps(10, 9, (3, it), range(4))][order]  # (4, 9)
        torch.testing.assert_close(got[it], expected, rtol=0, atol=0)
        assert all(not torch.equal(got[it, 2 * m], got[it, 2 * m + 1]) for m in range(2))
        assert all(len(set(row.tolist())) == 9 for row in got[it])  # 9 distinct grid points, none repeated
    assert not torch.equal(got[0], got[1])


def test_samples_are_shuffled_before_the_split_into_optimizer_steps():
    """A permutation per (seed, iteration, process): another at the next iteration and on another process, the same
    when asked again (a resumed run repeats it)."""
    orders = {(it, rank): N.sample_order(8, 3, it, rank).tolist() for it in range(3) for rank in range(2)}
    assert all(sorted(o) == list(range(8)) for o in orders.values())
    assert len({tuple(o) for o in orders.values()}) == 6 and list(range(8)) not in orders.values()
    assert N.sample_order(8, 3, 1, 0).tolist() == orders[1, 0]
    assert N.sample_order(4, 3, 0, 0).tolist() == [0, 2, 3, 1]  # main()'s first iteration in the tests below


def test_the_evaluation_swap_copies_one_tensor_at_a_time_and_restores_every_bit():
    """weights_swapped holds the EMA in the parameters inside its block and gives both back exactly; the memory it
    allocates is one tensor's (the largest), not a copy of all the weights (torch's memory tracker)."""
    from benchmarks.gpu import memory

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (1000, 50_000, 20_000)]
    ema = [torch.randn(p.shape, generator=g) for p in params]
    before = [p.detach().clone() for p in params], [e.clone() for e in ema]
    inside = {}

    def swapped():
        with M.weights_swapped(params, ema):
            inside["params"] = [p.detach().clone() for p in params]

    peak = memory.measure(lambda: M.swap(params, ema), *params, *ema)
    M.swap(params, ema)  # back
    assert peak == 50_000 * 4  # the largest tensor, in fp32 (a copy of all three: 284,000 bytes)
    swapped()
    assert all(torch.equal(a, b) for a, b in zip(inside["params"], before[1]))
    assert all(torch.equal(p, b) for p, b in zip(params, before[0]))
    assert all(torch.equal(e, b) for e, b in zip(ema, before[1]))


def test_main_step_gradient_is_the_mean_of_the_per_timestep_gradients(nft_step):
    """The gradient at the first optimizer step against one computed here: the gradient of each (micro-batch,
    timestep) loss (its mean over the micro-batch's images) at the step's weights, averaged over the 2 x 9 of them.
    Summing over timesteps instead would give 9 times it, over micro-batches 2 times."""
    tape, model, at_step = nft_step
    params = at_step["params"]
    with torch.no_grad():
        for p, w in zip(params, at_step["weights"]):
            p.copy_(w)
    per_call = []
    recorded = list(zip(tape.calls["policy_loss"], tape.calls["velocity"], strict=True))[:18]  # the first step's
    for (a, kw, _), (va, vkw, _) in recorded:
        _, v_old, v_ref, x0, x_t, t, r = a
        v_theta = model.velocity(*va, **vkw).float()
        loss, _ = N.policy_loss(v_theta, v_old, v_ref, x0, x_t, t, r, **kw)
        per_call.append(torch.autograd.grad(loss.mean(), params, allow_unused=True))
    assert len(per_call) == 18
    total = 0.0
    for k, (p, g) in enumerate(zip(params, at_step["grads"])):
        mean = sum(c[k] if c[k] is not None else torch.zeros_like(p) for c in per_call) / len(per_call)
        torch.testing.assert_close(g, mean, rtol=1e-4, atol=1e-8)  # fp32 sums in another order; a wrong scale is 2x
        total += mean.abs().sum().item()
    assert total > 0
