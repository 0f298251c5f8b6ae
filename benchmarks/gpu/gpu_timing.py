"""Time a training script's denoiser work on the GPU: benchmarks/gpu/gpu_check.py runs each of its cases, in the kit's
process, under `timing(clock)`; the command line times any run of a script (a real one, loading its weights from
--model-id).

    python benchmarks/gpu/gpu_timing.py TIMINGS.json dancegrpo.py --model-id ... (the script's own flags)

`timing(clock)` patches, while it is open, the forward of the diffusers denoiser classes and accelerate's
Accelerator.backward to record a CUDA event before and after each call, and common.runs.Run.end_iteration to count
iterations; everything is restored when it closes. Events are read once, at the end (Clock.table), so the run is not
synchronised more than it is without the patches. Per iteration:
  nograd_rows, nograd_s   denoiser forwards without gradients (the rollout; V-GRPO's behaviour values too): rows (one
                          image or video each; a CFG batch counts both halves) and GPU time
  grad_rows, grad_s       forwards with gradients (the training step's)
  backward_s              the backward passes (with gradient checkpointing: the recomputed forwards included)
On a CPU (gpu_check.py --rehearse) the same counts are made with wall-clock times.
"""

from __future__ import annotations

import contextlib
import functools
import json
import runpy
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    """Pairs of CUDA events (or wall-clock times on a CPU) per (iteration, kind), read at the end."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.iteration = 0
        self.spans = []  # (iteration, kind, rows, start, end)

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def timed(self, fn, kind_of, rows_of):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            start = self.now()
            out = fn(*a, **k)
            self.spans.append((self.iteration, kind_of(), rows_of(a, k), start, self.now()))
            return out

        return wrapper

    def table(self) -> list[dict]:
        if self.cuda:
            torch.cuda.synchronize()
        rows = {}
        for it, kind, n, start, end in self.spans:
            r = rows.setdefault(it, {"iteration": it, "nograd_rows": 0, "nograd_s": 0.0, "grad_rows": 0,
                                     "grad_s": 0.0, "backward_s": 0.0})  # fmt: skip
            s = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            r[f"{kind}_s"] += s
            if kind != "backward":
                r[f"{kind}_rows"] += n
        return [rows[k] for k in sorted(rows)]


def hidden_rows(a, k) -> int:
    """Rows of a denoiser call: the batch size of its first input (hidden_states; Z-Image's list of latents)."""
    x = k["hidden_states"] if "hidden_states" in k else a[1]  # a[0] is self
    return len(x) if isinstance(x, (list, tuple)) else int(x.shape[0])


def denoisers() -> list[str]:
    """Every denoiser class common.models runs: benchmarks/gpu/memory.py's plan of each model kind names it (Wan2.2-A14B's
    two experts are two WanTransformer3DModel)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.gpu.memory import PLANS

    return sorted({plan.denoiser for plan in PLANS.values()})


@contextlib.contextmanager
def timing(clock: Clock):
    """While open, every denoiser forward, Accelerator.backward and Run.end_iteration is recorded by `clock`."""
    import diffusers
    from accelerate import Accelerator

    from common import runs

    grad_kind = lambda: "grad" if torch.is_grad_enabled() else "nograd"  # noqa: E731
    saved = [(getattr(diffusers, name), "forward") for name in denoisers()]
    saved += [(Accelerator, "backward"), (runs.Run, "end_iteration")]
    originals = [(owner, attr, owner.__dict__[attr]) for owner, attr in saved]
    end_iteration = runs.Run.end_iteration

    def counted(self, *a, **k):
        end_iteration(self, *a, **k)
        clock.iteration += 1

    try:
        for owner, attr, fn in originals[:-2]:
            setattr(owner, attr, clock.timed(fn, grad_kind, hidden_rows))
        Accelerator.backward = clock.timed(Accelerator.backward, lambda: "backward", lambda a, k: 0)
        runs.Run.end_iteration = counted
        yield clock
    finally:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)


def main():
    out, script, flags = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    sys.path.insert(0, str(ROOT))
    clock = Clock()
    sys.argv = [script, *flags]
    try:
        with timing(clock):
            runpy.run_path(str(ROOT / script), run_name="__main__")
    finally:
        out.write_text(json.dumps(clock.table(), indent=1))


if __name__ == "__main__":
    main()
