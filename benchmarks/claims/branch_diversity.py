"""Does branching keep the diversity of independent sampling? (BranchGRPO, arXiv 2509.06040, section 3.1)

    python benchmarks/claims/branch_diversity.py                       # 16 held-out prompts, every configuration below
    python benchmarks/claims/branch_diversity.py --prompts 4 --out /tmp/div.json

For each held-out ShapesBench prompt, the M = 16 leaves of one tree of the shipped base model (20 steps, K = 2,
Flow-GRPO SDE noise a = 0.7, as branchgrpo.py's defaults) are compared with 16 independent SDE samples of the same
model and prompt (no splits: the same sampler with one root per sample). Distances are measured on the learned
reward's image embeddings (64-d, unit norm): the unbiased MMD^2 with a Gaussian kernel (bandwidth: the median
pairwise distance of the pooled features) and the KID (MMD^2 with the cubic kernel (x.y / d + 1)^3), both averaged
over prompts; plus the verifier's diversity (mean pairwise RMS pixel distance within a prompt's samples). The noise
floor is a second set of 16 independent samples against the first. Configurations: the paper's correlated branch
noise with s in {0, 1, 4, 16} (siblings' noise correlation 1 / (1 + s)) on the dense splits 0,3,6,9; the release's
scaled independent noise (x4); and the sparse (0,5,10,15) and late (10,12,14,16) split schedules with s = 4.
Prints a JSON table; docs/branchgrpo.md holds the one we measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CONFIGS = {  # name: (split schedule, branch noise, s); s = 0: siblings share their split-step noise (not later ones)
    "dense, correlated s=0": ("dense", "correlated", 0.0),
    "dense, correlated s=1": ("dense", "correlated", 1.0),
    "dense, correlated s=4 (default)": ("dense", "correlated", 4.0),
    "dense, correlated s=16": ("dense", "correlated", 16.0),
    "dense, scaled x4 (release)": ("dense", "scaled", 4.0),
    "sparse, correlated s=4": ("sparse", "correlated", 4.0),
    "late, correlated s=4": ("late", "correlated", 4.0),
}


def mmd2(x: torch.Tensor, y: torch.Tensor, kernel: str = "rbf", bandwidth: float | None = None) -> float:
    """Unbiased MMD^2 between samples x (n, d) and y (m, d): mean k(x, x') + mean k(y, y') - 2 mean k(x, y), the
    first two over distinct pairs. kernel 'rbf': exp(-|a - b|^2 / (2 h^2)), h = `bandwidth` or the median pairwise
    distance of the pooled samples; 'poly': (a.b / d + 1)^3 (the KID's kernel)."""
    x, y = x.double(), y.double()
    z = torch.cat([x, y])
    if kernel == "rbf":
        d2 = torch.cdist(z, z).square()
        if bandwidth is None:
            bandwidth = float(d2[torch.triu_indices(len(z), len(z), 1).unbind()].sqrt().median().clamp_min(1e-12))
        k = torch.exp(-d2 / (2 * bandwidth**2))
    elif kernel == "poly":
        k = (z @ z.T / z.shape[1] + 1) ** 3
    else:
        raise ValueError(f"kernel {kernel!r}: use 'rbf' or 'poly'")
    n = len(x)
    kxx, kyy, kxy = k[:n, :n], k[n:, n:], k[:n, n:]
    off = lambda a: (a.sum() - a.diagonal().sum()) / (len(a) * (len(a) - 1))  # noqa: E731
    return float(off(kxx) + off(kyy) - 2 * kxy.mean())


@torch.no_grad()
def samples(model, cond, splits, args, seed: int, n_roots: int, latent_shape) -> torch.Tensor:
    """Images (leaves, 3, H, W) in [0, 1] of n_roots trees (n_roots = 1: one tree; splits = []: independent samples)."""
    import branchgrpo as B

    sigmas = B.sigma_schedule(args.num_steps, args.shift)
    g = B.noise_g(sigmas, args.sde_type, args.noise_level)
    roots = torch.stack([torch.randn(latent_shape, generator=B.rng(seed, "root", t)) for t in range(n_roots)])
    tree = B.Tree(args.num_steps, tuple(splits), args.branch_factor, args.branch_noise, args.branch_s)
    noise_fn = partial(B.tree_noise, tree, args.seed, seed, list(range(n_roots)), latent_shape)
    cond = {k: v.expand(n_roots, *v.shape[1:]) for k, v in cond.items()}
    sde = list(range(args.num_steps - 1))
    states, _ = B.tree_rollout(
        model, model.transformer, cond, roots, noise_fn, tree, sigmas, g, sde, args.rollout_batch_size, 1.0, nullcontext
    )
    return model.decode(states[-1]).float()


def measure(n_prompts: int, configs: dict = CONFIGS) -> dict:
    import branchgrpo as B
    from common.models import load_model
    from common.prompts import load_prompts
    from common.shapesbench import diversity
    from common.shapesbench.reward import load_reward_model

    model, reward = load_model("shapesbench"), load_reward_model()
    prompts = load_prompts("shapes-eval")[:: max(1, 48 // n_prompts)][:n_prompts]
    base = B.Args(noise_level=0.7, shift=3.0)  # ShapesBench's static grid (no resolve_and_check here)
    shape = model.latent_shape()
    feats = lambda img: reward.image_features(img) * 8  # noqa: E731  (unit norm x sqrt(64): a.b / d is the cosine)
    independent, floor = [], []
    for j, p in enumerate(prompts):
        cond = model.encode_prompts([p])
        independent.append(samples(model, cond, [], base, 1000 + j, 16, shape))
        floor.append(samples(model, cond, [], base, 2000 + j, 16, shape))
    ind_f = [feats(x) for x in independent]

    def row(sets):
        f = [feats(x) for x in sets]
        return {
            "mmd2_rbf": round(sum(mmd2(a, b) for a, b in zip(f, ind_f)) / len(f), 4),
            "kid": round(sum(mmd2(a, b, "poly") for a, b in zip(f, ind_f)) / len(f), 4),
            "diversity": round(sum(diversity(x, [p] * len(x)) for x, p in zip(sets, prompts)) / len(sets), 4),
        }

    table = {"prompts": len(prompts), "threads": torch.get_num_threads()}
    table["independent vs independent (noise floor)"] = row(floor)
    for name, (schedule, noise, s) in configs.items():
        t0 = time.perf_counter()
        args = B.Args(noise_level=0.7, shift=3.0, split_schedule=schedule, branch_noise=noise, branch_s=s)
        splits = B.split_steps(schedule, args.num_steps, args.num_splits)
        trees = [
            samples(model, model.encode_prompts([p]), splits, args, 3000 + j, 1, shape) for j, p in enumerate(prompts)
        ]
        table[name] = {**row(trees), "splits": splits, "s": round(time.perf_counter() - t0, 1)}
        print(name, table[name], file=sys.stderr)
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts (spread over the 48)")
    parser.add_argument("--out", help="also write the JSON table here")
    a = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    table = measure(a.prompts)
    print(json.dumps(table, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
