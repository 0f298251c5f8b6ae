"""The interface every model kind implements (common/models/__init__.py has the convention): the frozen parts and
their device, the batched classifier-free guidance, the VAE decode, and the checks of a size or a frame count."""

import math
from pathlib import Path

import torch

from common import InputError
from common.offload import Offloaded


def _cfg(forward, x, t, cond, get_uncond, scale, guide_below_one: bool = False):
    """Classifier-free guidance as diffusers does it: one batched forward on [uncond; cond] when scale > 1 (the
    pipelines' `do_classifier_free_guidance`), or with `guide_below_one` at every scale but 1 (diffusers'
    ClassifierFreeGuidance guider: its `_is_cfg_enabled` is `not math.isclose(scale, 1.0)`, so at 0.5 it returns the
    mean of the two predictions); a tensor `scale`, one per row, always guides. A key of `cond` that the unconditional
    encoding lacks (an edit's source latents: common/edits.py) is the same in both halves, as the editing pipelines'
    true CFG drops the instruction and keeps the image."""
    if not torch.is_tensor(scale) and (math.isclose(scale, 1.0) if guide_below_one else scale <= 1.0):
        return forward(x, t, cond)
    B, uncond = x.shape[0], get_uncond()
    both = {
        k: torch.cat([uncond[k].expand(B, *uncond[k].shape[1:]) if k in uncond else cond[k], cond[k]]) for k in cond
    }
    out_uncond, out_cond = forward(torch.cat([x, x]), torch.cat([t, t]), both).chunk(2)
    if torch.is_tensor(scale):  # one scale per row (B, 1, ...), in the outputs' dtype as a number would act
        scale = scale.to(out_cond.dtype)
    return out_uncond + scale * (out_cond - out_uncond)


def save_pretrained(module, folder, state_dict=None) -> None:
    """`module.save_pretrained(folder)`, the tensors taken from `state_dict` where one is given (FSDP's gathered full
    weights): diffusers' ModelMixin.save_pretrained has no state_dict argument (it swallows the keyword and saves the
    module's own tensors, under FSDP this process's shard), so the config and one safetensors file are written here,
    as save_pretrained names them, for `from_pretrained`."""
    if state_dict is None:
        return module.save_pretrained(folder)
    from safetensors.torch import save_file  # heavy only with the rest of a save

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    module.save_config(folder)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, folder / "diffusion_pytorch_model.safetensors")


def _vae_decode(vae, latents):
    """(B, C, h, w) model latents -> (B, 3, H, W) in [0, 1], differentiable w.r.t. latents."""
    shift = vae.config.shift_factor or 0.0  # SD3/FLUX VAEs are shifted, SD1.x ones (None) are not
    img = vae.decode((latents / vae.config.scaling_factor + shift).to(vae.dtype)).sample
    return ((img + 1) / 2).clamp(0, 1).to(latents.dtype)


def _unnormalise(z, vae_config):
    """A 3D VAE's latents (B, C, F, h, w) from the model's: z * latents_std + latents_mean per channel (Wan, Qwen-Image)."""
    view = (1, -1, 1, 1, 1)
    std = torch.tensor(vae_config.latents_std, device=z.device).view(view)
    return z * std + torch.tensor(vae_config.latents_mean, device=z.device).view(view)


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
        """Batch-first conditioning tensors of `prompts` on `device` (the text encoders visit it with --offload-frozen).
        Each distinct prompt is encoded once and its rows repeated: a GRPO group repeats its prompt G times, so the
        encoders' activations (the memory peak of some recipes) scale with the prompts, not the samples."""
        distinct = list(dict.fromkeys(prompts))  # first-seen order
        with self._text.visit():
            cond = self._encode(distinct)
        if len(distinct) == len(prompts):
            return cond
        row = {p: i for i, p in enumerate(distinct)}
        idx = torch.tensor([row[p] for p in prompts], device=self.device)  # (B,) into the distinct prompts' rows
        return {k: v[idx] for k, v in cond.items()}

    @classmethod
    def from_folder(cls, where: str, index: dict, dtype, resolution: int | None, num_frames: int | None = None):
        """The wrapper of a pipeline folder or hub id `where` (its model_index.json is `index`), all parts in `dtype`:
        the kind's diffusers pipeline loads it. A kind whose pipeline takes more (its own class per folder, a frame
        count) overrides this."""
        return cls(cls.pipeline.from_pretrained(where, dtype=dtype), resolution)

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

    @property
    def scheduler_config(self):
        """The folder's scheduler config (scheduler/scheduler_config.json), as the pipeline loaded it."""
        return self.pipe.scheduler.config

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The sigma grid (T + 1,), ending at 0, on which the model's own diffusers pipeline samples at this size in
        T steps (`--shift pipeline`): a fresh scheduler of the folder's class and config, set_timesteps as the
        pipeline's __call__ calls it (_pipeline_timesteps: its sigmas and mu), read back; float32 on the CPU."""
        scheduler = type(self.pipe.scheduler).from_config(self.scheduler_config)
        scheduler.set_timesteps(**self._pipeline_timesteps(num_steps))
        return scheduler.sigmas.float().cpu()

    def _pipeline_timesteps(self, num_steps: int) -> dict:
        """set_timesteps' arguments as the pipeline passes them; this default is WanPipeline's and (on a static
        config) StableDiffusion3Pipeline's: the step count alone."""
        return {"num_inference_steps": num_steps}

    def _io_dtype(self):
        return self.transformer.dtype  # wrapped copies passed to velocity() share the unwrapped one's dtype


def _dynamic_mu(calculate_shift, config, image_seq_len: int, max_shift: float = 1.15) -> float:
    """mu of a pipeline that shifts by resolution (FLUX.1, Qwen-Image, Z-Image, SD3): its own calculate_shift on the
    image's token count and the scheduler config, with the pipeline's defaults for keys the config lacks."""
    c = config
    return calculate_shift(
        image_seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
        c.get("max_shift", max_shift),
    )  # fmt: skip


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
