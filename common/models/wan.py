"""Wan2.1, Wan2.2-TI2V-5B and Wan2.2-T2V-A14B text-to-video: latents (16, F', H/8, W/8) (Wan2.2-5B: (48, F', H/16,
W/16)), UMT5 text, CFG; the VAE decodes in fp32, a video at a time. A14B's two experts are one module (WanExperts)."""

from pathlib import Path

import torch
from diffusers import ModelMixin, WanPipeline
from diffusers.loaders import PeftAdapterMixin

from common import InputError
from common.models import LOW_NOISE_LORA
from common.models.base import FlowModel, _cfg, _check_multiple, _unnormalise, check_num_frames, save_pretrained


class WanExperts(ModelMixin, PeftAdapterMixin):
    """Wan2.2-T2V-A14B's two experts as the one module the scripts train: each row goes through the expert WanPipeline
    would use at its timestep, `high` (the pipeline's `transformer`) where t = 1000 sigma >= `boundary` (boundary_ratio
    x 1000 = 875), else `low` (`transformer_2`). A LoRA adapter (add_adapter) lands on both experts, so both are
    trained, each on the steps it denoises; checkpointing, adapters on/off and DDP act on both.

    DDP reduces every trainable parameter after each backward, so an expert with no row in a batch (each of
    DanceGRPO's micro-batches is one timestep) still takes part, through a zero term: its adapter's gradient is 0
    there, not None, and AdamW's momentum and weight decay move it as they move any weight with a zero gradient."""

    _supports_gradient_checkpointing = True

    def __init__(self, high, low, boundary: float):
        super().__init__()
        self.high, self.low, self.boundary = high, low, boundary

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        # hidden_states (B, C, F', h, w), timestep (B,) in [0, 1000], encoder_hidden_states (B, 512, 4096)
        high = timestep >= self.boundary  # (B,) as WanPipeline: `t >= boundary_timestep` -> transformer
        outs, zero = [], 0.0
        for expert, idx in ((self.high, high.nonzero()[:, 0]), (self.low, (~high).nonzero()[:, 0])):
            if len(idx) == len(high):  # every row: the expert's own output, as a one-expert model's
                outs.append((idx, expert(hidden_states, timestep, encoder_hidden_states, return_dict=False)[0]))
            elif len(idx):
                kw = dict(timestep=timestep[idx], encoder_hidden_states=encoder_hidden_states[idx], return_dict=False)
                outs.append((idx, expert(hidden_states[idx], **kw)[0]))
            elif torch.is_grad_enabled():  # the idle expert joins the graph with a zero (see the docstring)
                zero = zero + sum(p.view(-1)[0] for p in expert.parameters() if p.requires_grad) * 0.0
        out = outs[0][1]
        if len(outs) == 2:  # rows on both sides: each expert's rows back in their places
            out = out.new_empty((len(high), *out.shape[1:])).index_put((outs[0][0],), out)
            out = out.index_put((outs[1][0],), outs[1][1].to(out.dtype))
        return (out + zero,)

    def load_lora_adapter(self, folder, prefix="transformer", **kw):
        """final/'s two adapters, as WanPipeline.load_lora_weights reads them: `folder`'s default file into `high`, its
        LOW_NOISE_LORA into `low` (the pipeline: `load_lora_weights(folder, weight_name=LOW_NOISE_LORA,
        load_into_transformer_2=True)`)."""
        self.high.load_lora_adapter(str(folder), prefix=prefix, **kw)
        self.low.load_lora_adapter(str(folder), prefix=prefix, weight_name=LOW_NOISE_LORA, **kw)

    def save_lora(self, out_dir, layers: dict, metadata: dict) -> None:
        """The trained adapter (keys `high.*` and `low.*`) as two files in `out_dir` (see load_lora_adapter)."""
        for expert, weight_name in (("high", None), ("low", LOW_NOISE_LORA)):
            own = {k.removeprefix(f"{expert}."): v for k, v in layers.items() if k.startswith(f"{expert}.")}
            WanPipeline.save_lora_weights(
                out_dir, transformer_lora_layers=own, transformer_lora_adapter_metadata=metadata,
                weight_name=weight_name,
            )  # fmt: skip

    def save_full(self, out_dir, state_dict=None) -> None:
        """Full fine-tuning: out_dir/transformer and out_dir/transformer_2, as the pipeline's folder has them."""
        for expert, sub in (("high", "transformer"), ("low", "transformer_2")):
            own = None if state_dict is None else {
                k.removeprefix(f"{expert}."): v for k, v in state_dict.items() if k.startswith(f"{expert}.")
            }  # fmt: skip
            save_pretrained(getattr(self, expert), Path(out_dir) / sub, own)


class WanModel(FlowModel):
    """Wan2.1 / Wan2.2-TI2V-5B text-to-video: latents (C, F', H/s, W/s) with F' = (F - 1) / 4 + 1 (the VAE keeps the
    first frame and packs every 4 after it into one latent frame), 1x2x2 patches, UMT5 text, classifier-free
    guidance. Wan2.1: C = 16, s = 8. Wan2.2-TI2V-5B (expand_timesteps): C = 48, s = 16 (its VAE patchifies pixels 2x2
    before an 8x encoder), and the transformer gets one timestep per token, as WanPipeline feeds it (a scalar per
    sample gives the same velocity only to float rounding, 5e-7 on tests/tiny.py's model). Wan2.2-T2V-A14B: Wan2.1's
    latents and two experts, `transformer` for sigma >= boundary_ratio (0.875) and `transformer_2` below (WanExperts);
    --guidance-scale is the high-noise expert's CFG scale and `guidance_scale_2` (--guidance-scale-2) the low-noise
    one's, WanPipeline's guidance_scale_2 (None: the same, as the pipeline's default)."""

    kind = "wan"
    pipeline = WanPipeline  # loads the folder; saves and loads a LoRA adapter (save_lora_weights)
    text_tokens = 512  # WanPipeline's default max_sequence_length
    native_size = (480, 832)  # WanPipeline's default height and width (Wan2.1's 480p)
    native_frames = 81  # WanPipeline's default num_frames (5 s at 16 fps)
    native_5b = ((704, 1280), 121)  # Wan2.2-TI2V-5B's own 720p, 121 frames (5 s at 24 fps), as its model card runs it
    guidance_scale_2 = None  # A14B: the low-noise expert's CFG scale (trainable_denoiser sets --guidance-scale-2)

    @classmethod
    def from_folder(cls, where, index, dtype, resolution, num_frames=None):
        return cls(cls.pipeline.from_pretrained(where, dtype=dtype), resolution, num_frames)

    def __init__(self, pipe: WanPipeline, resolution: int | None, num_frames: int | None):
        self.per_token = bool(pipe.config.expand_timesteps)  # Wan2.2-TI2V-5B
        denoiser, self.boundary = pipe.transformer, None
        if (pipe.transformer_2 is None) != (pipe.config.boundary_ratio is None):
            raise InputError("--model-id: a Wan2.2 pipeline needs both transformer_2 and boundary_ratio, or neither")
        if pipe.transformer_2 is not None:  # A14B
            if self.per_token:
                raise InputError("--model-id: two experts with per-token timesteps (expand_timesteps) are not known")
            self.boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
            denoiser = WanExperts(pipe.transformer, pipe.transformer_2, self.boundary)
        self.pipe = pipe
        self.vae_scale, self.vae_scale_t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
        if self.per_token:
            self.native_size, self.native_frames = self.native_5b
        height, width = (resolution, resolution) if resolution else self.native_size
        _check_multiple(height, self.vae_scale * pipe.transformer.config.patch_size[1], "wan")
        self.num_frames = num_frames or self.native_frames
        check_num_frames(self.num_frames, self.vae_scale_t)
        super().__init__(denoiser, [pipe.text_encoder], pipe.vae, height, width)

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

        scale = guidance_scale
        if self.guidance_scale_2 is not None and guidance_scale > 1.0:  # A14B: each row at its expert's scale
            high = sigma * 1000 >= self.boundary  # (B,) WanPipeline's (and WanExperts') rule for `transformer`
            scale = torch.where(high, guidance_scale, self.guidance_scale_2).view(-1, *[1] * (x.dim() - 1))
        return _cfg(forward, x, sigma, cond, self.uncond, scale).to(x.dtype)

    def decode(self, x) -> torch.Tensor:
        """(B, 16, F', h, w) -> video (B, F, 3, H, W) in [0, 1] (frames first, as WanPipeline's output), differentiable.
        The latents are normalised per channel: z = x * latents_std + latents_mean, as WanPipeline un-normalises."""
        self._vae.fetch()
        z = _unnormalise(x, self.vae.config).to(self.vae.dtype)
        # one video at a time: the VAE's activations grow with the frames, a batch of videos multiplies them
        video = torch.cat([self.vae.decode(z[i : i + 1]).sample for i in range(len(z))])  # (B, 3, F, H, W), [-1, 1]
        return ((video + 1) / 2).clamp(0, 1).to(x.dtype).transpose(1, 2)
