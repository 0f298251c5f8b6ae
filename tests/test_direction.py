"""Each script's own update moves toward its objective. main() runs one iteration in this process (ShapesBench, one
optimizer step); wrappers record what TRAINING fed its loss, and after the run the trained rows are scored again
with the updated weights. The change of each row's log-likelihood (V-GRPO: its surrogate) must go with its
advantage, taken from where main() computed it, not from what it passed to the loss; with zero advantages and a KL
weight, the update must bring the policy closer to the base model. A flipped advantage or KL sign in main() fails.
"""

import functools

import pytest
import torch
import tyro

import branchgrpo as B
import dancegrpo as D
import rlr as R
import vgrpo as V
from common import rewards
from common.models import base_weights, reference_velocity
from common.rewards import ScoreFn

QUICK = ["--iterations", "1", "--eval-every", "0", "--sample-every", "0", "--no-save", "--lr-warmup", "0"]


class Tape:
    """Wraps functions of a script module and records their calls (args, kwargs, output) in order."""

    def __init__(self, monkeypatch, module, *names):
        self.calls = {name: [] for name in names}
        self.functions = {name: getattr(module, name) for name in names}  # the originals, before wrapping
        for name in names:
            monkeypatch.setattr(module, name, self.wrap(name, getattr(module, name)))

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def recorded(*a, **kw):
            out = fn(*a, **kw)
            self.calls[name].append((a, kw, out))
            return out

        return recorded


def gaussian_kl(mean, mean_ref, std):
    """KL(N(mean, std^2) || N(mean_ref, std^2)) per row, averaged over the latent dimensions (as the log-prob)."""
    return ((mean - mean_ref) ** 2).flatten(1).mean(1) / (2 * std.flatten() ** 2)


def run_main(module, monkeypatch, tmp_path, flags, tape_names, perturb_lora=False):
    """module.main() on `flags`, one iteration; returns the tape and the model (its denoiser holds the new weights)."""
    tape = Tape(monkeypatch, module, *tape_names)
    loaded = {}

    def load_model(*a, **kw):
        loaded["model"] = model = load(*a, **kw)
        velocity, calls = model.velocity, tape.calls.setdefault("velocity", [])

        def recorded(*va, **vkw):  # the forwards with gradients: TRAINING's
            out = velocity(*va, **vkw)
            if torch.is_grad_enabled():
                calls.append((va, vkw, out))
            return out

        model.velocity = recorded
        return model

    def trainable_denoiser(model, args):
        denoiser = make_trainable(model, args)
        if perturb_lora:  # a policy away from the base model, so that the KL term has a gradient
            gen = torch.Generator().manual_seed(0)
            for name, p in denoiser.named_parameters():
                if "lora_B" in name:
                    p.data = 0.05 * torch.randn(p.shape, generator=gen)
        return denoiser

    load, make_trainable = module.load_model, module.trainable_denoiser
    monkeypatch.setattr(module, "load_model", load_model)
    monkeypatch.setattr(module, "trainable_denoiser", trainable_denoiser)
    args = tyro.cli(module.Args, args=[*flags, *QUICK, "--output-dir", str(tmp_path)])
    module.main(args)
    return tape, loaded["model"]


@pytest.fixture
def zero_reward(monkeypatch):
    """A reward that scores every image 0: advantages 0, so that only the KL term trains."""
    zero = lambda device, checkpoint=None: ScoreFn(lambda x, p: x.sum((1, 2, 3)) * 0, False)  # noqa: E731
    monkeypatch.setitem(rewards.REWARDS, "zero", rewards.RewardKind(zero, differentiable=False))


DANCE = [
    "--samples-per-device",
    "4",
    "--group-size",
    "4",
    "--rollout-batch-size",
    "4",
    "--samples-per-update",
    "4",
    "--num-steps",
    "4",
    "--learning-rate",
    "1e-3",
]  # fmt: skip  (one chunk, one group, one update)


def dance_rescore(model, tape):
    """Per training step of dancegrpo.py (the policy's velocity and SDE step, with a KL term the reference's, then the
    loss): the old log-prob (B,) and, under the updated weights, the new one and the step's mean (and the base
    model's mean with a KL term)."""
    velocity_calls = tape.calls["velocity"]
    rows = []
    policy_steps = [c for c in tape.calls["sde_step"] if c[1].get("prev_sample") is not None]
    per_step = len(policy_steps) // len(tape.calls["policy_loss"])  # 1, or 2 with a KL reference step
    for k in range(len(tape.calls["policy_loss"])):
        (x, _, sigma, sigma_next, g), kw, (_, old_lp, _, std) = policy_steps[k * per_step]
        (_, x_v, sig, cond, gs), _, _ = velocity_calls[k * per_step]
        assert torch.equal(x_v, x)
        with torch.no_grad():
            v_new = model.velocity(model.transformer, x, sig, cond, gs).float()
            _, new_lp, new_mean, _ = D.sde_step(x, v_new, sigma, sigma_next, g, prev_sample=kw["prev_sample"])
            ref_mean = None
            if per_step == 2:
                v_ref = reference_velocity(model, model.transformer, True, x, sig, cond, gs).float()
                ref_mean = D.sde_step(x, v_ref, sigma, sigma_next, g, prev_sample=kw["prev_sample"])[2]
        rows.append({"old": old_lp.detach(), "new": new_lp, "new_mean": new_mean, "ref_mean": ref_mean, "std": std})
    return rows


def test_dancegrpo_update_raises_the_likelihood_of_samples_with_positive_advantage(monkeypatch, tmp_path):
    tape, model = run_main(D, monkeypatch, tmp_path, DANCE, ["sde_step", "policy_loss", "group_advantages"])
    adv = tape.calls["group_advantages"][0][2]  # (4,): main()'s advantages, one group
    rows = dance_rescore(model, tape)
    gain = sum(float((adv * (r["new"] - r["old"])).sum()) for r in rows)
    assert gain > 0, gain


def test_dancegrpo_kl_term_pulls_the_policy_toward_the_base_model(monkeypatch, tmp_path, zero_reward):
    flags = [*DANCE, "--reward", "zero", "--kl-beta", "1", "--learning-rate", "1e-5"]  # a small step: first order
    tape, model = run_main(D, monkeypatch, tmp_path, flags, ["sde_step", "policy_loss"], perturb_lora=True)
    old_kl = torch.cat([gaussian_kl(c[0][3], c[0][5], c[0][6]) for c in tape.calls["policy_loss"]])  # mean, ref, std
    rows = dance_rescore(model, tape)
    new_kl = torch.cat(
        [((r["new_mean"] - r["ref_mean"]) ** 2).flatten(1).mean(1) / (2 * r["std"].flatten() ** 2) for r in rows]
    )
    assert old_kl.sum() > 0 and new_kl.sum() < old_kl.sum(), (old_kl.sum(), new_kl.sum())


VGRPO = ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4", "--train-batch-size", "4",
         "--samples-per-update", "4", "--num-steps", "4", "--n-mc", "2", "--learning-rate", "1e-3"]  # fmt: skip


def test_vgrpo_update_raises_the_surrogate_of_samples_with_positive_advantage(monkeypatch, tmp_path):
    tape, model = run_main(V, monkeypatch, tmp_path, VGRPO, ["surrogate", "combined_advantages"])
    adv = tape.calls["combined_advantages"][0][2]  # (4,): main()'s advantages
    training = [c for c in tape.calls["surrogate"] if c[2][0].requires_grad]  # the forwards with gradients
    assert len(training) == 1
    a, kw, (old_values, _) = training[0]
    with torch.no_grad():
        new_values, _ = V.surrogate(*a, **kw)
    gain = float((adv * (new_values.mean(1) - old_values.detach().mean(1))).sum())
    assert gain > 0, gain


BRANCH = ["--trees-per-device", "1", "--trees-per-update", "1", "--num-steps", "6", "--num-splits", "2",
          "--rollout-batch-size", "4", "--learning-rate", "1e-3"]  # fmt: skip


def test_branchgrpo_update_raises_the_likelihood_of_edges_with_positive_advantage(monkeypatch, tmp_path):
    tape, model = run_main(B, monkeypatch, tmp_path, BRANCH, ["micro_batch", "edge_gaussians"])
    g = tape.calls["edge_gaussians"][0][0][5]
    gain = 0.0
    for (_, segments, sigmas, tree), _, out in tape.calls["micro_batch"]:
        x, sig, cond, masks, x_child, old_lp, adv = out  # adv: from main()'s depth advantages, per trained edge
        with torch.no_grad():
            v = model.velocity(model.transformer, x, sig, cond, 1.0).float()
            mean, std = B.edge_gaussians(x, v, segments, masks, sigmas, g, tree)
            gain += float((adv * (B.gaussian_log_prob(x_child, mean, std) - old_lp)).sum())
    assert gain > 0, gain


RLR = ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "2", "--num-steps", "4",
       "--terms", "fo+ho", "--reward", "flat", "--learning-rate", "1e-4"]  # fmt: skip


@pytest.fixture
def flat_reward(monkeypatch):
    """Brightness as the reward, with a zero gradient: RLR's first-order term is then 0 and its update is the
    half-order likelihood-ratio term alone."""

    def score(x, p):
        return x.sum((1, 2, 3)) * 0 + x.detach().mean((1, 2, 3))

    flat = rewards.RewardKind(lambda device, checkpoint=None: ScoreFn(score, True), differentiable=True)
    monkeypatch.setitem(rewards.REWARDS, "flat", flat)


def test_rlr_half_order_update_raises_the_likelihood_of_samples_above_their_baseline(
    monkeypatch, tmp_path, flat_reward
):
    tape, _ = run_main(R, monkeypatch, tmp_path, RLR, ["subchain_log_prob", "term_weights"])
    ((_, _, (w_ho, _, _, _)),) = tape.calls["term_weights"]  # R - b per sample (N,), as main() computed it
    gain, rows = 0.0, 0
    for (mean_std, latents, noise, j, h), _, (old_lp, _) in list(tape.calls["subchain_log_prob"]):
        with torch.no_grad():  # mean_std calls the trained module: the updated weights now
            new_lp, _ = R.subchain_log_prob(mean_std, latents, noise, j, h)
        gain += float((w_ho[rows : rows + len(new_lp)] * (new_lp - old_lp.detach())).sum())
        rows += len(new_lp)
    assert rows == 4 and gain > 0, gain


def test_branchgrpo_kl_term_pulls_the_policy_toward_the_base_model(monkeypatch, tmp_path, zero_reward):
    flags = [*BRANCH, "--reward", "zero", "--kl-beta", "1", "--learning-rate", "1e-5"]  # a small step: first order
    names = ["micro_batch", "edge_gaussians", "policy_loss"]
    tape, model = run_main(B, monkeypatch, tmp_path, flags, names, perturb_lora=True)
    g = tape.calls["edge_gaussians"][0][0][5]
    old_kl = torch.cat([gaussian_kl(*c[0][3:6]) for c in tape.calls["policy_loss"]])  # per trained edge
    new_kl = []
    for (_, segments, sigmas, tree), _, (x, sig, cond, masks, *_) in list(tape.calls["micro_batch"]):
        with torch.no_grad():
            v = model.velocity(model.transformer, x, sig, cond, 1.0).float()
            v_ref = reference_velocity(model, model.transformer, True, x, sig, cond, 1.0).float()
            mean, std = B.edge_gaussians(x, v, segments, masks, sigmas, g, tree)
            mean_ref, _ = B.edge_gaussians(x, v_ref, segments, masks, sigmas, g, tree)
        new_kl.append(((mean - mean_ref) ** 2).flatten(1).mean(1) / (2 * std**2))
    new_kl = torch.cat(new_kl)
    assert old_kl.sum() > 0 and new_kl.sum() < old_kl.sum(), (old_kl.sum(), new_kl.sum())


def test_vgrpo_kl_term_pulls_the_policy_toward_the_base_model(monkeypatch, tmp_path, zero_reward):
    flags = [*VGRPO, "--reward", "zero", "--kl-beta", "1", "--kl-ref", "base", "--learning-rate", "1e-5"]
    tape, model = run_main(V, monkeypatch, tmp_path, flags, ["surrogate", "policy_loss"], perturb_lora=True)
    (old_kl,) = [(a[3] - a[4]).square().flatten(2).mean(2).mean(1) for a, _, _ in tape.calls["policy_loss"]]  # (B,)
    (training,) = [c for c in tape.calls["surrogate"] if c[2][0].requires_grad]
    a, kw, _ = training
    with torch.no_grad():
        _, x0_new = V.surrogate(*a, **kw)
        with base_weights(model.transformer, True):  # the base model: the adapter off
            _, x0_base = V.surrogate(*a, **kw)
    new_kl = (x0_new - x0_base).square().flatten(2).mean(2).mean(1)
    assert old_kl.sum() > 0 and new_kl.sum() < old_kl.sum(), (old_kl.sum(), new_kl.sum())
