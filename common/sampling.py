"""The sigma schedule and the deterministic sampling that evaluation shares: the scripts' Evaluator
(common/runs.py) and ShapesBench's eval command (`python -m common.shapesbench eval`) draw the same noise through the
same sampler, so a model gets one held-out figure from both.

The training scripts keep their own readable copies of the schedule (and of their stochastic samplers); blocks
marked `# same as in X.py` are checked against X's by scripts/check.py.
"""

from __future__ import annotations

import contextlib
import hashlib
from functools import partial

import torch


def sigma_schedule(num_steps: int, shift: float) -> torch.Tensor:  # same as in dancegrpo.py
    """linspace(1, 0, T + 1) warped by s' = k s / (1 + (k - 1) s) (SD3 shift); shape (T + 1,)."""
    s = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)  # cpu: read as 0-dim scalars or moved with .to()
    return (shift * s / (1 + (shift - 1) * s)).float()


def schedule(model, num_steps: int, shift) -> torch.Tensor:
    """The grid (T + 1,) of --shift: sigma_schedule's for a number, the model's own diffusers pipeline's for
    'pipeline' (FlowModel.sigmas)."""
    return model.sigmas(num_steps) if shift == "pipeline" else sigma_schedule(num_steps, shift)


def keyed_generator(*keys) -> torch.Generator:
    """A CPU generator seeded by a stable hash of `keys`, e.g. (seed, iteration, "noise", sample_index): the scripts'
    rng(). Keyed draws depend on neither the process count nor the batch size, so resumed and multi-process runs
    repeat them exactly."""
    digest = hashlib.sha256(repr(keys).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def keyed_randn(shape, *keys) -> torch.Tensor:
    """Standard normal noise of `shape` from keyed_generator(*keys), on the CPU (the caller moves it to its device):
    the same numbers whatever the process count, the batch size or a resume."""
    return torch.randn(shape, generator=keyed_generator(*keys), device="cpu")


def fixed_noise(seed: int, tag: str, shape, start: int, n: int) -> torch.Tensor:
    """Initial noise of samples start..start + n - 1, (n, *shape), each keyed on (seed, tag, index): the same
    whatever the batching. tag 'eval' is the held-out evaluation's, 'grid' the sample grid's."""
    return torch.stack([keyed_randn(shape, seed, tag, start + j) for j in range(n)])  # sample_prompts() moves them


@torch.no_grad()
def sample_ode(model, transformer, cond, noise, sigmas, guidance_scale, autocast=contextlib.nullcontext):
    """Deterministic Euler samples of a flow model along `sigmas`: noise (B, *L) -> images (B, 3, H, W) (videos:
    (B, F, 3, H, W))."""
    x = noise
    for i in range(len(sigmas) - 1):
        with autocast():
            v = model.velocity(transformer, x, sigmas[i].expand(len(x)).to(x.device), cond, guidance_scale)
        x = x + (sigmas[i + 1] - sigmas[i]) * v.float()
    return model.decode(x).float()


def ode_sampler(model, transformer, sigmas, guidance_scale, autocast):
    """`sampler(cond, noise) -> images` for the Evaluator: sample_ode along `sigmas` with the training module."""
    return partial(sample_ode, model, transformer, sigmas=sigmas, guidance_scale=guidance_scale, autocast=autocast)


def sample_prompts(sampler, model, prompts: list[str], noise: torch.Tensor, batch_size: int, progress=iter):
    """Images (N, 3, H, W) (videos (N, F, 3, H, W)) of `prompts` from `noise` (N, *L), `batch_size` at a time through `sampler(cond, noise)`
    (a VAE decode at 720 px needs most of a GB per image: docs/gpu.md); `progress` wraps the batch starts."""
    starts = range(0, len(prompts), batch_size)
    return torch.cat(
        [
            sampler(model.encode_prompts(prompts[i : i + batch_size]), noise[i : i + batch_size].to(model.device))
            for i in progress(starts)
        ]
    )
