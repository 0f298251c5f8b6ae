# V-GRPO: docs/vgrpo.md; paper: arXiv 2604.23380 (no official code is public; docs/vgrpo.md lists the open choices)
"""GRPO with an ELBO likelihood surrogate for a flow-matching text-to-image model, one file (V-GRPO).

Sampling is decoupled from training: a group of images per prompt is generated with a deterministic ODE solver
(DPM-Solver++(2M) or Euler), scored, and the rewards normalised within the group. The likelihood of each whole
image under the policy is replaced by a low-variance surrogate, the mean over N_MC (t, eps) pairs of a
self-normalised x-prediction error: S(x) = mean_j -mean((x0_hat_j - x)^2) / sg(mean|x0_hat_j - x|)
(sg = stop-gradient), x0_hat_j = z_j - t_j v(z_j, t_j), z_j = (1 - t_j) x + t_j eps_j. The pairs are shared by
every image of the iteration (so by each group, and on every process) and their timesteps are stratified over the rollout
schedule. The PPO-clipped loss uses the whole-image ratio exp(S_theta - S_old), with S_old stored right after
the rollout; optional KL to the behaviour policy and a tanh soft clip of the advantages.

Launch (run.sh has more):
    python vgrpo.py                                                  # ShapesBench on CPU
    python vgrpo.py --no-stratified --no-shared-pairs --no-self-normalize   # the naive ELBO baseline
    PROMPTS=prompts.txt bash run.sh vgrpo-flux-8gpu                 # FLUX.1-dev, LoRA, 8 GPUs; docs/gpu.md: all of them
    PROMPTS=prompts.txt bash run.sh vgrpo-wan-8gpu                  # Wan2.1 text-to-video, 8 GPUs; docs/video.md
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 vgrpo.py   # 2 CPU processes
    python vgrpo.py --resume-from latest                             # continue the newest runs/vgrpo__*

ShapesBench's defaults differ from the paper's (the FLUX line above uses the paper's): docs/vgrpo.md lists them and
why. Choices where the paper is silent, and deviations (docs/vgrpo.md explains each):
  1. DPM-Solver++(2M) is written out (dpm_solver_2m_step, tested against diffusers' DPMSolverMultistepScheduler);
  2. the pairs come from keyed randomness, (seed, iteration) only, so every process draws the same ones without a
     broadcast; --no-shared-pairs keys them by global sample index;
  3. timesteps are drawn from the rollout schedule sigma_0 .. sigma_{T-1}, one uniform pick in each of N_MC chunks
     (--pair-times uniform: the paper's N_MC equal intervals of (0, 1));
  4. the behaviour values S_old come from the same micro-batches as the training forwards (the first log ratio is
     exactly 0) and serve every optimizer step of the iteration;
  5. KL (--kl-beta) is D_simple on the stored pairs, against the behaviour policy or (--kl-ref base) the base model;
  6. several rewards: each is normalised within the group, the advantages summed with the --reward weights as given,
     then clipped, then optionally soft-clipped;
  7. the surrogate forwards use --guidance-scale like the rollout; evaluation uses the shared Euler sampler;
  8. all randomness is keyed on (seed, iteration, ...): resumed and multi-process runs match.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Literal

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed

from common.checkpoints import Carried
from common.evaluator import Evaluator
from common.flags import Ge, Gt, Le, Lt, RunArgs, check_flags, check_run_args, cli, divides, need
from common.logs import reward_stats, summarize
from common.models import base_weights, frozen_copy, load_model, trainable_denoiser, weights_swapped
from common.prompts import draw_prompts
from common.rewards import RewardSpec, build_reward
from common.runs import Run, all_finite
from common.sampling import keyed_generator as rng  # (seed, iteration, ...) -> a generator
from common.sampling import keyed_randn


@dataclass
class Args(RunArgs):  # the shared flags (--model-id, --reward, --iterations, ...) are in common/flags.py
    iterations: Annotated[int, Ge(1), Le(1_000_000)] = 30  # a loop count: a million iterations are years of GPU time
    """training iterations; 30, not the shared 40: by 40 V-GRPO's ShapesBench run collapses each prompt toward one
    image (docs/vgrpo.md has the figures)"""
    num_steps: Annotated[int, Ge(1), Le(1000)] = 10
    """sampling steps T of a rollout (shifted sigma schedule); the surrogate's timesteps are drawn from this grid"""
    solver: Literal["dpm++2m", "euler"] = "dpm++2m"
    """deterministic ODE solver of the rollouts: DPM-Solver++(2M) for flow models (paper), or Euler"""
    group_size: Annotated[int, Ge(2), Le(65536)] = 8  # counts of images: at most 2**16, far above any GPU's batch
    """images per prompt (G); a group may span processes"""
    samples_per_device: Annotated[int, Ge(1), Le(65536)] = 64
    """images sampled per process per iteration; prompts per iteration = processes * this / group size"""
    rollout_batch_size: Annotated[int, Ge(1), Le(65536)] = 16
    """images per denoiser forward in sampling"""
    train_batch_size: Annotated[int, Ge(1), Le(65536)] = 8
    """images per surrogate micro-batch: one forward of this x --n-mc rows (behaviour values and training alike)"""
    samples_per_update: Annotated[int, Ge(1), Le(65536)] = 32
    """images (per process) whose gradients are accumulated into one optimizer step"""
    n_mc: Annotated[int, Ge(1), Le(1024)] = 4  # each pair is one more row of every surrogate forward
    """(t, eps) pairs per image in the surrogate (N_MC)"""
    pair_times: Literal["grid", "uniform"] = "grid"
    """where the surrogate's timesteps live: 'grid' = the rollout schedule sigma_0 .. sigma_{T-1}; 'uniform' = (0, 1) (paper)"""
    stratified: bool = True
    """one timestep per one of N_MC equal parts of --pair-times (grid: contiguous chunks); --no-stratified: i.i.d. draws"""
    shared_pairs: bool = True
    """the same pairs for every image of an iteration (so of a group, on every process); --no-shared-pairs: per image"""
    self_normalize: bool = True
    """divide each pair's squared error by its stop-gradient mean absolute error (clamped at 1e-5)"""
    prediction: Literal["x", "v", "eps"] = "x"
    """space of the surrogate's error: x0 (paper), velocity or noise"""
    clip_range: Annotated[float, Gt(0)] = 6e-3
    """PPO clip epsilon on the whole-image ratio exp(S_theta - S_old)"""
    adv_clip_max: Annotated[float, Gt(0)] = 5.0
    """advantages are clipped to +-this (before the optional soft clip)"""
    adv_soft_clip: Annotated[float, Ge(0)] = 0.0
    """eta of the tanh advantage soft clip A -> eta tanh(A / eta); 0 = off"""
    advantage_aggregation: Literal["sum", "per-reward"] = "per-reward"
    """several rewards: 'per-reward' normalises each, then sums with the weights (MixGRPO lineage); 'sum' normalises their weighted sum"""
    kl_beta: Annotated[float, Ge(0)] = 0.0
    """weight of D_simple, the x0-prediction MSE to the --kl-ref policy on the stored pairs (0 = off)"""
    kl_ref: Literal["behaviour", "base"] = "base"
    """KL reference: 'behaviour' = the policy that sampled this iteration (paper); 'base' = the model before training
    (frozen copy, or LoRA adapter off; N_MC more forwards per image), so drift cannot accumulate over iterations"""
    ema: bool = False
    """evaluate and save (final/) an EMA of the trained weights, as diffusionnft.py does, so that the two compare on
    the same kind of weights; off by default (the paper evaluates the trained weights)"""
    ema_max_decay: Annotated[float, Ge(0), Lt(1)] = 0.9
    """EMA decay after s optimizer steps: min((1 + s) / (10 + s), this) (diffusionnft.py's default)"""


# ---------------------------------------------------------------------------------------------------
# ALGO LOGIC: schedule, ODE solvers, pairs, surrogate, advantages, loss
# ---------------------------------------------------------------------------------------------------
def sigma_schedule(num_steps: int, shift: float) -> torch.Tensor:  # same as in dancegrpo.py
    """linspace(1, 0, T + 1) warped by s' = k s / (1 + (k - 1) s) (SD3 shift); shape (T + 1,)."""
    s = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)  # cpu: read as 0-dim scalars or moved with .to()
    return (shift * s / (1 + (shift - 1) * s)).float()


def dpm_solver_2m_step(x, x0_hat, x0_prev, sigma_prev, sigma, sigma_next):
    """One DPM-Solver++(2M) step of a flow model from sigma to sigma_next (Lu et al. 2022, multistep, midpoint).

    x: (B, *L); x0_hat = x - sigma v is the data prediction at sigma, x0_prev the one at sigma_prev (None at the
    first step). With alpha = 1 - s and lambda(s) = log((1 - s) / s) the update
    x' = (s'/s) x - alpha' (e^-h - 1) (x0_hat + (x0_hat - x0_prev) / (2 r)),  h = lambda(s') - lambda(s),  r = (lambda(s) - lambda(s_prev)) / h
    simplifies to x' = (s'/s) x + (1 - s'/s) (x0_hat + (x0_hat - x0_prev) / (2 r)). First order (= DDIM = Euler) at the first
    step, after sigma_prev = 1 (lambda = -inf, so r = inf) and at the last step (s' = 0), as diffusers does.
    """
    ratio = sigma_next / sigma
    if x0_prev is None or sigma_prev >= 1 or sigma_next <= 0:
        return ratio * x + (1 - ratio) * x0_hat

    def lam(s):
        return math.log((1 - s) / s)

    r = (lam(sigma) - lam(sigma_prev)) / (lam(sigma_next) - lam(sigma))
    return ratio * x + (1 - ratio) * (x0_hat + (x0_hat - x0_prev) / (2 * r))


@torch.no_grad()
def rollout(model, denoiser, cond, x, sigmas, solver, guidance_scale, autocast):
    """ODE samples of one chunk: x (B, *L) initial noise -> final latents (B, *L) fp32 (no trajectory is kept)."""
    x0_prev, s_prev = None, 1.0
    for i in range(len(sigmas) - 1):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        with autocast():
            v = model.velocity(denoiser, x, sigmas[i].expand(len(x)).to(x.device), cond, guidance_scale)
        v = v.float()
        if solver == "euler":
            x = x + (s_next - s) * v
        else:
            x0_hat = x - s * v  # the data prediction DPM-Solver++ integrates
            x = dpm_solver_2m_step(x, x0_hat, x0_prev, s_prev, s, s_next)
            x0_prev, s_prev = x0_hat, s
    return x


def stratified_indices(grid_size: int, n_mc: int, gen: torch.Generator) -> torch.Tensor:
    """One index drawn uniformly inside each of the n_mc contiguous chunks of range(grid_size) (tensor_split
    semantics: the first grid_size % n_mc chunks hold one more element). (n_mc,) int64, increasing."""
    return torch.stack(
        [
            c[torch.randint(len(c), (1,), generator=gen, device=gen.device)[0]]
            for c in torch.arange(grid_size, device=gen.device).tensor_split(n_mc)
        ]
    )


def draw_pairs(grid, n_mc, latent_shape, key, sample_ids, stratified=True, shared=True):
    """The (t, eps) pairs of the surrogate for the images `sample_ids` (global indices) of one iteration.

    grid: (K,) timesteps to draw from (the rollout schedule without 0), or None for the continuous range (0, 1),
    cut into n_mc equal intervals when stratified (the paper's description); key: e.g. (seed, iteration).
    Returns t (S, N) and eps (S, N, *L). Timesteps and noise come from separate keyed generators, so switching
    `stratified` leaves eps unchanged. shared: one draw keyed on `key` alone, expanded to all images (a view),
    hence identical for every image of the group, the batch and every process.
    """

    def one(*k):
        g_t, g_eps = rng(*key, "pairs_t", *k), rng(*key, "pairs_eps", *k)
        if grid is None:
            u = torch.rand(n_mc, generator=g_t, device=g_t.device)
            t = (torch.arange(n_mc, device=u.device) + u) / n_mc if stratified else u
        else:
            idx = (
                stratified_indices(len(grid), n_mc, g_t)
                if stratified
                else torch.randint(len(grid), (n_mc,), generator=g_t, device=g_t.device)
            )
            t = grid[idx]
        return t, torch.randn((n_mc, *latent_shape), generator=g_eps, device=g_eps.device)

    if shared:
        t, eps = one()
        return t.expand(len(sample_ids), n_mc), eps.expand(len(sample_ids), *eps.shape)
    t, eps = zip(*(one(k) for k in sample_ids))
    return torch.stack(t), torch.stack(eps)


def pair_values(v, x, z, eps, t, prediction="x", self_normalize=True):
    """Per-pair surrogate log-likelihood from the velocity v predicted at z = (1 - t) x + t eps (every model kind's
    convention: the exact velocity is eps - x). All (M, *L) fp32, t (M,). Returns (values (M,), x0_hat (M, *L)).

    error: x (paper): x0_hat - x with x0_hat = z - t v; v: v - (eps - x); eps: eps_hat - eps with eps_hat = z + (1 - t) v
    (the three differ by the factors -t and 1 - t). value = -mean(err^2) / sg(max(mean|err|, 1e-5)), or -mean(err^2)
    without self-normalisation.
    """
    tv = t.view(-1, *[1] * (x.dim() - 1))
    x0_hat = z - tv * v
    err = {"x": x0_hat - x, "v": v - (eps - x), "eps": z + (1 - tv) * v - eps}[prediction]
    value = -err.square().flatten(1).mean(1)
    if self_normalize:
        value = value / err.detach().abs().flatten(1).mean(1).clamp_min(1e-5)
    return value, x0_hat


def surrogate(model, denoiser, x, cond, t, eps, guidance_scale, autocast, prediction="x", self_normalize=True):
    """Surrogate values of a micro-batch in ONE forward of B x N rows: x (B, *L) rollout latents, cond (B, ...),
    t (B, N), eps (B, N, *L). Returns values (B, N) fp32 and x0_hat (B, N, *L) fp32. Differentiable (call under
    no_grad for the behaviour values)."""
    (B, N), L = t.shape, x.shape[1:]
    rows = x.unsqueeze(1).expand(B, N, *L).reshape(B * N, *L)  # (B N, *L): image b repeated N times
    t_rows, eps_rows = t.reshape(B * N).to(x.device), eps.reshape(B * N, *L).to(x.device)
    tv = t_rows.view(-1, *[1] * len(L))
    z = (1 - tv) * rows + tv * eps_rows  # forward process at the pair's (t, eps)
    cond_rows = {k: c.repeat_interleave(N, 0) for k, c in cond.items()}
    with autocast():
        v = model.velocity(denoiser, z, t_rows, cond_rows, guidance_scale)
    values, x0_hat = pair_values(v.float(), rows, z, eps_rows, t_rows, prediction, self_normalize)
    return values.view(B, N), x0_hat.view(B, N, *L)


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:  # same as in dancegrpo.py
    """(N,) rewards in global sample order, consecutive blocks of G = one prompt -> (N,) advantages.

    A = (R - mean_group) / (std_group + 1e-8) with the unbiased std, as DanceGRPO; a group with equal
    rewards gets 0 everywhere."""
    R = rewards.view(-1, group_size).double()
    return ((R - R.mean(1, keepdim=True)) / (R.std(1, keepdim=True) + 1e-8)).flatten().float()


def combined_advantages(parts: dict, weights: dict, *, group_size, adv_clip_max, adv_soft_clip) -> torch.Tensor:
    """A = sum_k w_k A_k over group advantages A_k of parts: name -> (N,) scores in global order, clipped to
    +-adv_clip_max, then A -> eta tanh(A / eta) when adv_soft_clip = eta > 0. Each reward's raw scores and weights:
    per-reward (MixGRPO's advantage_aggr, arXiv 2507.21802); the weighted sum of the rewards as one part of weight 1:
    --advantage-aggregation sum. A fork's advantage flag: a keyword argument here and a field of Args."""
    adv = sum(w * group_advantages(parts[name], group_size) for name, w in weights.items() if w != 0)
    adv = adv.clamp(-adv_clip_max, adv_clip_max)
    return adv_soft_clip * torch.tanh(adv / adv_soft_clip) if adv_soft_clip > 0 else adv


def policy_loss(values, old_values, adv, x0_hat, ref_x0, *, clip_range, kl_beta):
    """The objective per image (B,): the PPO-clipped loss on the whole-image ratio, values and old_values (B, N)
    per-pair surrogates averaged over the pairs FIRST, then log rho = S_theta - S_old; plus kl_beta * D_simple, the
    mean squared distance of the policy's x0_hat (B, N, *L) on the pairs to the KL reference's ref_x0, if given.
    Returns it and its figures, logged as losses/<name> (common.logs.summarize). A fork's new term: one line adding it
    to `loss`, its weight a keyword argument here (with a default) passed where main() calls this, a field of Args."""
    log_ratio = values.mean(1) - old_values.mean(1)
    ratio = torch.exp(log_ratio)
    surrogate = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range))
    figures = {
        "policy": surrogate.mean(),
        "ratio_mean": ratio,
        "ratio_max_dev": (ratio - 1).abs().max(),
        "log_ratio_max_abs": log_ratio.abs().max(),
        "clipfrac": ((ratio - 1).abs() > clip_range).float().mean(),
        "approx_kl": 0.5 * log_ratio**2,
    }
    loss = surrogate
    if ref_x0 is not None:
        kl = (x0_hat - ref_x0).square().flatten(2).mean(2).mean(1)  # (B,)
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


def coefficient_of_variation(s: torch.Tensor, group_size: int) -> tuple[float, float]:
    """(overall, within-group) coefficient of variation std / |mean| of per-image surrogates (N,) in global order;
    the within-group one is averaged over groups."""
    s = s.double()
    g = s.view(-1, group_size)
    return (s.std() / s.mean().abs()).item(), (g.std(1) / g.mean(1).abs()).mean().item()


# ---------------------------------------------------------------------------------------------------
# Flag checks: the mode's defaults, then every flag, before a model loads (the shared flags are in common/flags.py)
# ---------------------------------------------------------------------------------------------------
MODE_FLAGS = [  # a flag of another mode is an error unless left at its default (no dead flags)
    ("kl_ref", lambda a: a.kl_beta > 0, "--kl-beta > 0"),
    ("ema_max_decay", lambda a: a.ema, "--ema"),
]


def resolve_and_check(args: Args) -> tuple[list[str], list[str], RewardSpec]:
    """The mode's defaults filled in, this script's flags and the shared ones (common/flags.py) checked: a bad flag is
    one `error:` line naming it (those that need the process count: in main()). Returns check_run_args's."""
    check_flags(args, MODE_FLAGS)  # floats finite, every flag in its declared range, no dead flags
    args.exp_name = args.exp_name or Path(__file__).stem  # a fork: its own name
    need(
        not args.stratified or args.pair_times == "uniform" or args.n_mc <= args.num_steps,
        f"--n-mc {args.n_mc} must be <= --num-steps {args.num_steps} with stratified timesteps on the rollout grid "
        "(one per chunk of the schedule); pass --pair-times uniform or --no-stratified",
    )
    need(
        divides(args.rollout_batch_size, args.samples_per_device),
        "--samples-per-device must be a multiple of --rollout-batch-size",
    )
    need(
        divides(args.train_batch_size, args.samples_per_update)
        and divides(args.samples_per_update, args.samples_per_device),
        "--samples-per-update must be a multiple of --train-batch-size and divide --samples-per-device",
    )
    return check_run_args(args)


def main(args: Args):
    # ---------------------------------------------------------------- SETUP
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    world, rank = accelerator.num_processes, accelerator.process_index
    inputs = resolve_and_check(args)  # flags checked, prompts read, --reward parsed, before any model loads
    S, G = args.samples_per_device, args.group_size
    need(S * world % G == 0, f"--samples-per-device {S} x {world} processes must be a multiple of --group-size {G}")
    need(
        not args.ema or accelerator.distributed_type != DistributedType.FSDP,
        "--ema keeps an EMA beside the trained weights, which FSDP would shard: use DDP (accelerate launch "
        "--multi_gpu) with --lora, or leave --ema off",
    )
    base_kl = args.kl_beta > 0 and args.kl_ref == "base"
    run = Run(args, accelerator, "V-GRPO", frozen_copy=base_kl and not args.lora)
    set_seed(args.seed)  # LoRA init and anything else not keyed through rng()
    device = accelerator.device
    autocast = accelerator.autocast
    frozen_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    prompts_per_iter = world * args.samples_per_device // args.group_size
    mb = args.train_batch_size
    micro_per_update = args.samples_per_update // mb
    updates_per_iter = args.samples_per_device // args.samples_per_update

    # ---------------------------------------------------------------- MODELS
    model = load_model(args.model_id, device, frozen_dtype, args.resolution, args.num_frames, args.offload_frozen)
    sigmas = model.sigmas(args.num_steps) if args.shift == "pipeline" else sigma_schedule(args.num_steps, args.shift)
    denoiser = trainable_denoiser(model, args)  # trained in fp32: all weights, or a LoRA adapter (--lora)
    # the KL to the behaviour policy needs no reference model (its outputs are stored); the KL to the base does
    ref = (denoiser if args.lora else frozen_copy(denoiser, frozen_dtype)) if base_kl else None

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
    grid = sigmas[:-1] if args.pair_times == "grid" else None  # the rollout schedule without t = 0 (x0_hat = x there)
    latent_shape = model.latent_shape()
    evaluate = Evaluator(args, model, denoiser, reward_fn, eval_prompts, run, args.rollout_batch_size)  # Euler ODE
    # the surrogate on one micro-batch: surrogate_of(x, cond, t, eps) -> (values (B, N), x0_hat (B, N, *L))
    options = dict(guidance_scale=args.guidance_scale, autocast=autocast, prediction=args.prediction)
    surrogate_of = partial(surrogate, model, denoiser, **options, self_normalize=args.self_normalize)
    nfe = args.num_steps + (3 if base_kl else 2) * args.n_mc  # forwards per image: rollout, behaviour (+ base), policy
    flags = {"stratified": args.stratified, "shared pairs": args.shared_pairs, "self-normalize": args.self_normalize}
    off = ", ".join(name for name, on in flags.items() if not on)
    lines = [
        f"processes {world} x samples per process {args.samples_per_device} = {prompts_per_iter} prompts x group "
        f"size {args.group_size}; rollouts: {args.solver} ODE, {args.num_steps} steps, batch {args.rollout_batch_size}",
        f"surrogate: {args.n_mc} (t, eps) pairs per image, t on the {args.pair_times} support, {args.prediction}-"
        f"prediction, variance reduction {'off: ' + off if off else 'all on'}; micro-batch {mb} images x {args.n_mc}",
        f"optimizer steps / iteration {updates_per_iter} ({args.samples_per_update} images per process each), "
        f"denoiser forwards per image {nfe}; clip {args.clip_range}, KL beta {args.kl_beta} to the {args.kl_ref} "
        f"policy, adv soft clip {args.adv_soft_clip or 'off'}; EMA for evaluation "
        + (f"(max decay {args.ema_max_decay})" if args.ema else "off"),
    ]
    run.banner(model, params, lines)
    with weights_swapped(params, ema, args.ema):  # evaluation sees the EMA weights, as in diffusionnft.py
        evaluate(start, final=start == args.iterations)  # at the start; resumed: what the interrupted run missed
    for it in run.iterations(start):
        # ------------------------------------------------------------ SAMPLING
        # The same prompt draw on every process; process r owns global samples [r S, (r + 1) S).
        drawn = draw_prompts(train_prompts, prompts_per_iter, args.seed, it)
        global_idx = range(rank * args.samples_per_device, (rank + 1) * args.samples_per_device)
        my_prompts = [drawn[k // args.group_size] for k in global_idx]
        # every image its own initial noise: the ODE is deterministic, so shared noise would give identical images
        init = torch.stack([keyed_randn(latent_shape, args.seed, it, "init", k) for k in global_idx])  # (CPU)
        cond = model.encode_prompts(my_prompts)
        denoiser.eval()
        chunks = [
            slice(c, c + args.rollout_batch_size) for c in range(0, args.samples_per_device, args.rollout_batch_size)
        ]
        x = torch.cat(
            [
                rollout(
                    model,
                    denoiser,
                    {k: v[c] for k, v in cond.items()},
                    init[c].to(device),
                    sigmas,
                    args.solver,
                    args.guidance_scale,
                    autocast,
                )
                for c in chunks
            ]
        )  # (S, *L) fp32 final latents
        with torch.no_grad():  # rewards asked now: a served reward answers while the behaviour values are computed
            requests = [reward_fn.request(model.decode(x[c]).float(), my_prompts[c]) for c in chunks]
        t_sample = time.perf_counter() - run.t_iter

        # behaviour values S_old, right after the rollout, on the micro-batches the training pass will use
        t_pairs, eps = draw_pairs(
            grid, args.n_mc, latent_shape, (args.seed, it), global_idx, args.stratified, args.shared_pairs
        )
        old_values = torch.empty(args.samples_per_device, args.n_mc, device=device)  # (S, N)
        ref_x0 = (
            torch.empty(args.samples_per_device, args.n_mc, *latent_shape, device=device) if args.kl_beta > 0 else None
        )  # (S, N, *L) the KL reference's x0_hat on the pairs
        with torch.no_grad():
            for m in range(args.samples_per_device // mb):
                sl = slice(m * mb, (m + 1) * mb)
                cond_sl = {k: v[sl] for k, v in cond.items()}
                old_values[sl], x0_hat = surrogate_of(x[sl], cond_sl, t_pairs[sl], eps[sl])
                if base_kl:
                    with base_weights(ref, args.lora) as base:
                        x0_hat = surrogate(model, base, x[sl], cond_sl, t_pairs[sl], eps[sl], **options)[1]
                if ref_x0 is not None:
                    ref_x0[sl] = x0_hat
        t_old = time.perf_counter() - run.t_iter - t_sample

        # ------------------------------------------------------------ REWARDS & ADVANTAGES
        rewards, parts = reward_fn.collect(requests)  # (S,), each component's (S,)
        all_rewards = accelerator.gather(rewards.float().to(device))  # (world * S,) in global sample order
        parts = {k: accelerator.gather(v.float().to(device)) for k, v in parts.items()}
        per_reward = args.advantage_aggregation == "per-reward"
        scores, weights = (parts, reward_fn.weights) if per_reward else ({"sum": all_rewards}, {"sum": 1.0})
        all_adv = combined_advantages(  # (world * S,)
            scores,
            weights,
            group_size=args.group_size,
            adv_clip_max=args.adv_clip_max,
            adv_soft_clip=args.adv_soft_clip,
        )
        adv = all_adv[rank * args.samples_per_device : (rank + 1) * args.samples_per_device]
        all_old = accelerator.gather(old_values.mean(1))  # (world * S,) per-image behaviour surrogates, for logging

        # ------------------------------------------------------------ TRAINING
        model.park(), reward_fn.park()  # --offload-frozen: the VAE and the reward models leave the GPU
        denoiser.train()
        stats = defaultdict(list)  # each figure policy_loss returns, one tensor per micro-batch
        for u in range(updates_per_iter):
            for m in range(u * micro_per_update, (u + 1) * micro_per_update):
                sl = slice(m * mb, (m + 1) * mb)
                last = m == (u + 1) * micro_per_update - 1
                with accelerator.no_sync(denoiser) if not last else nullcontext():
                    values, x0_hat = surrogate_of(x[sl], {k: v[sl] for k, v in cond.items()}, t_pairs[sl], eps[sl])
                    x0_ref = None if ref_x0 is None else ref_x0[sl]  # the --kl-ref policy's x0_hat on the same pairs
                    loss, figures = policy_loss(values, old_values[sl], adv[sl], x0_hat, x0_ref, clip_range=args.clip_range,
                                                kl_beta=args.kl_beta)  # fmt: skip
                    accelerator.backward(loss.mean() / micro_per_update)
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
        cv, group_cv = coefficient_of_variation(all_old, args.group_size)
        # checksum of this process's first image's pairs; with shared pairs all processes must agree
        checksum = (t_pairs[0].double().sum() + eps[0].double().sum()).reshape(1).to(device)
        checksums = accelerator.gather(checksum)
        log = {
            **reward_stats(all_rewards, parts),
            "advantages/zero_std_groups": (all_adv.view(-1, args.group_size) == 0).all(1).float().mean().item(),
            "advantages/abs_mean": all_adv.abs().mean().item(),
            "surrogate/mean": all_old.mean().item(),
            "surrogate/cv": cv,
            "surrogate/group_cv": group_cv,
            "surrogate/t_mean": t_pairs.float().mean().item(),
            **summarize(stats, "losses/"),  # every figure of policy_loss
            "losses/first_ratio_max_dev": stats["ratio_max_dev"][0].item(),  # 0: the first ratio is exactly 1
            "charts/pairs_checksum": checksums[0].item(),
            "charts/rank_pairs_spread": (checksums.max() - checksums.min()).item(),
            "perf/nfe_per_image": nfe,
            "perf/trained_pairs_per_image": args.n_mc,
            "perf/sampling_s": t_sample,
            "perf/reward_wait_s": reward_fn.wait_s,
            "perf/behaviour_s": t_old,
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
