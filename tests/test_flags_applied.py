"""Flags whose effect no other test checked at a non-default, non-neutral value (docs/testing.md, "Flag inventory"):
each against a figure worked out here by hand. Pure functions first; then one in-process main() run per script on
tiny ShapesBench settings, with wrappers recording what main() passed (tests/test_direction.py's Tape), so that one
run checks several flags."""

import dataclasses
import inspect
import math
import sys
import types
from pathlib import Path

import pytest
import torch
import tyro
from accelerate import Accelerator

import branchgrpo as B
import dancegrpo as D
import rlr as R
import vgrpo as V
from common import InputError, remote, rewards
from common import evaluate as E
from common import evaluator as evaluator_module
from common.flags import RunArgs
from common.logs import read_metrics
from common.models import load_model, trainable_denoiser
from common.rewards import ScoreFn
from common.runs import Run
from tests.test_direction import Tape

SHIFT2_4 = [1.0, 1.5 / 1.75, 1.0 / 1.5, 0.5 / 1.25, 0.0]  # 2 s / (1 + s) at s = 1, .75, .5, .25, 0
SHAPES = ["a red circle on a blue background", "a green square on a white background",
          "a blue triangle on a yellow background", "a yellow circle on a red background",
          "a red square on a green background"]  # fmt: skip


# ---------------------------------------------------------------- pure functions
@pytest.mark.parametrize("module", [D, B, V, R])
def test_shift_two_warps_the_sigma_schedule(module):
    torch.testing.assert_close(module.sigma_schedule(4, 2.0), torch.tensor(SHIFT2_4))


@pytest.mark.parametrize("module", [D, B, R])
def test_noise_level_sets_g_for_both_sde_types(module):
    sigmas = torch.tensor(SHIFT2_4)
    torch.testing.assert_close(module.noise_g(sigmas, "dance", 0.5), torch.full((4,), 0.5))
    # flow: a sqrt(s / (1 - s)), the first step with sigma_1 = 6/7 in the denominator: 0.5 sqrt(1 / (1/7))
    s = [1.0, 6 / 7, 2 / 3, 0.4]
    expected = [0.5 * math.sqrt(7.0)] + [0.5 * math.sqrt(x / (1 - x)) for x in s[1:]]
    torch.testing.assert_close(module.noise_g(sigmas, "flow", 0.5), torch.tensor(expected))


def test_rlr_schedule_takes_shift_noise_level_and_sde_type():
    fake = types.SimpleNamespace(kind="shapes")
    sched = R.make_schedule(fake, 4, 0.5, 2.0, "dance")
    torch.testing.assert_close(sched["sigmas"], torch.tensor(SHIFT2_4))
    torch.testing.assert_close(sched["g"], torch.tensor([0.5, 0.5, 0.5, 0.0]))  # the last step deterministic


def test_branchgrpo_policy_loss_clip_range_and_kl_beta():
    logp_old, logp = torch.zeros(4), torch.log(torch.tensor([1.0, 1.5, 0.5, 1.5]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, figures = B.policy_loss(logp, logp_old, adv, None, None, None, clip_range=0.2, kl_beta=0.0)
    torch.testing.assert_close(loss, torch.tensor([-1.0, -1.2, 0.8, 1.5]))  # A > 0 capped at 1.2; A < 0 pessimistic
    assert figures["clipfrac"] == 0.75
    mean, std = torch.zeros(4, 2), torch.tensor([1.0, 1.0, 2.0, 0.5])
    mean_ref = torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 0.0], [1.0, 3.0]])  # squared distance 0, 1, 2, 5 a dim
    loss_kl, _ = B.policy_loss(logp, logp_old, adv, mean, mean_ref, std, clip_range=0.2, kl_beta=0.1)
    torch.testing.assert_close(loss_kl, torch.tensor([-1.0, -1.2, 0.8, 1.5]) + 0.1 * torch.tensor([0, 0.5, 0.25, 10]))


def test_vgrpo_kl_beta_adds_d_simple():
    values, old = torch.zeros(2, 2), torch.zeros(2, 2)  # ratio 1: the surrogate is -A
    x0_hat = torch.zeros(2, 2, 3)
    ref = torch.tensor([[[1.0, 1.0, 1.0], [0.0, 0.0, 3.0]], [[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    loss, figures = V.policy_loss(values, old, torch.tensor([1.0, -2.0]), x0_hat, ref, clip_range=0.1, kl_beta=0.5)
    # D_simple per image: mean over pairs of the mean squared distance: (1 + 3) / 2 = 2, (4/3 + 0) / 2 = 2/3
    torch.testing.assert_close(loss, torch.tensor([-1.0 + 0.5 * 2, 2.0 + 0.5 * 2 / 3]))
    torch.testing.assert_close(figures["kl"], torch.tensor((2 + 2 / 3) / 2))


def test_vgrpo_adv_clip_max_and_soft_clip():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3, unbiased std sqrt(14 / 3)
    a = [(x - 3) / math.sqrt(14 / 3) for x in (1.0, 2.0, 3.0, 6.0)]  # -0.926, -0.463, 0, 1.389
    clipped = V.combined_advantages({"r": r}, {"r": 1.0}, group_size=4, adv_clip_max=0.5, adv_soft_clip=0.0)
    torch.testing.assert_close(clipped, torch.tensor([-0.5, a[1], 0.0, 0.5]))
    soft = V.combined_advantages({"r": r}, {"r": 1.0}, group_size=4, adv_clip_max=5.0, adv_soft_clip=2.0)  # eta = 2
    torch.testing.assert_close(soft, torch.tensor([2 * math.tanh(x / 2) for x in a]))


def test_fusion_gamma_and_temperature_weight_the_leaves():
    sizes = B.Tree(3, (0, 1), 2).sizes  # [1, 2, 4, 4]
    r = torch.tensor([[1.0, 2.0, 3.0, 5.0]])
    lps = [torch.tensor([0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0, 0.0]), torch.zeros(4)]  # leaf 1: path log-prob 1
    values = B.node_values(r, lps, sizes, "path", 2.0, 0.5)  # weights softmax(2 * lp / 0.5) = softmax(4 lp)
    e = math.exp(4.0)
    torch.testing.assert_close(values[1], torch.tensor([[(1 + 2 * e) / (1 + e), 4.0]], dtype=torch.float64))
    torch.testing.assert_close(values[0], torch.tensor([[(1 + 2 * e + 3 + 5) / (3 + e)]], dtype=torch.float64))


def test_branch_s_sets_the_sibling_correlation_and_the_scaled_noise():
    tree = B.Tree(4, (0,), 2, branch_noise="correlated", branch_s=3.0)  # rho = 1 / (1 + 3) = 0.25
    z = B.tree_noise(tree, 0, 0, [0], (8,), 0, 20000).view(20000, 2, 8)
    corr = torch.corrcoef(torch.stack([z[:, 0].flatten(), z[:, 1].flatten()]))[0, 1].item()
    assert abs(corr - 0.25) < 0.015 and abs(z.var().item() - 1) < 0.02
    scaled = B.Tree(4, (0,), 2, branch_noise="scaled", branch_s=3.0)
    assert [scaled.noise_scale(i) for i in range(4)] == [3.0, 1.0, 1.0, 1.0]  # the split's std times s


def test_num_splits_sets_how_many_splits_a_named_schedule_makes():
    assert B.split_steps("dense", 20, 2) == [0, 3]
    assert B.split_steps("sparse", 20, 5) == [0, 4, 8, 12, 16]  # every 20 // 5 steps
    assert B.split_steps("late", 20, 3) == [10, 13, 16]  # from T / 2, every (19 - 10) // 3 steps


def test_width_keep_ratio_keeps_that_share_of_the_chains():
    tree = B.Tree(20, (0, 3, 6, 9), 2, pruning="width", width_mode="extreme", width_keep_ratio=0.25)
    torch.manual_seed(0)
    adv = [torch.randn(1, n) for n in tree.sizes[1:]]
    keep = B.trained_edges(tree, B.sde_steps(tree, 0), adv, 0)
    order = sorted(range(16), key=lambda c: float(adv[9][0, c]))
    expected = sorted(order[:2] + order[-2:])  # int(16 x 0.25) = 4 chains: the 2 lowest and the 2 highest
    for i in range(10, 19):
        assert torch.nonzero(keep[i][0]).flatten().tolist() == expected
    assert sum(int(k.sum()) for k in keep) == 218 - 16 - 9 * 12


def test_rlr_group_size_two_makes_each_baseline_the_partner():
    r = torch.tensor([1.0, 4.0, 2.0, 7.0])
    torch.testing.assert_close(R.loo_baseline(r, 2), torch.tensor([4.0, 1.0, 7.0, 2.0]))
    w_ho, _, _, _ = R.term_weights(
        r, torch.zeros(4, dtype=torch.long), torch.zeros(4, 3, dtype=torch.bool), 1, group_size=2
    )
    torch.testing.assert_close(w_ho, torch.tensor([-3.0, 3.0, -5.0, 5.0]))


def test_zo_scale_is_the_perturbation_std_and_divides_the_gradient():
    params = [torch.zeros(4, 5, requires_grad=True)]
    zeta = R.zo_noise(params, 7, 0.1)
    torch.testing.assert_close(zeta[0], 0.1 * torch.randn(4, 5, generator=torch.Generator().manual_seed(7)))
    R.add_zo_grad(params, zeta, torch.tensor(0.5), 0.1)
    torch.testing.assert_close(params[0].grad, -0.5 * zeta[0] / 0.01)


def test_lora_rank_and_alpha_set_the_adapter():
    model = load_model("shapesbench")
    denoiser = trainable_denoiser(model, RunArgs(lora_rank=4, lora_alpha=2.0))
    layers = [m for m in denoiser.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert layers and all(m.lora_A["default"].weight.shape[0] == 4 for m in layers)
    assert all(m.scaling["default"] == 0.5 for m in layers)  # alpha / rank


def test_save_every_and_checkpoints_total_limit(tmp_path):
    args = RunArgs(exp_name="t", output_dir=str(tmp_path), lora=False, save_every=2, checkpoints_total_limit=3)
    run = Run(args, Accelerator(cpu=True), "test")
    for it in range(1, 11):
        run.checkpoint(it, final=False)
    assert sorted(p.name for p in run.ckpt.dir.iterdir()) == ["iter_000006", "iter_000008", "iter_000010"]


def test_wandb_project_name_is_the_wandb_project(tmp_path, monkeypatch):
    calls = []
    fake = types.SimpleNamespace(
        init=lambda **kw: calls.append(kw) or types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None),
        util=types.SimpleNamespace(generate_id=lambda: "id0"),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = RunArgs(exp_name="t", output_dir=str(tmp_path), track=True, wandb_project_name="my-project")
    run = Run(args, Accelerator(cpu=True), "test")
    run.logs.log({"charts/lr": 1.0}, 1)
    run.logs.close()
    assert [c["project"] for c in calls] == ["my-project"]


def test_serve_main_passes_every_option_to_the_server(monkeypatch, tmp_path, capsys):
    built, served = [], []
    probe = rewards.RewardKind(lambda device, checkpoint=None: built.append((device, checkpoint)), differentiable=False)
    monkeypatch.setitem(rewards.REWARDS, "probe", probe)

    def serve(score, names, host, port, token, max_batch, max_mb, max_pixels, **limits):
        served.append((names, host, port, max_batch, max_mb, max_pixels, limits))
        return types.SimpleNamespace(server_port=port, serve_forever=lambda: None)

    monkeypatch.setattr(remote, "serve", serve)
    ckpt = tmp_path / "probe.pt"
    ckpt.write_text("")
    argv = ["serve", "--reward", "probe", "--reward-ckpt", f"probe={ckpt}", "--host", "0.0.0.0", "--port", "8123",
            "--device", "meta", "--max-batch", "3", "--max-mb", "1.5", "--max-pixels", "1000", "--max-prompt-chars",
            "77", "--max-connections", "5", "--request-deadline", "2.5"]  # fmt: skip
    rewards.serve_main(argv)
    assert built == [("meta", str(ckpt))]
    limits = dict(max_prompt_chars=77, max_connections=5, request_deadline=2.5)
    assert served == [(["probe"], "0.0.0.0", 8123, 3, 1.5, 1000, limits)]
    for flag, value, said in (
        ("--max-connections", "0", "must be >= 1 (got 0)"),
        ("--request-deadline", "nan", "must be a finite number (got nan)"),
        ("--max-mb", "-1", "must be > 0 (got -1.0)"),
    ):
        with pytest.raises(SystemExit) as refused:
            rewards.serve_main([*argv, flag, value])
        assert refused.value.code == 2
        assert capsys.readouterr().err == f"error: {flag} {said}\n", flag


# ---------------------------------------------------------------- main() in this process
class RecordingAdamW(torch.optim.AdamW):
    """AdamW that records, at each step, the learning rate, the weight decay, the total gradient norm (after the
    script's clipping) and the trained tensors before and after the step."""

    steps = []

    def step(self, closure=None):
        group = self.param_groups[0]
        grads = [p.grad.double().square().sum() for p in group["params"] if p.grad is not None]
        before = [p.detach().clone() for p in group["params"]]
        out = super().step(closure)
        after = [p.detach().clone() for p in group["params"]]
        norm = math.sqrt(float(sum(grads)))
        self.steps.append(
            {"lr": group["lr"], "wd": group["weight_decay"], "norm": norm, "before": before, "after": after}
        )
        return out


def run_flags(module, monkeypatch, tmp_path, argv, names=()):
    """module.main() on `argv` in this process; returns (tape, record): the calls of the module's functions `names`,
    and `record`: the model, each velocity call (guidance scale, rows, with gradients or not), each encode_prompts
    call, each optimizer step (RecordingAdamW) and the run's metrics."""
    tape = Tape(monkeypatch, module, *names)
    record = {"velocity": [], "encode": []}
    RecordingAdamW.steps = record["steps"] = []
    load = module.load_model

    def load_model(*a, **kw):
        record["model"] = model = load(*a, **kw)
        velocity, encode = model.velocity, model.encode_prompts

        def recorded_velocity(denoiser, x, sigma, cond, guidance_scale=1.0):
            record["velocity"].append((guidance_scale, len(x), torch.is_grad_enabled()))
            return velocity(denoiser, x, sigma, cond, guidance_scale)

        def recorded_encode(prompts):
            record["encode"].append(list(prompts))
            return encode(prompts)

        model.velocity, model.encode_prompts = recorded_velocity, recorded_encode
        return model

    monkeypatch.setattr(module, "load_model", load_model)
    monkeypatch.setattr(torch.optim, "AdamW", RecordingAdamW)
    record["args"] = args = tyro.cli(module.Args, args=[*argv, "--output-dir", str(tmp_path)])
    module.main(args)
    runs = sorted(Path(tmp_path).glob("*__*__*"))
    record["metrics"] = read_metrics(runs[-1]) if runs else []
    record["runs"] = runs
    assert_flags_passed_by_name(tape, record["args"])
    return tape, record


def assert_flags_passed_by_name(tape, args):
    """Every call main() made of a recorded function passed each of its keyword-only parameters named like a flag
    with that flag's value (the flags resolved by main()): the rule docs/forking.md states and the flag inventory
    relies on, whatever else the call passes and however main() spells it."""
    fields = {f.name for f in dataclasses.fields(args)}
    for name, fn in tape.functions.items():
        calls = tape.calls[name]
        keywords = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
        for _, kw, _ in calls:
            for key in [k for k in keywords if k in fields]:
                assert key in kw and kw[key] == getattr(args, key), (name, key, kw.get(key), getattr(args, key))


def train_rows(record):
    return [r for r in record["metrics"] if "charts/lr" in r]


@pytest.fixture
def zero_reward(monkeypatch):
    zero = lambda device, checkpoint=None: ScoreFn(lambda x, p: x.sum((1, 2, 3)) * 0, False)  # noqa: E731
    monkeypatch.setitem(rewards.REWARDS, "zero", rewards.RewardKind(zero, differentiable=False))


QUIET = ["--eval-every", "0", "--sample-every", "0", "--no-save", "--lr-warmup", "0"]


def test_dancegrpo_main_applies_the_sampling_and_training_flags(monkeypatch, tmp_path):
    """8 samples in chunks of 2, groups of 4 sharing their initial noise, DanceGRPO noise 0.5, half of the 5 SDE steps
    trained, advantages clipped at 0.5, two optimizer steps with gradients clipped to norm 1e-4."""
    argv = ["--iterations", "1", "--samples-per-device", "8", "--group-size", "4", "--rollout-batch-size", "2",
            "--samples-per-update", "4", "--num-steps", "6", "--timestep-fraction", "0.5", "--same-noise",
            "--adv-clip-max", "0.5", "--max-grad-norm", "1e-4", "--sde-type", "dance", "--noise-level", "0.5",
            "--learning-rate", "1e-3", *QUIET]  # fmt: skip
    tape, record = run_flags(D, monkeypatch, tmp_path, argv, ["rollout", "combined_advantages", "policy_loss"])
    rollouts = tape.calls["rollout"]
    assert [len(c[0][3]) for c in rollouts] == [2, 2, 2, 2]  # --rollout-batch-size 2, --samples-per-device 8
    init = torch.cat([c[0][3] for c in rollouts])
    assert all(torch.equal(init[k], init[4 * (k // 4)]) for k in range(8)) and not torch.equal(init[0], init[4])
    assert all(torch.equal(c[0][6], torch.full((6,), 0.5)) for c in rollouts)  # g: dance, --noise-level 0.5
    (row,) = train_rows(record)
    assert row["perf/trained_steps_per_image"] == 2  # int(5 SDE steps x 0.5)
    assert len(tape.calls["policy_loss"]) == 4 * 2  # 4 chunks x 2 trained steps
    (scores, weights), flags, _ = tape.calls["combined_advantages"][0]
    assert (flags["group_size"], flags["adv_clip_max"]) == (4, 0.5)
    all_adv = D.combined_advantages(scores, weights, group_size=4, adv_clip_max=math.inf)  # unclipped
    assert all_adv.abs().max() > 0.5  # the clip acts
    for k, (a, _, _) in enumerate(tape.calls["policy_loss"]):
        chunk = all_adv[2 * (k // 2) : 2 * (k // 2) + 2].tolist()
        assert a[2].tolist() == pytest.approx([max(-0.5, min(0.5, x)) for x in chunk])
    steps = record["steps"]
    assert len(steps) == 2  # --samples-per-update 4 of 8
    assert row["charts/grad_norm"] > 1e-3 and all(s["norm"] == pytest.approx(1e-4, rel=1e-3) for s in steps)


def test_dancegrpo_main_applies_the_run_flags(monkeypatch, tmp_path, zero_reward):
    """A zero reward (zero gradients): AdamW's step is its weight decay alone, p (1 - lr wd); the warmup's learning
    rates, the MixGRPO window, the evaluation and grid schedule, the held-out prompts, the seed, the shift and the
    guidance scale, the LoRA rank and alpha, the run folder's name."""
    (tmp_path / "eval.txt").write_text("\n".join(SHAPES) + "\n")
    argv = ["--iterations", "3", "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4",
            "--samples-per-update", "4", "--num-steps", "4", "--sde-window", "1", "--window-shift-every", "1",
            "--reward", "zero", "--weight-decay", "0.1", "--learning-rate", "1e-3", "--lr-warmup", "2",
            "--eval-every", "2", "--sample-every", "3", "--eval-prompts", str(tmp_path / "eval.txt"),
            "--eval-max-prompts", "3", "--eval-samples-per-prompt", "2", "--eval-steps", "3", "--shift", "2",
            "--guidance-scale", "2", "--seed", "3", "--lora-rank", "4", "--lora-alpha", "2", "--exp-name", "flags",
            "--no-save"]  # fmt: skip
    sampled, samplers, noises = [], [], []
    sample_prompts, ode_sampler, fixed_noise = (
        evaluator_module.sample_prompts,
        evaluator_module.ode_sampler,
        evaluator_module.fixed_noise,
    )
    monkeypatch.setattr(
        evaluator_module, "sample_prompts", lambda s, m, p, *a: sampled.append(p) or sample_prompts(s, m, p, *a)
    )
    monkeypatch.setattr(evaluator_module, "ode_sampler", lambda *a: samplers.append(a) or ode_sampler(*a))
    monkeypatch.setattr(evaluator_module, "fixed_noise", lambda *a: noises.append(a) or fixed_noise(*a))
    out = tmp_path / "out"
    tape, record = run_flags(D, monkeypatch, out, argv, ["rollout", "draw_prompts"])
    rows = train_rows(record)
    assert [r["iteration"] for r in rows] == [1, 2, 3]  # --iterations 3
    assert [r["charts/window_start"] for r in rows] == [0, 1, 2]  # one step deeper every iteration
    assert [r["charts/lr"] for r in rows] == pytest.approx([5e-4, 1e-3, 1e-3])  # 1e-3 x min(1, step / 2)
    for step in record["steps"]:
        assert step["wd"] == 0.1
        for before, after in zip(step["before"], step["after"]):
            torch.testing.assert_close(after, before * (1 - step["lr"] * 0.1), rtol=0, atol=1e-7)
    assert any(b.abs().sum() > 0 for b in record["steps"][0]["before"])  # lora_A decays (lora_B starts at 0)
    assert [r["iteration"] for r in record["metrics"] if "eval/reward" in r] == [0, 2, 3]
    assert sorted(p.name for p in (record["runs"][-1] / "samples").iterdir()) == [
        "samples_000000.png",
        "samples_000003.png",
    ]
    subset = [SHAPES[0], SHAPES[0], SHAPES[1], SHAPES[1], SHAPES[3], SHAPES[3]]  # 5 prompts: 0, 5 // 3, 10 // 3
    assert sampled == [subset] * 5  # grid at 0, 3; evaluation at 0, 2, 3
    ((_, _, sigmas, guidance, _),) = samplers
    torch.testing.assert_close(sigmas, torch.tensor([1.0, 0.8, 0.5, 0.0]))  # 2 s / (1 + s) at s = 1, 2/3, 1/3, 0
    assert guidance == 2 and all(n[0] == 3 for n in noises)
    torch.testing.assert_close(tape.calls["rollout"][0][0][5], torch.tensor(SHIFT2_4))
    assert {g for g, _, _ in record["velocity"]} == {2.0}
    assert [c[0][2] for c in tape.calls["draw_prompts"]] == [3, 3, 3]  # the seed keys the prompt draw
    assert record["runs"][-1].name.startswith("flags__3__")
    layers = [m for m in record["model"].transformer.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert layers and all(m.lora_A["default"].weight.shape[0] == 4 and m.scaling["default"] == 0.5 for m in layers)


def test_branchgrpo_main_applies_the_tree_and_batch_flags(monkeypatch, tmp_path):
    """Two trees of 5 steps with one split into 3 children (3 leaves each), one per optimizer step, nodes 2 at a time, advantages
    clipped at 0.3, prompts from a file."""
    (tmp_path / "train.txt").write_text("\n".join(SHAPES[:2]) + "\n")
    argv = ["--iterations", "1", "--trees-per-device", "2", "--trees-per-update", "1", "--num-steps", "5",
            "--num-splits", "1", "--branch-factor", "3", "--rollout-batch-size", "2", "--adv-clip-max", "0.3",
            "--prompts", str(tmp_path / "train.txt"), *QUIET]  # fmt: skip
    tape, record = run_flags(
        B, monkeypatch, tmp_path / "out", argv, ["tree_advantages", "trained_edges", "draw_prompts"]
    )
    (row,) = train_rows(record)
    assert row["tree/rollout_forwards_per_leaf"] == pytest.approx((1 + 3 + 3 + 3 + 3) / 3)
    rollout_rows = [n for _, n, grad in record["velocity"] if not grad]
    assert rollout_rows == [1, 2, 1, 2, 1, 2, 1, 2, 1] * 2  # per tree: the root, then 3 nodes a depth, 2 at a time
    assert len(record["steps"]) == 2  # 2 trees, 1 per optimizer step
    in_training = tape.calls["trained_edges"][1:]  # the first: the banner's count, on dummy advantages
    assert len(in_training) == len(tape.calls["tree_advantages"]) == 2
    free = []  # each group's advantages without the clip
    for (a, kw, out), (targs, _, _) in zip(tape.calls["tree_advantages"], in_training):
        assert kw["adv_clip_max"] == 0.3 and out is targs[2]  # what trained_edges (and the loss) get
        free.append(B.tree_advantages(*a, **(kw | {"adv_clip_max": math.inf})))
        for unclipped, clipped in zip(free[-1], out):
            assert clipped.flatten().tolist() == pytest.approx(
                [max(-0.3, min(0.3, x)) for x in unclipped.flatten().tolist()]
            )
    assert any(a.abs().max() > 0.3 for adv in free for a in adv)  # the clip acts
    assert tape.calls["draw_prompts"][0][0][0] == SHAPES[:2]


def test_vgrpo_main_applies_the_batch_and_advantage_flags(monkeypatch, tmp_path):
    argv = ["--iterations", "1", "--samples-per-device", "8", "--group-size", "4", "--rollout-batch-size", "4",
            "--train-batch-size", "2", "--samples-per-update", "4", "--num-steps", "4", "--n-mc", "2",
            "--advantage-aggregation", "sum", "--reward", "shapes:1,verifier:0.5", "--adv-clip-max", "0.5",
            "--adv-soft-clip", "2", "--kl-beta", "0.1", "--kl-ref", "behaviour", "--clip-range", "0.01",
            *QUIET]  # fmt: skip
    tape, record = run_flags(
        V, monkeypatch, tmp_path, argv, ["rollout", "surrogate", "combined_advantages", "policy_loss"]
    )
    assert [len(c[0][3]) for c in tape.calls["rollout"]] == [4, 4]  # --rollout-batch-size 4 of 8
    shapes = [(tuple(c[0][4].shape), c[2][0].requires_grad) for c in tape.calls["surrogate"]]
    assert shapes == [((2, 2), False)] * 4 + [((2, 2), True)] * 4  # 2 images x 2 pairs, behaviour then training
    assert len(record["steps"]) == 2
    ((scores, weights), flags, _) = tape.calls["combined_advantages"][0]
    assert weights == {"sum": 1.0} and list(scores) == ["sum"]
    assert (flags["group_size"], flags["adv_clip_max"], flags["adv_soft_clip"]) == (4, 0.5, 2.0)
    assert all((kw["clip_range"], kw["kl_beta"]) == (0.01, 0.1) for _, kw, _ in tape.calls["policy_loss"])
    (row,) = train_rows(record)
    assert row["perf/trained_pairs_per_image"] == 2 and row["perf/nfe_per_image"] == 4 + 2 * 2


def test_rlr_main_applies_the_estimator_flags(monkeypatch, tmp_path):
    """Groups of 2, one perturbation block of scale 0.01, DCoT prompts per third of the steps, the flow schedule
    from --shift, --sde-type and --noise-level."""
    lines = [(f"a {c} circle on a blue background", f"a {c} square on a blue background",
              f"a {c} circle on a white background", f"a {c} triangle on a blue background")
             for c in ("red", "green")]  # fmt: skip
    (tmp_path / "dcot.tsv").write_text("".join("\t".join(line) + "\n" for line in lines))
    argv = ["--iterations", "1", "--samples-per-device", "4", "--group-size", "2", "--rollout-batch-size", "2",
            "--num-steps", "4", "--terms", "fo+ho+zo", "--subchain-stage", "any", "--zo-scale", "0.01",
            "--zo-perturbations", "1", "--dcot-prompts", str(tmp_path / "dcot.tsv"), "--shift", "2",
            "--sde-type", "dance", "--noise-level", "0.5", *QUIET]  # fmt: skip
    names = ["term_weights", "zo_noise", "add_zo_grad", "subchain_log_prob", "make_schedule"]
    tape, record = run_flags(R, monkeypatch, tmp_path / "out", argv, names)
    ((r, block, zo_mask, n_blocks), flags, (w_ho, _, _, _)) = tape.calls["term_weights"][0]
    assert flags["group_size"] == 2 and n_blocks == 1 and block.tolist() == [0, 0, 0, 0]
    torch.testing.assert_close(w_ho, torch.stack([r[0] - r[1], r[1] - r[0], r[2] - r[3], r[3] - r[2]]))
    assert tape.calls["zo_noise"] and all(c[0][2] == 0.01 for c in tape.calls["zo_noise"])
    assert tape.calls["add_zo_grad"] and all(c[0][3] == 0.01 for c in tape.calls["add_zo_grad"])
    assert [c[0][1].shape[0] for c in tape.calls["subchain_log_prob"]] == [2, 2]  # 2 chunks of 2
    sched = tape.calls["make_schedule"][0][2]
    torch.testing.assert_close(sched["sigmas"], torch.tensor(SHIFT2_4))
    torch.testing.assert_close(sched["g"], torch.tensor([0.5, 0.5, 0.5, 0.0]))
    prompts, *stages = record["encode"][:4]
    by_prompt = {line[0]: line[1:] for line in lines}
    assert len(prompts) == 4 and set(prompts) <= set(by_prompt)
    assert stages == [[by_prompt[p][s] for p in prompts] for s in range(3)]


def test_evaluate_applies_shift_guidance_seed_and_grid_prompts(monkeypatch, tmp_path):
    samplers, noises, grids = [], [], []
    ode_sampler, fixed_noise, report = E.ode_sampler, E.fixed_noise, E.report
    monkeypatch.setattr(E, "ode_sampler", lambda *a: samplers.append(a) or ode_sampler(*a))
    monkeypatch.setattr(E, "fixed_noise", lambda *a: noises.append(a) or fixed_noise(*a))
    monkeypatch.setattr(E, "report", lambda *a, **kw: grids.append(a[6]) or report(*a, **kw))
    argv = ["--num-steps", "2", "--samples-per-prompt", "2", "--max-prompts", "4", "--batch-size", "4", "--reward",
            "shapes", "--grid-prompts", "3", "--seed", "5", "--shift", "2", "--guidance-scale", "2", "--out",
            str(tmp_path / "eval")]  # fmt: skip
    E.main(tyro.cli(E.EvalArgs, args=argv))
    ((_, _, sigmas, guidance, _),) = samplers
    torch.testing.assert_close(sigmas, torch.tensor([1.0, 2 / 3, 0.0]))  # 2 s / (1 + s) at s = 1, 1/2, 0
    assert guidance == 2 and [n[0] for n in noises] == [5]
    assert grids == [[0, 2, 4]]  # prompts 0, 4 // 3, 8 // 3 of 4, each one's first of 2 samples


def test_branchgrpo_num_steps_four_without_pruning_is_accepted():
    """The window is checked only where it is used (depth and mix pruning)."""
    B.resolve_and_check(B.Args(num_steps=4, num_splits=1))
    with pytest.raises(InputError, match=r"--window must be in \[1, 3\]"):
        B.resolve_and_check(B.Args(num_steps=4, num_splits=1, pruning="mix"))


# ---------------------------------------------------------------- diffusionnft.py
def test_diffusionnft_shift_and_euler_solver_by_hand():
    """--shift 2 warps the grid as the other scripts'; --solver euler integrates dx/ds = v: with v = x each step
    multiplies x by 1 + (s' - s), while the default DPM-Solver-2 lands elsewhere."""
    from contextlib import nullcontext

    import diffusionnft as N

    sigmas = N.sigma_schedule(4, 2.0)
    torch.testing.assert_close(sigmas, torch.tensor(SHIFT2_4))
    model = types.SimpleNamespace(velocity=lambda denoiser, x, sigma, cond, guidance_scale: x)
    x = torch.ones(2, 3)
    euler = N.rollout(model, None, {}, x, sigmas, "euler", 1.0, nullcontext)
    # 1 + (s' - s) at 1 -> 6/7 -> 2/3 -> 2/5 -> 0: 6/7, 17/21, 11/15, 3/5
    torch.testing.assert_close(euler, torch.full((2, 3), 6 / 7 * 17 / 21 * 11 / 15 * 3 / 5))
    dpm2 = N.rollout(model, None, {}, x, sigmas, "dpm2", 1.0, nullcontext)
    assert (dpm2 - euler).abs().min() > 1e-3


def test_diffusionnft_main_applies_the_sampling_and_training_flags(monkeypatch, tmp_path):
    """8 samples in groups of 4, rolled out 2 at a time with Euler on the shift-2 grid, trained 2 at a time at 2 of
    4 timesteps, 2 optimizer steps; r = 1/2 + clip(A, -0.5, 0.5) by hand; beta 0.5, KL 0.1 and the plain MSE reach
    the loss; the delayed schedule keeps the old policy equal to theta; the weights handed to final/ are the EMA
    with its decay capped at 0.2."""
    import diffusionnft as N

    finals = []
    save_final = Run.save_final

    def recorded_save_final(self, model, prepared, lora):
        finals.append([p.detach().clone() for p in prepared.parameters() if p.requires_grad])
        return save_final(self, model, prepared, lora)

    monkeypatch.setattr(Run, "save_final", recorded_save_final)
    argv = ["--iterations", "1", "--samples-per-device", "8", "--group-size", "4", "--rollout-batch-size", "2",
            "--train-batch-size", "2", "--samples-per-update", "4", "--num-steps", "4", "--timestep-fraction", "0.5",
            "--shift", "2", "--solver", "euler", "--beta", "0.5", "--kl-beta", "0.1", "--adv-clip-max", "0.5",
            "--no-self-normalize", "--old-decay", "delayed", "--old-decay-speed", "40", "--ema-max-decay", "0.2",
            "--learning-rate", "1e-2", *QUIET]  # fmt: skip
    tape, record = run_flags(N, monkeypatch, tmp_path, argv, ["rollout", "nft_advantages", "policy_loss"])
    rollouts = tape.calls["rollout"]
    assert [len(c[0][3]) for c in rollouts] == [2, 2, 2, 2]  # --rollout-batch-size 2 of --samples-per-device 8
    assert all(c[0][5] == "euler" for c in rollouts)
    assert all(torch.equal(c[0][4], torch.tensor(SHIFT2_4)) for c in rollouts)
    prompts = record["encode"][0]
    assert len(prompts) == 8 and all(prompts[k] == prompts[4 * (k // 4)] for k in range(8))  # groups of 4
    ((rewards_in,), flags, _) = tape.calls["nft_advantages"][0]
    assert flags["group_size"] == 4
    rw = rewards_in.double().tolist()
    mean, means = sum(rw) / 8, [sum(rw[:4]) / 4, sum(rw[4:]) / 4]
    std = math.sqrt(sum((x - mean) ** 2 for x in rw) / 8)
    adv = [(x - means[k // 4]) / (std + 1e-4) for k, x in enumerate(rw)]
    assert max(abs(a) for a in adv) > 0.5  # the clip acts
    r = [0.5 + max(-0.5, min(0.5, a)) for a in adv]  # 1/2 + clip(A, -c, c) / (2 c), c = 0.5
    losses = tape.calls["policy_loss"]
    assert len(losses) == 4 * 2  # 4 micro-batches of 2 x 2 trained timesteps
    order = N.sample_order(8, 0, 0, 0).tolist()  # the samples in the order they are trained (seed 0, iteration 0)
    for k, (a, kw, _) in enumerate(losses):
        assert (kw["beta"], kw["adv_clip_max"], kw["kl_beta"], kw["self_normalize"]) == (0.5, 0.5, 0.1, False)
        assert a[2] is not None
        mine = order[2 * (k // 2) : 2 * (k // 2) + 2]  # micro-batch k // 2
        assert len(a[0]) == 2 and a[6].tolist() == pytest.approx([r[i] for i in mine], abs=1e-6)
        assert all(any(abs(t - s) < 1e-6 for s in SHIFT2_4[:4]) for t in a[5].tolist())  # the shift-2 grid
    assert [n for _, n, grad in record["velocity"] if grad] == [2] * 8
    steps = record["steps"]
    assert len(steps) == 2  # --samples-per-update 4 of 8
    (row,) = train_rows(record)
    assert row["perf/trained_timesteps_per_image"] == 2 and row["perf/nfe_per_image"] == 4 + 2 * 3
    # delayed at 40 x the step count: eta 0 after step 1 (s = 40 < 75: the old policy becomes theta), then 0.0075 x
    # (80 - 75) after step 2, so the old policy stays 0.0375 of the way back (at speed 1: eta 0, distance 0)
    assert row["nft/old_eta"] == pytest.approx(0.0375) and row["nft/old_distance"] > 0
    assert row["nft/ema_decay"] == pytest.approx(0.2)  # min(3 / 12, 0.2)
    # the EMA by hand: decay min(2 / 11, 0.2) = 2/11 after the first step, min(3 / 12, 0.2) = 0.2 after the second
    (final,) = finals
    for p0, p1, p2, f in zip(steps[0]["before"], steps[0]["after"], steps[1]["after"], final):
        ema1 = 2 / 11 * p0 + 9 / 11 * p1
        torch.testing.assert_close(f, 0.2 * ema1 + 0.8 * p2, rtol=0, atol=1e-6)
    assert any(not torch.equal(f, p) for f, p in zip(final, steps[1]["after"]))


def test_diffusionnft_no_ema_saves_the_live_weights(monkeypatch, tmp_path):
    """--no-ema: the weights handed to final/ are those of the last optimizer step, not the EMA (2/11 p0 + 9/11 p1
    after one step)."""
    import diffusionnft as N

    finals = []
    save_final = Run.save_final

    def recorded_save_final(self, model, prepared, lora):
        finals.append([p.detach().clone() for p in prepared.parameters() if p.requires_grad])
        return save_final(self, model, prepared, lora)

    monkeypatch.setattr(Run, "save_final", recorded_save_final)
    argv = ["--iterations", "1", "--samples-per-device", "2", "--group-size", "2", "--rollout-batch-size", "2",
            "--train-batch-size", "2", "--samples-per-update", "2", "--num-steps", "2", "--timestep-fraction", "0.5",
            "--kl-beta", "0", "--no-ema", *QUIET]  # fmt: skip
    _, record = run_flags(N, monkeypatch, tmp_path, argv)
    (step,) = record["steps"]
    (final,) = finals
    assert all(torch.equal(f, p) for f, p in zip(final, step["after"], strict=True))
    assert any(not torch.equal(p0, p1) for p0, p1 in zip(step["before"], step["after"]))  # the EMA would differ
