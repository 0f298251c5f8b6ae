# RLR (Recursive Likelihood Ratio optimizer): docs/rlr.md; paper: arXiv 2502.00639 (ICLR 2026 oral)
"""Half-order fine-tuning of a text-to-image diffusion / flow model with the RLR gradient estimator, one file.

The sampler is a chain of Gaussian transitions from noise x_0 to the sample x_T (the paper counts the other way:
its step t is our step T - t):
    x_{i+1} = mu_i(x_i; theta_i) + s_i z_i,   z_i ~ N(0, I),   i = 0 .. T-1,   s_{T-1} = 0 (deterministic last step),
the flow SDE of dancegrpo.py for flow models (ShapesBench, FLUX.1, SD3.5) and DDIM with eta > 0 for SD1.x/2.x.
Every rollout chunk draws a window start j (uniform over the allowed starts, independent of everything else), which
splits the steps in three; each group gets an estimator that is unbiased for exactly its steps' share of
grad_theta E[R(decode(x_T))], and the three are added with unit weights (per sample, then averaged); FO / HO / ZO =
first / half / zero order, sg = stop-gradient:
    FO  step T-1:           grad_theta R(decode(mu_{T-1}(sg(x_{T-1}); theta)))       backprop: last step, decoder, reward
    HO  steps j..j+h-1:     (R - b) (d m / d theta)^T z_{j+h-1} / s_{j+h-1}
                            m = mean of x_{j+h} from the h-step rollout of means started at sg(x_j), the window's inner
                            noises held fixed: backprop through h denoiser calls, cut at x_j, likelihood-ratio weight
                            on the sampler noise at the window's end (= (R - b) grad_theta log N(x_{j+h}; m, s^2 I))
    ZO  all other steps C:  sum_{i in C} (R - b') zeta_i / sigma^2, where the rollout ran step i with the parameters
                            theta + zeta_i, zeta_i ~ N(0, sigma^2 I) (Gaussian smoothing; --zo-scale sigma), one zeta_i
                            per step and perturbation block (--zo-perturbations), regenerated from its seed (MeZO: Malladi et al. 2023, arXiv 2305.17333)
Baselines keep it unbiased: b = mean reward of the other samples of the prompt (independent of this sample's z);
b' = mean reward of the prompt's samples in other perturbation blocks (independent of this block's zetas).
The objective is that of the chain actually sampled (ZO steps perturbed: eq. 1), O(sigma^2) from the unperturbed
one; tests/test_rlr.py checks unbiasedness against a linear-Gaussian chain's closed-form gradient.

Launch (run.sh has more):
    python rlr.py                                                    # ShapesBench on CPU: the paper's V2, see below
    python rlr.py --terms fo+ho+zo --subchain-stage any              # RLR's full, unbiased estimator (eq. 6)
    PROMPTS=prompts.txt bash run.sh rlr-sd15-8gpu                   # SD1.5, LoRA r4, 8 GPUs; docs/gpu.md: all of them
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 rlr.py --samples-per-device 4  # 2 CPU processes
    python rlr.py --resume-from latest                               # continue the newest runs/rlr__*

Deviations from the public code (it has neither the sub-chain nor the ZO term; docs/rlr.md explains each): 1. eq. 6
with unit weights and unbiased baselines; 2. one optimizer step per iteration on the terms' sum (--terms: ablations
V1 = fo, V2 = fo+ho, V3 = fo+zo); 3. the log-density summed over latent dimensions; 4. a uniform window start;
5. DDIM's last step lands on x0_hat; 6. randomness keyed on (seed, iteration, sample / chunk / block). The default is
V2 in the DCoT stage coarse: at ShapesBench's LoRA size the ZO term's noise drowns the full estimator's signal.
"""

from __future__ import annotations

import hashlib
import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Callable, Literal, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed

from common.evaluator import Evaluator
from common.flags import Ge, Gt, Le, Lt, ModeDefault, RunArgs, check_flags, check_run_args, cli, divides, need
from common.logs import reward_stats, summarize
from common.models import check_model_id, load_model, trainable_denoiser
from common.prompts import draw_prompts, load_dcot
from common.rewards import RewardSpec, build_reward, check_reward_prompts
from common.runs import Run, all_finite
from common.sampling import keyed_generator as rng  # (seed, iteration, ...) -> a generator
from common.sampling import keyed_randn


@dataclass
class Args(RunArgs):  # the shared flags (--model-id, --reward, --iterations, ...) are in common/flags.py
    num_steps: Annotated[int, Ge(2), Le(1000)] = 10
    """sampling steps T of a rollout (shifted sigma schedule for flow models, DDIM timesteps for SD1.x)"""
    sde_type: Literal["dance", "flow"] = "flow"
    """flow models' noise schedule g(sigma): 'dance' = constant eta, 'flow' = a sqrt(sigma / (1 - sigma)); unused for SD1.x"""
    noise_level: Annotated[
        Optional[float], ModeDefault("0.3 with --sde-type dance, 0.7 with flow, 1.0 for SD1.x"), Gt(0), Le(10)
    ] = None
    """eta for 'dance', a for 'flow', DDIM eta for SD1.x (at most 10, ten times the published values: beyond, noise
    drowns the sample)"""
    group_size: Annotated[int, Ge(2), Le(65536)] = 4  # counts of images: at most 2**16, far above any GPU's batch
    """images per prompt; the others' mean reward is each sample's baseline (a group may span processes)"""
    learning_rate: Annotated[float, Gt(0), Le(1)] = 1.2e-3
    """AdamW learning rate (constant after --lr-warmup); 4x the shared ShapesBench default (docs/rlr.md says why)"""
    samples_per_device: Annotated[int, Ge(1), Le(65536)] = 32
    """images sampled per process per iteration; prompts per iteration = processes * this / group size"""
    rollout_batch_size: Annotated[int, Ge(1), Le(65536)] = 4
    """images per denoiser forward; also the unit that shares one sub-chain window"""
    subchain_len: Annotated[Optional[int], ModeDefault("2, the paper's"), Ge(1), Le(999)] = None
    """h, the number of denoising steps back-propagated in the half-order sub-chain (at most --num-steps - 1)"""
    memory_budget_gb: Annotated[Optional[float], Gt(0), Le(1e6)] = None
    """choose h by the paper's h* rule for this memory budget instead of --subchain-len"""
    ho_step_gb: Annotated[float, Ge(1e-6), Le(1e6)] = 8.0  # a kilobyte to a petabyte: h* stays a finite number
    """B_h of the h* rule: memory of one back-propagated step (8 GB for SD1.4, paper Table 9)"""
    zo_step_gb: Annotated[float, Ge(1e-6), Le(1e6)] = 0.24
    """B_z of the h* rule: memory of one zero-order step (0.24 GB for SD1.4, paper Table 9)"""
    variance_ratio: Annotated[float, Ge(0), Lt(1)] = 0.0
    """V_h / V_z of the h* rule (per-step variance of HO over ZO; 0 = negligible, as the paper assumes)"""
    subchain_stage: Literal["any", "coarse", "medium", "fine"] = "coarse"
    """window starts allowed: anywhere, or in the first / middle / last third of the steps (diffusion chain of thought)"""
    dcot_prompts: Optional[str] = None
    """diffusion chain-of-thought prompt file (TSV: prompt, coarse, medium, fine); replaces --prompts"""
    zo_scale: Annotated[float, Gt(0), Le(1)] = 1e-3
    """sigma, std of the Gaussian parameter perturbation zeta_i of the zero-order steps (at most 1: a perturbation of
    that size already swamps the trained weights)"""
    zo_perturbations: Annotated[Optional[int], ModeDefault("one per rollout chunk"), Ge(1), Le(65536)] = None
    """independent parameter perturbations per process and iteration (samples split into that many blocks)"""
    terms: Literal["fo+ho+zo", "fo+ho", "fo+zo", "fo"] = "fo+ho"
    """estimator terms: fo+ho+zo = RLR (unbiased); the paper's ablations fo+ho = V2 (biased), fo+zo = V3
    (unbiased, every step but the last is ZO), fo = V1 (one-step truncated backprop, AlignProp K=1; biased)"""


# ---------------------------------------------------------------------------------------------------
# ALGO LOGIC: schedules and Gaussian transitions
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


def sde_step(x, v, sigma, sigma_next, g, prev_sample=None, noise=None):  # same as in dancegrpo.py
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


def ddim_step(x, eps, alpha, alpha_prev, eta):
    """Mean and std of one DDIM step (Song et al. eq. 12, DDPO's form) from alpha = alphabar_t to alpha_prev.

    x0_hat = (x - sqrt(1 - a) eps) / sqrt(a), std = eta sqrt((1 - a_prev) / (1 - a) (1 - a / a_prev)),
    mean = sqrt(a_prev) x0_hat + sqrt(1 - a_prev - std^2) eps. eta = 0 is deterministic DDIM."""
    alpha, alpha_prev = (torch.as_tensor(a, dtype=x.dtype, device=x.device) for a in (alpha, alpha_prev))
    x0_hat = (x - (1 - alpha).sqrt() * eps) / alpha.sqrt()
    std = eta * ((1 - alpha_prev) / (1 - alpha) * (1 - alpha / alpha_prev)).clamp(min=0).sqrt()
    mean = alpha_prev.sqrt() * x0_hat + (1 - alpha_prev - std**2).clamp(min=0).sqrt() * eps
    return mean, std.to(x.device)


def make_schedule(model, num_steps: int, noise_level: float, shift=3.0, sde_type="flow", stochastic=True) -> dict:
    """Per-step constants of the sampler. Flow: sigmas (T + 1,), g (T,). DDIM: timesteps t, alphabar a and a_prev,
    eta (T,), "leading" spacing with the scheduler's steps_offset as diffusers; the last step is always
    deterministic (g = eta = 0) and DDIM's lands on x0_hat (a_prev = 1). stochastic=False: an ODE / DDIM(eta=0)."""
    if model.kind == "sd1":
        ac = model.alphas_cumprod.double()
        ratio = len(ac) // num_steps
        offset = model.pipe.scheduler.config.get("steps_offset", 0)
        t = torch.arange(num_steps - 1, -1, -1, device=ac.device) * ratio + offset
        prev = t - ratio
        a_prev = torch.where(prev >= 0, ac[prev.clamp(min=0)], torch.ones((), dtype=ac.dtype, device=ac.device))
        eta = torch.full((num_steps,), noise_level if stochastic else 0.0, device=ac.device)
        eta[-1] = 0
        return {"t": t, "a": ac[t].float(), "a_prev": a_prev.float(), "eta": eta}
    sigmas = model.sigmas(num_steps) if shift == "pipeline" else sigma_schedule(num_steps, shift)
    g = noise_g(sigmas, sde_type, noise_level) if stochastic else torch.zeros(num_steps, device=sigmas.device)
    g[-1] = 0
    return {"sigmas": sigmas, "g": g}


def transition(model, module, sched: dict, i: int, x, cond, guidance_scale: float, autocast):
    """Gaussian step i of the sampler: (mean (B, *L), std) of x_{i+1} given x_i, differentiable w.r.t. `module`."""
    n = len(x)
    if model.kind == "sd1":
        with autocast():
            eps = model.eps(module, x, sched["t"][i].expand(n).to(x.device), cond, guidance_scale)
        return ddim_step(x, eps.float(), sched["a"][i], sched["a_prev"][i], sched["eta"][i])
    sigma, sigma_next, g = sched["sigmas"][i], sched["sigmas"][i + 1], sched["g"][i]
    with autocast():
        v = model.velocity(module, x, sigma.expand(n).to(x.device), cond, guidance_scale)
    v = v.float()
    if g == 0:  # Euler (ODE) step
        return x + (sigma_next - sigma) * v, torch.zeros((), device=x.device)
    _, _, mean, std = sde_step(x, v, sigma, sigma_next, g, prev_sample=x)
    return mean, std


def stage_of(i: int, num_steps: int) -> int:
    """0 / 1 / 2 = coarse / medium / fine: the first, middle and last third of the steps (from the noise end)."""
    return min(3 * i // num_steps, 2)


# ---------------------------------------------------------------------------------------------------
# ALGO LOGIC: the RLR estimator, on any chain of Gaussian steps mean_std(i, x) -> (mean, std)
# ---------------------------------------------------------------------------------------------------
def optimal_subchain_len(budget_gb, num_steps, ho_step_gb, zo_step_gb, variance_ratio=0.0) -> int:
    """The paper's h* (eq. 8): min(floor((B - B_z (T - 1)) / (B_h - B_z)), floor(T V_z / (2 (V_z - V_h)) - 1)),
    with V_h = variance_ratio V_z, capped at T - 1 (the window must end before the FO step). May be < 1."""
    by_memory = math.floor((budget_gb - zo_step_gb * (num_steps - 1)) / (ho_step_gb - zo_step_gb) + 1e-9)
    by_variance = math.floor(num_steps / (2 * (1 - variance_ratio)) - 1 + 1e-9)
    return min(by_memory, by_variance, num_steps - 1)


def window_starts(num_steps: int, h: int, stage: str = "any") -> list[int]:
    """Allowed sub-chain starts j: the window j..j+h-1 must end before the last (FO) step; a stage restricts j
    to its third of the steps (the paper's DCoT: j ~ U(a, b))."""
    starts = range(num_steps - h)
    if stage != "any":
        starts = [j for j in starts if stage_of(j, num_steps) == ("coarse", "medium", "fine").index(stage)]
    return list(starts)


def zo_steps_of(num_steps: int, j: int, h: int) -> list[int]:
    """Steps estimated by ZO: every step but the window j..j+h-1 and the last (FO) step (h = 0: no window)."""
    return [i for i in range(num_steps - 1) if not j <= i < j + h]


def rollout(mean_std: Callable, x, noise, zo_steps=(), perturb: Optional[Callable] = None):
    """Sample the stochastic steps 0..T-2 without a graph. x: (B, *L) = x_0, noise: (B, T - 1, *L) the z_i.

    Steps in `zo_steps` run inside `perturb(i)` (parameters theta + zeta_i). Returns latents (B, T, *L) fp32:
    x_0 .. x_{T-1}, the last one the input of the deterministic FO step."""
    latents = [x]
    with torch.no_grad():
        for i in range(noise.shape[1]):
            with perturb(i) if i in zo_steps else nullcontext():
                mean, std = mean_std(i, x)
            x = mean + std * noise[:, i]
            latents.append(x)
    return torch.stack(latents, 1)


def subchain_log_prob(mean_std: Callable, latents, noise, j: int, h: int):
    """HO window: recompute steps j..j+h-1 with a graph from the constant x_j, inner noises z_j..z_{j+h-2} fixed.

    Returns (log N(x_{j+h}; m, s^2 I) summed over latent dimensions (B,), max |m - rollout's mean|). The gradient
    of (R - b) * log_prob is (R - b) (dm / dtheta)^T z_{j+h-1} / s: the HO term. The second value is 0 when the
    recomputation reproduces the rollout (an on-policy check)."""
    x = latents[:, j].detach()
    for k in range(j, j + h):
        mean, std = mean_std(k, x)
        if k < j + h - 1:
            x = mean + std * noise[:, k]
    target = latents[:, j + h]
    std = torch.as_tensor(std, dtype=mean.dtype, device=mean.device)
    log_prob = -((target - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    deviation = (mean.detach() + std * noise[:, j + h - 1] - target).abs().max()
    return log_prob.flatten(1).sum(1), deviation


def loo_baseline(rewards, group_size: int):
    """Leave-one-out group mean: each sample's baseline is the mean reward of the other G - 1 samples of its group
    (consecutive blocks of G in global order); independent of the sample's own noise. (N,) -> (N,)."""
    R = rewards.view(-1, group_size).double()
    return ((R.sum(1, keepdim=True) - R) / (group_size - 1)).flatten().to(rewards.dtype)


def zo_baseline(rewards, group_size: int, block):
    """ZO baseline of each sample: mean reward of its group's samples in *other* perturbation blocks, else of all
    samples in other blocks, else 0; never uses the sample's own block, so it is independent of its zetas.
    rewards (N,), block (N,) long -> (N,)."""
    n = len(rewards)
    group = torch.arange(n, device=rewards.device) // group_size
    R = rewards.double()
    n_g, n_b = int(group.max()) + 1, int(block.max()) + 1
    gb_sum = torch.zeros(n_g, n_b, dtype=R.dtype, device=R.device).index_put_((group, block), R, accumulate=True)
    gb_cnt = torch.zeros_like(gb_sum).index_put_((group, block), torch.ones_like(R), accumulate=True)
    same_sum, same_cnt = gb_sum.sum(1)[group] - gb_sum[group, block], gb_cnt.sum(1)[group] - gb_cnt[group, block]
    all_sum, all_cnt = R.sum() - gb_sum.sum(0)[block], n - gb_cnt.sum(0)[block]
    out = torch.where(
        same_cnt > 0,
        same_sum / same_cnt.clamp(min=1),
        torch.where(all_cnt > 0, all_sum / all_cnt.clamp(min=1), torch.zeros_like(R)),
    )
    return out.to(rewards.dtype)


def term_weights(rewards, block, zo_mask, n_blocks: int, *, group_size):
    """The weights that combine the terms (eq. 6), with baselines that keep each unbiased, for all N samples in global
    order: HO, R - b per sample (loo_baseline; the loss averages it over the samples); ZO, coef[q, i] = the sum over
    the samples of block q whose step i was a ZO step of (R - b') / N (zo_baseline), the weight of zeta_qi / sigma^2.
    The FO term is each reward's own gradient / N. rewards (N,), block (N,) long, zo_mask (N, T) bool -> (R - b (N,),
    R - b' (N,), coef (n_blocks, T), figures: logged as rlr/<name>). A fork changes the estimator's weighting here, in
    one place."""
    w_ho, w_zo = rewards - loo_baseline(rewards, group_size), rewards - zo_baseline(rewards, group_size, block)
    coef = torch.zeros(n_blocks, zo_mask.shape[1], dtype=w_zo.dtype, device=w_zo.device)
    coef.index_add_(0, block, (w_zo / len(rewards))[:, None] * zo_mask.to(w_zo.dtype))
    figures = {  # the mean size of each term's weight (0 for a term not in use)
        "ho_adv_abs": w_ho.abs().mean(),
        "zo_adv_abs": w_zo.abs().mean() if zo_mask.any() else torch.zeros((), device=w_zo.device),
    }
    return w_ho, w_zo, coef, figures


def zo_noise(params, seed: int, scale: float) -> list[torch.Tensor]:
    """zeta ~ N(0, scale^2 I) shaped like `params`, drawn on their device from one generator seeded by `seed`, so
    it can be regenerated for the gradient instead of stored (MeZO)."""
    gen = torch.Generator(device=params[0].device).manual_seed(seed)
    return [scale * torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) for p in params]


@contextmanager
def perturbed(params, zeta):
    """Run the body with theta + zeta, then restore theta exactly (a copy, not a subtraction)."""
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, z in zip(params, zeta):
            p.add_(z)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


def add_zo_grad(params, zeta, coef, scale: float) -> None:
    """Accumulate the ZO term into .grad, minimisation convention: grad -= coef * zeta / scale^2
    (coef a scalar, or a tensor that broadcasts against zeta, e.g. one row per chain in tests)."""
    for p, z in zip(params, zeta):
        g = -(coef * z) / scale**2
        p.grad = g.to(p.dtype) if p.grad is None else p.grad.add_(g.to(p.dtype))


def key_seed(*keys) -> int:
    """A 63-bit seed from a stable hash of `keys` (as rng(), for generators on any device)."""
    return int.from_bytes(hashlib.sha256(repr(keys).encode()).digest()[:8], "little") & (2**63 - 1)


def staged_transition(
    model, module, sched: dict, conds: list[dict], num_steps: int, guidance_scale: float, autocast, i: int, x
):
    """mean_std(i, x) of the rollout: the step-i transition conditioned on the stage's prompt (DCoT: coarse, medium,
    fine thirds of the chain; else the prompt three times)."""
    return transition(model, module, sched, i, x, conds[stage_of(i, num_steps)], guidance_scale, autocast)


def zo_perturbed(params, key: tuple, scale: float, i: int):
    """perturb(i): a context with theta + zeta_{q, i}, the ZO perturbation of block q (in key) at step i."""
    return perturbed(params, zo_noise(params, key_seed(*key, i), scale))


def sample_images(model, module, sched, cond, noise, guidance_scale, autocast):
    """Deterministic samples (Euler ODE, or DDIM with eta 0) for evaluation and grids; noise (B, *L) -> (B, 3, H, W).
    Adapted from common/sampling.py's sample_ode (any sampler of this file)."""
    x = noise
    for i in range(len(sched["eta" if model.kind == "sd1" else "g"])):
        x, _ = transition(model, module, sched, i, x, cond, guidance_scale, autocast)
    return model.decode(x).float()


def grad_norm(params) -> float:
    """The L2 norm of the accumulated gradients of this process (unclipped, fp64)."""
    return math.sqrt(sum(float(p.grad.double().square().sum()) for p in params if p.grad is not None))


# ---------------------------------------------------------------------------------------------------
# Flag checks: the mode's defaults, then every flag, before a model loads (the shared flags are in common/flags.py)
# ---------------------------------------------------------------------------------------------------
MODE_FLAGS = [  # a flag of another mode is an error unless left at its default (no dead flags)
    *[(f, lambda a: a.memory_budget_gb is not None, "--memory-budget-gb") for f in ("ho_step_gb", "zo_step_gb", "variance_ratio")],
    *[(f, lambda a: "ho" in a.terms, "--terms with ho") for f in ("subchain_len", "memory_budget_gb", "subchain_stage")],
    *[(f, lambda a: "zo" in a.terms, "--terms with zo") for f in ("zo_scale", "zo_perturbations")],
]  # fmt: skip


def resolve_and_check(args: Args) -> tuple[list[str], list[str], RewardSpec]:
    """The mode's defaults filled in, this script's flags and the shared ones (common/flags.py) checked: a bad flag is
    one `error:` line naming it (those that need the process count: in main()). Returns check_run_args's."""
    check_flags(args, MODE_FLAGS)  # floats finite, every flag in its declared range, no dead flags
    need(
        args.ho_step_gb > args.zo_step_gb,
        "--ho-step-gb must be > --zo-step-gb: the h* rule divides by their difference",
    )
    if args.memory_budget_gb is not None:  # h* from the flags just checked
        need(args.subchain_len is None, "give --subchain-len or --memory-budget-gb, not both")
        args.subchain_len = optimal_subchain_len(
            args.memory_budget_gb, args.num_steps, args.ho_step_gb, args.zo_step_gb, args.variance_ratio
        )
    elif args.subchain_len is None:
        args.subchain_len = min(2, args.num_steps - 1)
    if args.zo_perturbations is None:
        args.zo_perturbations = args.samples_per_device // args.rollout_batch_size  # one per rollout chunk
    args.exp_name = args.exp_name or Path(__file__).stem  # a fork: its own name
    if args.noise_level is None:  # the model's kind from its model_index.json, before it loads
        sd1 = check_model_id(args.model_id) == "sd1"
        args.noise_level = 1.0 if sd1 else 0.3 if args.sde_type == "dance" else 0.7
    T, h, S = args.num_steps, args.subchain_len, args.samples_per_device
    B, n_blocks = args.rollout_batch_size, args.zo_perturbations
    if "ho" in args.terms:
        budget = f" (h* of --memory-budget-gb {args.memory_budget_gb})" if args.memory_budget_gb is not None else ""
        need(1 <= h <= T - 1, f"h = {h}{budget}: --subchain-len must be in [1, {T - 1}] (= --num-steps - 1)")
        need(
            window_starts(T, h, args.subchain_stage),
            f"--subchain-stage {args.subchain_stage}: no window of {h} steps (--subchain-len) starts in that third of "
            f"--num-steps {T} and ends before the last step",
        )
    need(divides(B, S), "--samples-per-device must be a multiple of --rollout-batch-size")
    need(
        divides(n_blocks, S) and divides(B, S // n_blocks),
        "--zo-perturbations must divide --samples-per-device into blocks that are multiples of --rollout-batch-size",
    )
    # RLR's paper trains images; its first-order term backpropagates through the reward
    train_prompts, eval_prompts, reward_spec = check_run_args(args, video=False, differentiable=True)
    if args.dcot_prompts is not None:
        need(args.prompts == "shapes-train", "--dcot-prompts replaces --prompts: give one of them")
        train_prompts = list(load_dcot(args.dcot_prompts))
        check_reward_prompts(reward_spec, train_prompts, "--dcot-prompts")  # as check_run_args checks --prompts
    return train_prompts, eval_prompts, reward_spec


def main(args: Args):
    # ---------------------------------------------------------------- SETUP
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    world, rank = accelerator.num_processes, accelerator.process_index
    inputs = resolve_and_check(args)  # flags checked, prompts read, --reward parsed, before any model loads
    T, S, B, G = args.num_steps, args.samples_per_device, args.rollout_batch_size, args.group_size
    need(S * world % G == 0, f"--samples-per-device {S} x {world} processes must be a multiple of --group-size {G}")
    need(
        not (accelerator.distributed_type == DistributedType.FSDP and "zo" in args.terms),
        "the ZO term perturbs whole parameter tensors in place, which FSDP shards; use DDP (e.g. --lora and "
        "configs/ddp_8gpu.yaml) or --terms fo+ho",
    )
    run = Run(args, accelerator, f"RLR, terms {args.terms}")
    set_seed(args.seed)  # LoRA init and anything else not keyed through rng()
    device, autocast = accelerator.device, accelerator.autocast
    frozen_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    n_blocks = args.zo_perturbations  # perturbation blocks per process
    use_ho, use_zo = "ho" in args.terms, "zo" in args.terms
    h = args.subchain_len if use_ho else 0  # h = 0: no window (ablations V1, V3)
    N, prompts_per_iter = world * S, world * S // G  # samples and prompts per iteration, all processes
    n_chunks = S // B  # rollout chunks per process; global chunk gc = rank * n_chunks + c: samples [gc B, (gc + 1) B)
    chunks_per_block = S // n_blocks // B  # chunks sharing one parameter perturbation

    # ---------------------------------------------------------------- MODELS
    model = load_model(args.model_id, device, frozen_dtype, args.resolution, offload=args.offload_frozen)
    denoiser = trainable_denoiser(model, args)  # trained in fp32: all weights, or a LoRA adapter (--lora)

    # ---------------------------------------------------------------- PROMPTS & REWARDS
    train_prompts, eval_prompts, reward_spec = inputs
    dcot = load_dcot(args.dcot_prompts) if args.dcot_prompts else None
    reward_fn = build_reward(reward_spec, device, args.offload_frozen)

    # ---------------------------------------------------------------- OPTIMIZER
    params = [p for p in denoiser.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    denoiser, optimizer = accelerator.prepare(denoiser, optimizer)
    denoiser.eval()  # no dropout anywhere: the sampled and the differentiated policy must be the same function

    # ---------------------------------------------------------------- RESUME, EVALUATOR, BANNER
    start = run.resume()  # 0, or the iteration of the --resume-from checkpoint (weights, optimizer, RNG, counters)
    sched = make_schedule(model, T, args.noise_level, args.shift, args.sde_type)
    latent_shape = model.latent_shape()
    starts = window_starts(T, h, args.subchain_stage) if use_ho else [0]
    eval_sched = make_schedule(model, args.eval_steps, args.noise_level, args.shift, args.sde_type, stochastic=False)
    sampler = partial(sample_images, model, denoiser, eval_sched, guidance_scale=args.guidance_scale, autocast=autocast)
    eval_batch = max(B, 16) if model.kind == "shapes" else B  # (CPU ShapesBench: batch up)
    evaluate = Evaluator(args, model, denoiser, reward_fn, eval_prompts, run, eval_batch, sampler)
    noise = f"{'DDIM eta' if model.kind == 'sd1' else args.sde_type + ' SDE noise'} {args.noise_level}"
    variant = {"fo+ho+zo": "RLR", "fo+ho": "ablation V2", "fo+zo": "ablation V3", "fo": "ablation V1"}[args.terms]
    h_star = f" (h* for {args.memory_budget_gb} GB)" if args.memory_budget_gb is not None else ""
    lines = [
        f"{world} processes x {S} samples = {N} images / iteration = {prompts_per_iter} prompts x group {G}",
        f"{T} steps ({noise}), terms {args.terms} ({variant}, {'un' if use_zo else ''}biased)"
        + (", DCoT prompts" if dcot else ""),
        f"sub-chain h = {h}{h_star}, window starts {starts[0]}..{starts[-1]} ({args.subchain_stage})" if use_ho else "",
        f"ZO: {n_blocks} perturbation block(s) per process, scale {args.zo_scale:g}" if use_zo else "",
        f"rollout batch {B}, one optimizer step per iteration",
    ]
    run.banner(model, params, [line for line in lines if line])
    evaluate(start, final=start == args.iterations)  # at the start; resumed: what the interrupted run missed
    for it in run.iterations(start):
        # ------------------------------------------------------------ SAMPLING
        # (with the first-order term: its backward runs per chunk right after the rollout, while the chunk's graph
        # through the last step, the decoder and the reward exists; see TRAINING for the HO and ZO terms)
        # The same prompt draw on every process; process r owns global samples [r S, (r + 1) S), as in dancegrpo.py.
        drawn = draw_prompts(train_prompts, prompts_per_iter, args.seed, it)
        global_idx = range(rank * S, (rank + 1) * S)
        my_prompts = [drawn[k // G] for k in global_idx]
        # keyed noise, drawn on the CPU and moved to the device chunk by chunk
        init = torch.stack([keyed_randn(latent_shape, args.seed, it, "init", k) for k in global_idx])
        step_noise = torch.stack([keyed_randn((T - 1, *latent_shape), args.seed, it, "sde", k) for k in global_idx])
        cond = model.encode_prompts(my_prompts)
        # conditioning per stage (coarse, medium, fine): the DCoT prompts, else the prompt itself three times
        conds = [model.encode_prompts([dcot[p][s] for p in my_prompts]) for s in range(3)] if dcot else [cond] * 3
        # every global chunk's window start j and perturbation block (global chunks,), drawn identically on every process
        j_of = [
            starts[int(torch.randint(len(starts), (1,), generator=rng(args.seed, it, "window", gc), device="cpu"))]
            for gc in range(world * n_chunks)
        ]
        block_of = torch.arange(world * n_chunks) // chunks_per_block  # cpu: read by int(), or moved with .to(device)
        chunks, rewards, parts = [], [], []
        for c in range(n_chunks):
            gc, sl = rank * n_chunks + c, slice(c * B, (c + 1) * B)
            conds_c = [{k: v[sl] for k, v in cd.items()} for cd in conds]
            # (i, x) -> the mean and std of step i; (i) -> a context with this block's ZO perturbation of step i
            mean_std = partial(staged_transition, model, denoiser, sched, conds_c, T, args.guidance_scale, autocast)
            perturb = partial(zo_perturbed, params, (args.seed, it, "zo", int(block_of[gc])), args.zo_scale)
            noise_c = step_noise[sl].to(device)
            latents = rollout(
                mean_std, init[sl].to(device), noise_c, zo_steps_of(T, j_of[gc], h) if use_zo else (), perturb
            )
            # FO term: the last (deterministic) step with a graph, the decoder and the reward; x_{T-1} is a constant.
            # All backwards but the iteration's last skip the DDP all-reduce; the last one reduces the sum.
            with accelerator.no_sync(denoiser) if use_ho or c < n_chunks - 1 else nullcontext():
                x_last, _ = mean_std(T - 1, latents[:, -1])
                R, comp = reward_fn(model.decode(x_last).float(), my_prompts[sl])
                accelerator.backward(-R.sum() / S)
            chunks.append({"mean_std": mean_std, "latents": latents, "noise": noise_c, "j": j_of[gc]})
            rewards.append(R.detach())
            parts.append(comp)
        fo_norm = grad_norm(params)  # process-local: the FO term of this process's samples
        model.park(), reward_fn.park()  # --offload-frozen: the FO graphs are gone; VAE and rewards leave the GPU
        t_sample = time.perf_counter() - run.t_iter

        # ------------------------------------------------------------ REWARDS & ADVANTAGES
        all_rewards = accelerator.gather(torch.cat(rewards).float().to(device))  # (N,) in global sample order
        parts = {k: accelerator.gather(torch.cat([p[k] for p in parts]).float().to(device)) for k in parts[0]}
        sample_block = block_of.to(device)[torch.arange(N, device=device) // B]  # (N,)
        zo_mask = torch.zeros(N, T, dtype=torch.bool, device=device)  # (N, T): which steps of each sample were ZO steps
        if use_zo:
            for gc, j in enumerate(j_of):
                zo_mask[gc * B : (gc + 1) * B, zo_steps_of(T, j, h)] = True
        # R - b and R - b' (N,), and the ZO coefficient of every (block, step) (blocks, T)
        w_ho, _, coef, figures = term_weights(
            all_rewards, sample_block, zo_mask, world * n_blocks, group_size=args.group_size
        )
        adv_ho = w_ho[rank * S : (rank + 1) * S]  # this process's samples

        # ------------------------------------------------------------ TRAINING
        # HO term: -(R - b) log N(x_{j+h}; m(theta), s^2) per sample; the last backward all-reduces FO + HO (DDP)
        deviations = [torch.zeros((), device=device)]
        for c, ch in enumerate(chunks if use_ho else []):
            with accelerator.no_sync(denoiser) if c < n_chunks - 1 else nullcontext():
                log_prob, dev = subchain_log_prob(ch["mean_std"], ch["latents"], ch["noise"], ch["j"], h)
                accelerator.backward(-(adv_ho[c * B : (c + 1) * B] * log_prob).sum() / S)
            deviations.append(dev)
        fo_ho_norm = grad_norm(params)
        # ZO term: identical on every process (all blocks' zetas are regenerated from their seeds), added after the all-reduce
        zo_norm = 0.0
        if use_zo:
            before = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
            for q, i in coef.nonzero().tolist():
                add_zo_grad(
                    params,
                    zo_noise(params, key_seed(args.seed, it, "zo", q, i), args.zo_scale),
                    coef[q, i],
                    args.zo_scale,
                )
            zo_norm = math.sqrt(sum(float((p.grad - g).double().square().sum()) for p, g in zip(params, before)))
            del before
        lr = args.learning_rate * min(1.0, (run.optimizer_steps + 1) / max(1, args.lr_warmup))  # linear warmup
        optimizer.param_groups[0]["lr"] = lr  # one group: every trained parameter
        norm = accelerator.clip_grad_norm_(params, args.max_grad_norm)  # before clipping
        if stepped := all_finite(norm, accelerator):  # else skipped on every process
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.count_step(lr, norm, stepped)  # logged at the iteration's end; the warmup and resume count it

        # ------------------------------------------------------------ LOGGING
        log = {
            **reward_stats(all_rewards, parts),
            "rlr/subchain_len": h,
            "rlr/window_start": sum(j_of) / len(j_of),
            "rlr/zo_steps": zo_mask.sum(1).float().mean().item(),
            **summarize(figures, "rlr/"),  # every figure of term_weights
            "rlr/recompute_max_dev": accelerator.gather(torch.stack(deviations).max().reshape(1)).max().item(),
            "grad/fo_norm": fo_norm,
            "grad/fo_ho_norm": fo_ho_norm,
            "grad/zo_norm": zo_norm,
            "perf/nfe_per_image": T + h,
            "perf/sampling_s": t_sample,
        }
        run.end_iteration(it, log, params)  # + gradient norms, timings; metrics.jsonl, TensorBoard, W&B

        # ------------------------------------------------------------ CHECKPOINT
        run.checkpoint(it + 1, final=it + 1 == args.iterations)  # + on SIGTERM / Ctrl-C, then exits

        # ------------------------------------------------------------ EVAL
        evaluate(it + 1, final=it + 1 == args.iterations)

    # ---------------------------------------------------------------- FINAL SAVE
    run.save_final(model, denoiser, args.lora)


if __name__ == "__main__":
    cli(main, Args)
