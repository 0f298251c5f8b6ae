"""ShapesBench-Edit: methods at their defaults learning to follow edit instructions on a CPU.

    python benchmarks/claims/edit_compare.py --jobs 2                       # DanceGRPO and DiffusionNFT, seed 0
    python benchmarks/claims/edit_compare.py --jobs 2 --methods vgrpo --seeds 0 1

Each method trains `--model-id shapesbench-edit` (common/shapesbench/edit.py: a tiny FLUX.1-Kontext pretrained to
follow instructions imperfectly) with nothing else changed from its script's defaults: the ShapesBench splits are then
the edits' (3360 training edits; 192 of the 1344 held-out ones, whose sources are ShapesBench's held-out prompts) and
the default reward, ShapesBench's learned reward, scores each edit against the caption it should give. The runs are
benchmarks/claims/training_runs.py's (as compare.py's: resumed, skipped when done, --jobs at a time). The record,
docs/results_edit.json, keeps every method's last runs; its section of docs/results.md is spliced in here (compare.py
writes the same section when it rewrites that file), with each method's first and last sample grid side by side in
docs/results_grids/edit_<method>.png (each edit right of its source; the badge is the edit verifier's verdict).
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
from benchmarks.claims.compare import grids  # noqa: E402
from benchmarks.claims.nft_vs_vgrpo import splice  # noqa: E402
from benchmarks.claims.training_runs import curves, run_one  # noqa: E402

METHODS = {  # key: (label, script and flags); each at its defaults on the edit model
    "dancegrpo": ("DanceGRPO", ["dancegrpo.py"]),
    "mixgrpo": ("MixGRPO", ["dancegrpo.py", "--sde-window", "4", "--kl-beta", "0.2"]),
    "branchgrpo_depth": ("BranchGRPO, depth pruning", ["branchgrpo.py", "--pruning", "depth", "--iterations", "30"]),
    "vgrpo": ("V-GRPO", ["vgrpo.py"]),
    "diffusionnft": ("DiffusionNFT", ["diffusionnft.py"]),
    "dgpo": ("DGPO", ["dgpo.py"]),
    "rlr": ("RLR", ["rlr.py"]),
}
# the edit verifier's accuracies (common.shapesbench.edit.edit_metrics) and the learned reward of the targets
EVAL = ["edit_acc", "changed_acc", "kept_acc", "size_kept_acc", "clean_acc", "reward_mean"]
LABELS = ["edit acc.", "change made", "rest kept", "size kept", "clean", "learned reward"]
BARS = {  # what a default command should show: learning the edit, and keeping what the instruction did not name
    "edit +20": lambda a, b, t: b["edit_acc"] - a["edit_acc"] >= 0.20,
    "rest kept >= 0.90": lambda a, b, t: b["kept_acc"] >= 0.90,
    "size kept >= 0.90": lambda a, b, t: b["size_kept_acc"] >= 0.90,
    "<= 8 min": lambda a, b, t: t <= 8.0,
}
HEADING = "## ShapesBench-Edit: learning to edit"


def mean(xs) -> float:
    return sum(xs) / len(xs)


def missed(cs: list[dict]) -> list[str]:
    first = {k: mean([c["evals"][0][k] for c in cs]) for k in EVAL}
    last = {k: mean([c["evals"][-1][k] for c in cs]) for k in EVAL}
    minutes = mean([c["train_time"] for c in cs]) / 60
    return [name for name, ok in BARS.items() if not ok(first, last, minutes)]


def section(record: dict) -> list[str]:
    """The section of docs/results.md, from the record: a row per method (means over its seeds), how each was made."""
    lines = [
        HEADING,
        "",
        "The edit task of docs/editing.md in ShapesBench's world: `--model-id shapesbench-edit`, a tiny FLUX.1-Kontext "
        "pretrained to follow 'make the circle blue', 'make the background white' and 'turn the square into a "
        "triangle' imperfectly, each method at its script's defaults. Held-out: 192 edits of the 48 held-out sources "
        "(4 samples each, Euler 20 steps), judged from pixels by the edit verifier: edit acc. = the requested change "
        "made and the rest as in the source; change made = the named attribute has the requested value; rest kept = "
        "the two attributes not named are the source's; size kept = the shape's size is the source's. Time is "
        "training time.",
        "",
        "| method | it. | s / it. | time | " + " | ".join(LABELS) + " | bars missed |",
        "|---|" + "---|" * (4 + len(LABELS)),
    ]
    made = []
    for key, entry in record.items():
        cs = entry["curves"]
        cells = [
            f"{mean([c['evals'][0][k] for c in cs]):.3f} -> {mean([c['evals'][-1][k] for c in cs]):.3f}" for k in EVAL
        ]
        lines.append(
            f"| {METHODS[key][0]} | {cs[0]['evals'][-1]['iteration']} | {mean([c['s_per_iteration'] for c in cs]):.2f} "
            f"| {mean([c['train_time'] for c in cs]) / 60:.1f} min | "
            + " | ".join(cells)
            + f" | {', '.join(missed(cs)) or 'none'} |"
        )
        made.append(f"- {METHODS[key][0]}: `{entry['command']}` at {entry['commit']}, {entry['date']}, seeds "
                    f"{', '.join(map(str, entry['seeds']))}, {entry['machine']}")  # fmt: skip
    lines += [
        "",
        "Made by:",
        *made,
        "",
        "Bars: " + ", ".join(BARS) + " (edit in points of accuracy, start to end).",
        "",
    ]
    lines += [f"![{METHODS[k][0]}: first and last sample grid](results_grids/edit_{k}.png)" for k in record]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=["dancegrpo", "diffusionnft"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each gets --threads threads)")
    parser.add_argument("--threads", type=int, help="threads per run (default: the cores divided by --jobs)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "claims" / "compare_out" / "edit")
    a = parser.parse_args()
    if a.jobs < 1 or (a.threads is not None and a.threads < 1):
        parser.error("--jobs and --threads must be >= 1")
    threads = a.threads or max(1, (os.cpu_count() or 1) // a.jobs)
    command = "python benchmarks/claims/edit_compare.py" + (f" --jobs {a.jobs}" if a.jobs > 1 else "")
    command += f" --methods {' '.join(a.methods)} --seeds {' '.join(map(str, a.seeds))}"
    todo = [(k, s) for k in a.methods for s in a.seeds]
    argv = {k: [*METHODS[k][1], "--model-id", "shapesbench-edit"] for k in a.methods}
    with ThreadPoolExecutor(a.jobs) as pool:
        done = dict(
            zip(todo, pool.map(lambda ks: run_one(f"edit_{ks[0]}", argv[ks[0]], ks[1], a.out, False, threads), todo))
        )
    docs = ROOT / "docs"
    store = docs / "results_edit.json"
    record = json.loads(store.read_text()) if store.exists() else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    made = {"command": command, "commit": commit.stdout.strip() or "?", "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {threads} thread(s) per run, {a.jobs} at a time"}  # fmt: skip
    for k in a.methods:
        record[k] = {**made, "seeds": a.seeds, "curves": [curves(done[k, s], EVAL) for s in a.seeds]}
    store.write_text(json.dumps({k: record[k] for k in METHODS if k in record}, indent=1) + "\n")
    md = docs / "results.md"
    md.write_text(splice(md.read_text(), section({k: record[k] for k in METHODS if k in record})) + "\n")
    grids({f"edit_{k}": [done[k, a.seeds[0]]] for k in a.methods}, docs / "results_grids")
    print(f"wrote {store}, {md} ({HEADING[3:]}), {docs / 'results_grids'}/edit_*.png")


if __name__ == "__main__":
    main()
