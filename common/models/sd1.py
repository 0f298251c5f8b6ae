"""SD1.x / SD2.x (for RLR): a DDPM-style eps (or v) UNet on latents (4, H/8, W/8), CLIP text, CFG; not a flow model."""

import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline

from common import InputError
from common.models.base import _cfg, _check_multiple, _Parts


class DDIMModel(_Parts):
    """SD1.x/2.x: UNet eps-prediction on latents (4, H/8, W/8), CLIP text, CFG. Not a flow model.

    `alphas_cumprod` (1000,) is the DDIM/DDPM schedule: x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps.
    """

    kind = "sd1"
    pipeline = StableDiffusionPipeline  # loads the folder; saves and loads a LoRA adapter (save_lora_weights)

    def __init__(self, pipe: StableDiffusionPipeline, resolution: int | None):
        self.pipe, self.unet = pipe, pipe.unet
        self.vae_scale = pipe.vae_scale_factor
        size = resolution or pipe.unet.config.sample_size * self.vae_scale
        _check_multiple(size, self.vae_scale, "sd1")
        super().__init__(pipe.unet, [pipe.text_encoder], pipe.vae, size, size)
        scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
        self.alphas_cumprod = scheduler.alphas_cumprod  # (T,) float32
        self.prediction_type = scheduler.config.prediction_type  # SD2.x-768 models predict v
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise InputError(f"unsupported prediction_type {self.prediction_type!r} in --model-id's scheduler config")

    @classmethod
    def from_folder(cls, where, index, dtype, resolution, num_frames=None):
        pipe = cls.pipeline.from_pretrained(where, dtype=dtype, safety_checker=None, requires_safety_checker=False)
        return cls(pipe, resolution)

    def latent_shape(self):
        return (self.pipe.vae.config.latent_channels, self.height // self.vae_scale, self.width // self.vae_scale)

    def _encode(self, prompts):
        embeds, _ = self.pipe.encode_prompt(prompts, self.device, 1, False)
        return {"prompt_embeds": embeds}  # (B, 77, D)

    def eps(self, unet, x, t, cond, guidance_scale: float = 1.0) -> torch.Tensor:
        """x: (B, *latent_shape), t: (B,) integer timesteps in [0, T). Returns predicted noise like x."""
        dt = self.unet.dtype

        def forward(x, t, cond):
            return unet(x.to(dt), t, encoder_hidden_states=cond["prompt_embeds"].to(dt), return_dict=False)[0]

        out = _cfg(forward, x, t, cond, self.uncond, guidance_scale).to(x.dtype)
        if self.prediction_type == "v_prediction":  # v = sqrt(a) eps - sqrt(1-a) x0  =>  eps = sqrt(a) v + sqrt(1-a) x
            a = self.alphas_cumprod.to(x.device)[t].view(-1, *[1] * (x.ndim - 1)).to(x.dtype)
            out = a.sqrt() * out + (1 - a).sqrt() * x
        return out
