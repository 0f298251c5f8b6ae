# BranchGRPO: docs/branchgrpo.md; paper: arXiv 2509.06040 (Li et al., "BranchGRPO: Stable and Efficient GRPO with Structured Branching")
"""GRPO on tree-structured SDE rollouts of a flow-matching text-to-image model, one file.

Every prompt grows one tree: the trajectories share their early denoising prefix and split into K children
at chosen steps, so 16 leaves cost 203 node forwards instead of 320 (20 steps, splits 0,3,6,9, K = 2). All
nodes of a depth go through one batched forward. Leaf rewards are fused upward into node values, normalised
per depth within the tree, and each edge parent -> child is trained with its child's advantage under the
PPO-clipped ratio of its SDE step. Width pruning, depth pruning or a sliding ODE/SDE mix only change which
edges are trained, never the rollout or the rewards.

Launch (run.sh has more):
    python branchgrpo.py                                            # ShapesBench on CPU, ~4 min
    python branchgrpo.py --pruning depth                            # depth pruning (4-step window, slides every 30 it.)
    PROMPTS=prompts.txt bash run.sh branchgrpo-flux-8gpu            # FLUX.1-dev, depth pruning, 8 GPUs; docs/gpu.md: all of them
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 branchgrpo.py   # 2 CPU processes
    python branchgrpo.py --resume-from latest                       # continue the newest runs/branchgrpo__*

ShapesBench defaults that differ from the paper (run.sh's GPU recipes use the paper's): --sde-type flow (a = 0.7), not
constant eta 0.3; --clip-range 1e-3, not 1e-4 (log-probs are means over latent dimensions: ratios move ~4.6x more
over ShapesBench's 3072 than FLUX's 65536); common/runs.py's optimiser defaults (LoRA r32, lr 3e-4, wd 10, 40 it.).
Deviations from the official release (docs/branchgrpo.md explains each): the paper's correlated branch noise (the
release's 4x scaled independent noise is --branch-noise scaled, scored under the std it uses); nodes batched per
depth; path fusion as a softmax over descendant leaves; parent-top1 width pruning keeps each last-split parent's best
chain; depth and Mix windows slide with iterations; the deterministic last step is not trained; optimizer steps
counted in trees, not edges.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import Literal, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from common import InputError
from common.models import frozen_copy, load_model, reference_velocity, trainable_denoiser
from common.rewards import build_reward
from common.runs import Evaluator, Run, RunArgs, check_run_args, cli, draw_prompts, need
from common.sampling import ode_sampler


@dataclass
class Args(RunArgs):  # the shared flags (--model-id, --reward, --iterations, ...) are in common/runs.py
    num_steps: int = 20
    """sampling steps T of a rollout (shifted sigma schedule), as the paper"""
    shift: float = 3.0
    """SD3 time shift k of the sigma schedule: s' = k s / (1 + (k - 1) s)"""
    sde_type: Literal["dance", "flow"] = "flow"
    """noise schedule g(sigma): 'dance' = constant eta (DanceGRPO, the release), 'flow' = a sqrt(sigma / (1 - sigma))"""
    noise_level: Optional[float] = None
    """eta for 'dance' (if unset: 0.3), a for 'flow' (if unset: 0.7)"""
    split_schedule: str = "dense"
    """split steps: 'dense' (0,3,6,...), 'sparse' (evenly spread), 'late' (second half) or a list like '0,3,6,9'"""
    num_splits: int = 4
    """number of split steps for the named schedules"""
    branch_factor: int = 2
    """children per split (K); leaves per tree = K ** splits"""
    branch_noise: Literal["correlated", "scaled"] = "correlated"
    """'correlated': siblings share part of their noise, each child is an exact SDE step (paper); 'scaled': independent noise times s (release)"""
    branch_s: float = 4.0
    """correlated: ratio of branch-specific to shared noise variance, rho = 1 / (1 + s); scaled: the noise multiplier"""
    trees_per_device: int = 2
    """prompts (trees) per process per iteration"""
    trees_per_update: int = 1
    """trees whose edges are accumulated into one optimizer step"""
    rollout_batch_size: int = 16
    """nodes per transformer forward (batched per depth); also the training micro-batch of parents"""
    fusion: Literal["uniform", "path"] = "uniform"
    """node value from its leaves: 'uniform' mean, or 'path' softmax of beta * path log-prob / temperature"""
    fusion_beta: Optional[float] = None
    """'path' fusion: weight of the path log-prob (if unset: 1.0; 0 gives uniform)"""
    fusion_temperature: Optional[float] = None
    """'path' fusion: softmax temperature (if unset: 1.0)"""
    pruning: Literal["none", "width", "depth", "mix"] = "none"
    """which edges are trained: all, width-pruned, depth-pruned, or only SDE edges of a sliding Mix window"""
    width_mode: Optional[Literal["parent-top1", "extreme"]] = None
    """--pruning width: 'parent-top1' (if unset) or 'extreme'"""
    width_keep_ratio: Optional[float] = None
    """--width-mode extreme: fraction of post-split chains kept, half best and half worst (if unset: 0.5)"""
    window: Optional[int] = None
    """--pruning depth / mix: window size in steps (if unset: 4)"""
    window_shift_every: Optional[int] = None
    """--pruning depth / mix: the window moves one step deeper every N iterations (if unset: 30)"""
    clip_range: float = 1e-3
    """PPO clip epsilon on the ratio (log-probs are means over latent dimensions, hence small)"""
    adv_clip_max: float = 5.0
    """advantages are clipped to +-this"""
    kl_beta: float = 0.04
    """weight of the per-step Gaussian KL to the frozen base model (0 = off, as the release)"""


# ---------------------------------------------------------------------------------------------------
# ALGO LOGIC: schedule and SDE step (copies of dancegrpo.py's), the tree, fusion, advantages, pruning
# Notation (docs/math.md): T steps, K children per split, M = K ** splits leaves per tree, P trees in a batch,
# n_d nodes at depth d, *L the latent shape
# ---------------------------------------------------------------------------------------------------
def sigma_schedule(num_steps: int, shift: float) -> torch.Tensor:  # same as in dancegrpo.py
    """linspace(1, 0, T + 1) warped by s' = k s / (1 + (k - 1) s) (SD3 shift); shape (T + 1,)."""
    s = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)
    return (shift * s / (1 + (shift - 1) * s)).float()


def noise_g(sigmas: torch.Tensor, sde_type: str, level: float) -> torch.Tensor:  # same as in dancegrpo.py
    """Diffusion coefficient g_i of each step i (T,). DanceGRPO: constant eta. Flow-GRPO: a sqrt(s / (1 - s)),
    with sigmas[1] standing in for the first sigma in the denominator, as Flow-GRPO does (1 - 1 = 0)."""
    s = sigmas[:-1]
    if sde_type == "dance":
        return torch.full_like(s, level)
    s_den = torch.where(s >= 1, sigmas[1], s)
    return level * torch.sqrt(s / (1 - s_den))


def step_mean_std(x, v, sigma, sigma_next, g):
    """Mean and std of one reverse-SDE step (docs/math.md; the body of dancegrpo.py's sde_step). x, v: (B, *L) fp32.
    x0_hat = x - sigma v, score = -(x - (1 - sigma) x0_hat) / sigma^2, mean = x + d (v - g^2/2 score), std = g sqrt(-d)."""
    d = float(sigma_next - sigma)
    x0_hat = x - float(sigma) * v
    score = -(x - (1 - float(sigma)) * x0_hat) / float(sigma) ** 2
    return x + d * (v - float(g) ** 2 / 2 * score), float(g) * math.sqrt(-d)


def gaussian_log_prob(x_next, mean, std):
    """Full Gaussian log-density of x_next under N(mean, std^2), averaged over latent dimensions (as dancegrpo.py). (B,)"""
    std = torch.as_tensor(std, dtype=x_next.dtype, device=x_next.device).reshape((-1,) + (1,) * (x_next.dim() - 1))
    lp = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(1)


def grpo_loss(log_prob, old_log_prob, adv, clip_range: float):  # same as in dancegrpo.py
    """PPO-clipped surrogate per sample: max(-A r, -A clip(r, 1 - eps, 1 + eps)), r = exp(logp - logp_old). (B,)"""
    ratio = torch.exp(log_prob - old_log_prob)
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)), ratio


def rng(*keys) -> torch.Generator:  # same as in dancegrpo.py
    """A CPU generator seeded by a stable hash of `keys`, e.g. (seed, iteration, "noise", sample_index)."""
    digest = hashlib.sha256(repr(keys).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def split_steps(schedule: str, num_steps: int, num_splits: int) -> list[int]:
    """Split steps of the tree. 'dense': every 3rd step from 0 (0,3,6,9 for 4 splits: the release's launcher schedule,
    taken as the paper's Dense, whose steps §4.2 does not list); 'sparse': spread evenly over the trajectory (0,5,10,15 for 20 steps); 'late': spread evenly over the
    second half (10,12,14,16 for 20 steps); or an explicit comma-separated list. Splits must precede the last step."""
    if schedule == "dense":
        return [3 * k for k in range(num_splits)]
    if schedule == "sparse":
        return [k * (num_steps // num_splits) for k in range(num_splits)]
    if schedule == "late":
        half = num_steps // 2
        return [half + k * max(1, (num_steps - 1 - half) // num_splits) for k in range(num_splits)]
    try:
        return sorted({int(s) for s in schedule.split(",")})
    except ValueError:
        raise InputError(f"--split-schedule {schedule!r}: use dense, sparse, late or a list like 0,3,6,9") from None


def tree_sizes(num_steps: int, splits: list[int], k: int) -> list[int]:
    """Nodes per depth (T + 1,): depth 0 is the root x_0 (pure noise), depth i + 1 holds the states after step i."""
    n = [1]
    for i in range(num_steps):
        n.append(n[-1] * (k if i in splits else 1))
    return n


def tree_counts(num_steps: int, splits: list[int], k: int) -> tuple[int, int]:
    """(node forwards, edges) of one tree: forwards = sum of nodes at depths 0..T-1, edges = sum at depths 1..T.
    For T = 20, splits 0,3,6,9, K = 2: (203, 218), i.e. 12.69 and 13.625 per leaf (the release's README: 13.68)."""
    n = tree_sizes(num_steps, splits, k)
    return sum(n[:-1]), sum(n[1:])


def branch_noise(gen, n_parents: int, k: int, shape, rho: float) -> torch.Tensor:
    """Noise of the k children of each parent, (n_parents * k, *shape), children of a parent consecutive.
    z_c = sqrt(rho) xi_parent + sqrt(1 - rho) xi_c with fresh xi at every split (paper appendix B.1): every z_c is
    N(0, I), so each child edge is an exact SDE transition, and siblings have correlation rho."""
    shared = torch.randn((n_parents, 1, *shape), generator=gen)
    own = torch.randn((n_parents, k, *shape), generator=gen)
    return (math.sqrt(rho) * shared + math.sqrt(1 - rho) * own).flatten(0, 1)


def tree_noise(
    args, iteration: int, tree_ids: list[int], splits: list[int], latent_shape, rho: float, i: int, n_parents: int
) -> torch.Tensor:
    """Unscaled step-i noise of the trees `tree_ids`, (P * n_parents * kk, *L), children of a parent consecutive;
    keyed on (seed, iteration, tree, step), so it does not depend on chunking or on the process count."""
    kk, per_tree = children(i, splits, args.branch_factor), []
    for t in tree_ids:
        gen = rng(args.seed, iteration, "tree", t, i)
        if kk > 1 and args.branch_noise == "correlated":
            per_tree.append(branch_noise(gen, n_parents, kk, latent_shape, rho))
        else:
            per_tree.append(torch.randn((n_parents * kk, *latent_shape), generator=gen))
    return torch.cat(per_tree)


@torch.no_grad()
def tree_rollout(model, transformer, cond, roots, sigmas, g, splits, sde_set, noise_fn, args, autocast):
    """Grow P trees at once. roots: (P, *L), one per tree; cond: dict of (P, ...) tensors.

    Depth by depth, all nodes (tree-major, children of a parent consecutive) go through the transformer in chunks of
    --rollout-batch-size. noise_fn(step, n_parents_per_tree) -> (P * n_parents * kk, *L) unscaled step noise; its std
    is the step's std times noise_scale(). Returns states: list of T + 1 tensors (P * n_d, *L) fp32, and log_probs:
    list of T tensors (P * n_{i+1},), the old log-prob of every edge (0 at ODE steps)."""
    states, log_probs, batch_size = [roots], [], args.rollout_batch_size
    tree_of = torch.arange(len(roots))  # (nodes,) tree index of each node
    for i in range(len(sigmas) - 1):
        x = states[-1]
        v = []
        for c in range(0, len(x), batch_size):
            idx = tree_of[c : c + batch_size]
            sig, cond_c = sigmas[i].expand(len(idx)).to(x.device), {key: val[idx] for key, val in cond.items()}
            with autocast():
                v.append(model.velocity(transformer, x[c : c + batch_size], sig, cond_c, args.guidance_scale).float())
        v = torch.cat(v)
        kk = children(i, splits, args.branch_factor)
        if i in sde_set:
            mean, std = step_mean_std(x, v, sigmas[i], sigmas[i + 1], g[i])
            std = std * noise_scale(i, splits, args)
            mean = mean.repeat_interleave(kk, 0)
            x_next = mean + std * noise_fn(i, len(x) // len(roots)).to(x.device)
            log_probs.append(gaussian_log_prob(x_next, mean, std))
        else:  # ODE (Euler) step; splits are always SDE
            x_next = x + (sigmas[i + 1] - sigmas[i]) * v
            log_probs.append(torch.zeros(len(x), device=x.device))
        tree_of = tree_of.repeat_interleave(kk)
        states.append(x_next)
    return states, log_probs


def node_values(leaf_rewards, log_probs, sizes, fusion: str, beta: float, temperature: float) -> list[torch.Tensor]:
    """Fuse leaf rewards (P, M) into node values, a list over depths of (P, n_d) (paper §3.3).

    A node at depth d covers a contiguous block of M / n_d leaves. 'uniform': the block mean. 'path': a softmax
    over the block of beta * lp(node -> leaf) / temperature, where lp is the sum of the edge log-probs (per-dim
    means) from the node down to the leaf; beta = 0 is exactly uniform."""
    n_trees, n_leaves = leaf_rewards.shape
    if fusion == "path":
        # per-leaf log-prob of its edge at each step: (P, M, steps), then suffix sums from each depth
        per_step = [
            lp.view(n_trees, sizes[i + 1]).repeat_interleave(n_leaves // sizes[i + 1], 1)
            for i, lp in enumerate(log_probs)
        ]
        suffix = torch.flip(torch.cumsum(torch.flip(torch.stack(per_step, -1).double(), [-1]), -1), [-1])
    values = []
    for d, n in enumerate(sizes):
        r = leaf_rewards.view(n_trees, n, n_leaves // n).double()
        if fusion == "uniform" or d == len(sizes) - 1:
            values.append(r.mean(-1))
        else:
            w = torch.softmax(beta * suffix[..., d].view(n_trees, n, -1) / temperature, -1)
            values.append((w * r).sum(-1))
    return values


def depth_advantages(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per tree and depth, z-score the node values: A = (V - mean_d) / (std_d + 1e-8), unbiased std (the release);
    0 where a depth has one node or its values are equal (std < 1e-6). list of (P, n_d), float32."""
    out = []
    for v in values:
        if v.shape[1] < 2:
            out.append(torch.zeros_like(v, dtype=torch.float32))
            continue
        std = v.std(1, keepdim=True)
        a = (v - v.mean(1, keepdim=True)) / (std + 1e-8)
        out.append(torch.where(std < 1e-6, torch.zeros_like(a), a).float())
    return out


def children(i: int, splits: list[int], k: int) -> int:
    """Children per node at step i: K at a split, else 1. The rollout and the training must agree on it."""
    return k if i in splits else 1


def noise_scale(i: int, splits: list[int], args) -> float:
    """Multiplier of the step-i noise std: s at the splits with the release's 'scaled' branch noise, else 1 (the
    correlated noise is exactly N(0, I) per child). Rollout and training score an edge under the same std."""
    return args.branch_s if children(i, splits, args.branch_factor) > 1 and args.branch_noise == "scaled" else 1.0


def depth_window(num_steps: int, last_split: int, size: int, shift_every: int, iteration: int) -> list[int]:
    """Steps whose edges depth pruning leaves out of the loss: `size` steps starting right after the last split,
    one step deeper every `shift_every` iterations, stopping once the window ends at the last trainable step T - 2.
    If fewer than `size` steps follow the last split, the window is what fits (validate warns at start-up)."""
    first, last = last_split + 1, num_steps - 2
    size = min(size, last - first + 1)
    start = min(first + iteration // shift_every, last - size + 1)
    return list(range(start, start + size))


def mix_window(num_steps: int, size: int, shift_every: int, iteration: int) -> list[int]:
    """Mix: the SDE window [c, c + size) with c = iteration // shift_every, stopping once it ends at step T - 2."""
    start = min(iteration // shift_every, num_steps - 1 - size)
    return list(range(start, start + size))


def sde_steps(args, splits: list[int], iteration: int) -> set[int]:
    """Steps sampled by the SDE: all but the deterministic last one; with --pruning mix only the sliding window
    (from step 0) and the splits, every other step an Euler ODE step."""
    if args.pruning == "mix":
        return set(mix_window(args.num_steps, args.window, args.window_shift_every, iteration)) | set(splits)
    return set(range(args.num_steps - 1))


def edge_gaussians(x, v, runs, masks, sigmas, g, splits, args):
    """Mean (E, *L) and std (E,) of the trained child edges of a packed micro-batch. x, v: (rows, *L), one run of
    rows per (step i, parent indices ps) in `runs`; masks[j] (len(ps) * kk,) picks the trained children of run j."""
    means, stds, r = [], [], 0
    for (i, ps), m in zip(runs, masks):
        mean, std = step_mean_std(x[r : r + len(ps)], v[r : r + len(ps)], sigmas[i], sigmas[i + 1], g[i])
        means.append(mean.repeat_interleave(children(i, splits, args.branch_factor), 0)[m])
        stds.append(torch.full((int(m.sum()),), std * noise_scale(i, splits, args), device=x.device))
        r += len(ps)
    return torch.cat(means), torch.cat(stds)


def trained_edges(args, splits, sizes, sde_set, adv, iteration) -> list[torch.Tensor]:
    """Which edges are trained, a list over steps of bool (P, n_{i+1}); adv[i] (P, n_{i+1}) holds the advantages of
    the children of step i. Pruning acts here only: the rollout and the rewards are the same whatever it is. ODE
    edges and the last (deterministic) step are never trained."""
    n_trees, last, s_last = adv[0].shape[0], args.num_steps - 1, max(splits)
    keep = [torch.full((n_trees, sizes[i + 1]), i in sde_set and i < last) for i in range(args.num_steps)]
    if args.pruning == "depth":  # paper §3.4 / appendix A: a 4-step window, one step deeper every 30 iterations
        for i in depth_window(args.num_steps, s_last, args.window, args.window_shift_every, iteration):
            keep[i][:] = False
    elif args.pruning == "width":  # only the post-split chains (steps after the last split) are pruned
        a = adv[s_last]  # (P, M): the children of the last split, one per leaf; each chain below carries this advantage
        if args.width_mode == "parent-top1":  # each parent of the last split keeps its best child's chain
            best = a.view(n_trees, -1, args.branch_factor).argmax(-1)  # (P, parents)
            chain = torch.nn.functional.one_hot(best, args.branch_factor).bool().flatten(1)
        else:  # extreme: the chains with the highest and the lowest advantages
            n_keep = max(2, int(a.shape[1] * args.width_keep_ratio))
            order = a.argsort(1)
            chain = torch.zeros_like(a, dtype=torch.bool)
            chain.scatter_(
                1, torch.cat([order[:, : n_keep // 2], order[:, a.shape[1] - (n_keep - n_keep // 2) :]], 1), True
            )
        for i in range(s_last + 1, last):
            keep[i] &= chain
    return keep


# ---------------------------------------------------------------------------------------------------
# Flag checks (run plumbing: evaluation, grids, checkpoints, resume and logging live in common/runs.py)
# ---------------------------------------------------------------------------------------------------
def resolve_defaults(args: Args) -> None:
    """Fill the mode-dependent defaults; a mode-specific flag given for another mode is an error (no dead flags)."""
    for flag, ok, mode in [
        ("fusion_beta", args.fusion == "path", "--fusion path"),
        ("fusion_temperature", args.fusion == "path", "--fusion path"),
        ("width_mode", args.pruning == "width", "--pruning width"),
        ("width_keep_ratio", args.width_mode == "extreme", "--pruning width --width-mode extreme"),
        ("window", args.pruning in ("depth", "mix"), "--pruning depth or mix"),
        ("window_shift_every", args.pruning in ("depth", "mix"), "--pruning depth or mix"),
    ]:
        need(getattr(args, flag) is None or ok, f"--{flag.replace('_', '-')} only applies with {mode}")
    defaults = {
        "noise_level": 0.3 if args.sde_type == "dance" else 0.7,
        "fusion_beta": 1.0,
        "fusion_temperature": 1.0,
        "width_mode": "parent-top1",
        "width_keep_ratio": 0.5,
        "window": 4,
        "window_shift_every": 30,
        "exp_name": Path(__file__).stem + ("" if args.pruning == "none" else f"_{args.pruning}"),  # a fork: its own
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def validate(args: Args, world: int) -> tuple[list[str], list[str]]:
    """Check this script's flags, then the shared ones (common.runs); returns (training prompts, held-out prompts)."""
    need(args.num_steps >= 2, "--num-steps must be at least 2 (the last step is a deterministic Euler step)")
    splits = split_steps(args.split_schedule, args.num_steps, args.num_splits)
    need(
        len(splits) >= 1 and all(0 <= s <= args.num_steps - 2 for s in splits),
        f"--split-schedule gives splits {splits}: they must lie in [0, {args.num_steps - 2}] (the last step is deterministic); "
        "change --num-splits, --num-steps or --split-schedule",
    )
    need(args.num_splits >= 1 and args.branch_factor >= 2, "--num-splits >= 1 and --branch-factor >= 2")
    need(
        min(args.branch_s, args.noise_level, args.fusion_temperature, args.clip_range, args.adv_clip_max) > 0
        and args.kl_beta >= 0,
        "--branch-s, --noise-level, --fusion-temperature, --clip-range and --adv-clip-max must be > 0, --kl-beta >= 0",
    )
    need(0 < args.width_keep_ratio <= 1, "--width-keep-ratio must be in (0, 1]")
    need(
        args.window_shift_every >= 1 and 1 <= args.window <= args.num_steps - 1,
        f"--window must be in [1, {args.num_steps - 1}] and --window-shift-every >= 1",
    )
    after = args.num_steps - 2 - max(splits)  # trainable steps after the last split (T - 1 is deterministic)
    need(
        args.pruning not in ("depth", "width") or after >= 1,
        f"--pruning {args.pruning}: the last split is step {max(splits)} = --num-steps - 2, so no trainable step follows "
        "it; move the splits earlier (--split-schedule) or raise --num-steps",
    )
    need(args.trees_per_device % args.trees_per_update == 0, "--trees-per-update must divide --trees-per-device")
    need(min(args.trees_per_device, args.rollout_batch_size) >= 1, "--trees-per-device, --rollout-batch-size >= 1")
    if args.pruning == "depth" and after < args.window + 1:
        print(
            f"warning: --pruning depth: {after} trainable step(s) follow the last split {max(splits)}, so the {args.window}-step "
            f"window {'shrinks to ' + str(after) + ' step(s) and ' if after < args.window else ''}cannot slide; "
            "raise --num-steps or split earlier for a sliding window",
            file=sys.stderr,
        )
    return check_run_args(args)


def main(args: Args):
    # ---------------------------------------------------------------- SETUP
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    world, rank = accelerator.num_processes, accelerator.process_index
    resolve_defaults(args)
    train_prompts, eval_prompts = validate(args, world)
    mode = args.pruning + (f" ({args.width_mode})" if args.pruning == "width" else "")
    run = Run(args, accelerator, f"BranchGRPO, pruning {mode}", frozen_copy=args.kl_beta > 0 and not args.lora)
    set_seed(args.seed)  # LoRA init and anything else not keyed through rng()
    device, autocast = accelerator.device, accelerator.autocast
    frozen_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    splits = split_steps(args.split_schedule, args.num_steps, args.num_splits)
    sizes = tree_sizes(args.num_steps, splits, args.branch_factor)  # nodes per depth, (T + 1,)
    n_leaves = sizes[-1]  # M
    rho = 1 / (1 + args.branch_s)  # correlated branch noise: Var(branch-specific) / Var(shared) = s

    # ---------------------------------------------------------------- MODELS
    model = load_model(
        args.model_id, device=device, dtype=frozen_dtype, resolution=args.resolution, offload=args.offload_frozen
    )
    transformer = trainable_denoiser(model, args)  # trained in fp32: all weights, or a LoRA adapter (--lora)
    # KL reference policy: with LoRA this module itself (unwrapped) with the adapter off, else a frozen copy of the base
    ref = transformer if args.lora else frozen_copy(transformer, frozen_dtype) if args.kl_beta > 0 else None

    # ---------------------------------------------------------------- PROMPTS & REWARDS
    reward_fn = build_reward(args.reward, device, args.reward_checkpoints(), offload=args.offload_frozen)

    # ---------------------------------------------------------------- OPTIMIZER
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)

    # ---------------------------------------------------------------- RESUME
    start = run.resume()
    sigmas = sigma_schedule(args.num_steps, args.shift)
    g = noise_g(sigmas, args.sde_type, args.noise_level)
    latent_shape = model.latent_shape()
    eval_sigmas = sigma_schedule(args.eval_steps, args.shift)
    sampler = ode_sampler(model, transformer, eval_sigmas, args.guidance_scale, autocast)
    evaluate = Evaluator(args, model, transformer, sampler, reward_fn, eval_prompts, run, args.rollout_batch_size)
    forwards, edges = tree_counts(args.num_steps, splits, args.branch_factor)
    keep0 = trained_edges(args, splits, sizes, sde_steps(args, splits, 0), [torch.zeros(1, n) for n in sizes[1:]], 0)
    trained0 = sum(int(k.sum()) for k in keep0)
    corr = f" (sibling correlation {rho:.3f})" if args.branch_noise == "correlated" else ""
    lines = [
        f"tree: {args.num_steps} steps, splits {splits}, K {args.branch_factor} -> {n_leaves} leaves, {forwards} node "
        f"forwards ({forwards / n_leaves:.2f} / leaf), {edges} edges, {trained0} trained at iteration 0",
        f"branch noise {args.branch_noise} s={args.branch_s}{corr}, {args.sde_type} noise {args.noise_level}",
        f"{world} processes x {args.trees_per_device} trees, {args.trees_per_update} per optimizer step, micro-batch "
        f"{args.rollout_batch_size} nodes, fusion {args.fusion}, KL beta {args.kl_beta}, clip {args.clip_range}",
    ]
    run.banner(model, params, lines)
    evaluate(start, final=start == args.iterations)  # at the start; resumed: what the interrupted run missed
    n_groups = args.trees_per_device // args.trees_per_update
    for it in run.iterations(start):
        # ------------------------------------------------------------ SAMPLING
        # The same prompt draw on every process; process r owns trees [r P, (r + 1) P), P = --trees-per-device
        drawn = draw_prompts(train_prompts, world * args.trees_per_device, args.seed, it)
        tree_ids = list(range(rank * args.trees_per_device, (rank + 1) * args.trees_per_device))
        sde_set = sde_steps(args, splits, it)  # SDE steps; the rest (with --pruning mix) are Euler ODE steps
        groups = []  # one dict per update group of trees: prompts, cond, states, log_probs
        transformer.eval()
        for u in range(n_groups):
            ids = tree_ids[u * args.trees_per_update : (u + 1) * args.trees_per_update]
            prompts_u = [drawn[t] for t in ids]
            cond = model.encode_prompts(prompts_u)
            roots = torch.stack([torch.randn(latent_shape, generator=rng(args.seed, it, "root", t)) for t in ids])
            roots = roots.to(device)  # (P_u, *L)
            noise_fn = partial(tree_noise, args, it, ids, splits, latent_shape, rho)
            states, log_probs = tree_rollout(
                model, transformer, cond, roots, sigmas, g, splits, sde_set, noise_fn, args, autocast
            )
            groups.append({"prompts": prompts_u, "cond": cond, "states": states, "log_probs": log_probs})
        t_sample = time.perf_counter() - run.t_iter

        # ------------------------------------------------------------ REWARDS & ADVANTAGES
        with torch.no_grad():
            leaf_prompts = [p for grp in groups for p in grp["prompts"] for _ in range(n_leaves)]
            images = torch.cat([model.decode(grp["states"][-1]).float() for grp in groups])
            rewards, parts = reward_fn(images, leaf_prompts)  # (trees * leaves,)
        for grp, r in zip(groups, rewards.to(device).view(n_groups, -1, n_leaves)):  # r: (P_u, M) leaf rewards
            values = node_values(r, grp["log_probs"], sizes, args.fusion, args.fusion_beta, args.fusion_temperature)
            adv = depth_advantages(values)  # (P_u, n_d) per depth, P_u = --trees-per-update
            grp["adv"] = [a.clamp(-args.adv_clip_max, args.adv_clip_max) for a in adv]
            grp["keep"] = trained_edges(args, splits, sizes, sde_set, grp["adv"][1:], it)  # step i -> depth i + 1
        all_rewards = accelerator.gather(rewards.float().to(device))
        parts = {k: accelerator.gather(v.float().to(device)) for k, v in parts.items()}

        # ------------------------------------------------------------ TRAINING
        model.park(), reward_fn.park()  # --offload-frozen: the VAE and the reward models leave the GPU
        transformer.train()
        stats = {k: [] for k in ("policy_loss", "kl", "ratio", "clipfrac", "approx_kl")}
        n_trained_edges, n_train_forwards = 0, 0
        for grp in groups:
            # rows (step, parent) with a trained child edge, in rollout order, packed into micro-batches across steps
            # (one forward each; the step maths stays per step): a pruned step leaves no small micro-batch, so the
            # cost follows the trained edges; the first ratio is 1 up to the forward's batch-size rounding (~1e-7)
            n_edges = sum(int(k.sum()) for k in grp["keep"])  # keep[i]: (P_u, n_{i+1}); parents are global indices
            has_child = [
                k.reshape(-1, children(i, splits, args.branch_factor)).any(1) for i, k in enumerate(grp["keep"])
            ]
            rows = [(i, p) for i, h in enumerate(has_child) for p in torch.nonzero(h).flatten().tolist()]
            n_trained_edges, n_train_forwards = n_trained_edges + n_edges, n_train_forwards + len(rows)
            batches = [rows[c : c + args.rollout_batch_size] for c in range(0, len(rows), args.rollout_batch_size)]
            for w, batch in enumerate(batches):
                runs = [(i, torch.tensor([p for _, p in r], device=device)) for i, r in groupby(batch, itemgetter(0))]
                x = torch.cat([grp["states"][i][ps] for i, ps in runs])  # (rows, *L)
                sig = torch.cat([sigmas[i].expand(len(ps)) for i, ps in runs]).to(device)
                cond = {key: val[torch.cat([ps // sizes[i] for i, ps in runs])] for key, val in grp["cond"].items()}
                masks, adv, old_lp, x_child = [], [], [], []
                for i, ps in runs:  # a parent's children are consecutive; only the trained edges are kept
                    kk = children(i, splits, args.branch_factor)
                    c = (ps[:, None] * kk + torch.arange(kk, device=device)).flatten()  # (len(ps) * kk,)
                    masks.append(grp["keep"][i].flatten().to(device)[c])
                    adv.append(grp["adv"][i + 1].flatten().to(device)[c][masks[-1]])
                    old_lp.append(grp["log_probs"][i][c][masks[-1]])
                    x_child.append(grp["states"][i + 1][c][masks[-1]])
                adv, old_lp, x_child = torch.cat(adv), torch.cat(old_lp), torch.cat(x_child)  # (E,), (E,), (E, *L)
                with accelerator.no_sync(transformer) if w < len(batches) - 1 else nullcontext():
                    with autocast():
                        v = model.velocity(transformer, x, sig, cond, args.guidance_scale).float()
                    mean, std = edge_gaussians(x, v, runs, masks, sigmas, g, splits, args)
                    log_prob = gaussian_log_prob(x_child, mean, std)
                    loss_vec, ratio = grpo_loss(log_prob, old_lp, adv, args.clip_range)
                    loss = loss_vec.sum()
                    if args.kl_beta > 0:
                        with autocast():  # the base model: frozen copy, or LoRA adapter off
                            v_ref = reference_velocity(model, ref, args.lora, x, sig, cond, args.guidance_scale)
                        mean_ref, _ = edge_gaussians(x, v_ref.float(), runs, masks, sigmas, g, splits, args)
                        # exact KL between the two Gaussian steps, per edge, averaged over dimensions (as dancegrpo.py)
                        kl = ((mean - mean_ref) ** 2).flatten(1).mean(1) / (2 * std**2)
                        loss = loss + args.kl_beta * kl.sum()
                        stats["kl"].append(kl.mean().detach())
                    accelerator.backward(loss / max(1, n_edges))  # the mean over this update's trained edges
                stats["policy_loss"].append(loss_vec.mean().detach())
                stats["ratio"].append(ratio.detach())
                stats["clipfrac"].append(((ratio - 1).abs() > args.clip_range).float().mean().detach())
                stats["approx_kl"].append((0.5 * (log_prob - old_lp) ** 2).mean().detach())
            run.step(optimizer, params)  # clipped; skipped if the gradient norm is not finite

        # ------------------------------------------------------------ LOGGING
        ratios = torch.cat(stats["ratio"])
        leaves_here = args.trees_per_device * n_leaves
        log = {
            "rewards/mean": all_rewards.mean().item(),
            "rewards/std": all_rewards.std().item(),
            **{f"rewards/{k}": v.mean().item() for k, v in parts.items()},
            "rewards/tree_std": all_rewards.view(-1, n_leaves).std(1).mean().item(),
            "losses/policy": torch.stack(stats["policy_loss"]).mean().item(),
            "losses/ratio_mean": ratios.mean().item(),
            "losses/ratio_max_dev": (ratios - 1).abs().max().item(),
            "losses/first_ratio_max_dev": (stats["ratio"][0] - 1).abs().max().item(),
            "losses/clipfrac": torch.stack(stats["clipfrac"]).mean().item(),
            "losses/approx_kl": torch.stack(stats["approx_kl"]).mean().item(),
            "tree/rollout_forwards_per_leaf": forwards / n_leaves,
            "tree/trained_edges_per_leaf": n_trained_edges / leaves_here,
            "tree/train_forwards_per_leaf": n_train_forwards * (2 if args.kl_beta > 0 else 1) / leaves_here,
            "perf/sampling_s": t_sample,
        }
        if args.pruning == "depth":
            log["charts/window_start"] = depth_window(
                args.num_steps, max(splits), args.window, args.window_shift_every, it
            )[0]
        elif args.pruning == "mix":
            log["charts/window_start"] = mix_window(args.num_steps, args.window, args.window_shift_every, it)[0]
        if stats["kl"]:
            log["losses/kl"] = torch.stack(stats["kl"]).mean().item()
        run.end_iteration(it, log, params)  # + gradient norms, timings; metrics.jsonl, TensorBoard, W&B

        # ------------------------------------------------------------ CHECKPOINT
        run.checkpoint(it + 1, final=it + 1 == args.iterations)  # + on SIGTERM / Ctrl-C, then exits

        # ------------------------------------------------------------ EVAL
        evaluate(it + 1, final=it + 1 == args.iterations)

    # ---------------------------------------------------------------- FINAL SAVE
    run.save_final(model, transformer, args.lora)


if __name__ == "__main__":
    cli(main, Args)
