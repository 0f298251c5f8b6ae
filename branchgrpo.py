# BranchGRPO: docs/branchgrpo.md; paper: arXiv 2509.06040 (Li et al., "BranchGRPO: Stable and Efficient GRPO with Structured Branching")
"""GRPO on tree-structured SDE rollouts of a flow-matching text-to-image model, one file.

Every prompt grows one tree: the trajectories share their early denoising prefix and split into K children at chosen
steps, so 16 leaves cost 203 node forwards instead of 320 (20 steps, splits 0,3,6,9, K = 2), a depth in one batched
forward. Leaf rewards are fused upward into node values, normalised per depth within the tree, and each edge is trained
with its child's advantage under the PPO-clipped ratio of its SDE step. Width pruning, depth pruning or a sliding
ODE/SDE mix only change which edges are trained, never the rollout or the rewards (arXiv 2509.06040 §3).

Launch (run.sh has more):
    python branchgrpo.py                                            # ShapesBench on CPU
    python branchgrpo.py --pruning depth                            # depth pruning (every post-split step left out)
    PROMPTS=prompts.txt bash run.sh branchgrpo-flux-8gpu            # FLUX.1-dev, depth pruning, 8 GPUs; docs/gpu.md: all of them
    PROMPTS=prompts.txt bash run.sh branchgrpo-wan-8gpu             # Wan2.1 text-to-video, 8 GPUs; docs/video.md
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 branchgrpo.py   # 2 CPU processes
    python branchgrpo.py --resume-from latest                       # continue the newest runs/branchgrpo__*

ShapesBench's defaults differ from the paper's (run.sh's GPU recipes use the paper's). Deviations from the release
(docs/branchgrpo.md explains each): 1. correlated branch noise; 2. nodes batched per depth; 3. path fusion, a softmax
over the leaves; 4. width pruning by chain; 5. sliding windows; 6. the last step untrained; 7. steps counted in trees.
"""

from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, fields
from functools import partial
from itertools import groupby
from pathlib import Path
from typing import Annotated, Literal, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed

from common import InputError
from common.checkpoints import Carried
from common.evaluator import Evaluator
from common.flags import Ge, Gt, Le, Lt, ModeDefault, RunArgs, check_flags, check_run_args, cli, divides, need
from common.logs import reward_stats, summarize
from common.models import frozen_copy, load_model, reference_velocity, trainable_denoiser, weights_swapped
from common.prompts import draw_prompts
from common.rewards import RewardSpec, build_reward
from common.runs import Run, all_finite
from common.sampling import keyed_generator as rng  # (seed, iteration, ...) -> a generator


@dataclass
class Args(RunArgs):  # the shared flags (--model-id, --reward, --iterations, ...) are in common/flags.py
    learning_rate: Annotated[float, Gt(0), Le(1)] = 6e-4
    """AdamW learning rate (constant after --lr-warmup); 2x the shared default, as dancegrpo.py (docs/branchgrpo.md)"""
    num_steps: Annotated[int, Ge(2), Le(1000)] = 20
    """sampling steps T of a rollout (shifted sigma schedule), as the paper"""
    sde_type: Literal["dance", "flow"] = "flow"
    """noise schedule g(sigma): 'dance' = constant eta (DanceGRPO, the release), 'flow' = a sqrt(sigma / (1 - sigma))"""
    noise_level: Annotated[Optional[float], ModeDefault("0.7; 0.3 with --sde-type dance"), Gt(0), Le(10)] = None
    """eta for 'dance', a for 'flow' (at most 10, ten times the published values: beyond, noise drowns the sample)"""
    split_schedule: str = "dense"
    """split steps: 'dense' (0,3,6,...), 'sparse' (evenly spread), 'late' (second half) or a list like '0,3,6,9'"""
    num_splits: Annotated[int, Ge(1), Le(64)] = 4
    """number of split steps m for the named schedules"""
    branch_factor: Annotated[int, Ge(2), Le(64)] = 2
    """children per split K; leaves per tree M = K ** m, at most 65536"""
    branch_noise: Literal["correlated", "scaled"] = "correlated"
    """'correlated': siblings share part of their noise, each child is an exact SDE step (paper); 'scaled': independent noise times s (release)"""
    branch_s: Annotated[float, Gt(0), Le(1000)] = 4.0  # 1000: rho < 1e-3 already; a 1000-fold noise samples nothing
    """correlated: ratio s of branch-specific to shared noise variance, rho = 1 / (1 + s); scaled: the noise multiplier"""
    trees_per_device: Annotated[int, Ge(1), Le(65536)] = 4  # counts of trees and nodes: at most 2**16
    """prompts (trees) per process per iteration"""
    trees_per_update: Annotated[int, Ge(1), Le(65536)] = 2
    """trees whose edges are accumulated into one optimizer step"""
    rollout_batch_size: Annotated[int, Ge(1), Le(65536)] = 16
    """nodes per denoiser forward (batched per depth); also the training micro-batch of parents"""
    fusion: Literal["uniform", "path"] = "uniform"
    """node value from its leaves: 'uniform' mean, or 'path' softmax of gamma * path log-prob / temperature"""
    fusion_gamma: Annotated[float, Ge(-1000), Le(1000)] = 1.0  # gamma x a path's log-prob stays finite in the softmax
    """--fusion path: weight gamma of the path log-prob (0 gives uniform)"""
    fusion_temperature: Annotated[float, Gt(0), Le(1000)] = 1.0
    """--fusion path: softmax temperature (at most 1000: a hotter softmax is --fusion uniform)"""
    pruning: Literal["none", "width", "depth", "mix"] = "none"
    """which edges are trained: all, width-pruned, depth-pruned, or only SDE edges of a sliding Mix window"""
    width_mode: Literal["parent-top1", "extreme"] = "parent-top1"
    """--pruning width: each last-split parent keeps its best child's chain, or the extreme chains"""
    width_keep_ratio: Annotated[float, Gt(0), Le(1)] = 0.5
    """--width-mode extreme: fraction of post-split chains kept, half best and half worst"""
    window: Annotated[
        Optional[int], ModeDefault("the steps after the last split for depth, 4 for mix"), Ge(1), Le(999)
    ] = None
    """--pruning depth / mix: window size W in steps (at most --num-steps - 1)"""
    window_shift_every: Annotated[int, Ge(1)] = 30
    """--pruning depth / mix: the window moves one step deeper every E iterations"""
    clip_range: Annotated[float, Gt(0)] = 1e-3
    """PPO clip epsilon on the ratio (log-probs are means over latent dimensions, hence small)"""
    adv_clip_max: Annotated[float, Gt(0)] = 5.0
    """advantages are clipped to +-this"""
    advantage_aggregation: Literal["sum", "per-reward"] = "sum"
    """several rewards: 'sum' fuses their weighted sum (release); 'per-reward' fuses and normalises each, then sums with the weights"""
    kl_beta: Annotated[float, Ge(0)] = 0.0
    """weight beta of the per-step Gaussian KL to the frozen base model (0 = off, as the release)"""
    ema: bool = False
    """evaluate and save (final/) an EMA of the trained weights, as diffusionnft.py and vgrpo.py --ema do; off by default"""
    ema_max_decay: Annotated[float, Ge(0), Lt(1)] = 0.9
    """EMA decay after s optimizer steps: min((1 + s) / (10 + s), this) (diffusionnft.py's default)"""


# ---------------------------------------------------------------------------------------------------
# ALGO LOGIC, in main()'s order: schedule and SDE step, the tree and its noise, the rollout, leaf rewards -> node values
# -> advantages, pruning, training micro-batches. Notation (docs/math.md): T steps, step i takes depth i to i + 1, K
# children per split, M = K ** m leaves, P trees, n_i nodes at depth i, *L the latent shape; per-step lists (log-probs,
# advantages, trained-edge masks) hold step i's edges into depth i + 1.
# ---------------------------------------------------------------------------------------------------
def sigma_schedule(num_steps: int, shift: float) -> torch.Tensor:  # same as in dancegrpo.py
    """linspace(1, 0, T + 1) warped by s' = k s / (1 + (k - 1) s) (SD3 shift); shape (T + 1,)."""
    s = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)  # cpu: read as 0-dim scalars or moved with .to()
    return (shift * s / (1 + (shift - 1) * s)).float()


def noise_g(sigmas: torch.Tensor, sde_type: str, level: float) -> torch.Tensor:  # same as in dancegrpo.py
    """Diffusion coefficient g_i of each step i (T,). DanceGRPO: constant eta (CPS: eta, which its step uses). Flow-GRPO:
    a sqrt(s / (1 - s)), with sigmas[1] standing in for the first sigma in the denominator, as Flow-GRPO does."""
    s = sigmas[:-1]
    if sde_type != "flow":
        return torch.full_like(s, level)
    s_den = torch.where(s >= 1, sigmas[1], s)
    return level * torch.sqrt(s / (1 - s_den))


def step_mean_std(x, v, sigma, sigma_next, g):
    """Mean and std of one reverse-SDE step (docs/math.md; dancegrpo.py's sde_step). x (B, *L) at sigma, v = eps - x0
    the velocity (x = (1 - sigma) x0 + sigma eps), fp32. x0_hat = x - sigma v, score = -(x - (1 - sigma) x0_hat) /
    sigma^2, mean = x + d (v - g^2/2 score), std = g sqrt(-d)."""
    d, x0_hat = float(sigma_next - sigma), x - float(sigma) * v
    score = -(x - (1 - float(sigma)) * x0_hat) / float(sigma) ** 2
    return x + d * (v - float(g) ** 2 / 2 * score), float(g) * math.sqrt(-d)


def gaussian_log_prob(x_next, mean, std):
    """Full Gaussian log-density of x_next under N(mean, std^2), averaged over latent dimensions (as dancegrpo.py). (B,)"""
    std = torch.as_tensor(std, dtype=x_next.dtype, device=x_next.device).reshape((-1,) + (1,) * (x_next.dim() - 1))
    return (-((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)


def split_steps(schedule: str, num_steps: int, num_splits: int) -> list[int]:
    """Split steps: 'dense' every 3rd from 0 (0,3,6,9: the release's launcher schedule, taken as the paper's Dense,
    whose steps §4.2 does not list); 'sparse' spread over the trajectory (0,5,10,15 for T = 20); 'late' spread over
    the second half (10,12,14,16); or a comma-separated list. Splits must precede the last step."""
    if schedule == "dense":
        return [3 * n for n in range(num_splits)]
    if schedule == "sparse":
        return [n * (num_steps // num_splits) for n in range(num_splits)]
    if schedule == "late":
        return [num_steps // 2 + n * max(1, (num_steps - 1 - num_steps // 2) // num_splits) for n in range(num_splits)]
    try:
        return sorted({int(s) for s in schedule.split(",")})
    except ValueError:
        raise InputError(f"--split-schedule {schedule!r}: use dense, sparse, late or a list like 0,3,6,9") from None


@dataclass(frozen=True)
class Tree:
    """Every tree of a run, built once in main(): T steps, the split steps, K children per split, the noise at a split
    ('correlated': sibling correlation rho = 1 / (1 + s); the release's independent noise 'scaled' by s), and which
    edges are trained (pruning; depth and mix: a window of W steps, one step deeper every E iterations)."""

    num_steps: int
    splits: tuple[int, ...]
    branch_factor: int = 2
    branch_noise: str = "correlated"
    branch_s: float = 4.0
    pruning: str = "none"
    window: int = 4
    window_shift_every: int = 30
    width_mode: str = "parent-top1"
    width_keep_ratio: float = 0.5

    def children(self, i: int) -> int:  # children per node at step i: K at a split, else 1
        return self.branch_factor if i in self.splits else 1

    @property
    def sizes(self) -> list[int]:
        """Nodes n_i per depth i (T + 1,): depth 0 is the root x_0 (pure noise), depth i + 1 holds the states after
        step i. Nodes are stored tree-major, the children of a parent consecutive: node j of depth i is in tree j // n_i."""
        return [self.branch_factor ** sum(s < i for s in set(self.splits)) for i in range(self.num_steps + 1)]

    def counts(self) -> tuple[int, int]:
        """(node forwards, edges): the nodes at depths 0..T-1 and at 1..T; T = 20, splits 0,3,6,9, K = 2: (203, 218)."""
        return sum(self.sizes[:-1]), sum(self.sizes[1:])

    def noise_scale(self, i: int) -> float:
        """Step i's noise std multiplier: s at a split with the release's 'scaled' noise, else 1 (rollout and training)."""
        return self.branch_s if self.children(i) > 1 and self.branch_noise == "scaled" else 1.0

    def window_steps(self, iteration: int) -> list[int]:
        """W steps, one step deeper every E iterations until they end at step T - 2: Mix's SDE steps from step 0; the
        steps depth pruning leaves out of the loss, from right after the last split (fewer if fewer fit)."""
        first, last = (max(self.splits) + 1 if self.pruning == "depth" else 0), self.num_steps - 2
        size = min(self.window, last - first + 1)
        start = min(first + iteration // self.window_shift_every, last - size + 1)
        return list(range(start, start + size))


def branch_noise(gen, n_parents: int, n_children: int, shape, rho: float) -> torch.Tensor:
    """Noise of each parent's children (n_parents * n_children, *shape): z_c = sqrt(rho) xi_parent + sqrt(1 - rho) xi_c,
    fresh xi at every split (appendix B.1): each z_c is N(0, I) (an exact SDE step), siblings correlate by rho."""
    shared = torch.randn((n_parents, 1, *shape), generator=gen, device=gen.device)
    own = torch.randn((n_parents, n_children, *shape), generator=gen, device=gen.device)
    return (math.sqrt(rho) * shared + math.sqrt(1 - rho) * own).flatten(0, 1)


def tree_noise(tree: Tree, seed: int, iteration: int, tree_ids: list[int], latent_shape, i: int, n_parents: int):
    """Unscaled step-i noise z_i of the trees `tree_ids`, (P * n_parents * n_children, *L), children of a parent
    consecutive; keyed on (seed, iteration, tree, step), so it depends neither on chunking nor on the process count."""
    n_children, per_tree = tree.children(i), []
    for t in tree_ids:
        gen = rng(seed, iteration, "tree", t, i)
        if n_children > 1 and tree.branch_noise == "correlated":
            per_tree.append(branch_noise(gen, n_parents, n_children, latent_shape, 1 / (1 + tree.branch_s)))
        else:
            per_tree.append(torch.randn((n_parents * n_children, *latent_shape), generator=gen, device=gen.device))
    return torch.cat(per_tree)


def sde_steps(tree: Tree, iteration: int) -> list[int]:
    """Steps sampled by the SDE, the others Euler ODE steps: all but the deterministic last one; with --pruning mix
    only the sliding window (from step 0) and the splits."""
    if tree.pruning != "mix":
        return list(range(tree.num_steps - 1))
    return sorted(set(tree.window_steps(iteration)) | set(tree.splits))


@torch.no_grad()
def tree_rollout(model, denoiser, cond, roots, noise_fn, tree, sigmas, g, sde_idx, batch_size, guidance, autocast):
    """Grow P trees at once from roots (P, *L) and cond, a dict of (P, ...): depth by depth, all nodes (tree-major,
    siblings consecutive) through the denoiser `batch_size` at a time. noise_fn(step, n_parents_per_tree) -> unscaled
    noise (P * n_parents * n_children, *L). Returns states, T + 1 tensors (P * n_i, *L) fp32 over depths, and
    log_probs, T tensors (P * n_{i+1},) over steps: the old log-prob of every edge (0 at ODE steps)."""
    states, log_probs, tree_of = [roots], [], torch.arange(len(roots), device=roots.device)  # tree_of: each node's tree
    for i in range(len(sigmas) - 1):
        x, v = states[-1], []  # the nodes of depth i (P * n_i, *L), their velocities
        for c in range(0, len(x), batch_size):
            idx = tree_of[c : c + batch_size]
            sig, cond_c = sigmas[i].expand(len(idx)).to(x.device), {key: val[idx] for key, val in cond.items()}
            with autocast():
                v.append(model.velocity(denoiser, x[c : c + batch_size], sig, cond_c, guidance).float())
        v = torch.cat(v)
        n_children = tree.children(i)
        if i in sde_idx:
            mean, std = step_mean_std(x, v, sigmas[i], sigmas[i + 1], g[i])
            mean, std = mean.repeat_interleave(n_children, 0), std * tree.noise_scale(i)
            x_next = mean + std * noise_fn(i, len(x) // len(roots)).to(x.device)
            log_probs.append(gaussian_log_prob(x_next, mean, std))
        else:  # ODE (Euler) step; splits are always SDE
            x_next = x + (sigmas[i + 1] - sigmas[i]) * v
            log_probs.append(torch.zeros(len(x), device=x.device))
        tree_of = tree_of.repeat_interleave(n_children)
        states.append(x_next)
    return states, log_probs


def node_values(leaf_rewards, log_probs, sizes, fusion: str, gamma: float, temperature: float) -> list[torch.Tensor]:
    """Fuse leaf rewards (P, M) into node values V, a list over depths of (P, n_i) (paper §3.3); a node at depth i
    covers a block of M / n_i leaves. 'uniform': the block mean; 'path': a softmax over the block of gamma *
    lp(node -> leaf) / temperature, lp the sum of the edge log-probs down to the leaf (gamma = 0: uniform)."""
    n_trees, n_leaves = leaf_rewards.shape
    if fusion == "path":  # each leaf's edge log-prob at each step, (P, M, T), then suffix sums from each depth
        per_step = [lp.view(n_trees, n).repeat_interleave(n_leaves // n, 1) for lp, n in zip(log_probs, sizes[1:])]
        suffix = torch.flip(torch.cumsum(torch.flip(torch.stack(per_step, -1).double(), [-1]), -1), [-1])
    values = []
    for depth, n in enumerate(sizes):
        R = leaf_rewards.view(n_trees, n, n_leaves // n).double()
        if fusion == "uniform" or depth == len(sizes) - 1:
            values.append(R.mean(-1))
        else:
            weights = torch.softmax(gamma * suffix[..., depth].view(n_trees, n, -1) / temperature, -1)
            values.append((weights * R).sum(-1))
    return values


def depth_advantages(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per tree and depth, z-score the node values: A = (V - mean) / (std + 1e-8), unbiased std (the release);
    0 where a depth has one node or its values are equal (std < 1e-6). List over depths of (P, n_i), float32."""
    out = []
    for v in values:
        std = v.std(1, keepdim=True) if v.shape[1] > 1 else torch.zeros_like(v)  # one node: no spread, A = 0
        a = (v - v.mean(1, keepdim=True)) / (std + 1e-8)
        out.append(torch.where(std < 1e-6, torch.zeros_like(a), a).float())
    return out


def tree_advantages(leaf_scores, weights, log_probs, sizes, *, fusion, fusion_gamma, fusion_temperature, adv_clip_max):
    """Per step i, its children's advantages (P, n_{i+1}) within +-adv_clip_max: sum_k w_k depth_advantages(node_values(
    leaf_scores[k] (P, M))) over the weighted reward sum (weight 1) or each reward (per-reward, arXiv 2507.21802)."""
    fuse = partial(node_values, log_probs=log_probs, sizes=sizes, fusion=fusion, gamma=fusion_gamma,
                   temperature=fusion_temperature)  # fmt: skip
    terms = [[w * a for a in depth_advantages(fuse(leaf_scores[k]))] for k, w in weights.items() if w != 0]
    return [sum(depth).clamp(-adv_clip_max, adv_clip_max) for depth in list(zip(*terms))[1:]]


def trained_edges(tree: Tree, sde_idx, adv, iteration: int) -> list[torch.Tensor]:
    """Which edges are trained, per step bool (P, n_{i+1}) on the advantages' device, from adv[i] (P, n_{i+1}), the
    advantages of step i's children. Pruning acts here only, never on the rollout or the rewards; ODE edges and the
    last step are never trained."""
    n_trees, last, s_last, sizes, dev = adv[0].shape[0], tree.num_steps - 1, max(tree.splits), tree.sizes, adv[0].device
    keep = [torch.full((n_trees, sizes[i + 1]), i in sde_idx and i < last, device=dev) for i in range(tree.num_steps)]
    if tree.pruning == "depth":  # paper §3.4 / appendix A: a 4-step window, one step deeper every 30 iterations
        for i in tree.window_steps(iteration):
            keep[i][:] = False
    elif tree.pruning == "width":  # only the post-split chains (steps after the last split) are pruned
        a = adv[s_last]  # (P, M): the children of the last split, one per leaf; each chain below carries this advantage
        if tree.width_mode == "parent-top1":  # each parent of the last split keeps its best child's chain
            best = a.view(n_trees, -1, tree.branch_factor).argmax(-1)  # (P, parents)
            chain = torch.nn.functional.one_hot(best, tree.branch_factor).bool().flatten(1)
        else:  # extreme: the chains with the highest and the lowest advantages
            n_keep = max(2, int(a.shape[1] * tree.width_keep_ratio))
            order = a.argsort(1)
            kept = torch.cat([order[:, : n_keep // 2], order[:, a.shape[1] - (n_keep - n_keep // 2) :]], 1)
            chain = torch.zeros_like(a, dtype=torch.bool).scatter_(1, kept, True)
        for i in range(s_last + 1, last):
            keep[i] &= chain
    return keep


def pack_micro_batches(keep, tree: Tree, batch_size: int, device) -> list[list[tuple]]:
    """One update's micro-batches: the parents (step i, index p at depth i) with a trained child, `batch_size` at a
    time across steps (a pruned step leaves no small forward); per micro-batch its segments [(i, parents (rows,))]."""
    rows = []
    for i, k in enumerate(keep):  # k: (P, n_{i+1}) -> one row (i, p) per parent p with a trained child
        rows += [(i, p) for p in torch.nonzero(k.reshape(-1, tree.children(i)).any(1)).flatten().tolist()]
    batches = [rows[c : c + batch_size] for c in range(0, len(rows), batch_size)]
    return [[(i, torch.tensor([p for _, p in seg], device=device)) for i, seg in groupby(batch, lambda row: row[0])]
            for batch in batches]  # fmt: skip


def micro_batch(upd, segments, sigmas, tree: Tree):
    """One micro-batch of `upd`, one optimizer step's trees: parents x (rows, *L), sigma (rows,), cond, per segment
    `masks` of the trained children (len(parents) * n_children,), and for its E trained edges x_child, old_log_prob, adv."""
    device = upd["states"][0].device
    tree_of = torch.cat([parents // tree.sizes[i] for i, parents in segments])  # parent p at depth i: tree p // n_i
    masks, adv, old_log_prob, x_child = [], [], [], []
    for i, parents in segments:  # a parent's children are consecutive; only the trained edges are kept
        n_children = tree.children(i)
        child = (parents[:, None] * n_children + torch.arange(n_children, device=device)).flatten()
        masks.append(upd["keep"][i].flatten().to(device)[child])
        adv.append(upd["adv"][i].flatten().to(device)[child][masks[-1]])
        old_log_prob.append(upd["log_probs"][i][child][masks[-1]])
        x_child.append(upd["states"][i + 1][child][masks[-1]])
    x = torch.cat([upd["states"][i][parents] for i, parents in segments])
    sigma = torch.cat([sigmas[i].expand(len(parents)) for i, parents in segments]).to(device)
    cond = {key: val[tree_of] for key, val in upd["cond"].items()}
    return x, sigma, cond, masks, torch.cat(x_child), torch.cat(old_log_prob), torch.cat(adv)


def edge_gaussians(x, v, segments, masks, sigmas, g, tree: Tree):
    """Mean (E, *L) and std (E,) of the trained child edges of a micro-batch. x, v: (rows, *L), one run of rows per
    segment (step i, parents); masks[j] (len(parents) * n_children,) picks the trained children of segment j."""
    means, stds, rows = [], [], [len(parents) for _, parents in segments]
    for (i, _), m, x_i, v_i in zip(segments, masks, x.split(rows), v.split(rows)):
        mean, std = step_mean_std(x_i, v_i, sigmas[i], sigmas[i + 1], g[i])
        means.append(mean.repeat_interleave(tree.children(i), 0)[m])
        stds.append(torch.full((int(m.sum()),), std * tree.noise_scale(i), device=x.device))
    return torch.cat(means), torch.cat(stds)


def policy_loss(log_prob, old_log_prob, adv, mean, mean_ref, std, *, clip_range, kl_beta):  # dancegrpo.py's clip
    """The objective per sample (B,): the PPO-clipped surrogate max(-A r, -A clip(r, 1 - eps, 1 + eps)), r = exp(logp -
    logp_old), plus kl_beta * KL(N(mean, std^2) || N(mean_ref, std^2)) to the base model's step (per dimension, as the
    log-prob) if `mean_ref` is given; log_prob, old_log_prob, adv (B,), mean, mean_ref (B, *L), std (B,) or (B, 1..).
    Returns it and its figures, logged as losses/<name> (common.logs.summarize). A fork's new term: one line adding it
    to `loss`, its weight a keyword argument here (with a default) passed where main() calls this, a field of Args."""
    ratio = torch.exp(log_prob - old_log_prob)
    surrogate = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range))
    figures = {
        "policy": surrogate.mean(),
        "ratio_mean": ratio,
        "ratio_max_dev": (ratio - 1).abs().max(),
        "clipfrac": ((ratio - 1).abs() > clip_range).float().mean(),
        "approx_kl": (0.5 * (log_prob - old_log_prob) ** 2).mean(),
    }
    loss = surrogate
    if mean_ref is not None:
        kl = ((mean - mean_ref) ** 2).flatten(1).mean(1) / (2 * std.flatten() ** 2)  # (B,)
        loss = loss + kl_beta * kl  # term by term: a new term is one more such line
        figures["kl"] = kl.mean()
    return loss, {k: v.detach() for k, v in figures.items()}


def ema_decay(step: int, max_decay: float) -> float:  # same as in diffusionnft.py
    """Decay of the evaluation EMA after `step` optimizer steps: min((1 + s) / (10 + s), max_decay)."""
    return min((1 + step) / (10 + step), max_decay)


@torch.no_grad()
def soft_update(targets, sources, decay: float) -> None:  # same as in diffusionnft.py
    """targets <- decay targets + (1 - decay) sources, in place (lerp: decay 0 copies the sources bitwise)."""
    for t, s in zip(targets, sources, strict=True):
        t.lerp_(s.detach(), 1 - decay)


# ---------------------------------------------------------------------------------------------------
# Flag checks: the mode's defaults, then every flag, before a model loads (the shared flags are in common/flags.py)
# ---------------------------------------------------------------------------------------------------
MODE_FLAGS = [  # a flag of another mode is an error unless left at its default (no dead flags)
    *[(f, lambda a: a.fusion == "path", "--fusion path") for f in ("fusion_gamma", "fusion_temperature")],
    ("width_mode", lambda a: a.pruning == "width", "--pruning width"),
    ("width_keep_ratio", lambda a: a.width_mode == "extreme", "--pruning width --width-mode extreme"),
    *[(f, lambda a: a.pruning in ("depth", "mix"), "--pruning depth or mix") for f in ("window", "window_shift_every")],
    ("ema_max_decay", lambda a: a.ema, "--ema"),
]


def resolve_and_check(args: Args) -> tuple[list[str], list[str], RewardSpec]:
    """The mode's defaults filled in, this script's flags and the shared ones (common/flags.py) checked: a bad flag is
    one `error:` line naming it (those that need the process count: in main()). Returns check_run_args's."""
    check_flags(args, MODE_FLAGS)  # floats finite, every flag in its declared range, no dead flags
    splits = split_steps(args.split_schedule, args.num_steps, args.num_splits)
    after = args.num_steps - 2 - max(splits)  # trainable steps after the last split (T - 1 is deterministic)
    args.noise_level = args.noise_level or (0.3 if args.sde_type == "dance" else 0.7)  # None: the mode's default
    args.window = args.window or (max(1, after) if args.pruning == "depth" else 4)  # depth: all those steps, mix: 4
    args.exp_name = args.exp_name or Path(__file__).stem + ("" if args.pruning == "none" else f"_{args.pruning}")
    need(all(0 <= s <= args.num_steps - 2 for s in splits) and len(set(splits)) == len(splits),  # sparse 30 of 20
         f"--split-schedule gives splits {splits}: they must be distinct steps in [0, {args.num_steps - 2}] (the last "
         "step is deterministic); change --num-splits, --num-steps or --split-schedule")  # fmt: skip
    K, m = args.branch_factor, len(set(splits))  # a tree's leaves K ** m size every rollout: at most 2**16
    need(K**m <= 65536, f"--branch-factor {K} at {m} split steps makes {K}^{m} leaves per tree, more than 65536; lower "
         "--branch-factor or the splits (--num-splits, --split-schedule)")  # fmt: skip
    need(args.pruning not in ("depth", "mix") or args.window <= args.num_steps - 1,  # the window only where it is used
         f"--window must be in [1, {args.num_steps - 1}] (= --num-steps - 1)")  # fmt: skip
    need(args.pruning not in ("depth", "width") or after >= 1, f"--pruning {args.pruning}: the last split is step "
         f"{max(splits)} = --num-steps - 2, so no trainable step follows it; move the splits earlier "
         "(--split-schedule) or raise --num-steps")  # fmt: skip
    need(divides(args.trees_per_update, args.trees_per_device), "--trees-per-update must divide --trees-per-device")
    if args.pruning == "depth" and after < args.window:
        print(f"warning: --pruning depth: {after} trainable step(s) follow the last split {max(splits)}, so the "
              f"{args.window}-step window shrinks to {after} and cannot slide; raise --num-steps or split earlier",
              file=sys.stderr)  # fmt: skip
    return check_run_args(args)


def main(args: Args):
    # ---------------------------------------------------------------- SETUP
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    world, rank = accelerator.num_processes, accelerator.process_index
    inputs = resolve_and_check(args)  # flags checked, prompts read, --reward parsed, before any model loads
    need(not args.ema or accelerator.distributed_type != DistributedType.FSDP, "--ema keeps an EMA beside the trained "
         "weights, which FSDP would shard: use DDP with --lora, or leave --ema off")  # fmt: skip
    mode = args.pruning + (f" ({args.width_mode})" if args.pruning == "width" else "")
    run = Run(args, accelerator, f"BranchGRPO, pruning {mode}", frozen_copy=args.kl_beta > 0 and not args.lora)
    set_seed(args.seed)  # LoRA init and anything else not keyed through rng()
    device, autocast = accelerator.device, accelerator.autocast
    frozen_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    splits = split_steps(args.split_schedule, args.num_steps, args.num_splits)
    tree = Tree(splits=tuple(splits), **{f.name: getattr(args, f.name) for f in fields(Tree) if f.name != "splits"})
    sizes, n_leaves = tree.sizes, tree.sizes[-1]  # nodes per depth (T + 1,), leaves per tree M

    # ---------------------------------------------------------------- MODELS
    model = load_model(args.model_id, device, frozen_dtype, args.resolution, args.num_frames, args.offload_frozen)
    sigmas = model.sigmas(args.num_steps) if args.shift == "pipeline" else sigma_schedule(args.num_steps, args.shift)
    g = noise_g(sigmas, args.sde_type, args.noise_level)  # (T,)
    denoiser = trainable_denoiser(model, args)  # trained in fp32: all weights, or a LoRA adapter (--lora)
    ref = denoiser if args.lora else frozen_copy(denoiser, frozen_dtype) if args.kl_beta > 0 else None  # KL reference
    latent_shape = model.latent_shape()

    # ---------------------------------------------------------------- PROMPTS & REWARDS
    train_prompts, eval_prompts, reward_spec = inputs
    reward_fn = build_reward(reward_spec, device, args.offload_frozen, args.reward_frames)

    # ---------------------------------------------------------------- OPTIMIZER
    params = [p for p in denoiser.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    denoiser, optimizer = accelerator.prepare(denoiser, optimizer)
    ema = [p.detach().clone() for p in params] if args.ema else []  # the evaluation EMA (--ema)
    if args.ema:  # registered only with --ema: the default run's checkpoints stay as they were
        accelerator.register_for_checkpointing(Carried(ema=ema))  # before resume() loads it

    # ---------------------------------------------------------------- RESUME, EVALUATOR, BANNER
    start = run.resume()  # 0, or the iteration of the --resume-from checkpoint (weights, optimizer, RNG, counters)
    evaluate = Evaluator(args, model, denoiser, reward_fn, eval_prompts, run, args.rollout_batch_size)  # Euler ODE
    forwards, edges = tree.counts()
    zeros = [torch.zeros(1, n) for n in sizes[1:]]  # cpu: dummy advantages (they don't matter) for the banner's count
    edges_at_0 = sum(int(k.sum()) for k in trained_edges(tree, sde_steps(tree, 0), zeros, 0))
    corr = f" (sibling correlation {1 / (1 + tree.branch_s):.3f})" if args.branch_noise == "correlated" else ""
    lines = [
        f"tree: {args.num_steps} steps, splits {splits}, K {args.branch_factor} -> {n_leaves} leaves, {forwards} node "
        f"forwards ({forwards / n_leaves:.2f} / leaf), {edges} edges, {edges_at_0} trained at iteration 0",
        f"branch noise {args.branch_noise} s={args.branch_s}{corr}, {args.sde_type} noise {args.noise_level}",
        f"{world} processes x {args.trees_per_device} trees, {args.trees_per_update} per optimizer step, micro-batch "
        f"{args.rollout_batch_size} nodes, fusion {args.fusion}, KL beta {args.kl_beta}, clip {args.clip_range}",
        *([f"EMA for evaluation and final/, max decay {args.ema_max_decay}"] if args.ema else []),
    ]
    run.banner(model, params, lines)
    with weights_swapped(params, ema, args.ema):  # evaluation sees the EMA weights, as in diffusionnft.py
        evaluate(start, final=start == args.iterations)  # at the start; resumed: what the interrupted run missed
    n_updates = args.trees_per_device // args.trees_per_update
    for it in run.iterations(start):
        # ------------------------------------------------------------ SAMPLING
        # The same prompt draw on every process; process r owns trees [r P, (r + 1) P), P = --trees-per-device
        drawn = draw_prompts(train_prompts, world * args.trees_per_device, args.seed, it)
        tree_ids = list(range(rank * args.trees_per_device, (rank + 1) * args.trees_per_device))
        sde_idx = sde_steps(tree, it)  # SDE steps; the rest (with --pruning mix) are Euler ODE steps
        updates = []  # per optimizer step, its --trees-per-update trees: cond, states, log_probs, request (then adv, keep)
        denoiser.eval()
        for u in range(n_updates):
            ids = tree_ids[u * args.trees_per_update : (u + 1) * args.trees_per_update]
            cond = model.encode_prompts([drawn[t] for t in ids])
            gens = [rng(args.seed, it, "root", t) for t in ids]
            roots = torch.stack([torch.randn(latent_shape, generator=gen, device="cpu") for gen in gens]).to(device)
            noise_fn = partial(tree_noise, tree, args.seed, it, ids, latent_shape)
            states, log_probs = tree_rollout(model, denoiser, cond, roots, noise_fn, tree, sigmas, g, sde_idx,
                                             args.rollout_batch_size, args.guidance_scale, autocast)  # fmt: skip
            with torch.no_grad():  # the leaves' rewards asked now: a served reward answers while the next group samples
                leaf_prompts = [drawn[t] for t in ids for _ in range(n_leaves)]
                request = reward_fn.request(model.decode(states[-1]).float(), leaf_prompts)  # collect() scores it
            updates.append({"cond": cond, "states": states, "log_probs": log_probs, "request": request})
        t_sample = time.perf_counter() - run.t_iter

        # ------------------------------------------------------------ REWARDS & ADVANTAGES
        rewards, parts = reward_fn.collect([upd["request"] for upd in updates])  # (trees * leaves,) and per component
        per_reward = args.advantage_aggregation == "per-reward"
        scores, weights = (parts, reward_fn.weights) if per_reward else ({"sum": rewards}, {"sum": 1.0})
        for u, upd in enumerate(updates):
            leaf = {k: scores[k].to(device).view(n_updates, -1, n_leaves)[u] for k in weights}  # (P_u, M) per score
            # per step i, the advantages of its children (P_u, n_{i+1}), clipped; then which edges are trained
            upd["adv"] = tree_advantages(leaf, weights, upd["log_probs"], sizes, fusion=args.fusion,
                                         fusion_gamma=args.fusion_gamma, fusion_temperature=args.fusion_temperature,
                                         adv_clip_max=args.adv_clip_max)  # fmt: skip
            upd["keep"] = trained_edges(tree, sde_idx, upd["adv"], it)  # bool (P_u, n_{i+1}) per step
        all_rewards = accelerator.gather(rewards.float().to(device))
        parts = {k: accelerator.gather(v.float().to(device)) for k, v in parts.items()}

        # ------------------------------------------------------------ TRAINING
        model.park(), reward_fn.park()  # --offload-frozen: the VAE and the reward models leave the GPU
        denoiser.train()
        stats, n_trained_edges, n_train_forwards = defaultdict(list), 0, 0  # stats: policy_loss's figures
        for upd in updates:  # one optimizer step per update, over its trained edges
            batches = pack_micro_batches(upd["keep"], tree, args.rollout_batch_size, device)
            n_edges = sum(int(k.sum()) for k in upd["keep"])
            n_trained_edges += n_edges
            n_train_forwards += sum(len(parents) for segments in batches for _, parents in segments)
            for b, segments in enumerate(batches):
                x, sig, cond, masks, x_child, old_lp, adv = micro_batch(upd, segments, sigmas, tree)
                with accelerator.no_sync(denoiser) if b < len(batches) - 1 else nullcontext():
                    with autocast():  # each trained edge's log-prob under the current policy, then the loss
                        v = model.velocity(denoiser, x, sig, cond, args.guidance_scale).float()
                    mean, std = edge_gaussians(x, v, segments, masks, sigmas, g, tree)
                    log_prob = gaussian_log_prob(x_child, mean, std)
                    mean_ref = None
                    if args.kl_beta > 0:  # the KL reference's Gaussian of each trained edge
                        with autocast():  # the base model: frozen copy, or LoRA adapter off
                            v_ref = reference_velocity(model, ref, args.lora, x, sig, cond, args.guidance_scale)
                        mean_ref, _ = edge_gaussians(x, v_ref.float(), segments, masks, sigmas, g, tree)
                    loss, figures = policy_loss(log_prob, old_lp, adv, mean, mean_ref, std, clip_range=args.clip_range,
                                                kl_beta=args.kl_beta)  # fmt: skip
                    accelerator.backward(loss.sum() / max(1, n_edges))  # the mean over this update's trained edges
                for k, v in figures.items():
                    stats[k].append(v)
            lr = args.learning_rate * min(1.0, (run.optimizer_steps + 1) / max(1, args.lr_warmup))  # linear warmup
            optimizer.param_groups[0]["lr"] = lr  # one group: every trained parameter
            norm = accelerator.clip_grad_norm_(params, args.max_grad_norm)  # before clipping
            if stepped := all_finite(norm, accelerator):  # else skipped on every process
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run.count_step(lr, norm, stepped)  # logged at the iteration's end; the warmup and resume count it
            if stepped and args.ema:  # as in diffusionnft.py: a skipped step moves neither the weights nor the EMA
                soft_update(ema, params, ema_decay(run.optimizer_steps, args.ema_max_decay))

        # ------------------------------------------------------------ LOGGING
        leaves_here = args.trees_per_device * n_leaves
        log = {
            **reward_stats(all_rewards, parts),
            "rewards/tree_std": all_rewards.view(-1, n_leaves).std(1).mean().item(),
            **summarize(stats, "losses/"),  # every figure of policy_loss
            "losses/first_ratio_max_dev": stats["ratio_max_dev"][0].item(),  # 0: the first ratio is exactly 1
            "tree/rollout_forwards_per_leaf": forwards / n_leaves,
            "tree/trained_edges_per_leaf": n_trained_edges / leaves_here,
            "tree/train_forwards_per_leaf": n_train_forwards * (2 if args.kl_beta > 0 else 1) / leaves_here,
            "perf/sampling_s": t_sample,
            "perf/reward_wait_s": reward_fn.wait_s,
            **({"charts/window_start": tree.window_steps(it)[0]} if args.pruning in ("depth", "mix") else {}),
            **({"charts/ema_decay": ema_decay(run.optimizer_steps, args.ema_max_decay)} if args.ema else {}),
        }
        run.end_iteration(it, log, params)  # + gradient norms, timings; metrics.jsonl, TensorBoard, W&B

        # ------------------------------------------------------------ CHECKPOINT
        run.checkpoint(it + 1, final=it + 1 == args.iterations)  # + on SIGTERM / Ctrl-C, then exits

        # ------------------------------------------------------------ EVAL
        with weights_swapped(params, ema, args.ema):  # as in diffusionnft.py
            evaluate(it + 1, final=it + 1 == args.iterations)

    # ---------------------------------------------------------------- FINAL SAVE
    with weights_swapped(params, ema, args.ema):  # final/ holds the EMA weights, as in diffusionnft.py
        run.save_final(model, denoiser, args.lora)


if __name__ == "__main__":
    cli(main, Args)
