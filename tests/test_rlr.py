"""rlr.py: the estimator is unbiased on a linear-Gaussian chain (closed-form gradient), its variance falls with h,
the DDIM / flow transitions, the h* rule, baselines, parameter perturbations, and the real script end to end."""

import itertools
import math
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import tyro
from safetensors.torch import load_file

import rlr as R
from common import InputError
from common.models import load_model
from tests.helpers import SHIPPED, WEIGHTS, assert_final_loads, assert_survives_kills, find_run, metrics
from tests.helpers import run_script as run
from tests.tiny import build_sd1, build_shapes, build_tiny_hps

TINY_RUN = [
    "--iterations",
    "2",
    "--samples-per-device",
    "4",
    "--group-size",
    "2",
    "--rollout-batch-size",
    "2",
    "--num-steps",
    "4",
    "--eval-every",
    "2",
    "--eval-samples-per-prompt",
    "1",
    "--eval-steps",
    "4",
    "--sample-every",
    "2",
    *("--terms", "fo+ho+zo", "--subchain-stage", "any", "--learning-rate", "3e-4"),  # the full estimator
]


def run_script(args, tmp_path, *rest, **kw):
    return run("rlr.py", args, tmp_path, *rest, **kw)


# ---------------------------------------------------------------- the estimator on an analytic chain
# x_{i+1} = a_i(theta) x_i + b_i(theta) + s_i z_i in R^2, a_i = alpha_i + beta_i . theta (scalar), b_i = gamma_i +
# delta_i theta, s_4 = 0 (the deterministic FO step), x_0 ~ N(m0, v0 I), reward R(x) = -|x - y|^2 / 2.
T, D = 5, 2
ALPHA = torch.tensor([0.9, 0.8, 0.85, 0.7, 0.9], dtype=torch.float64)
BETA = torch.tensor([[0.2, -0.1], [0.1, 0.3], [-0.2, 0.1], [0.15, 0.2], [0.1, -0.2]], dtype=torch.float64)
GAMMA = torch.tensor([[0.1, -0.2], [0.0, 0.3], [0.2, 0.1], [-0.1, 0.0], [0.3, -0.1]], dtype=torch.float64)
DELTA = torch.tensor(
    [
        [[0.5, 0.1], [0.0, 0.4]],
        [[0.3, -0.2], [0.1, 0.2]],
        [[0.2, 0.0], [-0.3, 0.5]],
        [[0.4, 0.2], [0.1, -0.1]],
        [[0.6, -0.3], [0.2, 0.3]],
    ],
    dtype=torch.float64,
)
STD = torch.tensor([0.6, 0.5, 0.4, 0.3, 0.0], dtype=torch.float64)
M0, V0, Y = torch.tensor([0.5, -0.5], dtype=torch.float64), 1.0, torch.tensor([1.0, 2.0], dtype=torch.float64)
THETA = torch.tensor([0.3, -0.2], dtype=torch.float64)
ZO_SCALE = 0.3
N_CHAINS = 40_000
GROUP = 4  # samples per prompt: each baseline is the mean of the other 3


def step_params(theta, i):
    """theta (..., D) -> a (...), b (..., 2) of step i."""
    return ALPHA[i] + theta @ BETA[i], GAMMA[i] + theta @ DELTA[i].T


def chain(theta_rep):
    """The chain as rlr.py sees any sampler: mean_std(i, x) -> (mean, std), one parameter row per chain."""

    def mean_std(i, x):
        a, b = step_params(theta_rep, i)
        return a[:, None] * x + b, STD[i]

    return mean_std


def exact_gradient(j, h):
    """Closed form of grad E[R] for the chain RLR samples at window start j: steps outside the window and before the
    last are run with theta + zeta_i, zeta_i ~ N(0, ZO_SCALE^2 I). The mean m and the isotropic variance v of x_T follow
    m' = a m + b, v' = a^2 v + s^2, E[R] = -(|m - y|^2 + D v) / 2; E[R] has degree <= 2 in each coordinate of each
    zeta_i, so the 2-point Gauss-Hermite rule (nodes +-ZO_SCALE) integrates it exactly. Differentiated by autograd."""
    zo = R.zo_steps_of(T, j, h)
    theta = THETA.clone().requires_grad_()
    nodes = torch.tensor(list(itertools.product([-ZO_SCALE, ZO_SCALE], repeat=D * len(zo))), dtype=torch.float64)
    nodes = nodes.view(-1, len(zo), D)
    m, v = M0.expand(len(nodes), D), torch.full((len(nodes),), V0, dtype=torch.float64)
    for i in range(T):
        a, b = step_params(theta + nodes[:, zo.index(i)] if i in zo else theta.expand(len(nodes), D), i)
        m, v = a[:, None] * m + b, a**2 * v + STD[i] ** 2
    return torch.autograd.grad((-0.5 * (((m - Y) ** 2).sum(-1) + D * v)).mean(), theta)[0]


def rlr_estimates(j, h, n, seed, terms=("fo", "ho", "zo")):
    """One RLR estimate of grad E[R] per chain (n, D), built from rlr.py's own functions exactly as main() uses them,
    term_weights combining the terms. Vectorised: each chain has its own parameter row, hence its own perturbation
    block (block = chain); the chains form prompt groups of GROUP, as in a run."""
    theta_rep = THETA.repeat(n, 1).requires_grad_()
    gen = torch.Generator().manual_seed(seed)
    x0 = M0 + math.sqrt(V0) * torch.randn(n, D, generator=gen, dtype=torch.float64)
    noise = torch.randn(n, T - 1, D, generator=gen, dtype=torch.float64)
    zo = R.zo_steps_of(T, j, h)
    zetas = {i: R.zo_noise([theta_rep], R.key_seed(seed, "zo", i), ZO_SCALE) for i in zo}
    mean_std = chain(theta_rep)
    latents = R.rollout(mean_std, x0, noise, zo, lambda i: R.perturbed([theta_rep], zetas[i]))
    x_last, _ = mean_std(T - 1, latents[:, -1])  # FO: the last step with a graph
    r = -0.5 * ((x_last - Y) ** 2).sum(-1)
    log_prob, deviation = R.subchain_log_prob(mean_std, latents, noise, j, h)
    assert deviation == 0
    mask = torch.zeros(n, T, dtype=torch.bool)
    mask[:, zo] = True
    w_ho, _, coef, _ = R.term_weights(
        r.detach(), torch.arange(n), mask, n, group_size=GROUP
    )  # coef (n chains = blocks, T), / n
    loss = -r.sum() if "fo" in terms else torch.zeros(())
    if "ho" in terms:
        loss = loss - (w_ho * log_prob).sum()
    loss.backward()
    if "zo" in terms:
        for i in zo:
            R.add_zo_grad([theta_rep], zetas[i], n * coef[:, i : i + 1], ZO_SCALE)
    return -theta_rep.grad  # .grad holds the minimisation direction


@pytest.mark.parametrize("h", [1, 2, 3])
def test_estimator_is_unbiased_on_a_linear_gaussian_chain(h):
    """For every window start j the mean of 40k estimates matches the closed-form gradient within 4 standard errors
    per coordinate (a false alarm has probability ~1e-4 per comparison; the seeds are fixed). Without the ZO term
    (the paper's ablation V2) the same test sees the bias, so it has the power to catch a wrong estimator."""
    biased = []
    for j in R.window_starts(T, h):
        exact = exact_gradient(j, h)
        est = rlr_estimates(j, h, N_CHAINS, seed=10 * h + j)
        se = est.std(0) / math.sqrt(N_CHAINS)
        z = (est.mean(0) - exact) / se
        assert z.abs().max() < 4, (h, j, exact, est.mean(0), z)
        no_zo = rlr_estimates(j, h, N_CHAINS, seed=10 * h + j, terms=("fo", "ho"))
        biased.append(((no_zo.mean(0) - exact) / se).abs().max())
    assert max(biased) > 6, biased


def test_variance_falls_as_h_grows():
    """Total variance (trace of the covariance) of one estimate, j drawn uniformly: each step moved from ZO to the
    back-propagated sub-chain lowers it (the paper's memory-variance trade-off)."""
    variances = []
    for h in (1, 2, 3):
        est = torch.cat([rlr_estimates(j, h, N_CHAINS // 4, seed=100 + 10 * h + j) for j in R.window_starts(T, h)])
        variances.append(est.var(0).sum().item())
    assert variances[0] > 1.2 * variances[1] > 1.2**2 * variances[2], variances


# ---------------------------------------------------------------- samplers, schedules, rules, helpers
def test_ddim_step_matches_diffusers():
    from diffusers import DDIMScheduler

    sched = DDIMScheduler(beta_schedule="scaled_linear", clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    sched.set_timesteps(10)
    fake = SimpleNamespace(kind="sd1", alphas_cumprod=sched.alphas_cumprod, pipe=SimpleNamespace(scheduler=sched))
    ours = R.make_schedule(fake, 10, 0.8)
    assert ours["t"].tolist() == sched.timesteps.tolist()
    assert ours["eta"][-1] == 0 and ours["a_prev"][-1] == 1  # deterministic last step onto x0_hat
    g = torch.Generator().manual_seed(0)
    x, eps, z = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
    for i in range(9):  # the last step differs on purpose (alpha_prev = 1, not alphabar_0)
        mean, std = R.ddim_step(x, eps, ours["a"][i], ours["a_prev"][i], ours["eta"][i])
        ref = sched.step(eps, int(ours["t"][i]), x, eta=0.8, variance_noise=z).prev_sample
        torch.testing.assert_close(mean + std * z, ref, rtol=1e-5, atol=1e-5)


def test_flow_transition_and_exact_recompute(tmp_path):
    """The flow transition is dancegrpo's SDE step (Euler at the last step), and the HO window recomputed with a
    graph reproduces the rollout bit for bit, so the likelihood ratio is evaluated on-policy."""
    build_shapes(tmp_path)
    model = load_model(str(tmp_path))
    sched = R.make_schedule(model, 5, 0.7)
    cond = model.encode_prompts(["a red circle on a blue background", "a green square on a white background"])
    gen = torch.Generator().manual_seed(0)
    L = model.latent_shape()  # (4, 8, 8)
    x, noise = torch.randn(2, *L, generator=gen), torch.randn(2, 4, *L, generator=gen)

    def mean_std(i, x):
        return R.transition(model, model.transformer, sched, i, x, cond, 1.0, nullcontext)

    with torch.no_grad():
        v = model.velocity(model.transformer, x, torch.ones(2), cond)
        _, _, mean_ref, std_ref = R.sde_step(
            x, v, sched["sigmas"][0], sched["sigmas"][1], sched["g"][0], noise=noise[:, 0]
        )
        mean, std = mean_std(0, x)
        torch.testing.assert_close(mean, mean_ref)
        torch.testing.assert_close(std, std_ref)
        last, std_last = mean_std(4, x)
        assert std_last == 0 and torch.equal(
            last, x - sched["sigmas"][4] * model.velocity(model.transformer, x, sched["sigmas"][4].expand(2), cond)
        )
    latents = R.rollout(mean_std, x, noise)
    assert latents.shape == (2, 5, *L)
    for j, h in [(0, 1), (1, 2), (0, 4)]:
        log_prob, deviation = R.subchain_log_prob(mean_std, latents, noise, j, h)
        assert deviation == 0 and log_prob.requires_grad and log_prob.shape == (2,)


def test_h_star_matches_the_papers_worked_values():
    # SD1.4, T = 50, B_h = 8 GB, B_z = 0.24 GB (RLR paper, arXiv 2502.00639, eq. 8, Table 9): 24 GB -> 1, 30 -> 2, 35 -> 2, 35.04 -> 3
    assert [R.optimal_subchain_len(b, 50, 8.0, 0.24) for b in (24, 30, 35, 35.04)] == [1, 2, 2, 3]
    assert R.optimal_subchain_len(1000, 50, 8.0, 0.24) == 24  # the variance term: floor(T / 2 - 1)
    assert R.optimal_subchain_len(1000, 50, 8.0, 0.24, variance_ratio=0.5) == 49  # capped at T - 1
    assert R.optimal_subchain_len(10, 50, 8.0, 0.24) < 1  # refused by validate


def test_windows_and_zo_steps_partition_the_steps():
    for h in range(1, 9):
        for j in R.window_starts(10, h):
            window, zo = set(range(j, j + h)), set(R.zo_steps_of(10, j, h))
            assert not window & zo and window | zo | {9} == set(range(10)) and 9 not in window
    assert R.window_starts(10, 2) == list(range(8))
    assert R.window_starts(10, 2, "coarse") == [0, 1, 2, 3] and R.window_starts(10, 2, "fine") == [7]
    assert [R.stage_of(i, 10) for i in range(10)] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_baselines_by_hand():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 9.0])
    torch.testing.assert_close(
        R.loo_baseline(r, 4), torch.tensor([11 / 3, 10 / 3, 3.0, 2.0, 19 / 3, 19 / 3, 19 / 3, 5.0])
    )
    # blocks of 2: the baseline of a sample is the mean of its group outside its own block
    block = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    torch.testing.assert_close(R.zo_baseline(r, 4, block), torch.tensor([4.5, 4.5, 1.5, 1.5, 7.0, 7.0, 5.0, 5.0]))
    # a group inside one block falls back to all other blocks, and never reads its own block
    torch.testing.assert_close(
        R.zo_baseline(r, 4, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])), torch.tensor([6.0] * 4 + [3.0] * 4)
    )
    assert torch.all(R.zo_baseline(r, 4, torch.zeros(8, dtype=torch.long)) == 0)
    # term_weights: R - b, R - b', and the ZO coefficients: per block and step, the sum of (R - b') / N over the
    # block's samples whose step was a ZO step
    w_ho, w_zo, coef, _ = R.term_weights(
        r, block, torch.tensor([[True, False]] * 4 + [[False, True]] * 4), 4, group_size=4
    )
    torch.testing.assert_close(w_ho, r - R.loo_baseline(r, 4))
    torch.testing.assert_close(w_zo, r - torch.tensor([4.5, 4.5, 1.5, 1.5, 7.0, 7.0, 5.0, 5.0]))
    torch.testing.assert_close(coef * 8, torch.tensor([[-6.0, 0], [6.0, 0], [0, -4.0], [0, 4.0]]))


def test_parameter_perturbation_restores_exactly_and_regenerates():
    params = [torch.randn(3, 4, requires_grad=True), torch.randn(5, requires_grad=True)]
    before = [p.detach().clone() for p in params]
    zeta = R.zo_noise(params, 123, 1e-3)
    with R.perturbed(params, zeta):
        assert all(torch.equal(p, b + z) for p, b, z in zip(params, before, zeta))
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # a copy back, not a subtraction
    again = R.zo_noise(params, 123, 1e-3)
    assert all(torch.equal(a, b) for a, b in zip(zeta, again))
    R.add_zo_grad(params, zeta, torch.tensor(0.5), 1e-3)
    torch.testing.assert_close(params[0].grad, -0.5 * zeta[0] / 1e-6)


def test_validation_names_the_flag(tmp_path):
    def args(**kw):
        return R.Args(**{"subchain_len": 2, "zo_perturbations": 4, "terms": "fo+ho+zo", **kw})

    R.resolve_and_check(args())
    for kw, flag in [
        ({"reward": "verifier"}, "--reward"),
        ({"reward": "shapes:1,jpeg:0.5"}, "--reward"),
        ({"reward": "hpsv2.1", "reward_url": ["hpsv2.1=http://127.0.0.1:9"]}, "hpsv2.1 is not differentiable.*served"),
        ({"reward": "unifiedreward", "reward_url": ["unifiedreward=http://127.0.0.1:9/v1"]}, "unifiedreward is not"),
        ({"subchain_len": 10}, "--subchain-len"),
        ({"subchain_len": 3, "subchain_stage": "fine"}, "--subchain-stage"),
        ({"zo_perturbations": 3}, "--zo-perturbations"),
        ({"dcot_prompts": str(tmp_path / "nope.tsv")}, "--dcot-prompts"),
    ]:
        with pytest.raises(InputError, match=flag):
            R.resolve_and_check(args(**kw))
    R.resolve_and_check(args(reward="shapes:1,verifier:0"))  # weight 0: logged only, no gradient needed
    (tmp_path / "bad.tsv").write_text("a red circle on a blue background\tonly two\n")
    with pytest.raises(InputError, match="4 TAB-separated"):
        R.resolve_and_check(args(dcot_prompts=str(tmp_path / "bad.tsv")))
    out = run_script(["--group-size", "3"], tmp_path / "g", check=False)  # main()'s check of the process count
    assert out.returncode == 2 and "--group-size 3" in out.stderr


def test_non_differentiable_reward_is_refused_at_start_up(tmp_path):
    out = run_script(["--reward", "verifier"], tmp_path, check=False)
    assert out.returncode == 2 and "--reward verifier: verifier is not differentiable" in out.stderr
    assert "Traceback" not in out.stderr and "Loading" not in out.stderr  # refused before any model loads
    assert not list(tmp_path.iterdir())  # and no empty run folder left behind
    out = run_script(["--memory-budget-gb", "1", "--num-steps", "50"], tmp_path, check=False)
    assert out.returncode == 2 and "--memory-budget-gb" in out.stderr


# ---------------------------------------------------------------- the real script
def test_end_to_end_shapesbench_with_dcot(tmp_path):
    (tmp_path / "dcot.tsv").write_text(
        "# prompt, coarse, medium, fine\n"
        + "".join(
            f"a {c} circle on a blue background\ta {c} square on a blue background\ta {c} circle on a blue background"
            f"\ta {c} circle on a white background\n"
            for c in ("red", "green", "yellow")
        )
    )
    run_script(
        TINY_RUN
        + [
            "--exp-name",
            "e2e",
            "--save-every",
            "1",
            "--dcot-prompts",
            str(tmp_path / "dcot.tsv"),
            "--subchain-stage",
            "coarse",
        ],
        tmp_path,
    )
    run = find_run(tmp_path / "e2e")
    rows = metrics(run)
    train = [r for r in rows if "grad/fo_norm" in r]
    assert [r["iteration"] for r in train] == [1, 2]
    for r in train:
        assert r["rlr/recompute_max_dev"] == 0  # the HO window is evaluated on-policy
        assert r["rlr/subchain_len"] == 2 and r["perf/nfe_per_image"] == 4 + 2
        assert r["rlr/zo_steps"] == 1 and r["rlr/window_start"] in (0, 0.5, 1)  # coarse third of 4 steps: j in {0, 1}
        assert r["grad/zo_norm"] > 0 and math.isfinite(r["charts/grad_norm"]) and r["charts/skipped_updates"] == 0
    evals = [r for r in rows if "eval/shape_acc" in r]
    assert [r["iteration"] for r in evals] == [0, 2]
    assert_final_loads(run)  # the default trains a LoRA adapter, which diffusers' loader reads
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000001", "iter_000002"]
    assert (run / "samples" / "samples_000002.png").is_file()


def test_killed_runs_resume_to_the_same_weights(tmp_path):
    common = TINY_RUN + [
        "--eval-every",
        "0",
        "--sample-every",
        "0",
        "--memory-budget-gb",
        "1.2",
        "--ho-step-gb",
        "0.5",
        "--zo-step-gb",
        "0.1",
        "--variance-ratio",
        "0.5",
    ]
    # h* = min(floor((1.2 - 0.1 x 3) / (0.5 - 0.1)), floor(4 / (2 x 0.5) - 1)) = min(2, 3) = 2
    assert_survives_kills("rlr.py", common, tmp_path)
    assert all(r["rlr/subchain_len"] == 2 for r in metrics(tmp_path / "straight"))


def test_two_processes_keep_identical_weights(tmp_path):
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2")
    # groups of 2 over 2 processes x 2 samples, one chunk and one perturbation block per process
    run_script(
        TINY_RUN + ["--exp-name", "ddp", "--samples-per-device", "2", "--eval-every", "0", "--no-lora"],  # all weights
        tmp_path,
        launcher,
        {"ACCELERATE_USE_CPU": "1"},
    )
    last = [r for r in metrics(tmp_path / "ddp") if "charts/rank_weight_spread" in r][-1]
    assert last["iteration"] == 2 and last["charts/rank_weight_spread"] == 0 and last["grad/zo_norm"] > 0
    # and independent of the number of processes: one process with both processes' samples draws the same prompts,
    # noises, windows and perturbations (keyed on global indices) and ends with the same weights, to rounding (the
    # sums run in another order)
    run_script(
        TINY_RUN + ["--exp-name", "one", "--samples-per-device", "4", "--eval-every", "0", "--no-lora"], tmp_path
    )
    a, b = (load_file(find_run(tmp_path / n) / "final" / WEIGHTS) for n in ("ddp", "one"))
    base = load_file(SHIPPED / WEIGHTS)
    assert max((a[k] - base[k]).abs().max() for k in a) > 1e-5  # both trained (warmup: small steps), 10x atol
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("terms", ["fo+ho+zo", "fo"])
def test_end_to_end_tiny_sd1_with_tiny_hps(tmp_path, monkeypatch, terms):
    """DDIM with eta > 0 on a tiny random SD1.x pipeline, LoRA, the tiny HPS reward; in-process (open_clip's
    tiny-hps config is registered in this process only), the real main(). Also the ablation V1 (--terms fo)."""

    ckpt = build_tiny_hps(tmp_path)
    from tests.tiny import use_tiny_hps

    use_tiny_hps(monkeypatch)
    build_sd1(tmp_path / "sd1")
    (tmp_path / "prompts.txt").write_text("a cat\na dog\n")
    base = list(TINY_RUN)
    if "ho" not in terms:  # --subchain-stage and --subchain-len apply to the HO term only
        k = base.index("--subchain-stage")
        del base[k : k + 2]
    argv = base + [
        "--output-dir",
        str(tmp_path),
        "--exp-name",
        "sd1",
        "--model-id",
        str(tmp_path / "sd1"),
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
        "3",
        *(["--subchain-len", "1"] if "ho" in terms else []),  # a window only where the HO term uses one
        "--terms",
        terms,
        *("--gradient-checkpointing", "--offload-frozen"),  # as the GPU recipes (bf16: gpu_check.sh --tiny)
    ]
    R.main(tyro.cli(R.Args, args=argv))
    train = [r for r in metrics(tmp_path / "sd1") if "grad/fo_norm" in r]
    assert len(train) == 2 and all(r["rlr/recompute_max_dev"] == 0 and r["grad/fo_norm"] > 0 for r in train)
    if terms == "fo":  # one-step truncated backprop: no window, no perturbation
        assert all(r["rlr/zo_steps"] == 0 and r["grad/zo_norm"] == 0 and r["perf/nfe_per_image"] == 4 for r in train)
        assert all(r["grad/fo_ho_norm"] == r["grad/fo_norm"] for r in train)
    else:  # 4 steps: 1 in the window, 1 FO, 2 ZO
        assert all(r["rlr/zo_steps"] == 2 and r["grad/zo_norm"] > 0 and r["perf/nfe_per_image"] == 5 for r in train)
    assert_final_loads(find_run(tmp_path / "sd1"), str(tmp_path / "sd1"))
