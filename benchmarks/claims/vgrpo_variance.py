# V-GRPO surrogate variance on ShapesBench: docs/vgrpo.md "Results"; paper: arXiv 2604.23380 (Fig. 2, Table 4 text)
"""How much do V-GRPO's three variance-reduction techniques (stratified timesteps, pairs shared by the group,
self-normalisation) reduce the variability of the ELBO surrogate, on the shipped ShapesBench model?

Images are sampled once (DPM-Solver++(2M) ODE, `--num-steps`, each image its own noise, G per prompt), then the
per-image surrogate S(x) = mean over N_MC pairs of the per-pair values (vgrpo.py's own functions) is evaluated for
`--draws` independent pair draws under each configuration. Reported per configuration:
  cv        std / |mean| of S over all images, one draw at a time, averaged over draws  (paper: 0.230 -> 0.128)
  group_cv  std / |mean| of S within each prompt group, averaged over groups and draws   (paper: 0.170 -> 0.038)
  mc_cv     std / |mean| of S across draws for one image, averaged over images (the estimator's own noise)
The paper does not define its population precisely; docs/vgrpo.md says what we take and why.

    python benchmarks/claims/vgrpo_variance.py                                   # 16 prompts x 8 images, 8 draws (minutes)
    python benchmarks/claims/vgrpo_variance.py --prompts 4 --group-size 4 --draws 3   # a quick look
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import vgrpo as V
from common.models import load_model
from common.prompts import load_prompts

# name -> (stratified, shared_pairs, self_normalize); "all" and "none" are the paper's two ends
CONFIGS = {
    "all": (True, True, True),
    "none": (False, False, False),
    "no-stratified": (False, True, True),
    "no-shared-pairs": (True, False, True),
    "no-self-normalize": (True, True, False),
}


@dataclass
class Args:
    model_id: str = "shapesbench"
    """the model to measure (default: the shipped ShapesBench model)"""
    prompts: int = 16
    """training prompts used (the first ones of a seeded permutation of shapes-train)"""
    group_size: int = 8
    """images per prompt"""
    draws: int = 8
    """independent (t, eps) pair draws per configuration"""
    n_mc: int = 4
    """pairs per image"""
    num_steps: int = 10
    """rollout steps (and the timestep grid of the pairs)"""
    shift: float = 3.0
    """time shift of the schedule"""
    prediction: Literal["x", "v", "eps"] = "x"
    """error space of the surrogate: x, v or eps"""
    batch_size: int = 16
    """images per forward (x n_mc rows in the surrogate)"""
    seed: int = 0
    """seed of prompts, noise and pairs"""
    out: Optional[str] = None
    """also write the results as JSON here"""


def main(args: Args) -> dict:
    t0 = time.perf_counter()
    model = load_model(args.model_id)
    tr = model.transformer.eval()
    pick = torch.randperm(len(load_prompts("shapes-train")), generator=V.rng(args.seed, "bench-prompts"))[
        : args.prompts
    ]
    prompts = [load_prompts("shapes-train")[i] for i in pick for _ in range(args.group_size)]
    n, shape = len(prompts), model.latent_shape()
    sigmas = V.sigma_schedule(args.num_steps, args.shift)
    cond = model.encode_prompts(prompts)
    noise = torch.stack([torch.randn(shape, generator=V.rng(args.seed, "bench-init", k)) for k in range(n)])
    chunks = [slice(c, c + args.batch_size) for c in range(0, n, args.batch_size)]
    x = torch.cat(
        [
            V.rollout(model, tr, {k: v[sl] for k, v in cond.items()}, noise[sl], sigmas, "dpm++2m", 1.0, nullcontext)
            for sl in chunks
        ]
    )
    results = {}
    with torch.no_grad():
        for name, (stratified, shared, self_norm) in CONFIGS.items():
            S = torch.empty(args.draws, n)  # (draws, images) per-image surrogates
            for d in range(args.draws):
                t, eps = V.draw_pairs(
                    sigmas[:-1], args.n_mc, shape, (args.seed, "bench", d), range(n), stratified, shared
                )
                for sl in chunks:
                    values, _ = V.surrogate(
                        model,
                        tr,
                        x[sl],
                        {k: v[sl] for k, v in cond.items()},
                        t[sl],
                        eps[sl],
                        1.0,
                        nullcontext,
                        args.prediction,
                        self_norm,
                    )
                    S[d, sl] = values.mean(1)
            cvs = [V.coefficient_of_variation(S[d], args.group_size) for d in range(args.draws)]
            S64 = S.double()
            results[name] = {
                "cv": sum(c for c, _ in cvs) / len(cvs),
                "group_cv": sum(g for _, g in cvs) / len(cvs),
                "mc_cv": (S64.std(0) / S64.mean(0).abs()).mean().item() if args.draws > 1 else float("nan"),
                "mean": S64.mean().item(),
            }
    print(
        f"{n} images ({args.prompts} prompts x {args.group_size}), {args.draws} draws of {args.n_mc} pairs, "
        f"{args.prediction}-prediction, {args.num_steps}-step grid, {time.perf_counter() - t0:.0f} s"
    )
    print(
        "| config | stratified | shared | self-norm | cv | group_cv | mc_cv | mean S |\n|---|---|---|---|---|---|---|---|"
    )
    for name, r in results.items():
        flags = " | ".join("yes" if f else "no" for f in CONFIGS[name])
        print(f"| {name} | {flags} | {r['cv']:.3f} | {r['group_cv']:.3f} | {r['mc_cv']:.3f} | {r['mean']:.4f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
