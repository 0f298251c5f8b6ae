"""The memory plan's model kinds: one Plan each (its published parts, and how common/models/ builds and calls
them), and the denoiser, VAE and reward calls the phases run. Part of benchmarks/gpu/memory.py, whose docstring
describes the plan.
"""

from __future__ import annotations

import contextlib
import json
import math
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from benchmarks.gpu.memory_configs import (
    BYT5_SMALL,
    CLIP_G,
    CLIP_L,
    CLIP_VIT_H14_VISION,
    FLUX2_DEV,
    FLUX2_KLEIN_4B,
    FLUX_DEV,
    GEMMA3_12B_LM,
    HPS,
    HPSV3_TEXT_TOKENS,
    HUNYUAN15,
    LTX23,
    MISTRAL_SMALL_31,
    QWEN3_4B,
    QWEN25_VL_7B,
    QWEN_EDIT_CONDITION_PATCHES,
    QWEN_EDIT_DROPPED,
    QWEN_EDIT_PICTURE_PREFIX,
    QWEN_EDIT_PICTURE_TOKENS,
    QWEN_EDIT_SUFFIX,
    QWEN_IMAGE,
    SD15_UNET,
    SD35_MEDIUM,
    T5_XXL,
    UMT5_XXL,
    VAE_4CH,
    VAE_16CH,
    VAE_FLUX2,
    VAE_HUNYUAN15,
    VAE_LTX23,
    VAE_QWEN,
    VAE_WAN,
    VAE_WAN22,
    WAN21_I2V_14B,
    WAN22_A14B_EXPERT,
    WAN22_I2V_A14B_EXPERT,
    WAN22_TI2V_5B,
    WAN_T2V_1_3B,
    Z_IMAGE,
)
from benchmarks.gpu.memory_fake import _WORLD, checkpoint_under_policy, encode_text


# ---------------------------------------------------------------------------------------------------
# Model kinds: one Plan each (its published parts, and how common/models/ builds and calls them)
# ---------------------------------------------------------------------------------------------------
@dataclass
class Shapes:
    """Tensor shapes of one model at one resolution (and frame count, for a video model)."""

    kind: str
    latent: tuple  # one image's latent as the scripts hold it (FLUX: packed tokens; Wan: (16, F', h, w))
    vae_latent: tuple  # what the VAE decodes
    image: tuple  # (3, H, W)
    cond: dict  # name -> per-prompt shape of the conditioning tensors
    frames: int | None = None  # a video's frames (video models); None for images
    cond_bytes: dict = field(default_factory=dict)  # bytes per element of a cond tensor not in the frozen dtype
    images: int = 0  # images a prompt brings (an edit's sources or references, a first frame)

    @property
    def sample(self) -> tuple:
        """One decoded sample as the scripts keep it: an image (3, H, W), or a video (F, 3, H, W), fp32."""
        return self.image if self.frames is None else (self.frames, *self.image)

    @staticmethod
    def of(kind: str, parts: dict, resolution, frames: int | None = None) -> "Shapes":
        """`resolution`: the side of a square image, or (height, width); `frames`: a video model's frame count."""
        height, width = (resolution, resolution) if isinstance(resolution, int) else resolution
        return PLANS[kind].shapes(kind, parts, height, width, frames)


def _full(rows: int, value: float, dtype=None):
    return torch.full((rows,), value, dtype=dtype)


class Plan:
    """A published checkpoint of one common.models kind (`model`): its parts at their published sizes (`parts`: the
    denoiser, its text encoders as (family, config, tokens per prompt as the pipeline pads them), the VAE, the reward
    model, the native resolution (side, or (height, width)), a video model's native frame count, the FSDP units when
    no accelerate config names them) and how common/models/ builds and calls them. A new kind is one subclass here,
    in PLANS, beside its module and REGISTRY entry in common/models/."""

    model: str  # its common.models kind: model_kind reads a folder's model_index.json through it
    name: str  # in the tables
    denoiser: str  # the diffusers class of its denoiser
    reads_values = False  # whether its forward reads input values (it then runs in fake_world only, not on meta)
    video = False  # (B, F, 3, H, W) samples; Wan's fp32 VAE
    cfg = True  # --guidance-scale > 1 doubles the rows (FLUX.1-dev and FLUX.2 [dev] embed it instead)
    clip_projection = False  # its CLIP text encoders have a projection (SD3's)
    lora_targets = None  # what --lora adapts, where the model's wrapper says other than LORA_TARGETS
    encodes_images = False  # its prompts' encoding reads their images (encode): the VAE is on the GPU then

    def __init__(self, **parts):
        self.parts = parts

    def folder(self, index: dict) -> bool:
        """Whether a folder of `model`'s pipeline class (its model_index.json `index`) is this checkpoint."""
        return True

    def hub(self, name: str) -> bool:
        """Whether a hub id (lower case) is this checkpoint."""
        raise NotImplementedError

    def vae(self, config: dict, dtype):
        """The VAE in the dtype the scripts decode in (the frozen dtype)."""
        from diffusers import AutoencoderKL

        return AutoencoderKL(**config).to(dtype).eval()

    def shapes(self, kind: str, parts: dict, height: int, width: int, frames: int | None) -> Shapes:
        raise NotImplementedError

    def forward(self, shapes: Shapes, module, x, cond: dict, dt):
        """One denoiser forward as the kind's velocity / eps calls it; `cond` in the module's dtype `dt`."""
        raise NotImplementedError

    def encode(self, shapes: Shapes, encoders, vae, prompts: int):
        """encode_prompts on `prompts` distinct prompts (no grad), as the kind's _encode runs it: every text encoder
        on them at once (encoders: (family, module, tokens)); a kind whose prompts bring images encodes those too."""
        encode_text(encoders, prompts)

    def unpack(self, shapes: Shapes, latents):
        """The scripts' latents (B, *shapes.latent) as the VAE takes them (B, *shapes.vae_latent)."""
        return latents

    def decode(self, vae, shapes: Shapes, latents):
        """common.models.base._vae_decode: (B, *vae latent) -> images (B, 3, H, W) fp32 in [0, 1]."""
        img = vae.decode(latents.to(next(vae.parameters()).dtype)).sample
        return ((img + 1) / 2).clamp(0, 1).float()


def _square_vae(parts: dict, height: int) -> tuple[int, tuple]:
    """The side of an AutoencoderKL latent and its shape (channels, side, side)."""
    vae = parts["vae"]
    side = height // 2 ** (len(vae["block_out_channels"]) - 1)
    return side, (vae["latent_channels"], side, side)


class FluxPlan(Plan):
    model, name, denoiser, cfg = "flux", "FLUX.1-dev", "FluxTransformer2DModel", False  # guidance embedded

    def hub(self, name):
        return "flux" in name and "flux.2" not in name and "kontext" not in name

    def shapes(self, kind, parts, height, width, frames):
        den, (side, vae_latent) = parts["denoiser"], _square_vae(parts, height)
        latent = ((side // 2) ** 2, den["in_channels"])  # 2x2 patches packed into tokens
        t5_tokens = [n for fam, _, n in parts["text"] if fam == "t5"][0]
        cond = {"prompt_embeds": (t5_tokens, den["joint_attention_dim"]), "pooled": (den["pooled_projection_dim"],)}
        return Shapes(kind, latent, vae_latent, (3, height, width), cond)

    def forward(self, shapes, module, x, cond, dt):
        rows, tokens = len(x), shapes.cond["prompt_embeds"][0]
        return module(
            hidden_states=x.to(dt), timestep=_full(rows, 0.5, dt), guidance=_full(rows, 3.5),
            pooled_projections=cond["pooled"], encoder_hidden_states=cond["prompt_embeds"],
            txt_ids=torch.zeros(tokens, 3, dtype=dt), img_ids=torch.zeros(x.shape[1], 3, dtype=dt), return_dict=False,
        )[0]  # fmt: skip

    def unpack(self, shapes, latents):
        from diffusers import FluxPipeline

        side = shapes.image[-1]
        return FluxPipeline._unpack_latents(latents, side, side, side // shapes.vae_latent[-1])


class KontextPlan(FluxPlan):
    """common.models.kontext.FluxKontextModel: FLUX.1-dev's transformer on [noisy tokens; source tokens], the source
    cut to the run's square (as many tokens as the noise: the sequence doubles), ids of first coordinate 1, the output
    cut to the noisy tokens; embedded guidance, no CFG. Encoding a prompt also VAE-encodes its source (the VAE's mode,
    shifted and scaled, packed), every distinct prompt's at once, in the frozen dtype; the packed source tokens are
    part of each row's conditioning."""

    model, name, encodes_images = "kontext", "FLUX.1-Kontext-dev", True

    def hub(self, name):
        return "kontext" in name

    def shapes(self, kind, parts, height, width, frames):
        shapes = super().shapes(kind, parts, height, width, frames)
        shapes.cond["image_latents"] = shapes.latent  # (seq, 64): the source's packed tokens
        shapes.images = 1
        return shapes

    def forward(self, shapes, module, x, cond, dt):  # FluxKontextModel.velocity
        rows, tokens, seq = len(x), shapes.cond["prompt_embeds"][0], x.shape[1]
        return module(
            hidden_states=torch.cat([x.to(dt), cond["image_latents"].to(dt)], 1), timestep=_full(rows, 0.5, dt),
            guidance=_full(rows, 2.5), pooled_projections=cond["pooled"], encoder_hidden_states=cond["prompt_embeds"],
            txt_ids=torch.zeros(tokens, 3, dtype=dt), img_ids=torch.zeros(2 * seq, 3, dtype=dt), return_dict=False,
        )[0][:, :seq]  # fmt: skip

    def encode(self, shapes, encoders, vae, prompts):  # FluxKontextModel._encode: text, then the sources at once
        from diffusers import FluxPipeline

        super().encode(shapes, encoders, vae, prompts)
        with torch.no_grad():
            pixels = torch.zeros(prompts, *shapes.image, dtype=next(vae.parameters()).dtype)
            z = (vae.encode(pixels).latent_dist.mode() - 0.1159) * 0.3611  # the posterior's mode, shifted, scaled
            return FluxPipeline._pack_latents(z, prompts, *z.shape[1:])


class SD3Plan(Plan):
    model, name, denoiser, clip_projection = "sd3", "SD3.5-M", "SD3Transformer2DModel", True

    def hub(self, name):
        return "stable-diffusion-3.5" in name and "large" not in name

    def shapes(self, kind, parts, height, width, frames):
        den, (_, vae_latent) = parts["denoiser"], _square_vae(parts, height)
        tokens = 77 + [n for fam, _, n in parts["text"] if fam == "t5"][0]  # CLIP-L+G and T5 tokens, concatenated
        cond = {"prompt_embeds": (tokens, den["joint_attention_dim"]), "pooled": (den["pooled_projection_dim"],)}
        return Shapes(kind, vae_latent, vae_latent, (3, height, width), cond)

    def forward(self, shapes, module, x, cond, dt):
        return module(
            hidden_states=x.to(dt), timestep=_full(len(x), 500.0), encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled"], return_dict=False,
        )[0]  # fmt: skip


class SD1Plan(Plan):
    model, name, denoiser = "sd1", "SD1.5", "UNet2DConditionModel"

    def hub(self, name):
        return "stable-diffusion-v1" in name

    def shapes(self, kind, parts, height, width, frames):
        _, vae_latent = _square_vae(parts, height)
        cond = {"prompt_embeds": (77, parts["denoiser"].get("cross_attention_dim", 1280))}
        return Shapes(kind, vae_latent, vae_latent, (3, height, width), cond)

    def forward(self, shapes, module, x, cond, dt):
        t = torch.full((len(x),), 500, dtype=torch.long)
        return module(x.to(dt), t, encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]


class Flux2Plan(Plan):
    model, name, denoiser = "flux2", "FLUX.2-klein-4B", "Flux2Transformer2DModel"  # [klein] base: CFG with ""

    @property
    def lora_targets(self):  # its adapter also covers the single blocks' fused Linears
        from common.models import Flux2Model

        return Flux2Model.lora_targets

    def folder(self, index):
        return index.get("_class_name") == "Flux2KleinPipeline"

    def hub(self, name):
        return "flux.2-klein" in name and "9b" not in name

    def vae(self, config, dtype):
        from diffusers import AutoencoderKLFlux2

        return AutoencoderKLFlux2(**config).to(dtype).eval()

    def shapes(self, kind, parts, height, width, frames):  # 8x, 2x2 patchified into tokens of 4 x 32
        h, w = height // 8, width // 8
        text = parts["text"][0]  # 3 stacked hidden states, 512 tokens
        hidden = text[1].get("text_config", text[1])["hidden_size"]  # [dev]: Mistral3's language model
        cond = {"prompt_embeds": (text[2], 3 * hidden)}
        return Shapes(
            kind, ((h // 2) * (w // 2), parts["denoiser"]["in_channels"]), (32, h, w), (3, height, width), cond
        )

    def forward(self, shapes, module, x, cond, dt):  # Flux2Model.velocity: timestep = sigma, 4-axis ids
        rows, tokens = len(x), shapes.cond["prompt_embeds"][0]
        return module(
            hidden_states=x.to(dt), timestep=_full(rows, 0.5, dt), guidance=None if self.cfg else _full(rows, 4.0, dt),
            encoder_hidden_states=cond["prompt_embeds"], txt_ids=torch.zeros(tokens, 4, dtype=torch.long),
            img_ids=torch.zeros(x.shape[1], 4, dtype=torch.long), return_dict=False,
        )[0]  # fmt: skip

    def decode(self, vae, shapes, latents):  # Flux2Model.decode itself: BatchNorm statistics, un-patchify, decode
        from diffusers import Flux2KleinPipeline

        from common.models import Flux2Model
        from common.offload import Offloaded

        holder = types.SimpleNamespace(vae=vae, _vae=Offloaded([vae], "cpu", False), pipe=Flux2KleinPipeline)
        holder.grid = (shapes.vae_latent[1] // 2, shapes.vae_latent[2] // 2)
        holder._vae_latents = lambda x: Flux2Model._vae_latents(holder, x)
        return Flux2Model.decode(holder, latents)


class Flux2DevPlan(Flux2Plan):
    name, cfg = "FLUX.2-dev", False  # guidance embedded

    def folder(self, index):
        return index.get("_class_name") != "Flux2KleinPipeline"

    def hub(self, name):
        return "flux.2-dev" in name


class QwenPlan(Plan):
    model, name, denoiser = "qwen", "Qwen-Image", "QwenImageTransformer2DModel"

    def hub(self, name):
        return "qwen-image" in name and not any(k in name for k in ("edit", "2.1", "layered"))

    def vae(self, config, dtype):
        from diffusers import AutoencoderKLQwenImage

        return AutoencoderKLQwenImage(**config).to(dtype).eval()

    def shapes(self, kind, parts, height, width, frames):  # 8x, 2x2 patches packed into tokens of 4 x 16
        den, vae = parts["denoiser"], parts["vae"]
        h, w = height // 2 ** len(vae["temperal_downsample"]), width // 2 ** len(vae["temperal_downsample"])
        tokens = parts["text"][0][2] - 34  # the template's system part is dropped
        cond = {"prompt_embeds": (tokens, den["joint_attention_dim"]), "prompt_embeds_mask": (tokens,)}
        latent = ((h // 2) * (w // 2), den["in_channels"])
        return Shapes(kind, latent, (vae["z_dim"], 1, h, w), (3, height, width), cond)  # the 3D VAE's one frame

    def forward(self, shapes, module, x, cond, dt):  # QwenImageModel.velocity: timestep = sigma, the text mask
        rows, side = len(x), int(math.isqrt(x.shape[1]))
        return module(
            hidden_states=x.to(dt), timestep=_full(rows, 0.5, dt), encoder_hidden_states=cond["prompt_embeds"],
            encoder_hidden_states_mask=torch.ones(rows, cond["prompt_embeds"].shape[1]),
            img_shapes=[[(1, side, side)]] * rows, return_dict=False,
        )[0]  # fmt: skip

    def decode(self, vae, shapes, latents):
        from common.models import QwenImageModel
        from common.offload import Offloaded

        side = shapes.image[-1]
        holder = types.SimpleNamespace(vae=vae, _vae=Offloaded([vae], "cpu", False), height=side, width=side)
        holder.vae_scale = side // shapes.vae_latent[-1]
        return QwenImageModel.decode(holder, latents)


class QwenEditPlan(QwenPlan):
    """common.models.qwenimage_edit.QwenImageEditModel (Qwen-Image-Edit-2509 / -2511): Qwen-Image's transformer on
    [noisy tokens; each reference's tokens] (each reference cut to the run's square: as many tokens as the noise), the
    output cut to the noisy tokens; true CFG as one batch of [negative; prompt] rows padded to the prompt's text length.
    parts["images"]: references per prompt (1 to 3). Encoding a prompt runs Qwen2.5-VL with its references twice, for
    the instruction and for the negative prompt " " (one prompt per call, as the pipeline), each reference read by the
    vision tower at the condition size; then the VAE encodes each reference alone, in the frozen dtype. Each row's
    conditioning holds both embeddings, their masks and the references' tokens."""

    model, name, encodes_images = "qwen-edit", "Qwen-Image-Edit-2509", True

    def hub(self, name):
        return "qwen-image-edit-25" in name  # the Plus pipeline's checkpoints (2509, 2511); not Qwen-Image-Edit

    def text_tokens(self, parts, instruction: int) -> int:
        """Positions kept of an encoding (the system turn dropped): each reference's picture tokens, the
        instruction's `instruction` tokens, the template's end."""
        return parts["images"] * QWEN_EDIT_PICTURE_TOKENS + instruction + QWEN_EDIT_SUFFIX

    def shapes(self, kind, parts, height, width, frames):
        shapes = super().shapes(kind, parts, height, width, frames)
        n, hidden = parts["images"], parts["denoiser"]["joint_attention_dim"]
        tokens, negative = self.text_tokens(parts, parts["text"][0][2]), self.text_tokens(parts, 1)  # " ": 1 token
        shapes.cond = {
            "prompt_embeds": (tokens, hidden), "prompt_embeds_mask": (tokens,),
            "negative_prompt_embeds": (negative, hidden), "negative_prompt_embeds_mask": (negative,),
            "image_latents": (n * shapes.latent[0], shapes.latent[1]), "image_count": (),
        }  # fmt: skip
        shapes.cond_bytes = {k: 8 for k in ("prompt_embeds_mask", "negative_prompt_embeds_mask", "image_count")}
        shapes.images = n
        return shapes

    def forward(self, shapes, module, x, cond, dt):  # QwenImageEditModel._forward_rows on rows bringing n images
        rows, seq, n = len(x), x.shape[1], shapes.images
        side = int(math.isqrt(seq))
        return module(
            hidden_states=torch.cat([x.to(dt), cond["image_latents"].to(dt)], 1), timestep=_full(rows, 0.5, dt),
            encoder_hidden_states=cond["prompt_embeds"],
            encoder_hidden_states_mask=torch.ones(rows, cond["prompt_embeds"].shape[1]),
            img_shapes=[[(1, side, side)] * (1 + n)] * rows, return_dict=False,
        )[0][:, :seq]  # fmt: skip

    def encode(self, shapes, encoders, vae, prompts):
        """QwenImageEditModel._encode, prompt by prompt: the VL model on the instruction's and the negative's template
        with the references (qwen_vl_encode), then each reference VAE-encoded alone (its mode, normalised, packed)."""
        from diffusers import QwenImagePipeline

        (_, vl, instruction), n = encoders[0], shapes.images
        parts = {"images": n}
        dt, (_, h, w) = next(vae.parameters()).dtype, shapes.vae_latent[-3:]
        kept = []
        with torch.no_grad():
            for _ in range(prompts):
                for length in (self.text_tokens(parts, instruction), self.text_tokens(parts, 1)):
                    kept.append(qwen_vl_encode(vl, n, QWEN_EDIT_DROPPED + length))
                for _ in range(n):
                    z = vae.encode(torch.zeros(1, 3, 1, *shapes.image[1:], dtype=dt)).latent_dist.mode()
                    kept.append(QwenImagePipeline._pack_latents(z - 0.5, 1, z.shape[1], h, w))
        return kept


def qwen_vl_encode(model, images: int, length: int):
    """QwenImageEditPlusPipeline._get_qwen_prompt_embeds on one prompt of `length` positions bringing `images`
    condition images (no grad): Qwen2.5-VL's vision tower on the images' patches, then the language model with every
    hidden state. What the model reads as values (the token ids: where each picture's vision tokens are; the image
    grid; the vision tower's window and position indices, made here from the grid as the tower makes them) is real;
    the rest is fake. Returns the last hidden state past the dropped system turn."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from transformers import vision_utils

    config, visual, (gh, gw) = model.config, model.model.visual, QWEN_EDIT_CONDITION_PATCHES
    merged, merge = gh * gw // 4, visual.spatial_merge_size
    with unset_fake_temporarily():  # real values
        ids, at = torch.zeros(1, length, dtype=torch.long), QWEN_EDIT_DROPPED
        for _ in range(images):  # "Picture k: " then <|vision_start|>, the image's tokens, <|vision_end|>
            at += QWEN_EDIT_PICTURE_PREFIX
            ids[0, at], ids[0, at + 1 + merged] = config.vision_start_token_id, config.vision_end_token_id
            ids[0, at + 1 : at + 1 + merged] = config.image_token_id
            at += 2 + merged
        grid, mask = torch.tensor([[1, gh, gw]] * images), torch.ones(1, length, dtype=torch.long)
        window, cu_window = vision_utils.get_vision_window_index(grid, merge, visual.window_size, visual.patch_size)
        positions = vision_utils.get_vision_position_ids(grid, merge)
        index = dict(window_index=window, cu_window_seqlens=cu_window, position_ids=positions,
                     cu_seqlens=vision_utils.get_vision_cu_seqlens(grid))  # fmt: skip
    vision = config.vision_config
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    with _constants(4 * max(length, images * gh * gw)) as constant:
        grid = constant(grid)
        pixels = torch.zeros(images * gh * gw, patch).type(visual.dtype)  # get_image_features' cast of the patches
        out = visual(pixels, grid_thw=grid, **{k: constant(v) for k, v in index.items()})
        out.pooler_output = torch.split(out.pooler_output, [merged] * images)
        out = model(
            input_ids=constant(ids), attention_mask=constant(mask), image_grid_thw=grid,
            mm_encoder_outputs={"image": out}, output_hidden_states=True,
        )  # fmt: skip
        return out.hidden_states[-1][:, QWEN_EDIT_DROPPED:]


class ZImagePlan(Plan):
    model, name, denoiser = "zimage", "Z-Image", "ZImageTransformer2DModel"

    def hub(self, name):
        return "z-image" in name

    def shapes(self, kind, parts, height, width, frames):  # the VAE latent itself (the transformer patchifies it)
        _, vae_latent = _square_vae(parts, height)
        tokens = parts["text"][0][2]  # padded captions
        cond = {"prompt_embeds": (tokens, parts["denoiser"]["cap_feat_dim"]), "prompt_embeds_mask": (tokens,)}
        return Shapes(kind, vae_latent, vae_latent, (3, height, width), cond)

    def forward(self, shapes, module, x, cond, dt):  # ZImageModel.velocity: lists of (C, 1, h, w) and captions
        outs = module(
            list(x.to(dt).unsqueeze(2).unbind(0)), _full(len(x), 0.5, dt), list(cond["prompt_embeds"].unbind(0)),
            return_dict=False,
        )[0]  # fmt: skip
        return torch.stack([o.float() for o in outs]).squeeze(2)


class WanPlan(Plan):
    model, name, denoiser, video = "wan", "Wan2.1-1.3B", "WanTransformer3DModel", True

    def folder(self, index):
        return not index.get("expand_timesteps") and (index.get("transformer_2") or [None])[0] is None

    def hub(self, name):
        return "wan" in name and not any(k in name for k in ("14b", "wan2.2", "i2v"))

    def vae(self, config, dtype):  # fp32, as common.models.WanModel.to keeps it
        from diffusers import AutoencoderKLWan

        return AutoencoderKLWan(**config).float().eval()

    def shapes(self, kind, parts, height, width, frames):  # WanPipeline: vae_scale_factor_spatial / _temporal
        vae = parts["vae"]
        scale = vae.get("scale_factor_spatial", 2 ** len(vae["temperal_downsample"]))
        t_scale = 2 ** sum(vae["temperal_downsample"])
        latent = (vae["z_dim"], (frames - 1) // t_scale + 1, height // scale, width // scale)
        cond = {"prompt_embeds": (parts["text"][0][2], parts["denoiser"]["text_dim"])}  # UMT5 tokens, zero-padded
        return Shapes(kind, latent, latent, (3, height, width), cond, frames)

    def timestep(self, x):  # WanModel.velocity: 1000 sigma (fp32)
        return _full(len(x), 500.0)

    def forward(self, shapes, module, x, cond, dt):
        return module(
            hidden_states=x.to(dt), timestep=self.timestep(x), encoder_hidden_states=cond["prompt_embeds"],
            return_dict=False,
        )[0]  # fmt: skip

    def decode(self, vae, shapes, latents):  # WanModel.decode itself: one video at a time, fp32
        from common.models import WanModel
        from common.offload import Offloaded

        return WanModel.decode(types.SimpleNamespace(vae=vae, _vae=Offloaded([vae], "cpu", False)), latents)


class Wan22Plan(WanPlan):
    name = "Wan2.2-5B"

    def folder(self, index):
        return bool(index.get("expand_timesteps"))

    def hub(self, name):
        return "wan2.2-ti2v-5b" in name

    def timestep(self, x):  # one timestep per token: (rows, F' x h/2 x w/2)
        return super().timestep(x)[:, None].expand(-1, x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2))


class Wan22A14BPlan(WanPlan):
    name = "Wan2.2-A14B"  # one expert's denoiser (parts' experts: how many)

    def folder(self, index):
        return (index.get("transformer_2") or [None])[0] is not None

    def hub(self, name):
        return "wan2.2-t2v-a14b" in name


class WanI2VPlan(WanPlan):
    """common.models.wan_i2v.WanI2VModel (Wan2.1-I2V-14B-480P / -720P): WanModel's latents, the transformer fed them
    channel-concatenated with the first frame's condition (4 mask + 16 latent channels: 36 in), and the first frame's
    CLIP tokens (257 x 1280, the image encoder's penultimate hidden state) through the cross-attention's added keys and
    values; CFG rows as WanModel's, the condition and the image tokens in both halves. Encoding a prompt runs UMT5,
    the CLIP vision tower on the first frame (it travels with the text encoders) and the fp32 VAE on the whole
    [frame, F - 1 zero frames] video, one video at a time; the condition is kept in fp32, as the pipeline makes it."""

    model, name, encodes_images = "wan-i2v", "Wan2.1-I2V-14B", True

    def folder(self, index):
        return (index.get("transformer_2") or [None])[0] is None

    def hub(self, name):
        return "i2v" in name and "wan2.1" in name

    def shapes(self, kind, parts, height, width, frames):
        shapes = super().shapes(kind, parts, height, width, frames)
        (C, *grid), t_scale = shapes.latent, 2 ** sum(parts["vae"]["temperal_downsample"])
        shapes.cond["image_condition"], shapes.cond_bytes["image_condition"] = (t_scale + C, *grid), 4
        for family, config, _ in parts["text"]:
            if family == "clip_vision":  # its patches and the class token (257 for ViT-H/14 at 224 px)
                tokens = (config["image_size"] // config["patch_size"]) ** 2 + 1
                shapes.cond["image_embeds"] = (tokens, config["hidden_size"])
        shapes.images = 1
        return shapes

    def forward(self, shapes, module, x, cond, dt):  # WanI2VModel.velocity
        image = {"encoder_hidden_states_image": cond["image_embeds"]} if "image_embeds" in cond else {}
        return module(
            hidden_states=torch.cat([x.to(dt), cond["image_condition"].to(dt)], 1), timestep=self.timestep(x),
            encoder_hidden_states=cond["prompt_embeds"], return_dict=False, **image,
        )[0]  # fmt: skip

    def encode(self, shapes, encoders, vae, prompts):
        """WanI2VModel._encode: UMT5 on the prompts, CLIP's vision tower on their first frames at once (every hidden
        state), then each [frame, zeros] video VAE-encoded alone in fp32 (its mode, normalised) and the mask."""
        super().encode(shapes, encoders, vae, prompts)
        kept = []
        with torch.no_grad():
            for family, module, _ in encoders:
                if family == "clip_vision":
                    side, dt = module.config.image_size, next(module.parameters()).dtype
                    out = module(pixel_values=torch.zeros(prompts, 3, side, side, dtype=dt), output_hidden_states=True)
                    kept.append(out.hidden_states[-2])
            C, F, h, w = shapes.latent
            for _ in range(prompts):
                video = torch.zeros(1, 3, shapes.frames, *shapes.image[1:], dtype=next(vae.parameters()).dtype)
                kept.append(vae.encode(video).latent_dist.mode().float() - 0.5)
            kept.append(torch.zeros(prompts, shapes.cond["image_condition"][0] - C, F, h, w))  # the mask
        return kept


class WanI2VA14BPlan(WanI2VPlan):
    name = "Wan2.2-I2V-A14B"  # one expert's denoiser (parts' experts: 2); no image encoder

    def folder(self, index):
        return (index.get("transformer_2") or [None])[0] is not None

    def hub(self, name):
        return "wan2.2-i2v-a14b" in name


class LTX2Plan(Plan):
    """common.models.ltx2.LTX2Model: the state is the video tokens (F' h' w', 128) and the audio tokens (round(F / 24
    x 25), 128) in one sequence, both through the joint transformer; only the video half is decoded (its own VAE, in
    the frozen dtype, one video at a time)."""

    model, name, denoiser, video = "ltx2", "LTX-2.3", "LTX2VideoTransformer3DModel", True

    def hub(self, name):
        return "ltx-2" in name

    def vae(self, config, dtype):
        from diffusers import AutoencoderKLLTX2Video

        return AutoencoderKLLTX2Video(**config).to(dtype).eval()

    def shapes(self, kind, parts, height, width, frames):
        vae, den = parts["vae"], parts["denoiser"]
        grid = ((frames - 1) // vae["temporal_compression_ratio"] + 1, height // vae["spatial_compression_ratio"],
                width // vae["spatial_compression_ratio"])  # fmt: skip
        audio = round(frames / 24.0 * 16000 / 160 / 4)  # LTX2Pipeline's audio latent frames at 24 fps
        latent = (grid[0] * grid[1] * grid[2] + audio, den["in_channels"])
        tokens = parts["text"][0][2]
        inner, audio_inner = (den["num_attention_heads"] * den["attention_head_dim"],
                              den["audio_num_attention_heads"] * den["audio_attention_head_dim"])  # fmt: skip
        cond = {"prompt_embeds": (tokens, inner), "audio_prompt_embeds": (tokens, audio_inner),
                "attention_mask": (tokens,)}  # fmt: skip
        shapes = Shapes(kind, latent, (vae["latent_channels"], *grid), (3, height, width), cond, frames)
        shapes.grid, shapes.audio = grid, audio
        return shapes

    def forward(self, shapes, module, x, cond, dt):  # LTX2Model.velocity: t = 1000 sigma as timestep and sigma
        n, t = x.shape[1] - shapes.audio, _full(len(x), 500.0, dt)
        video, audio = module(
            hidden_states=x[:, :n].to(dt), audio_hidden_states=x[:, n:].to(dt),
            encoder_hidden_states=cond["prompt_embeds"], audio_encoder_hidden_states=cond["audio_prompt_embeds"],
            timestep=t, sigma=t, encoder_attention_mask=torch.ones(len(x), cond["attention_mask"].shape[1]),
            audio_encoder_attention_mask=torch.ones(len(x), cond["attention_mask"].shape[1]), num_frames=shapes.grid[0],
            height=shapes.grid[1], width=shapes.grid[2], fps=24.0, audio_num_frames=shapes.audio,
            use_cross_timestep=True, return_dict=False,
        )  # fmt: skip
        return torch.cat([video, audio], dim=1)

    def unpack(self, shapes, latents):  # the video tokens (B, F' h' w', C) -> (B, C, F', h', w')
        f, h, w = shapes.grid
        return latents[:, : f * h * w].unflatten(1, (f, h, w)).permute(0, 4, 1, 2, 3)

    def decode(self, vae, shapes, latents):  # LTX2Model.decode: one video at a time -> (B, F, 3, H, W)
        dt = next(vae.parameters()).dtype
        video = torch.cat([vae.decode(z.unsqueeze(0).to(dt), None, return_dict=False)[0] for z in latents])
        return ((video + 1) / 2).clamp(0, 1).float().transpose(1, 2)


class Hunyuan15Plan(Plan):
    """common.models.hunyuan15.HunyuanVideo15Model: latents (32, F', H/16, W/16), the transformer fed (65, F', h, w)
    and 729 zero image tokens; the VAE in the frozen dtype, one video at a time."""

    model, name, denoiser, video = "hunyuan15", "HunyuanVideo-1.5", "HunyuanVideo15Transformer3DModel", True
    reads_values = True

    def hub(self, name):
        return "hunyuanvideo-1.5" in name

    def vae(self, config, dtype):
        from diffusers import AutoencoderKLHunyuanVideo15

        return AutoencoderKLHunyuanVideo15(**config).to(dtype).eval()

    def shapes(self, kind, parts, height, width, frames):  # the published sizes are the classes' defaults
        vae, den = parts["vae"], parts["denoiser"]
        s, t = vae.get("spatial_compression_ratio", 16), vae.get("temporal_compression_ratio", 4)
        latent = (vae.get("latent_channels", 32), (frames - 1) // t + 1, height // s, width // s)
        cond = {"prompt_embeds": (1000, den.get("text_embed_dim", 3584)), "mask": (1000,),
                "prompt_embeds_2": (256, den.get("text_embed_2_dim", 1472)), "mask_2": (256,)}  # fmt: skip
        shapes = Shapes(kind, latent, latent, (3, height, width), cond, frames)
        shapes.image_embeds = (729, den.get("image_embed_dim", 1152))  # made at every call, not kept
        return shapes

    def forward(self, shapes, module, x, cond, dt):  # HunyuanVideo15Model.velocity
        """The transformer reads values: whether the image embeddings are all zero (text-to-video: it then makes
        their mask zero) and the three masks, whose valid tokens it moves first. Those are real values here
        (constants of the fake world, the masks it makes itself too); the activations stay fake."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        x, B = x.to(dt), len(x)
        with unset_fake_temporarily():
            image, masks = torch.zeros(B, *shapes.image_embeds, dtype=dt), (torch.ones(B, 1000), torch.ones(B, 256))
        with _constants(2 * image.numel()) as constant, _RealFactories(constant):
            return module(
                hidden_states=torch.cat([x, torch.zeros_like(x), x.new_zeros(B, 1, *x.shape[2:])], dim=1),
                image_embeds=constant(image), timestep=_full(B, 500.0, dt),
                encoder_hidden_states=cond["prompt_embeds"], encoder_attention_mask=constant(masks[0]),
                encoder_hidden_states_2=cond["prompt_embeds_2"], encoder_attention_mask_2=constant(masks[1]),
                return_dict=False,
            )[0]  # fmt: skip

    def decode(self, vae, shapes, latents):  # HunyuanVideo15Model.decode: one video at a time -> (B, F, 3, H, W)
        dt = next(vae.parameters()).dtype
        video = torch.cat([vae.decode(z.unsqueeze(0).to(dt), return_dict=False)[0] for z in latents])
        return ((video + 1) / 2).clamp(0, 1).float().transpose(1, 2)


PLANS = {
    "flux": FluxPlan(
        denoiser=FLUX_DEV, text=[("clip", CLIP_L, 77), ("t5", T5_XXL, 512)], vae=VAE_16CH, reward=HPS,
        resolution=1024, fsdp_units=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
    ),  # FluxPipeline pads prompts to 512 T5 tokens
    "kontext": KontextPlan(
        denoiser=FLUX_DEV, text=[("clip", CLIP_L, 77), ("t5", T5_XXL, 512)], vae=VAE_16CH, reward=HPS,
        resolution=1024, fsdp_units=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
    ),  # FLUX.1-Kontext-dev: FLUX.1-dev's architecture and parts; FluxKontextPipeline pads to 512 T5 tokens, ~1 MP
    "sd3": SD3Plan(
        denoiser=SD35_MEDIUM, text=[("clip", CLIP_L, 77), ("clip", CLIP_G, 77), ("t5", T5_XXL, 256)], vae=VAE_16CH,
        reward=HPS, resolution=1024, fsdp_units=("JointTransformerBlock",),
    ),  # StableDiffusion3Pipeline: 256 T5 tokens
    "sd1": SD1Plan(
        denoiser=SD15_UNET, text=[("clip", CLIP_L, 77)], vae=VAE_4CH, reward=HPS, resolution=512,
        fsdp_units=("BasicTransformerBlock", "ResnetBlock2D"),
    ),
    "flux2": Flux2Plan(
        denoiser=FLUX2_KLEIN_4B, text=[("qwen3", QWEN3_4B, 512)], vae=VAE_FLUX2, reward=HPS, resolution=1024,
        fsdp_units=("Flux2TransformerBlock", "Flux2SingleTransformerBlock"),
    ),  # Flux2KleinPipeline: prompts padded to 512 tokens, 1024 px; the base model's CFG with ""
    "flux2_dev": Flux2DevPlan(
        denoiser=FLUX2_DEV, text=[("mistral3", MISTRAL_SMALL_31, 512)], vae=VAE_FLUX2, reward=HPS, resolution=1024,
        fsdp_units=("Flux2TransformerBlock", "Flux2SingleTransformerBlock"),
    ),  # Flux2Pipeline: prompts padded to 512 tokens, guidance embedded (no CFG)
    "qwen": QwenPlan(
        denoiser=QWEN_IMAGE, text=[("qwen25vl", QWEN25_VL_7B, 34 + 256)], vae=VAE_QWEN, reward=HPS, resolution=1328,
        fsdp_units=("QwenImageTransformerBlock",),
    ),  # QwenImagePipeline: the template's 34 tokens + the prompt's (the longest in the batch; 256 here), 1328 px
    "qwen-edit": QwenEditPlan(
        denoiser=QWEN_IMAGE, text=[("qwen25vl", QWEN25_VL_7B, 256)], vae=VAE_QWEN, reward=HPS, resolution=1024,
        images=1, fsdp_units=("QwenImageTransformerBlock",),
    ),  # QwenImageEditPlusPipeline: an instruction of 256 tokens (as Qwen-Image's prompt) and 1 reference (up to 3),
        # 1024 px (its VAE_IMAGE_SIZE)
    "wan": WanPlan(
        denoiser=WAN_T2V_1_3B, text=[("umt5", UMT5_XXL, 512)], vae=VAE_WAN, reward=HPS, resolution=(480, 832),
        frames=81, fsdp_units=("WanTransformerBlock",),
    ),  # WanPipeline: 512 UMT5 tokens, 480 x 832, 81 frames by default
    "wan22": Wan22Plan(
        denoiser=WAN22_TI2V_5B, text=[("umt5", UMT5_XXL, 512)], vae=VAE_WAN22, reward=HPS, resolution=(704, 1280),
        frames=121, fsdp_units=("WanTransformerBlock",),
    ),  # Wan2.2-TI2V-5B's own 720p: 704 x 1280, 121 frames (5 s at 24 fps); one timestep per token
    "zimage": ZImagePlan(
        denoiser=Z_IMAGE, text=[("qwen3", QWEN3_4B, 256)], vae=VAE_16CH, reward=HPS, resolution=1024,
        fsdp_units=("ZImageTransformerBlock",),
    ),  # ZImagePipeline: captions as long as the batch's longest prompt after the chat template (256 here), 1024 px
    "wan22_a14b": Wan22A14BPlan(
        denoiser=WAN22_A14B_EXPERT, text=[("umt5", UMT5_XXL, 512)], vae=VAE_WAN, reward=HPS, resolution=(480, 832),
        frames=81, fsdp_units=("WanTransformerBlock",), experts=2,
    ),  # two experts, one of them in each forward (common.models.wan.WanExperts): weights, adapter, gradients and
        # AdamW state twice, activations once
    "wan-i2v": WanI2VPlan(
        denoiser=WAN21_I2V_14B, text=[("umt5", UMT5_XXL, 512), ("clip_vision", CLIP_VIT_H14_VISION, 257)],
        vae=VAE_WAN, reward=HPS, resolution=(480, 832), frames=81, fsdp_units=("WanTransformerBlock",),
    ),  # WanImageToVideoPipeline: 512 UMT5 tokens, 257 CLIP tokens, 480 x 832 (the 480P checkpoint's), 81 frames
    "wan-i2v-a14b": WanI2VA14BPlan(
        denoiser=WAN22_I2V_A14B_EXPERT, text=[("umt5", UMT5_XXL, 512)], vae=VAE_WAN, reward=HPS,
        resolution=(480, 832), frames=81, fsdp_units=("WanTransformerBlock",), experts=2,
    ),  # as wan22_a14b: both experts' weights and state, one expert's activations
    "ltx2": LTX2Plan(
        denoiser=LTX23, text=[("qwen3", GEMMA3_12B_LM, 1024)], vae=VAE_LTX23, reward=HPS, resolution=(512, 768),
        frames=121, fsdp_units=("LTX2VideoTransformerBlock",),
    ),  # LTX2Pipeline: 1024 Gemma tokens, 512 x 768, 121 frames (5 s at 24 fps) by default
    "hunyuan15": Hunyuan15Plan(
        denoiser=HUNYUAN15, text=[("qwen25vl", QWEN25_VL_7B, 1108), ("t5", BYT5_SMALL, 256)], vae=VAE_HUNYUAN15,
        reward=HPS, resolution=(480, 848), frames=121, fsdp_units=("HunyuanVideo15TransformerBlock",),
    ),  # HunyuanVideo15Pipeline: 108 + 1000 Qwen tokens (the system part cropped after encoding), 256 ByT5 tokens
}  # fmt: skip
MODELS = {kind: plan.parts for kind, plan in PLANS.items()}  # the published parts of each
VIDEO_KINDS = tuple(kind for kind, plan in PLANS.items() if plan.video)
FLUX2_KINDS = tuple(kind for kind, plan in PLANS.items() if isinstance(plan, Flux2Plan))


def model_kind(model_id: str) -> str:
    """--model-id -> its PLANS key: a local folder's model_index.json says (its common.models kind, then the Plan's
    folder test), else the hub id (nothing is read from the hub)."""
    index = Path(model_id) / "model_index.json"
    if index.is_file():
        from common.models import KINDS

        config = json.loads(index.read_text())
        kind = KINDS.get(config.get("_class_name"))
        for key, plan in PLANS.items():
            if plan.model == kind and plan.folder(config):
                return key
    for key, plan in PLANS.items():
        if plan.hub(model_id.lower()):
            return key
    names = [plan.name for plan in PLANS.values()]
    raise ValueError(
        f"--model-id {model_id}: not {', '.join(names[:-1])} or {names[-1]}, whose published configs are here"
    )


def build_denoiser(kind: str, config: dict, dtype):
    import diffusers

    return getattr(diffusers, PLANS[kind].denoiser)(**config).to(dtype)


def build_vae(kind: str, config: dict, dtype):
    """The VAE in the dtype the scripts decode in: the frozen dtype, fp32 for Wan (common.models.WanModel.to)."""
    return PLANS[kind].vae(config, dtype)


def trained_module(kind: str, config: dict, args, frozen_dtype, checkpointing: bool):
    """The denoiser exactly as the scripts prepare it: loaded in the frozen dtype, then common.models'
    trainable_denoiser (LoRA adapter and which weights are fp32, gradient checkpointing)."""
    from common.models import trainable_denoiser

    module = build_denoiser(kind, config, frozen_dtype)
    holder = types.SimpleNamespace(kind=kind, unet=module, transformer=module, lora_targets=PLANS[kind].lora_targets)
    module = trainable_denoiser(holder, args)
    if checkpointing or module.is_gradient_checkpointing:  # FSDP's config can ask for it too
        module.enable_gradient_checkpointing(checkpoint_under_policy)
    return module


def denoise(shapes: Shapes, module, x):
    """One denoiser forward of latents x (rows, *latent) fp32, as FlowModel.velocity / DDIMModel.eps call it (inputs
    cast to the module's dtype; FLUX's guidance is an input, CFG rows are already in x). Returns fp32 like x."""
    dt = next(module.parameters()).dtype
    cond = {k: torch.zeros(len(x), *s, dtype=dt) for k, s in shapes.cond.items()}  # values do not matter here
    return PLANS[shapes.kind].forward(shapes, module, x, cond, dt).float()


def vae_decode(vae, shapes: Shapes, latents):
    """common.models.base._vae_decode: (B, *latent) fp32 -> images (B, 3, H, W) fp32 in [0, 1]. Wan: WanModel.decode
    itself (one video at a time, fp32) -> videos (B, F, 3, H, W)."""
    latents = PLANS[shapes.kind].unpack(shapes, latents)  # (the packed tokens freed before the VAE runs)
    return PLANS[shapes.kind].decode(vae, shapes, latents)


def hps_score(reward, images):
    """common.rewards.hpsv2_1's score: HPS's resize-and-pad, then the image and text towers, in fp32."""
    from common.rewards import hps_pixels

    image = reward.encode_image(hps_pixels(images.float(), reward.visual.image_size[0]), normalize=True)
    text = reward.encode_text(torch.zeros(len(images), 77, dtype=torch.long), normalize=True)
    return (image * text).sum(-1)


def image_similarity_score(clip, images):
    """common.rewards.image_similarity's score (no grad): CLIP ViT-L/14's projected image features of the edits and
    of their sources (source_pixels: each prompt's first image cut to the edit's frame, (n, 3, H, W) fp32 like the
    edits), through CLIP's preprocessing (224 px), normalised; their cosine."""
    import torch.nn.functional as F

    from common.rewards import crop_pixels

    mean, std = (0.4815, 0.4578, 0.4082), (0.2686, 0.2613, 0.2758)  # CLIPImageProcessor's statistics

    def features(x):
        out = clip.get_image_features(pixel_values=crop_pixels(x.float(), 224, (224, 224), mean, std))
        return F.normalize(getattr(out, "pooler_output", out), dim=-1)

    sources = torch.zeros(images.shape, dtype=torch.float32)
    return (features(images) * features(sources)).sum(-1)


@contextlib.contextmanager
def _constants(limit: int):
    """Fake tensors made from real ones by `constant` keep their values through ops of at most `limit` elements (the
    fake world's default: 1), so that code reading its inputs' values (index lists, counts) runs on them."""
    from torch._subclasses import fake_tensor

    default = fake_tensor.CONSTANT_NUMEL_LIMIT
    fake_tensor.CONSTANT_NUMEL_LIMIT = limit
    try:
        mode = _WORLD[-1]
        yield lambda t: mode.fake_tensor_converter.from_real_tensor(mode, t, make_constant=True)
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT = default


class _RealFactories(TorchFunctionMode):
    """torch.zeros and torch.ones of at most 65536 elements (masks) make real values, as constants of the fake world."""

    def __init__(self, constant):
        super().__init__()
        self.constant = constant

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        real = {k: v for k, v in kwargs.items() if k != "device"}
        if func in (torch.zeros, torch.ones) and func(*args, **real, device="meta").numel() <= 65536:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                return self.constant(func(*args, **real))
        return func(*args, **kwargs)


def hpsv3_score(model, images):
    """common.rewards.hpsv3's score (no grad) on (n, 3, H, W) images: Qwen2-VL's patches at the smart-resized size,
    then the chat turn of 847 positions per image, right-padded alike. The token ids and the image grid, which the
    forward reads (where the image tokens go, the vision tower's per-image attention), are real values; the rest is
    fake. The images' own resize and patching are a few fp32 copies of the pixels, left out."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from common.hpsv3 import FACTOR, smart_resize

    n, _, H, W = images.shape
    h, w = smart_resize(H, W)
    gh, gw = h // (FACTOR // 2), w // (FACTOR // 2)
    length = gh * gw // 4 + HPSV3_TEXT_TOKENS
    with unset_fake_temporarily():  # real values
        ids = torch.zeros(n, length, dtype=torch.long)
        ids[:, 5 : 5 + gh * gw // 4] = model.image_token_id  # after the system turn
        ids[:, -10] = model.reward_token_id  # before "\n\nEND\n" and the assistant's turn
        grid = torch.tensor([[1, gh, gw]] * n)
    with _constants(2 * n * max(length, gh * gw)) as constant:
        ids, grid = constant(ids), constant(grid)
        pixels = torch.zeros(n * gh * gw, 3 * 2 * 14 * 14)  # (patches, 3 x 2 frames x 14 x 14), fp32
        return model(ids, torch.ones(n, length, dtype=torch.long), pixels, grid)[:, 0]


def geneval_score(nets, images):
    """common.geneval's judge (no grad) on (n, 3, H, W) images, the tensors that hold memory: the batch resized and
    padded for the detector (detector_inputs), then per image (one at a time) the Mask2Former forward and its 100
    masks upsampled to the padded input and to the image (instance_detections: the gathered masks, their sigmoid and
    binary copies), then CLIP's image tower on the 16 crops a class can have at most (224 px). The per-detection box
    loop and the PIL crops are small and left out."""
    import torch.nn.functional as F

    from common.geneval import MAX_OBJECTS, MAX_PER_IMAGE, detector_inputs

    x, resized = detector_inputs(images.float() * 255)
    for k in range(len(x)):
        out = nets["detector"](pixel_values=x[k : k + 1])
        masks = F.interpolate(out.masks_queries_logits.float(), size=x.shape[-2:], mode="bilinear")
        masks = F.interpolate(masks[..., : resized[0], : resized[1]], size=images.shape[-2:], mode="bilinear")[0]
        masks = masks[torch.zeros(MAX_PER_IMAGE, dtype=torch.long)]  # the 100 best (query, class) pairs' masks
        binary = masks > 0
        (masks.sigmoid() * binary).flatten(1).sum(1)
        nets["clip"].get_image_features(pixel_values=torch.zeros(MAX_OBJECTS, 3, 224, 224))
    return torch.zeros(len(images))


def score_samples(nets: dict, spec: str, frames: int, samples):
    """The scripts' reward call (common.rewards.CompositeReward, no grad) on decoded samples, images (n, 3, H, W) or
    videos (n, F, 3, H, W), with the components that hold GPU memory: HPSv2.1, HPSv3, GenEval and image_similarity
    (`nets`: name -> network; the two GenEval names share one judge, as common.rewards loads one), on `frames` evenly
    spaced frames of each video (--reward-frames), and 'temporal' (videos). Others (jpeg, ...) are left out: they work
    on the CPU or are not modelled (reward_model refuses pickscore and clip)."""
    from common.rewards import CompositeReward, ScoreFn, parse_rewards, temporal

    scores = {"hpsv2.1": hps_score, "hpsv3": hpsv3_score, "geneval": geneval_score, "geneval_accuracy": geneval_score,
              "image_similarity": image_similarity_score}  # fmt: skip
    parts = []
    for name, weight in parse_rewards(spec).weights.items():
        if name in nets:
            fn = lambda x, prompts, net=nets[name], score=scores[name]: score(net, x)  # noqa: E731
            parts.append((name, weight, ScoreFn(fn, differentiable=True)))
        elif name == "temporal":
            parts.append((name, weight, temporal("cpu")))
    return CompositeReward(parts, frames, check=False)(samples, [""] * len(samples))  # fake tensors: no values
