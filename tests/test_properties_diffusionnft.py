"""diffusionnft.py's functions at values where a wrong constant, sign, bound or key shows: each against numbers worked
out by hand here. Written for the mutants benchmarks/testing/mutation.py generated that the other tests let pass."""

import warnings
from contextlib import nullcontext

import pytest
import torch

import diffusionnft as N
from common import InputError
from common import models as M  # the old policy and the weight swap (model plumbing)
from common.checkpoints import Carried
from common.models import load_model, trainable_denoiser
from common.sampling import keyed_generator


# ---------------------------------------------------------------- the ODE solver
def test_dpm_solver_2m_step_by_hand():
    """x = 2, x0_hat = 0.5, x0_prev = 0.2 from sigma_prev 0.9 through sigma 0.6 to sigma_next 0.3: ratio s'/s = 1/2,
    lambda(s) = log((1 - s) / s): lambda(0.9) = -2.197225, lambda(0.6) = -0.405465, lambda(0.3) = 0.847298,
    r = 1.791759 / 1.252763 = 1.430246; x' = 1/2 * 2 + 1/2 * (0.5 + 0.3 / (2 r)) = 1 + 0.302439 = 1.302439."""
    x, x0_hat, x0_prev = (torch.tensor([v], dtype=torch.float64) for v in (2.0, 0.5, 0.2))
    torch.testing.assert_close(
        N.dpm_solver_2m_step(x, x0_hat, x0_prev, 0.9, 0.6, 0.3), torch.tensor([1.3024385]).double()
    )
    # first order (x' = 1/2 * 2 + 1/2 * 0.5 = 1.25): no previous prediction, or one made at sigma_prev = 1
    first = torch.tensor([1.25], dtype=torch.float64)
    torch.testing.assert_close(N.dpm_solver_2m_step(x, x0_hat, None, 0.9, 0.6, 0.3), first)
    torch.testing.assert_close(N.dpm_solver_2m_step(x, x0_hat, x0_prev, 1.0, 0.6, 0.3), first)
    # the last step lands on the data prediction (lambda(0) would be infinite)
    torch.testing.assert_close(N.dpm_solver_2m_step(x, x0_hat, x0_prev, 0.9, 0.6, 0.0), x0_hat)


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
    euler = N.rollout(Linear(), "denoiser", cond, x, torch.tensor([1.0, 0.6, 0.0]), "euler", 2.0, nullcontext)
    # image 2: v = -6 + 1 = -5, x = -2 - 0.4 * -5 = 0; v = 0 + 0.6, x = 0 - 0.6 * 0.6 = -0.36
    torch.testing.assert_close(euler, torch.tensor([[-0.32], [-0.36]]))
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    dpm = N.rollout(Linear(), "denoiser", cond, x, sigmas, "dpm2", 2.0, nullcontext)
    # image 2 by the same steps: v = -5, x0_hat = 3, x = -1.5 + 0.75 = -0.75; v = -2.25 + 0.75 = -1.5,
    # x0_hat = -0.75 + 1.125 = 0.375, x = -0.5 + 0.125 = -0.375; v = -1.125 + 0.5 = -0.625, x0_hat = -0.0625,
    # D = -0.0625 + (-0.0625 - 0.375) / 2 = -0.28125, x = -0.1875 - 0.140625 = -0.328125;
    # v = -0.984375 + 0.25 = -0.734375, x = x0_hat = -0.328125 + 0.18359375 = -0.14453125
    torch.testing.assert_close(dpm, torch.tensor([[-0.0859375], [-0.14453125]]))


def test_sigma_schedule_is_the_float64_formula_rounded_once():
    """s = 1 - i / 10 warped by 3 s / (1 + 2 s), computed in float64 and rounded to float32 once (so the grid is the
    same wherever it is computed); s = 0.7: 2.1 / 2.4 = 0.875, s = 0.1: 0.3 / 1.2 = 0.25."""
    expected = [3 * (1 - i / 10) / (1 + 2 * (1 - i / 10)) for i in range(11)]
    assert torch.equal(N.sigma_schedule(10, 3.0), torch.tensor(expected, dtype=torch.float64).float())
    assert N.sigma_schedule(10, 3.0)[3] == 0.875 and N.sigma_schedule(10, 3.0)[9] == 0.25


# ---------------------------------------------------------------- timesteps
def test_train_timesteps_are_keyed_on_seed_iteration_and_image():
    """Each image's trained timesteps are the first n of its own permutation of the T grid indices, drawn from the
    generator keyed (seed, iteration, 'timesteps', global image index): deterministic, different between images,
    iterations and seeds, never repeating a timestep."""
    steps = N.train_timesteps(10, 4, (7, 3), [5, 6])
    assert steps.shape == (2, 4) and steps.dtype == torch.int64
    for row, k in zip(steps, (5, 6)):
        assert len(set(row.tolist())) == 4 and all(0 <= i < 10 for i in row.tolist())
        assert torch.equal(row, torch.randperm(10, generator=keyed_generator(7, 3, "timesteps", k))[:4])
    assert torch.equal(N.train_timesteps(10, 4, (7, 3), [5, 6]), steps)  # deterministic
    assert not torch.equal(steps[0], steps[1])  # each image its own draw
    assert not torch.equal(N.train_timesteps(10, 4, (8, 3), [5, 6]), steps)  # another seed
    assert not torch.equal(N.train_timesteps(10, 4, (7, 4), [5, 6]), steps)  # another iteration


def test_fractional_timestep_count_and_forward_process():
    """0.99 of 10 timesteps trains 9 (truncated, as the official code); x_t = (1 - t) x0 + t eps at t = 0.3:
    0.7 * 2 + 0.3 * -1 = 1.1."""
    assert N.n_train_timesteps(10, 0.99) == 9 and N.n_train_timesteps(10, 0.4) == 4
    x0, eps = torch.tensor([[2.0], [4.0]]), torch.tensor([[-1.0], [1.0]])
    torch.testing.assert_close(N.noised(x0, eps, torch.tensor([0.3, 0.75])), torch.tensor([[1.1], [1.75]]))


# ---------------------------------------------------------------- the old policy
def test_the_old_policy_of_full_fine_tuning_is_a_frozen_copy_and_its_weights_are_its_own():
    policy = torch.nn.Linear(3, 2)
    old = M.add_old_policy(policy, lora=False)
    assert old is not policy and all(not p.requires_grad for p in old.parameters())
    assert all(torch.equal(o, p) for o, p in zip(old.parameters(), policy.parameters()))
    pairs = zip(M.old_weights(policy, old, lora=False), old.parameters())
    assert all(w is o for w, o in pairs)  # the copy's tensors, not the trained ones
    with M.old_policy(policy, old, lora=False) as module:
        assert module is old


def test_the_old_adapter_is_added_without_a_warning_and_with_its_own_config():
    policy = trainable_denoiser(load_model("shapesbench"), N.Args(lora_rank=4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # peft's "Already found a `peft_config`" is expected and silenced
        assert M.add_old_policy(policy, lora=True) is None
    assert policy.peft_config["old"] is not policy.peft_config["default"]


# ---------------------------------------------------------------- flags: every bound at its edge, each message naming it
REFUSED = [  # each message whole: a constant bound is the declaration's message, one that reads another flag its own
    (dict(num_steps=0), "--num-steps must be >= 1 (got 0)"),
    (dict(timestep_fraction=0.0), "--timestep-fraction must be > 0 (got 0.0)"),
    (dict(timestep_fraction=1.5), "--timestep-fraction must be <= 1 (got 1.5)"),
    (
        dict(timestep_fraction=0.09),  # int(10 x 0.09) = 0
        "--timestep-fraction 0.09 trains int(10 x 0.09) = 0 of the --num-steps 10 timesteps; raise it",
    ),
    (dict(group_size=1), "--group-size must be >= 2 (got 1)"),
    (dict(rollout_batch_size=24), "--samples-per-device must be a multiple of --rollout-batch-size"),
    (
        dict(samples_per_device=48, samples_per_update=24),
        "--samples-per-update must be a multiple of --train-batch-size and divide --samples-per-device",
    ),
    (dict(beta=0.0), "--beta must be > 0 (got 0.0)"),
    (dict(kl_beta=-1.0), "--kl-beta must be >= 0 (got -1.0)"),
    (dict(adv_clip_max=0.0), "--adv-clip-max must be > 0 (got 0.0)"),
    (dict(ema_max_decay=1.0), "--ema-max-decay must be < 1 (got 1.0)"),
    (dict(ema_max_decay=1.5), "--ema-max-decay must be < 1 (got 1.5)"),
    (dict(old_decay_speed=0.0), "--old-decay-speed must be > 0 (got 0.0)"),
]
ACCEPTED = [
    dict(num_steps=1, timestep_fraction=1.0),
    dict(timestep_fraction=0.1),  # int(10 x 0.1) = 1 timestep, the fewest
    dict(kl_beta=0.0),
    dict(adv_clip_max=0.5),
    dict(ema_max_decay=0.0),
]


@pytest.mark.parametrize("flags,message", REFUSED)
def test_each_refused_flag_is_one_message_that_starts_with_it(flags, message):
    with pytest.raises(InputError) as e:
        N.resolve_and_check(N.Args(**flags))
    assert str(e.value) == message


@pytest.mark.parametrize("flags", ACCEPTED)
def test_each_bound_itself_is_accepted(flags):
    args = N.Args(**flags)
    N.resolve_and_check(args)
    assert args.exp_name == "diffusionnft"
    named = N.Args(exp_name="mine", **flags)
    N.resolve_and_check(named)
    assert named.exp_name == "mine"


def test_a_video_model_is_refused(tmp_path):
    (tmp_path / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    (tmp_path / "p.txt").write_text("a cat\na dog\n")
    args = N.Args(model_id=str(tmp_path), prompts=str(tmp_path / "p.txt"), eval_prompts=str(tmp_path / "p.txt"))
    with pytest.raises(InputError, match="is a video model \\(wan\\), and .* trains image models only"):
        N.resolve_and_check(args)


# ---------------------------------------------------------------- the EMA's swap and the checkpoint's extra tensors
def test_weights_swapped_holds_the_values_inside_and_restores_them_bitwise_after():
    """By default the block sees `values` (the EMA); after it the parameters are their own again, bitwise, even when
    the block raises; on=False leaves them alone."""
    params = [torch.tensor([1.0, -2.0]), torch.tensor([0.3])]
    own = [p.clone() for p in params]
    ema = [torch.tensor([0.5, 0.25]), torch.tensor([-1.0])]
    ema_values = [e.clone() for e in ema]
    with M.weights_swapped(params, ema):
        assert all(torch.equal(p, e) for p, e in zip(params, ema_values))
    assert all(torch.equal(p, o) for p, o in zip(params, own))
    assert all(torch.equal(e, v) for e, v in zip(ema, ema_values))  # the EMA as it was
    with pytest.raises(RuntimeError), M.weights_swapped(params, ema):
        raise RuntimeError("an evaluation that fails")
    assert all(torch.equal(p, o) for p, o in zip(params, own))
    with M.weights_swapped(params, ema, on=False):
        assert all(torch.equal(p, o) for p, o in zip(params, own))


def test_a_soft_update_or_a_checkpoint_of_another_length_is_refused():
    """Lists of tensors that do not pair up (a parameter missing from the old policy or the EMA) are an error, never a
    partial update."""
    a, b = torch.zeros(2), torch.ones(2)
    with pytest.raises(ValueError):
        N.soft_update([a.clone()], [a, b], 0.5)
    carried = Carried(ema=[a.clone(), b.clone()])
    with pytest.raises(ValueError):
        carried.load_state_dict({"ema": [a]})
