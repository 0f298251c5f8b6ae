"""FLUX.1 (dev, schnell): packed 2x2 latent tokens, CLIP pooled + T5 text, guidance embedded in the transformer."""

import numpy as np
import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from common import InputError
from common.models.base import FlowModel, _check_multiple, _dynamic_mu


class FluxModel(FlowModel):
    """FLUX.1: packed latent tokens (seq, 4 * 16) with 2x2 patches, CLIP pooled + T5 text, embedded guidance."""

    kind = "flux"
    pipeline = FluxPipeline  # loads the folder; saves and loads a LoRA adapter (save_lora_weights)
    text_tokens = 512  # T5 tokens per prompt: FluxPipeline.__call__'s max_sequence_length

    def __init__(self, pipe: FluxPipeline, resolution: int | None):
        self.pipe = pipe
        self.vae_scale = pipe.vae_scale_factor
        size = resolution or pipe.default_sample_size * self.vae_scale
        _check_multiple(size, self.vae_scale * 2, "flux")  # 2x2 packing of the VAE latent
        super().__init__(pipe.transformer, [pipe.text_encoder, pipe.text_encoder_2], pipe.vae, size, size)
        h, w = size // self.vae_scale, size // self.vae_scale
        self.img_ids = FluxPipeline._prepare_latent_image_ids(None, h // 2, w // 2, "cpu", torch.float32)  # (seq, 3)

    def latent_shape(self):
        seq = (self.height // self.vae_scale // 2) * (self.width // self.vae_scale // 2)
        return (seq, self.transformer.config.in_channels)  # in_channels = 4 * VAE latent channels

    def _encode(self, prompts):
        embeds, pooled, _ = self.pipe.encode_prompt(  # txt_ids (zeros): in velocity
            prompts, None, device=self.device, max_sequence_length=self.text_tokens
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}  # (B, text_tokens, 4096), (B, 768)

    def velocity(self, transformer, x, sigma, cond, guidance_scale=1.0):
        # FLUX.1-dev is guidance-distilled: the scale is an input of the transformer, there is no CFG.
        # FluxPipeline passes timestep = sigma and the raw guidance scale; the transformer multiplies both by 1000.
        dt = self._io_dtype()
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((x.shape[0],), guidance_scale, device=x.device)
        elif guidance_scale != 1.0:
            raise InputError(
                "this FLUX checkpoint has no guidance embedding (e.g. FLUX.1-schnell) and FluxPipeline does no CFG; "
                "use --guidance-scale 1"
            )
        embeds = cond["prompt_embeds"].to(dt)
        tokens, ids = self._tokens(x, cond, dt)
        return transformer(
            hidden_states=tokens,
            # `t.expand(B).to(latents.dtype) / 1000` as FluxPipeline, t the scheduler's float32 1000 sigma: rounded to
            # the io dtype at 1000 sigma, then divided in it (in bf16, sigma.to(dt) is one bf16 step off at some sigmas)
            timestep=(sigma.float() * 1000).to(dt) / 1000,
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"].to(dt),
            encoder_hidden_states=embeds,
            txt_ids=embeds.new_zeros(embeds.shape[1], 3),
            img_ids=ids,
            return_dict=False,
        )[0][:, : x.shape[1]].to(x.dtype)  # the noisy tokens' velocity (an editing kind appends more: _tokens)

    def _tokens(self, x, cond, dt):
        """The transformer's image tokens (B, seq, 64) and their position ids (seq, 3): here x's own; FLUX.1-Kontext
        appends its source's (common/models/kontext.py)."""
        return x.to(dt), self.img_ids.to(x.device, dt)

    def _pipeline_timesteps(self, num_steps):
        """FluxPipeline: sigmas linspace(1, 1/T, T) (none with use_flow_sigmas), mu from the token count (FLUX.1-dev's
        config shifts dynamically: mu 0.5 at 256 tokens to 1.15 at 4096, exponential)."""
        config = self.scheduler_config
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / num_steps, num_steps)
        mu = _dynamic_mu(calculate_shift, config, self.latent_shape()[0])
        return dict(num_inference_steps=num_steps if sigmas is None else None, sigmas=sigmas, mu=mu)

    def _vae_latents(self, x):
        return FluxPipeline._unpack_latents(x, self.height, self.width, self.vae_scale)  # (B, 16, H/8, W/8)
