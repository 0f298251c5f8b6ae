# BranchGRPO: docs/branchgrpo.md; paper: arXiv 2509.06040 (Li et al., "BranchGRPO: Stable and Efficient GRPO with Structured Branching")
"""GRPO on tree-structured SDE rollouts of a flow-matching text-to-image model, one file.

Every prompt grows one tree: the trajectories share their early denoising prefix and split into K children at chosen
steps, so 16 leaves cost 203 node forwards instead of 320 (20 steps, splits 0,3,6,9, K = 2). All nodes of a depth go
through one batched forward. Leaf rewards are fused upward into node values, normalised per depth within the tree, and
each edge parent -> child is trained with its child's advantage under the PPO-clipped ratio of its SDE step. Width
pruning, depth pruning or a sliding ODE/SDE mix only change which edges are trained, never the rollout or the rewards.

Launch (run.sh has more):
    python branchgrpo.py                                            # ShapesBench on CPU, ~8 min
    python branchgrpo.py --pruning depth                            # depth pruning (every post-split step left out)
    PROMPTS=prompts.txt bash run.sh branchgrpo-flux-8gpu            # FLUX.1-dev, depth pruning, 8 GPUs; docs/gpu.md: all of them
    PROMPTS=prompts.txt bash run.sh branchgrpo-wan-8gpu             # Wan2.1 text-to-video, 8 GPUs; docs/video.md
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 branchgrpo.py   # 2 CPU processes
    python branchgrpo.py --resume-from latest                       # continue the newest runs/branchgrpo__*

ShapesBench defaults that differ from the paper (run.sh's GPU recipes use the paper's; docs/branchgrpo.md says why):
--sde-type flow (a = 0.7), not eta 0.3; --clip-range 1e-3, not 1e-4 (log-probs are means over latent dimensions);
4 trees per process, 2 per update, lr 6e-4, a depth window of all 9 post-split steps, not 4; LoRA r32, no KL, 40 it.
Deviations from the release (docs/branchgrpo.md explains each): the paper's correlated branch noise (the release's 4x
scaled independent noise is --branch-noise scaled); nodes batched per depth; path fusion as a softmax over descendant
leaves; parent-top1 width pruning keeps each last-split parent's best chain; depth and Mix windows slide with
iterations; the deterministic last step is not trained; optimizer steps counted in trees, not edges.
"""

from __future__ import annotations

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
from common.runs import Evaluator, Run, RunArgs, check_mode_flags, check_run_args, cli, draw_prompts, need
from common.sampling import keyed_generator as rng  # (seed, iteration, ...) -> a generator


@dataclass
class Args(RunArgs):  # the shared flags (--model-id, --reward, --iterations, ...) are in common/runs.py
    learning_rate: float = 6e-4  # AdamW learning rate (constant after --lr-warmup); 2x the shared default (docstring)
    num_steps: int = 20
    """sampling steps T of a rollout (shifted sigma schedule), as the paper"""
    shift: float = 3.0
    """SD3 time shift k of the sigma schedule: sigma = k u / (1 + (k - 1) u)"""
    sde_type: Literal["dance", "flow"] = "flow"
    """noise schedule g(sigma): 'dance' = constant eta (DanceGRPO, the release), 'flow' = a sqrt(sigma / (1 - sigma))"""
    noise_level: Optional[float] = None
    """eta for 'dance', a for 'flow'; if unset: 0.3 for 'dance', 0.7 for 'flow'"""
    split_schedule: str = "dense"
    """split steps: 'dense' (0,3,6,...), 'sparse' (evenly spread), 'late' (second half) or a list like '0,3,6,9'"""
    num_splits: int = 4
    """number of split steps m for the named schedules"""
    branch_factor: int = 2
    """children per split K; leaves per tree M = K ** m"""
    branch_noise: Literal["correlated", "scaled"] = "correlated"
    """'correlated': siblings share part of their noise, each child is an exact SDE step (paper); 'scaled': independent noise times s (release)"""
    branch_s: float = 4.0
    """correlated: ratio s of branch-specific to shared noise variance, rho = 1 / (1 + s); scaled: the noise multiplier"""
    trees_per_device: int = 4
    """prompts (trees) per process per iteration"""
    trees_per_update: int = 2
    """trees whose edges are accumulated into one optimizer step"""
    rollout_batch_size: int = 16
    """nodes per transformer forward (batched per depth); also the training micro-batch of parents"""
    fusion: Literal["uniform", "path"] = "uniform"
    """node value from its leaves: 'uniform' mean, or 'path' softmax of gamma * path log-prob / temperature"""
    fusion_gamma: float = 1.0
    """--fusion path: weight gamma of the path log-prob (0 gives uniform)"""
    fusion_temperature: float = 1.0
    """--fusion path: softmax temperature"""
    pruning: Literal["none", "width", "depth", "mix"] = "none"
    """which edges are trained: all, width-pruned, depth-pruned, or only SDE edges of a sliding Mix window"""
    width_mode: Literal["parent-top1", "extreme"] = "parent-top1"
    """--pruning width: each last-split parent keeps its best child's chain, or the extreme chains"""
    width_keep_ratio: float = 0.5
    """--width-mode extreme: fraction of post-split chains kept, half best and half worst"""
    window: Optional[int] = None
    """--pruning depth / mix: window size W in steps (unset: every step after the last split for depth, 4 for mix)"""
    window_shift_every: int = 30
    """--pruning depth / mix: the window moves one step deeper every E iterations"""
    clip_range: float = 1e-3
    """PPO clip epsilon on the ratio (log-probs are means over latent dimensions, hence small)"""
    adv_clip_max: float = 5.0
    """advantages are clipped to +-this"""
    kl_beta: float = 0.0
    """weight beta of the per-step Gaussian KL to the frozen base model (0 = off, as the release)"""


# ---------------------------------------------------------------------------------------------------
# ALGO LOGIC, in the order main() meets it: schedule and SDE step (copies of dancegrpo.py's), the tree and its noise,
# the rollout, leaf rewards -> node values -> advantages, pruning, training micro-batches. Notation (docs/math.md):
# T steps, step i takes depth i to i + 1, K children per split, M = K ** m leaves, P trees, n_i nodes at depth i, *L
# the latent shape. Per-step lists (log-probs, advantages, trained-edge masks) hold step i's edges into depth i + 1.
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


def split_steps(schedule: str, num_steps: int, num_splits: int) -> list[int]:
    """Split steps: 'dense' every 3rd from 0 (0,3,6,9: the release's launcher schedule, taken as the paper's Dense,
    whose steps §4.2 does not list); 'sparse' spread over the trajectory (0,5,10,15 for T = 20); 'late' spread over
    the second half (10,12,14,16); or a comma-separated list. Splits must precede the last step."""
    if schedule == "dense":
        return [3 * n for n in range(num_splits)]
    if schedule == "sparse":
        return [n * (num_steps // num_splits) for n in range(num_splits)]
    if schedule == "late":
        half = num_steps // 2
        return [half + n * max(1, (num_steps - 1 - half) // num_splits) for n in range(num_splits)]
    try:
        return sorted({int(s) for s in schedule.split(",")})
    except ValueError:
        raise InputError(f"--split-schedule {schedule!r}: use dense, sparse, late or a list like 0,3,6,9") from None


def children(i: int, splits: list[int], branch_factor: int) -> int:
    """Children per node at step i: K at a split, else 1. The rollout and the training must agree on it."""
    return branch_factor if i in splits else 1


def tree_sizes(num_steps: int, splits: list[int], branch_factor: int) -> list[int]:
    """Nodes n_i per depth i (T + 1,): depth 0 is the root x_0 (pure noise), depth i + 1 holds the states after step i.
    Nodes are stored tree-major, the children of a parent consecutive: node j of depth i belongs to tree j // n_i."""
    n = [1]
    for i in range(num_steps):
        n.append(n[-1] * children(i, splits, branch_factor))
    return n


def tree_counts(num_steps: int, splits: list[int], branch_factor: int) -> tuple[int, int]:
    """(node forwards, edges) of one tree: forwards = sum of nodes at depths 0..T-1, edges = sum at depths 1..T.
    For T = 20, splits 0,3,6,9, K = 2: (203, 218), i.e. 12.69 and 13.625 per leaf (the release's README: 13.68)."""
    n = tree_sizes(num_steps, splits, branch_factor)
    return sum(n[:-1]), sum(n[1:])


def noise_scale(i: int, splits: list[int], args) -> float:
    """Multiplier of the step-i noise std: s at the splits with the release's 'scaled' branch noise, else 1 (the
    correlated noise is exactly N(0, I) per child). Rollout and training score an edge under the same std."""
    return args.branch_s if children(i, splits, args.branch_factor) > 1 and args.branch_noise == "scaled" else 1.0


def branch_noise(gen, n_parents: int, n_children: int, shape, rho: float) -> torch.Tensor:
    """Noise of the children of each parent, (n_parents * n_children, *shape), children of a parent consecutive.
    z_c = sqrt(rho) xi_parent + sqrt(1 - rho) xi_c with fresh xi at every split (paper appendix B.1): every z_c is
    N(0, I), so each child edge is an exact SDE transition, and siblings have correlation rho."""
    shared = torch.randn((n_parents, 1, *shape), generator=gen, device=gen.device)
    own = torch.randn((n_parents, n_children, *shape), generator=gen, device=gen.device)
    return (math.sqrt(rho) * shared + math.sqrt(1 - rho) * own).flatten(0, 1)


def tree_noise(args, iteration, tree_ids: list[int], splits, latent_shape, rho: float, i: int, n_parents: int):
    """Unscaled step-i noise z_i of the trees `tree_ids`, (P * n_parents * n_children, *L), children of a parent
    consecutive; keyed on (seed, iteration, tree, step), so it depends neither on chunking nor on the process count."""
    n_children, per_tree = children(i, splits, args.branch_factor), []
    for t in tree_ids:
        gen = rng(args.seed, iteration, "tree", t, i)
        if n_children > 1 and args.branch_noise == "correlated":
            per_tree.append(branch_noise(gen, n_parents, n_children, latent_shape, rho))
        else:
            per_tree.append(torch.randn((n_parents * n_children, *latent_shape), generator=gen, device=gen.device))
    return torch.cat(per_tree)


def mix_window(num_steps: int, size: int, shift_every: int, iteration: int) -> list[int]:
    """Mix: the SDE window [i_W, i_W + W) with i_W = iteration // E, stopping once it ends at step T - 2."""
    start = min(iteration // shift_every, num_steps - 1 - size)
    return list(range(start, start + size))


def sde_steps(args, splits: list[int], iteration: int) -> set[int]:
    """Steps sampled by the SDE: all but the deterministic last one; with --pruning mix only the sliding window
    (from step 0) and the splits, every other step an Euler ODE step."""
    if args.pruning == "mix":
        return set(mix_window(args.num_steps, args.window, args.window_shift_every, iteration)) | set(splits)
    return set(range(args.num_steps - 1))


@torch.no_grad()
def tree_rollout(model, transformer, cond, roots, sigmas, g, splits, sde_set, noise_fn, args, autocast):
    """Grow P trees at once. roots: (P, *L), one per tree; cond: dict of (P, ...) tensors. Depth by depth, all nodes
    (tree-major, children of a parent consecutive) go through the transformer in chunks of --rollout-batch-size.
    noise_fn(step, n_parents_per_tree) -> (P * n_parents * n_children, *L) unscaled step noise; its std is the
    step's std times noise_scale(). Returns states: list over depths of T + 1 tensors (P * n_i, *L) fp32, and
    log_probs: list over steps of T tensors (P * n_{i+1},), the old log-prob of every edge (0 at ODE steps)."""
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
        n_children = children(i, splits, args.branch_factor)
        if i in sde_set:
            mean, std = step_mean_std(x, v, sigmas[i], sigmas[i + 1], g[i])
            std = std * noise_scale(i, splits, args)
            mean = mean.repeat_interleave(n_children, 0)
            x_next = mean + std * noise_fn(i, len(x) // len(roots)).to(x.device)
            log_probs.append(gaussian_log_prob(x_next, mean, std))
        else:  # ODE (Euler) step; splits are always SDE
            x_next = x + (sigmas[i + 1] - sigmas[i]) * v
            log_probs.append(torch.zeros(len(x), device=x.device))
        tree_of = tree_of.repeat_interleave(n_children)
        states.append(x_next)
    return states, log_probs


def node_values(leaf_rewards, log_probs, sizes, fusion: str, gamma: float, temperature: float) -> list[torch.Tensor]:
    """Fuse leaf rewards (P, M) into node values V, a list over depths of (P, n_i) (paper §3.3). A node at depth i
    covers a contiguous block of M / n_i leaves. 'uniform': the block mean. 'path': a softmax over the block of
    gamma * lp(node -> leaf) / temperature, where lp is the sum of the edge log-probs (per-dim means) from the
    node down to the leaf; gamma = 0 is exactly uniform."""
    n_trees, n_leaves = leaf_rewards.shape
    if fusion == "path":
        # per-leaf log-prob of its edge at each step: (P, M, T), then suffix sums from each depth
        per_step = [
            lp.view(n_trees, sizes[i + 1]).repeat_interleave(n_leaves // sizes[i + 1], 1)
            for i, lp in enumerate(log_probs)
        ]
        suffix = torch.flip(torch.cumsum(torch.flip(torch.stack(per_step, -1).double(), [-1]), -1), [-1])
    values = []
    for depth, n in enumerate(sizes):
        r = leaf_rewards.view(n_trees, n, n_leaves // n).double()
        if fusion == "uniform" or depth == len(sizes) - 1:
            values.append(r.mean(-1))
        else:
            weights = torch.softmax(gamma * suffix[..., depth].view(n_trees, n, -1) / temperature, -1)
            values.append((weights * r).sum(-1))
    return values


def depth_advantages(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per tree and depth, z-score the node values: A = (V - mean) / (std + 1e-8), unbiased std (the release);
    0 where a depth has one node or its values are equal (std < 1e-6). List over depths of (P, n_i), float32."""
    out = []
    for v in values:
        if v.shape[1] < 2:
            out.append(torch.zeros_like(v, dtype=torch.float32))
            continue
        std = v.std(1, keepdim=True)
        a = (v - v.mean(1, keepdim=True)) / (std + 1e-8)
        out.append(torch.where(std < 1e-6, torch.zeros_like(a), a).float())
    return out


def depth_window(num_steps: int, last_split: int, size: int, shift_every: int, iteration: int) -> list[int]:
    """Steps whose edges depth pruning leaves out of the loss: W steps from right after the last split, one step deeper
    every E iterations, until the window ends at step T - 2 (or what fits there: validate warns at start-up)."""
    first, last = last_split + 1, num_steps - 2
    size = min(size, last - first + 1)
    start = min(first + iteration // shift_every, last - size + 1)
    return list(range(start, start + size))


def trained_edges(args, splits, sizes, sde_set, adv, iteration) -> list[torch.Tensor]:
    """Which edges are trained, a list over steps of bool (P, n_{i+1}); adv[i] (P, n_{i+1}) holds the advantages of
    the children of step i. Pruning acts here only: the rollout and the rewards are the same whatever it is. ODE
    edges and the last (deterministic) step are never trained."""
    n_trees, last, s_last = adv[0].shape[0], args.num_steps - 1, max(splits)
    dev = adv[0].device  # the masks meet the advantages (on the GPU in training)
    keep = [torch.full((n_trees, sizes[i + 1]), i in sde_set and i < last, device=dev) for i in range(args.num_steps)]
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
            kept = torch.cat([order[:, : n_keep // 2], order[:, a.shape[1] - (n_keep - n_keep // 2) :]], 1)
            chain = torch.zeros_like(a, dtype=torch.bool).scatter_(1, kept, True)
        for i in range(s_last + 1, last):
            keep[i] &= chain
    return keep


def pack_micro_batches(keep, splits, branch_factor: int, batch_size: int, device) -> list[list[tuple]]:
    """The training micro-batches of one update: the parents (step i, index p at depth i) with a trained child edge,
    in rollout order, packed --rollout-batch-size at a time across steps, so that a pruned step leaves no small
    forward. Returns per micro-batch its segments [(i, parent indices (rows,))], one per step it spans."""
    rows = []
    for i, k in enumerate(keep):  # k: (P, n_{i+1}) -> one row per parent with a trained child
        has_child = k.reshape(-1, children(i, splits, branch_factor)).any(1)
        rows += [(i, p) for p in torch.nonzero(has_child).flatten().tolist()]
    batches = [rows[c : c + batch_size] for c in range(0, len(rows), batch_size)]
    return [
        [(i, torch.tensor([p for _, p in seg], device=device)) for i, seg in groupby(batch, itemgetter(0))]
        for batch in batches
    ]


def micro_batch(grp, segments, sigmas, sizes, splits, args):
    """One micro-batch of update group `grp`: parents x (rows, *L), sigma (rows,), cond, per segment `masks` of the
    trained children (len(parents) * n_children,), and for its E trained edges x_child (E, *L), old_log_prob, adv."""
    device = grp["states"][0].device
    # nodes are tree-major: parent p at depth i belongs to tree p // n_i, whose prompt encoding it uses
    tree_of = torch.cat([parents // sizes[i] for i, parents in segments])
    masks, adv, old_log_prob, x_child = [], [], [], []
    for i, parents in segments:  # a parent's children are consecutive; only the trained edges are kept
        n_children = children(i, splits, args.branch_factor)
        child = (parents[:, None] * n_children + torch.arange(n_children, device=device)).flatten()
        masks.append(grp["keep"][i].flatten().to(device)[child])
        adv.append(grp["adv"][i].flatten().to(device)[child][masks[-1]])
        old_log_prob.append(grp["log_probs"][i][child][masks[-1]])
        x_child.append(grp["states"][i + 1][child][masks[-1]])
    x = torch.cat([grp["states"][i][parents] for i, parents in segments])
    sigma = torch.cat([sigmas[i].expand(len(parents)) for i, parents in segments]).to(device)
    cond = {key: val[tree_of] for key, val in grp["cond"].items()}
    return x, sigma, cond, masks, torch.cat(x_child), torch.cat(old_log_prob), torch.cat(adv)


def edge_gaussians(x, v, segments, masks, sigmas, g, splits, args):
    """Mean (E, *L) and std (E,) of the trained child edges of a micro-batch. x, v: (rows, *L), one run of rows per
    segment (step i, parents); masks[j] (len(parents) * n_children,) picks the trained children of segment j."""
    means, stds, rows = [], [], [len(parents) for _, parents in segments]
    for (i, _), m, x_i, v_i in zip(segments, masks, x.split(rows), v.split(rows)):
        mean, std = step_mean_std(x_i, v_i, sigmas[i], sigmas[i + 1], g[i])
        means.append(mean.repeat_interleave(children(i, splits, args.branch_factor), 0)[m])
        stds.append(torch.full((int(m.sum()),), std * noise_scale(i, splits, args), device=x.device))
    return torch.cat(means), torch.cat(stds)


def grpo_loss(log_prob, old_log_prob, adv, clip_range: float):  # same as in dancegrpo.py
    """PPO-clipped surrogate per sample: max(-A r, -A clip(r, 1 - eps, 1 + eps)), r = exp(logp - logp_old). (B,)"""
    ratio = torch.exp(log_prob - old_log_prob)
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)), ratio


# ---------------------------------------------------------------------------------------------------
# Flag checks (run plumbing: evaluation, grids, checkpoints, resume and logging live in common/runs.py)
# ---------------------------------------------------------------------------------------------------
MODE_FLAGS = [  # a flag of another mode is an error unless left at its default (no dead flags)
    ("fusion_gamma", lambda a: a.fusion == "path", "--fusion path"),
    ("fusion_temperature", lambda a: a.fusion == "path", "--fusion path"),
    ("width_mode", lambda a: a.pruning == "width", "--pruning width"),
    ("width_keep_ratio", lambda a: a.width_mode == "extreme", "--pruning width --width-mode extreme"),
    ("window", lambda a: a.pruning in ("depth", "mix"), "--pruning depth or mix"),
    ("window_shift_every", lambda a: a.pruning in ("depth", "mix"), "--pruning depth or mix"),
]


def resolve_defaults(args: Args) -> None:
    """The mode-dependent defaults (--noise-level, --exp-name); a flag set for another mode is an error."""
    check_mode_flags(args, MODE_FLAGS)
    if args.noise_level is None:
        args.noise_level = 0.3 if args.sde_type == "dance" else 0.7
    if args.window is None:  # depth: no post-split edge in the loss (docs/branchgrpo.md); mix: the paper's 4
        last_split = max(split_steps(args.split_schedule, args.num_steps, args.num_splits), default=0)
        args.window = max(1, args.num_steps - 2 - last_split) if args.pruning == "depth" else 4
    args.exp_name = args.exp_name or Path(__file__).stem + ("" if args.pruning == "none" else f"_{args.pruning}")


def validate(args: Args, world: int) -> tuple[list[str], list[str]]:
    """Check this script's flags, then the shared ones (common.runs); returns (training prompts, held-out prompts)."""
    need(args.num_steps >= 2, "--num-steps must be at least 2 (the last step is a deterministic Euler step)")
    splits = split_steps(args.split_schedule, args.num_steps, args.num_splits)
    need(
        len(splits) >= 1 and all(0 <= s <= args.num_steps - 2 for s in splits),
        f"--split-schedule gives splits {splits}: they must lie in [0, {args.num_steps - 2}] (the last step is "
        "deterministic); change --num-splits, --num-steps or --split-schedule",
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
    if args.pruning == "depth" and after < args.window:
        print(
            f"warning: --pruning depth: {after} trainable step(s) follow the last split {max(splits)}, so the "
            f"{args.window}-step window shrinks to {after} and cannot slide; raise --num-steps or split earlier",
            file=sys.stderr,
        )
    return check_run_args(args)


def main(args: Args):
    # ---------------------------------------------------------------- SETUP
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    world, rank = accelerator.num_processes, accelerator.process_index
    resolve_defaults(args)
    prompt_lists = validate(args, world)  # every flag and input checked (prompt files read) before a model loads
    mode = args.pruning + (f" ({args.width_mode})" if args.pruning == "width" else "")
    run = Run(args, accelerator, f"BranchGRPO, pruning {mode}", frozen_copy=args.kl_beta > 0 and not args.lora)
    set_seed(args.seed)  # LoRA init and anything else not keyed through rng()
    device, autocast = accelerator.device, accelerator.autocast
    frozen_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    sigmas = sigma_schedule(args.num_steps, args.shift)  # (T + 1,)
    g = noise_g(sigmas, args.sde_type, args.noise_level)  # (T,)
    splits = split_steps(args.split_schedule, args.num_steps, args.num_splits)
    sizes = tree_sizes(args.num_steps, splits, args.branch_factor)  # nodes per depth, (T + 1,)
    n_leaves = sizes[-1]  # M
    rho = 1 / (1 + args.branch_s)  # correlated branch noise: Var(branch-specific) / Var(shared) = s

    # ---------------------------------------------------------------- MODELS
    model = load_model(args.model_id, device, frozen_dtype, args.resolution, args.num_frames, args.offload_frozen)
    transformer = trainable_denoiser(model, args)  # trained in fp32: all weights, or a LoRA adapter (--lora)
    # KL reference policy: with LoRA this module itself (unwrapped) with the adapter off, else a frozen copy of the base
    ref = transformer if args.lora else frozen_copy(transformer, frozen_dtype) if args.kl_beta > 0 else None
    latent_shape = model.latent_shape()

    # ---------------------------------------------------------------- PROMPTS & REWARDS
    train_prompts, eval_prompts = prompt_lists
    reward_fn = build_reward(args.reward, device, args.reward_checkpoints(), args.offload_frozen, args.reward_frames)

    # ---------------------------------------------------------------- OPTIMIZER
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)

    # ---------------------------------------------------------------- RESUME, EVALUATOR, BANNER
    start = run.resume()  # 0, or the iteration of the --resume-from checkpoint (weights, optimizer, RNG, counters)
    evaluate = Evaluator(args, model, transformer, reward_fn, eval_prompts, run, args.rollout_batch_size)  # Euler ODE
    forwards, edges = tree_counts(args.num_steps, splits, args.branch_factor)
    zeros = [torch.zeros(1, n) for n in sizes[1:]]  # advantages do not matter to the count
    edges_at_0 = sum(int(k.sum()) for k in trained_edges(args, splits, sizes, sde_steps(args, splits, 0), zeros, 0))
    corr = f" (sibling correlation {rho:.3f})" if args.branch_noise == "correlated" else ""
    lines = [
        f"tree: {args.num_steps} steps, splits {splits}, K {args.branch_factor} -> {n_leaves} leaves, {forwards} node "
        f"forwards ({forwards / n_leaves:.2f} / leaf), {edges} edges, {edges_at_0} trained at iteration 0",
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
        groups = []  # one dict per update group of trees: prompts, cond, states, log_probs (then adv, keep)
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
            values = node_values(r, grp["log_probs"], sizes, args.fusion, args.fusion_gamma, args.fusion_temperature)
            depth_adv = depth_advantages(values)  # per depth, (P_u, n_i), P_u = --trees-per-update
            # per step i, the advantages of its children (depth i + 1), clipped; then which edges are trained
            grp["adv"] = [a.clamp(-args.adv_clip_max, args.adv_clip_max) for a in depth_adv[1:]]
            grp["keep"] = trained_edges(args, splits, sizes, sde_set, grp["adv"], it)  # bool (P_u, n_{i+1}) per step
        all_rewards = accelerator.gather(rewards.float().to(device))
        parts = {k: accelerator.gather(v.float().to(device)) for k, v in parts.items()}

        # ------------------------------------------------------------ TRAINING
        model.park(), reward_fn.park()  # --offload-frozen: the VAE and the reward models leave the GPU
        transformer.train()
        stats = {k: [] for k in ("policy_loss", "kl", "ratio", "clipfrac", "approx_kl")}
        n_trained_edges, n_train_forwards = 0, 0
        for grp in groups:  # one optimizer step per update group, over its trained edges
            batches = pack_micro_batches(grp["keep"], splits, args.branch_factor, args.rollout_batch_size, device)
            n_edges = sum(int(k.sum()) for k in grp["keep"])
            n_trained_edges += n_edges
            n_train_forwards += sum(len(parents) for segments in batches for _, parents in segments)
            for b, segments in enumerate(batches):
                x, sig, cond, masks, x_child, old_lp, adv = micro_batch(grp, segments, sigmas, sizes, splits, args)
                with accelerator.no_sync(transformer) if b < len(batches) - 1 else nullcontext():
                    # each trained edge's log-prob under the current policy, then the clipped surrogate
                    with autocast():
                        v = model.velocity(transformer, x, sig, cond, args.guidance_scale).float()
                    mean, std = edge_gaussians(x, v, segments, masks, sigmas, g, splits, args)
                    log_prob = gaussian_log_prob(x_child, mean, std)
                    loss_vec, ratio = grpo_loss(log_prob, old_lp, adv, args.clip_range)
                    loss = loss_vec.sum()
                    if args.kl_beta > 0:  # exact KL between the two Gaussian steps, per edge, averaged over dims
                        with autocast():  # the base model: frozen copy, or LoRA adapter off
                            v_ref = reference_velocity(model, ref, args.lora, x, sig, cond, args.guidance_scale)
                        mean_ref, _ = edge_gaussians(x, v_ref.float(), segments, masks, sigmas, g, splits, args)
                        kl = ((mean - mean_ref) ** 2).flatten(1).mean(1) / (2 * std**2)
                        loss = loss + args.kl_beta * kl.sum()
                        stats["kl"].append(kl.mean().detach())
                    accelerator.backward(loss / max(1, n_edges))  # the mean over this update's trained edges
                stats["policy_loss"].append(loss_vec.mean().detach())
                stats["ratio"].append(ratio.detach())
                stats["clipfrac"].append(((ratio - 1).abs() > args.clip_range).float().mean().detach())
                stats["approx_kl"].append((0.5 * (log_prob - old_lp) ** 2).mean().detach())
            # learning rate: linear warmup over the first --lr-warmup optimizer steps, then constant
            lr_now = args.learning_rate * min(1.0, (run.state.optimizer_steps + 1) / max(1, args.lr_warmup))
            run.step(optimizer, params, lr_now)  # clipped; skipped if the gradient norm is not finite

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
