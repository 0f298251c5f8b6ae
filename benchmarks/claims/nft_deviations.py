"""The measured effect of diffusionnft.py's remaining differences from the official DiffusionNFT code (its docstring's
numbered list; docs/diffusionnft.md explains each), on ShapesBench:

    python benchmarks/claims/nft_deviations.py               # every part (about 25 min on one thread)
    python benchmarks/claims/nft_deviations.py --part loss   # 2. the loss in fp32, not float64
    python benchmarks/claims/nft_deviations.py --part eval   # 5. the shared 20-step Euler evaluation, not the official 40
    python benchmarks/claims/nft_deviations.py --part lora   # peft's default LoRA initialisation, not the official Gaussian

2. The loss in fp32 (the official code computes its errors and weights in float64): diffusionnft.py's default run, its
   first --iterations iterations, with policy_loss computed a second and a third time on the same tensors (the
   rollout's x0, the keyed x_t, the old, base and trained velocities), in fp32 and in float64. Reported: the largest
   relative difference of the per-image loss and of its gradient with respect to the trained velocity (what flows
   back into the network), over every micro-batch and trained timestep.
5. The evaluation sampler (the official code evaluates with 40 Euler steps, every script here with --eval-steps 20):
   the base model's held-out reward and ShapesBench accuracies (python -m common.evaluate, the scripts' default
   reward `shapes`, 48 prompts x 4 samples, the same noise) at 20 and at 40 steps.

LoRA initialisation (listed after the numbered differences): diffusionnft.py's default run (30 iterations, seed 0)
   twice, with peft's default initialisation of the adapter (B = 0, A Kaiming-uniform) and with the official
   Gaussian one (B = 0, A normal); both start as the base model. Reported: each run's held-out reward and shape
   accuracy at its evaluations.

The other numbered differences change no number the official code would compute: 1 and 3 draw from the same
distributions (keyed instead of process-local), 4 counts the same steps, 6 and 8 apply only to settings the official
code refuses or gets wrong (no LoRA, FSDP, train-side CFG), 7 is an ablation flag.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402


def precision_gap(policy_loss, v_theta, v_old, v_ref, x0, x_t, t, r, **flags) -> tuple[float, float]:
    """(largest relative difference of the per-image loss, relative difference of its gradient with respect to
    v_theta) between policy_loss in the inputs' fp32 and in float64, on the same values."""

    def loss_and_grad(dtype):
        v = v_theta.detach().to(dtype).requires_grad_()
        cast = [None if a is None else a.detach().to(dtype) for a in (v_old, v_ref, x0, x_t, t, r)]
        loss, _ = policy_loss(v, *cast, **flags)
        (grad,) = torch.autograd.grad(loss.sum(), v)
        return loss.detach().double(), grad.double()

    (l32, g32), (l64, g64) = loss_and_grad(torch.float32), loss_and_grad(torch.float64)
    return ((l32 - l64).abs() / l64.abs()).max().item(), ((g32 - g64).norm() / g64.norm()).item()


def loss_part(iterations: int) -> dict:
    import tyro

    import diffusionnft as N

    original, gaps = N.policy_loss, []

    @functools.wraps(original)  # main() passes the flags its signature names (flags_of)
    def measured(*a, **flags):
        gaps.append(precision_gap(original, *a, **flags))
        return original(*a, **flags)

    N.policy_loss = measured  # main() calls it through the module's globals
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--iterations", str(iterations), "--eval-every", "0", "--sample-every", "0", "--no-save"]
        N.main(tyro.cli(N.Args, args=[*argv, "--output-dir", tmp]))
    N.policy_loss = original
    return {"calls": len(gaps), "loss_rel_max": max(g[0] for g in gaps), "grad_rel_max": max(g[1] for g in gaps)}


def eval_part(samples: int) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for steps in (20, 40):
            cmd = [sys.executable, "-m", "common.evaluate", "--reward", "shapes", "--num-steps", str(steps),
                   "--samples-per-prompt", str(samples), "--out", f"{tmp}/{steps}"]  # fmt: skip
            subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            out[steps] = json.loads(Path(f"{tmp}/{steps}/results.json").read_text())["figures"]["base"]
    return {
        steps: {k: round(v, 4) for k, v in figures.items() if isinstance(v, float)} for steps, figures in out.items()
    }


def lora_part(iterations: int) -> dict:
    import tyro

    import common.models as M
    import diffusionnft as N
    from common.logs import read_metrics

    out, original = {}, M.LoraConfig
    for init in ("default", "gaussian"):
        M.LoraConfig = original if init == "default" else functools.partial(original, init_lora_weights="gaussian")
        with tempfile.TemporaryDirectory() as tmp:
            N.main(tyro.cli(N.Args, args=["--iterations", str(iterations), "--no-save", "--output-dir", tmp]))
            (run,) = Path(tmp).glob("diffusionnft__*")
            evals = [r for r in read_metrics(run) if "eval/reward" in r]
        out[init] = [(r["iteration"], round(r["eval/reward"], 4), round(r["eval/shape_acc"], 4)) for r in evals]
    M.LoraConfig = original
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["loss", "eval", "lora", "all"], default="all")
    p.add_argument("--iterations", type=int, default=2, help="of the default run, for the loss part")
    p.add_argument("--samples", type=int, default=4, help="per held-out prompt, for the evaluation part")
    p.add_argument("--lora-iterations", type=int, default=30, help="of each run, for the LoRA part")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.part in ("loss", "all"):
        print("2. the loss in fp32:", json.dumps(loss_part(a.iterations)), flush=True)
    if a.part in ("eval", "all"):
        print("5. the evaluation at 20 and 40 Euler steps:", json.dumps(eval_part(a.samples)), flush=True)
    if a.part in ("lora", "all"):
        print("LoRA initialisation (iteration, reward, shape accuracy):", json.dumps(lora_part(a.lora_iterations)))


if __name__ == "__main__":
    main()
