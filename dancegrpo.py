# DanceGRPO (and MixGRPO with --sde-window): docs/dancegrpo.md; paper: arXiv 2505.07818 (MixGRPO: 2507.21802)
"""GRPO on the reverse-time SDE of a flow-matching text-to-image model, one file.

Each denoising step of an SDE sampler is a Gaussian policy pi(x_{i+1} | x_i); a group of images per
prompt is sampled and scored, rewards are normalised within the group, and a PPO-clipped surrogate on
the per-step likelihood ratio is optimised over a random fraction of the steps (DanceGRPO). With
--sde-window W only a W-step window is stochastic (and trained); it slides one step deeper every
--window-shift-every iterations and every other step is a deterministic ODE step (MixGRPO).

Launch (run.sh has more):
    python dancegrpo.py                                              # ShapesBench on CPU
    python dancegrpo.py --sde-window 4                               # MixGRPO on ShapesBench
    PROMPTS=prompts.txt bash run.sh dancegrpo-flux-8gpu             # FLUX.1-dev, LoRA, 8 GPUs; docs/gpu.md: all of them
    PROMPTS=prompts.txt bash run.sh dancegrpo-wan-8gpu              # Wan2.1 text-to-video, 8 GPUs; docs/video.md
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 dancegrpo.py   # 2 CPU processes
    python dancegrpo.py --resume-from latest                         # continue the newest runs/dancegrpo__*

ShapesBench's defaults differ from the paper's (run.sh's GPU recipes use the paper's): docs/dancegrpo.md lists them
and why. Deviations from the official code (docs/dancegrpo.md explains each):
  1. rollout chunks are the training micro-batches and the trained steps are drawn per chunk, so the first ratio of
     an iteration is exactly 1;
  2. the last step is a deterministic Euler step onto x0_hat, neither sampled nor trained;
  3. the optional KL is the exact Gaussian KL of one step;
  4. all randomness is keyed on (seed, iteration, global sample index), so resumed and multi-process runs draw the
     same numbers as an uninterrupted single-process one.
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
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed

from common.checkpoints import Carried
from common.evaluator import Evaluator
from common.flags import AllowInf, Ge, Gt, Le, Lt, ModeDefault, RunArgs, check_flags, check_run_args, cli, divides, need
from common.logs import reward_stats, summarize
from common.models import frozen_copy, load_model, reference_velocity, trainable_denoiser, weights_swapped
from common.prompts import draw_prompts
from common.rewards import RewardSpec, build_reward
from common.runs import Run, all_finite
from common.sampling import keyed_generator as rng  # (seed, iteration, ...) -> a generator
from common.sampling import keyed_randn


@dataclass
class Args(RunArgs):  # the shared flags (--model-id, --reward, --iterations, ...) are in common/flags.py
    learning_rate: Annotated[float, Gt(0), Le(1)] = 6e-4
    """AdamW learning rate (constant after --lr-warmup); 2x the shared default: the per-step estimator's update
    direction is mostly noise (docs/dancegrpo.md)"""
    num_steps: Annotated[int, Ge(2), Le(1000)] = 10
    """sampling steps T of a rollout (shifted sigma schedule)"""
    sde_type: Literal["dance", "flow", "cps"] = "flow"
    """the SDE step: 'dance' = noise g = eta (DanceGRPO), 'flow' = g = a sqrt(sigma / (1 - sigma)) (Flow-GRPO), 'cps' =
    the coefficient-preserving step, std sigma' sin(eta pi / 2) (arXiv 2509.05952), with its constant-free log-prob"""
    noise_level: Annotated[
        Optional[float], ModeDefault("0.3 with --sde-type dance, 0.7 with flow, 0.8 with cps"), Gt(0), Le(10)
    ] = None
    """eta for 'dance' and 'cps', a for 'flow' (at most 10, ten times the published values: beyond, noise drowns the
    sample)"""
    group_size: Annotated[int, Ge(2), Le(65536)] = 8  # counts of images: at most 2**16, far above any GPU's batch
    """images per prompt (G); a group may span processes"""
    samples_per_device: Annotated[int, Ge(1), Le(65536)] = 64
    """images sampled per process per iteration; prompts per iteration = processes * this / group size"""
    rollout_batch_size: Annotated[int, Ge(1), Le(65536)] = 32
    """images per denoiser forward in sampling; also the training micro-batch"""
    same_noise: bool = False
    """one shared initial noise per prompt group (DanceGRPO --init_same_noise)"""
    timestep_fraction: Annotated[Optional[float], ModeDefault("0.6; 1.0 with --sde-window"), Gt(0), Le(1)] = None
    """fraction of a trajectory's SDE steps trained (MixGRPO trains its whole window)"""
    samples_per_update: Annotated[int, Ge(1), Le(65536)] = 32
    """trajectories (per process) whose gradients are accumulated into one optimizer step"""
    objective: Literal["clip", "guard", "dppo"] = "clip"
    """'clip': the PPO-clipped ratio (DanceGRPO, Flow-GRPO); 'guard': GRPO-Guard's normalised ratio in the clip and
    1/step-size reweighting (arXiv 2510.22319); 'dppo': Flow-DPPO's unclipped ratio with a KL mask (arXiv 2606.11025)"""
    clip_range: Annotated[
        Optional[float], ModeDefault("1e-3; 1e-5 with --sde-type cps, 2e-6 with --objective guard"), AllowInf, Gt(0)
    ] = None
    """PPO clip epsilon on the ratio (log-probs are means over latent dimensions, hence small; CPS's constant-free
    log-prob shrinks the ratio's log by 2 std^2, GRPO-Guard's normalisation by std: the official ranges follow)"""
    adv_clip_max: Annotated[Optional[float], ModeDefault("5; none with --objective dppo"), AllowInf, Gt(0)] = None
    """advantages are clipped to +-this (Flow-DPPO leaves them unclipped)"""
    kl_mask_threshold: Annotated[float, Gt(0)] = 1e-5
    """--objective dppo: a sample whose step KL to the rollout policy is >= this is dropped where its ratio moves away"""
    advantage_aggregation: Literal["sum", "per-reward"] = "sum"
    """several rewards: 'sum' normalises their weighted sum (DanceGRPO); 'per-reward' normalises each, then sums with the weights (MixGRPO)"""
    kl_beta: Annotated[float, Ge(0)] = 0.0
    """weight of the per-step Gaussian KL to the frozen base model (0 = off, as upstream DanceGRPO and ShapesBench)"""
    sde_window: Annotated[int, Ge(0), Le(999)] = 0  # at most --num-steps - 1 (checked), and --num-steps <= 1000
    """MixGRPO: SDE (and training) only inside a window of W steps, ODE elsewhere; 0 = SDE everywhere"""
    window_shift_every: Annotated[int, Ge(1)] = 25
    """MixGRPO: the window moves one step deeper every N iterations"""
    ode_solver: Literal["euler", "dpm2"] = "euler"
    """MixGRPO: the ODE after the window; 'dpm2' = DPM-Solver++(2M) on a coarser grid (MixGRPO-Flash)"""
    post_window_compress: Annotated[float, Gt(0), Le(1)] = 0.4
    """--ode-solver dpm2: the steps after the window are re-gridded to max(int((T - last) x this), 2) points"""
    ema: bool = False
    """evaluate and save (final/) an EMA of the trained weights, as diffusionnft.py and vgrpo.py --ema do; off by default"""
    ema_max_decay: Annotated[float, Ge(0), Lt(1)] = 0.9
    """EMA decay after s optimizer steps: min((1 + s) / (10 + s), this) (diffusionnft.py's default)"""


# ---------------------------------------------------------------------------------------------------
# ALGO LOGIC: schedule, SDE step with log-prob, advantages, loss
# ---------------------------------------------------------------------------------------------------
def sigma_schedule(num_steps: int, shift: float) -> torch.Tensor:
    """linspace(1, 0, T + 1) warped by s' = k s / (1 + (k - 1) s) (SD3 shift); shape (T + 1,)."""
    s = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)  # cpu: read as 0-dim scalars or moved with .to()
    return (shift * s / (1 + (shift - 1) * s)).float()


def noise_g(sigmas: torch.Tensor, sde_type: str, level: float) -> torch.Tensor:
    """Diffusion coefficient g_i of each step i (T,). DanceGRPO: constant eta (CPS: eta, which its step uses). Flow-GRPO:
    a sqrt(s / (1 - s)), with sigmas[1] standing in for the first sigma in the denominator, as Flow-GRPO does."""
    s = sigmas[:-1]
    if sde_type != "flow":
        return torch.full_like(s, level)
    s_den = torch.where(s >= 1, sigmas[1], s)
    return level * torch.sqrt(s / (1 - s_den))


def sde_step(x, v, sigma, sigma_next, g, prev_sample=None, noise=None):
    """One Euler-Maruyama step of the reverse SDE dx = [v - g^2/2 score] ds + g dw (docs/math.md).

    x: (B, *L) fp32 at sigma, x = (1 - sigma) x0 + sigma eps; v: (B, *L) fp32, the model's velocity v = eps - x0 (every
    model kind returns this convention, common/models); sigma, sigma_next, g: floats or (B,) tensors. Returns (x_next, log_prob (B,), mean, std).
    x0_hat = x - sigma v, score = -(x - (1 - sigma) x0_hat) / sigma^2, mean = x + d (v - g^2/2 score),
    std = g sqrt(-d) with d = sigma_next - sigma < 0. log_prob is the full Gaussian log-density of x_next,
    averaged (not summed) over the latent dimensions as the official code does.
    """
    view = (-1,) + (1,) * (x.dim() - 1)
    sigma, sigma_next, g = (
        torch.as_tensor(t, dtype=x.dtype, device=x.device).reshape(view) for t in (sigma, sigma_next, g)
    )
    d = sigma_next - sigma
    x0_hat = x - sigma * v
    score = -(x - (1 - sigma) * x0_hat) / sigma**2
    mean = x + d * (v - g**2 / 2 * score)
    std = g * torch.sqrt(-d)
    if prev_sample is None:
        prev_sample = mean + std * noise
    log_prob = -((prev_sample - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return prev_sample, log_prob.flatten(1).mean(1), mean, std


def cps_step(x, v, sigma, sigma_next, eta, prev_sample=None, noise=None):
    """One coefficient-preserving step (CPS, arXiv 2509.05952 §3), called as sde_step with eta in g's place.

    x0_hat = x - sigma v and x1_hat = x + (1 - sigma) v (the predicted data and noise); std = sigma' sin(eta pi / 2);
    mean = (1 - sigma') x0_hat + sqrt(sigma'^2 - std^2) x1_hat, so x_next = mean + std eps keeps the signal
    coefficient 1 - sigma' and a total noise variance (sigma'^2 - std^2) + std^2 = sigma'^2 of the forward process.
    log_prob = -mean_D (x_next - mean)^2: the official code's, every constant dropped (no 1 / (2 std^2), no log std),
    so a log-ratio of it is 2 std^2 times the Gaussian one (the clip range is scaled accordingly). Returns (x_next,
    log_prob (B,), mean, std) as sde_step."""
    view = (-1,) + (1,) * (x.dim() - 1)
    sigma, sigma_next, eta = (
        torch.as_tensor(t, dtype=x.dtype, device=x.device).reshape(view) for t in (sigma, sigma_next, eta)
    )
    x0_hat, x1_hat = x - sigma * v, x + (1 - sigma) * v
    std = sigma_next * torch.sin(eta * math.pi / 2)
    mean = (1 - sigma_next) * x0_hat + torch.sqrt(sigma_next**2 - std**2) * x1_hat
    if prev_sample is None:
        prev_sample = mean + std * noise
    return prev_sample, -((prev_sample - mean) ** 2).flatten(1).mean(1), mean, std


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) rewards in global sample order, consecutive blocks of G = one prompt -> (N,) advantages.

    A = (R - mean_group) / (std_group + 1e-8) with the unbiased std, as DanceGRPO; a group with equal
    rewards gets 0 everywhere."""
    R = rewards.view(-1, group_size).double()
    return ((R - R.mean(1, keepdim=True)) / (R.std(1, keepdim=True) + 1e-8)).flatten().float()


def combined_advantages(scores: dict, weights: dict, *, group_size, adv_clip_max) -> torch.Tensor:
    """sum_k w_k * group_advantages(scores[k]) clipped to +-adv_clip_max, scores: name -> (N,) in global order. Given
    the weighted sum of the rewards as one score of weight 1 (--advantage-aggregation sum), the advantage of the
    weighted reward; given each reward's raw scores and weights (per-reward, MixGRPO's advantage_aggr, arXiv
    2507.21802), each reward counts by its weight whatever the spread of its scores. A zero weight never enters (its
    reward is still logged). A fork's advantage flag: a keyword argument here and a field of Args (as policy_loss)."""
    adv = sum(w * group_advantages(scores[name], group_size) for name, w in weights.items() if w != 0)
    return adv.clamp(-adv_clip_max, adv_clip_max)


def policy_loss(log_prob, old_log_prob, adv, mean, old_mean, mean_ref, std, dt, *, objective, clip_range,
                kl_mask_threshold, kl_beta):  # fmt: skip
    """The objective per sample (B,) of one step; log_prob, old_log_prob, adv (B,), mean, old_mean (the rollout's),
    mean_ref (B, *L), std (B,) or (B, 1..), dt = sigma - sigma' > 0 the step size. r = exp(logp - logp_old), and
    kl_old = mean_D (mean - old_mean)^2 / (2 std^2), the step's Gaussian KL to the rollout policy (per dimension).
      clip   the PPO-clipped surrogate max(-A r, -A clip(r, 1 - eps, 1 + eps)) (DanceGRPO, Flow-GRPO);
      guard  GRPO-Guard (arXiv 2510.22319 §4): r = exp(std (log r + kl_old)) in the same clip, whose log is
             mean_D(noise * (mean - old_mean)), zero-mean under the rollout noise (the plain log r is biased below 0
             by kl_old), then divided by dt so that every step's gradient has one size;
      dppo   Flow-DPPO (arXiv 2606.11025, Eq. 14, 18): -A r without clip, 0 for a sample with kl_old >= the threshold
             whose ratio moves away (r > 1 with A > 0, r < 1 with A < 0); corrective updates are kept.
    Plus kl_beta * KL(N(mean, std^2) || N(mean_ref, std^2)) to the base model's step if `mean_ref` is given.
    Returns it and its figures, logged as losses/<name> (common.logs.summarize). A fork's new term: one line adding it
    to `loss`, its weight a keyword argument here (with a default) passed where main() calls this, a field of Args."""
    std = std.flatten()
    kl_old = ((mean - old_mean) ** 2).flatten(1).mean(1) / (2 * std**2)  # (B,)
    log_ratio = log_prob - old_log_prob
    if objective == "guard":  # RatioNorm: the ratio-mean bias kl_old added back, the log scaled by std
        log_ratio = std * (log_ratio + kl_old)
    ratio = torch.exp(log_ratio)
    masked = torch.zeros_like(ratio, dtype=torch.bool)
    if objective == "dppo":  # no clip; a high-KL sample is dropped only where its ratio moves away
        masked = (kl_old >= kl_mask_threshold) & (((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0)))
        surrogate = torch.where(masked, 0.0, -adv * ratio)
    else:
        surrogate = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range))
    if objective == "guard":  # gradient reweighting: L / dt
        surrogate = surrogate / dt
    figures = {
        "policy": surrogate.mean(),
        "ratio_mean": ratio,
        "ratio_max_dev": (ratio - 1).abs().max(),
        "clipfrac": ((ratio - 1).abs() > clip_range).float().mean(),
        "approx_kl": (0.5 * (log_prob - old_log_prob) ** 2).mean(),
        "kl_old": kl_old.mean(),
        "masked": masked.float().mean(),
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


def sde_steps(num_steps: int, sde_window: int, window_shift_every: int, iteration: int) -> list[int]:
    """Steps sampled with the SDE (and trainable) at this iteration. The last step (to sigma = 0) is always
    ODE: it lands on x0_hat, which DanceGRPO decodes anyway, so it cannot change the reward.
    MixGRPO: the window [c, c + W) with c = iteration // window_shift_every, stopping at the last trainable step."""
    trainable = num_steps - 1
    if sde_window == 0:
        return list(range(trainable))
    start = min(iteration // window_shift_every, trainable - sde_window)
    return list(range(start, start + sde_window))


def post_window_sigmas(sigmas: torch.Tensor, shift: float, last: int, compress: float) -> torch.Tensor:
    """MixGRPO-Flash's grid (arXiv 2507.21802 §4.3): sigmas up to the window's last step `last`, then the rest, from
    sigmas[last + 1] to 0, re-gridded with the same shift to n = max(int((T - last) compress), 2) points (the official
    code's count, at least one step), for DPM-Solver++(2M). Shape (last + 1 + n,)."""
    T = len(sigmas) - 1
    n = max(int((T - last) * compress), 2)
    u = torch.linspace(1 - (last + 1) / T, 0, n, dtype=torch.float64)  # cpu: the unshifted times, as sigmas
    return torch.cat([sigmas[: last + 2], (shift * u / (1 + (shift - 1) * u)).float()[1:]])  # sigmas[last + 1] kept


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
def rollout(model, denoiser, cond, x, step_noise, sigmas, g, sde_idx, guidance_scale, autocast, step, dpm_after=None):
    """Sample one chunk. x: (B, *L) initial noise, step_noise: (B, T, *L). `step` (sde_step or cps_step) at the steps
    in `sde_idx`, Euler elsewhere; after step `dpm_after` (MixGRPO-Flash: the window's last, on post_window_sigmas)
    DPM-Solver++(2M), its history taken from every earlier step's x0_hat.

    Returns latents (B, T + 1, *L) fp32 (x_0 ... x_T, x_T the image latent), log_probs (B, T) (0 at ODE steps) and
    means (B, T, *L): each step's Gaussian mean (an ODE step's: x_{i+1} itself), what a ratio to the rollout needs."""
    latents, log_probs = [x], torch.zeros(len(x), len(sigmas) - 1, device=x.device)
    means, x0_prev, s_prev = [], None, 1.0
    for i in range(len(sigmas) - 1):
        with autocast():
            v = model.velocity(denoiser, x, sigmas[i].expand(len(x)).to(x.device), cond, guidance_scale)
        v = v.float()
        s, s_next, x0_hat = float(sigmas[i]), float(sigmas[i + 1]), x - sigmas[i] * v
        if i in sde_idx:
            x, log_probs[:, i], mean, _ = step(
                x, v, sigmas[i], sigmas[i + 1], g[i], noise=step_noise[:, i].to(x.device)
            )
        elif dpm_after is not None and i > dpm_after:
            x = mean = dpm_solver_2m_step(x, x0_hat, x0_prev, s_prev, s, s_next)
        else:
            x = mean = x + (sigmas[i + 1] - sigmas[i]) * v
        latents.append(x), means.append(mean)
        x0_prev, s_prev = x0_hat, s
    return torch.stack(latents, 1), log_probs, torch.stack(means, 1)


# ---------------------------------------------------------------------------------------------------
# Flag checks: the mode's defaults, then every flag, before a model loads (the shared flags are in common/flags.py)
# ---------------------------------------------------------------------------------------------------
MODE_FLAGS = [  # a flag of another mode is an error unless left at its default (no dead flags)
    *[(f, lambda a: a.sde_window > 0, "--sde-window W > 0 (MixGRPO)") for f in ("window_shift_every", "ode_solver")],
    ("post_window_compress", lambda a: a.ode_solver == "dpm2", "--ode-solver dpm2 (MixGRPO-Flash)"),
    ("kl_mask_threshold", lambda a: a.objective == "dppo", "--objective dppo"),
    *[(f, lambda a: a.objective != "dppo", "--objective clip or guard") for f in ("clip_range", "adv_clip_max")],
    ("ema_max_decay", lambda a: a.ema, "--ema"),
]


def title(args: Args) -> str:
    """The method the flags make, for the banner."""
    name = "MixGRPO-Flash" if args.ode_solver == "dpm2" else "MixGRPO" if args.sde_window else "DanceGRPO"
    return (
        name
        + {"clip": "", "guard": " + GRPO-Guard", "dppo": " + Flow-DPPO"}[args.objective]
        + (" (CPS)" if args.sde_type == "cps" else "")
    )


def resolve_and_check(args: Args) -> tuple[list[str], list[str], RewardSpec]:
    """The mode's defaults filled in, this script's flags and the shared ones (common/flags.py) checked: a bad flag is
    one `error:` line naming it (those that need the process count: in main()). Returns check_run_args's."""
    check_flags(args, MODE_FLAGS)  # floats finite, every flag in its declared range, no dead flags
    need(
        args.sde_type != "cps" or args.objective == "clip",
        f"--objective {args.objective} needs a Gaussian log-density: --sde-type cps's log-prob drops its constants "
        "(the official GRPO-Guard and Flow-DPPO refuse it too); pass --sde-type flow or dance",
    )
    if args.noise_level is None:
        args.noise_level = {"dance": 0.3, "flow": 0.7, "cps": 0.8}[args.sde_type]
    if args.clip_range is None:
        guard, cps = args.objective == "guard", args.sde_type == "cps"
        args.clip_range = math.inf if args.objective == "dppo" else 2e-6 if guard else 1e-5 if cps else 1e-3
    if args.adv_clip_max is None:
        args.adv_clip_max = math.inf if args.objective == "dppo" else 5.0
    if args.timestep_fraction is None:
        args.timestep_fraction = 1.0 if args.sde_window else 0.6
    mode = ("_flash" if args.ode_solver == "dpm2" else "_mix" if args.sde_window else "") + (
        "" if args.objective == "clip" else f"_{args.objective}"
    )
    args.exp_name = args.exp_name or Path(__file__).stem + mode + ("_cps" if args.sde_type == "cps" else "")
    T, S = args.num_steps, args.samples_per_device
    need(args.sde_window <= T - 1, f"--sde-window must be in [0, {T - 1}] (= --num-steps - 1)")
    need(
        args.sde_type != "cps" or args.noise_level < 1, "--noise-level must be < 1 with --sde-type cps (sin(eta pi/2))"
    )
    need(
        args.ode_solver != "dpm2" or args.shift != "pipeline",
        "--ode-solver dpm2 re-grids the steps after the window with a static shift: pass a number as --shift",
    )
    need(divides(args.rollout_batch_size, S), "--samples-per-device must be a multiple of --rollout-batch-size")
    need(
        divides(args.rollout_batch_size, args.samples_per_update) and divides(args.samples_per_update, S),
        "--samples-per-update must be a multiple of --rollout-batch-size and divide --samples-per-device",
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
    frozen = args.kl_beta > 0 and not args.lora  # KL reference: a frozen copy of the base (LoRA: adapter off)
    run = Run(args, accelerator, title(args), frozen_copy=frozen)
    set_seed(args.seed)  # LoRA init and anything else not keyed through rng()
    device, autocast = accelerator.device, accelerator.autocast
    frozen_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    prompts_per_iter = world * args.samples_per_device // args.group_size
    micro_per_update = args.samples_per_update // args.rollout_batch_size  # rollout chunks, each a micro-batch
    updates_per_iter = args.samples_per_device // args.samples_per_update
    policy_step = cps_step if args.sde_type == "cps" else sde_step  # the trained Gaussian step, with its log-prob

    # ---------------------------------------------------------------- MODELS
    model = load_model(args.model_id, device, frozen_dtype, args.resolution, args.num_frames, args.offload_frozen)
    sigmas = model.sigmas(args.num_steps) if args.shift == "pipeline" else sigma_schedule(args.num_steps, args.shift)
    g = noise_g(sigmas, args.sde_type, args.noise_level)  # (T,)
    denoiser = trainable_denoiser(model, args)  # trained in fp32: all weights, or a LoRA adapter (--lora)
    ref = denoiser if args.lora else frozen_copy(denoiser, frozen_dtype) if frozen else None

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
    latent_shape = model.latent_shape()
    evaluate = Evaluator(args, model, denoiser, reward_fn, eval_prompts, run, args.rollout_batch_size)  # Euler ODE
    n_sde = len(sde_steps(args.num_steps, args.sde_window, args.window_shift_every, 0))
    n_train = max(1, int(n_sde * args.timestep_fraction))
    lines = [
        f"{world} processes x {args.samples_per_device} samples = {prompts_per_iter} prompts x group {args.group_size}",
        f"{args.num_steps} steps, {n_sde} SDE ({args.sde_type} noise {args.noise_level}), {n_train} of them trained",
        f"micro-batch {args.rollout_batch_size}, {updates_per_iter} optimizer steps / iteration",
        f"objective {args.objective}, clip {args.clip_range}, advantages within +-{args.adv_clip_max}, KL beta "
        f"{args.kl_beta}" + (f", KL mask {args.kl_mask_threshold}" if args.objective == "dppo" else ""),
        *([f"EMA for evaluation and final/, max decay {args.ema_max_decay}"] if args.ema else []),
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
        # keyed noise, drawn on the CPU and moved to the device chunk by chunk; --same-noise: one per prompt group
        noise_ids = [k // args.group_size if args.same_noise else k for k in global_idx]
        init = torch.stack([keyed_randn(latent_shape, args.seed, it, "init", k) for k in noise_ids])
        step_noise = torch.stack(
            [keyed_randn((args.num_steps, *latent_shape), args.seed, it, "sde", k) for k in global_idx]
        )
        sde_idx = sde_steps(args.num_steps, args.sde_window, args.window_shift_every, it)
        flash = args.ode_solver == "dpm2"  # MixGRPO-Flash: a coarser grid after the window, DPM-Solver++(2M) on it
        grid = post_window_sigmas(sigmas, args.shift, sde_idx[-1], args.post_window_compress) if flash else sigmas
        cond = model.encode_prompts(my_prompts)
        chunks = []  # one dict per rollout chunk: cond, latents (B, T + 1, *L), log_probs (B, T), means (B, T, *L)
        denoiser.eval()
        for c in range(0, args.samples_per_device, args.rollout_batch_size):
            sl = slice(c, c + args.rollout_batch_size)
            cond_c = {k: v[sl] for k, v in cond.items()}
            latents, log_probs, means = rollout(
                model, denoiser, cond_c, init[sl].to(device), step_noise[sl], grid, g, sde_idx, args.guidance_scale,
                autocast, policy_step, dpm_after=sde_idx[-1] if flash else None,
            )  # fmt: skip
            with torch.no_grad():  # the chunk's rewards asked now: a served reward answers while the next one samples
                request = reward_fn.request(model.decode(latents[:, -1]).float(), my_prompts[sl])  # collect() scores it
            chunks.append(
                {"cond": cond_c, "latents": latents, "log_probs": log_probs, "means": means, "request": request}
            )
        t_sample = time.perf_counter() - run.t_iter

        # ------------------------------------------------------------ REWARDS & ADVANTAGES
        rewards, parts = reward_fn.collect([ch["request"] for ch in chunks])  # (S,), each component's (S,)
        all_rewards = accelerator.gather(rewards.float().to(device))  # (world * S,) in global sample order
        parts = {k: accelerator.gather(v.float().to(device)) for k, v in parts.items()}
        per_reward = args.advantage_aggregation == "per-reward"
        scores, weights = (parts, reward_fn.weights) if per_reward else ({"sum": all_rewards}, {"sum": 1.0})
        all_adv = combined_advantages(
            scores, weights, group_size=args.group_size, adv_clip_max=args.adv_clip_max
        )  # (world * S,)
        adv = all_adv[rank * args.samples_per_device : (rank + 1) * args.samples_per_device]

        # ------------------------------------------------------------ TRAINING
        model.park(), reward_fn.park()  # --offload-frozen: the VAE and the reward models leave the GPU
        denoiser.train()
        n_train = max(1, int(len(sde_idx) * args.timestep_fraction))
        stats = defaultdict(list)  # each figure policy_loss returns, one tensor per trained step and chunk
        for u in range(updates_per_iter):
            for ci in range(u * micro_per_update, (u + 1) * micro_per_update):
                ch, sl = chunks[ci], slice(ci * args.rollout_batch_size, (ci + 1) * args.rollout_batch_size)
                # trained steps of this chunk: a random subset of its SDE steps (DanceGRPO: per sample, here per chunk)
                first_k = ci * args.rollout_batch_size + rank * args.samples_per_device
                order = torch.randperm(len(sde_idx), generator=rng(args.seed, it, "steps", first_k), device="cpu")
                trained = [sde_idx[j] for j in order[:n_train]]  # step indices, drawn from sde_idx
                for j, i in enumerate(trained):
                    last = ci == (u + 1) * micro_per_update - 1 and j == len(trained) - 1
                    x, x_next = ch["latents"][:, i], ch["latents"][:, i + 1]
                    sig = sigmas[i].expand(len(x)).to(device)
                    with accelerator.no_sync(denoiser) if not last else nullcontext():
                        with autocast():
                            v = model.velocity(denoiser, x, sig, ch["cond"], args.guidance_scale)
                        _, log_prob, mean, std = policy_step(
                            x, v.float(), sigmas[i], sigmas[i + 1], g[i], prev_sample=x_next
                        )
                        mean_ref = None
                        if args.kl_beta > 0:
                            with autocast():  # the base model: frozen copy, or LoRA adapter off
                                v_ref = reference_velocity(
                                    model, ref, args.lora, x, sig, ch["cond"], args.guidance_scale
                                )
                            _, _, mean_ref, _ = policy_step(
                                x, v_ref.float(), sigmas[i], sigmas[i + 1], g[i], prev_sample=x_next
                            )
                        loss, figures = policy_loss(
                            log_prob, ch["log_probs"][:, i], adv[sl], mean, ch["means"][:, i], mean_ref, std,
                            sigmas[i] - sigmas[i + 1], objective=args.objective, clip_range=args.clip_range,
                            kl_mask_threshold=args.kl_mask_threshold, kl_beta=args.kl_beta,
                        )  # fmt: skip
                        accelerator.backward(loss.mean() / (micro_per_update * len(trained)))
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
        log = {
            **reward_stats(all_rewards, parts),
            "advantages/zero_std_groups": (all_rewards.view(-1, args.group_size).std(1) == 0).float().mean().item(),
            **summarize(stats, "losses/"),  # every figure of policy_loss
            "losses/first_ratio_max_dev": stats["ratio_max_dev"][0].item(),  # 0: the first ratio is exactly 1
            "charts/window_start": sde_idx[0],
            # NFE = number of function evaluations: denoiser forwards per image (rollout + trained steps)
            "perf/nfe_per_image": len(grid) - 1 + n_train * (2 if args.kl_beta > 0 else 1),
            "perf/trained_steps_per_image": n_train,
            "perf/sampling_s": t_sample,
            "perf/reward_wait_s": reward_fn.wait_s,
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
