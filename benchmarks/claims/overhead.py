"""Where a training iteration's time goes: the transformer's forward and backward, or the rest (the overhead).

    python benchmarks/claims/overhead.py                                  # each script's default iteration, ShapesBench
    python benchmarks/claims/overhead.py --scripts vgrpo.py --iterations 4

Each script runs in this process at its defaults, with --iterations N and no evaluation, grids or checkpoints, and
timers around: every forward of the trained denoiser (a forward pre-hook and hook on the top-level module: rollouts,
behaviour passes and training alike; a frozen KL reference copied from it carries the same hooks), every
`accelerator.backward` (the transformer's backward; in rlr.py's first-order term also the decoder's and the reward
model's), the reward, image decoding, prompt encoding, the optimizer step (clipping, the all-process finite check,
`step`, `zero_grad`),
logging (`Run.end_iteration`) and, in rlr.py, drawing the zero-order parameter perturbations and adding their
gradient (`zo_noise`, `add_zo_grad`; applying and undoing a perturbation falls under "other"). An iteration is the
time between two `Run.end_iteration` returns; the first iteration is dropped (warm-up) and the others are averaged.
"other" is what no timer covers: log-probs, tree bookkeeping, advantages, Python. Prints a JSON table and, with
--out, writes it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
SCRIPTS = ["dancegrpo.py", "branchgrpo.py", "vgrpo.py", "rlr.py"]
PARTS = ["forward", "backward", "reward", "decode", "encode_prompts", "optimizer", "logging", "zo_noise"]
ZO = ["zo_noise", "add_zo_grad"]  # rlr.py's zero-order term: drawing the parameter perturbations, adding their gradient


class Timers:
    """Accumulated seconds per part; `snapshot()` at each iteration end gives per-iteration figures."""

    def __init__(self):
        self.total, self.rows, self.last = defaultdict(float), [], None

    def wrap(self, part, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total[part] += time.perf_counter() - t0

        return timed

    def hook(self, module):
        """Time and count every forward of `module` (not re-entrant: the top-level module is never called inside
        itself). A copy of the module (a frozen KL reference) carries these hooks with it."""
        start = {}

        def before(m, a):
            start["t"] = time.perf_counter()

        def after(m, a, out):
            self.total["forward"] += time.perf_counter() - start["t"]
            self.total["forward_calls"] += 1

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)
        return module

    def snapshot(self):
        now = time.perf_counter()
        if self.last is not None:
            row = {p: self.total[p] - self.last[1].get(p, 0.0) for p in [*PARTS, "forward_calls"]}
            row["iteration"] = now - self.last[0]
            self.rows.append(row)
        self.last = (now, dict(self.total))


def measure(script: str, iterations: int, extra: list[str]) -> dict:
    """Run `script`'s main() with timers patched in; returns mean seconds per part over iterations 2..N."""
    import tyro
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    from common import rewards, runs

    module = importlib.import_module(Path(script).stem)
    timers = Timers()
    originals = {
        (Accelerator, "backward"): Accelerator.backward,
        (Accelerator, "clip_grad_norm_"): Accelerator.clip_grad_norm_,
        (AcceleratedOptimizer, "step"): AcceleratedOptimizer.step,
        (AcceleratedOptimizer, "zero_grad"): AcceleratedOptimizer.zero_grad,
        (runs.Run, "end_iteration"): runs.Run.end_iteration,
        (rewards.CompositeReward, "__call__"): rewards.CompositeReward.__call__,
        (rewards.CompositeReward, "request"): rewards.CompositeReward.request,
        (rewards.CompositeReward, "collect"): rewards.CompositeReward.collect,
    }
    module_originals = {
        name: getattr(module, name)
        for name in ("load_model", "trainable_denoiser", "all_finite", *ZO)
        if hasattr(module, name)
    }

    def load_model(*a, **kw):
        model = module_originals["load_model"](*a, **kw)
        model.decode = timers.wrap("decode", model.decode)
        model.encode_prompts = timers.wrap("encode_prompts", model.encode_prompts)
        return model

    def end_iteration(self, *a, **kw):
        out = timers.wrap("logging", originals[(runs.Run, "end_iteration")])(self, *a, **kw)
        timers.snapshot()
        return out

    Accelerator.backward = timers.wrap("backward", originals[(Accelerator, "backward")])
    for owner, name in [
        (Accelerator, "clip_grad_norm_"),
        (AcceleratedOptimizer, "step"),
        (AcceleratedOptimizer, "zero_grad"),
    ]:  # fmt: skip  (the optimizer step, in the scripts)
        setattr(owner, name, timers.wrap("optimizer", originals[owner, name]))
    module.all_finite = timers.wrap("optimizer", module_originals["all_finite"])  # the step's all-process check
    runs.Run.end_iteration = end_iteration
    for name in ("__call__", "request", "collect"):  # the scripts score rollouts with request + collect
        setattr(rewards.CompositeReward, name, timers.wrap("reward", originals[(rewards.CompositeReward, name)]))
    module.load_model = load_model
    for name in ZO:
        if name in module_originals:
            setattr(module, name, timers.wrap("zo_noise", module_originals[name]))
    module.trainable_denoiser = lambda *a, **kw: timers.hook(module_originals["trainable_denoiser"](*a, **kw))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            argv = ["--iterations", str(iterations), "--eval-every", "0", "--sample-every", "0", "--save-every", "0"]
            args = tyro.cli(module.Args, args=[*argv, "--output-dir", tmp, *extra])
            module.main(args)
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)
        for name, fn in module_originals.items():
            setattr(module, name, fn)
    rows = timers.rows[1:]  # the first iteration warms up
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    out = {"s_per_iteration": round(mean["iteration"], 3), "forward_calls": mean["forward_calls"]}
    out.update({f"{p}_share": round(mean[p] / mean["iteration"], 3) for p in PARTS})
    out["other_share"] = round(1 - sum(mean[p] for p in PARTS) / mean["iteration"], 3)
    out["overhead_share"] = round(1 - (mean["forward"] + mean["backward"]) / mean["iteration"], 3)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scripts", nargs="+", default=SCRIPTS, choices=SCRIPTS)
    parser.add_argument("--iterations", type=int, default=3, help="iterations per script (the first is dropped)")
    parser.add_argument("--out", help="also write the JSON table here")
    a = parser.parse_args()
    if a.iterations < 2:
        parser.error("--iterations must be >= 2 (the first iteration is dropped)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    table = {"threads": torch.get_num_threads(), "iterations": a.iterations}
    for script in a.scripts:
        print(f"== {script}", file=sys.stderr)
        table[script] = measure(script, a.iterations, [])
        print(json.dumps({script: table[script]}), file=sys.stderr)
    print(json.dumps(table, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
