"""DGPO's speed claim on ShapesBench: optimizer steps and wall time to DanceGRPO's final held-out reward.

    python benchmarks/claims/dgpo_speed.py --jobs 2      # 3 seeds x 3 methods: docs/dgpo_speed.md, .png and .json
    python benchmarks/claims/dgpo_speed.py --quick       # smoke test: seed 0, 2 iterations, 8 prompts x 1 sample

DGPO's paper claims to train about 20 times faster than Flow-GRPO (near 30 times on GenEval, SD3.5-Medium). Here each
method runs at its ShapesBench defaults (its script's own flags, its own --iterations), evaluated on its live
weights every iteration on the same held-out prompts and noise (keyed on the seed alone):
  dancegrpo     dancegrpo.py: Flow-GRPO's family here (the flow SDE with a likelihood ratio), the reference;
  dgpo          dgpo.py --no-ema;
  diffusionnft  diffusionnft.py --no-ema.
A seed's target is DanceGRPO's held-out learned reward at the end of its run. Per method and seed: the optimizer
steps and the training seconds (evaluations excluded) at the first evaluation that reaches the target; a run that
never does is censored (>N, its last count) and counted, never dropped. Over the seeds: the median and [min, max]
(a 75% distribution-free interval for the median with 3 seeds); the ratio is DanceGRPO's median over the method's
(how many times faster), a bound when a median is censored. Forwards per image are each script's logged count.

Runs keep their folders under <out>/runs/ and their logs under <out>/logs/ (benchmarks/claims/training_runs.py's
run_one): rerunning the command skips finished runs and resumes interrupted ones from their last checkpoint.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.claims.nft_vs_vgrpo import cell, summary  # noqa: E402
from benchmarks.claims.training_runs import curves, default_of, run_one  # noqa: E402

METHODS = {  # key -> (label, the script and its flags)
    "dancegrpo": ("DanceGRPO", ["dancegrpo.py"]),
    "dgpo": ("DGPO", ["dgpo.py", "--no-ema"]),
    "diffusionnft": ("DiffusionNFT", ["diffusionnft.py", "--no-ema"]),
}
PAPER = "about 20x fewer steps than Flow-GRPO (near 30x on GenEval)"


def child_argv(key: str, iterations: int | None, eval_samples: int, eval_prompts: int) -> list[str]:
    """run_one's argv: this file as the child (--train), the script and its flags after `--`."""
    script, *flags = METHODS[key][1]
    own = iterations or default_of(script, "iterations")
    return [
        *("benchmarks/claims/dgpo_speed.py", "--train", script, "--eval-samples", str(eval_samples)),
        *("--eval-prompts", str(eval_prompts), "--", *flags, "--iterations", str(own)),
    ]


def train(argv: list[str]) -> None:
    """The child process of one run: `--train SCRIPT --eval-samples N --eval-prompts P -- FLAGS`: SCRIPT's main() on
    FLAGS with an evaluation every iteration added last, so that it overrides what run_one passes."""
    parser = argparse.ArgumentParser(prog="dgpo_speed.py --train", allow_abbrev=False)
    parser.add_argument("script", choices=sorted({m[1][0] for m in METHODS.values()}))
    parser.add_argument("--eval-samples", type=int, required=True)
    parser.add_argument("--eval-prompts", type=int, required=True)
    if "--" not in argv:
        parser.error("the script's flags come after `--`")
    a = parser.parse_args(argv[: argv.index("--")])
    module = importlib.import_module(Path(a.script).stem)
    tail = ["--eval-every", "1", "--eval-samples-per-prompt", str(a.eval_samples), "--eval-max-prompts"]
    sys.argv = [a.script, *argv[argv.index("--") + 1 :], *tail, str(a.eval_prompts)]
    from common.flags import cli

    cli(module.main, module.Args)


def first_reaching(evals: list[dict], target: float) -> tuple[tuple, tuple]:
    """((steps, censored), (whole seconds, censored)) at the first evaluation whose reward_mean >= target; the last
    evaluation's, censored, when none does."""
    for e in evals:
        if e["reward_mean"] >= target:
            return (e["steps"], False), (round(e["time"]), False)
    return (evals[-1]["steps"], True), (round(evals[-1]["time"]), True)


def speedup(ref: dict, other: dict) -> str:
    """DanceGRPO's median over the method's: how many times faster; '<' when the method's median is censored (its
    true value is larger). DanceGRPO always reaches its own final reward, at its last evaluation at the latest."""
    (a, _), (b, censored) = ref["median"], other["median"]
    return "n/a" if b == 0 else f"{'<' if censored else ''}{a / b:.2f}"


def rows(results: dict, seeds: list[int]) -> list[dict]:
    """Per method: steps and seconds to the seed's target (DanceGRPO's final reward), their summaries and ratios."""
    targets = [c["evals"][-1]["reward_mean"] for c in results["dancegrpo"]]
    out = []
    for key in METHODS:
        reached = [first_reaching(c["evals"], t) for c, t in zip(results[key], targets)]
        steps, secs = summary([r[0] for r in reached]), summary([r[1] for r in reached])
        out.append({"method": key, "steps": steps, "seconds": secs, "forwards": results[key][0]["forwards"]})
    ref = out[0]
    for r in out:
        r["step_ratio"], r["time_ratio"] = speedup(ref["steps"], r["steps"]), speedup(ref["seconds"], r["seconds"])
    return out


def plot(results: dict, path: Path) -> None:
    """Held-out reward against optimizer steps and against training seconds: per method the mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for n, (key, cs) in enumerate(results.items()):
        k = min(len(c["evals"]) for c in cs)
        ys = [statistics.mean(c["evals"][i]["reward_mean"] for c in cs) for i in range(k)]
        for ax, x in zip(axes, ("steps", "time")):
            ax.plot([statistics.mean(c["evals"][i][x] for c in cs) for i in range(k)], ys, color=f"C{n}",
                    label=METHODS[key][0])  # fmt: skip
    target = statistics.mean(c["evals"][-1]["reward_mean"] for c in results["dancegrpo"])
    for ax, label in zip(axes, ("optimizer steps", "training seconds (evaluations excluded)")):
        ax.axhline(target, color="grey", ls="--", lw=0.8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out learned reward (mean over seeds)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(record: dict) -> str:
    results, seeds = record["curves"], record["seeds"]
    lines = [
        "# DGPO's speed claim on ShapesBench",
        "",
        f"Made by `{record['command']}` at {record['commit']}, seeds {', '.join(map(str, seeds))}; the method and the "
        "statistics: benchmarks/claims/dgpo_speed.py's docstring. Target: each seed's DanceGRPO held-out learned reward "
        "at the end of its run. Median [min, max] over the seeds (reached / seeds); >N: not reached in N. The paper: "
        f"{PAPER}.",
        "",
        "| method | command | optimizer steps to the target | DanceGRPO's / its (medians) | training s to the target "
        "| DanceGRPO's / its (medians) | forwards / image |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows(results, seeds):
        key = r["method"]
        lines.append(
            f"| {METHODS[key][0]} | `{' '.join(METHODS[key][1])}` | {cell(r['steps'])} | {r['step_ratio']} | "
            f"{cell(r['seconds'])} | {r['time_ratio']} | {r['forwards']:g} |"
        )
    lines += ["", "| method | steps | reward before -> after, mean [min, max] |", "|---|---|---|"]
    for key, cs in results.items():
        last = [c["evals"][-1]["reward_mean"] for c in cs]
        first = statistics.mean(c["evals"][0]["reward_mean"] for c in cs)
        steps = statistics.mean(c["evals"][-1]["steps"] for c in cs)
        lines.append(
            f"| {METHODS[key][0]} | {steps:g} | {first:.3f} -> {statistics.mean(last):.3f} "
            f"[{min(last):.3f}, {max(last):.3f}] |"
        )
    return "\n".join([*lines, "", "![held-out reward against steps and seconds](dgpo_speed.png)", ""])


def main():
    if sys.argv[1:2] == ["--train"]:  # the child process of one run
        return train(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help="seed 0, 2 iterations, 8 prompts x 1 sample per eval")
    parser.add_argument("--seeds", type=int, nargs="+", help="default: 0 1 2 (--quick: 0)")
    parser.add_argument("--eval-prompts", type=int, default=48, help="held-out prompts per evaluation")
    parser.add_argument("--eval-samples", type=int, default=2, help="samples per held-out prompt")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    parser.add_argument("--threads", type=int, default=1, help="threads per run")
    parser.add_argument(
        "--out", type=Path, help="runs and logs (default benchmarks/claims/dgpo_speed_out/{full,quick})"
    )
    a = parser.parse_args()
    if min(a.jobs, a.threads, a.eval_prompts, a.eval_samples) < 1:
        parser.error("--jobs, --threads, --eval-prompts and --eval-samples must be >= 1")
    seeds = a.seeds or ([0] if a.quick else [0, 1, 2])
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        parser.error("--seeds must be distinct and >= 0")
    iterations = 2 if a.quick else None  # None: each script's own
    prompts, samples = (8, 1) if a.quick else (a.eval_prompts, a.eval_samples)
    out = a.out or ROOT / "benchmarks" / "claims" / "dgpo_speed_out" / ("quick" if a.quick else "full")
    docs = out if a.quick else ROOT / "docs"
    argvs = {k: child_argv(k, iterations, samples, prompts) for k in METHODS}
    todo = [(k, s) for s in seeds for k in METHODS]  # seed by seed: an interrupted campaign has whole seeds
    with ThreadPoolExecutor(a.jobs) as pool:  # each job waits on its subprocess
        done = dict(zip(todo, pool.map(lambda ks: run_one(ks[0], argvs[ks[0]], ks[1], out, False, a.threads), todo)))
    results = {k: [curves(done[k, s]) for s in seeds] for k in METHODS}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    command = "python benchmarks/claims/dgpo_speed.py" + " ".join(["", *sys.argv[1:]])
    record = {"command": command, "commit": commit.stdout.strip() or "?", "seeds": seeds, "argv": argvs}
    record["curves"] = results
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "dgpo_speed.json").write_text(json.dumps(record, indent=1) + "\n")
    (docs / "dgpo_speed.md").write_text(report(record))
    plot(results, docs / "dgpo_speed.png")
    print(f"wrote {docs / 'dgpo_speed.md'}, .png, .json")


if __name__ == "__main__":
    main()
