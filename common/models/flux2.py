"""FLUX.2 [klein] (4B, 9B; distilled and base) and [dev]: tokens of 2x2-patchified 32-channel latents (seq, 128),
4-axis RoPE ids, stacked text-encoder hidden states (Qwen3 for klein, Mistral-Small-3.1 for dev) padded to 512
tokens, a VAE whose latents are normalised by its BatchNorm statistics.

Reference images (an EditPrompt, common/edits.py), as Flux2Pipeline and Flux2KleinPipeline take `image=[...]`: each
reference is VAE-encoded (the distribution's mode), patchified, BatchNorm-normalised and packed like the noisy latents;
the references' tokens follow the noisy ones in one sequence, the i-th reference's position ids (t, h, w, l) =
(10 + 10 i, row, column, 0) (the pipelines' _prepare_image_ids), and the output is cut to the noisy tokens. The text
is encoded from the instruction alone, as the pipelines do (Flux2Pipeline reads the images in its prompt only when it
upsamples the caption, which RL does not). A plain str prompt takes the text-to-image path, unchanged.
"""

import math
import sys

import numpy as np
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline

from common import InputError
from common.edits import EditPrompt, centre_square
from common.models.base import FlowModel, _cfg, _check_multiple

# Flux2Pipeline and Flux2KleinPipeline shrink a reference of more pixels than this to this area (their __call__'s
# `1024 * 1024`, Flux2ImageProcessor._resize_to_target_area) before encoding it
REFERENCE_MAX_AREA = 1024 * 1024
# References per prompt: the pipelines take any number; Black Forest Labs' model cards give [klein] (4B, 9B) up to 4
# and [dev] a recommended 6 (each 1024 px reference is 4096 more tokens in every forward)
MAX_REFERENCES = {"[klein]": 4, "[dev]": 6}


class Flux2Model(FlowModel):
    """The transformer takes sigma itself as its timestep (x 1000 inside) and returns v = eps - x0. Guidance as the
    matching pipeline: [dev] embeds the scale (an input, no CFG); [klein] distilled checkpoints take none
    (--guidance-scale 1); [klein] base checkpoints do CFG with the negative prompt "" (one batch here, two forwards in
    Flux2KleinPipeline), the references in both halves as there. Every sample of a batch shares one grid of position
    ids, as in the pipelines; a batch with references has the same number of them in every row (one token sequence)."""

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
        # Each reference: centre_square(image, size) (common/edits.py), then what the pipelines' __call__ does to an
        # image of that size: over REFERENCE_MAX_AREA pixels, shrunk to that area (its arithmetic, for the side here;
        # its LANCZOS resize in _reference), then floored to a multiple of vae_scale_factor * 2
        side = size
        if side * side > REFERENCE_MAX_AREA:
            side = int(side * math.sqrt(REFERENCE_MAX_AREA / (side * side)))
        # pixels: 1024 above 1024 px, but 1008 at 1040 (the pipelines' float arithmetic gives 1023 there)
        self.reference_side = side // (self.vae_scale * 2) * (self.vae_scale * 2)
        self.reference_grid = self.reference_side // self.vae_scale // 2  # token rows (= columns) of one reference
        self.variant = "[klein]" if isinstance(pipe, Flux2KleinPipeline) else "[dev]"
        self._reference_ids = {}  # number of references -> their position ids (n * grid^2, 4) on the CPU

    @classmethod
    def from_folder(cls, where, index, dtype, resolution, num_frames=None):
        pipeline = {"Flux2Pipeline": Flux2Pipeline, "Flux2KleinPipeline": Flux2KleinPipeline}[index["_class_name"]]
        return cls(pipeline.from_pretrained(where, dtype=dtype), resolution)  # [dev] or [klein]: the folder's own

    def latent_shape(self):
        return (self.grid[0] * self.grid[1], self.transformer.config.in_channels)  # (seq, 4 * 32)

    def _encode(self, prompts):
        """{"prompt_embeds": (B, 512, 3 x the text encoder's width)}, and with references "image_latents"
        (B, n * reference_grid^2, 128): the n references of each row, their tokens one after another."""
        counts = [len(p.images) if isinstance(p, EditPrompt) else 0 for p in prompts]
        for p, n in zip(prompts, counts):
            if n != counts[0]:
                raise InputError(
                    f"prompt {p!r} brings {n} reference image(s) where {prompts[0]!r} brings {counts[0]}: a FLUX.2 "
                    "batch is one token sequence, so every prompt of it brings the same number of references; give "
                    "each row of the edit file the same number of images"
                )
            if n > MAX_REFERENCES[self.variant]:
                raise InputError(
                    f"prompt {p!r} brings {n} reference images; FLUX.2 {self.variant} takes at most "
                    f"{MAX_REFERENCES[self.variant]} (Black Forest Labs' limit for it)"
                )
        texts = [p.text if isinstance(p, EditPrompt) else p for p in prompts]  # the instruction alone
        embeds, _ = self.pipe.encode_prompt(texts, device=self.device)  # text ids rebuilt in velocity (l = 0..L-1)
        if not counts[0]:
            return {"prompt_embeds": embeds}
        with self._vae.visit():
            latents = [torch.cat([self._reference(img) for img in p.load_images()], dim=1) for p in prompts]
        return {"prompt_embeds": embeds, "image_latents": torch.cat(latents)}

    def _reference(self, image):
        """One reference (a PIL image) -> its tokens (1, reference_grid^2, 128) on `device`, in the VAE's dtype: as
        the pipelines' __call__ and prepare_image_latents treat each `image`, after the project's centre_square (no
        check_image_input: after the crop it would only refuse a --resolution under 64). One image per VAE encode, as
        there (at 1024 px a batch of them would be GBs of activations)."""
        img = centre_square(image, self.height)
        processor = self.pipe.image_processor
        if img.width * img.height > REFERENCE_MAX_AREA:
            img = processor._resize_to_target_area(img, REFERENCE_MAX_AREA)
        side = self.reference_side
        pixels = processor.preprocess(img, height=side, width=side, resize_mode="crop")  # (1, 3, side, side) in [-1, 1]
        latent = self.pipe._encode_vae_image(pixels.to(self.device, self.vae.dtype), generator=None)  # (1, 128, g, g)
        return self.pipe._pack_latents(latent)  # (1, g * g, 128), row-major as the noisy tokens

    def reference_ids(self, n: int) -> torch.Tensor:
        """Position ids (n * reference_grid^2, 4) of n references, on the CPU: the pipelines' _prepare_image_ids, the
        i-th reference at t = 10 + 10 i (the noisy tokens are at t = 0)."""
        if n not in self._reference_ids:
            shape_only = torch.empty(1, 1, self.reference_grid, self.reference_grid, device="meta")  # its shapes alone
            self._reference_ids[n] = self.pipe._prepare_image_ids([shape_only] * n)[0]
        return self._reference_ids[n]

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
            hidden, img_ids = x.to(dt), self.img_ids.to(x.device)
            refs = cond.get("image_latents")  # (B, n * grid^2, 128), the same in both CFG halves (_cfg)
            if refs is not None:  # the pipelines: cat([latents, image_latents], dim=1), ids likewise
                hidden = torch.cat([hidden, refs.to(dt)], dim=1)
                n = refs.shape[1] // self.reference_grid**2
                img_ids = torch.cat([img_ids, self.reference_ids(n).to(x.device)])
            out = transformer(
                hidden_states=hidden,
                # Flux2Pipeline and Flux2KleinPipeline pass `t.expand(B).to(latents.dtype) / 1000`, t the scheduler's
                # float32 1000 sigma: rounded to the io dtype at 1000 sigma, then divided in it (in bf16, sigma.to(dt)
                # is one bf16 step off that at some sigmas: 0.95703125 at 0.9547, where sigma.to(dt) is 0.953125)
                timestep=(sigma.float() * 1000).to(dt) / 1000,
                guidance=guidance,
                encoder_hidden_states=embeds,
                txt_ids=txt_ids,
                img_ids=img_ids,
                return_dict=False,
            )[0]
            return out if refs is None else out[:, : x.shape[1]]  # the noisy tokens' velocity, as the pipelines cut it

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
