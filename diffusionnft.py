# DiffusionNFT: docs/diffusionnft.md; paper: arXiv 2509.16117 (official code: NVlabs/DiffusionNFT, SD3 only)
"""Online diffusion negative-aware fine-tuning of a flow-matching text-to-image model, one file (DiffusionNFT).

No likelihood and no sampler log-probs: images are sampled from the OLD policy with a deterministic ODE solver (only
the final latents x0 are kept), scored, and each reward R becomes an optimality probability
r = 1/2 + clip(A, -c, c) / (2 c), A = (R - mean_prompt R) / (std_all R + 1e-4), c = 5. Training is plain flow
matching on those x0, at timesteps of the sampler's grid with fresh noise: x_t = (1 - t) x0 + t eps, target
v = eps - x0. Two implicit policies share the trained velocity v_theta and the old one v_old (no gradient):
v+ = (1 - beta) v_old + beta v_theta and v- = (1 + beta) v_old - beta v_theta; the loss pulls v+ towards v on good
images and v- on bad ones, loss = c (r L(v+) + (1 - r) L(v-)) / beta, L = the x0-space squared error divided by its
stop-gradient mean absolute error, plus --kl-beta times the velocity MSE to the base model. Its per-sample minimiser
with equal weights is v_theta* = v_old + (2r - 1)(v - v_old) / beta. The old policy (a second LoRA adapter `old`)
is soft-updated once per iteration, old <- eta old + (1 - eta) theta, and never optimised; an EMA of the trained
weights is what evaluation and final/ use.

Launch:
    python diffusionnft.py                                               # ShapesBench on CPU
    python diffusionnft.py --beta 0.1 --old-decay delayed                # the official OCR recipe's beta and schedule
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 diffusionnft.py   # 2 CPU processes
    python diffusionnft.py --resume-from latest                          # continue the newest runs/diffusionnft__*
    (SD3.5-M with the official values: docs/diffusionnft.md, "Real models")

ShapesBench's defaults differ from the official configs (each flag's help gives the official value; docs/diffusionnft.md
says why). Deviations from the official code and choices where it is silent (docs/diffusionnft.md explains each):
  1. every random draw (initial noise, training timesteps, forward noise) is keyed on (seed, iteration, sample), so
     resumed and multi-process runs draw the same numbers; a group is G consecutive samples of one drawn prompt;
  2. the loss is computed in fp32 (the official weights and errors are float64; measured: 5.6e-7 of the loss, 2.2e-6
     of its gradient at most on ShapesBench);
  3. the samples of an iteration are shuffled (keyed on seed, iteration and process) before they are split into
     optimizer steps, as the official code, so that each step mixes prompts;
  4. the soft update's and the EMA's step s counts the optimizer steps taken, this iteration's included;
  5. evaluation uses the shared Euler sampler (--eval-steps 20; the official: 40 Euler steps; measured: the base's
     held-out reward 0.6185 at 20 steps, 0.6164 at 40), with the EMA weights;
  6. --no-lora keeps the old policy as a frozen fp32 copy (the official code is LoRA only); FSDP is refused;
  7. --no-self-normalize (plain x0 MSE) is an ablation; with it the minimiser above holds exactly, with the official
     adaptive weight gradient descent drives v+ (r > 1/2) or v- (r < 1/2) onto v itself (tests check both);
  8. --guidance-scale > 1 applies CFG in rollouts and training alike (the official train-side branch looks broken).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed

from common.checkpoints import Carried
from common.evaluator import Evaluator
from common.flags import Ge, Gt, Le, Lt, RunArgs, check_flags, check_run_args, cli, divides, need
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
    """training iterations; 30, not the shared 40: an iteration takes about 12 s on one CPU thread here, so 40 and
    their evaluations would pass ShapesBench's 8 minutes (docs/diffusionnft.md)"""
    num_steps: Annotated[int, Ge(1), Le(1000)] = 10
    """sampling steps T of a rollout (shifted sigma schedule); training timesteps come from this grid (official: 10)"""
    solver: Literal["dpm2", "euler"] = "dpm2"
    """deterministic ODE solver of the rollouts: 'dpm2' = DPM-Solver-2 multistep in x0 (first and last steps first
    order; official), or Euler"""
    group_size: Annotated[int, Ge(2), Le(65536)] = 8  # counts of images: at most 2**16, far above any GPU's batch
    """images per prompt (G); a group may span processes (official: 24)"""
    samples_per_device: Annotated[int, Ge(1), Le(65536)] = 64
    """images sampled per process per iteration; prompts per iteration = processes * this / group size (official:
    144 per GPU on 8 GPUs = 48 prompts x 24)"""
    rollout_batch_size: Annotated[int, Ge(1), Le(65536)] = 16
    """images per denoiser forward in sampling (official: 9)"""
    train_batch_size: Annotated[int, Ge(1), Le(65536)] = 16
    """images per training micro-batch: one forward each of the old, the trained (and the base) policy per timestep
    (official: 9)"""
    samples_per_update: Annotated[int, Ge(1), Le(65536)] = 32
    """images (per process) whose gradients are accumulated into one optimizer step (official: all of them, 1 step per
    iteration; OCR: 2)"""
    timestep_fraction: Annotated[float, Gt(0), Le(1)] = 0.4
    """each image is trained at the first int(this * T) timesteps of its own random permutation of the grid (official:
    0.99, so 9 of 10)"""
    beta: Annotated[float, Gt(0), Le(100)] = 1.0  # at 100, v+ and v- are already a hundredfold extrapolation
    """NFT beta: v+ = (1 - beta) v_old + beta v_theta, v- = (1 + beta) v_old - beta v_theta, loss / beta (official:
    1.0; 0.1 for OCR and multi-reward); not the KL weight"""
    kl_beta: Annotated[float, Ge(0)] = 1e-4
    """weight of the velocity MSE to the base model (LoRA adapters off, or a frozen copy); 0 = off (official: 1e-4,
    its `train.beta`)"""
    adv_clip_max: Annotated[float, Gt(0)] = 5.0
    """advantages are clipped to +-c and r = 1/2 + clip(A) / (2 c); c also multiplies the NFT term (official: 5)"""
    self_normalize: bool = True
    """divide each squared x0 error by its stop-gradient mean absolute error, clamped at 1e-5 (official adaptive
    weighting); --no-self-normalize: the plain x0 MSE"""
    old_decay: Literal["linear", "delayed"] = "linear"
    """old-policy soft update old <- eta old + (1 - eta) theta after s optimizer steps: 'linear' eta = min(0.001 s,
    0.5) (official default), 'delayed' eta = 0 for s < 75, then min(0.0075 (s - 75), 0.999) (official OCR)"""
    old_decay_speed: Annotated[float, Gt(0)] = 1.0
    """the schedule read at this many times the step count, eta(s) = schedule(k s) (official: 1): a short run keeps the
    official run's pace relative to its length with k = its steps / the run's (about 1,700 / N on SD3.5-M)"""
    ema: bool = True
    """evaluate and save (final/) the EMA of the trained weights, as the official code; --no-ema: the live weights"""
    ema_max_decay: Annotated[float, Ge(0), Lt(1)] = 0.9
    """EMA decay after s optimizer steps: min((1 + s) / (10 + s), this) (official: 0.9)"""


# ---------------------------------------------------------------------------------------------------
# ALGO LOGIC: schedule, ODE solver, optimality probability, timesteps, the old policy, EMA, loss
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


def nft_advantages(rewards: torch.Tensor, *, group_size) -> torch.Tensor:
    """(N,) rewards in global sample order, consecutive blocks of G = one prompt -> (N,) advantages
    A = (R - mean of the prompt's R) / (std of ALL N rewards + 1e-4): the population std over every process's
    samples (the official global_std), not the group's."""
    R = rewards.double()
    return (
        (R.view(-1, group_size) - R.view(-1, group_size).mean(1, keepdim=True)).flatten() / (R.std(correction=0) + 1e-4)
    ).float()


def optimality(adv: torch.Tensor, clip_max: float) -> torch.Tensor:
    """The optimality probability r = clamp(clip(A, -c, c) / c / 2 + 1/2, 0, 1) of each advantage: 1/2 is neutral."""
    return (adv.clamp(-clip_max, clip_max) / clip_max / 2 + 0.5).clamp(0, 1)


def n_train_timesteps(num_steps: int, fraction: float) -> int:
    """Timesteps trained per image: int(T x fraction), truncated as the official code does (0.99 of 10: 9)."""
    return int(num_steps * fraction)


def noised(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The forward process x_t = (1 - t) x0 + t eps of (B, *L) data and noise at each image's own t (B,)."""
    tv = t.view(-1, *[1] * (x0.dim() - 1))
    return (1 - tv) * x0 + tv * eps


def train_timesteps(num_steps: int, n_train: int, key: tuple, sample_ids) -> torch.Tensor:
    """(S, n_train) indices into the rollout grid sigma_0 .. sigma_{T-1} (t = 1 included, t = 0 never): per image the
    first n_train of its own random permutation, keyed on (*key, 'timesteps', global sample index)."""
    return torch.stack(
        [
            torch.randperm(num_steps, generator=rng(*key, "timesteps", k), device="cpu")[:n_train]  # cpu: keyed
            for k in sample_ids
        ]
    )


def sample_order(n: int, seed: int, iteration: int, rank: int) -> torch.Tensor:
    """The order (n,) in which a process's samples of an iteration are split into micro-batches and optimizer steps:
    a permutation keyed on (seed, iteration, process), as the official code shuffles, so a step mixes prompts and a
    resumed run repeats it."""
    return torch.randperm(n, generator=rng(seed, iteration, "shuffle", rank), device="cpu")  # cpu: keyed


def old_decay(step: int, schedule: str, speed: float = 1.0) -> float:
    """eta of the soft update old <- eta old + (1 - eta) theta after `step` optimizer steps, s = speed x step: 'linear'
    min(0.001 s, 0.5); 'delayed' 0 for s < 75 (the old policy follows theta), then min(0.0075 (s - 75), 0.999)."""
    step = step * speed
    if schedule == "linear":
        return min(0.001 * step, 0.5)
    return 0.0 if step < 75 else min(0.0075 * (step - 75), 0.999)


def ema_decay(step: int, max_decay: float) -> float:
    """Decay of the evaluation EMA after `step` optimizer steps: min((1 + s) / (10 + s), max_decay)."""
    return min((1 + step) / (10 + step), max_decay)


@torch.no_grad()
def soft_update(targets, sources, decay: float) -> None:
    """targets <- decay targets + (1 - decay) sources, in place (lerp: decay 0 copies the sources bitwise)."""
    for t, s in zip(targets, sources, strict=True):
        t.lerp_(s.detach(), 1 - decay)


def policy_loss(v_theta, v_old, v_ref, x0, x_t, t, r, *, beta, adv_clip_max, kl_beta, self_normalize):
    """The objective per image (B,) at one timestep: v_theta (B, *L) the trained velocity (with graph), v_old the old
    policy's, v_ref the base model's (None without a KL term), all at x_t = (1 - t) x0 + t eps; t, r (B,).
    c (r E(v+) + (1 - r) E(v-)) / beta + kl_beta mean((v_theta - v_ref)^2), E(v) = mean((x0_hat - x0)^2) /
    sg(max(mean|x0_hat - x0|, 1e-5)) with x0_hat = x_t - t v (without self_normalize: the plain mean) and c =
    adv_clip_max, the factor the official code multiplies the term by (5 in every official config). Returns it and
    its figures, logged as losses/<name>. A fork's new term: a keyword argument here, a field of Args, its figure."""
    tv = t.view(-1, *[1] * (x0.dim() - 1))
    v_old = v_old.detach()
    v_pos = (1 - beta) * v_old + beta * v_theta  # the implicit positive policy
    v_neg = (1 + beta) * v_old - beta * v_theta  # and the negative one, its reflection about v_old

    def x0_error(v):  # (B,)
        err = (x_t - tv * v - x0).flatten(1)
        sq = err.square().mean(1)
        return sq / err.detach().abs().mean(1).clamp_min(1e-5) if self_normalize else sq

    pos, neg = x0_error(v_pos), x0_error(v_neg)
    loss = adv_clip_max * (r * pos + (1 - r) * neg) / beta  # c = the advantage clip, as the official code
    figures = {"policy": loss, "pos": pos, "neg": neg, "old_deviation": (v_theta - v_old).square().flatten(1).mean(1)}
    if v_ref is not None:
        kl = (v_theta - v_ref).square().flatten(1).mean(1)
        loss = loss + kl_beta * kl  # term by term: a new term is one more such line
        figures["kl"] = kl
    return loss, {k: v.detach() for k, v in figures.items()}


# ---------------------------------------------------------------------------------------------------
# Flag checks: the mode's defaults, then every flag, before a model loads (the shared flags are in common/flags.py)
# ---------------------------------------------------------------------------------------------------
MODE_FLAGS = [  # a flag of another mode is an error unless left at its default (no dead flags)
    ("ema_max_decay", lambda a: a.ema, "--ema"),
]


def resolve_and_check(args: Args) -> tuple[list[str], list[str], RewardSpec]:
    """The mode's defaults filled in, this script's flags and the shared ones (common/flags.py) checked: a bad flag is
    one `error:` line naming it (those that need the process count: in main()). Returns check_run_args's."""
    check_flags(args, MODE_FLAGS)  # floats finite, every flag in its declared range, no dead flags
    args.exp_name = args.exp_name or Path(__file__).stem  # a fork: its own name
    T, fraction = args.num_steps, args.timestep_fraction
    need(
        n_train_timesteps(T, fraction) >= 1,
        f"--timestep-fraction {fraction} trains int({T} x {fraction}) = 0 of the --num-steps {T} timesteps; raise it",
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
    return check_run_args(args, video=False)


def main(args: Args):
    # ---------------------------------------------------------------- SETUP
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    world, rank = accelerator.num_processes, accelerator.process_index
    inputs = resolve_and_check(args)  # flags checked, prompts read, --reward parsed, before any model loads
    S, G = args.samples_per_device, args.group_size
    need(S * world % G == 0, f"--samples-per-device {S} x {world} processes must be a multiple of --group-size {G}")
    need(
        accelerator.distributed_type != DistributedType.FSDP,
        "diffusionnft.py keeps the old policy and the EMA beside the trained weights, which FSDP would shard: "
        "use DDP (accelerate launch --multi_gpu) with --lora",
    )
    run = Run(args, accelerator, "DiffusionNFT", frozen_copy=not args.lora)
    set_seed(args.seed)  # LoRA init and anything else not keyed through rng()
    device, autocast = accelerator.device, accelerator.autocast
    frozen_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    prompts_per_iter = world * args.samples_per_device // args.group_size
    mb = args.train_batch_size
    micro_per_update = args.samples_per_update // mb
    updates_per_iter = args.samples_per_device // args.samples_per_update
    n_train = n_train_timesteps(args.num_steps, args.timestep_fraction)  # trained timesteps per image

    # ---------------------------------------------------------------- MODELS
    model = load_model(args.model_id, device, frozen_dtype, args.resolution, args.num_frames, args.offload_frozen)
    sigmas = model.sigmas(args.num_steps) if args.shift == "pipeline" else sigma_schedule(args.num_steps, args.shift)
    denoiser = trainable_denoiser(model, args)  # trained in fp32: all weights, or a LoRA adapter (--lora)
    # the base model for the KL: the adapters switched off (LoRA), or a frozen copy made before any update
    ref = (denoiser if args.lora else frozen_copy(denoiser, frozen_dtype)) if args.kl_beta > 0 else None
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
    nfe = args.num_steps + n_train * (3 if ref is not None else 2)  # rollout; old, trained (+ base) per timestep
    lines = [
        f"processes {world} x samples per process {args.samples_per_device} = {prompts_per_iter} prompts x group "
        f"size {args.group_size}; rollouts from the old policy: {args.solver} ODE, {args.num_steps} steps, "
        f"guidance {args.guidance_scale}",
        f"{n_train} of {args.num_steps} grid timesteps per image, fresh noise each; micro-batch {mb}; optimizer steps "
        f"/ iteration {updates_per_iter}; denoiser forwards per image {nfe}",
        f"NFT beta {args.beta}, KL weight {args.kl_beta}, adaptive weight {args.self_normalize}; old policy: "
        f"{'adapter `old`' if args.lora else 'frozen copy'}, {args.old_decay} soft update; EMA for evaluation "
        + (f"(max decay {args.ema_max_decay})" if args.ema else "off"),
    ]
    run.banner(model, params, lines)
    with weights_swapped(params, ema, args.ema):  # evaluation sees the EMA weights
        evaluate(start, final=start == args.iterations)  # at the start; resumed: what the interrupted run missed
    for it in run.iterations(start):
        # ------------------------------------------------------------ SAMPLING
        # The same prompt draw on every process; process r owns global samples [r S, (r + 1) S).
        drawn = draw_prompts(train_prompts, prompts_per_iter, args.seed, it)
        global_idx = range(rank * args.samples_per_device, (rank + 1) * args.samples_per_device)
        my_prompts = [drawn[k // args.group_size] for k in global_idx]
        init = torch.stack([keyed_randn(latent_shape, args.seed, it, "init", k) for k in global_idx])  # (CPU)
        cond = model.encode_prompts(my_prompts)
        denoiser.eval()
        chunks = [
            slice(c, c + args.rollout_batch_size) for c in range(0, args.samples_per_device, args.rollout_batch_size)
        ]
        with old_policy(policy, old, args.lora) as pi_old:  # the rollouts come from the old policy
            x = torch.cat(
                [
                    rollout(
                        model,
                        pi_old,
                        {k: v[c] for k, v in cond.items()},
                        init[c].to(device),
                        sigmas,
                        args.solver,
                        args.guidance_scale,
                        autocast,
                    )
                    for c in chunks
                ]
            )  # (S, *L) fp32 final latents: the only thing kept
        with torch.no_grad():
            requests = [reward_fn.request(model.decode(x[c]).float(), my_prompts[c]) for c in chunks]
        t_sample = time.perf_counter() - run.t_iter

        # ------------------------------------------------------------ REWARDS & ADVANTAGES
        rewards, parts = reward_fn.collect(requests)  # (S,) the weighted sum of the components, each component's (S,)
        all_rewards = accelerator.gather(rewards.float().to(device))  # (world * S,) in global sample order
        parts = {k: accelerator.gather(v.float().to(device)) for k, v in parts.items()}
        all_adv = nft_advantages(all_rewards, group_size=args.group_size)  # (world * S,)
        all_r = optimality(all_adv, args.adv_clip_max)  # (world * S,)
        r = all_r[rank * args.samples_per_device : (rank + 1) * args.samples_per_device]

        # ------------------------------------------------------------ TRAINING
        model.park(), reward_fn.park()  # --offload-frozen: the VAE and the reward models leave the GPU
        denoiser.train()
        t_idx = train_timesteps(args.num_steps, n_train, (args.seed, it), global_idx)  # (S, n_train), CPU
        # the samples in a keyed random order before they are split into optimizer steps (deviation 3)
        order = sample_order(args.samples_per_device, args.seed, it, rank)
        stats = defaultdict(list)  # each figure policy_loss returns, one tensor per micro-batch and timestep
        for u in range(updates_per_iter):
            for m in range(u * micro_per_update, (u + 1) * micro_per_update):
                sl = order[m * mb : (m + 1) * mb]  # (B,) local sample indices, CPU
                cond_sl, x0 = {k: v[sl.to(v.device)] for k, v in cond.items()}, x[sl.to(device)]
                for j in range(n_train):  # one forward and backward per timestep, as the official code
                    last = m == (u + 1) * micro_per_update - 1 and j == n_train - 1
                    t = sigmas[t_idx[sl, j]].to(device)  # (B,) each image its own grid timestep
                    eps = torch.stack([keyed_randn(latent_shape, args.seed, it, "eps", global_idx[k], j) for k in sl])
                    x_t = noised(x0, eps.to(device), t)
                    with torch.no_grad(), autocast():
                        with old_policy(policy, old, args.lora) as pi_old:
                            v_old = model.velocity(pi_old, x_t, t, cond_sl, args.guidance_scale).float()
                        v_ref = None
                        if ref is not None:
                            with base_weights(ref, args.lora) as base:
                                v_ref = model.velocity(base, x_t, t, cond_sl, args.guidance_scale).float()
                    with accelerator.no_sync(denoiser) if not last else nullcontext():
                        with autocast():
                            v_theta = model.velocity(denoiser, x_t, t, cond_sl, args.guidance_scale).float()
                        loss, figures = policy_loss(
                            v_theta, v_old, v_ref, x0, x_t, t, r[sl.to(device)], beta=args.beta,
                            adv_clip_max=args.adv_clip_max, kl_beta=args.kl_beta, self_normalize=args.self_normalize,
                        )  # fmt: skip
                        accelerator.backward(loss.mean() / (micro_per_update * n_train))
                    for k, v in figures.items():
                        stats[k].append(v)
            lr = args.learning_rate * min(1.0, (run.optimizer_steps + 1) / max(1, args.lr_warmup))  # linear warmup
            optimizer.param_groups[0]["lr"] = lr  # one group: every trained parameter
            norm = accelerator.clip_grad_norm_(params, args.max_grad_norm)  # before clipping
            if stepped := all_finite(norm, accelerator):  # else skipped on every process
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run.count_step(lr, norm, stepped)  # logged at the iteration's end; the warmup and resume count it
            if stepped:  # a skipped step moves neither the weights nor their EMA
                soft_update(ema, params, ema_decay(run.optimizer_steps, args.ema_max_decay))  # the evaluation EMA
        eta = old_decay(run.optimizer_steps, args.old_decay, args.old_decay_speed)
        soft_update(old_params, params, eta)  # once per iteration, after the optimizer steps

        # ------------------------------------------------------------ LOGGING
        log = {
            **reward_stats(all_rewards, parts),
            "advantages/zero_std_groups": (all_rewards.view(-1, args.group_size).std(1) == 0).float().mean().item(),
            "advantages/abs_mean": all_adv.abs().mean().item(),
            "advantages/clipfrac": (all_adv.abs() > args.adv_clip_max).float().mean().item(),
            "nft/r_abs_dev": (all_r - 0.5).abs().mean().item(),  # 0: every r neutral (1/2), 0.5: all 0 or 1
            "nft/x0_norm": x.square().mean().item(),  # the official x0_norm (brightness drift shows here)
            "nft/old_eta": eta,
            "nft/ema_decay": ema_decay(run.optimizer_steps, args.ema_max_decay),
            "nft/old_distance": sum((o - p).square().sum() for o, p in zip(old_params, params)).sqrt().item(),
            **summarize(stats, "losses/"),  # every figure of policy_loss
            "losses/first_old_deviation": stats["old_deviation"][0].max().item(),  # 0 while old == theta
            "perf/nfe_per_image": nfe,
            "perf/trained_timesteps_per_image": n_train,
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
