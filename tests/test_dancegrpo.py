"""dancegrpo.py: the SDE log-prob, advantages, the MixGRPO window, ratio == 1, and the real script end to end."""

import resource
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import dancegrpo as D
from common import InputError
from common.models import load_model
from tests.helpers import (
    ROOT,
    assert_final_loads,
    assert_same_trained_weights,
    checkpoint_begun,
    find_run,
    logged,
    metrics,
    replace_flags,
    run_recipe,
    run_until,
)
from tests.helpers import run_script as run
from tests.tiny import build_shapes

TINY_RUN = [
    "--iterations",
    "2",
    "--samples-per-device",
    "8",
    "--group-size",
    "4",
    "--rollout-batch-size",
    "4",
    "--samples-per-update",
    "4",
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
]


def run_script(args, tmp_path, *rest, **kw):
    return run("dancegrpo.py", args, tmp_path, *rest, **kw)


def test_sde_step_log_prob_is_the_gaussian_density():
    g = torch.Generator().manual_seed(0)
    x, v, noise = (torch.randn(5, 3, 8, 8, generator=g) for _ in range(3))
    sigma, sigma_next, eta = torch.tensor([0.9, 0.7, 0.5, 0.3, 0.2]), torch.tensor([0.8, 0.6, 0.3, 0.1, 0.0]), 0.7
    x_next, log_prob, mean, std = D.sde_step(x, v, sigma, sigma_next, eta, noise=noise)
    # the closed form of docs/math.md, written independently
    s, d = sigma.view(-1, 1, 1, 1), (sigma_next - sigma).view(-1, 1, 1, 1)
    expected_mean = x + d * (v + eta**2 / 2 * (x + (1 - s) * v) / s)
    torch.testing.assert_close(mean, expected_mean)
    torch.testing.assert_close(x_next, expected_mean + eta * (-d).sqrt() * noise)
    normal = torch.distributions.Normal(expected_mean, eta * (-d).sqrt())
    torch.testing.assert_close(log_prob, normal.log_prob(x_next).flatten(1).mean(1))
    # scoring a given sample reproduces the same log-prob
    torch.testing.assert_close(D.sde_step(x, v, sigma, sigma_next, eta, prev_sample=x_next)[1], log_prob)


def test_noise_schedules():
    sigmas = D.sigma_schedule(10, 3.0)
    assert sigmas[0] == 1 and sigmas[-1] == 0 and torch.all(sigmas[1:] < sigmas[:-1])
    torch.testing.assert_close(sigmas[5], torch.tensor(3 * 0.5 / (1 + 2 * 0.5)))
    assert torch.all(D.noise_g(sigmas, "dance", 0.3) == 0.3)
    flow = D.noise_g(sigmas, "flow", 0.7)
    # Flow-GRPO: the first step's std g sqrt(dt) is exactly a, since dt = 1 - sigma_1
    torch.testing.assert_close(flow[0] * (sigmas[0] - sigmas[1]).sqrt(), torch.tensor(0.7))
    torch.testing.assert_close(flow[3], 0.7 * (sigmas[3] / (1 - sigmas[3])).sqrt())


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0])
    adv = D.group_advantages(r, 4)
    mean, std = 3.0, torch.tensor([1.0, 2.0, 3.0, 6.0]).std().item()  # unbiased std = sqrt(14/3)
    torch.testing.assert_close(adv[:4], (torch.tensor([1.0, 2.0, 3.0, 6.0]) - mean) / (std + 1e-8))
    assert torch.all(adv[4:] == 0)  # a group of equal rewards carries no signal


def test_policy_loss_clips_the_ratio_and_adds_the_kl_term():
    logp_old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.5]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    mean, std = torch.zeros(4, 2), torch.tensor([1.0, 1.0, 2.0, 0.5]).view(4, 1)
    # the rollout's means away from the policy's: squared distance 1, 2, 4, 0 a dim, over 2 std^2 (the behaviour KL)
    old_mean = torch.tensor([[1.0, 1.0], [0.0, 2.0], [2.0, 2.0], [0.0, 0.0]])
    flags = {"objective": "clip", "clip_range": 0.2, "kl_mask_threshold": 1e-5}
    loss, figures = D.policy_loss(logp, logp_old, adv, mean, old_mean, None, std, 0.1, **flags, kl_beta=0.0)
    torch.testing.assert_close(figures["ratio_mean"], torch.tensor([1.0, 1.5, 0.5, 1.5]))
    # A > 0: the gain is capped at 1 + eps; A < 0: the pessimistic (larger) loss is kept; the clip objective reads
    # the plain ratio, not the behaviour KL
    torch.testing.assert_close(loss, torch.tensor([-1.0, -1.2, 0.8, 1.5]))
    torch.testing.assert_close(figures["kl_old"], torch.tensor((0.5 + 1.0 + 0.5 + 0.0) / 4))
    assert figures["clipfrac"] == 0.75 and "kl" not in figures
    torch.testing.assert_close(figures["ratio_max_dev"], torch.tensor(0.5))
    # the KL of two Gaussian steps with one std: mean over dims of (mean - mean_ref)^2, over 2 std^2
    mean_ref = torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 0.0], [1.0, 3.0]])  # squared distance 0, 1, 2, 5 a dim
    loss_kl, figures = D.policy_loss(logp, logp_old, adv, mean, old_mean, mean_ref, std, 0.1, **flags, kl_beta=0.1)
    torch.testing.assert_close(loss_kl, loss + 0.1 * torch.tensor([0.0, 0.5, 0.25, 10.0]))
    assert figures["kl"] == (0.5 + 0.25 + 10.0) / 4


def test_mixgrpo_window_slides_and_stops():
    assert D.sde_steps(10, 0, 25, 123) == list(range(9))  # DanceGRPO: every step but the last
    assert D.sde_steps(10, 4, 25, 0) == [0, 1, 2, 3]
    assert D.sde_steps(10, 4, 25, 24) == [0, 1, 2, 3]
    assert D.sde_steps(10, 4, 25, 25) == [1, 2, 3, 4]
    assert D.sde_steps(10, 4, 25, 125) == [5, 6, 7, 8]
    assert D.sde_steps(10, 4, 25, 10_000) == [5, 6, 7, 8]  # stays at the last trainable steps


def test_ratio_is_exactly_one_before_the_first_update(tmp_path):
    build_shapes(tmp_path)
    model = load_model(str(tmp_path))
    prompts = ["a red circle on a blue background", "a green square on a white background"] * 2
    cond = model.encode_prompts(prompts)
    sigmas = D.sigma_schedule(6, 3.0)
    g = D.noise_g(sigmas, "flow", 0.7)
    gen = torch.Generator().manual_seed(0)
    L = model.latent_shape()  # (4, 8, 8)
    x, noise = torch.randn(4, *L, generator=gen), torch.randn(4, 6, *L, generator=gen)
    from contextlib import nullcontext

    latents, log_probs, means = D.rollout(
        model, model.transformer, cond, x, noise, sigmas, g, range(5), 1.0, nullcontext, D.sde_step
    )
    assert latents.shape == (4, 7, *L) and torch.all(log_probs[:, -1] == 0) and means.shape == (4, 6, *L)
    assert torch.equal(means[:, -1], latents[:, -1])  # the last, deterministic step's mean is its result
    for i in range(5):  # the training forward (with grad) on the same micro-batch
        v = model.velocity(model.transformer, latents[:, i], sigmas[i].expand(4), cond)
        _, logp, mean, _ = D.sde_step(
            latents[:, i], v.float(), sigmas[i], sigmas[i + 1], g[i], prev_sample=latents[:, i + 1]
        )
        assert torch.equal(torch.exp(logp - log_probs[:, i]), torch.ones(4))
        assert torch.equal(mean, means[:, i])  # so GRPO-Guard's and Flow-DPPO's KL to the rollout starts at 0


def test_validation_names_the_flag(tmp_path):
    with pytest.raises(InputError, match="--sde-window"):
        D.resolve_and_check(D.Args(sde_window=10))
    with pytest.raises(InputError, match="unknown reward"):
        D.resolve_and_check(D.Args(reward="nope"))
    args = D.Args(sde_window=4)
    D.resolve_and_check(args)  # the mode's defaults
    assert (args.noise_level, args.timestep_fraction, args.exp_name) == (0.7, 1.0, "dancegrpo_mix")
    # the process count's check is main()'s: 10 samples on one process do not fill groups of 4
    flags = [
        "--samples-per-device",
        "12",
        "--group-size",
        "8",
        "--rollout-batch-size",
        "4",
        "--samples-per-update",
        "12",
    ]
    out = run_script(flags, tmp_path, check=False)
    assert (
        out.returncode == 2
        and "error: --samples-per-device 12 x 1 processes must be a multiple of --group-size 8" in out.stderr
    )


def test_end_to_end_shapesbench(tmp_path):
    run_script(TINY_RUN + ["--exp-name", "e2e", "--save-every", "1", "--kl-beta", "0.04"], tmp_path)  # KL path too
    run = find_run(tmp_path / "e2e")
    rows = metrics(run)
    train = [r for r in rows if "losses/policy" in r]
    assert [r["iteration"] for r in train] == [1, 2]
    assert all(r["losses/first_ratio_max_dev"] == 0 for r in train)  # ratio exactly 1 at the first update
    # 4 rollout steps + int(3 SDE steps x 0.6) = 1 trained step x (policy + KL reference forward)
    assert all(r["perf/nfe_per_image"] == 4 + 1 * 2 for r in train)
    evals = [r for r in rows if "eval/shape_acc" in r]
    assert [r["iteration"] for r in evals] == [0, 2]
    assert_final_loads(run)  # the default trains a LoRA adapter, which diffusers' loader reads
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000001", "iter_000002"]
    assert (run / "samples" / "samples_000002.png").is_file()


def test_mixgrpo_end_to_end(tmp_path):
    run_script(TINY_RUN + ["--exp-name", "mix", "--sde-window", "2", "--kl-beta", "0", "--eval-every", "0"], tmp_path)
    train = [r for r in metrics(tmp_path / "mix") if "losses/policy" in r]
    assert all(r["perf/nfe_per_image"] == 4 + 2 and r["charts/window_start"] == 0 for r in train)


def test_faults_a_cluster_delivers_change_nothing(tmp_path):
    """SIGKILL mid-iteration, SIGKILL the moment a checkpoint begins, SIGTERM (preemption), a full disk: each time
    `--resume-from latest` goes on, and the run ends with the weights of an uninterrupted one, each iteration and
    each evaluation logged once, in metrics.jsonl and TensorBoard. Also under --lr-warmup: the optimizer-step
    counter is checkpointed, so the warmup goes on where it was."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    common = replace_flags(TINY_RUN, {"--samples-per-device": "4"}) + [
        "--sample-every",
        "0",
        "--save-every",
        "2",
        "--lr-warmup",
        "100",
        "--iterations",
        "6",
    ]
    common += ["--eval-max-prompts", "2"]  # evaluations of 2 held-out prompts: a record each is what counts here
    run_script(common + ["--exp-name", "straight"], tmp_path)
    faulty, name = common + ["--exp-name", "faulty"], tmp_path / "faulty"
    resume = faulty + ["--resume-from", "latest"]
    # preempted: SIGTERM in iteration 4 -> it finishes the iteration (or the next), writes a checkpoint and exits
    status, out = run_until("dancegrpo.py", faulty, tmp_path, lambda p: logged(name, 3), signal.SIGTERM)
    assert status == 128 + signal.SIGTERM and "SIGTERM: stopped after iteration" in out, out[-2000:]
    stopped, run = int(out.split("SIGTERM: stopped after iteration ")[1].split(",")[0]), find_run(name)
    assert stopped in (3, 4) and (run / "checkpoints" / f"iter_{stopped:06d}").is_dir()  # 3 was not due
    # killed mid-iteration: in iteration 6, after the checkpoint of iteration 4
    status, _ = run_until("dancegrpo.py", resume, tmp_path, lambda p: logged(name, 5))
    assert status == -signal.SIGKILL
    # a full disk (here: a file-size limit) while the checkpoint of iteration 6 is written: one line, nothing partial
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # noqa: E731
    status, out = run_until("dancegrpo.py", resume, tmp_path, lambda p: False, preexec_fn=limit)
    assert status == 1 and "error: cannot write the checkpoint of iteration 6" in out, out[-2000:]
    assert "the previous checkpoint iter_000004 is intact" in out and "Traceback" not in out
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "iter_000004"
    # killed the moment the checkpoint of iteration 6 begins to be written
    status, _ = run_until("dancegrpo.py", resume, tmp_path, lambda p: checkpoint_begun(name, 6))
    assert status == -signal.SIGKILL
    run_script(resume, tmp_path)
    assert_same_trained_weights(tmp_path / "straight", name)
    saved = load_file(max((run / "checkpoints").glob("iter_*")) / "model.safetensors")
    assert saved and all("lora_" in k for k in saved)  # a LoRA checkpoint holds the adapter, not the frozen base
    rows = {n: metrics(tmp_path / n) for n in ("straight", "faulty")}
    for n in rows:  # each training iteration and each evaluation once, in order
        assert [r["iteration"] for r in rows[n] if "charts/lr" in r] == [1, 2, 3, 4, 5, 6]
        assert [r["iteration"] for r in rows[n] if "eval/reward" in r] == [0, 2, 4, 6]
    lrs = [[r["charts/lr"] for r in rows[n] if "charts/lr" in r] for n in rows]
    # one optimizer step per iteration under --lr-warmup 100: 6e-4 x k / 100 at step k, across every resume
    assert lrs[0] == lrs[1] and lrs[0] == pytest.approx([6e-6 * k for k in range(1, 7)], rel=1e-9)
    events = EventAccumulator(str(run))
    events.Reload()
    assert [e.step for e in events.Scalars("charts/lr")] == [1, 2, 3, 4, 5, 6]  # the purge step hides repeats
    assert [e.step for e in events.Scalars("eval/reward")] == [0, 2, 4, 6]


def test_two_processes_keep_identical_weights(tmp_path):
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2")
    # groups of 4 over 2 processes x 2 samples: every group spans both processes
    run_script(
        TINY_RUN
        + [
            "--exp-name",
            "ddp",
            "--no-lora",  # full fine-tuning (the FSDP recipes' mode) with the frozen-copy KL; the default is LoRA
            "--samples-per-device",
            "2",
            "--rollout-batch-size",
            "2",
            "--samples-per-update",
            "2",
            "--eval-every",
            "0",
        ],
        tmp_path,
        launcher,
        {"ACCELERATE_USE_CPU": "1"},
    )
    last = [r for r in metrics(tmp_path / "ddp") if "charts/rank_weight_spread" in r][-1]
    assert last["iteration"] == 2 and last["charts/rank_weight_spread"] == 0


def test_run_sh_recipe_launches_the_script(tmp_path):
    """run.sh's CPU recipes are what the README points to: run one with tiny flags (later flags win)."""
    run_recipe("mixgrpo-cpu", [*TINY_RUN, "--sde-window", "2", "--eval-every", "0"], tmp_path)
    train = [r for r in metrics(tmp_path / "mixgrpo") if "losses/policy" in r]
    assert len(train) == 2 and train[0]["charts/window_start"] == 0
    bad = subprocess.run(["bash", "run.sh", "no-such-recipe"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown recipe" in bad.stderr
