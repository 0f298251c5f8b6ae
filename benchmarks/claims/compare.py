"""Every method side by side on ShapesBench with the learned reward, each at its default settings.

    python benchmarks/claims/compare.py             # 2 seeds at the defaults (hours on 2 CPU cores): docs/results.md,
                                             # docs/results.png, docs/results_grids/
    python benchmarks/claims/compare.py --quick     # 1 seed, 10 iterations each (~15 min): the same files in
                                             # benchmarks/claims/compare_out/quick/
    python benchmarks/claims/compare.py --tradeoff  # + the sweep of SWEEP (seed 0): docs/tradeoff.md, docs/tradeoff.png
    bash run.sh compare [--quick]

DanceGRPO, MixGRPO (--sde-window 4), BranchGRPO (no / width / depth / mix pruning), V-GRPO, RLR and DiffusionNFT
(and V-GRPO and DiffusionNFT at 1 optimizer step per iteration, for V-GRPO's claim against DiffusionNFT) run one at a
time, as subprocesses with the same thread count (--threads), the held-out evaluation every few iterations (48
prompts; 4 samples each, 2 with --quick) and a fixed-seed sample grid at the start and the end. Every run keeps its
folder under <out>/runs/ and its log under <out>/logs/: rerunning the command skips finished runs (final/ written)
and resumes interrupted ones from their last checkpoint (--save-every 5). --jobs 2 runs two at a time (one thread
each by default), which halves the wall time on 2 cores; the table says how the runs shared the machine. "Time" is
training time (the sum of the iterations' wall times, evaluations excluded), so methods compare whatever their
evaluation schedule. Every row is checked against the bars of docs/shapesbench.md (BARS). --methods reruns some:
every method's last runs are on record in results.json beside the table, so the other rows stay.

--tradeoff adds one seed of each method at weaker settings of the regularisers that keep diversity (SWEEP: the
KL to the base model at two strengths, half the learning rate) and draws held-out shape accuracy against diversity
kept for all of them, with each default run's evaluations along its training (fewer iterations, the third
regulariser) as a line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.claims.nft_vs_vgrpo import results_section  # noqa: E402
from benchmarks.claims.training_runs import EVAL, curves, default_of, run_one  # noqa: E402

METHODS = {  # key: (label, script and flags)
    "dancegrpo": ("DanceGRPO", ["dancegrpo.py"]),
    "mixgrpo": ("MixGRPO", ["dancegrpo.py", "--sde-window", "4", "--kl-beta", "0.2"]),
    # the GRPO-family variants of dancegrpo.py (docs/dancegrpo.md), each at its official defaults
    "cps": ("DanceGRPO + CPS", ["dancegrpo.py", "--sde-type", "cps"]),
    "grpo_guard": ("GRPO-Guard", ["dancegrpo.py", "--objective", "guard"]),
    "flow_dppo": ("Flow-DPPO", ["dancegrpo.py", "--objective", "dppo"]),
    "mixgrpo_flash": (
        "MixGRPO-Flash",
        ["dancegrpo.py", "--sde-window", "4", "--kl-beta", "0.2", "--ode-solver", "dpm2"],
    ),
    "branchgrpo": ("BranchGRPO", ["branchgrpo.py"]),
    "branchgrpo_width": ("BranchGRPO, width pruning", ["branchgrpo.py", "--pruning", "width"]),
    "branchgrpo_depth": ("BranchGRPO, depth pruning", ["branchgrpo.py", "--pruning", "depth", "--iterations", "30"]),
    "branchgrpo_mix": ("BranchGRPO, Mix", ["branchgrpo.py", "--pruning", "mix"]),
    "vgrpo": ("V-GRPO", ["vgrpo.py"]),
    "rlr": ("RLR", ["rlr.py"]),
    "diffusionnft": ("DiffusionNFT", ["diffusionnft.py"]),
    "dgpo": ("DGPO", ["dgpo.py"]),
    "dpo": ("Diffusion-DPO (online)", ["dgpo.py", "--objective", "dpo"]),
    # V-GRPO and DiffusionNFT at the papers' 1 optimizer step per iteration (benchmarks/claims/nft_vs_vgrpo.py compares them)
    "vgrpo_1step": ("V-GRPO, 1 step / it.", ["vgrpo.py", "--samples-per-update", "64"]),
    "diffusionnft_1step": ("DiffusionNFT, 1 step / it.", ["diffusionnft.py", "--samples-per-update", "64"]),
}
# the trade-off sweep (seed 0): (label, flags added to the method's) per method. "KL" = --kl-beta (V-GRPO's KL is per
# ELBO pair, on another scale); "lr / 2" = half the script's default learning rate; "40 it." = the shared length where a
# default stops earlier. Each default run's own evaluations give one more regulariser, fewer iterations. Swept: the
# methods whose 40-iteration, KL-free run lost diversity, and DanceGRPO's rate.
SWEEP = {
    "dancegrpo": [("lr / 2", None)],
    "mixgrpo": [("no KL", ["--kl-beta", "0"])],
    "branchgrpo_depth": [
        ("40 it.", ["--iterations", "40"]),
        ("40 it., KL 0.2", ["--iterations", "40", "--kl-beta", "0.2"]),
    ],
    "vgrpo": [("40 it.", ["--iterations", "40"]), ("40 it., KL 5", ["--iterations", "40", "--kl-beta", "5"])],
}
# the bars every default command should meet (docs/shapesbench.md): name -> test on (first, last evaluation, minutes)
BARS = {
    "shape +20": lambda a, b, t: b["shape_acc"] - a["shape_acc"] >= 0.20,
    "all correct +15": lambda a, b, t: b["all_acc"] - a["all_acc"] >= 0.15,
    "clean >= 0.90": lambda a, b, t: b["clean_acc"] >= 0.90,
    "diversity kept >= 70%": lambda a, b, t: b["diversity_kept"] >= 0.70,
    "<= 8 min": lambda a, b, t: t <= 8.0,
}


def sweep_runs(methods: list[str]) -> dict:
    """key -> (method, setting, argv) of the --tradeoff runs of these methods: the method's flags + the setting's."""
    runs = {}
    for key in methods:
        argv = METHODS[key][1]
        for name, flags in SWEEP.get(key, []):
            flags = flags or ["--learning-rate", f"{default_of(argv[0], 'learning_rate') / 2:g}"]
            slug = name.replace(" ", "").replace("/", "over").replace(",", "_")
            runs[f"{key}+{slug}"] = (key, name, [*argv, *flags])
    return runs


def missed(cs: list[dict]) -> list[str]:
    """The bars the means over runs cs miss."""
    first = {k: sum(c["evals"][0][k] for c in cs) / len(cs) for k in EVAL}
    last = {k: sum(c["evals"][-1][k] for c in cs) / len(cs) for k in EVAL}
    minutes = sum(c["train_time"] for c in cs) / len(cs) / 60
    return [name for name, ok in BARS.items() if not ok(first, last, minutes)]


def reach(c: dict, target: float) -> dict | None:
    """The first evaluation (iteration, training seconds, optimizer steps, metrics) whose learned reward reaches
    target."""
    return next((e for e in c["evals"] if e["reward_mean"] >= target), None)


def start_end(cs: list[dict], k: str) -> str:
    """'start -> end' of eval metric k, means over the seeds' runs."""
    first, last = [c["evals"][0][k] for c in cs], [c["evals"][-1][k] for c in cs]
    return f"{sum(first) / len(first):.3f} -> {sum(last) / len(last):.3f}"


def mean(xs) -> float:
    return sum(xs) / len(xs)


def nft_vs_vgrpo_section(docs: Path) -> list[str]:
    """docs/results.md's section on V-GRPO against DiffusionNFT: benchmarks/claims/nft_vs_vgrpo.py's, from its record
    docs/nft_vs_vgrpo.json (which that benchmark splices into this file when it runs), or none before it has run."""
    record = docs / "nft_vs_vgrpo.json"
    if not record.exists():
        return []
    return ["", *results_section(json.loads(record.read_text()))]


def edit_section(docs: Path) -> list[str]:
    """docs/results.md's ShapesBench-Edit section: benchmarks/claims/edit_compare.py's, from its record
    docs/results_edit.json (which that benchmark splices into this file when it runs), or none before it has run."""
    record = docs / "results_edit.json"
    if not record.exists():
        return []
    from benchmarks.claims.edit_compare import section  # here: it imports this module

    return ["", *section(json.loads(record.read_text()))]


def write_table(
    results: dict, kept: dict, made: dict, path: Path, command: str, threads: int, jobs: int, seeds: list[int]
) -> None:
    """docs/results.md: a row per method of `results` (method -> curves per seed), then the rows `kept` (label ->
    line) of the previous table that no run on record can redraw; `made` (method -> the command, commit and date of
    its runs) says where every row not made by `command` comes from."""
    dance = results["dancegrpo"]
    target = mean([c["evals"][-1]["reward_mean"] for c in dance])
    fell = target <= mean([c["evals"][0]["reward_mean"] for c in dance])  # then every run "reaches" it at once
    lines = [
        "# Results: every method at its defaults on ShapesBench (learned reward)",
        "",
        f"Made by `{command}` on {platform.machine()} with {os.cpu_count()} cores (threads per run: {threads}), "
        + ("one run at a time" if jobs == 1 else f"{jobs} runs at a time")
        + f", {time.strftime('%Y-%m-%d')}. Values are means over seeds {', '.join(map(str, seeds))}; "
        "start -> end is the held-out evaluation (48 prompts, Euler 20 steps) before training and after the "
        "last iteration. Time is training time (evaluations excluded). The last column: iterations and time "
        "until the held-out learned reward first reaches DanceGRPO's final value"
        + f" ({target:.3f}), at the evaluation points"
        + ("; n/a here, because DanceGRPO's reward fell below its start." if fell else "."),
        "",
        "| method | it. | s / it. | forwards / image | trained / image | time | shape acc. | all correct | "
        "clean | learned reward | diversity | diversity kept | to DanceGRPO's reward | bars missed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, cs in results.items():
        label = METHODS[key][0]
        got = [e for e in (reach(c, target) for c in cs) if e is not None]
        when = (
            "n/a"
            if fell
            else f"{mean([e['iteration'] for e in got]):.0f} it., {mean([e['time'] for e in got]) / 60:.1f} min "
            f"({len(got)}/{len(cs)})"
            if got
            else "not reached"
        )
        lines.append(
            f"| {label} | {cs[0]['evals'][-1]['iteration']} | {mean([c['s_per_iteration'] for c in cs]):.2f} | "
            f"{mean([c['forwards'] for c in cs]):.1f} | {mean([c['trained'] for c in cs]):.1f} | "
            f"{mean([c['train_time'] for c in cs]) / 60:.1f} min | "
            + " | ".join(start_end(cs, k) for k in EVAL)
            + f" | {when} | {', '.join(missed(cs)) or 'none'} |"
        )
    lines += list(kept.values())
    other = {k: m for k, m in made.items() if m["command"] != command or k not in results}
    if other or kept:
        lines += ["", "Rows made at other times (the table keeps every method's last runs, docs/results.json):"]
        lines += [f"- {METHODS[k][0]}: `{m['command']}` at {m['commit']}, {m['date']}" for k, m in other.items()]
        if kept:
            lines.append(f"- {', '.join(kept)}: kept from the table before results.json existed (2026-12-03)")
    lines += [
        "",
        "Trained per image: DanceGRPO / MixGRPO trained SDE steps, BranchGRPO trained edges per leaf, V-GRPO ELBO "
        "pairs with a graph, RLR the back-propagated sub-chain's length, DiffusionNFT the timesteps trained per "
        "image (each one forward of the old policy, of the base for the KL term and of the trained one). Forwards per image: every transformer "
        "forward of an iteration (rollout, behaviour or reference passes, training) divided by its images. "
        "Bars (docs/shapesbench.md): " + ", ".join(BARS) + " (shape and all correct in points of accuracy, "
        "start to end; diversity kept = diversity / the renderer's own for the same prompts; training time).",
        "",
        "![held-out shape accuracy and learned reward](results.png)",
        *nft_vs_vgrpo_section(path.parent),
        *edit_section(path.parent),
    ]
    path.write_text("\n".join(lines))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharey="row")
    for key, cs in results.items():
        for row, metric in enumerate(("shape_acc", "reward_mean")):
            for col, x in enumerate(("time", "iteration")):
                xs = [[e[x] / (60 if x == "time" else 1) for e in c["evals"]] for c in cs]
                ys = [[e[metric] for e in c["evals"]] for c in cs]
                n = min(len(y) for y in ys)
                xm = [sum(v[i] for v in xs) / len(xs) for i in range(n)]
                (line,) = axes[row, col].plot(
                    xm, [sum(v[i] for v in ys) / len(ys) for i in range(n)], label=METHODS[key][0]
                )
                if len(cs) > 1:  # seeds as a band: min to max
                    lo, hi = [min(v[i] for v in ys) for i in range(n)], [max(v[i] for v in ys) for i in range(n)]
                    axes[row, col].fill_between(xm, lo, hi, color=line.get_color(), alpha=0.15)
                axes[row, col].set_xlabel("training time (min)" if x == "time" else "iteration")
                axes[row, col].set_ylabel(
                    "held-out shape accuracy" if metric == "shape_acc" else "held-out learned reward"
                )
                axes[row, col].grid(alpha=0.3)
    axes[0, 1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def tradeoff(results: dict, swept: dict, docs: Path, command: str, samples: int) -> None:
    """docs/tradeoff.md and tradeoff.png: held-out shape accuracy against diversity kept, seed 0. Each default run is
    a line through its evaluations (fewer iterations), each swept run (swept: method -> {setting: curves}) a marker
    at its last evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = results["dancegrpo"][0]["evals"][0]
    lines = [
        "# The accuracy-diversity trade-off on ShapesBench",
        "",
        f"Made by `{command}` (seed 0 of every method; {time.strftime('%Y-%m-%d')}). Held-out evaluation (48 "
        f"prompts x {samples} samples, Euler 20 steps); diversity kept = diversity / the renderer's own diversity for the "
        "same prompts (a perfect policy: 1.0; the base model: "
        f"{first['diversity_kept']:.2f}, its wrong shapes included). The defaults are listed at every evaluation "
        "(a shorter run is the same run stopped there); the other settings at their last. Bars: shape accuracy "
        f"{first['shape_acc'] + 0.2:.3f} (+20 points) and diversity kept 0.70.",
        "",
        "| method | setting | it. | shape acc. | all correct | clean | diversity kept | time | bars missed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fig, ax = plt.subplots(figsize=(8, 6))
    for n, (key, cs) in enumerate(results.items()):
        c, colour = cs[0], f"C{n}"
        label = METHODS[key][0]
        ev = c["evals"]
        ax.plot([e["diversity_kept"] for e in ev], [e["shape_acc"] for e in ev], "o-", color=colour, label=label, ms=4)
        for e in ev[1:]:
            lines.append(
                f"| {label} | default | {e['iteration']} | {e['shape_acc']:.3f} | {e['all_acc']:.3f} | "
                f"{e['clean_acc']:.3f} | {e['diversity_kept']:.2f} | {e['time'] / 60:.1f} min | "
                + (", ".join(missed([{"evals": [ev[0], e], "train_time": e["time"]}])) or "none")
                + " |"
            )
        for name, vc in swept.get(key, {}).items():
            marker = "s" if name.startswith("lr") else "^" if "KL" in name else "D"
            e = vc["evals"][-1]
            ax.plot(e["diversity_kept"], e["shape_acc"], marker, color=colour, ms=8, mfc="none")
            ax.annotate(
                name, (e["diversity_kept"], e["shape_acc"]), fontsize=7, xytext=(4, 3), textcoords="offset points"
            )
            lines.append(
                f"| {label} | {name} | {e['iteration']} | {e['shape_acc']:.3f} | {e['all_acc']:.3f} | "
                f"{e['clean_acc']:.3f} | {e['diversity_kept']:.2f} | {vc['train_time'] / 60:.1f} min | "
                + (", ".join(missed([vc])) or "none")
                + " |"
            )
    ax.axvline(0.7, color="grey", ls="--", lw=1)
    ax.axhline(first["shape_acc"] + 0.2, color="grey", ls="--", lw=1)
    ax.set_xlabel("diversity kept (diversity / the renderer's)")
    ax.set_ylabel("held-out shape accuracy")
    ax.set_title(
        "lines: defaults along training; markers: KL (triangles), lr / 2 (squares), 40 it. (diamonds)", fontsize=9
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(docs / "tradeoff.png", dpi=110)
    lines += ["", "![shape accuracy against diversity kept](tradeoff.png)", ""]
    (docs / "tradeoff.md").write_text("\n".join(lines))


def grids(results_runs: dict, folder: Path) -> None:
    """Before / after sample grid per method (seed 0's run): the run's own fixed-seed grids, side by side."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for key, runs in results_runs.items():
        pngs = sorted((runs[0] / "samples").glob("samples_*.png"))
        if len(pngs) < 2:
            continue
        a, b = Image.open(pngs[0]), Image.open(pngs[-1])
        both = Image.new("RGB", (a.width + b.width + 8, max(a.height, b.height)), "white")
        both.paste(a, (0, 0))
        both.paste(b, (a.width + 8, 0))
        both.save(folder / f"{key}.png")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 10 iterations each, 2 eval samples per prompt")
    parser.add_argument("--seeds", type=int, nargs="+", help="default: 0 1 (--quick: 0)")
    parser.add_argument("--tradeoff", action="store_true", help="+ the SWEEP runs (seed 0): tradeoff.md and .png")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each gets --threads threads)")
    parser.add_argument("--threads", type=int, help="threads per run (default: the cores divided by --jobs)")
    parser.add_argument(
        "--out", type=Path, help="runs, logs and (--quick) results; default benchmarks/claims/compare_out/"
    )
    a = parser.parse_args()
    if a.jobs < 1 or (a.threads is not None and a.threads < 1):
        parser.error("--jobs and --threads must be >= 1")
    threads = a.threads or max(1, (os.cpu_count() or 1) // a.jobs)
    seeds = a.seeds or ([0] if a.quick else [0, 1])
    out = a.out or ROOT / "benchmarks" / "claims" / "compare_out" / ("quick" if a.quick else "full")
    docs = out if a.quick else ROOT / "docs"
    command = (
        "python benchmarks/claims/compare.py"
        + (" --quick" if a.quick else "")
        + (f" --jobs {a.jobs}" if a.jobs > 1 else "")
        + (" --tradeoff" if a.tradeoff else "")
        + (f" --methods {' '.join(a.methods)}" if a.methods != list(METHODS) else "")
        + (f" --seeds {' '.join(map(str, a.seeds))}" if a.seeds else "")
    )
    store = docs / "results.json"  # every method's last runs: curves per seed, and how they were made
    saved = json.loads(store.read_text()) if store.exists() else {}
    if "dancegrpo" not in a.methods and "dancegrpo" not in saved:
        parser.error("--methods must include dancegrpo (the reference of the last column) until it has runs on record")
    sweep = sweep_runs(a.methods) if a.tradeoff else {}
    argvs = {**{key: METHODS[key][1] for key in a.methods}, **{k: v[2] for k, v in sweep.items()}}
    todo = [(key, s) for key in a.methods for s in seeds] + [(k, seeds[0]) for k in sweep]
    with ThreadPoolExecutor(a.jobs) as pool:  # each job waits on its subprocess
        done = dict(zip(todo, pool.map(lambda ks: run_one(ks[0], argvs[ks[0]], ks[1], out, a.quick, threads), todo)))
    runs = {key: [done[key, s] for s in seeds] for key in a.methods}
    docs.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    made = {"command": command, "commit": commit.stdout.strip() or "?", "date": time.strftime("%Y-%m-%d")}
    saved.update({key: {**made, "seeds": seeds, "curves": [curves(r) for r in runs[key]]} for key in a.methods})
    store.write_text(json.dumps(saved, indent=1) + "\n")
    results = {key: saved[key]["curves"] for key in METHODS if key in saved}
    old = (docs / "results.md").read_text().splitlines() if (docs / "results.md").exists() else []
    kept = {  # rows of methods that have no runs on record: the previous table's, as they were
        METHODS[k][0]: row for k in METHODS if k not in saved for row in old if row.startswith(f"| {METHODS[k][0]} |")
    }
    write_table(
        results,
        kept,
        {k: {x: saved[k][x] for x in made} for k in results},
        docs / "results.md",
        command,
        threads,
        a.jobs,
        seeds,
    )
    plot(results, docs / "results.png")
    grids(runs, docs / "results_grids")
    print(f"wrote {docs / 'results.md'}, {docs / 'results.png'}, {docs / 'results_grids'}/")
    if sweep:
        swept = {key: {} for key in a.methods}  # method -> {setting: curves}
        for k, (key, name, _) in sweep.items():
            swept[key][name] = curves(done[k, seeds[0]])
        tradeoff(results, swept, docs, command, 2 if a.quick else 4)
        print(f"wrote {docs / 'tradeoff.md'}, {docs / 'tradeoff.png'}")


if __name__ == "__main__":
    main()
