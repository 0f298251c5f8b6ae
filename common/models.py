"""Text-to-image models behind one small interface, for the RL scripts' own samplers.

Flow models (ShapesBench, SD3/SD3.5, FLUX.1, Wan2.1 text-to-video) share one convention, whatever the checkpoint's:
    x_s = (1 - s) x0 + s eps,   v = eps - x0,   s in [0, 1],   s = 1 is pure noise.
`FlowModel.velocity(transformer, x, sigma, cond)` returns v; the scripts integrate it themselves. A video model's
decode gives (B, F, 3, H, W) where an image model's gives (B, 3, H, W); the rewards take either (common/rewards.py).
SD1.x/2.x (for RLR) is a DDPM-style eps model, so it gets its own `DDIMModel`.

The trainable denoiser is passed *into* `velocity`/`eps` rather than read from the object, so scripts
can hand in a LoRA'd, DDP/FSDP-wrapped or reference copy of it. Everything else is frozen.
"""

import contextlib
import copy
import json
from pathlib import Path

import torch
from diffusers import (
    DDIMScheduler,
    FluxPipeline,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    WanPipeline,
)
from huggingface_hub import hf_hub_download
from peft import LoraConfig, get_peft_model_state_dict

from common import InputError, hub_reachable
from common.offload import Offloaded
from common.shapesbench.builders import LATENT_PATH, SHAPESBENCH_KEY, T5_TOKENS, RepeatedLastTokenJointAttention

SHAPESBENCH_DIR = LATENT_PATH  # what --model-id shapesbench loads
# model_index.json `_class_name` -> kind; a StableDiffusion3Pipeline folder with the key "_shapesbench" is "shapes"
KINDS = {
    "FluxPipeline": "flux",
    "StableDiffusion3Pipeline": "sd3",
    "StableDiffusionPipeline": "sd1",
    "WanPipeline": "wan",
}
VIDEO_KINDS = ("wan",)
HOW_TO_GET_WEIGHTS = (
    "To run without hub access: on a machine with internet run `hf download <hub-id> --local-dir /path` "
    "(e.g. black-forest-labs/FLUX.1-dev; gated models need their licence accepted and `hf auth login`), copy /path "
    "here and pass `--model-id /path`; or pre-populate the HF_HOME cache."
)


def _cfg(forward, x, t, cond, get_uncond, scale):
    """Classifier-free guidance as diffusers does it: one batched forward on [uncond; cond] when scale > 1."""
    if scale <= 1.0:
        return forward(x, t, cond)
    B, uncond = x.shape[0], get_uncond()
    both = {k: torch.cat([uncond[k].expand(B, *uncond[k].shape[1:]), cond[k]]) for k in cond}
    out_uncond, out_cond = forward(torch.cat([x, x]), torch.cat([t, t]), both).chunk(2)
    return out_uncond + scale * (out_cond - out_uncond)


def _vae_decode(vae, latents):
    """(B, C, h, w) model latents -> (B, 3, H, W) in [0, 1], differentiable w.r.t. latents."""
    shift = vae.config.shift_factor or 0.0  # SD3/FLUX VAEs are shifted, SD1.x ones (None) are not
    img = vae.decode((latents / vae.config.scaling_factor + shift).to(vae.dtype)).sample
    return ((img + 1) / 2).clamp(0, 1).to(latents.dtype)


def _move(modules, device, dtype):
    # only pass what is set: diffusers' ModelMixin.to() warns whenever a `dtype` kwarg is present, even None
    # (and no dtype when a module has it already: the warning is noise then)
    for m in modules:
        if m is not None:
            kwargs = {"device": device} if device is not None else {}
            if dtype is not None and any(p.dtype != dtype for p in m.parameters()):
                kwargs["dtype"] = dtype
            if kwargs:
                m.to(**kwargs)


class _Parts:
    """What every model wrapper shares: the denoiser, the frozen text encoders and VAE (eval, no grad), where they
    live (`device`; with `offload` the frozen parts stay on the CPU and visit `device` only for their work: see
    common/offload.py), and the cached unconditional embedding for CFG."""

    def __init__(self, denoiser, text_encoders, vae, height, width):
        self.height, self.width, self.vae = height, width, vae
        self.text_encoders = [m for m in text_encoders if m is not None]
        for m in [*self.text_encoders, vae]:
            if m is not None:
                m.requires_grad_(False).eval()
        self._denoiser, self.device, self.offload = denoiser, torch.device("cpu"), False
        self._text, self._vae = Offloaded(self.text_encoders, "cpu", False), Offloaded([vae], "cpu", False)
        self._uncond = None  # encode_prompts([""]) for CFG, computed on first use and dropped by .to()

    def to(self, device=None, dtype=None, offload: bool | None = None):
        """Everything to `device` / `dtype`; with `offload` (--offload-frozen) the frozen parts go to the CPU instead
        (None: as before)."""
        self.device = torch.device(device) if device is not None else self.device
        self.offload = self.offload if offload is None else offload
        self._text, self._vae = (Offloaded(m, self.device, self.offload) for m in (self.text_encoders, [self.vae]))
        _move([self._denoiser], device, dtype)
        _move([*self.text_encoders, self.vae], "cpu" if self.offload else device, dtype)
        self._uncond = None
        return self

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning tensors of `prompts` on `device` (the text encoders visit it with --offload-frozen)."""
        with self._text.visit():
            return self._encode(prompts)

    def _encode(self, prompts):
        raise NotImplementedError

    def uncond(self) -> dict[str, torch.Tensor]:
        if self._uncond is None:
            self._uncond = self.encode_prompts([""])
        return self._uncond

    def decode(self, x) -> torch.Tensor:
        """(B, *latent_shape()) -> (B, 3, H, W) in [0, 1], differentiable; the VAE comes to `device` if offloaded."""
        self._vae.fetch()
        return _vae_decode(self.vae, self._vae_latents(x))

    def _vae_latents(self, x):
        return x

    def park(self) -> None:
        """With --offload-frozen, the VAE back to the CPU (the text encoders go back after each encode_prompts). The
        scripts call it before their backward passes, where no autograd graph through the VAE is alive."""
        self._vae.park()


class FlowModel(_Parts):
    """A flow model's parts. x: (B, *latent_shape()), sigma: (B,) in [0, 1], cond: dict from encode_prompts.

    velocity(transformer, x, sigma, cond, guidance_scale) -> v like x; differentiable w.r.t. `transformer`.
    guidance_scale means what it means in the matching diffusers pipeline (CFG for sd3/shapes, embedded for FLUX).
    decode(x) -> (B, 3, H, W) in [0, 1], differentiable. encode_prompts is batch-first, so it can be sliced.
    """

    kind: str
    transformer: torch.nn.Module  # trainable; returned with requires_grad as loaded
    height: int  # image size in pixels
    width: int

    def __init__(self, transformer, text_encoders, vae, height, width):
        super().__init__(transformer, text_encoders, vae, height, width)
        self.transformer = transformer

    def latent_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def velocity(self, transformer, x, sigma, cond, guidance_scale: float = 1.0) -> torch.Tensor:
        raise NotImplementedError

    def _io_dtype(self):
        return self.transformer.dtype  # wrapped copies passed to velocity() share the unwrapped one's dtype


class SD3Model(FlowModel):
    """SD3/SD3.5: latents (16, H/8, W/8), CLIP-L + CLIP-G + T5 text, classifier-free guidance."""

    kind = "sd3"
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


class FluxModel(FlowModel):
    """FLUX.1: packed latent tokens (seq, 4 * 16) with 2x2 patches, CLIP pooled + T5 text, embedded guidance."""

    kind = "flux"

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
        embeds, pooled, _ = self.pipe.encode_prompt(prompts, None, device=self.device)  # txt_ids (zeros): in velocity
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}  # (B, 512, 4096), (B, 768)

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
        return transformer(
            hidden_states=x.to(dt),
            timestep=sigma.to(dt),
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"].to(dt),
            encoder_hidden_states=embeds,
            txt_ids=embeds.new_zeros(embeds.shape[1], 3),
            img_ids=self.img_ids.to(x.device, dt),
            return_dict=False,
        )[0].to(x.dtype)

    def _vae_latents(self, x):
        return FluxPipeline._unpack_latents(x, self.height, self.width, self.vae_scale)  # (B, 16, H/8, W/8)


class WanModel(FlowModel):
    """Wan2.1 text-to-video: latents (16, F', H/8, W/8) with F' = (F - 1) / 4 + 1 (the VAE keeps the first frame
    and packs every 4 after it into one latent frame), 1x2x2 patches, UMT5 text, classifier-free guidance."""

    kind = "wan"
    text_tokens = 512  # WanPipeline's default max_sequence_length
    native_size = (480, 832)  # WanPipeline's default height and width (Wan2.1's 480p)
    native_frames = 81  # WanPipeline's default num_frames (5 s at 16 fps)

    def __init__(self, pipe: WanPipeline, resolution: int | None, num_frames: int | None):
        if pipe.transformer_2 is not None or pipe.config.boundary_ratio is not None or pipe.config.expand_timesteps:
            raise InputError(
                "--model-id: a Wan2.2 pipeline (two experts or per-token timesteps); give a Wan2.1 text-to-video "
                "checkpoint, e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
            )
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
            return transformer(
                hidden_states=x.to(dt),
                timestep=sigma * 1000,
                encoder_hidden_states=cond["prompt_embeds"].to(dt),
                return_dict=False,
            )[0]

        return _cfg(forward, x, sigma, cond, self.uncond, guidance_scale).to(x.dtype)

    def decode(self, x) -> torch.Tensor:
        """(B, 16, F', h, w) -> video (B, F, 3, H, W) in [0, 1] (frames first, as WanPipeline's output), differentiable.
        The latents are normalised per channel: z = x * latents_std + latents_mean, as WanPipeline un-normalises."""
        self._vae.fetch()
        cfg, view = self.vae.config, (1, -1, 1, 1, 1)
        mean = torch.tensor(cfg.latents_mean, device=x.device).view(view)
        std = torch.tensor(cfg.latents_std, device=x.device).view(view)
        z = (x * std + mean).to(self.vae.dtype)
        # one video at a time: the VAE's activations grow with the frames, a batch of videos multiplies them
        video = torch.cat([self.vae.decode(z[i : i + 1]).sample for i in range(len(z))])  # (B, 3, F, H, W), [-1, 1]
        return ((video + 1) / 2).clamp(0, 1).to(x.dtype).transpose(1, 2)


class DDIMModel(_Parts):
    """SD1.x/2.x: UNet eps-prediction on latents (4, H/8, W/8), CLIP text, CFG. Not a flow model.

    `alphas_cumprod` (1000,) is the DDIM/DDPM schedule: x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps.
    """

    kind = "sd1"

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


def check_num_frames(num_frames: int, temporal_scale: int = 4) -> None:
    """--num-frames of a Wan2.1 video: its VAE (temporal_scale 4) keeps the first frame and packs the others 4 to a
    latent frame, so the count is 4k + 1."""
    if num_frames < 1 or (num_frames - 1) % temporal_scale:
        raise InputError(
            f"--num-frames {num_frames}: must be {temporal_scale}k + 1 (Wan's VAE keeps the first frame and "
            f"compresses the rest {temporal_scale}x in time), e.g. 33 or 81"
        )


def _check_multiple(size, multiple, kind):
    if size % multiple:
        raise InputError(f"--resolution {size} must be a multiple of {multiple} for {kind} models")


def _model_index(model_id: str) -> tuple[dict, str]:
    """Read model_index.json from a local folder or the hub (the local HF cache first; the hub only if reachable)."""
    if model_id == "shapesbench":
        if not (SHAPESBENCH_DIR / "model_index.json").is_file():
            raise InputError(
                f"the ShapesBench model is missing from {SHAPESBENCH_DIR} (it ships with the repo: restore it with "
                "git, or train it again); or pass another model with --model-id"
            )
        model_id = str(SHAPESBENCH_DIR)
    path = Path(model_id).expanduser()
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise InputError(f"--model-id {model_id}: no model_index.json, so not a diffusers pipeline folder")
        return json.loads((path / "model_index.json").read_text()), str(path)
    if model_id.startswith(("/", ".", "~")) or model_id.count("/") != 1:
        raise InputError(f"--model-id {model_id}: no such folder, and not a hub id of the form owner/name")
    try:  # the local cache first: no network, no retries
        return json.loads(
            Path(hf_hub_download(model_id, "model_index.json", local_files_only=True)).read_text()
        ), model_id
    except Exception:
        pass

    if not hub_reachable():
        raise InputError(
            f"--model-id {model_id}: not in the local Hugging Face cache and the hub cannot be reached "
            f"(offline, or HF_HUB_OFFLINE=1). {HOW_TO_GET_WEIGHTS}"
        )
    try:
        return json.loads(Path(hf_hub_download(model_id, "model_index.json")).read_text()), model_id
    except Exception as e:  # bad id, gated without login
        raise InputError(
            f"--model-id {model_id!r} is neither a local diffusers folder nor a hub model available here "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). {HOW_TO_GET_WEIGHTS}"
        ) from None


def check_model_id(model_id: str) -> str:
    """--model-id names a supported model that is here or downloadable; checked before anything loads. Returns its
    kind ('shapes', 'flux', 'sd3', 'sd1', 'wan'), read from model_index.json alone."""
    return _kind(_model_index(model_id)[0], model_id)


def _kind(index: dict, model_id: str) -> str:
    name = index.get("_class_name")
    if name not in KINDS:
        raise InputError(f"--model-id {model_id}: unsupported model class {name!r}; supported: {', '.join(KINDS)}")
    return "shapes" if index.get(SHAPESBENCH_KEY) and name == "StableDiffusion3Pipeline" else KINDS[name]


def load_model(
    model_id: str = "shapesbench",
    device="cpu",
    dtype=torch.float32,
    resolution: int | None = None,
    num_frames: int | None = None,
    offload: bool = False,
) -> FlowModel | DDIMModel:
    """Load a model by hub id or local path (`--model-id`), all parts in `dtype` on `device` (with `offload`,
    --offload-frozen, the text encoders and the VAE on the CPU until they work: common/offload.py).

    The kind comes from model_index.json's `_class_name`. `resolution` (`--resolution`) is the square image
    side in pixels; None = the model's native size (Wan2.1: 480 x 832). `num_frames` (`--num-frames`, video models
    only): frames of each video; None = the model's native count (Wan2.1: 81). Frozen parts are eval() with requires_grad False; the
    denoiser keeps requires_grad (the script decides: LoRA via add_lora, or full fine-tuning).
    """
    index, where = _model_index(model_id)
    kind = _kind(index, model_id)
    if num_frames is not None and kind not in VIDEO_KINDS:
        raise InputError(f"--num-frames only applies to a video model (Wan2.1); --model-id {model_id} is {kind}")
    try:
        if kind == "sd1":
            pipe = StableDiffusionPipeline.from_pretrained(
                where, dtype=dtype, safety_checker=None, requires_safety_checker=False
            )
            model = DDIMModel(pipe, resolution)
        elif kind == "wan":
            model = WanModel(WanPipeline.from_pretrained(where, dtype=dtype), resolution, num_frames)
        else:
            pipe_cls, model_cls = {
                "flux": (FluxPipeline, FluxModel),
                "sd3": (StableDiffusion3Pipeline, SD3Model),
                "shapes": (StableDiffusion3Pipeline, ShapesModel),
            }[kind]
            model = model_cls(pipe_cls.from_pretrained(where, dtype=dtype), resolution)
    except OSError as e:  # model_index.json found but weights not (partial download / cache)
        raise InputError(f"--model-id {model_id}: could not load the weights ({e}). {HOW_TO_GET_WEIGHTS}") from None
    return model.to(device, offload=offload)


# Attention projections of joint (MM-DiT) blocks, single blocks and UNet cross/self-attention; names that a
# model lacks are skipped by peft (add_* only exist in SD3/FLUX joint blocks).
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


def trainable_denoiser(model: FlowModel | DDIMModel, args):
    """The module RL trains (the transformer, or an SD1.x UNet), in train mode.

    Full fine-tuning: fp32 master weights for AdamW; autocast runs the forwards in bf16 (--mixed-precision bf16).
    --lora: a LoRA adapter (rank --lora-rank, alpha --lora-alpha) whose weights alone are trainable and fp32; the
    frozen base stays in its load dtype (bf16 under --mixed-precision bf16), as diffusers' LoRA training examples
    cast only the trainable parameters: FLUX.1-dev's 11.9B base weights take 24 GB in bf16, 48 GB in fp32.
    --gradient-checkpointing: diffusers' activation recomputation in the backward (same values, less memory).
    """
    denoiser = model.unet if model.kind == "sd1" else model.transformer
    if args.lora:
        add_lora(denoiser, args.lora_rank, args.lora_alpha)
        for p in denoiser.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    else:
        denoiser.float()
    if args.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    return denoiser.train()


def frozen_copy(module, dtype):
    """A frozen copy of `module` (the KL reference policy of full fine-tuning), in bf16 if `dtype` is bf16."""
    ref = copy.deepcopy(module).requires_grad_(False).eval()
    return ref.bfloat16() if dtype == torch.bfloat16 else ref  # (not .to(dtype): diffusers warns on it)


@contextlib.contextmanager
def base_weights(ref, lora: bool):
    """Inside the block `ref` computes the KL reference policy, the base model: with --lora `ref` is the trained
    (unwrapped) module and its adapter is switched off; in full fine-tuning it is a frozen_copy of the base."""
    if lora:
        ref.disable_adapters()
    try:
        yield ref
    finally:
        if lora:
            ref.enable_adapters()


@torch.no_grad()
def reference_velocity(model, ref, lora: bool, x, sigma, cond, guidance_scale):
    """Velocity (B, *L) of the KL reference policy (see base_weights)."""
    with base_weights(ref, lora):
        return model.velocity(ref, x, sigma, cond, guidance_scale)


def add_lora(transformer, rank: int, alpha: float, target_modules: list[str] | None = None):
    """Add a LoRA adapter (B = 0 at init, so outputs are unchanged) in place; base weights are frozen."""
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules or LORA_TARGETS)
    transformer.requires_grad_(False)
    transformer.add_adapter(config)  # diffusers PeftAdapterMixin: only the new lora_A/lora_B require grad
    return transformer


def save_trained_weights(model: FlowModel | DDIMModel, transformer, out_dir, lora: bool, state_dict=None):
    """Save what was trained. LoRA: `<Pipeline>.from_pretrained(base).load_lora_weights(out_dir)` reads it (ShapesBench:
    StableDiffusion3Pipeline). Full: out_dir/transformer (out_dir/unet for sd1), for `<ModelClass>.from_pretrained`.

    Pass the unwrapped denoiser (`accelerator.unwrap_model`); a `.module` wrapper (DDP) is unwrapped here. Under
    FSDP pass `state_dict=accelerator.get_state_dict(prepared)` (gathered on every process, full on the main one).
    Call it on the main process only.
    """
    transformer = getattr(transformer, "module", transformer)
    out_dir = Path(out_dir)
    if not lora:
        transformer.save_pretrained(out_dir / ("unet" if model.kind == "sd1" else "transformer"), state_dict=state_dict)
        return
    layers = get_peft_model_state_dict(transformer, state_dict=state_dict)
    metadata = transformer.peft_config["default"].to_dict()  # keeps lora_alpha, so the scale survives reloading
    if model.kind == "sd1":
        StableDiffusionPipeline.save_lora_weights(out_dir, unet_lora_layers=layers, unet_lora_adapter_metadata=metadata)
    else:
        pipe_cls = {"flux": FluxPipeline, "wan": WanPipeline}.get(model.kind, StableDiffusion3Pipeline)
        pipe_cls.save_lora_weights(out_dir, transformer_lora_layers=layers, transformer_lora_adapter_metadata=metadata)
