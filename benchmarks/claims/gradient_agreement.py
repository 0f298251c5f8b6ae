"""How much signal is in one iteration's policy gradient? DanceGRPO's and BranchGRPO's per-step likelihood ratios
against V-GRPO's ELBO surrogate.

    python benchmarks/claims/gradient_agreement.py                  # 3 draws of 128 images (16 prompts x 8), ~4 min
    python benchmarks/claims/gradient_agreement.py --draws 5 --images 64
    python benchmarks/claims/gradient_agreement.py --same-noise --steps 0,1,2 --noise-level 1.5   # DanceGRPO variants

On the shipped ShapesBench base model with a fresh LoRA adapter (rank 32, as the V-GRPO default), one iteration
is sampled for each method as its script does by default (DanceGRPO: Flow-GRPO SDE, 10 steps, a = 0.7, every SDE
step trained; V-GRPO: DPM-Solver++ ODE, 10 steps, 4 shared stratified pairs), scored by the learned reward, and
normalised within groups of 8. Each group is split into two halves (even and odd samples: the same prompts, the
advantages of the whole group) and the loss gradient of each half is computed. The cosine between the two
halves' gradients measures what the estimator agrees on beyond its noise: near 0 when the noise dominates, larger
when one iteration's gradient carries a direction that a second sample would confirm. BranchGRPO grows two trees per
prompt at its defaults (16 leaves each, images / 32 prompts, so as many leaves as the other methods' images) and
compares the first trees' gradient with the second trees'.
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
GROUP = 8
METHODS = ("DanceGRPO", "V-GRPO", "BranchGRPO")


def dance_loss(model, tr, cond, lat, lp, adv, sig, g, steps, idx):
    """DanceGRPO's loss of the samples idx, summed over the trained steps (dancegrpo.py's training pass)."""
    import dancegrpo as D

    c, total = {k: v[idx] for k, v in cond.items()}, 0
    for i in steps:
        v = model.velocity(tr, lat[idx, i], sig[i].expand(len(idx)), c, 1.0)
        _, logp, mean, std = D.sde_step(lat[idx, i], v.float(), sig[i], sig[i + 1], g[i], prev_sample=lat[idx, i + 1])
        flags = {"objective": "clip", "clip_range": 1e-3, "kl_mask_threshold": 1e-5, "kl_beta": 0}
        # the clipped objective reads no rollout mean: the step's own stands in for it
        total = (
            total
            + D.policy_loss(logp, lp[idx, i], adv[idx], mean, mean, None, std, sig[i] - sig[i + 1], **flags)[0].mean()
        )
    return total


def vgrpo_loss(model, tr, cond, x, t, eps, old, adv, idx):
    """V-GRPO's loss of the samples idx on their stored pairs (vgrpo.py's training pass)."""
    import vgrpo as V

    new, _ = V.surrogate(model, tr, x[idx], {k: v[idx] for k, v in cond.items()}, t[idx], eps[idx], 1.0, nullcontext)
    return V.policy_loss(new, old[idx], adv[idx], None, None, clip_range=6e-3, kl_beta=0)[0].mean()


def branch_loss(model, tr, B, args, cond, states, log_probs, adv, keep, sigmas, g, tree, trees):
    """BranchGRPO's loss over every trained edge of the trees `trees` (indices of the P trees), as branchgrpo.py's
    training pass: per step, the parents' SDE Gaussian, each child edge's clipped ratio with its child's advantage;
    mean over the trained edges."""
    total, n_edges = 0, 0
    for i in range(len(sigmas) - 1):
        kk, n = tree.children(i), tree.sizes[i]
        nodes = torch.cat([torch.arange(t * n, (t + 1) * n) for t in trees])  # parents of these trees at depth i
        edges = (nodes[:, None] * kk + torch.arange(kk)).flatten()
        mask = keep[i].flatten()[edges]
        if not mask.any():
            continue
        tree_of = nodes // n
        v = model.velocity(
            tr, states[i][nodes], sigmas[i].expand(len(nodes)), {k: c[tree_of] for k, c in cond.items()}, 1.0
        )
        mean, std = B.edge_gaussians(states[i][nodes], v.float(), [(i, nodes)], [mask], sigmas, g, tree)
        logp = B.gaussian_log_prob(states[i + 1][edges][mask], mean, std)
        a = adv[i + 1].flatten()[edges][mask]
        total = (
            total
            + B.policy_loss(
                logp, log_probs[i][edges][mask], a, None, None, None, clip_range=args.clip_range, kl_beta=0
            )[0].sum()
        )
        n_edges += int(mask.sum())
    return total / n_edges


def branch_cosine(model, tr, params, reward, prompts, d: int, n_prompts: int) -> float:
    """Two trees per prompt at branchgrpo.py's defaults (20 steps, dense splits 0,3,6,9, K = 2: 16 leaves, uniform
    fusion, no pruning); the halves are the first and the second tree of every prompt."""
    import branchgrpo as B

    args = B.Args()
    B.resolve_and_check(args)
    splits = B.split_steps(args.split_schedule, args.num_steps, args.num_splits)
    tree = B.Tree(args.num_steps, tuple(splits), args.branch_factor, args.branch_noise, args.branch_s)  # no pruning
    sizes = tree.sizes
    sigmas = B.sigma_schedule(args.num_steps, args.shift)
    g = B.noise_g(sigmas, args.sde_type, args.noise_level)
    ps = [prompts[(7 * k + 13 * d) % len(prompts)] for k in range(n_prompts) for _ in range(2)]
    cond = model.encode_prompts(ps)
    ids, shape = list(range(len(ps))), model.latent_shape()
    roots = torch.stack([torch.randn(shape, generator=B.rng(d, "root", t)) for t in ids])
    noise_fn = partial(B.tree_noise, tree, args.seed, d, ids, shape)
    sde = B.sde_steps(tree, 0)
    with torch.no_grad():
        states, log_probs = B.tree_rollout(
            model, tr, cond, roots, noise_fn, tree, sigmas, g, sde, args.rollout_batch_size, 1.0, nullcontext
        )
        leaf_prompts = [p for p in ps for _ in range(sizes[-1])]
        r = reward(model.decode(states[-1]).float(), leaf_prompts)[0].view(len(ps), sizes[-1])
    values = B.node_values(r, log_probs, sizes, args.fusion, args.fusion_gamma, args.fusion_temperature)
    adv = [a.clamp(-args.adv_clip_max, args.adv_clip_max) for a in B.depth_advantages(values)]
    keep = B.trained_edges(tree, sde, adv[1:], 0)
    halves = []
    for h in range(2):
        tr.zero_grad()
        trees = list(range(h, len(ps), 2))
        branch_loss(model, tr, B, args, cond, states, log_probs, adv, keep, sigmas, g, tree, trees).backward()
        halves.append(torch.cat([p.grad.flatten() for p in params]))
    return float(torch.nn.functional.cosine_similarity(*halves, dim=0))


def measure(
    draws=3,
    images=128,
    noise_level=0.7,
    same_noise=False,
    steps=tuple(range(9)),
    model_id="shapesbench",
    methods=METHODS,
    sde_type="flow",
) -> dict:
    """DanceGRPO's variants: the SDE's g (sde_type 'flow': a sqrt(s / (1 - s)) with a = noise_level; 'dance':
    constant eta = noise_level), one initial noise per group (same_noise), trained steps.
    Per method: the cosines of the draws, their mean, and n0 = images (1 - mean) / mean, the image count at which
    the agreement would be 1/2 if the agreement of n images is n / (n + n0) (independent noise around a fixed
    direction); None when the mean is not positive."""
    import dancegrpo as D
    import vgrpo as V
    from common.models import add_lora, load_model
    from common.prompts import load_prompts
    from common.rewards import build_reward, parse_rewards

    torch.manual_seed(0)
    model = load_model(model_id)
    tr = add_lora(model.transformer.float(), 32, 64.0)
    params = [p for p in tr.parameters() if p.requires_grad]
    reward, prompts = build_reward(parse_rewards("shapes"), "cpu"), load_prompts("shapes-train")
    sig = D.sigma_schedule(10, 3.0)
    g = D.noise_g(sig, sde_type, noise_level)

    def cosine(loss_of) -> float:
        halves = []
        for h in range(2):
            tr.zero_grad()
            loss_of(torch.arange(h, images, 2)).backward()  # even / odd samples: every group in both halves
            halves.append(torch.cat([p.grad.flatten() for p in params]))
        return float(torch.nn.functional.cosine_similarity(*halves, dim=0))

    out = {
        "images": images,
        "group": GROUP,
        "sde_type": sde_type,
        "noise_level": noise_level,
        "same_noise": same_noise,
        "steps": list(steps),
    }
    out.update({k: [] for k in methods})
    for d in range(draws):
        ps = [prompts[(7 * k + 13 * d) % len(prompts)] for k in range(images // GROUP) for _ in range(GROUP)]
        cond = model.encode_prompts(ps)
        gen = torch.Generator().manual_seed(d)
        L = model.latent_shape()  # (4, 8, 8): the VAE latent
        init, noise = torch.randn(images, *L, generator=gen), torch.randn(images, 10, *L, generator=gen)
        with torch.no_grad():
            start = init[::GROUP].repeat_interleave(GROUP, 0) if same_noise else init  # (images, *L)
            lat, lp, _ = D.rollout(model, tr, cond, start, noise, sig, g, list(range(9)), 1.0, nullcontext, D.sde_step)
            adv = D.group_advantages(reward(model.decode(lat[:, -1]).float(), ps)[0], GROUP)

        if "DanceGRPO" in methods:
            loss_of = partial(dance_loss, model, tr, cond, lat, lp, adv, sig, g, steps)
            out["DanceGRPO"].append(round(cosine(loss_of), 4))
        if "V-GRPO" in methods:
            with torch.no_grad():
                x = torch.cat(
                    [
                        V.rollout(model, tr, {k: v[c : c + 16] for k, v in cond.items()}, init[c : c + 16], sig, "dpm++2m", 1.0, nullcontext)
                        for c in range(0, images, 16)
                    ]
                )  # fmt: skip
                adv_v = D.group_advantages(reward(model.decode(x).float(), ps)[0], GROUP)
                t, eps = V.draw_pairs(sig[:-1], 4, L, (0, d), range(images))
                old, _ = V.surrogate(model, tr, x, cond, t, eps, 1.0, nullcontext)

            out["V-GRPO"].append(round(cosine(partial(vgrpo_loss, model, tr, cond, x, t, eps, old, adv_v)), 4))
        if "BranchGRPO" in methods:
            cos = branch_cosine(model, tr, params, reward, prompts, d, max(1, images // 32))
            out["BranchGRPO"].append(round(cos, 4))
        print(f"draw {d}: " + ", ".join(f"{k} {out[k][-1]}" for k in methods), file=sys.stderr)
    for k in methods:
        mean = sum(out[k]) / len(out[k])
        out[f"{k} mean"] = round(mean, 4)
        out[f"{k} n0"] = round(images * (1 - mean) / mean) if mean > 0 else None
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=3, help="independent iterations")
    parser.add_argument("--images", type=int, default=128, help="images per iteration, a multiple of 16")
    parser.add_argument("--sde-type", choices=["flow", "dance"], default="flow", help="DanceGRPO's g, as its flag")
    parser.add_argument("--noise-level", type=float, help="DanceGRPO's a ('flow', default 0.7) or eta ('dance', 0.3)")
    parser.add_argument("--same-noise", action="store_true", help="DanceGRPO: one initial noise per group")
    parser.add_argument("--steps", default="0,1,2,3,4,5,6,7,8", help="DanceGRPO's trained steps (of 0..8)")
    parser.add_argument(
        "--model-id", default="shapesbench", help="a ShapesBench pipeline folder (default: the shipped)"
    )
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="which to measure")
    a = parser.parse_args()
    if a.images % 16 or a.draws < 1:
        parser.error("--images must be a multiple of 16 and --draws >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    steps = [int(i) for i in a.steps.split(",")]
    if not steps or not all(0 <= i <= 8 for i in steps):
        parser.error("--steps: a comma-separated list of steps in 0..8")
    level = a.noise_level if a.noise_level is not None else {"flow": 0.7, "dance": 0.3}[a.sde_type]
    out = measure(a.draws, a.images, level, a.same_noise, steps, a.model_id, a.methods, a.sde_type)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
