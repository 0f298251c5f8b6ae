"""Text-to-image models behind one small interface, for the RL scripts' own samplers.

Flow models (ShapesBench, SD3/SD3.5, FLUX.1, FLUX.2, Qwen-Image, Z-Image, Wan2.1 text-to-video) share one convention,
whatever the checkpoint's:
    x_s = (1 - s) x0 + s eps,   v = eps - x0,   s in [0, 1],   s = 1 is pure noise.
`FlowModel.velocity(transformer, x, sigma, cond)` returns v; the scripts integrate it themselves. A video model's
decode gives (B, F, 3, H, W) where an image model's gives (B, 3, H, W); the rewards take either (common/rewards.py).
SD1.x/2.x (for RLR) is a DDPM-style eps model, so it gets its own `DDIMModel`.

One file per model family, as diffusers does: base.py (the interface), sd3.py (SD3.5 and ShapesBench), flux.py
(FLUX.1), flux2.py (FLUX.2 [dev] and [klein]), qwenimage.py (Qwen-Image), zimage.py (Z-Image), wan.py (Wan2.1 and
Wan2.2), sd1.py (SD1.x). This file registers them (REGISTRY: one entry per kind, which pipeline classes load as it
and whether it makes videos), loads a `--model-id` as the right kind and prepares what RL trains (LoRA or all
weights) and saves. A new kind is its module and one REGISTRY entry (docs/forking.md).

The trainable denoiser is passed *into* `velocity`/`eps` rather than read from the object, so scripts
can hand in a LoRA'd, DDP/FSDP-wrapped or reference copy of it. Everything else is frozen.

Importing this package imports no model family's module: each imports its diffusers pipeline and through it
transformers, seconds that `--help` and the checks of the flags need not wait for. A wrapper class is imported the
first time it is asked for (`common.models.FluxModel`, a REGISTRY entry's `cls`: WRAPPERS).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from huggingface_hub import hf_hub_download

from common import InputError, hub_reachable
from common.models.base import FlowModel, _cfg, _Parts, check_num_frames, save_pretrained
from common.shapesbench.builders import EDIT_PATH, LATENT_PATH, SHAPESBENCH_KEY

if TYPE_CHECKING:  # for the annotations; at run time __getattr__ imports it on first use
    from common.models.sd1 import DDIMModel

__all__ = [  # the interface the scripts, common/ and the tests use
    "FlowModel", "SD3Model", "ShapesModel", "FluxModel", "Flux2Model", "QwenImageModel", "ZImageModel", "WanModel", "DDIMModel",
    "FluxKontextModel", "QwenImageEditModel", "WanI2VModel", "ShapesEditModel",
    "Kind", "REGISTRY", "KINDS", "VIDEO_KINDS", "registered", "is_video", "register_kind", "unregister_kind",
    "check_model_id", "has_two_experts", "check_num_frames", "load_model", "LORA_TARGETS", "trainable_denoiser", "frozen_copy",
    "base_weights", "reference_velocity", "add_lora", "save_trained_weights", "LOW_NOISE_LORA", "_cfg", "_Parts",
]  # fmt: skip
SHAPESBENCH_DIR = LATENT_PATH  # what --model-id shapesbench loads
SHAPESBENCH_EDIT_DIR = EDIT_PATH / "model"  # and --model-id shapesbench-edit (common/shapesbench/edit.py)
# final/'s adapter of Wan2.2-T2V-A14B's low-noise expert (common/models/wan.py writes it, common.evaluate reads it)
LOW_NOISE_LORA = "pytorch_lora_weights_transformer_2.safetensors"

# Each wrapper class (and Wan's two experts) and the module of its family, imported on first use by __getattr__. A
# kind of common/ is its module, its line here and its REGISTRY entry by name; a fork's entry may give its class.
WRAPPERS = {
    "FluxModel": "flux", "Flux2Model": "flux2", "QwenImageModel": "qwenimage", "ZImageModel": "zimage",
    "SD3Model": "sd3", "ShapesModel": "sd3", "DDIMModel": "sd1", "WanModel": "wan", "WanExperts": "wan",
    "LTX2Model": "ltx2", "HunyuanVideo15Model": "hunyuan15", "FluxKontextModel": "kontext", "ShapesEditModel": "kontext",
    "QwenImageEditModel": "qwenimage_edit", "WanI2VModel": "wan_i2v",
}  # fmt: skip


def __getattr__(name: str):
    """common.models.FluxModel and the other WRAPPERS: their module is imported the first time one is read."""
    if name not in WRAPPERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    wrapper = getattr(importlib.import_module(f"{__name__}.{WRAPPERS[name]}"), name)
    globals()[name] = wrapper  # later reads find it without this function
    return wrapper


@dataclass(frozen=True)
class Kind:
    """A model kind: its wrapper class in common/models/<family>.py (`cls.kind` names it; `cls.pipeline` and
    `cls.from_folder` load a folder; `cls.lora_targets`, if set, is what --lora adapts instead of LORA_TARGETS) and the
    model_index.json `_class_name`s that load as it. A new kind is its module and one entry of REGISTRY.

    `wrapper` is the class, or its name in WRAPPERS with the kind's `name` beside it: then its module is imported
    the first time `cls` is read, and the checks of --model-id, which read the names alone, import none."""

    wrapper: type | str
    pipelines: tuple[str, ...]
    video: bool = False  # decodes (B, F, 3, H, W): takes --num-frames and the rewards of videos
    name: str = ""  # the kind, `cls.kind` ('flux', 'wan', ...): read from the class when `wrapper` is one
    # (least, most) images a prompt brings: an edit's sources, references or a first frame (common/edits.py); (0, 0):
    # text alone
    images: tuple[int, int] = (0, 0)

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", self.wrapper.kind)

    @property
    def cls(self) -> type:
        return getattr(sys.modules[__name__], self.wrapper) if isinstance(self.wrapper, str) else self.wrapper


REGISTRY = [  # read at each call (not copied at import), so an entry added at run time counts
    Kind("FluxModel", ("FluxPipeline",), name="flux"),
    Kind("QwenImageModel", ("QwenImagePipeline",), name="qwen"),
    # references optional, at most 4: FLUX.2 [klein]'s documented limit ([dev]'s recommended one is 6)
    Kind("Flux2Model", ("Flux2Pipeline", "Flux2KleinPipeline"), name="flux2", images=(0, 4)),
    Kind("FluxKontextModel", ("FluxKontextPipeline",), name="kontext", images=(1, 1)),
    Kind("QwenImageEditModel", ("QwenImageEditPlusPipeline",), name="qwen-edit", images=(1, 3)),
    Kind("ZImageModel", ("ZImagePipeline",), name="zimage"),
    Kind("SD3Model", ("StableDiffusion3Pipeline",), name="sd3"),  # ShapesModel: such a folder with "_shapesbench"
    Kind("ShapesModel", (), name="shapes"),
    Kind("ShapesEditModel", (), name="shapes-edit", images=(1, 1)),  # such a FluxKontextPipeline folder
    Kind("DDIMModel", ("StableDiffusionPipeline",), name="sd1"),
    Kind("WanModel", ("WanPipeline",), video=True, name="wan"),
    Kind("WanI2VModel", ("WanImageToVideoPipeline",), video=True, name="wan-i2v", images=(1, 1)),
    Kind("LTX2Model", ("LTX2Pipeline",), video=True, name="ltx2"),
    Kind("HunyuanVideo15Model", ("HunyuanVideo15Pipeline",), video=True, name="hunyuan15"),
]


def registered(kind: str) -> Kind:
    """The REGISTRY entry of the kind named `kind` ('flux', 'wan', ...)."""
    return next(k for k in REGISTRY if k.name == kind)


def is_video(kind: str) -> bool:
    return registered(kind).video


def register_kind(entry: Kind) -> None:
    """Add a model kind at run time (a fork's own kind, from its file; a test's): `--model-id` then loads a folder
    whose model_index.json names one of `entry.pipelines` as that kind. A kind's name is registered once."""
    if any(k.name == entry.name for k in REGISTRY):
        raise ValueError(f"model kind {entry.name!r} is registered already")
    REGISTRY.append(entry)


def unregister_kind(kind: str) -> Kind:
    """Take the kind named `kind` out of REGISTRY and return its entry (a test that registered one ends with this)."""
    entry = next((k for k in REGISTRY if k.name == kind), None)
    if entry is None:
        raise ValueError(f"model kind {kind!r} is not registered")
    REGISTRY.remove(entry)
    return entry


# model_index.json `_class_name` -> kind, and the video kinds, as REGISTRY has them at import
KINDS = {name: k.name for k in REGISTRY for name in k.pipelines}
VIDEO_KINDS = tuple(k.name for k in REGISTRY if k.video)
HOW_TO_GET_WEIGHTS = (
    "To run without hub access: on a machine with internet run `hf download <hub-id> --local-dir /path` "
    "(e.g. black-forest-labs/FLUX.1-dev; gated models need their licence accepted and `hf auth login`), copy /path "
    "here and pass `--model-id /path`; or pre-populate the HF_HOME cache."
)


def _model_index(model_id: str) -> tuple[dict, str]:
    """Read model_index.json from a local folder or the hub (the local HF cache first; the hub only if reachable)."""
    if model_id in ("shapesbench", "shapesbench-edit"):
        folder = SHAPESBENCH_DIR if model_id == "shapesbench" else SHAPESBENCH_EDIT_DIR
        if not (folder / "model_index.json").is_file():
            raise InputError(
                f"the ShapesBench model is missing from {folder} (it ships with the repo: restore it with git, or "
                "train it again); or pass another model with --model-id"
            )
        model_id = str(folder)
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
    kind ('shapes', 'flux', 'flux2', 'sd3', 'qwen', 'zimage', 'sd1', 'wan'), read from model_index.json alone."""
    return _kind(_model_index(model_id)[0], model_id)


def has_two_experts(model_id: str) -> bool:
    """Whether --model-id is a two-expert Wan2.2 (A14B: model_index.json names a transformer_2)."""
    return (_model_index(model_id)[0].get("transformer_2") or [None])[0] is not None


def _kind(index: dict, model_id: str) -> str:
    name = index.get("_class_name")
    names = {p: k.name for k in REGISTRY for p in k.pipelines}
    if name not in names:
        raise InputError(f"--model-id {model_id}: unsupported model class {name!r}; supported: {', '.join(names)}")
    if index.get(SHAPESBENCH_KEY) and name in ("StableDiffusion3Pipeline", "FluxKontextPipeline"):
        return "shapes" if name == "StableDiffusion3Pipeline" else "shapes-edit"  # ShapesBench's, and its edits'
    return names[name]


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
    if num_frames is not None and not is_video(kind):
        raise InputError(f"--num-frames only applies to a video model (Wan2.1); --model-id {model_id} is {kind}")
    try:
        model = registered(kind).cls.from_folder(where, index, dtype, resolution, num_frames)
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
    Wan2.2-T2V-A14B: --experts picks the trained expert(s), and --guidance-scale-2 goes onto the model (the low-noise
    expert's CFG scale in every velocity: rollouts, training, evaluation).
    """
    denoiser = model.unet if model.kind == "sd1" else model.transformer
    if args.lora:
        add_lora(denoiser, args.lora_rank, args.lora_alpha, getattr(model, "lora_targets", None))
        for p in denoiser.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    else:
        denoiser.float()
    if _wan_experts(denoiser) and args.experts != "both":  # --experts: the other one stays frozen
        getattr(denoiser, "low" if args.experts == "high" else "high").requires_grad_(False)
    if _wan_experts(denoiser):
        model.guidance_scale_2 = args.guidance_scale_2
    if args.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    return denoiser.train()


def _wan_experts(module) -> bool:
    """isinstance(module, WanExperts) (Wan2.2-T2V-A14B's two experts), importing nothing: without wan.py imported
    there is no WanExperts."""
    wan = sys.modules.get(f"{__name__}.wan")
    return wan is not None and isinstance(module, wan.WanExperts)


def frozen_copy(module, dtype):
    """A frozen copy of `module` (the KL reference policy of full fine-tuning), in bf16 if `dtype` is bf16."""
    ref = copy.deepcopy(module).requires_grad_(False).eval()
    return ref.bfloat16() if dtype == torch.bfloat16 else ref  # (not .to(dtype): diffusers warns on it)


# A second policy beside the trained one (DiffusionNFT's old policy; any method's frozen snapshot of the trained
# weights), and the in-place swap of weights that evaluates an EMA: model plumbing, shared by the scripts.
def add_old_policy(policy, lora: bool):
    """The old policy, a copy of the trained weights the optimiser never sees: with --lora a second adapter `old` of
    `policy` (returns None; old_policy() switches to it), else a frozen fp32 copy (returned)."""
    if not lora:
        return frozen_copy(policy, torch.float32)
    with warnings.catch_warnings():  # peft warns that the model has an adapter already: that is the point
        warnings.filterwarnings("ignore", "Already found a `peft_config`")
        policy.add_adapter(copy.deepcopy(policy.peft_config["default"]), adapter_name="old")
    policy.set_adapter("default")  # peft's set_adapter: `default` trainable, `old` frozen
    for o, p in zip(old_weights(policy, None, True), trained_weights(policy), strict=True):
        o.data = p.detach().clone()  # fp32, as the trained adapter
    return None


def trained_weights(policy) -> list:
    """The parameters of `policy` the optimiser trains, in its order."""
    return [p for p in policy.parameters() if p.requires_grad]


def old_weights(policy, old, lora: bool) -> list:
    """The old policy's tensor of each trained parameter of `policy`, in the order of trained_weights(policy)."""
    named = dict((policy if lora else old).named_parameters())
    return [
        named[n.replace(".default.", ".old.") if lora else n] for n, p in policy.named_parameters() if p.requires_grad
    ]


@contextlib.contextmanager
def old_policy(policy, old, lora: bool):
    """Inside the block the old policy's module: `policy` (unwrapped) with its `old` adapter active (--lora; peft then
    freezes `default` until the block ends), or the frozen copy `old`."""
    if not lora:
        yield old
        return
    policy.set_adapter("old")
    try:
        yield policy
    finally:
        policy.set_adapter("default")


def swap(params, values) -> None:
    """Exchange the contents of each parameter and its value tensor in place, one tensor at a time: no copy of all
    the weights is ever made (at FLUX.1-dev full fine-tuning a copy would be 48 GB), only of the largest one."""
    with torch.no_grad():
        for p, v in zip(params, values):
            held = p.detach().clone()
            p.copy_(v), v.copy_(held)
            del held  # freed before the next tensor's is made


@contextlib.contextmanager
def weights_swapped(params, values, on: bool = True):
    """Inside the block the parameters hold `values` (the EMA: evaluation and final/) and `values` the parameters'
    own; after it, both as before, bit for bit."""
    if not on:
        yield
        return
    swap(params, values)
    try:
        yield
    finally:
        swap(params, values)


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


def add_lora(transformer, rank: int, alpha: float, target_modules: list[str] | str | None = None):
    """Add a LoRA adapter (B = 0 at init, so outputs are unchanged) in place; base weights are frozen.
    `target_modules`: module-name suffixes or one regex of whole names (peft's); None: LORA_TARGETS."""
    from peft import LoraConfig  # heavy: imported when an adapter is added

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
    experts = _wan_experts(transformer)  # Wan2.2-T2V-A14B: each expert's weights where the pipeline reads them
    if not lora:
        if experts:
            return transformer.save_full(out_dir, state_dict)
        save_pretrained(transformer, out_dir / ("unet" if model.kind == "sd1" else "transformer"), state_dict)
        return
    from peft import get_peft_model_state_dict  # heavy: imported when an adapter is saved

    layers = get_peft_model_state_dict(transformer, state_dict=state_dict)
    metadata = transformer.peft_config["default"].to_dict()  # keeps lora_alpha, so the scale survives reloading
    if experts:
        transformer.save_lora(out_dir, layers, metadata)
    elif model.kind == "sd1":
        from common.models.sd1 import DDIMModel  # imported already: an SD1.x model was loaded

        DDIMModel.pipeline.save_lora_weights(out_dir, unet_lora_layers=layers, unet_lora_adapter_metadata=metadata)
    else:
        model.pipeline.save_lora_weights(
            out_dir, transformer_lora_layers=layers, transformer_lora_adapter_metadata=metadata
        )
