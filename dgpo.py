# DGPO: docs/dgpo.md; paper: "Reinforcing Diffusion Models by Direct Group Preference Optimization" (official code:
# Luo-Yihong/DGPO, SD3 only); online Diffusion-DPO (arXiv 2311.12908) is its --objective dpo
"""Direct group preference optimization of a flow-matching text-to-image model, one file (DGPO).

No likelihood and no stochastic policy: images come from a deterministic ODE solver (only the final latents x0 are
kept) and are scored; each group's advantages A = (R - mean_prompt R) / (std R + 1e-4), clamped to +-5, split it into
a positive (A > 0) and a negative set (A < 0), weighted by |A|. Training is on the forward process at a few timesteps
of the rollout grid: x_t = (1 - t) x0 + t eps with the noise shared by a group, d = the velocity MSE to eps - x0 of
the trained model, d_ref the base model's. DPO's objective lifted from pairs of samples to a group's two sets,
L = -log sigmoid(-beta / G sum_i A_i (d_i - d_ref,i)), has the gradient sigmoid(beta / G sum_i A_i (d_i - d_ref,i))
x beta / G sum_i A_i grad d_i; the official code descends the surrogate w_g mean(A_i d_i) with the group weight
w_g = sigmoid(...) detached, whose gradient is that one divided by beta (docs/dgpo.md). A PPO-style
clip stops the gradient of d_i once exp(d_old,i - d_i) leaves 1 +- --clip-range on the advantage's side (d_old: an
EMA of the trained weights, the `old` policy), plus --kl-beta times the velocity MSE to the base model.
--objective dpo is online Diffusion-DPO on each group's best and worst image: -log sigmoid(-beta / 2 ((d_w - d_ref,w)
- (d_l - d_ref,l))), the pair sharing its noise and timestep (beta: arXiv 2311.12908's beta T omega(lambda) folded in).

Launch:
    python dgpo.py                                                        # ShapesBench on CPU
    python dgpo.py --objective dpo                                        # online Diffusion-DPO, best vs worst
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 dgpo.py   # 2 CPU processes
    python dgpo.py --resume-from latest                                   # continue the newest runs/dgpo__*
    bash run.sh dgpo-sd35-geneval-8gpu                                    # SD3.5-M, the official GenEval setting

ShapesBench's defaults differ from the official configs (each flag's help gives the official value). Deviations from
the official code and choices where it is silent (docs/dgpo.md explains and measures each):
  1. every random draw (initial noise, the trained timesteps, the forward noise) is keyed on (seed, iteration, ...),
     so resumed and multi-process runs draw the same numbers; a group is G consecutive samples of one drawn prompt and
     lives on one process, and a training micro-batch holds whole groups (the official's spread over the GPUs, its
     group sums all-reduced: the same sums);
  2. the group weight sums over the whole group (the official: over the group's samples in the micro-batch, which
     its sampler makes the whole group);
  3. the evaluation EMA is updated once every --ema-every optimizer steps (the official steps it once per
     micro-batch, so an update counts as many times as the iteration has micro-batches);
  4. evaluation uses the shared Euler sampler (--eval-steps) with the EMA weights;
  5. --no-lora keeps the old policy as a frozen fp32 copy (the official code is LoRA only); FSDP is refused.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Optional

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed

from common.checkpoints import Carried
from common.evaluator import Evaluator
from common.flags import AllowInf, Ge, Gt, Le, Lt, ModeDefault, RunArgs, check_flags, check_run_args, cli, divides, need
from common.logs import reward_stats, summarize
from common.models import (
    add_old_policy,
    base_weights,
    frozen_copy,
    load_model,
    old_policy,
    old_weights,
    trainable_denoiser,
    weights_swapped,
)
from common.prompts import draw_prompts
from common.rewards import RewardSpec, build_reward
from common.runs import Run, all_finite
from common.sampling import keyed_generator as rng  # (seed, iteration, ...) -> a generator
from common.sampling import keyed_randn


@dataclass
class Args(RunArgs):  # the shared flags (--model-id, --reward, --iterations, ...) are in common/flags.py
    iterations: Annotated[int, Ge(1), Le(1_000_000)] = 30  # a loop count: a million iterations are years of GPU time
    """training iterations; 30, not the shared 40, as diffusionnft.py: ShapesBench's 8 minutes (docs/dgpo.md)"""
    objective: Literal["dgpo", "dpo"] = "dgpo"
    """'dgpo': the group preference objective (official); 'dpo': online Diffusion-DPO on each group's best and worst"""
    num_steps: Annotated[int, Ge(1), Le(1000)] = 10
    """ODE steps T of a rollout (shifted sigma schedule); the trained timesteps come from this grid (official: 10)"""
    solver: Literal["dpm2", "euler"] = "dpm2"
    """deterministic ODE solver of the rollouts: 'dpm2' = DPM-Solver-2 multistep in x0 (official: DPM-Solver), or Euler"""
    group_size: Annotated[int, Ge(2), Le(65536)] = 8  # counts of images: at most 2**16, far above any GPU's batch
    """images per prompt (G), on one process (official: 16; 24 'for better performance')"""
    samples_per_device: Annotated[int, Ge(1), Le(65536)] = 64
    """images sampled per process per iteration, a multiple of --group-size (official: 32 per GPU on 4 GPUs)"""
    rollout_batch_size: Annotated[int, Ge(1), Le(65536)] = 16
    """images per denoiser forward in sampling (official: 16)"""
    train_batch_size: Annotated[
        Optional[int], ModeDefault("16; 4 (2 pairs) with --objective dpo"), Ge(1), Le(65536)
    ] = None
    """rows per training micro-batch, whole groups (dpo: whole pairs); each timestep one forward of the trained, the
    base (and the old) policy (official: 16)"""
    samples_per_update: Annotated[int, Ge(1), Le(65536)] = 16
    """sampled images (per process) whose training rows are accumulated into one optimizer step (official: all of an
    iteration, one step per iteration; ShapesBench: 4 steps, docs/dgpo.md)"""
    train_timesteps: Annotated[int, Ge(1), Le(1000)] = 4
    """M: the rollout grid's timesteps trained per iteration, distinct, shared by every image (official: 4)"""
    trunc_steps: Annotated[int, Ge(0), Le(999)] = 6
    """the M timesteps are drawn from grid indices 0 .. this (0 = pure noise; official: 6, GenEval 4)"""
    beta: Annotated[float, Gt(0), Le(1e6)] = 100.0
    """DPO's beta in the group weight sigmoid(beta / G sum A (d - d_ref)) (dpo: in its sigmoid) (official: 100)"""
    clip_range: Annotated[float, AllowInf, Gt(0)] = 1e-2
    """PPO-style clip: d's gradient stops once exp(d_old - d) leaves 1 +- this on the advantage's side; inf = off, and
    no old-policy forward (official: 1e-2 GenEval and OCR, 5e-2 its base config)"""
    kl_beta: Annotated[float, Ge(0)] = 0.02
    """weight of the velocity MSE to the base model; 0 = off (official: 0.02)"""
    adv_clip_max: Annotated[float, Gt(0)] = 5.0
    """advantages are clamped to +-this (official: 5)"""
    global_std: bool = False
    """divide by the std of all rewards of the iteration, not the group's (official: GenEval no, OCR yes)"""
    switch_ema_ref: Annotated[int, Ge(0), Le(10**9)] = 200
    """after this many optimizer steps the rollouts come from the old policy, the EMA reference, not the trained
    weights (official: 200; GenEval 500)"""
    train_guidance_scale: Annotated[float, Ge(0), Le(100)] = 1.0
    """guidance of the training forwards (official: 1, the conditional branch alone, while rollouts use CFG; give
    FLUX.1-dev's embedded guidance, 3.5, there)"""
    ema: bool = True
    """evaluate and save (final/) an EMA of the trained weights, as the official code; --no-ema: the live weights"""
    ema_max_decay: Annotated[float, Ge(0), Lt(1)] = 0.9
    """EMA decay after s optimizer steps: min((1 + s) / (10 + s), this) (official: 0.9)"""
    ema_every: Annotated[int, Ge(1), Le(10**6)] = 1
    """the evaluation EMA is updated every this many optimizer steps (official: 8)"""


# ---------------------------------------------------------------------------------------------------
# ALGO LOGIC: schedule, ODE solver, advantages, timesteps, the objectives, the old policy, EMA
# ---------------------------------------------------------------------------------------------------
def sigma_schedule(num_steps: int, shift: float) -> torch.Tensor:  # same as in dancegrpo.py
    """linspace(1, 0, T + 1) warped by s' = k s / (1 + (k - 1) s) (SD3 shift); shape (T + 1,)."""
    s = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)  # cpu: read as 0-dim scalars or moved with .to()
    return (shift * s / (1 + (shift - 1) * s)).float()


def dpm_solver_2m_step(x, x0_hat, x0_prev, sigma_prev, sigma, sigma_next):  # same as in vgrpo.py
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
def rollout(model, denoiser, cond, x, sigmas, solver, guidance_scale, autocast):  # same as in vgrpo.py
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


def group_advantages(rewards: torch.Tensor, *, group_size: int, global_std: bool, clip: float) -> torch.Tensor:
    """(N,) rewards in global sample order, consecutive blocks of G = one prompt -> (N,) advantages
    clamp((R - mean of the prompt's R) / (std + 1e-4), -clip, clip), std the population std of the prompt's rewards
    (global_std: of all N), as the official per-prompt stat tracker; a group of equal rewards gets 0."""
    R = rewards.double().view(-1, group_size)
    std = R.std(correction=0) if global_std else R.std(1, correction=0, keepdim=True)
    return ((R - R.mean(1, keepdim=True)) / (std + 1e-4)).flatten().clamp(-clip, clip).float()


def shared_timesteps(trunc_steps: int, m: int, key: tuple) -> list[int]:
    """The M grid indices an iteration trains, distinct, drawn from 0 .. trunc_steps and shared by every image and
    process, keyed on (*key, 'timesteps') (the official draws them on process 0 and broadcasts them)."""
    return torch.randperm(trunc_steps + 1, generator=rng(*key, "timesteps"), device="cpu")[:m].tolist()  # cpu: keyed


def best_and_worst(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Diffusion-DPO's pair in each group of (N,) rewards: (winner, loser) local indices (N / G,) each, the first
    best and the first worst, and (N / G,) whether the group has a preference at all (a group of equal rewards has
    none: its pair is trained with weight 0)."""
    R = rewards.view(-1, group_size)
    base = torch.arange(len(R), device=R.device) * group_size
    return base + R.argmax(1), base + R.argmin(1), R.max(1).values > R.min(1).values


def velocity_error(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """d: the per-image mean squared error (B,) of a velocity (B, *L) to the flow-matching target eps - x0."""
    return (v - target).square().flatten(1).mean(1)


def ppo_clip(d: torch.Tensor, d_old: torch.Tensor, adv: torch.Tensor, clip_range: float) -> tuple:
    """The official PPO-style clip on d (B,) with graph: ratio = exp(d_old - d) (the old policy's error over the
    trained one's, as a likelihood ratio); where A > 0 and ratio > 1 + eps, or A < 0 and ratio < 1 - eps, d's gradient
    stops. Returns (d with those rows detached, (B,) which were clipped, the ratio (B,))."""
    ratio = torch.exp(d_old - d.detach())
    clipped = torch.where(adv > 0, ratio > 1 + clip_range, ratio < 1 - clip_range)
    return torch.where(clipped, d.detach(), d), clipped, ratio


def dgpo_loss(d: torch.Tensor, d_ref: torch.Tensor, adv: torch.Tensor, *, beta: float, group_size: int):
    """The official surrogate on whole groups: d (B,) with graph (B = k G rows, G consecutive = one group), d_ref the
    base model's (B,), adv (B,). Per group w = sigmoid(beta / G sum_i A_i (d_i - d_ref,i)) (detached), and the loss
    is the mean of w A_i d_i over the rows. Its gradient is that of DGPO's objective, the mean over groups of
    -log sigmoid(-beta / G sum_i A_i (d_i - d_ref,i)), divided by beta (docs/dgpo.md). Returns it and its figures."""
    margin = (adv * beta * (d.detach() - d_ref) / group_size).view(-1, group_size).sum(1)  # (k,)
    w = torch.sigmoid(margin).repeat_interleave(group_size)  # (B,)
    loss = (w * adv * d).mean()
    return loss, {"group_weight": w.detach(), "margin": margin}


def dpo_loss(d: torch.Tensor, d_ref: torch.Tensor, has_pref: torch.Tensor, *, beta: float):
    """Diffusion-DPO (arXiv 2311.12908, eq. 14 as its code runs it) on pairs: d, d_ref (2 P,) as (winner, loser) per
    pair; -log sigmoid(-beta / 2 ((d_w - d_ref,w) - (d_l - d_ref,l))), weight 0 for a pair without a preference.
    Returns the mean over pairs (a pair without a preference counts, as a 0) and its figures."""
    gap = (d - d_ref).view(-1, 2)  # (P, 2): winner's, loser's
    z = -0.5 * beta * (gap[:, 0] - gap[:, 1])
    loss = -F.logsigmoid(z) * has_pref
    ranked = (z > 0).float().detach()[has_pref > 0]  # the share ranked right, of the pairs with a preference
    return loss.mean(), {"dpo_margin": z.detach(), "dpo_accuracy": ranked}


def ref_decay(step: int) -> float:
    """Decay of the old policy (the official ema_ref) after `step` optimizer steps: min(0.3, 0.001 s), so it stays
    within a few steps of the trained weights."""
    return min(0.3, 0.001 * step)


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
    ("clip_range", lambda a: a.objective == "dgpo", "--objective dgpo"),
    ("adv_clip_max", lambda a: a.objective == "dgpo", "--objective dgpo"),
    ("global_std", lambda a: a.objective == "dgpo", "--objective dgpo"),
    ("switch_ema_ref", lambda a: a.objective == "dgpo", "--objective dgpo"),
    ("ema_max_decay", lambda a: a.ema, "--ema"),
    ("ema_every", lambda a: a.ema, "--ema"),
]


def resolve_and_check(args: Args) -> tuple[list[str], list[str], RewardSpec]:
    """This script's flags and the shared ones (common/flags.py) checked: a bad flag is one `error:` line naming it.
    Returns check_run_args's."""
    check_flags(args, MODE_FLAGS)  # floats finite, every flag in its declared range, no dead flags
    args.exp_name = args.exp_name or Path(__file__).stem + ("" if args.objective == "dgpo" else "_dpo")
    need(
        args.train_timesteps <= args.trunc_steps + 1 <= args.num_steps,
        f"--train-timesteps {args.train_timesteps} distinct grid indices are drawn from 0 .. --trunc-steps "
        f"{args.trunc_steps}, which must lie within the --num-steps {args.num_steps} steps",
    )
    if args.train_batch_size is None:  # the default update's rows: 16 images, or its 2 groups' 2 pairs (dpo)
        args.train_batch_size = 16 if args.objective == "dgpo" else 4
    S, G, U, mb = args.samples_per_device, args.group_size, args.samples_per_update, args.train_batch_size
    need(divides(args.rollout_batch_size, S), "--samples-per-device must be a multiple of --rollout-batch-size")
    need(
        divides(G, U) and divides(U, S),
        "--samples-per-update must be a multiple of --group-size and divide --samples-per-device",
    )
    rows = U if args.objective == "dgpo" else 2 * U // G  # rows of one update: its images, or 2 per group (dpo)
    whole = G if args.objective == "dgpo" else 2  # a micro-batch holds whole groups, or whole pairs
    need(
        divides(whole, mb) and divides(mb, rows),
        f"--train-batch-size {mb} must be a multiple of {whole} (whole {'groups' if whole == G else 'pairs'}) and "
        f"divide the {rows} training rows of an update",
    )
    return check_run_args(args)  # images, or videos (the paper trains images; nothing here is image-specific)


def main(args: Args):
    # ---------------------------------------------------------------- SETUP
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    world, rank = accelerator.num_processes, accelerator.process_index
    inputs = resolve_and_check(args)  # flags checked, prompts read, --reward parsed, before any model loads
    need(
        accelerator.distributed_type != DistributedType.FSDP,
        "dgpo.py keeps the old policy and the EMA beside the trained weights, which FSDP would shard: use DDP "
        "(accelerate launch --multi_gpu) with --lora",
    )
    run = Run(args, accelerator, "DGPO" if args.objective == "dgpo" else "Diffusion-DPO", frozen_copy=not args.lora)
    set_seed(args.seed)  # LoRA init and anything else not keyed through rng()
    device, autocast = accelerator.device, accelerator.autocast
    frozen_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    S, G, mb, dpo = args.samples_per_device, args.group_size, args.train_batch_size, args.objective == "dpo"
    prompts_per_iter = world * S // G
    rows_per_update = args.samples_per_update if not dpo else 2 * args.samples_per_update // G
    micro_per_update = rows_per_update // mb
    updates_per_iter = S // args.samples_per_update
    use_old = not dpo and math.isfinite(args.clip_range)  # the PPO-style clip reads the old policy

    # ---------------------------------------------------------------- MODELS
    model = load_model(args.model_id, device, frozen_dtype, args.resolution, args.num_frames, args.offload_frozen)
    sigmas = model.sigmas(args.num_steps) if args.shift == "pipeline" else sigma_schedule(args.num_steps, args.shift)
    denoiser = trainable_denoiser(model, args)  # trained in fp32: all weights, or a LoRA adapter (--lora)
    # the base model of d_ref (and the KL): the adapters switched off (LoRA), or a frozen copy made before any update
    ref = denoiser if args.lora else frozen_copy(denoiser, frozen_dtype)
    policy, old = denoiser, add_old_policy(denoiser, args.lora)  # policy: unwrapped, for the no-grad forwards

    # ---------------------------------------------------------------- PROMPTS & REWARDS
    train_prompts, eval_prompts, reward_spec = inputs
    reward_fn = build_reward(reward_spec, device, args.offload_frozen, args.reward_frames)

    # ---------------------------------------------------------------- OPTIMIZER
    params = [p for p in denoiser.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    denoiser, optimizer = accelerator.prepare(denoiser, optimizer)
    old_params = old_weights(policy, old, args.lora)  # soft-updated from params, never in the optimiser
    ema = [p.detach().clone() for p in params]
    accelerator.register_for_checkpointing(Carried(old=old_params, ema=ema))  # before resume() loads them

    # ---------------------------------------------------------------- RESUME, EVALUATOR, BANNER
    start = run.resume()  # 0, or the iteration of the --resume-from checkpoint (weights, optimizer, RNG, counters)
    latent_shape = model.latent_shape()
    evaluate = Evaluator(args, model, denoiser, reward_fn, eval_prompts, run, args.rollout_batch_size)  # Euler ODE
    nfe = args.num_steps + args.train_timesteps * (3 if use_old else 2) * (2 / G if dpo else 1)  # per sampled image
    lines = [
        f"processes {world} x samples per process {S} = {prompts_per_iter} prompts x group size {G}; rollouts: "
        f"{args.solver} ODE, {args.num_steps} steps, guidance {args.guidance_scale}, from the trained weights until "
        f"{args.switch_ema_ref} optimizer steps, then the old policy",
        f"{args.train_timesteps} timesteps of grid indices 0..{args.trunc_steps} per iteration, noise shared by a "
        f"group; training rows / update {rows_per_update}, micro-batch {mb}; optimizer steps / iteration "
        f"{updates_per_iter}; denoiser forwards per image {nfe:g}",
        (f"DGPO: beta {args.beta}, clip {args.clip_range}, advantages clamped to {args.adv_clip_max}" if not dpo else
         f"Diffusion-DPO on the best and worst of each group: beta {args.beta}")
        + f"; KL weight {args.kl_beta}; EMA for evaluation "
        + (f"(max decay {args.ema_max_decay}, every {args.ema_every} steps)" if args.ema else "off"),
    ]  # fmt: skip
    run.banner(model, params, lines)
    with weights_swapped(params, ema, args.ema):  # evaluation sees the EMA weights
        evaluate(start, final=start == args.iterations)  # at the start; resumed: what the interrupted run missed
    for it in run.iterations(start):
        # ------------------------------------------------------------ SAMPLING
        # The same prompt draw on every process; process r owns global samples [r S, (r + 1) S), whole groups.
        drawn = draw_prompts(train_prompts, prompts_per_iter, args.seed, it)
        global_idx = range(rank * S, (rank + 1) * S)
        my_prompts = [drawn[k // G] for k in global_idx]
        init = torch.stack([keyed_randn(latent_shape, args.seed, it, "init", k) for k in global_idx])  # (CPU)
        cond = model.encode_prompts(my_prompts)
        denoiser.eval()
        chunks = [slice(c, c + args.rollout_batch_size) for c in range(0, S, args.rollout_batch_size)]
        # DGPO's official code: from then on, the rollouts of the EMA reference (Diffusion-DPO has none)
        switched = not dpo and run.optimizer_steps > args.switch_ema_ref
        with old_policy(policy, old, args.lora) if switched else nullcontext(policy) as pi:
            x = torch.cat(
                [
                    rollout(model, pi, {k: v[c] for k, v in cond.items()}, init[c].to(device), sigmas, args.solver,
                            args.guidance_scale, autocast)
                    for c in chunks
                ]
            )  # (S, *L) fp32 final latents: the only thing kept  # fmt: skip
        with torch.no_grad():
            requests = [reward_fn.request(model.decode(x[c]).float(), my_prompts[c]) for c in chunks]
        t_sample = time.perf_counter() - run.t_iter

        # ------------------------------------------------------------ REWARDS & ADVANTAGES
        rewards, parts = reward_fn.collect(requests)  # (S,) the weighted sum of the components, each component's (S,)
        all_rewards = accelerator.gather(rewards.float().to(device))  # (world * S,) in global sample order
        parts = {k: accelerator.gather(v.float().to(device)) for k, v in parts.items()}
        mine = slice(rank * S, (rank + 1) * S)
        if dpo:  # the rows: each group's (winner, loser), 2 per group
            winner, loser, has_pref = best_and_worst(all_rewards[mine], G)
            rows, weight = torch.stack([winner, loser], 1).flatten(), has_pref.float()  # (2 S / G,), (S / G,)
        else:  # the rows: every image, with its advantage
            adv = group_advantages(all_rewards, group_size=G, global_std=args.global_std, clip=args.adv_clip_max)
            rows, weight = torch.arange(S, device=device), adv[mine]
        rows = rows.cpu()  # local sample indices of the training rows, whole groups (pairs) in order

        # ------------------------------------------------------------ TRAINING
        model.park(), reward_fn.park()  # --offload-frozen: the VAE and the reward models leave the GPU
        denoiser.train()
        t_idx = shared_timesteps(args.trunc_steps, args.train_timesteps, (args.seed, it))  # M grid indices
        stats = defaultdict(list)  # each figure of the objective, one tensor per micro-batch and timestep
        for u in range(updates_per_iter):
            for m in range(u * micro_per_update, (u + 1) * micro_per_update):
                sl = rows[m * mb : (m + 1) * mb]  # (B,) local sample indices, whole groups or pairs
                cond_sl, x0 = {k: v[sl.to(v.device)] for k, v in cond.items()}, x[sl.to(device)]
                w_sl = weight[m * mb // (2 if dpo else 1) : (m + 1) * mb // (2 if dpo else 1)]  # adv (B,) or (B/2,)
                for n, j in enumerate(t_idx):  # one forward and backward per timestep, as the official code
                    last = m == (u + 1) * micro_per_update - 1 and n == len(t_idx) - 1
                    t = sigmas[j].expand(len(sl)).to(device)  # (B,) the shared grid timestep
                    groups = [global_idx[k] // G for k in sl.tolist()]  # the noise is shared by a group
                    eps = torch.stack([keyed_randn(latent_shape, args.seed, it, "eps", g, j) for g in groups])
                    eps = eps.to(device)
                    tv = t.view(-1, *[1] * (x0.dim() - 1))
                    x_t, target = (1 - tv) * x0 + tv * eps, eps - x0
                    with torch.no_grad(), autocast():
                        with base_weights(ref, args.lora) as base:
                            v_ref = model.velocity(base, x_t, t, cond_sl, args.train_guidance_scale).float()
                        v_old = None
                        if use_old:
                            with old_policy(policy, old, args.lora) as pi_old:
                                v_old = model.velocity(pi_old, x_t, t, cond_sl, args.train_guidance_scale).float()
                    with accelerator.no_sync(denoiser) if not last else nullcontext():
                        with autocast():
                            v_theta = model.velocity(denoiser, x_t, t, cond_sl, args.train_guidance_scale).float()
                        d, d_ref = velocity_error(v_theta, target), velocity_error(v_ref, target)
                        figures = {"d": d.detach(), "d_ref": d_ref}
                        if dpo:
                            loss, more = dpo_loss(d, d_ref, w_sl, beta=args.beta)
                        else:
                            if use_old:
                                d, clipped, ratio = ppo_clip(d, velocity_error(v_old, target), w_sl, args.clip_range)
                                figures |= {"clipfrac": clipped.float(), "ratio_dev": (ratio - 1).abs()}
                            loss, more = dgpo_loss(d, d_ref, w_sl, beta=args.beta, group_size=G)
                        figures |= more
                        if args.kl_beta > 0:
                            kl = (v_theta - v_ref).square().flatten(1).mean(1)
                            loss = loss + args.kl_beta * kl.mean()
                            figures["kl"] = kl.detach()
                        figures["loss"] = loss.detach()
                        accelerator.backward(loss / (micro_per_update * len(t_idx)))
                    for k, v in figures.items():
                        stats[k].append(v)
            lr = args.learning_rate * min(1.0, (run.optimizer_steps + 1) / max(1, args.lr_warmup))  # linear warmup
            optimizer.param_groups[0]["lr"] = lr  # one group: every trained parameter
            norm = accelerator.clip_grad_norm_(params, args.max_grad_norm)  # before clipping
            if stepped := all_finite(norm, accelerator):  # else skipped on every process
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run.count_step(lr, norm, stepped)  # logged at the iteration's end; the warmup and resume count it
            if stepped:  # a skipped step moves neither the weights nor their EMAs
                soft_update(old_params, params, ref_decay(run.optimizer_steps - 1))  # the official's step count
                if args.ema and (run.optimizer_steps + 1) % args.ema_every == 0:  # the official's interval test
                    soft_update(ema, params, ema_decay(run.optimizer_steps, args.ema_max_decay))

        # ------------------------------------------------------------ LOGGING
        log = {
            **reward_stats(all_rewards, parts),
            "advantages/zero_std_groups": (all_rewards.view(-1, G).std(1) == 0).float().mean().item(),
            **({} if dpo else {"advantages/abs_mean": weight.abs().mean().item()}),
            "dgpo/x0_norm": x.square().mean().item(),
            "dgpo/rollouts_from_old": float(switched),
            "dgpo/old_distance": sum((o - p).square().sum() for o, p in zip(old_params, params)).sqrt().item(),
            **summarize(stats, "losses/"),  # every figure of the objective
            # 0 while the old policy equals the trained weights (the first iteration; after a step at decay 0)
            **({"losses/first_ratio_max_dev": stats["ratio_dev"][0].max().item()} if use_old else {}),
            "perf/nfe_per_image": nfe,
            "perf/trained_timesteps_per_image": args.train_timesteps * (2 / G if dpo else 1),  # per sampled image
            "perf/sampling_s": t_sample,
            "perf/reward_wait_s": reward_fn.wait_s,
        }
        run.end_iteration(it, log, params)  # + gradient norms, timings; metrics.jsonl, TensorBoard, W&B

        # ------------------------------------------------------------ CHECKPOINT
        run.checkpoint(it + 1, final=it + 1 == args.iterations)  # + on SIGTERM / Ctrl-C, then exits

        # ------------------------------------------------------------ EVAL
        with weights_swapped(params, ema, args.ema):
            evaluate(it + 1, final=it + 1 == args.iterations)

    # ---------------------------------------------------------------- FINAL SAVE
    with weights_swapped(params, ema, args.ema):  # final/ holds the EMA weights, as the official checkpoints
        run.save_final(model, denoiser, args.lora)


if __name__ == "__main__":
    cli(main, Args)
