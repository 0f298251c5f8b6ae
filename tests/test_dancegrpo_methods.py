"""dancegrpo.py's 2026 methods against their official formulas, each worked out here by hand at non-neutral values:
the CPS step (arXiv 2509.05952), GRPO-Guard's normalised ratio and reweighting (arXiv 2510.22319), Flow-DPPO's KL
mask (arXiv 2606.11025) and MixGRPO-Flash's post-window grid and solver (arXiv 2507.21802); their properties; the
combinations the official code refuses; and each mode end to end with a first ratio of exactly 1."""

import math
import sys
from contextlib import nullcontext

import pytest
import torch

import dancegrpo as D
from common import InputError
from tests.helpers import metrics
from tests.helpers import run_script as run

FLAGS = {"clip_range": 0.2, "kl_mask_threshold": 0.05, "kl_beta": 0.0}


def test_cps_step_by_hand():
    g = torch.Generator().manual_seed(1)
    x, v, noise = (torch.randn(3, 2, 4, generator=g) for _ in range(3))
    sigma, sigma_next, eta = 0.6, 0.45, 0.8
    x_next, log_prob, mean, std = D.cps_step(x, v, sigma, sigma_next, eta, noise=noise)
    s = 0.45 * math.sin(0.8 * math.pi / 2)  # 0.4280
    expected_mean = 0.55 * (x - 0.6 * v) + math.sqrt(0.45**2 - s**2) * (x + 0.4 * v)
    torch.testing.assert_close(mean, expected_mean)
    torch.testing.assert_close(std.flatten(), torch.tensor([s]))  # one step for the batch
    torch.testing.assert_close(x_next, expected_mean + s * noise)
    # the official log-prob: -mean over dimensions of the squared distance, no constant, no 1 / (2 std^2)
    torch.testing.assert_close(log_prob, -(s * noise).square().flatten(1).mean(1))
    other = torch.randn(3, 2, 4, generator=g)
    _, lp_other, _, _ = D.cps_step(x, v, sigma, sigma_next, eta, prev_sample=other)
    torch.testing.assert_close(lp_other, -(other - expected_mean).square().flatten(1).mean(1))


def test_cps_preserves_the_forward_process_coefficients():
    """With the exact velocity v = eps - x0 at x = (1 - s) x0 + s eps, the next latent is (1 - s') x0 plus noise of
    variance s'^2, for any eta: the coefficients of the forward process at s'."""
    g = torch.Generator().manual_seed(2)
    n = 200_000
    x0, eps, xi = (torch.randn(n, 1, generator=g, dtype=torch.float64) for _ in range(3))
    sigma, sigma_next = 0.7, 0.4
    x = (1 - sigma) * x0 + sigma * eps
    for eta in (0.3, 0.8):
        x_next, _, mean, std = D.cps_step(x, eps - x0, sigma, sigma_next, eta, noise=xi)
        resid = x_next - (1 - sigma_next) * x0
        assert abs(resid.mean().item()) < 5e-3
        assert resid.var().item() == pytest.approx(sigma_next**2, rel=2e-2)
        torch.testing.assert_close(mean - (1 - sigma_next) * x0, math.sqrt(0.4**2 - std[0].item() ** 2) * eps)


def test_grpo_guard_by_hand():
    log_prob = torch.tensor([0.02, -0.03, 0.01])
    old_log_prob = torch.tensor([0.0, 0.0, 0.05])
    adv = torch.tensor([1.5, -0.5, 2.0])
    mean = torch.tensor([[0.1, 0.3], [0.0, -0.2], [0.4, 0.4]])
    old_mean = torch.tensor([[0.0, 0.1], [0.1, -0.2], [0.4, 0.1]])
    std, dt = torch.tensor([0.5, 0.5, 0.5]), 0.08
    loss, fig = D.policy_loss(log_prob, old_log_prob, adv, mean, old_mean, None, std, dt, objective="guard", **FLAGS)
    b = torch.tensor([(0.01 + 0.04) / 2, (0.01 + 0) / 2, (0 + 0.09) / 2]) / (2 * 0.25)  # mean_D d^2 / (2 s^2)
    rho = torch.exp(0.5 * (log_prob - old_log_prob + b))
    expected = torch.maximum(-adv * rho, -adv * rho.clamp(0.8, 1.2)) / 0.08
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(fig["ratio_mean"], rho)
    torch.testing.assert_close(fig["kl_old"], b.mean())
    # the same numbers under --objective clip: the plain ratio, no reweighting
    plain, _ = D.policy_loss(log_prob, old_log_prob, adv, mean, old_mean, None, std, dt, objective="clip", **FLAGS)
    r = torch.exp(log_prob - old_log_prob)
    torch.testing.assert_close(plain, torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2)))


def test_grpo_guards_log_ratio_has_zero_mean_under_the_rollout_noise():
    """Over the noise of the rollout's step, the plain log-ratio of a moved policy averages -KL (< 0: the ratio-mean
    bias); GRPO-Guard's normalised one averages 0."""
    g = torch.Generator().manual_seed(3)
    n, L = 20_000, 16
    x = torch.randn(1, L, generator=g, dtype=torch.float64).expand(n, L)
    v_old = torch.randn(1, L, generator=g, dtype=torch.float64).expand(n, L)
    v_new = v_old + 0.3 * torch.randn(1, L, generator=g, dtype=torch.float64)
    sigmas = D.sigma_schedule(10, 3.0).double()
    gs = D.noise_g(sigmas, "flow", 0.7)
    noise = torch.randn(n, L, generator=g, dtype=torch.float64)
    x_next, old_lp, old_mean, std = D.sde_step(x, v_old, sigmas[3], sigmas[4], gs[3], noise=noise)
    _, new_lp, mean, _ = D.sde_step(x, v_new, sigmas[3], sigmas[4], gs[3], prev_sample=x_next)
    kl = (mean - old_mean).square().mean(1) / (2 * std.flatten() ** 2)
    assert (new_lp - old_lp).mean().item() == pytest.approx(-kl[0].item(), rel=0.05)
    normalised = std.flatten() * (new_lp - old_lp + kl)
    assert abs(normalised.mean().item()) < 4 * normalised.std().item() / math.sqrt(n)
    # and it is mean_D(noise * (mean - old_mean)), as derived
    torch.testing.assert_close(normalised, (noise * (mean - old_mean)).mean(1))


def test_flow_dppo_masks_only_high_kl_updates_that_move_away():
    # samples: (r > 1, A > 0, high KL) dropped; (r < 1, A > 0, high KL) corrective, kept; (r < 1, A < 0, high KL)
    # dropped; (r > 1, A > 0, low KL) kept; (r > 1, A < 0, high KL) corrective, kept
    log_prob = torch.log(torch.tensor([1.5, 0.5, 0.8, 1.2, 1.3]))
    old_log_prob = torch.zeros(5)
    adv = torch.tensor([2.0, 1.0, -1.0, 1.0, -3.0])
    old_mean = torch.zeros(5, 1)
    mean = torch.tensor([[0.5], [0.5], [0.5], [0.1], [0.5]])  # KL = d^2 / (2 std^2) with std 1: 0.125 or 0.005
    std = torch.ones(5)
    loss, fig = D.policy_loss(log_prob, old_log_prob, adv, mean, old_mean, None, std, 0.1, objective="dppo", **FLAGS)
    r = torch.tensor([1.5, 0.5, 0.8, 1.2, 1.3])
    expected = torch.tensor([0.0, -1.0 * 0.5, 0.0, -1.0 * 1.2, 3.0 * 1.3])
    torch.testing.assert_close(loss, expected)
    assert fig["masked"].item() == pytest.approx(2 / 5)
    torch.testing.assert_close(fig["ratio_mean"], r)
    # at a threshold above every KL nothing is dropped: -A r, unclipped
    free, _ = D.policy_loss(log_prob, old_log_prob, adv, mean, old_mean, None, std, 0.1, objective="dppo",
                            clip_range=0.2, kl_mask_threshold=1.0, kl_beta=0.0)  # fmt: skip
    torch.testing.assert_close(free, -adv * r)


def test_post_window_grid_and_nfe_of_mixgrpo_flash():
    """The official Flash* example: 25 steps, window 0-3, compress 0.2: 4 tail points (3 steps), 7 forwards."""
    sigmas = D.sigma_schedule(25, 3.0)
    grid = D.post_window_sigmas(sigmas, 3.0, 3, 0.2)
    assert len(grid) - 1 == 7
    assert torch.equal(grid[:5], sigmas[:5])  # up to sigma_4, where the window's last step lands: unchanged
    u = torch.tensor([21 / 25, 21 / 25 * 2 / 3, 21 / 25 / 3, 0.0], dtype=torch.float64)  # linspace(u_4, 0, 4)
    assert torch.equal(grid[4:], (3 * u / (1 + 2 * u)).float())  # computed in float64, then rounded once
    u = torch.linspace(0.9, 0.0, 5, dtype=torch.float64)  # T = 10, window 0-0, int(10 x 0.5) = 5 points
    # in float64 and rounded once: float32 throughout differs in the last bit at these points
    assert torch.equal(D.post_window_sigmas(D.sigma_schedule(10, 3.0), 3.0, 0, 0.5)[1:], (3 * u / (1 + 2 * u)).float())
    assert len(D.post_window_sigmas(sigmas, 3.0, 3, 0.4)) - 1 == 4 + int(22 * 0.4) - 1  # Flash: 11 forwards
    assert len(D.post_window_sigmas(D.sigma_schedule(4, 3.0), 3.0, 2, 0.1)) - 1 == 3 + 1  # at least one step
    assert len(D.post_window_sigmas(D.sigma_schedule(10, 3.0), 3.0, 2, 0.5)) - 1 == 3 + int(8 * 0.5) - 1  # T - last


def test_rollout_after_the_window_is_dpm_solver_2m():
    """A velocity field that is linear in x: the rollout's post-window steps equal DPM-Solver++(2M) done by hand,
    its history starting with the window's last x0_hat."""

    class Linear:
        def velocity(self, denoiser, x, sigma, cond, guidance_scale):
            return 0.5 * x + sigma.view(-1, 1) * 0.1

    sigmas = D.sigma_schedule(8, 3.0)
    grid = D.post_window_sigmas(sigmas, 3.0, 2, 0.5)  # window 0-2, then int(6 * 0.5) = 3 points: 2 DPM steps
    g = D.noise_g(sigmas, "flow", 0.7)
    gen = torch.Generator().manual_seed(0)
    x, noise = torch.randn(2, 3, generator=gen), torch.randn(2, 8, 3, generator=gen)
    latents, log_probs, means = D.rollout(
        Linear(), None, None, x, noise, grid, g, [0, 1, 2], 1.0, nullcontext, D.sde_step, dpm_after=2
    )
    assert latents.shape == (2, len(grid), 3) and torch.all(log_probs[:, 3:] == 0)
    xs, x0s = [x], []
    for i in range(len(grid) - 1):
        v = 0.5 * xs[-1] + grid[i] * 0.1
        x0s.append(xs[-1] - grid[i] * v)
        if i <= 2:
            xs.append(D.sde_step(xs[-1], v, grid[i], grid[i + 1], g[i], noise=noise[:, i])[0])
            continue
        s_prev, s, s_next = float(grid[i - 1]), float(grid[i]), float(grid[i + 1])
        if s_next == 0:  # the last step: first order
            xs.append(x0s[-1])
            continue
        lam = lambda t: math.log((1 - t) / t)  # noqa: E731
        r = (lam(s) - lam(s_prev)) / (lam(s_next) - lam(s))
        d = x0s[-1] + (x0s[-1] - x0s[-2]) / (2 * r)
        xs.append(s_next / s * xs[-1] + (1 - s_next / s) * d)
    torch.testing.assert_close(latents, torch.stack(xs, 1))
    torch.testing.assert_close(means[:, 3:], latents[:, 4:])
    # step dpm_after itself, when it is no SDE step, is an Euler step: DPM-Solver++(2M) starts after it
    latents, _, _ = D.rollout(
        Linear(), None, None, x, noise, grid, g, [0, 1], 1.0, nullcontext, D.sde_step, dpm_after=2
    )
    x2 = latents[:, 2]
    torch.testing.assert_close(latents[:, 3], x2 + (grid[3] - grid[2]) * (0.5 * x2 + grid[2] * 0.1))


def check(argv):
    return D.resolve_and_check(D.Args(**argv))


@pytest.mark.parametrize(
    "argv, message",
    [
        ({"sde_type": "cps", "objective": "guard"}, "--objective guard needs a Gaussian log-density: --sde-type cps"),
        ({"sde_type": "cps", "objective": "dppo"}, "--objective dppo needs a Gaussian log-density"),
        ({"ode_solver": "dpm2"}, "--ode-solver only applies with --sde-window"),
        ({"sde_window": 4, "post_window_compress": 0.2}, "--post-window-compress only applies with --ode-solver dpm2"),
        ({"kl_mask_threshold": 1e-3}, "--kl-mask-threshold only applies with --objective dppo"),
        ({"objective": "dppo", "clip_range": 1e-3}, "--clip-range only applies with --objective clip or guard"),
        ({"objective": "dppo", "adv_clip_max": 3.0}, "--adv-clip-max only applies with --objective clip or guard"),
        ({"sde_type": "cps", "noise_level": 1.0}, "--noise-level must be < 1 with --sde-type cps"),
        ({"sde_window": 4, "ode_solver": "dpm2", "post_window_compress": 0.0}, "--post-window-compress must be > 0 "),
        ({"sde_window": 4, "ode_solver": "dpm2", "shift": "pipeline"}, "--ode-solver dpm2 re-grids the steps after"),
    ],
)
def test_refused_combinations_name_the_flags(argv, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        check(argv)


def test_each_mode_gets_its_official_defaults():
    cases = [
        ({}, 0.7, 1e-3, 5.0, "dancegrpo"),
        ({"sde_type": "cps"}, 0.8, 1e-5, 5.0, "dancegrpo_cps"),
        ({"objective": "guard"}, 0.7, 2e-6, 5.0, "dancegrpo_guard"),
        ({"objective": "dppo"}, 0.7, math.inf, math.inf, "dancegrpo_dppo"),
        ({"sde_window": 4, "ode_solver": "dpm2"}, 0.7, 1e-3, 5.0, "dancegrpo_flash"),
    ]
    for argv, noise, clip, adv_max, name in cases:
        args = D.Args(**argv)
        check_args = D.resolve_and_check(args)
        assert check_args is not None
        assert (args.noise_level, args.clip_range, args.adv_clip_max, args.exp_name) == (noise, clip, adv_max, name)
    assert D.title(D.Args(sde_window=4, ode_solver="dpm2", objective="guard")) == "MixGRPO-Flash + GRPO-Guard"


QUICK = ["--iterations", "1", "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "2",
         "--samples-per-update", "4", "--num-steps", "6", "--eval-every", "0", "--sample-every", "0", "--no-save"]  # fmt: skip


@pytest.mark.parametrize(
    "mode",
    [
        ["--sde-type", "cps"],
        ["--objective", "guard"],
        ["--objective", "dppo", "--kl-mask-threshold", "1e-9"],
        ["--sde-window", "2", "--ode-solver", "dpm2", "--post-window-compress", "0.5"],
    ],
)
def test_each_mode_trains_from_a_first_ratio_of_exactly_one(mode, tmp_path):
    run("dancegrpo.py", [*QUICK, *mode, "--exp-name", "m"], tmp_path)
    (record,) = [r for r in metrics(tmp_path / "m") if "losses/first_ratio_max_dev" in r]
    assert record["losses/first_ratio_max_dev"] == 0 and math.isfinite(record["charts/grad_norm"])
    if "dpm2" in mode:  # window steps 0-1, then int((6 - 1) x 0.5) = 2 tail points: 1 DPM step; + 2 trained forwards
        assert record["perf/nfe_per_image"] == 3 + 2


MODES = {  # every mode once, combined where the official code allows (CPS's constant-free log-probs refuse the rest)
    # Flash re-grids its tail on a static shift (a real kind's default is its pipeline's grid)
    "cps_flash": "--sde-type cps --sde-window 2 --ode-solver dpm2 --post-window-compress 0.5 --shift 3".split(),
    "guard": ["--objective", "guard"],
    "dppo": ["--objective", "dppo", "--kl-mask-threshold", "1e-7"],
}


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES)
def test_each_mode_trains_on_two_processes_as_on_one_and_resumes_bitwise(mode, tmp_path, capsys):
    """Groups of 4 split over 2 processes x 2 images give 1 process x 4's weights (to the all-reduce's rounding) and
    identical weights on both. At 2 optimizer steps an iteration (the second off-policy, where the ratio, Guard's
    normalisation and DPPO's mask act), 1 iteration and a resume to 2 give the straight 2 iterations bitwise."""
    from safetensors.torch import load_file

    from tests.helpers import assert_same_trained_weights, find_run, run_in_process, run_script

    flags = [*QUICK[:-1], "--iterations", "2", "--learning-rate", "1e-2", *mode]  # saving on, 2 iterations
    run_in_process("dancegrpo.py", [*flags, "--exp-name", "one"], tmp_path)  # 4 images, 1 optimizer step
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2")
    two = ["--samples-per-device", "2", "--rollout-batch-size", "2", "--samples-per-update", "2", "--exp-name", "two"]
    run_script("dancegrpo.py", [*flags, *two], tmp_path, launcher, {"ACCELERATE_USE_CPU": "1"})
    last = [r for r in metrics(tmp_path / "two") if "charts/rank_weight_spread" in r][-1]
    assert last["iteration"] == 2 and last["charts/rank_weight_spread"] == 0
    a, b = (load_file(next((find_run(tmp_path / r) / "final").glob("*.safetensors"))) for r in ("one", "two"))
    assert a.keys() == b.keys() and any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    off = [*flags, "--samples-per-update", "2"]  # 2 optimizer steps an iteration
    run_in_process("dancegrpo.py", [*off, "--exp-name", "straight"], tmp_path)
    run_in_process("dancegrpo.py", [*off, "--exp-name", "cut", "--iterations", "1"], tmp_path)
    capsys.readouterr()
    run_in_process("dancegrpo.py", [*off, "--exp-name", "cut", "--resume-from", "latest"], tmp_path)
    assert "iter_000001 at iteration 1" in capsys.readouterr().out  # resumed, not trained again from the start
    assert_same_trained_weights(tmp_path / "straight", tmp_path / "cut")
    if "dppo" in mode:  # the mask dropped updates in both iterations, so it is part of what is compared
        masked = [r["losses/masked"] for r in metrics(tmp_path / "straight") if "losses/masked" in r]
        assert len(masked) == 2 and all(0 < m < 0.5 for m in masked), masked  # some of the second step's samples


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    """kind -> folder of its tiny random pipeline (tests/tiny.py) with a prompts file, built once per module."""
    from tests.tiny import BUILDERS

    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = tmp_path_factory.mktemp(kind)
            BUILDERS[kind](cache[kind])
            (cache[kind] / "prompts.txt").write_text("a red circle\na green square on a white background\n")
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", ["flux", "sd3", "qwen", "wan"])
def test_each_mode_trains_each_real_model_kind(kind, pipelines, tmp_path):
    """Each mode, 2 optimizer steps on a tiny FLUX.1 / SD3 / Qwen-Image / Wan2.1 pipeline with CFG 4 (FLUX.1's embedded
    guidance): the first ratio exactly 1, a finite gradient, the adapter moved, and MixGRPO-Flash's forwards counted."""
    from safetensors.torch import load_file

    from tests.helpers import LORA_WEIGHTS, find_run, run_in_process
    from tests.tiny import RES

    folder = pipelines(kind)
    size = ["--resolution", str(RES)] + (["--num-frames", "5"] if kind == "wan" else [])
    prompts = str(folder / "prompts.txt")
    base = ["--model-id", str(folder), *size, "--prompts", prompts, "--eval-prompts", prompts, "--reward", "jpeg",
            "--guidance-scale", "4", "--lora-rank", "4", "--learning-rate", "1e-2", *QUICK[:-1],
            "--samples-per-update", "2"]  # fmt: skip
    for name, mode in MODES.items():
        run_in_process("dancegrpo.py", [*base, *mode, "--exp-name", name], tmp_path)
        (record,) = [r for r in metrics(tmp_path / name) if "losses/first_ratio_max_dev" in r]
        assert record["losses/first_ratio_max_dev"] == 0 and math.isfinite(record["charts/grad_norm"]), name
        lora_b = [v for k, v in load_file(find_run(tmp_path / name) / "final" / LORA_WEIGHTS).items() if "lora_B" in k]
        assert lora_b and any(v.abs().sum() > 0 for v in lora_b), name
        # window steps 0-1, then int((6 - 1) x 0.5) = 2 tail points: 1 DPM step; + 2 trained forwards
        assert name != "cps_flash" or record["perf/nfe_per_image"] == 3 + 2, record


def test_the_banner_names_each_method_the_flags_make():
    cases = [
        ({}, "DanceGRPO"),
        ({"sde_window": 4}, "MixGRPO"),
        ({"sde_window": 4, "ode_solver": "dpm2"}, "MixGRPO-Flash"),
        ({"objective": "dppo"}, "DanceGRPO + Flow-DPPO"),
        ({"objective": "guard", "sde_type": "cps"}, "DanceGRPO + GRPO-Guard (CPS)"),
        ({"sde_window": 4, "sde_type": "cps"}, "MixGRPO (CPS)"),
    ]
    for flags, name in cases:
        assert D.title(D.Args(**flags)) == name, flags


def test_cps_step_takes_one_sigma_per_sample():
    """A batch whose samples stand at different steps (per-sample sigma, sigma', eta): each row as its own step."""
    g = torch.Generator().manual_seed(2)
    x, v, noise = (torch.randn(3, 2, 4, 4, generator=g) for _ in range(3))
    sigma, sigma_next, eta = (
        torch.tensor([0.9, 0.6, 0.3]),
        torch.tensor([0.8, 0.45, 0.1]),
        torch.tensor([0.5, 0.8, 1.0]),
    )
    x_next, log_prob, mean, std = D.cps_step(x, v, sigma, sigma_next, eta, noise=noise)
    for i in range(3):
        one = D.cps_step(
            x[i : i + 1], v[i : i + 1], sigma[i].item(), sigma_next[i].item(), eta[i].item(), noise=noise[i : i + 1]
        )
        torch.testing.assert_close(x_next[i : i + 1], one[0])
        torch.testing.assert_close(log_prob[i : i + 1], one[1])


def test_flow_dppo_drops_a_sample_at_or_over_the_kl_threshold_only_where_its_ratio_moves_with_its_advantage():
    """Eq. 18's mask by hand, at each edge: KL exactly at the threshold counts as over; a ratio of exactly 1 and an
    advantage of exactly 0 move nowhere; |A| < 1 is a sign like any other."""
    #            d    log r  A      masked   (kl_old = d^2 / 2 with std 1; threshold 0.5)
    rows = [(1.0, 0.1, 0.5, True), (1.0, -0.1, -0.5, True), (1.0, -0.1, 0.5, False), (1.0, 0.0, 0.5, False),
            (1.0, 0.0, -0.5, False), (1.0, 0.1, 0.0, False), (1.0, -0.1, 0.0, False), (0.5, 0.1, 0.5, False)]  # fmt: skip
    d, log_r, adv, masked = (torch.tensor([r[i] for r in rows]) for i in range(4))
    old = torch.zeros(len(rows))
    loss, figures = D.policy_loss(log_r, old, adv, d.view(-1, 1), torch.zeros(len(rows), 1), None, torch.tensor(1.0),
                                  0.1, objective="dppo", clip_range=0.2, kl_mask_threshold=0.5, kl_beta=0.0)  # fmt: skip
    expected = torch.where(masked.bool(), 0.0, -adv * log_r.exp())
    torch.testing.assert_close(loss, expected)
    assert figures["masked"].item() == 2 / 8
