"""The training runs of the side-by-side benchmarks: one (method, seed) trained as a subprocess, skipped when finished
and resumed from its last checkpoint (run_one), and the evaluation curves read back from its log (curves).
benchmarks/claims/compare.py and benchmarks/claims/nft_vs_vgrpo.py both train their runs with these.
"""

from __future__ import annotations

import importlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from common.logs import read_metrics  # noqa: E402

EVAL = ["shape_acc", "all_acc", "clean_acc", "reward_mean", "diversity", "diversity_kept"]
# forward passes and trained transitions per image, whichever the script logs
FORWARDS = ["perf/nfe_per_image", "tree/rollout_forwards_per_leaf"]
TRAINED = [
    "perf/trained_steps_per_image",
    "tree/trained_edges_per_leaf",
    "perf/trained_pairs_per_image",
    "rlr/subchain_len",
    "perf/trained_timesteps_per_image",
]


def default_of(script: str, field: str):
    return importlib.import_module(Path(script).stem).Args.__dataclass_fields__[field].default


def run_one(key: str, argv: list[str], seed: int, out: Path, quick: bool, threads: int) -> Path:
    """Train one (method, seed) unless it has finished; resume it if it has a checkpoint. Returns its run folder."""
    runs = out / "runs"
    folders = sorted(runs.glob(f"{key}__{seed}__*"))
    done = [f for f in folders if (f / "final").is_dir()]
    if done:
        return done[-1]
    resumable = [f for f in folders if any((f / "checkpoints").glob("iter_*"))]
    for f in folders:  # a run that died before its first checkpoint starts again
        if f not in resumable:
            shutil.rmtree(f)
    given = [int(argv[k + 1]) for k, flag in enumerate(argv) if flag == "--iterations"]  # a method's own length
    iterations = 10 if quick else (given or [default_of(argv[0], "iterations")])[-1]
    every = iterations if quick else max(5, iterations // 4)
    cmd = [sys.executable, *argv, "--seed", str(seed), "--exp-name", key, "--output-dir", str(runs)]
    cmd += ["--iterations", str(iterations), "--eval-every", str(every), "--sample-every", str(iterations)]
    cmd += ["--save-every", "5", "--eval-samples-per-prompt", "2" if quick else "4"]
    if resumable:
        cmd += ["--resume-from", str(resumable[-1])]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    (out / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(out / "logs" / f"{key}__{seed}.log", "a") as log:
        status = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if status != 0:
        raise SystemExit(f"{key} seed {seed} failed (exit {status}); see {out / 'logs' / f'{key}__{seed}.log'}")
    print(f"  {key} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    return sorted(runs.glob(f"{key}__{seed}__*"))[-1]


def curves(run: Path, keys: list[str] = EVAL) -> dict:
    """Evaluation points (iteration, training seconds so far, the eval/ metrics `keys`) and per-iteration figures of
    one run."""
    rows = read_metrics(run)
    train = {r["iteration"]: r for r in rows if "perf/iteration_s" in r}
    elapsed, total = {0: 0.0}, 0.0
    for it in sorted(train):
        total += train[it]["perf/iteration_s"]
        elapsed[it] = total
    steps = {0: 0, **{it: r.get("charts/optimizer_steps", float("nan")) for it, r in train.items()}}
    evals = [
        {
            "iteration": r["iteration"],
            "time": elapsed.get(r["iteration"], total),
            "steps": steps.get(r["iteration"], float("nan")),  # optimizer steps so far
            **{k: r[f"eval/{k}"] for k in keys},
        }
        for r in rows
        if f"eval/{keys[0]}" in r
    ]
    last = train[max(train)]
    forwards = next((last[k] for k in FORWARDS if k in last), float("nan"))
    if "tree/train_forwards_per_leaf" in last:
        forwards += last["tree/train_forwards_per_leaf"]
    return {
        "evals": evals,
        "s_per_iteration": statistics.median(r["perf/iteration_s"] for r in train.values()),
        "train_time": total,
        "forwards": forwards,
        "trained": next((last[k] for k in TRAINED if k in last), float("nan")),
    }
