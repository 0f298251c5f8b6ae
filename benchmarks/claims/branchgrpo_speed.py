"""BranchGRPO speed benchmarks, on the shipped ShapesBench model, CPU.

    python benchmarks/claims/branchgrpo_speed.py rollout      # one 16-leaf tree: batched per depth vs one node at a time
    python benchmarks/claims/branchgrpo_speed.py iteration    # s/iteration vs dancegrpo.py at 16 samples per prompt, 20 steps
    python benchmarks/claims/branchgrpo_speed.py mixgrpo      # dancegrpo.py defaults: full SDE vs --sde-window 4

`iteration` runs the real scripts back to back (subprocesses, no evaluation, KL off as in both papers) and
reports the median seconds per iteration over the iterations after the first; it prints a JSON table.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from common.logs import read_metrics  # noqa: E402


def rollout(repeats: int = 3) -> dict:
    import branchgrpo as B
    from common.models import load_model

    model = load_model("shapesbench")
    cond = model.encode_prompts(["a red circle on a blue background"])
    sigmas = B.sigma_schedule(20, 3.0)
    g = B.noise_g(sigmas, "flow", 0.7)
    tree, shape = B.Tree(20, (0, 3, 6, 9), 2), model.latent_shape()
    noise_fn = partial(B.tree_noise, tree, 0, 0, [0], shape)

    out = {}
    for name, bs in [("batched_per_depth", 16), ("one_node_at_a_time", 1)]:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            roots = torch.randn((1, *shape))
            B.tree_rollout(
                model, model.transformer, cond, roots, noise_fn, tree, sigmas, g, range(19), bs, 1.0, nullcontext
            )
            times.append(time.perf_counter() - t0)
        out[name + "_s"] = round(min(times), 3)
    out["speedup"] = round(out["one_node_at_a_time_s"] / out["batched_per_depth_s"], 2)
    out["threads"] = torch.get_num_threads()
    return out


def timed_runs(runs: dict, common: list) -> dict:
    """Run each script back to back; median seconds per iteration over the iterations after the first."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv in runs.items():
            cmd = [sys.executable, *argv, *common, "--output-dir", tmp, "--exp-name", name]
            subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
            run = next(Path(tmp).glob(f"{name}__*"))  # the run folder: {exp_name}__{seed}__{unix time}
            rows = read_metrics(run)
            its = [r["perf/iteration_s"] for r in rows if "perf/iteration_s" in r][1:]
            out[name] = {"s_per_iteration": round(statistics.median(its), 2)}
            for key in ("tree/trained_edges_per_leaf", "tree/train_forwards_per_leaf", "perf/nfe_per_image"):
                if key in rows[-1]:
                    out[name][key] = rows[-1][key]
    base = out[next(iter(runs))]["s_per_iteration"]
    for name in out:
        out[name]["speedup"] = round(base / out[name]["s_per_iteration"], 2)
    return out


def mixgrpo(iterations: int = 6) -> dict:
    common = ["--iterations", str(iterations), "--eval-every", "0", "--sample-every", "0", "--save-every", "0"]
    common += ["--no-lora"]  # full fine-tuning, as the papers' FLUX runs
    return timed_runs({"dancegrpo": ["dancegrpo.py"], "mixgrpo_window4": ["dancegrpo.py", "--sde-window", "4"]}, common)


def iteration(iterations: int = 4) -> dict:
    common = [
        "--num-steps",
        "20",
        "--iterations",
        str(iterations),
        "--eval-every",
        "0",
        "--sample-every",
        "0",
        "--save-every",
        "0",
        "--kl-beta",
        "0",
        "--no-lora",  # full fine-tuning, as the papers' FLUX runs
    ]
    return timed_runs(
        {
            "dancegrpo": [
                "dancegrpo.py",
                "--group-size",
                "16",
                "--samples-per-device",
                "16",
                "--rollout-batch-size",
                "16",
                "--samples-per-update",
                "16",
                "--timestep-fraction",
                "1.0",
            ],
            **{
                f"branchgrpo_{p}": [
                    "branchgrpo.py",
                    "--trees-per-device",
                    "1",
                    "--trees-per-update",
                    "1",
                    "--rollout-batch-size",
                    "16",
                    "--pruning",
                    p,
                    *(["--window", "4"] if p == "depth" else []),  # the paper's window, not ShapesBench's
                ]
                for p in ("none", "width", "depth", "mix")
            },
        },
        common,
    )


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "rollout"
    print(json.dumps({"rollout": rollout, "iteration": iteration, "mixgrpo": mixgrpo}[what](), indent=1))
