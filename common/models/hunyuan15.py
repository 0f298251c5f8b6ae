"""HunyuanVideo-1.5 (Tencent) text-to-video: latents (32, F', H/16, W/16), Qwen2.5-VL and ByT5 (glyph) text, CFG."""

import numpy as np
import torch
from diffusers import HunyuanVideo15Pipeline
from diffusers.loaders import HunyuanVideoLoraLoaderMixin

from common import InputError
from common.models.base import FlowModel, _cfg, _check_multiple


class HunyuanVideo15LoraPipeline(HunyuanVideoLoraLoaderMixin, HunyuanVideo15Pipeline):
    """HunyuanVideo15Pipeline with diffusers' transformer LoRA loader: HunyuanVideo15Pipeline has none, so final/ is
    saved as this class saves it (keys `transformer.*`), which the stock pipeline reads with
    `pipe.transformer.load_lora_adapter(final, prefix="transformer", weight_name="pytorch_lora_weights.safetensors")`
    and this class with `load_lora_weights(final)`."""


class HunyuanVideo15Model(FlowModel):
    """HunyuanVideo-1.5 text-to-video through HunyuanVideo15Pipeline. The transformer's input is the latents, zero
    image-condition latents and a zero mask, (2 x 32 + 1, F', h, w) channels, and 729 zero image tokens (the pipeline's
    text-to-video inputs); timestep 1000 sigma (a sinusoidal embedding, no rescale); text: Qwen2.5-VL's hidden state
    three from the last over the chat template (1000 tokens after its 108-token system part) and ByT5 over the
    prompt's quoted text (zeros and a zero mask when there is none), 256 tokens. CFG: the pipeline's guider
    (ClassifierFreeGuidance, v_u + w (v_c - v_u), negative prompt ""), one batched forward here, two there; the
    folder's guider must be plain CFG (no rescale, the Imagen formulation, on every step). --guidance-scale replaces
    the guider's scale: 1 = no CFG, and any other scale guides, below 1 too (the guider, unlike the other kinds'
    pipelines, is off only at 1)."""

    kind = "hunyuan15"
    pipeline = HunyuanVideo15LoraPipeline  # loads the folder; saves and loads a LoRA adapter (save_lora_weights)
    native_frames = 121  # HunyuanVideo15Pipeline's default num_frames

    @classmethod
    def from_folder(cls, where, index, dtype, resolution, num_frames=None):
        return cls(cls.pipeline.from_pretrained(where, dtype=dtype), resolution, num_frames)

    def __init__(self, pipe, resolution, num_frames: int | None):
        """`resolution`: a square side in pixels, an (height, width) pair, or None (the pipeline's 16:9 default at its
        target size: 480 x 848 for the 480p checkpoint)."""
        g = pipe.guider.config
        if g.guidance_rescale or g.use_original_formulation or g.start != 0.0 or g.stop != 1.0:
            raise InputError("--model-id: HunyuanVideo-1.5's guider must be plain CFG (no rescale, every step)")
        self.pipe = pipe
        self.vae_scale, self.vae_scale_t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
        if resolution is None:
            height, width = pipe.video_processor.calculate_default_height_width(
                pipe.default_aspect_ratio[1], pipe.default_aspect_ratio[0], pipe.target_size
            )
        else:
            height, width = (resolution, resolution) if isinstance(resolution, int) else resolution
        for side in (height, width):
            _check_multiple(side, self.vae_scale * pipe.transformer.config.patch_size, "hunyuan15")
        self.num_frames = num_frames or self.native_frames
        if self.num_frames < 1 or (self.num_frames - 1) % self.vae_scale_t:
            raise InputError(
                f"--num-frames {self.num_frames}: must be {self.vae_scale_t}k + 1 for hunyuan15 (its VAE keeps the "
                f"first frame and compresses the rest {self.vae_scale_t}x in time), e.g. 33 or 121"
            )
        super().__init__(pipe.transformer, [pipe.text_encoder, pipe.text_encoder_2], pipe.vae, height, width)

    def latent_shape(self):
        frames = (self.num_frames - 1) // self.vae_scale_t + 1
        return (self.vae.config.latent_channels, frames, self.height // self.vae_scale, self.width // self.vae_scale)

    def _encode(self, prompts):
        embeds, mask, embeds_2, mask_2 = self.pipe.encode_prompt(
            prompts, device=self.device, dtype=self.pipe.text_encoder.dtype, batch_size=len(prompts)
        )  # (B, 1000, D), (B, 1000), (B, 256, D2), (B, 256)
        return {"prompt_embeds": embeds, "mask": mask, "prompt_embeds_2": embeds_2, "mask_2": mask_2}

    def velocity(self, transformer, x, sigma, cond, guidance_scale=1.0):
        dt = self._io_dtype()
        semantic = (self.pipe.vision_num_semantic_tokens, transformer.config.image_embed_dim)

        def forward(x, sigma, cond):
            x = x.to(dt)  # (rows, 32, F', h, w) + zero condition latents + zero mask: (rows, 65, F', h, w)
            inputs = torch.cat([x, torch.zeros_like(x), x.new_zeros(len(x), 1, *x.shape[2:])], dim=1)
            return transformer(
                hidden_states=inputs,
                image_embeds=x.new_zeros(len(x), *semantic),  # text-to-video: no image tokens
                timestep=(sigma * 1000).to(dt),
                encoder_hidden_states=cond["prompt_embeds"].to(dt),
                encoder_attention_mask=cond["mask"].to(dt),
                encoder_hidden_states_2=cond["prompt_embeds_2"].to(dt),
                encoder_attention_mask_2=cond["mask_2"].to(dt),
                return_dict=False,
            )[0]

        # ClassifierFreeGuidance._is_cfg_enabled: off only where math.isclose(scale, 1.0), so 0.5 guides there too
        return _cfg(forward, x, sigma, cond, self.uncond, guidance_scale, guide_below_one=True).to(x.dtype)

    def _pipeline_timesteps(self, num_steps):
        """HunyuanVideo15Pipeline: sigmas linspace(1, 0, T + 1)[:-1] through the scheduler's static shift."""
        return {"sigmas": np.linspace(1.0, 0.0, num_steps + 1)[:-1]}

    def decode(self, x) -> torch.Tensor:
        """(B, 32, F', h, w) -> video (B, F, 3, H, W) in [0, 1], differentiable: latents / scaling_factor, as the
        pipeline decodes, one video at a time."""
        self._vae.fetch()
        z = (x / self.vae.config.scaling_factor).to(self.vae.dtype)
        video = torch.cat([self.vae.decode(z[i : i + 1], return_dict=False)[0] for i in range(len(z))])
        return ((video + 1) / 2).clamp(0, 1).to(x.dtype).transpose(1, 2)
