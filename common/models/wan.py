"""Wan2.1 and Wan2.2-TI2V-5B text-to-video: latents (16, F', H/8, W/8) (Wan2.2-5B: (48, F', H/16, W/16)), UMT5 text,
CFG; the VAE decodes in fp32, a video at a time."""

import torch
from diffusers import WanPipeline

from common import InputError
from common.models.base import FlowModel, _cfg, _check_multiple, _unnormalise, check_num_frames


class WanModel(FlowModel):
    """Wan2.1 / Wan2.2-TI2V-5B text-to-video: latents (C, F', H/s, W/s) with F' = (F - 1) / 4 + 1 (the VAE keeps the
    first frame and packs every 4 after it into one latent frame), 1x2x2 patches, UMT5 text, classifier-free
    guidance. Wan2.1: C = 16, s = 8. Wan2.2-TI2V-5B (expand_timesteps): C = 48, s = 16 (its VAE patchifies pixels 2x2
    before an 8x encoder), and the transformer gets one timestep per token, as WanPipeline feeds it (a scalar per
    sample gives the same velocity only to float rounding, 5e-7 on tests/tiny.py's model). Wan2.2-T2V-A14B's two experts are refused."""

    kind = "wan"
    pipeline = WanPipeline  # loads the folder; saves and loads a LoRA adapter (save_lora_weights)
    text_tokens = 512  # WanPipeline's default max_sequence_length
    native_size = (480, 832)  # WanPipeline's default height and width (Wan2.1's 480p)
    native_frames = 81  # WanPipeline's default num_frames (5 s at 16 fps)

    def __init__(self, pipe: WanPipeline, resolution: int | None, num_frames: int | None):
        if pipe.transformer_2 is not None or pipe.config.boundary_ratio is not None:
            raise InputError(
                "--model-id: a two-expert Wan2.2 pipeline (A14B: transformer_2, boundary_ratio) is not supported; give "
                "Wan-AI/Wan2.2-TI2V-5B-Diffusers or a Wan2.1 text-to-video checkpoint"
            )
        self.per_token = bool(pipe.config.expand_timesteps)  # Wan2.2-TI2V-5B
        self.pipe = pipe
        self.vae_scale, self.vae_scale_t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
        height, width = (resolution, resolution) if resolution else self.native_size
        _check_multiple(height, self.vae_scale * pipe.transformer.config.patch_size[1], "wan")
        self.num_frames = num_frames or self.native_frames
        check_num_frames(self.num_frames, self.vae_scale_t)
        super().__init__(pipe.transformer, [pipe.text_encoder], pipe.vae, height, width)

    def latent_shape(self):
        frames = (self.num_frames - 1) // self.vae_scale_t + 1
        return (self.vae.config.z_dim, frames, self.height // self.vae_scale, self.width // self.vae_scale)

    def to(self, device=None, dtype=None, offload=None):
        super().to(device, dtype, offload)
        self.vae.float()  # the Wan authors and diffusers' Wan examples decode in fp32 (127M weights: 0.5 GB)
        return self

    def _encode(self, prompts):
        embeds, _ = self.pipe.encode_prompt(
            prompts, do_classifier_free_guidance=False, max_sequence_length=self.text_tokens, device=self.device
        )
        return {"prompt_embeds": embeds}  # (B, 512, 4096), zero past each prompt's tokens as WanPipeline pads

    def velocity(self, transformer, x, sigma, cond, guidance_scale=1.0):
        # WanPipeline: timestep = 1000 sigma, CFG with the negative prompt "" (two forwards there, one batch here)
        dt = self._io_dtype()

        def forward(x, sigma, cond):
            t = sigma * 1000
            if self.per_token:  # (rows, tokens): F' x h/2 x w/2 patches, all at the sample's timestep
                t = t[:, None].expand(-1, x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2))
            return transformer(
                hidden_states=x.to(dt),
                timestep=t,
                encoder_hidden_states=cond["prompt_embeds"].to(dt),
                return_dict=False,
            )[0]

        return _cfg(forward, x, sigma, cond, self.uncond, guidance_scale).to(x.dtype)

    def decode(self, x) -> torch.Tensor:
        """(B, 16, F', h, w) -> video (B, F, 3, H, W) in [0, 1] (frames first, as WanPipeline's output), differentiable.
        The latents are normalised per channel: z = x * latents_std + latents_mean, as WanPipeline un-normalises."""
        self._vae.fetch()
        z = _unnormalise(x, self.vae.config).to(self.vae.dtype)
        # one video at a time: the VAE's activations grow with the frames, a batch of videos multiplies them
        video = torch.cat([self.vae.decode(z[i : i + 1]).sample for i in range(len(z))])  # (B, 3, F, H, W), [-1, 1]
        return ((video + 1) / 2).clamp(0, 1).to(x.dtype).transpose(1, 2)
