"""V-GRPO against DiffusionNFT on ShapesBench: optimizer steps to a held-out reward, both on the same weights.

    python benchmarks/claims/nft_vs_vgrpo.py --jobs 2    # 3 seeds x 8 runs: about 7 h of one core (3.5-4 h on 2 idle
                                                  # cores): docs/nft_vs_vgrpo.md, .png and .json
    python benchmarks/claims/nft_vs_vgrpo.py --quick     # smoke test: seed 0, 3 iterations, a small evaluation; the same
                                                  # files in benchmarks/claims/nft_vs_vgrpo_out/quick/

V-GRPO's paper (arXiv 2604.23380, Sec. 5) reports that it reaches in about 580 gradient steps what DiffusionNFT
(arXiv 2509.16117) needs about 1.7k for on SD3.5-M. This benchmark measures the same thing on ShapesBench with the
learned reward: each method at two settings, each evaluated on two kinds of weights, every iteration, over seeds.
It replaces the head-to-head of benchmarks/claims/compare.py (docs/results.md), which evaluated every 7 iterations, compared
DiffusionNFT's EMA weights with V-GRPO's live ones and left out the runs that missed its threshold.

Settings (SETTINGS; the batch stays ShapesBench's, 8 prompts x 8 images per iteration, for both methods):
  default  each script at its ShapesBench defaults (2 optimizer steps of 32 images per iteration).
  paper    each paper's settings, as far as they apply at this scale:
    V-GRPO (arXiv 2604.23380, appendix: its SD3.5-M stage 1, the human-preference stage whose continuous reward is
      the closest to ShapesBench's learned one; run.sh's vgrpo-sd35-8gpu has the same values):
      --samples-per-update 64  one optimizer step per iteration (fully on-policy: the ratio is 1, so the ratio clip
                               and a KL to the behaviour policy do nothing);
      --n-mc 4                 4 ELBO pairs per image (its N_MC ablation: 2 fails, 4 is the balance, 8 adds little;
                               the inferred 10 of its GenEval / OCR stages is for coarse rewards, not this one);
      --adv-soft-clip 3        the tanh soft clip eta = 3 of that stage;
      --kl-beta 0              no KL term in that stage.
      The pairs stay on the rollout grid (--pair-times grid, as the run.sh recipe): the paper's text describes equal
      intervals of (0, 1), a write-up of its code the sampler's grid (docs/vgrpo.md, open choice 2).
    DiffusionNFT (arXiv 2509.16117, App. C: the five-stage SD3.5-M curriculum V-GRPO compares against, whose bulk
      is the multi-reward stage; its official config sd3_multi_reward, NVlabs/DiffusionNFT config/nft.py):
      --samples-per-update 64  one optimizer step per iteration;
      --timestep-fraction 0.99 9 of the 10 grid timesteps trained per image (the default trains 4);
      --beta 0.1               the NFT beta of the multi-reward (and OCR) config (default 1);
      --old-decay linear       that config's old-policy schedule eta = min(0.001 s, 0.5) after s steps;
      --kl-beta 1e-4           its KL to the base model (the default too).
      --old-decay-speed 1700/N the schedule at the paper's pace relative to the run's length: its eta reaches the
                               cap of 0.5 after 500 of about 1700 steps (29% of training, counting the steps
                               through the curriculum), but an N-step run at speed 1 would end at eta 0.001 N (0.03
                               at 30 steps), on-policy all along; read at 1700 / N x the step count, the cap comes
                               after 29% of the run here too (the run logs eta as nft/old_eta).
  Shared by both: LoRA r32 alpha 64, lr 3e-4 with 10 warmup steps, 10-step deterministic rollouts, groups of 8 (the
  papers: 24; CPU budget), 30 iterations (--iterations), so 60 optimizer steps at the defaults and 30 at the papers'.

Weights (WEIGHTS): "live" evaluates the trained weights (DiffusionNFT with --no-ema), "EMA" an EMA of them with the
decay min((1 + s) / (10 + s), 0.9) after s steps (DiffusionNFT's default, V-GRPO with --ema, which copies it). The
EMA never feeds back into training, so live and EMA runs of a method train alike and differ only in what is
evaluated.

Evaluation: every iteration (and before the first), the held-out learned reward on 48 prompts x --eval-samples
samples (4), Euler 20 steps, from noise keyed on the seed alone: every run of a seed sees the same prompts and noise.

Statistics, per setting, weights, reward threshold and method. A seed's thresholds are its reward before training
(the same for every run of the seed: the same base weights and noise) plus each of --gains (0.02, 0.04 and 0.06:
the papers' settings gained about 0.06 in 30 iterations in compare.py's runs). Steps to a threshold:
the optimizer steps at the first evaluation whose reward is >= the threshold; a run that never reaches it is
censored, written >N (N its last step count), and counted, never dropped. Over the seeds: the median, and the range
[min, max] as its interval: for n seeds, the probability that the range misses the true median of a continuous
distribution is 2 x 0.5^n, so it is a 75% confidence interval for 3 seeds (94% for 5), with no assumption on the
distribution, and censored values only make its upper end >N. The step ratio is DiffusionNFT's median over V-GRPO's
(a bound, > or <, when one median is censored). Wall time per optimizer step: each run's median training time per
iteration (its perf/iteration_s, evaluations excluded) over its optimizer steps per iteration, the ratio DiffusionNFT / V-GRPO of the means
over seeds with the range of the ratios seed by seed.

Runs keep their folders under <out>/runs/ and their logs under <out>/logs/ (benchmarks/claims/training_runs.py's run_one):
rerunning the command skips finished runs and resumes interrupted ones from their last checkpoint (every 5
iterations). --jobs 2 runs two at a time. Each run is a child process of this file (--train SCRIPT ... -- FLAGS),
which adds the evaluation flags last, so that they override run_one's.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.claims.training_runs import curves, run_one  # noqa: E402

LABELS = {"vgrpo": "V-GRPO", "diffusionnft": "DiffusionNFT"}
SETTINGS = {  # setting -> (label, method -> flags)
    "default": ("ShapesBench defaults", {"vgrpo": [], "diffusionnft": []}),
    "paper": (
        "papers' settings",
        {
            "vgrpo": ["--samples-per-update", "64", "--n-mc", "4", "--adv-soft-clip", "3", "--kl-beta", "0"],
            "diffusionnft": [
                *("--samples-per-update", "64", "--timestep-fraction", "0.99", "--beta", "0.1"),
                *("--old-decay", "linear", "--kl-beta", "1e-4"),
            ],
        },
    ),
}
WEIGHTS = {  # weights -> (label, method -> flags)
    "live": ("live weights", {"vgrpo": [], "diffusionnft": ["--no-ema"]}),
    "ema": ("EMA weights", {"vgrpo": ["--ema"], "diffusionnft": []}),
}
PAPER_NFT_STEPS = 1700  # DiffusionNFT's gradient steps in the comparison (arXiv 2604.23380, Sec. 5)
PAPER_STEPS_PER_ITERATION = 1  # --samples-per-update 64 of the 64 samples of an iteration, in both paper settings
GAINS = [0.02, 0.04, 0.06]  # reward thresholds over the start: the papers' settings gain about 0.06 in 30 iterations


def configs() -> dict:
    """key -> (method, setting, weights) of every run kind, seeds apart."""
    return {f"{m}_{s}_{w}": (m, s, w) for s in SETTINGS for w in WEIGHTS for m in LABELS}


def flags_of(method: str, setting: str, weights: str, iterations: int) -> list[str]:
    """The script's flags of one run kind (seed and evaluation apart): with DiffusionNFT's paper setting, its
    old-policy schedule at the paper's pace relative to the run's length (the paper's steps over this run's)."""
    speed = PAPER_NFT_STEPS / (iterations * PAPER_STEPS_PER_ITERATION)
    pace = ["--old-decay-speed", f"{speed:.6g}"] if (method, setting) == ("diffusionnft", "paper") else []
    return [*SETTINGS[setting][1][method], *pace, *WEIGHTS[weights][1][method]]


def describe(key: str, iterations: int) -> str:
    """The command of one run kind as the report shows it: the script and its flags."""
    method, setting, weights = configs()[key]
    return " ".join([f"{method}.py", *flags_of(method, setting, weights, iterations)])


def child_argv(key: str, iterations: int, eval_samples: int, eval_prompts: int) -> list[str]:
    """run_one's argv of one run kind: this file as the child (--train) and the script's flags after `--`."""
    method, setting, weights = configs()[key]
    return [
        *("benchmarks/claims/nft_vs_vgrpo.py", "--train", f"{method}.py"),
        *("--eval-samples", str(eval_samples), "--eval-prompts", str(eval_prompts), "--"),
        *flags_of(method, setting, weights, iterations),
        *("--iterations", str(iterations)),
    ]


def train(argv: list[str]) -> None:
    """The child process of one run: `--train SCRIPT [--eval-samples N] [--eval-prompts P] -- FLAGS`. Runs SCRIPT's
    main() on FLAGS with the evaluation every iteration (N samples of P held-out prompts) added last, so that they
    override what run_one passes."""
    parser = argparse.ArgumentParser(prog="nft_vs_vgrpo.py --train", allow_abbrev=False)
    parser.add_argument("script", choices=["vgrpo.py", "diffusionnft.py"])
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--eval-prompts", type=int, default=48)
    if "--" not in argv:
        parser.error("the script's flags come after `--`")
    a = parser.parse_args(argv[: argv.index("--")])
    if a.eval_samples < 1 or a.eval_prompts < 1:
        parser.error("--eval-samples and --eval-prompts must be >= 1")
    module = importlib.import_module(Path(a.script).stem)
    tail = ["--eval-every", "1", "--eval-samples-per-prompt", str(a.eval_samples)]
    sys.argv = [a.script, *argv[argv.index("--") + 1 :], *tail, "--eval-max-prompts", str(a.eval_prompts)]
    from common.flags import cli

    cli(module.main, module.Args)


# ---------------------------------------------------------------------------------------------------
# Statistics: steps to a threshold (censored), the median and its order-statistic interval, the ratios
# ---------------------------------------------------------------------------------------------------
def steps_to(evals: list[dict], target: float) -> tuple[float, bool]:
    """(optimizer steps at the first evaluation whose reward_mean >= target, False), or (the steps at the last
    evaluation, True) when none reaches it: censored, the true value > those steps."""
    for e in evals:
        if e["reward_mean"] >= target:
            return e["steps"], False
    return evals[-1]["steps"], True


def order_key(v: tuple[float, bool]):
    return (v[1], v[0])  # a censored value (> its steps, the run's last) is above every value reached


def summary(values: list[tuple[float, bool]]) -> dict:
    """Median and [min, max] of (steps, censored) over seeds; censored values sort last. An even count's median is
    the mean of the middle two, censored (a lower bound) if either is. coverage: of [min, max] as a confidence
    interval for the median, 1 - 2 x 0.5^n."""
    v = sorted(values, key=order_key)
    n = len(v)
    if n % 2:
        median = v[n // 2]
    else:
        a, b = v[n // 2 - 1], v[n // 2]
        median = ((a[0] + b[0]) / 2, a[1] or b[1])
    return {
        "median": median,
        "low": v[0],
        "high": v[-1],
        "reached": sum(not c for _, c in v),
        "n": n,
        "coverage": 1 - 2 * 0.5**n,
    }


def fmt(v: tuple[float, bool]) -> str:
    return f">{v[0]:g}" if v[1] else f"{v[0]:g}"


def cell(s: dict) -> str:
    """'median [min, max] (reached/n)'."""
    return f"{fmt(s['median'])} [{fmt(s['low'])}, {fmt(s['high'])}] ({s['reached']}/{s['n']})"


def step_ratio(nft: dict, vgrpo: dict) -> str:
    """DiffusionNFT's median steps over V-GRPO's: a number, a bound when one median is censored, n/a when both are."""
    (a, ca), (b, cb) = nft["median"], vgrpo["median"]
    if ca and cb:
        return "n/a"
    if ca:
        return f">{a / b:.2f}"
    if cb:
        return f"<{a / b:.2f}"
    return f"{a / b:.2f}"


def seconds_per_step(c: dict) -> float:
    """Training seconds (evaluations excluded) per optimizer step of one run: its median iteration over its optimizer
    steps per iteration. The median, not the total: an iteration that waited on a paused or shared machine (a resumed
    run's first, or one beside a test run) would weigh in a sum."""
    last = c["evals"][-1]
    return c["s_per_iteration"] * last["iteration"] / last["steps"]


def starts(results: dict, seeds: list[int]) -> dict:
    """seed -> the held-out reward before training (the mean over that seed's runs, which all start alike)."""
    return {
        s: statistics.mean(cs[i]["evals"][0]["reward_mean"] for cs in results.values()) for i, s in enumerate(seeds)
    }


def threshold_rows(results: dict, seeds: list[int], gains: list[float]) -> list[dict]:
    """One row per (setting, weights, gain): the mean threshold, each method's summary and the step ratio."""
    start = starts(results, seeds)
    rows = []
    for s in SETTINGS:
        for w in WEIGHTS:
            for g in gains:
                got = {}
                for m in LABELS:
                    runs = zip(seeds, results[f"{m}_{s}_{w}"])
                    got[m] = summary([steps_to(c["evals"], start[seed] + g) for seed, c in runs])
                rows.append(
                    {
                        "setting": s,
                        "weights": w,
                        "gain": g,
                        "target": statistics.mean(start.values()) + g,
                        **got,
                        "ratio": step_ratio(got["diffusionnft"], got["vgrpo"]),
                    }
                )
    return rows


def time_rows(results: dict) -> list[dict]:
    """One row per (setting, weights): each method's mean seconds per optimizer step, their ratio, the range of the
    seed-by-seed ratios and each method's forwards per image (seed 0's: every seed runs the same count)."""
    rows = []
    for s in SETTINGS:
        for w in WEIGHTS:
            v, n = results[f"vgrpo_{s}_{w}"], results[f"diffusionnft_{s}_{w}"]
            per_seed = [seconds_per_step(b) / seconds_per_step(a) for a, b in zip(v, n)]
            mv, mn = statistics.mean(map(seconds_per_step, v)), statistics.mean(map(seconds_per_step, n))
            rows.append({"setting": s, "weights": w, "vgrpo": mv, "diffusionnft": mn, "ratio": mn / mv})
            rows[-1].update(low=min(per_seed), high=max(per_seed))
            # transformer forwards per image and iteration (rollout, old / reference passes, training): the work,
            # which no load on the machine changes; both methods train the same images per optimizer step
            rows[-1].update(forwards={"vgrpo": v[0]["forwards"], "diffusionnft": n[0]["forwards"]})
    return rows


# ---------------------------------------------------------------------------------------------------
# Report: the figure and the markdown
# ---------------------------------------------------------------------------------------------------
def plot(results: dict, seeds: list[int], gains: list[float], path: Path) -> None:
    """Held-out reward against optimizer steps: a panel per (setting, weights), per method the mean over seeds and a
    min-max band, the thresholds (their mean over seeds) dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = statistics.mean(starts(results, seeds).values())
    fig, axes = plt.subplots(len(SETTINGS), len(WEIGHTS), figsize=(11, 8), sharey=True, squeeze=False)
    for row, s in enumerate(SETTINGS):
        for col, w in enumerate(WEIGHTS):
            ax = axes[row, col]
            for n, m in enumerate(LABELS):
                cs = results[f"{m}_{s}_{w}"]
                k = min(len(c["evals"]) for c in cs)
                xs = [statistics.mean(c["evals"][i]["steps"] for c in cs) for i in range(k)]
                ys = [[c["evals"][i]["reward_mean"] for c in cs] for i in range(k)]
                ax.plot(xs, [statistics.mean(y) for y in ys], color=f"C{n}", label=LABELS[m])
                ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=f"C{n}", alpha=0.2, lw=0)
            for g in gains:
                ax.axhline(start + g, color="grey", ls="--", lw=0.8)
            ax.set_title(f"{SETTINGS[s][0]}, {WEIGHTS[w][0]}", fontsize=10)
            ax.set_xlabel("optimizer steps")
            ax.set_ylabel("held-out learned reward")
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8, title=f"mean, min-max over {len(seeds)} seed(s)", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def threshold_table(results: dict, seeds: list[int], gains: list[float]) -> list[str]:
    """The markdown table of steps to each threshold: a row per (setting, weights, gain)."""
    lines = [
        "| setting | weights | threshold (mean) | V-GRPO steps | DiffusionNFT steps | DiffusionNFT / V-GRPO (medians) |",
        "|---|---|---|---|---|---|",
    ]
    for r in threshold_rows(results, seeds, gains):
        lines.append(
            f"| {SETTINGS[r['setting']][0]} | {WEIGHTS[r['weights']][0]} | +{r['gain']:g} ({r['target']:.3f}) | "
            f"{cell(r['vgrpo'])} | {cell(r['diffusionnft'])} | {r['ratio']} |"
        )
    return lines


def results_section(record: dict) -> list[str]:
    """docs/results.md's section on this comparison, from docs/nft_vs_vgrpo.json's record: how it was made, the steps
    to each threshold, the time per step and the figure; nft_vs_vgrpo.md has the rest (flags, final rewards)."""
    results, seeds, gains = record["curves"], record["seeds"], record["gains"]
    timed = time_rows(results)
    times = ", ".join(
        f"{r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}] ({SETTINGS[r['setting']][0]}, {WEIGHTS[r['weights']][0]})"
        for r in timed
    )
    ratios = [r["ratio"] for r in threshold_rows(results, seeds, gains)]
    plain = sorted(float(r) for r in ratios if r[0].isdigit())  # the others: bounds (">x", "<x") or "n/a"
    spread = (
        f"The step ratio DiffusionNFT / V-GRPO (medians) ranges from {plain[0]:.2f} to {plain[-1]:.2f} over the "
        f"{len(ratios)} rows ({len(ratios) - len(plain)} of them a bound or n/a, from a censored median); the paper's "
        "is about 2.9. "
        if plain
        else ""
    )
    forwards = ", ".join(
        f"{r['forwards']['vgrpo']:g} and {r['forwards']['diffusionnft']:g} ({SETTINGS[r['setting']][0]})"
        for r in timed
        if r["weights"] == "live"  # the weights change what is evaluated, not what trains
    )
    return [
        "## V-GRPO against DiffusionNFT",
        "",
        "V-GRPO's paper (arXiv 2604.23380, Sec. 5) reports reaching in about 580 gradient steps what DiffusionNFT "
        "needs about 1.7k for on SD3.5-M: a step ratio of about 2.9. Here each method runs at its ShapesBench "
        "defaults and at its paper's settings, evaluated every iteration on the same held-out prompts and noise, on "
        "live and on EMA weights alike, over seeds "
        + ", ".join(map(str, seeds))
        + f"; made by `{record['command']}` at {record['commit']}. Optimizer steps to each seed's held-out learned "
        "reward before training + the gain: median [min, max] over the seeds (reached / seeds), >N for a run that "
        "never reached it. The flags, the final rewards and the statistics: [nft_vs_vgrpo.md](nft_vs_vgrpo.md).",
        "",
        *threshold_table(results, seeds, gains),
        "",
        f"{spread}Wall time per optimizer step, DiffusionNFT / V-GRPO [range over seeds]: {times}. Transformer "
        "forwards per "
        f"image and iteration, V-GRPO and DiffusionNFT (the same images per step for both): {forwards}.",
        "",
        "![held-out reward against optimizer steps, V-GRPO and DiffusionNFT](nft_vs_vgrpo.png)",
        "",
    ]


def splice(text: str, section: list[str]) -> str:
    """text (a markdown file) with its section of the same '## ' heading replaced by `section`, up to the next '## '
    heading, or with `section` appended where it has none."""
    lines, head = text.splitlines(), section[0]
    if head not in lines:
        return "\n".join([*lines, "", *section])
    i = lines.index(head)
    j = next((k for k in range(i + 1, len(lines)) if lines[k].startswith("## ")), len(lines))
    return "\n".join([*lines[:i], *section, *lines[j:]])


def report(results: dict, seeds: list[int], gains: list[float], argvs: dict, command: str, jobs: int, threads: int):
    """The markdown: how it was made, the flags, steps to each threshold, wall time per step, final rewards."""
    n = len(seeds)
    lines = [
        "# V-GRPO against DiffusionNFT on ShapesBench",
        "",
        f"Made by `{command}` on {platform.machine()} with {os.cpu_count()} cores ({threads} thread(s) per run, "
        + ("one run at a time" if jobs == 1 else f"{jobs} runs at a time")
        + f"), {time.strftime('%Y-%m-%d')}, seeds {', '.join(map(str, seeds))}. benchmarks/claims/nft_vs_vgrpo.py's "
        "docstring says why each flag expresses each paper's settings (V-GRPO: arXiv 2604.23380; DiffusionNFT: "
        "arXiv 2509.16117) and how the statistics are made. V-GRPO's paper reports about 580 gradient steps for "
        "what DiffusionNFT needs about 1.7k for (arXiv 2604.23380, Sec. 5): a step ratio of about 2.9.",
        "",
        "| run | command (+ --seed, --iterations and the evaluation flags) |",
        "|---|---|",
        *(f"| `{k}` | `{v}` |" for k, v in argvs.items()),
        "",
        f"Evaluation every iteration: the held-out learned reward, the same prompts and noise for every run of a seed. "
        f"Thresholds: each seed's reward before training + {', '.join(f'{g:g}' for g in gains)}. Steps to a threshold: "
        f"median [min, max] over the seeds (reached / seeds); >N: not reached in the run's N steps (censored, "
        "counted). "
        + (
            f"[min, max] is a {100 * (1 - 2 * 0.5**n):.0f}% distribution-free confidence interval for the median "
            f"with {n} seeds."
            if n > 1
            else "One seed: no interval."
        ),
        "",
        *threshold_table(results, seeds, gains),
        "",
        "Wall time per optimizer step: training time (evaluations excluded) over optimizer steps, means over seeds; "
        "the ratio's range is over the seeds' own ratios (runs of one seed started back to back, on the same machine).",
        "",
        "| setting | weights | V-GRPO s / step | DiffusionNFT s / step | DiffusionNFT / V-GRPO [range] | "
        "forwards / image: V-GRPO, DiffusionNFT |",
        "|---|---|---|---|---|---|",
    ]
    for r in time_rows(results):
        lines.append(
            f"| {SETTINGS[r['setting']][0]} | {WEIGHTS[r['weights']][0]} | {r['vgrpo']:.2f} | {r['diffusionnft']:.2f} "
            f"| {r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}] | {r['forwards']['vgrpo']:g}, "
            f"{r['forwards']['diffusionnft']:g} |"
        )
    lines += ["", "| run | steps | reward before -> after, mean [min, max] |", "|---|---|---|"]
    for k, cs in results.items():
        first = statistics.mean(c["evals"][0]["reward_mean"] for c in cs)
        last = [c["evals"][-1]["reward_mean"] for c in cs]
        steps = statistics.mean(c["evals"][-1]["steps"] for c in cs)
        lines.append(
            f"| `{k}` | {steps:g} | {first:.3f} -> {statistics.mean(last):.3f} [{min(last):.3f}, {max(last):.3f}] |"
        )
    lines += ["", "![held-out reward against optimizer steps](nft_vs_vgrpo.png)", ""]
    return "\n".join(lines)


def main():
    if sys.argv[1:2] == ["--train"]:  # the child process of one run
        return train(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help="seed 0, 3 iterations, 1 sample of 16 prompts per eval")
    parser.add_argument("--seeds", type=int, nargs="+", help="default: 0 1 2 (--quick: 0)")
    parser.add_argument("--iterations", type=int, help="per run (default: 30, the scripts' own; --quick: 3)")
    parser.add_argument("--gains", type=float, nargs=3, default=GAINS, help="the thresholds over the start")
    parser.add_argument("--eval-samples", type=int, help="samples per held-out prompt (default 4; --quick: 1)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each gets --threads threads)")
    parser.add_argument("--threads", type=int, help="threads per run (default: the cores divided by --jobs)")
    parser.add_argument(
        "--out", type=Path, help="runs and logs (default benchmarks/claims/nft_vs_vgrpo_out/full or /quick)"
    )
    a = parser.parse_args()
    if a.jobs < 1 or (a.threads is not None and a.threads < 1):
        parser.error("--jobs and --threads must be >= 1")
    if a.iterations is not None and a.iterations < 1:
        parser.error("--iterations must be >= 1")
    if a.eval_samples is not None and a.eval_samples < 1:
        parser.error("--eval-samples must be >= 1")
    if not all(0 < g for g in a.gains) or sorted(set(a.gains)) != a.gains:
        parser.error("--gains must be three increasing rewards > 0")
    if a.seeds is not None and (len(set(a.seeds)) != len(a.seeds) or min(a.seeds) < 0):
        parser.error("--seeds must be distinct and >= 0")
    threads = a.threads or max(1, (os.cpu_count() or 1) // a.jobs)
    seeds = a.seeds or ([0] if a.quick else [0, 1, 2])
    iterations = a.iterations or (3 if a.quick else 30)
    eval_samples, eval_prompts = a.eval_samples or (1 if a.quick else 4), 16 if a.quick else 48
    out = a.out or ROOT / "benchmarks" / "claims" / "nft_vs_vgrpo_out" / ("quick" if a.quick else "full")
    docs = out if a.quick else ROOT / "docs"
    command = "python benchmarks/claims/nft_vs_vgrpo.py" + " ".join(["", *sys.argv[1:]])
    argvs = {k: child_argv(k, iterations, eval_samples, eval_prompts) for k in configs()}
    todo = [(k, s) for s in seeds for k in configs()]  # seed by seed: an interrupted campaign has whole seeds
    with ThreadPoolExecutor(a.jobs) as pool:  # each job waits on its subprocess
        done = dict(zip(todo, pool.map(lambda ks: run_one(ks[0], argvs[ks[0]], ks[1], out, False, threads), todo)))
    results = {k: [curves(done[k, s]) for s in seeds] for k in configs()}
    docs.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    shown = {k: describe(k, iterations) for k in configs()}
    made = {"command": command, "commit": commit.stdout.strip() or "?", "seeds": seeds, "gains": a.gains}
    record = {**made, "argv": argvs, "curves": results}
    (docs / "nft_vs_vgrpo.json").write_text(json.dumps(record, indent=1) + "\n")
    (docs / "nft_vs_vgrpo.md").write_text(report(results, seeds, a.gains, shown, command, a.jobs, threads))
    plot(results, seeds, a.gains, docs / "nft_vs_vgrpo.png")
    written = [docs / "nft_vs_vgrpo.md", docs / "nft_vs_vgrpo.png", docs / "nft_vs_vgrpo.json"]
    if (
        not a.quick
    ):  # docs/results.md's section (benchmarks/claims/compare.py writes the same when it rewrites the file)
        md = docs / "results.md"
        md.write_text(splice(md.read_text() if md.exists() else "", results_section(record)))
        written.append(md)
    print("wrote " + ", ".join(map(str, written)))


if __name__ == "__main__":
    main()
