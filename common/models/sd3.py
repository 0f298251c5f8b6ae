"""SD3 / SD3.5 and ShapesBench (a tiny SD3 pipeline): latents (16, H/8, W/8), CLIP-L + CLIP-G + T5 text, CFG."""

from diffusers import StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

from common import InputError
from common.models.base import FlowModel, _cfg, _check_multiple, _dynamic_mu
from common.shapesbench.builders import T5_TOKENS, RepeatedLastTokenJointAttention


class SD3Model(FlowModel):
    """SD3/SD3.5: latents (16, H/8, W/8), CLIP-L + CLIP-G + T5 text, classifier-free guidance."""

    kind = "sd3"
    pipeline = StableDiffusion3Pipeline  # loads the folder; saves and loads a LoRA adapter (save_lora_weights)
    t5_tokens = 256  # StableDiffusion3Pipeline's default max_sequence_length

    def __init__(self, pipe: StableDiffusion3Pipeline, resolution: int | None):
        self.pipe = pipe  # kept for its encode_prompt (three tokenizers + encoders)
        self.vae_scale = pipe.vae_scale_factor
        size = resolution or pipe.default_sample_size * self.vae_scale
        _check_multiple(size, self.vae_scale * pipe.patch_size, "sd3")
        text_encoders = [pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]
        super().__init__(pipe.transformer, text_encoders, pipe.vae, size, size)

    def latent_shape(self):
        return (self.pipe.vae.config.latent_channels, self.height // self.vae_scale, self.width // self.vae_scale)

    def _encode(self, prompts):
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompts,
            None,
            None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.t5_tokens,
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}  # (B, 77+256, 4096), (B, 2048)

    def velocity(self, transformer, x, sigma, cond, guidance_scale=1.0):
        dt = self._io_dtype()

        def forward(x, sigma, cond):
            return transformer(
                hidden_states=x.to(dt),
                timestep=sigma * 1000,  # SD3 transformers take the scheduler's timestep = 1000 * sigma
                encoder_hidden_states=cond["prompt_embeds"].to(dt),
                pooled_projections=cond["pooled_prompt_embeds"].to(dt),
                return_dict=False,
            )[0]

        return _cfg(forward, x, sigma, cond, self.uncond, guidance_scale).to(x.dtype)

    def _pipeline_timesteps(self, num_steps):
        """StableDiffusion3Pipeline: the step count alone (SD3.5's static config: shift 3 on linspace(1, sigma_min,
        T), whose last sigma before 0 is small), with mu from the token count where the config shifts dynamically."""
        if not self.scheduler_config.get("use_dynamic_shifting"):
            return {"num_inference_steps": num_steps}
        _, h, w = self.latent_shape()
        patch = self.transformer.config.patch_size
        mu = _dynamic_mu(calculate_shift, self.scheduler_config, (h // patch) * (w // patch), max_shift=1.16)
        return {"num_inference_steps": num_steps, "mu": mu}


class ShapesModel(SD3Model):
    """ShapesBench: a tiny StableDiffusion3Pipeline (32x32 images, an 8x8x4 VAE latent, two tiny CLIP encoders, and
    in T5's slot a model that outputs zeros), loaded and run as SD3 with one exact shortcut. The pipeline conditions
    on 12 CLIP tokens and 256 identical zero T5 tokens; here the 256 are one token whose attention logit is raised
    by log 256 (common.shapesbench.builders.RepeatedLastTokenJointAttention), which gives the same velocities with a
    joint sequence of 64 + 13 tokens instead of 64 + 268. kind "shapes" also lets ShapesBench's prompts and rewards
    through the scripts' start-up checks."""

    kind = "shapes"
    t5_tokens = 1

    def __init__(self, pipe: StableDiffusion3Pipeline, resolution: int | None):
        super().__init__(pipe, resolution)
        self.transformer.set_attn_processor(RepeatedLastTokenJointAttention(T5_TOKENS))

    def _pipeline_timesteps(self, num_steps):
        raise InputError("--shift pipeline: ShapesBench has no diffusers pipeline of its own; give a number (3)")
