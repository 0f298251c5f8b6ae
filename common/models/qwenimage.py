"""Qwen-Image (Qwen/Qwen-Image, Qwen/Qwen-Image-2512): packed 2x2 latent tokens (seq, 64), Qwen2.5-VL text with a
mask, true CFG with a per-token norm rescale, a 16-channel VAE with per-channel latent statistics."""

import numpy as np
import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

from common.models.base import FlowModel, _check_multiple, _dynamic_mu, _unnormalise


def _pad(cond, length):
    """(embeddings (B, L, D), mask (B, L)) of `cond` padded with zeros to `length` >= L text tokens."""
    embeds, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]
    extra = length - embeds.shape[1]
    embeds = torch.cat([embeds, embeds.new_zeros(len(embeds), extra, embeds.shape[2])], 1)
    return embeds, torch.cat([mask, mask.new_zeros(len(mask), extra)], 1)


class QwenImageModel(FlowModel):
    """Qwen-Image's transformer takes sigma itself as its timestep (it multiplies by 1000 inside) and returns
    v = eps - x0 on tokens of 2x2 latent patches; RoPE positions come from the latent grid (img_shapes). The prompt
    embeddings have one length per batch (the longest prompt's), so they travel with their 0/1 mask, and CFG pads
    the conditional and unconditional ones to one length: with the mask the result is the two-forward pipeline's (to
    float rounding: 2e-7 on tests/tiny.py's model), without it 1.5e-2 off."""

    kind = "qwen"
    pipeline = QwenImagePipeline  # loads the folder; saves and loads a LoRA adapter (save_lora_weights)
    negative_prompt = " "  # the negative prompt of Qwen-Image's own examples; QwenImagePipeline does no CFG without one
    text_tokens = 512  # QwenImagePipeline.__call__'s max_sequence_length (encode_prompt's own default is 1024)

    def __init__(self, pipe: QwenImagePipeline, resolution: int | None):
        self.pipe = pipe
        self.vae_scale = pipe.vae_scale_factor
        size = resolution or pipe.default_sample_size * self.vae_scale
        _check_multiple(size, self.vae_scale * 2, "qwen")  # 2x2 packing of the VAE latent
        super().__init__(pipe.transformer, [pipe.text_encoder], pipe.vae, size, size)
        self.img_shape = (1, size // self.vae_scale // 2, size // self.vae_scale // 2)  # (frames, rows, columns)

    def latent_shape(self):
        return (self.img_shape[1] * self.img_shape[2], self.transformer.config.in_channels)  # (seq, 4 * 16)

    def _encode(self, prompts):
        embeds, mask = self.pipe.encode_prompt(prompts, device=self.device, max_sequence_length=self.text_tokens)
        if mask is None:  # the pipeline drops an all-ones mask; it is kept here, so the dict can be sliced
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}  # (B, L, 3584), (B, L) 1 = a prompt token

    def uncond(self):
        if self._uncond is None:
            self._uncond = self.encode_prompts([self.negative_prompt])
        return self._uncond

    def velocity(self, transformer, x, sigma, cond, guidance_scale=1.0):
        dt = self._io_dtype()

        def forward(x, sigma, embeds, mask):
            return transformer(
                hidden_states=x.to(dt),
                # QwenImagePipeline passes `t.expand(B).to(latents.dtype) / 1000`, t the scheduler's float32 1000 sigma:
                # rounded to the io dtype at 1000 sigma, then divided in it. In bf16, sigma.to(dt) would be one bf16
                # step off that at some sigmas (0.5823 of a 3-step grid: 0.58203125 where the pipeline has 0.5859375)
                timestep=(sigma.float() * 1000).to(dt) / 1000,
                encoder_hidden_states=embeds.to(dt),
                encoder_hidden_states_mask=mask,
                img_shapes=[[self.img_shape]] * len(x),
                return_dict=False,
            )[0]

        if guidance_scale <= 1.0:
            return forward(x, sigma, cond["prompt_embeds"], cond["prompt_embeds_mask"]).to(x.dtype)
        # true CFG in one batch [uncond; cond], both padded to one length (the mask hides the padding), then the
        # per-token rescale of QwenImagePipeline: the combination keeps the conditional prediction's norm
        B, uncond = len(x), self.uncond()
        length = max(uncond["prompt_embeds"].shape[1], cond["prompt_embeds"].shape[1])
        (e_u, m_u), (e_c, m_c) = _pad(uncond, length), _pad(cond, length)
        embeds = torch.cat([e_u.expand(B, -1, -1), e_c])
        mask = torch.cat([m_u.expand(B, -1), m_c])
        out_uncond, out_cond = forward(torch.cat([x, x]), torch.cat([sigma, sigma]), embeds, mask).chunk(2)
        comb = out_uncond + guidance_scale * (out_cond - out_uncond)
        return (comb * (out_cond.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))).to(x.dtype)

    def _pipeline_timesteps(self, num_steps):
        """QwenImagePipeline: sigmas linspace(1, 1/T, T), mu from the token count (Qwen-Image's config: 0.5 at 256
        tokens to 0.9 at 8192, exponential, then stretched so that the last sigma before 0 is 0.02)."""
        mu = _dynamic_mu(calculate_shift, self.scheduler_config, self.latent_shape()[0])
        return dict(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)

    def decode(self, x) -> torch.Tensor:
        """(B, seq, 64) -> (B, 3, H, W) in [0, 1], differentiable: unpacked to the VAE's (B, 16, 1, h, w) (one frame),
        un-normalised per channel, z = x * latents_std + latents_mean, as QwenImagePipeline does."""
        self._vae.fetch()
        z = _unnormalise(QwenImagePipeline._unpack_latents(x, self.height, self.width, self.vae_scale), self.vae.config)
        img = self.vae.decode(z.to(self.vae.dtype)).sample[:, :, 0]  # (B, 3, H, W) in [-1, 1]
        return ((img + 1) / 2).clamp(0, 1).to(x.dtype)
