"""FLUX.2 [klein] (4B, 9B; distilled and base) and [dev]: tokens of 2x2-patchified 32-channel latents (seq, 128),
4-axis RoPE ids, stacked text-encoder hidden states (Qwen3 for klein, Mistral-Small-3.1 for dev) padded to 512
tokens, a VAE whose latents are normalised by its BatchNorm statistics."""

import sys

import numpy as np
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline

from common import InputError
from common.models.base import FlowModel, _cfg, _check_multiple


class Flux2Model(FlowModel):
    """The transformer takes sigma itself as its timestep (x 1000 inside) and returns v = eps - x0. Guidance as the
    matching pipeline: [dev] embeds the scale (an input, no CFG); [klein] distilled checkpoints take none
    (--guidance-scale 1); [klein] base checkpoints do CFG with the negative prompt "" (one batch here, two forwards in
    Flux2KleinPipeline). Every sample of a batch shares one grid of position ids, as in the pipelines."""

    kind = "flux2"
    # LoRA on the double blocks' attention projections (the other kinds' LORA_TARGETS) and on the single blocks' two
    # Linears, which fuse q, k, v with the MLP's input and the attention's output with the MLP's: without them the
    # adapter would skip 20 of [klein] 4B's 25 blocks. A regex, because the single blocks' `attn.to_out` is a Linear
    # where the double blocks' is a ModuleList (peft cannot adapt that).
    lora_targets = (
        r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
        r"|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)"
    )

    def __init__(self, pipe: Flux2Pipeline | Flux2KleinPipeline, resolution: int | None):
        self.pipe = pipe
        self.pipeline = type(pipe)  # Flux2Pipeline or Flux2KleinPipeline: loads, saves and loads a LoRA adapter
        self.vae_scale = pipe.vae_scale_factor
        size = resolution or pipe.default_sample_size * self.vae_scale
        _check_multiple(size, self.vae_scale * 2, "flux2")  # 2x2 patchify of the VAE latent
        super().__init__(pipe.transformer, [pipe.text_encoder], pipe.vae, size, size)
        self.grid = (size // self.vae_scale // 2, size // self.vae_scale // 2)  # token rows, columns
        channels = pipe.transformer.config.in_channels
        shape_only = torch.empty(1, channels, *self.grid, device="meta")  # the pipeline's helper reads its shape
        self.img_ids = pipe._prepare_latent_ids(shape_only)[0]  # (seq, 4): t, h, w, l on the CPU; to x's in velocity
        self.distilled = isinstance(pipe, Flux2KleinPipeline) and pipe.config.is_distilled

    @classmethod
    def from_folder(cls, where, index, dtype, resolution, num_frames=None):
        pipeline = {"Flux2Pipeline": Flux2Pipeline, "Flux2KleinPipeline": Flux2KleinPipeline}[index["_class_name"]]
        return cls(pipeline.from_pretrained(where, dtype=dtype), resolution)  # [dev] or [klein]: the folder's own

    def latent_shape(self):
        return (self.grid[0] * self.grid[1], self.transformer.config.in_channels)  # (seq, 4 * 32)

    def _encode(self, prompts):
        embeds, _ = self.pipe.encode_prompt(prompts, device=self.device)  # text ids rebuilt in velocity (l = 0..L-1)
        return {"prompt_embeds": embeds}  # (B, 512, 3 x the text encoder's width)

    def velocity(self, transformer, x, sigma, cond, guidance_scale=1.0):
        dt = self._io_dtype()
        embedded = self.transformer.config.guidance_embeds  # [dev]
        if not embedded and self.distilled and guidance_scale != 1.0:
            raise InputError(
                "--model-id is a guidance-distilled FLUX.2 [klein] (is_distilled): Flux2KleinPipeline does no CFG on "
                "it; use --guidance-scale 1, or a [klein] base checkpoint for CFG"
            )

        def forward(x, sigma, cond):
            embeds = cond["prompt_embeds"].to(dt)
            guidance = torch.full((len(x),), guidance_scale, device=x.device) if embedded else None
            txt_ids = torch.zeros(embeds.shape[1], 4, dtype=torch.long, device=x.device)
            txt_ids[:, 3] = torch.arange(embeds.shape[1], device=x.device)  # (t, h, w, l) = (0, 0, 0, token)
            return transformer(
                hidden_states=x.to(dt),
                # Flux2Pipeline and Flux2KleinPipeline pass `t.expand(B).to(latents.dtype) / 1000`, t the scheduler's
                # float32 1000 sigma: rounded to the io dtype at 1000 sigma, then divided in it (in bf16, sigma.to(dt)
                # is one bf16 step off that at some sigmas: 0.95703125 at 0.9547, where sigma.to(dt) is 0.953125)
                timestep=(sigma.float() * 1000).to(dt) / 1000,
                guidance=guidance,
                encoder_hidden_states=embeds,
                txt_ids=txt_ids,
                img_ids=self.img_ids.to(x.device),
                return_dict=False,
            )[0]

        if embedded:
            return forward(x, sigma, cond).to(x.dtype)
        return _cfg(forward, x, sigma, cond, self.uncond, guidance_scale).to(x.dtype)

    def _pipeline_timesteps(self, num_steps):
        """Flux2Pipeline and Flux2KleinPipeline: sigmas linspace(1, 1/T, T) (none with use_flow_sigmas), mu from the
        pipeline module's compute_empirical_mu(tokens, T), which depends on the step count as well as the size."""
        sigmas = None if self.scheduler_config.get("use_flow_sigmas") else np.linspace(1.0, 1 / num_steps, num_steps)
        mu = sys.modules[type(self.pipe).__module__].compute_empirical_mu(self.latent_shape()[0], num_steps)
        return dict(num_inference_steps=num_steps if sigmas is None else None, sigmas=sigmas, mu=mu)

    def _vae_latents(self, x):
        """(B, seq, 128) -> the VAE's (B, 32, h, w): tokens back to the (B, 128, h/2, w/2) grid (row-major, as
        _pack_latents made them), un-normalised by the VAE's BatchNorm running statistics, un-patchified (what the
        pipelines' output_type="latent" gives for [klein])."""
        bn = self.vae.bn
        z = x.transpose(1, 2).reshape(len(x), x.shape[2], *self.grid)
        z = z * (bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).sqrt().to(x.dtype)
        return self.pipe._unpatchify_latents(z + bn.running_mean.view(1, -1, 1, 1).to(x.dtype))

    def decode(self, x) -> torch.Tensor:
        """(B, seq, 128) -> (B, 3, H, W) in [0, 1], differentiable (no scaling or shift factor: the BatchNorm
        statistics normalise FLUX.2's latents)."""
        self._vae.fetch()
        img = self.vae.decode(self._vae_latents(x).to(self.vae.dtype)).sample
        return ((img + 1) / 2).clamp(0, 1).to(x.dtype)
