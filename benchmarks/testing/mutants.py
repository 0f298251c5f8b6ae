"""Do the tests fail when the algorithm is wrong? Each mutant is one deliberate one-line bug of the kind a reader is
most likely to introduce (a sign, a factor of 2, an off-by-one in a window, a wrong baseline, a missing
normalisation); it is applied to a copy of the repository, the tests meant to catch it run there, and the table says
KILLED (they failed) or SURVIVED (they passed: the suite cannot see that bug). The same tests run first on the
unmutated copy, which they must pass.

    python benchmarks/testing/mutants.py                  # every mutant, one after another, one thread: about 20 minutes
    python benchmarks/testing/mutants.py --only 3,7,50-61 # some of them (numbers as the table prints them)

A mutant whose text is not found exactly once is reported as STALE (the code it targets has changed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (file, text, mutated text, tests that must fail, what the bug is)
MUTANTS = [
    ("dancegrpo.py", 'log_prob, ch["log_probs"][:, i], adv[sl],', 'log_prob, ch["log_probs"][:, i], -adv[sl],',
     "tests/test_direction.py -k dancegrpo_update", "DanceGRPO: the advantage's sign flipped where main() passes it"),
    ("dancegrpo.py", 'loss = loss + kl_beta * kl', 'loss = loss - kl_beta * kl',
     "tests/test_direction.py -k kl_term", "DanceGRPO: the KL term's sign flipped"),
    ("dancegrpo.py", "mean = x + d * (v - g**2 / 2 * score)", "mean = x + d * (v - g**2 * score)",
     "tests/test_dancegrpo.py -k sde_step_log_prob", "DanceGRPO: the SDE drift's g^2/2 as g^2"),
    ("dancegrpo.py", "/ (R.std(1, keepdim=True) + 1e-8)", "/ (R.std(1, keepdim=True, correction=0) + 1e-8)",
     "tests/test_dancegrpo.py -k group_advantages", "DanceGRPO: the biased group std"),
    ("dancegrpo.py", "torch.clamp(ratio, 1 - clip_range, 1 + clip_range)",
     "torch.clamp(ratio, 1 - clip_range, 1 + 2 * clip_range)", "tests/test_dancegrpo.py -k policy_loss",
     "DanceGRPO: the upper clip twice as wide"),
    ("dancegrpo.py", "return list(range(start, start + sde_window))", "return list(range(start, start + sde_window + 1))",
     "tests/test_dancegrpo.py -k mixgrpo_window", "MixGRPO: a window one step too long"),
    ("branchgrpo.py", "return x + d * (v - float(g) ** 2 / 2 * score)", "return x + d * (v - float(g) ** 2 * score)",
     "tests/test_branchgrpo.py -k closed_form", "BranchGRPO: the SDE drift's g^2/2 as g^2"),
    ("branchgrpo.py", "log_prob, old_lp, adv, mean, mean_ref,", "log_prob, old_lp, -adv, mean, mean_ref,",
     "tests/test_direction.py -k branchgrpo", "BranchGRPO: the advantage's sign flipped where main() passes it"),
    ("branchgrpo.py", "max(self.splits) + 1 if self.pruning", "max(self.splits) if self.pruning",
     "tests/test_branchgrpo.py -k depth", "BranchGRPO: the depth window starting on the last split"),
    ("branchgrpo.py", "sum(s < i for s in set(self.splits))", "sum(s <= i for s in set(self.splits))",
     "tests/test_branchgrpo.py -k tree_counts", "BranchGRPO: a tree's sizes off by one step"),
    ("branchgrpo.py", ".argmax(-1)  # (P, parents)", ".argmin(-1)  # (P, parents)",
     "tests/test_branchgrpo.py -k width_parent", "BranchGRPO: width pruning keeps the worst child"),
    ("branchgrpo.py", "std = v.std(1, keepdim=True)", "std = v.std(1, keepdim=True, correction=0)",
     "tests/test_branchgrpo.py -k depth_advantages_by_hand", "BranchGRPO: the biased std of the depth advantages"),
    ("branchgrpo.py", "math.sqrt(1 - rho) * own", "math.sqrt(rho) * own",
     "tests/test_branchgrpo.py -k branch_noise", "BranchGRPO: correlated branch noise of the wrong variance"),
    ("vgrpo.py", "values, old_values[sl], adv[sl], x0_hat, x0_ref,", "values, old_values[sl], -adv[sl], x0_hat, x0_ref,",
     "tests/test_direction.py -k vgrpo", "V-GRPO: the advantage's sign flipped where main() passes it"),
    ("vgrpo.py", "value = value / err.detach().abs()", "value = value / err.abs()",
     "tests/test_vgrpo.py -k pair_values_by_hand", "V-GRPO: a gradient through the self-normaliser"),
    ("vgrpo.py", "log_ratio = values.mean(1) - old_values.mean(1)", "log_ratio = (values - old_values).mean(1) * 2",
     "tests/test_vgrpo.py -k averages_pairs", "V-GRPO: the whole-image log-ratio doubled"),
    ("vgrpo.py", "(x0_hat - x0_prev) / (2 * r)", "(x0_hat - x0_prev) / r",
     "tests/test_vgrpo.py -k dpm_solver", "V-GRPO: DPM-Solver++(2M)'s second-order term doubled"),
    ("rlr.py", "return ((R.sum(1, keepdim=True) - R) / (group_size - 1))",
     "return ((R.sum(1, keepdim=True)) / (group_size))", "tests/test_rlr.py -k unbiased",
     "RLR: a half-order baseline that reads the sample's own reward"),
    ("rlr.py", "g = -(coef * z) / scale**2", "g = (coef * z) / scale**2", "tests/test_rlr.py -k perturbation",
     "RLR: the zero-order term's sign flipped"),
    ("rlr.py", "(1 - alpha_prev - std**2).clamp(min=0)", "(1 - alpha_prev).clamp(min=0)", "tests/test_rlr.py -k ddim",
     "RLR: DDIM's mean without the noise's share"),
    ("rlr.py", "adv_ho = w_ho[rank * S : (rank + 1) * S]", "adv_ho = -w_ho[rank * S : (rank + 1) * S]",
     "tests/test_direction.py -k rlr", "RLR: the half-order weights' sign flipped in main()"),
    ("rlr.py", "gb_sum.sum(1)[group] - gb_sum[group, block]", "gb_sum.sum(1)[group]",
     "tests/test_rlr.py -k unbiased", "RLR: a zero-order baseline that reads the sample's own block"),
    ("common/models/base.py", "return out_uncond + scale * (out_cond - out_uncond)",
     "return out_uncond + 1.001 * scale * (out_cond - out_uncond)", "tests/test_video.py -k stock",
     "CFG 0.1% too strong (Wan2.1, SD3)"),
    ("common/rewards.py", "total = total + w * r", "total = total + r", "tests/test_rewards.py -k composite_weights",
     "rewards: a component's weight ignored"),
    ("branchgrpo.py", 'loss = loss + kl_beta * kl', 'loss = loss - kl_beta * kl',
     "tests/test_direction.py -k branchgrpo_kl", "BranchGRPO: the KL term's sign flipped"),
    ("vgrpo.py", 'loss = loss + kl_beta * kl', 'loss = loss - kl_beta * kl',
     "tests/test_direction.py -k vgrpo_kl", "V-GRPO: the KL term's sign flipped"),
    ("dancegrpo.py", "len(grid) - 1 + n_train * (2 if args.kl_beta > 0 else 1)", "len(grid) - 1 + n_train",
     "tests/test_counts.py -k dancegrpo", "DanceGRPO: the KL reference's forwards left out of the logged count"),
    ("branchgrpo.py", '"tree/rollout_forwards_per_leaf": forwards / n_leaves',
     '"tree/rollout_forwards_per_leaf": (forwards - 1) / n_leaves', "tests/test_counts.py -k branchgrpo",
     "BranchGRPO: the root's forward left out of the logged count"),
    ("dancegrpo.py", "adv = sum(w * group_advantages(scores[name], group_size) for name, w in weights.items() if w != 0)",
     "adv = sum(group_advantages(scores[name], group_size) for name, w in weights.items() if w != 0)",
     "tests/test_aggregation.py -k group_aggregations", "per-reward advantages: the reward weights left out"),
    ("common/rewards.py", "return (head(features).squeeze(-1) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD",
     "return head(features).squeeze(-1) - IMAGEREWARD_MEAN", "tests/test_imagereward.py -k matches_the_package",
     "ImageReward: the score not divided by its std"),
    ("common/rewards.py", "served = {name: tuple(torch.cat(x) for x in zip(*chunks))",
     "served = {name: tuple(torch.cat(x[::-1]) for x in zip(*chunks))",
     "tests/test_remote.py -k arrive", "served rewards: the chunks' scores put back in the wrong order"),
    # a parameter, schedule or statistic applied wrongly at a non-default value
    ("dancegrpo.py", "start = min(iteration // window_shift_every,", "start = min((iteration + 1) // window_shift_every,",
     "tests/test_flags_applied.py -k dancegrpo_main_applies_the_run_flags", "MixGRPO: the window shifted one iteration early"),
    ("dancegrpo.py", "n_train = max(1, int(len(sde_idx) * args.timestep_fraction))",
     "n_train = max(1, math.ceil(len(sde_idx) * args.timestep_fraction))",
     "tests/test_flags_applied.py -k dancegrpo_main_applies_the_sampling", "DanceGRPO: trained steps rounded up"),
    ("dancegrpo.py", "min(1.0, (run.optimizer_steps + 1) / max(1, args.lr_warmup))",
     "min(1.0, run.optimizer_steps / max(1, args.lr_warmup))",
     "tests/test_flags_applied.py -k dancegrpo_main_applies_the_run_flags", "the learning-rate warmup one step late"),
    ("branchgrpo.py", "latent_shape, 1 / (1 + tree.branch_s)))", "latent_shape, 1 / (2 + tree.branch_s)))",
     "tests/test_flags_applied.py -k branch_s", "BranchGRPO: the sibling correlation main() derives from --branch-s"),
    ("branchgrpo.py", "/ temperature, -1)", "* temperature, -1)",
     "tests/test_flags_applied.py -k fusion_gamma", "BranchGRPO: path fusion multiplies by the temperature"),
    ("branchgrpo.py", "int(a.shape[1] * tree.width_keep_ratio)", "int(a.shape[1] * tree.width_keep_ratio / 2)",
     "tests/test_flags_applied.py -k width_keep_ratio", "BranchGRPO: width pruning keeps half the asked share"),
    ("vgrpo.py", "return adv_soft_clip * torch.tanh(adv / adv_soft_clip)", "return torch.tanh(adv / adv_soft_clip)",
     "tests/test_flags_applied.py -k soft_clip", "V-GRPO: the soft clip without its scale eta"),
    ("vgrpo.py", ".square().flatten(2).mean(2).mean(1)  # (B,)", ".square().flatten(2).sum(2).mean(1)  # (B,)",
     "tests/test_flags_applied.py -k vgrpo_kl_beta", "V-GRPO: D_simple summed over the latent dimensions"),
    ("dancegrpo.py", "/ (2 * std.flatten() ** 2)  # (B,)", "/ (std.flatten() ** 2)  # (B,)",
     "tests/test_dancegrpo.py -k policy_loss", "DanceGRPO: the Gaussian KL twice too large (--kl-beta doubled)"),
    ("rlr.py", "g = -(coef * z) / scale**2", "g = -(coef * z) / scale",
     "tests/test_flags_applied.py -k zo_scale", "RLR: the ZO term divided by sigma, not sigma^2"),
    ("rlr.py", "((R.sum(1, keepdim=True) - R) / (group_size - 1))", "((R.sum(1, keepdim=True) - R) / group_size)",
     "tests/test_flags_applied.py -k group_size_two", "RLR: the leave-one-out baseline over G, not G - 1"),
    ("common/rewards.py", "w = float(weight)", "w = abs(float(weight))",
     "tests/test_rewards.py -k parse_rewards_valid", "rewards: a negative weight taken as positive"),
    ("common/remote.py", "RETRIED = (429, 500, 502, 503, 504)", "RETRIED = (429, 500, 503, 504)",
     "tests/test_server.py -k retries", "served rewards: a 502 not retried"),
    ("common/logs.py", '(values.max() if "max" in name else values.mean())', "values.mean()",
     "tests/test_runs.py -k summarize", "logs: a max figure (ratio_max_dev) averaged"),
    ("common/evaluate.py", "diff.std().item() / math.sqrt(len(diff))", "diff.std().item()",
     "tests/test_evaluate_stats.py", "evaluate: the standard deviation reported as the paired standard error"),
    ("common/evaluate.py", "v.view(-1, S).mean(1)", "v.view(S, -1).mean(0)",
     "tests/test_evaluate_stats.py", "evaluate: per-prompt means over samples of different prompts"),
    ("common/sampling.py", "keyed_randn(shape, seed, tag, start + j)", "keyed_randn(shape, seed, tag, start)",
     "tests/test_evaluate_stats.py", "evaluation noise: every sample of a batch from the same noise (diversity 0)"),
    ("dancegrpo.py", "for name, w in weights.items() if w != 0)", "for name, w in weights.items() if w > 0)",
     "tests/test_aggregation.py -k group_aggregations", "advantages: a negative reward weight dropped"),
    # DiffusionNFT: the implicit policies, r, the statistics, the schedules, the old policy and the EMA
    ("diffusionnft.py", "v_neg = (1 + beta) * v_old - beta * v_theta", "v_neg = (1 - beta) * v_old + beta * v_theta",
     "tests/test_diffusionnft.py -k closed_form", "DiffusionNFT: the negative policy the same as the positive one"),
    ("diffusionnft.py", "loss = adv_clip_max * (r * pos + (1 - r) * neg) / beta",
     "loss = adv_clip_max * ((1 - r) * pos + r * neg) / beta", "tests/test_diffusionnft.py -k update_lowers",
     "DiffusionNFT: r weighting the negative policy"),
    ("diffusionnft.py", "sq / err.detach().abs().mean(1)", "sq / err.abs().mean(1)",
     "tests/test_diffusionnft.py -k detached", "DiffusionNFT: a gradient through the adaptive weight"),
    ("diffusionnft.py", "/ (R.std(correction=0) + 1e-4)", "/ (R.std() + 1e-4)",
     "tests/test_diffusionnft.py -k global_population_std", "DiffusionNFT: the unbiased std of the rewards"),
    ("diffusionnft.py", "adv.clamp(-clip_max, clip_max) / clip_max / 2 + 0.5",
     "adv.clamp(-clip_max, clip_max) / clip_max + 0.5", "tests/test_diffusionnft.py -k optimality_probability",
     "DiffusionNFT: r twice as far from 1/2"),
    ("diffusionnft.py", "return min(0.001 * step, 0.5)", "return min(0.001 * step, 0.9)",
     "tests/test_diffusionnft.py -k schedules_by_hand", "DiffusionNFT: the linear old-policy decay capped at 0.9"),
    ("diffusionnft.py", "min(0.0075 * (step - 75), 0.999)", "min(0.0075 * (step - 74), 0.999)",
     "tests/test_diffusionnft.py -k schedules_by_hand", "DiffusionNFT: the delayed schedule one step early"),
    ("diffusionnft.py", "t.lerp_(s.detach(), 1 - decay)", "t.lerp_(s.detach(), decay)",
     "tests/test_diffusionnft.py -k soft_update", "DiffusionNFT: the soft update's weights swapped"),
    ("diffusionnft.py", "v_theta, v_old, v_ref, x0, x_t, t, r[sl.to(device)],",
     "v_theta, v_old, v_ref, x0, x_t, t, 1 - r[sl.to(device)],",
     "tests/test_flags_applied.py -k diffusionnft_main_applies", "DiffusionNFT: r flipped where main() passes it"),
    ("diffusionnft.py", "eta = old_decay(run.optimizer_steps, args.old_decay, args.old_decay_speed)",
     "eta = old_decay(run.optimizer_steps - 1, args.old_decay, args.old_decay_speed)", "tests/test_diffusionnft.py -k end_to_end",
     "DiffusionNFT: the old policy's soft update one step behind"),
    ("diffusionnft.py", "ema_decay(run.optimizer_steps, args.ema_max_decay))  # the evaluation EMA",
     "ema_decay(run.optimizer_steps + 1, args.ema_max_decay))  # the evaluation EMA",
     "tests/test_flags_applied.py -k diffusionnft_main_applies", "DiffusionNFT: the EMA's decay one step ahead"),
    ("diffusionnft.py", "accelerator.register_for_checkpointing(Carried(old=old_params, ema=ema))",
     "Carried(old=old_params, ema=ema)", "tests/test_diffusionnft.py -k preempted",
     "DiffusionNFT: the old adapter and the EMA left out of the checkpoint"),
    # the 2026 variants of dancegrpo.py (docs/dancegrpo.md)
    ("dancegrpo.py", "std = sigma_next * torch.sin(eta * math.pi / 2)", "std = sigma_next * torch.sin(eta * math.pi)",
     "tests/test_dancegrpo_methods.py -k cps", "CPS: the noise's std at sin(eta pi), not sin(eta pi / 2)"),
    ("dancegrpo.py", "mean = (1 - sigma_next) * x0_hat + torch.sqrt(sigma_next**2 - std**2) * x1_hat",
     "mean = (1 - sigma_next) * x0_hat + sigma_next * x1_hat", "tests/test_dancegrpo_methods.py -k cps",
     "CPS: the noise prediction's coefficient without the std taken out (not coefficient-preserving)"),
    ("dancegrpo.py", "log_ratio = std * (log_ratio + kl_old)", "log_ratio = std * log_ratio",
     "tests/test_dancegrpo_methods.py -k guard", "GRPO-Guard: the ratio-mean bias not added back"),
    ("dancegrpo.py", "surrogate = surrogate / dt", "surrogate = surrogate / dt**0.5",
     "tests/test_dancegrpo_methods.py -k guard", "GRPO-Guard: the reweighting by 1/sqrt(dt), not 1/dt"),
    ("dancegrpo.py", "(((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0)))", "(((ratio > 1) & (adv > 0)))",
     "tests/test_dancegrpo_methods.py -k dppo", "Flow-DPPO: a high-KL sample with A < 0 moving away kept"),
    ("dancegrpo.py", "masked = (kl_old >= kl_mask_threshold) &", "masked = (kl_old <= kl_mask_threshold) &",
     "tests/test_dancegrpo_methods.py -k dppo", "Flow-DPPO: the mask on the low-KL samples"),
    ("dancegrpo.py", "n = max(int((T - last) * compress), 2)", "n = max(int((T - last - 1) * compress), 2)",
     "tests/test_dancegrpo_methods.py -k post_window", "MixGRPO-Flash: one step fewer counted after the window"),
    ("dancegrpo.py", "x = mean = dpm_solver_2m_step(x, x0_hat, x0_prev, s_prev, s, s_next)",
     "x = mean = dpm_solver_2m_step(x, x0_hat, None, s_prev, s, s_next)", "tests/test_dancegrpo_methods.py -k dpm",
     "MixGRPO-Flash: DPM-Solver++ without its history (first order after the window)"),
    ("diffusionnft.py", "loss = adv_clip_max * (r * pos", "loss = 5.0 * (r * pos",
     "tests/test_diffusionnft.py -k closed_form", "DiffusionNFT: the NFT term's factor a constant 5, not --adv-clip-max"),
    ("diffusionnft.py", 'generator=rng(seed, iteration, "shuffle", rank)', 'generator=rng(seed, 0, "shuffle", rank)',
     "tests/test_diffusionnft.py -k shuffled", "DiffusionNFT: the same sample order at every iteration"),
]  # fmt: skip


def copy_repo(dest: Path) -> None:
    """The tracked files and the untracked ones git does not ignore, without .venv and run folders."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    ).stdout.splitlines()
    for rel in listed:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def pytest(tests: str, work: Path) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests.split()]
    return subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env).returncode


def run_mutant(n: int, mutant, work: Path) -> tuple[str, float]:
    path, old, new, tests, _ = mutant
    target = work / path
    original = target.read_text()
    if original.count(old) != 1:
        return "STALE", 0.0
    t0 = time.perf_counter()
    if pytest(tests, work) != 0:  # the tests must pass on the code as it is, or a failure says nothing
        return "TESTS FAIL UNMUTATED", time.perf_counter() - t0
    target.write_text(original.replace(old, new))
    code = pytest(tests, work)
    target.write_text(original)
    if code == 5:  # no test selected: the mutant's tests are gone
        return "NO TEST", time.perf_counter() - t0
    return ("KILLED" if code != 0 else "SURVIVED"), time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="mutant numbers (1-based), comma-separated, or ranges: 3,7,50-61")
    a = parser.parse_args()
    ranges = [[int(n) for n in k.split("-")] for k in a.only.split(",")] if a.only else [[1, len(MUTANTS)]]
    chosen = [n for r in ranges for n in range(r[0], r[-1] + 1)]  # "3,7" or "50-61"
    rows = ["| # | mutant | file | tests | result |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        copy_repo(work)
        for n in chosen:
            m = MUTANTS[n - 1]
            result, seconds = run_mutant(n, m, work)
            rows.append(f"| {n} | {m[4]} | {m[0]} | `{m[3]}` | {result} |")
            print(f"{n:2d} {result:8s} {seconds:5.0f} s  {m[4]}", flush=True)
    print("\n".join(rows))
    survived = sum(r.endswith("| SURVIVED |") for r in rows)
    print(f"{len(rows) - 2} mutants, {survived} survived")


if __name__ == "__main__":
    main()
