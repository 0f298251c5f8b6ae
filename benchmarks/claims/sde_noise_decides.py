"""Does the SDE noise decide the shape, or the initial noise? DanceGRPO's rollout (10 steps, Flow-GRPO noise a = 0.7)
of the 48 held-out prompts x 8 on the shipped ShapesBench model, with independent initial noises or one per group of
8: the shape accuracy, the within-group variance of the verifier's 0/1 shape verdict, and how many groups mix right
and wrong shapes. If one initial noise per group leaves the groups as mixed as independent ones, the per-step noise
that DanceGRPO's likelihood ratios credit is what decides the shape.

    python benchmarks/claims/sde_noise_decides.py        # ~1 min on one thread
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import dancegrpo as D
    from common.models import load_model
    from common.shapesbench import split_prompts, verify

    model = load_model("shapesbench")
    prompts = [p for p in split_prompts("eval") for _ in range(8)]
    cond = model.encode_prompts(prompts)
    sigmas = D.sigma_schedule(10, 3.0)
    g = D.noise_g(sigmas, "flow", 0.7)
    gen = torch.Generator().manual_seed(1)
    init = torch.randn(len(prompts), *model.latent_shape(), generator=gen)
    noise = torch.randn(len(prompts), 10, *model.latent_shape(), generator=gen)
    for name, start in (("independent", init), ("one per group", init[::8].repeat_interleave(8, 0))):
        with torch.no_grad():
            lat, _, _ = D.rollout(
                model, model.transformer, cond, start, noise, sigmas, g, range(9), 1.0, nullcontext, D.sde_step
            )
            ok = verify(model.decode(lat[:, -1]).float(), prompts)["shape"].float().view(-1, 8)  # (48, 8)
        mixed = int(((ok.min(1).values == 0) & (ok.max(1).values == 1)).sum())
        var = ok.var(1, unbiased=False).mean()
        print(f"{name}: shape {ok.mean():.3f}, within-group variance {var:.3f}, mixed groups {mixed}/{len(ok)}")


if __name__ == "__main__":
    main()
