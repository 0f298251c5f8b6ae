"""Z-Image (Tongyi-MAI/Z-Image-Turbo, Tongyi-MAI/Z-Image): a single-stream transformer on the FLUX.1 VAE's
16-channel latent (B, 16, H/8, W/8), Qwen3 text embeddings of each prompt's own length, time running the other way
and an output of the opposite sign."""

import torch
from diffusers import ZImagePipeline
from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas

from common.models.base import FlowModel, _check_multiple, _dynamic_mu


class ZImageModel(FlowModel):
    """The transformer takes lists (one (C, 1, h, w) latent and one (L_i, D) caption per sample), 1 - sigma as its time
    (0 = noise) and returns x0 - eps: v = -output. The captions are kept here zero-padded with a 0/1 mask, so the
    conditioning is batch-first and can be sliced; velocity() cuts each back to its own tokens, as the pipeline
    passes them.

    --guidance-scale s is classifier-free guidance as for every other kind, u + s (c - u), with the negative prompt
    "" of ZImagePipeline; ZImagePipeline's own `guidance_scale` w means c + w (c - u), so its w is our s - 1 (Turbo's
    w = 0: --guidance-scale 1)."""

    kind = "zimage"
    pipeline = ZImagePipeline  # loads the folder; saves and loads a LoRA adapter (save_lora_weights)

    def __init__(self, pipe: ZImagePipeline, resolution: int | None):
        self.pipe = pipe
        self.vae_scale = pipe.vae_scale_factor
        size = resolution or 1024  # ZImagePipeline's default height and width
        _check_multiple(size, self.vae_scale * 2, "zimage")  # the transformer's 2x2 patches
        super().__init__(pipe.transformer, [pipe.text_encoder], pipe.vae, size, size)

    def latent_shape(self):
        return (self.transformer.config.in_channels, self.height // self.vae_scale, self.width // self.vae_scale)

    def _encode(self, prompts):
        # a copy: ZImagePipeline writes the chat-templated strings back into the list it is given
        embeds, _ = self.pipe.encode_prompt(list(prompts), device=self.device, do_classifier_free_guidance=False)
        length = max(len(e) for e in embeds)
        mask = torch.stack([torch.arange(length, device=self.device) < len(e) for e in embeds]).long()
        padded = torch.stack([torch.cat([e, e.new_zeros(length - len(e), e.shape[1])]) for e in embeds])
        return {"prompt_embeds": padded, "prompt_embeds_mask": mask}  # (B, L, 2560), (B, L) 1 = a prompt token

    def _pipeline_timesteps(self, num_steps):
        """ZImagePipeline: its default sigmas linspace(1, 1/T, T) (a float32 one), mu from the token count (which the
        static configs of Z-Image and Z-Image-Turbo, shift 6 and 3, ignore)."""
        _, h, w = self.latent_shape()
        mu = _dynamic_mu(calculate_shift, self.scheduler_config, (h // 2) * (w // 2))
        return dict(sigmas=get_default_z_image_sigmas(num_steps), mu=mu)

    def velocity(self, transformer, x, sigma, cond, guidance_scale=1.0):
        dt = self._io_dtype()

        def captions(c):
            return [e[m.bool()].to(dt) for e, m in zip(c["prompt_embeds"], c["prompt_embeds_mask"])]

        def output(x, sigma, caps):  # x0 - eps, (rows, 16, h, w) fp32
            # ZImagePipeline's time (1000 - t) / 1000, t the scheduler's float32 1000 sigma: 1 - sigma is one float32
            # step off that at about half of the sigmas (0.9: 0.10000002 where the pipeline has 0.1)
            time = (1000 - sigma.float() * 1000) / 1000
            out = transformer(list(x.to(dt).unsqueeze(2).unbind(0)), time, caps, return_dict=False)[0]
            return torch.stack([o.float() for o in out]).squeeze(2)

        if guidance_scale <= 1.0:
            return (-output(x, sigma, captions(cond))).to(x.dtype)
        # one call on [cond; uncond] as ZImagePipeline makes it, then its combination with w = s - 1
        B, uncond = len(x), captions(self.uncond())
        pos, neg = output(torch.cat([x, x]), torch.cat([sigma, sigma]), captions(cond) + uncond * B).chunk(2)
        return (-(pos + (guidance_scale - 1) * (pos - neg))).to(x.dtype)
