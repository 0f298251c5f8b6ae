"""How far the default static `--shift` grid is from each model's own pipeline schedule (`--shift pipeline`), at the
recipes' sizes and step counts, with the published checkpoints' scheduler configs (no weights needed).

    OMP_NUM_THREADS=1 python benchmarks/claims/schedules.py

Each pipeline grid is built as its diffusers pipeline builds it (the scheduler's set_timesteps with the pipeline's
sigmas and mu); tests/test_pipeline_schedules.py shows that FlowModel.sigmas gives exactly the stock pipelines' grids.
The static grid is sigma_schedule(T, k): linspace(1, 0, T + 1) under k s / (1 + (k - 1) s). FLUX.2's config is taken
to shift dynamically (exponential), as its pipeline's mu requires; LTX-2.3's is LTX-2's (LTX2 below).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common.sampling import sigma_schedule  # noqa: E402

FLUX1_DEV = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                 max_image_seq_len=4096, shift=3.0)  # fmt: skip
FLUX2 = dict(use_dynamic_shifting=True, time_shift_type="exponential", shift=3.0)
QWEN_IMAGE = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
                  max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")  # fmt: skip
# LTX-2's: the scheduler diffusers' LTX-2 conversion script saves with the pipeline (scripts/convert_ltx2_to_diffusers.py;
# ComfyUI's LTXVScheduler has the same shifts and terminal), taken to be LTX-2.3's; exponential, the default
LTX2 = dict(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
            max_image_seq_len=4096, shift_terminal=0.1)  # fmt: skip


def dynamic(config, tokens, steps, mu=None):
    """A FLUX.1 / FLUX.2 / Qwen-Image pipeline's grid: sigmas linspace(1, 1/T, T), mu by the token count."""
    s = FlowMatchEulerDiscreteScheduler(**config)
    c = s.config
    if mu is None:
        mu = calculate_shift(tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    s.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return s.sigmas


def steps_only(scheduler, steps):
    """A WanPipeline / StableDiffusion3Pipeline grid: set_timesteps(T) on the folder's scheduler."""
    scheduler.set_timesteps(steps)
    return scheduler.sigmas


def cases():
    """(model, px, T, static k, the pipeline's grid) at the recipes' settings and at the models' own sizes."""
    for px, T in ((720, 16), (720, 28), (384, 8), (1024, 28)):
        yield "FLUX.1-dev", px, T, 3.0, dynamic(FLUX1_DEV, (px // 16) ** 2, T)
    for px, T in ((384, 8), (384, 28), (1024, 28)):
        yield "FLUX.2", px, T, 3.0, dynamic(FLUX2, 0, T, mu=compute_empirical_mu((px // 16) ** 2, T))
    for px, T in ((512, 10), (512, 20), (512, 28), (512, 30), (1328, 50)):
        yield "Qwen-Image", px, T, 3.0, dynamic(QWEN_IMAGE, (px // 16) ** 2, T)
    turbo = FlowMatchEulerDiscreteScheduler(shift=3.0)
    turbo.set_timesteps(sigmas=torch.linspace(1.0, 1 / 6, 6).tolist(), mu=0.0)  # ZImagePipeline's sigmas
    yield "Z-Image-Turbo", 512, 6, 3.0, turbo.sigmas
    for T in (20, 30):
        wan = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
        yield "Wan2.1 (UniPC, flow_shift 3)", 480, T, 3.0, steps_only(wan, T)
    wan = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    yield "Wan2.2-TI2V-5B (UniPC, flow_shift 5)", 704, 10, 5.0, steps_only(wan, 10)
    for T in (10, 40):
        yield "SD3.5", 512, T, 3.0, steps_only(FlowMatchEulerDiscreteScheduler(shift=3.0), T)
    for (height, width, frames), T in (((320, 320, 81), 24), ((512, 768, 121), 40)):  # the recipe's, the default
        tokens = ((frames - 1) // 8 + 1) * (height // 32) * (width // 32)  # LTX2Pipeline's mu: the video tokens
        yield f"LTX-2.3 ({height}x{width} x {frames})", height, T, 3.0, dynamic(LTX2, tokens, T)
    hunyuan = FlowMatchEulerDiscreteScheduler(shift=5.0)  # HunyuanVideo15Pipeline: linspace(1, 0, T + 1)[:-1], static
    hunyuan.set_timesteps(sigmas=np.linspace(1.0, 0.0, 17)[:-1])
    yield "HunyuanVideo-1.5 (shift 5)", 480, 16, 5.0, hunyuan.sigmas


def rows() -> list[dict]:
    out = []
    for model, px, T, k, grid in cases():
        static = sigma_schedule(T, k)
        d = (static - grid.float()).abs()
        i = int(d.argmax())
        out.append(dict(model=model, px=px, steps=T, k=k, max_diff=float(d.max()), step=i, static=float(static[i]),
                        pipeline=float(grid[i]), last=float(grid[-2])))  # fmt: skip
    return out


def main() -> None:
    print("| model | px | T | static k | largest difference: step, static vs pipeline | pipeline's last sigma > 0 |")
    print("|---|---|---|---|---|---|")
    for r in rows():
        print(f"| {r['model']} | {r['px']} | {r['steps']} | {r['k']:g} | {r['max_diff']:.3f}: step {r['step']}, "
              f"{r['static']:.3f} vs {r['pipeline']:.3f} | {r['last']:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
