"""Peak memory and seconds per gradient step of rlr.py's estimator for h = 1..4, against full backpropagation
through all sampling steps, on ShapesBench (or any --model-id). Each configuration runs in its own process, so
its peak is its own: CUDA allocator peak on a GPU, max resident set size (getrusage) on a CPU, reported both
absolute and above the same process's level after loading and one sampling pass without a graph.

    python benchmarks/gpu/rlr_memory.py                                   # ShapesBench, T = 10, batch 8, CPU
    python benchmarks/gpu/rlr_memory.py --num-steps 20 --batch 16 --reps 5 --out rlr_memory.json
    python benchmarks/gpu/rlr_memory.py --device cuda --model-id /path/to/sd15 --reward hpsv2.1 ...

One "step" is one gradient of the batch: for RLR the rollout (ZO steps perturbed), the FO backward through the last
step, decoder and reward, the HO recompute and backward through h steps, and the ZO regeneration; for full BP a
rollout with a graph through every step, the decoder and the reward, and one backward. The slope of memory in h
is B_h of the paper's h* rule (rlr.py --ho-step-gb).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def peak_gb(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def worker(a) -> dict:
    """One configuration in this process: returns seconds per step and peak memory."""
    sys.path.insert(0, str(ROOT))
    import torch

    import rlr as R
    from common.attention import set_attention_backend
    from common.models import load_model
    from common.prompts import load_prompts
    from common.rewards import build_reward, parse_rewards

    device = torch.device(a.device)
    set_attention_backend(a.attention_backend, device)  # as rlr.py's run would
    model = load_model(a.model_id, device=device)
    module = (model.unet if model.kind == "sd1" else model.transformer).float().eval()
    params = [p for p in module.parameters() if p.requires_grad]
    reward_fn = build_reward(parse_rewards(a.reward), device)
    noise_level = a.noise_level if a.noise_level is not None else 1.0 if model.kind == "sd1" else 0.7
    sched = R.make_schedule(model, a.num_steps, noise_level)
    prompts = (load_prompts(a.prompts) * a.batch)[: a.batch]
    cond = model.encode_prompts(prompts)
    T, shape = a.num_steps, model.latent_shape()
    gen = torch.Generator().manual_seed(0)

    def mean_std(i, x):
        return R.transition(model, module, sched, i, x, cond, 1.0, nullcontext)

    def draw():
        return (
            torch.randn(a.batch, *shape, generator=gen).to(device),
            torch.randn(a.batch, T - 1, *shape, generator=gen).to(device),
        )

    x0, noise = draw()
    R.rollout(mean_std, x0, noise)  # warm-up without a graph: the baseline level
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    base = peak_gb(device)

    def rlr_step(it):
        x0, noise = draw()
        j = R.window_starts(T, a.h)[it % len(R.window_starts(T, a.h))]
        zo = R.zo_steps_of(T, j, a.h)
        latents = R.rollout(
            mean_std, x0, noise, zo, lambda i: R.perturbed(params, R.zo_noise(params, R.key_seed(it, i), 1e-3))
        )
        x_last, _ = mean_std(T - 1, latents[:, -1])
        r, _ = reward_fn(model.decode(x_last).float(), prompts)
        (-r.mean()).backward()
        log_prob, _ = R.subchain_log_prob(mean_std, latents, noise, j, a.h)
        adv = r.detach() - r.detach().mean()
        (-(adv * log_prob).mean()).backward()
        for i in zo:
            R.add_zo_grad(params, R.zo_noise(params, R.key_seed(it, i), 1e-3), adv.mean() / a.batch, 1e-3)

    def full_step(it):
        x, noise = draw()
        for i in range(T):
            mean, std = mean_std(i, x)
            x = mean + std * noise[:, i] if i < T - 1 else mean
        r, _ = reward_fn(model.decode(x).float(), prompts)
        (-r.mean()).backward()

    step = full_step if a.mode == "full" else rlr_step
    times = []
    for it in range(a.warmup + a.reps):
        t = time.perf_counter()
        step(it)
        for p in params:
            p.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if it >= a.warmup:
            times.append(time.perf_counter() - t)
    peak = peak_gb(device)
    return {
        "mode": a.mode,
        "h": a.h if a.mode == "rlr" else T,
        "num_steps": T,
        "batch": a.batch,
        "device": a.device,
        "s_per_step": sum(times) / len(times),
        "peak_gb": peak,
        "peak_above_base_gb": peak - base,
        "base_gb": base,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default="shapesbench")
    p.add_argument("--reward", default="shapes", help="a differentiable reward spec, as rlr.py --reward")
    p.add_argument("--prompts", default="shapes-train")
    p.add_argument("--num-steps", type=int, default=10)
    p.add_argument("--noise-level", type=float, default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hs", default="1,2,3,4", help="comma-separated sub-chain lengths")
    p.add_argument("--no-full", action="store_true", help="skip full backpropagation")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--attention-backend", default="auto", help="as rlr.py's flag (common/attention.py)")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="rlr", help=argparse.SUPPRESS)
    p.add_argument("--h", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a)))
        return
    configs = [("rlr", int(h)) for h in a.hs.split(",")] + ([] if a.no_full else [("full", 0)])
    passthrough = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(a).items()
        if k in ("model_id", "reward", "prompts", "num_steps", "batch", "reps", "warmup", "device", "attention_backend")
        and v is not None
    ]
    if a.noise_level is not None:
        passthrough.append(f"--noise-level={a.noise_level}")
    rows = []
    for mode, h in configs:
        out = subprocess.run(
            [sys.executable, __file__, "--worker", "--mode", mode, "--h", str(h), *passthrough],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not line:
            sys.exit(f"{mode} h={h} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        rows.append(json.loads(line[0][7:]))
        r = rows[-1]
        print(
            f"{'full BP' if mode == 'full' else f'RLR h={h}':>9}  {r['s_per_step']:7.2f} s/step  peak {r['peak_gb']:.3f} GB  "
            f"(+{r['peak_above_base_gb']:.3f} GB over sampling alone)",
            flush=True,
        )
    hs = [r for r in rows if r["mode"] == "rlr"]
    if len(hs) >= 2:
        slope = (hs[-1]["peak_above_base_gb"] - hs[0]["peak_above_base_gb"]) / (hs[-1]["h"] - hs[0]["h"])
        print(f"memory per back-propagated step (B_h, batch {a.batch}): {slope:.3f} GB")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
