"""How much signal is in one iteration's policy gradient? DanceGRPO's per-step likelihood ratio against V-GRPO's ELBO.

    python benchmarks/gradient_agreement.py                  # 3 draws of 128 images (16 prompts x 8), ~3 min
    python benchmarks/gradient_agreement.py --draws 5 --images 64
    python benchmarks/gradient_agreement.py --same-noise --steps 0,1,2 --noise-level 1.5   # DanceGRPO variants

On the shipped ShapesBench base model with a fresh LoRA adapter (rank 32, as the V-GRPO default), one iteration
is sampled for each method as its script does by default (DanceGRPO: Flow-GRPO SDE, 10 steps, a = 0.7, every SDE
step trained; V-GRPO: DPM-Solver++ ODE, 10 steps, 4 shared stratified pairs), scored by the learned reward, and
normalised within groups of 8. Each group is split into two halves (even and odd samples: the same prompts, the
advantages of the whole group) and the loss gradient of each half is computed. The cosine between the two
halves' gradients measures what the estimator agrees on beyond its noise: near 0 when the noise dominates, larger
when one iteration's gradient carries a direction that a second sample would confirm.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GROUP = 8


def dance_loss(model, tr, cond, lat, lp, adv, sig, g, steps, idx):
    """DanceGRPO's loss of the samples idx, summed over the trained steps (dancegrpo.py's training pass)."""
    import dancegrpo as D

    c, total = {k: v[idx] for k, v in cond.items()}, 0
    for i in steps:
        v = model.velocity(tr, lat[idx, i], sig[i].expand(len(idx)), c, 1.0)
        _, logp, _, _ = D.sde_step(lat[idx, i], v.float(), sig[i], sig[i + 1], g[i], prev_sample=lat[idx, i + 1])
        total = total + D.grpo_loss(logp, lp[idx, i], adv[idx], 1e-3)[0].mean()
    return total


def vgrpo_loss(model, tr, cond, x, t, eps, old, adv, idx):
    """V-GRPO's loss of the samples idx on their stored pairs (vgrpo.py's training pass)."""
    import vgrpo as V

    new, _ = V.surrogate(model, tr, x[idx], {k: v[idx] for k, v in cond.items()}, t[idx], eps[idx], 1.0, nullcontext)
    return V.vgrpo_loss(new, old[idx], adv[idx], 6e-3)[0].mean()


def measure(draws=3, images=128, noise_level=0.7, same_noise=False, steps=tuple(range(9))) -> dict:
    """DanceGRPO's variants: SDE noise a = noise_level, one initial noise per group (same_noise), trained steps."""
    import dancegrpo as D
    import vgrpo as V
    from common.models import add_lora, load_model
    from common.prompts import load_prompts
    from common.rewards import build_reward

    torch.manual_seed(0)
    model = load_model("shapesbench")
    tr = add_lora(model.transformer.float(), 32, 64.0)
    params = [p for p in tr.parameters() if p.requires_grad]
    reward, prompts = build_reward("shapes", "cpu"), load_prompts("shapes-train")
    sig = D.sigma_schedule(10, 3.0)
    g = D.noise_g(sig, "flow", noise_level)

    def cosine(loss_of) -> float:
        halves = []
        for h in range(2):
            tr.zero_grad()
            loss_of(torch.arange(h, images, 2)).backward()  # even / odd samples: every group in both halves
            halves.append(torch.cat([p.grad.flatten() for p in params]))
        return float(torch.nn.functional.cosine_similarity(*halves, dim=0))

    out = {"images": images, "group": GROUP, "noise_level": noise_level, "same_noise": same_noise, "steps": list(steps)}
    out.update({"DanceGRPO": [], "V-GRPO": []})
    for d in range(draws):
        ps = [prompts[(7 * k + 13 * d) % len(prompts)] for k in range(images // GROUP) for _ in range(GROUP)]
        cond = model.encode_prompts(ps)
        gen = torch.Generator().manual_seed(d)
        init, noise = torch.randn(images, 3, 32, 32, generator=gen), torch.randn(images, 10, 3, 32, 32, generator=gen)
        with torch.no_grad():
            start = init[::GROUP].repeat_interleave(GROUP, 0) if same_noise else init  # (images, *L)
            lat, lp = D.rollout(model, tr, cond, start, noise, sig, g, list(range(9)), 1.0, nullcontext)
            adv = D.group_advantages(reward(model.decode(lat[:, -1]).float(), ps)[0], GROUP)

        out["DanceGRPO"].append(round(cosine(partial(dance_loss, model, tr, cond, lat, lp, adv, sig, g, steps)), 4))
        with torch.no_grad():
            x = torch.cat(
                [
                    V.rollout(model, tr, {k: v[c : c + 16] for k, v in cond.items()}, init[c : c + 16], sig, "dpm++2m", 1.0, nullcontext)
                    for c in range(0, images, 16)
                ]
            )  # fmt: skip
            adv_v = D.group_advantages(reward(model.decode(x).float(), ps)[0], GROUP)
            t, eps = V.draw_pairs(sig[:-1], 4, (3, 32, 32), (0, d), range(images))
            old, _ = V.surrogate(model, tr, x, cond, t, eps, 1.0, nullcontext)

        out["V-GRPO"].append(round(cosine(partial(vgrpo_loss, model, tr, cond, x, t, eps, old, adv_v)), 4))
        print(f"draw {d}: DanceGRPO {out['DanceGRPO'][-1]}, V-GRPO {out['V-GRPO'][-1]}", file=sys.stderr)
    for k in ("DanceGRPO", "V-GRPO"):
        out[f"{k} mean"] = round(sum(out[k]) / len(out[k]), 4)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=3, help="independent iterations")
    parser.add_argument("--images", type=int, default=128, help="images per iteration, a multiple of 16")
    parser.add_argument("--noise-level", type=float, default=0.7, help="DanceGRPO's flow SDE noise a")
    parser.add_argument("--same-noise", action="store_true", help="DanceGRPO: one initial noise per group")
    parser.add_argument("--steps", default="0,1,2,3,4,5,6,7,8", help="DanceGRPO's trained steps (of 0..8)")
    a = parser.parse_args()
    if a.images % 16 or a.draws < 1:
        parser.error("--images must be a multiple of 16 and --draws >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    steps = [int(i) for i in a.steps.split(",")]
    if not steps or not all(0 <= i <= 8 for i in steps):
        parser.error("--steps: a comma-separated list of steps in 0..8")
    print(json.dumps(measure(a.draws, a.images, a.noise_level, a.same_noise, steps), indent=1))


if __name__ == "__main__":
    main()
