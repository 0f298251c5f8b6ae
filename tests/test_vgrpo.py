"""vgrpo.py: the solver, the (t, eps) pairs, the surrogate and its ablations, log ratio == 0, the script end to end."""

import math
import signal
import sys
from contextlib import nullcontext

import pytest
import torch
import tyro

import vgrpo as V
from common import InputError
from common.models import load_model
from tests.helpers import (
    assert_final_loads,
    assert_survives_kills,
    find_run,
    logged,
    metrics,
    replace_flags,
    run_recipe,
    run_until,
    worker_pid,
)
from tests.helpers import run_script as run
from tests.tiny import build_flux, build_shapes, build_tiny_hps

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
    "2",
    "--samples-per-update",
    "4",
    "--num-steps",
    "4",
    "--n-mc",
    "3",
    "--eval-every",
    "2",
    "--eval-samples-per-prompt",
    "1",
    "--eval-steps",
    "4",
    "--sample-every",
    "2",
]
PROMPTS = ["a red circle on a blue background", "a green square on a white background"]


def run_script(args, tmp_path, *rest, **kw):
    return run("vgrpo.py", args, tmp_path, *rest, **kw)


class FakeModel:
    """A smooth, non-linear stand-in velocity field, enough to exercise the solvers."""

    def velocity(self, transformer, x, sigma, cond, guidance_scale=1.0):
        return torch.sin(3 * x) * sigma.view(-1, *[1] * (x.dim() - 1)) + 0.5 * x - 0.3


# ---------------------------------------------------------------- solver
def test_dpm_solver_2m_step_is_the_dpm_solver_pp_formula():
    g = torch.Generator().manual_seed(0)
    x, d, d_prev = (torch.randn(2, 5, generator=g) for _ in range(3))
    s_prev, s, s_next = 0.9, 0.7, 0.4
    # DPM-Solver++(2M) as written in the paper: alpha = 1 - s, lambda = log(alpha / sigma)
    lam = lambda s: math.log((1 - s) / s)
    h, h0 = lam(s_next) - lam(s), lam(s) - lam(s_prev)
    d1 = (d - d_prev) / (h0 / h)
    expected = (s_next / s) * x - (1 - s_next) * (math.exp(-h) - 1) * d - 0.5 * (1 - s_next) * (math.exp(-h) - 1) * d1
    torch.testing.assert_close(V.dpm_solver_2m_step(x, d, d_prev, s_prev, s, s_next), expected)
    # first order (no history, after sigma = 1, or landing on 0) is the DDIM step, which equals Euler for flows
    v = (x - d) / s
    for args in ((None, 1.0, s, s_next), (d_prev, 1.0, s, s_next)):
        torch.testing.assert_close(V.dpm_solver_2m_step(x, d, *args), x + (s_next - s) * v)
    assert torch.equal(V.dpm_solver_2m_step(x, d, d_prev, s_prev, s, 0.0), d)  # the last step lands on x0_hat


def test_rollout_matches_diffusers_dpm_solver_multistep_on_our_schedule():
    from diffusers import DPMSolverMultistepScheduler

    T, shift = 10, 3.0
    sigmas = V.sigma_schedule(T, shift)
    sched = DPMSolverMultistepScheduler(
        use_flow_sigmas=True,
        flow_shift=shift,
        prediction_type="flow_prediction",
        algorithm_type="dpmsolver++",
        solver_order=2,
        final_sigmas_type="zero",
    )
    sched.set_timesteps(T)
    sched.sigmas = sigmas.clone()  # its own flow schedule starts at shift(0.999); the update is what we compare
    sched.set_begin_index(0)
    x0 = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(1))
    x = x0.clone()
    for i in range(T):
        x = sched.step(FakeModel().velocity(None, x, sigmas[i].expand(3), {}), sched.timesteps[i], x).prev_sample
    ours = V.rollout(FakeModel(), None, {}, x0.clone(), sigmas, "dpm++2m", 1.0, nullcontext)
    torch.testing.assert_close(ours, x, atol=1e-5, rtol=1e-5)
    # --solver euler is the plain Euler ODE of common/sampling.py's sample_ode
    e = x0.clone()
    for i in range(T):
        e = e + (sigmas[i + 1] - sigmas[i]) * FakeModel().velocity(None, e, sigmas[i].expand(3), {})
    assert torch.equal(V.rollout(FakeModel(), None, {}, x0.clone(), sigmas, "euler", 1.0, nullcontext), e)
    assert not torch.allclose(ours, e, atol=1e-3)  # and the two solvers do differ


# ---------------------------------------------------------------- pairs
def test_stratified_draws_fall_one_per_chunk_and_never_at_zero():
    sigmas = V.sigma_schedule(10, 3.0)
    grid = sigmas[:-1]
    chunks = [c.tolist() for c in torch.arange(10).tensor_split(4)]  # sizes 3, 3, 2, 2
    assert [len(c) for c in chunks] == [3, 3, 2, 2]
    hits = torch.zeros(10)
    for it in range(200):
        t, eps = V.draw_pairs(grid, 4, (3, 8, 8), (0, it), range(2))
        assert t.shape == (2, 4) and eps.shape == (2, 4, 3, 8, 8)
        idx = [int((grid == x).nonzero()) for x in t[0]]
        assert all(i in c for i, c in zip(idx, chunks)) and torch.all(t > 0)
        hits[idx] += 1
    assert torch.all(hits > 0)  # every grid point, sigma = 1 included, is reachable; 0 never is


def test_pairs_are_identical_across_a_group_and_across_processes():
    grid = V.sigma_schedule(6, 3.0)[:-1]
    # process 0 owns samples 0..3, process 1 samples 4..7: both draw the same pairs from the same key
    t0, e0 = V.draw_pairs(grid, 4, (3, 8, 8), (7, 3), range(4))
    t1, e1 = V.draw_pairs(grid, 4, (3, 8, 8), (7, 3), range(4, 8))
    assert torch.equal(t0, t1) and torch.equal(e0, e1)
    assert all(torch.equal(t0[0], t0[i]) and torch.equal(e0[0], e0[i]) for i in range(4))
    _, e2 = V.draw_pairs(grid, 4, (3, 8, 8), (7, 4), range(4))  # a fresh draw each iteration
    _, e3 = V.draw_pairs(grid, 4, (3, 8, 8), (8, 3), range(4))  # and each seed
    assert not torch.equal(e0, e2) and not torch.equal(e0, e3)


def test_no_shared_pairs_draws_per_image_and_changes_nothing_else():
    grid = V.sigma_schedule(10, 3.0)[:-1]
    t, eps = V.draw_pairs(grid, 4, (2, 4, 4), (0, 0), range(8), shared=False)
    assert not torch.equal(eps[0], eps[1]) and len({tuple(r.tolist()) for r in t}) > 1
    chunks = torch.arange(10).tensor_split(4)
    for row in t:  # still stratified, per image
        assert all(int((grid == x).nonzero()) in c.tolist() for x, c in zip(row, chunks))
    # keyed by global sample index: a sample's pairs do not depend on which process holds it
    t_b, eps_b = V.draw_pairs(grid, 4, (2, 4, 4), (0, 0), range(4, 8), shared=False)
    assert torch.equal(t[4:], t_b) and torch.equal(eps[4:], eps_b)


def test_uniform_pair_times_fall_one_per_equal_interval_of_0_1():
    """--pair-times uniform (the paper's description): one t in each of the N_MC equal intervals of (0, 1), so t below
    the last rollout sigma is drawn too; --no-stratified draws i.i.d. uniform times."""
    lows = []
    for it in range(200):
        t, _ = V.draw_pairs(None, 4, (2, 4, 4), (0, it), range(2))
        assert torch.equal(t[0], t[1])
        assert torch.all((t[0] >= torch.arange(4) / 4) & (t[0] < (torch.arange(4) + 1) / 4))
        lows.append(float(t[0, 0]))
    assert min(lows) < V.sigma_schedule(10, 3.0)[-2]  # below sigma_{T-1} = 0.25: unreachable on the grid
    t, _ = V.draw_pairs(None, 4, (2, 4, 4), (0, 0), range(2), stratified=False)
    assert t.shape == (2, 4) and torch.all((t >= 0) & (t < 1))


def test_no_stratified_changes_only_the_timesteps():
    grid = V.sigma_schedule(10, 3.0)[:-1]
    chunks = [c.tolist() for c in torch.arange(10).tensor_split(4)]
    same_chunk = 0
    for it in range(100):
        _, e_s = V.draw_pairs(grid, 4, (2, 4, 4), (0, it), range(2), stratified=True)
        t_u, e_u = V.draw_pairs(grid, 4, (2, 4, 4), (0, it), range(2), stratified=False)
        assert torch.equal(e_s, e_u)  # the noise is untouched
        assert all(bool((grid == x).any()) for x in t_u[0])  # same support: the rollout schedule, never 0
        which = [next(j for j, c in enumerate(chunks) if int((grid == x).nonzero()) in c) for x in t_u[0]]
        same_chunk += len(set(which)) < 4
    assert same_chunk > 50  # i.i.d. draws usually share a chunk (all apart: 4! x 3 x 3 x 2 x 2 / 10^4 = 9%)


# ---------------------------------------------------------------- surrogate
def test_pair_values_by_hand():
    """Two pairs at t = 0.2 and 0.7 (not 0.5, where t and 1 - t coincide), each with its own t."""
    x = torch.tensor([[1.0, -2.0], [0.5, 1.0]])
    eps = torch.tensor([[0.5, 1.0], [-1.0, 2.0]])
    t = torch.tensor([0.2, 0.7])
    z = torch.tensor([[0.9, -1.4], [-0.55, 1.7]])  # (1 - t) x + t eps
    v = torch.tensor([[0.0, 2.0], [1.0, -1.0]])
    values, x0_hat = V.pair_values(v, x, z, eps, t)
    torch.testing.assert_close(x0_hat, torch.tensor([[0.9, -1.8], [-1.25, 2.4]]))  # z - t v
    # err = x0_hat - x = [-0.1, 0.2] (mean square 0.025, mean abs 0.15) and [-1.75, 1.4] (2.51125, 1.575)
    torch.testing.assert_close(values, torch.tensor([-0.025 / 0.15, -2.51125 / 1.575]))
    torch.testing.assert_close(
        V.pair_values(v, x, z, eps, t, self_normalize=False)[0], torch.tensor([-0.025, -2.51125])
    )
    # the normaliser is clamped at 1e-5 and carries no gradient
    values, _ = V.pair_values(v[:1], x[:1], x[:1].clone(), eps[:1], torch.tensor([1e-9]))
    assert torch.isfinite(values).all()
    v = v.clone().requires_grad_()
    V.pair_values(v, x, z, eps, t)[0].sum().backward()
    # d/dv of -mean(err^2) / w with err = x0_hat - x, d x0_hat / dv = -t: err t / w (2 dims: 2 err / 2)
    expected = torch.tensor([[-0.1 * 0.2 / 0.15, 0.2 * 0.2 / 0.15], [-1.75 * 0.7 / 1.575, 1.4 * 0.7 / 1.575]])
    torch.testing.assert_close(v.grad, expected)


def test_prediction_and_self_normalize_change_only_the_error_space_and_weight():
    g = torch.Generator().manual_seed(0)
    x, eps, v = (torch.randn(6, 3, 4, 4, generator=g) for _ in range(3))
    t = torch.tensor([1.0, 0.9, 0.6, 0.4, 0.2, 0.05])
    z = (1 - t.view(-1, 1, 1, 1)) * x + t.view(-1, 1, 1, 1) * eps
    out = {(p, n): V.pair_values(v, x, z, eps, t, p, n) for p in ("x", "v", "eps") for n in (True, False)}
    for _, x0_hat in out.values():
        assert torch.equal(x0_hat, out[("x", True)][1])  # x0_hat (used by the KL term) never changes
    # x-error = -t v-error, eps-error = (1 - t) v-error: plain MSE scales by the square, the self-normalised by |.|
    torch.testing.assert_close(out[("x", False)][0], t**2 * out[("v", False)][0])
    torch.testing.assert_close(out[("eps", False)][0][1:], (1 - t[1:]) ** 2 * out[("v", False)][0][1:])
    torch.testing.assert_close(out[("x", True)][0], t * out[("v", True)][0])
    torch.testing.assert_close(out[("eps", True)][0][1:], (1 - t[1:]) * out[("v", True)][0][1:])
    assert out[("eps", True)][0][0] == 0  # at t = 1, eps_hat = z + 0 v = eps exactly: no signal (the paper's collapse)
    for p in ("x", "v", "eps"):  # self-normalisation divides by the mean absolute error of the same space
        err = {"x": out[("x", True)][1] - x, "v": v - (eps - x), "eps": z + (1 - t.view(-1, 1, 1, 1)) * v - eps}[p]
        torch.testing.assert_close(
            out[(p, True)][0][1:], (out[(p, False)][0] / err.abs().flatten(1).mean(1).clamp_min(1e-5))[1:]
        )


def test_log_ratio_is_exactly_zero_at_the_first_update(tmp_path):
    build_shapes(tmp_path)
    model = load_model(str(tmp_path))
    tr = model.transformer
    cond = model.encode_prompts(PROMPTS * 2)
    sigmas = V.sigma_schedule(6, 3.0)
    L = model.latent_shape()  # (4, 8, 8)
    init = torch.randn(4, *L, generator=torch.Generator().manual_seed(0))
    x = V.rollout(model, tr, cond, init, sigmas, "dpm++2m", 1.0, nullcontext)
    assert x.shape == (4, *L) and x.dtype == torch.float32
    t, eps = V.draw_pairs(sigmas[:-1], 3, L, (0, 0), range(4))
    tr.eval()
    with torch.no_grad():  # behaviour values, right after the rollout
        old, old_x0 = V.surrogate(model, tr, x, cond, t, eps, 1.0, nullcontext)
    tr.train()
    new, x0_hat = V.surrogate(model, tr, x, cond, t, eps, 1.0, nullcontext)  # training forward, with grad
    loss, figures = V.policy_loss(
        new, old, torch.tensor([1.0, -1.0, 0.5, 0.0]), x0_hat, None, clip_range=6e-3, kl_beta=0
    )
    ratio, log_ratio_max = figures["ratio_mean"], figures["log_ratio_max_abs"]
    assert log_ratio_max == 0 and torch.equal(ratio, torch.ones(4)) and torch.equal(x0_hat, old_x0)
    loss.mean().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tr.parameters())


def test_positive_advantage_raises_the_surrogate(tmp_path):
    build_shapes(tmp_path)
    model = load_model(str(tmp_path))
    tr = model.transformer
    cond = model.encode_prompts(PROMPTS)
    L = model.latent_shape()
    x = torch.randn(2, *L, generator=torch.Generator().manual_seed(0)).clamp(-1, 1)
    t, eps = V.draw_pairs(V.sigma_schedule(8, 3.0)[:-1], 4, L, (0, 0), range(2))
    with torch.no_grad():
        old, _ = V.surrogate(model, tr, x, cond, t, eps, 1.0, nullcontext)
    start = {k: v.clone() for k, v in tr.state_dict().items()}
    for advantage in (1.0, -1.0):  # one gradient step from the same weights for each sign, on the first sample
        tr.load_state_dict(start)
        tr.zero_grad()
        new, _ = V.surrogate(model, tr, x, cond, t, eps, 1.0, nullcontext)
        loss, _ = V.policy_loss(new, old, torch.tensor([advantage, 0.0]), None, None, clip_range=6e-3, kl_beta=0)
        loss.mean().backward()
        with torch.no_grad():
            for p in tr.parameters():
                if p.grad is not None:
                    p -= 1e-3 * p.grad
            after, _ = V.surrogate(model, tr, x, cond, t, eps, 1.0, nullcontext)
        assert (after.mean(1)[0] - old.mean(1)[0]) * advantage > 0


# ---------------------------------------------------------------- advantages and loss
def test_combined_advantages_per_reward_then_weights_then_clips():
    a = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0])
    b = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 4.0])
    ga, gb = V.group_advantages(a, 4), V.group_advantages(b, 4)
    assert torch.all(ga[4:] == 0)
    torch.testing.assert_close(
        V.combined_advantages(
            {"a": a, "b": b}, {"a": 1.0, "b": 0.5}, group_size=4, adv_clip_max=5.0, adv_soft_clip=0.0
        ),
        ga + 0.5 * gb,
    )
    # a zero weight is logged elsewhere but never enters the advantage
    torch.testing.assert_close(
        V.combined_advantages(
            {"a": a, "b": b}, {"a": 2.0, "b": 0.0}, group_size=4, adv_clip_max=5.0, adv_soft_clip=0.0
        ),
        2 * ga,
    )
    torch.testing.assert_close(
        V.combined_advantages({"a": a}, {"a": 10.0}, group_size=4, adv_clip_max=5.0, adv_soft_clip=0.0),
        (10 * ga).clamp(-5, 5),
    )
    soft = V.combined_advantages({"a": a}, {"a": 1.0}, group_size=4, adv_clip_max=5.0, adv_soft_clip=1.0)
    torch.testing.assert_close(soft, torch.tanh(ga))
    assert soft.abs().max() < 1


def test_policy_loss_averages_pairs_before_the_ratio_and_clips():
    old = torch.zeros(4, 2)
    new = torch.log(torch.tensor([[1.0, 1.0], [1.5, 1.5], [0.5, 0.5], [1.5, 1.5]]))
    new[0] = torch.tensor([0.3, -0.3])  # pairs that cancel: ratio exactly exp(0)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, figures = V.policy_loss(new, old, adv, None, None, clip_range=0.2, kl_beta=0)
    torch.testing.assert_close(figures["ratio_mean"], torch.tensor([1.0, 1.5, 0.5, 1.5]))
    torch.testing.assert_close(loss, torch.tensor([-1.0, -1.2, 0.8, 1.5]))


def test_coefficient_of_variation():
    """Groups of 2 whose values differ: [-1, -3] (std sqrt 2, |mean| 2) and [2, 4] (std sqrt 2, mean 3); over all 4,
    mean 0.5 and squared deviations 2.25 + 12.25 + 2.25 + 12.25 = 29 (unbiased variance 29 / 3)."""
    s = torch.tensor([-1.0, -3.0, 2.0, 4.0])
    cv, group_cv = V.coefficient_of_variation(s, 2)
    assert cv == pytest.approx(math.sqrt(29 / 3) / 0.5)
    assert group_cv == pytest.approx((math.sqrt(2) / 2 + math.sqrt(2) / 3) / 2)


def test_validation_names_the_flag(tmp_path):
    with pytest.raises(InputError, match="--n-mc"):
        V.resolve_and_check(V.Args(num_steps=3, n_mc=4))
    V.resolve_and_check(V.Args(num_steps=3, n_mc=4, stratified=False))  # i.i.d. draws need no chunks
    with pytest.raises(InputError, match="--samples-per-update"):
        V.resolve_and_check(V.Args(samples_per_update=12))
    with pytest.raises(InputError, match="unknown reward"):
        V.resolve_and_check(V.Args(reward="nope"))
    flags = ["--samples-per-device", "10", "--group-size", "4", "--rollout-batch-size", "2", "--train-batch-size", "2"]
    out = run_script(
        flags + ["--samples-per-update", "10"], tmp_path, check=False
    )  # main()'s check of the process count
    assert out.returncode == 2 and "--group-size 4" in out.stderr and "Traceback" not in out.stderr


# ---------------------------------------------------------------- the script
def test_end_to_end_shapesbench(tmp_path):
    run_script(TINY_RUN + ["--exp-name", "e2e", "--save-every", "1", "--kl-beta", "1"], tmp_path)  # KL path too
    run = find_run(tmp_path / "e2e")
    rows = metrics(run)
    train = [r for r in rows if "losses/policy" in r]
    assert [r["iteration"] for r in train] == [1, 2]
    assert all(r["losses/first_ratio_max_dev"] == 0 for r in train)  # log ratio exactly 0 at the first update
    assert any(r["losses/ratio_max_dev"] > 0 for r in train)  # and the second optimizer step sees a moved policy
    # 4 rollout steps + 3 pairs x (behaviour, base for the KL, policy)
    assert all(r["perf/nfe_per_image"] == 4 + 3 * 3 for r in train)
    assert 0 < train[0]["charts/lr"] < train[1]["charts/lr"] <= 3e-4  # the default linear warmup
    assert all(r["losses/kl"] > 0 for r in train)  # KL to the base (the second optimizer step has moved away)
    assert all(r["charts/rank_pairs_spread"] == 0 and math.isfinite(r["surrogate/cv"]) for r in train)
    assert train[0]["charts/pairs_checksum"] != train[1]["charts/pairs_checksum"]  # fresh pairs every iteration
    evals = [r for r in rows if "eval/shape_acc" in r]
    assert [r["iteration"] for r in evals] == [0, 2]
    assert_final_loads(run)  # the default trains a LoRA adapter, which diffusers' loader reads
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000001", "iter_000002"]
    assert (run / "samples" / "samples_000002.png").is_file()


def test_killed_runs_resume_to_the_same_weights(tmp_path):
    # with the soft clip on and the KL to the behaviour policy, so its stored x0_hat path is covered too (the
    # default KL, to the base, is covered by the tests that run the defaults); and with --ema, whose EMA is carried
    # by the checkpoints: final/ holds the EMA weights, so a resume that lost the EMA or its step count would differ
    small = {"--samples-per-device": "4", "--train-batch-size": "4"}  # one group, one micro-batch per update
    common = replace_flags(TINY_RUN, small) + [
        *("--eval-every", "0", "--sample-every", "0", "--kl-beta", "0.1", "--kl-ref", "behaviour"),
        *("--adv-soft-clip", "3", "--ema", "--ema-max-decay", "0.5"),
    ]
    assert_survives_kills("vgrpo.py", common, tmp_path)
    rows = [r for r in metrics(tmp_path / "straight") if "losses/kl" in r]
    assert len(rows) == 6 and rows[0]["losses/kl"] >= 0


@pytest.mark.parametrize("lora", [False, True])
def test_kl_to_the_base_starts_at_zero_and_grows_while_the_behaviour_kl_stays_zero(tmp_path, lora):
    # one optimizer step per iteration: every micro-batch is trained by the policy that sampled it
    one_update = [*TINY_RUN, "--samples-per-update", "8", "--eval-every", "0", "--sample-every", "0", "--kl-beta", "1"]
    for ref in ("behaviour", "base"):
        run_script([*one_update, "--exp-name", ref, "--kl-ref", ref, *([] if lora else ["--no-lora"])], tmp_path)
    rows = {ref: [r for r in metrics(tmp_path / ref) if "losses/kl" in r] for ref in ("behaviour", "base")}
    assert [r["losses/kl"] for r in rows["behaviour"]] == [0.0, 0.0]
    assert rows["base"][0]["losses/kl"] == 0.0 and rows["base"][1]["losses/kl"] > 0  # drift from the base is seen
    assert rows["base"][0]["perf/nfe_per_image"] == 4 + 3 * 3  # + one no-grad pass of the base per pair


def test_two_processes_keep_identical_weights_and_pairs(tmp_path):
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2")
    # groups of 4 over 2 processes x 2 samples: every group spans both processes
    ddp = ["--samples-per-device", "2", "--rollout-batch-size", "2", "--samples-per-update", "2"]
    run_script(
        TINY_RUN + ddp + ["--exp-name", "ddp", "--eval-every", "0"], tmp_path, launcher, {"ACCELERATE_USE_CPU": "1"}
    )
    train = [r for r in metrics(tmp_path / "ddp") if "losses/policy" in r]
    assert len(train) == 2 and all(r["charts/rank_pairs_spread"] == 0 for r in train)  # same (t, eps) on both ranks
    assert all(r["losses/first_ratio_max_dev"] == 0 for r in train)
    last = [r for r in train if "charts/rank_weight_spread" in r][-1]
    assert last["iteration"] == 2 and last["charts/rank_weight_spread"] == 0
    # a LoRA checkpoint (the adapter alone) read back under DDP; then SIGTERM to rank 1 alone, in iteration 4: both
    # processes stop after the same iteration (else one would wait forever), with a checkpoint, and rank 0 says so
    resume = ["--exp-name", "ddp", "--iterations", "8", "--resume-from", "latest", "--eval-every", "0"]
    name, env = tmp_path / "ddp", {"ACCELERATE_USE_CPU": "1"}
    to_rank_1 = lambda p: logged(name, 3) and worker_pid(p.pid, rank=1)  # noqa: E731
    status, out = run_until("vgrpo.py", TINY_RUN + ddp + resume, tmp_path, to_rank_1, signal.SIGTERM, launcher, env)
    assert status != 0 and "SIGTERM: stopped after iteration" in out, out[-3000:]
    stopped = int(out.split("SIGTERM: stopped after iteration ")[1].split(",")[0])
    assert stopped in (3, 4) and (find_run(name) / "checkpoints" / f"iter_{stopped:06d}").is_dir()
    assert [r["iteration"] for r in metrics(name) if "losses/policy" in r][-1] == stopped


def test_end_to_end_tiny_flux_with_tiny_hps(tmp_path, monkeypatch):
    """In-process (open_clip's tiny-hps config is registered in this process only), the real main(), here with
    every variance-reduction technique off, v-prediction and the Euler solver (the naive ELBO baseline)."""

    ckpt = build_tiny_hps(tmp_path)
    from tests.tiny import use_tiny_hps

    use_tiny_hps(monkeypatch)
    build_flux(tmp_path / "flux")
    (tmp_path / "prompts.txt").write_text("a cat\na dog\n")
    argv = TINY_RUN + [
        "--output-dir",
        str(tmp_path),
        "--exp-name",
        "flux",
        "--model-id",
        str(tmp_path / "flux"),
        "--resolution",
        "32",
        "--prompts",
        str(tmp_path / "prompts.txt"),
        "--eval-prompts",
        str(tmp_path / "prompts.txt"),
        "--reward",
        "hpsv2.1",
        "--reward-ckpt",
        f"hpsv2.1={ckpt}",
        "--lora",
        "--lora-rank",
        "4",
        "--guidance-scale",
        "3.5",
        "--solver",
        "euler",
        "--no-stratified",
        "--no-shared-pairs",
        "--no-self-normalize",
        "--prediction",
        "v",
        *("--gradient-checkpointing", "--offload-frozen"),  # as the GPU recipes (bf16: gpu_check.sh --tiny)
    ]
    V.main(tyro.cli(V.Args, args=argv))
    train = [r for r in metrics(tmp_path / "flux") if "losses/policy" in r]
    assert len(train) == 2 and all(r["losses/first_ratio_max_dev"] == 0 for r in train)
    assert_final_loads(find_run(tmp_path / "flux"), str(tmp_path / "flux"))


def test_run_sh_verifier_recipe_trains_on_the_verifier(tmp_path):
    """`bash run.sh vgrpo-verifier-cpu` (V-GRPO rewarded by the programmatic verifier) runs and scores with the verifier."""
    run_recipe("vgrpo-verifier-cpu", [*TINY_RUN, "--eval-every", "0", "--sample-every", "0"], tmp_path)
    train = [r for r in metrics(tmp_path / "vgrpo-verifier") if "losses/policy" in r]
    assert len(train) == 2
    # the verifier's score is the mean of four 0/1 verdicts, so every batch mean is a multiple of 1/(4 x 8 images)
    assert all(
        0 <= r["rewards/verifier"] <= 1 and abs(r["rewards/verifier"] * 32 - round(r["rewards/verifier"] * 32)) < 1e-4
        for r in train
    )


def test_run_sh_nokl_recipe_trains_every_weight_without_kl(tmp_path):
    """`bash run.sh vgrpo-nokl-cpu` (the KL-free over-optimisation recipe of docs/experiments.md) fine-tunes all weights with no KL term."""
    run_recipe("vgrpo-nokl-cpu", [*TINY_RUN, "--eval-every", "0", "--sample-every", "0"], tmp_path)
    train = [r for r in metrics(tmp_path / "vgrpo-nokl") if "losses/policy" in r]
    assert len(train) == 2 and all("losses/kl" not in r and r["perf/nfe_per_image"] == 4 + 2 * 3 for r in train)
    assert (
        find_run(tmp_path / "vgrpo-nokl") / "final" / "transformer" / "diffusion_pytorch_model.safetensors"
    ).is_file()
