"""Summarise finished runs from their metrics.jsonl: iterations, median s/iteration, training wall time, and the
held-out evaluation (ShapesBench verifier shape accuracy, learned reward, ...) at the first and the last evaluation.

    python benchmarks/claims/summarize.py runs/dancegrpo__0__1796000000 runs/branchgrpo__0__1796000000 [...]   (run folders)
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common.logs import read_metrics  # noqa: E402

KEYS = ["eval/shape_acc", "eval/colour_acc", "eval/clean_acc", "eval/all_acc", "eval/reward_mean", "eval/diversity"]


def summarize(run: Path) -> dict:
    rows = read_metrics(run)
    train = [r for r in rows if "perf/iteration_s" in r]
    evals = [r for r in rows if "eval/reward" in r]
    out = {
        "run": str(run),
        "iterations": train[-1]["iteration"] if train else 0,
        "median_s_per_iteration": round(statistics.median(r["perf/iteration_s"] for r in train), 2) if train else None,
        "train_minutes": round(sum(r["perf/iteration_s"] for r in train) / 60, 1),  # without evaluations
        "wall_minutes": round(train[-1].get("perf/wall_s", float("nan")) / 60, 1) if train else None,
    }  # with them
    for tag, row in (("before", evals[0] if evals else {}), ("after", evals[-1] if evals else {})):
        out[tag] = {
            "iteration": row.get("iteration"),
            **{k.removeprefix("eval/"): round(row[k], 4) for k in KEYS if k in row},
        }
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(json.dumps(summarize(Path(arg))))
