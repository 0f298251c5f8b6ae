"""The prepared GPU check: every model kind's training step on one lent GPU, in two calls, with random weights built
on the GPU from the published configs (benchmarks/memory.py's; nothing is downloaded or written to disk).

    call 1  (4 minutes at most) the environment, benchmarks/sdpa_probe.py (every attention kernel at every kind's
            training shapes), then one iteration of each model kind's script: FLUX.1-dev, FLUX.2 [klein] base 4B and
            [dev], SD3.5-Medium, SD1.5 (rlr.py), Qwen-Image, Z-Image, Wan2.1-T2V-1.3B, Wan2.2-TI2V-5B, Wan2.2-T2V-A14B
            (both experts); the large ones (FLUX.1-dev, FLUX.2 [dev], Qwen-Image, A14B) at their real width with 2
            blocks of each type (text encoders: 2 layers, or as many as the pipeline reads hidden states from), so
            every kernel, dtype and shape of the real model runs forward and backward; the others at full size
    call 2  (6 minutes at most) one iteration of each of the five scripts on full-depth FLUX.1-dev at a recipe's
            settings: 720 px, bf16, LoRA r128, gradient checkpointing, --offload-frozen; then the video kinds call 1
            has no time left for, LTX-2.3 and HunyuanVideo-1.5, at their real width with 2 blocks of each type

    bash benchmarks/gpu_check.sh --prepare          # wheels for an offline GPU node in .whl/, the plan, the commands
    bash benchmarks/gpu_check.sh --call 1           # one H100 / H200-class GPU
    bash benchmarks/gpu_check.sh --call 2
    bash benchmarks/gpu_check.sh --call 1 --cases qwen-image,wan22-a14b   # a rerun of some cases
    bash benchmarks/gpu_check.sh --rehearse         # both calls end to end on the CPU at tiny widths (tests run it)

How the kit differs from a user's run: the scripts run in the kit's own process (their `main(args)` on flags parsed
by their own `Args`, one case after the other), and only two things are replaced, inside `kit_weights` and only while
a case runs: the script's `load_model` builds the pipeline with random weights directly on the GPU (`build_model`:
each part made on the meta device, then its parameters on the GPU in the dtype `from_pretrained(dtype=...)` would
give them, modules the libraries keep in float32 included, and initialised there) instead of reading --model-id's
weights, and the hpsv2.1 reward builds ViT-H-14 with random weights on the GPU instead of reading its checkpoint.
--model-id is a folder holding only a model_index.json (a few bytes), so the scripts' own checks of the flags, the
model kind and its experts run unchanged. Reading weights from disk is not measured here (a user's run reads them
once, at start-up); tokenizers are built in memory (letters or bytes as tokens: prompts are more tokens than with
the real ones, padded to the pipelines' lengths as the real ones are).

Each case is contained: its failure (an exception, an out-of-memory, a time-out: SIGALRM at the time left) is
recorded with its type, message and traceback, and the call goes on; after each case the accelerate state is reset
and the GPU memory released (gc, empty_cache), and whether the case's model was freed is recorded. The results are
written from the start and after every step (gpu_check.json, gpu_check.md, gpu_check.log in --out and --results),
each case's line as it finishes; the call ends with one table: case, status, seconds of the rollout (the sampling
phase) and of the training step (the rest of the iteration), peak GPU memory (torch.cuda.max_memory_allocated, as
the scripts log it) against benchmarks/memory.py's plan for the same flags and sizes, and the TFLOP/s and MFU of the
denoiser's forwards without gradients (the rollout) and of the training step (forwards with gradients + backward),
each timed alone by benchmarks/gpu_timing.py's CUDA events: rows x the FLOPs of one row, counted by
torch.utils.flop_counter on the denoiser as the scripts train it (common.models.trainable_denoiser: LoRA adapter,
frozen bf16 base) on the meta device at the case's shapes, backward counted, not assumed; gradient checkpointing's
recomputed forwards are the hardware's work, not the model's, and are not counted.

Beside the table the timing model (`estimate_case`, `estimate_call`) gives each case's and each call's GPU time
from the FLOPs the case does at an assumed MFU of the GPU's datasheet peak, plus fixed costs (TIMING: start-up,
the probe, building weights at an assumed initialisation rate, a first iteration's kernel set-up, offload trips over
PCIe); the printed plan of both calls must fit 4 + 6 minutes by it (the tests check it). --rehearse runs both calls
end to end on the CPU at tiny widths (the same code: the builders, kit_weights, the scripts' main, the timing, the
table), so what runs on a lent GPU has run before; its seconds are the CPU's, its peak memory the process's resident
set, and its MFU none: it checks the kit, not the figures.

The plan (benchmarks/gpu_plan.json, written by --write-plan, which --prepare runs) holds, per case, memory.py's
peak and the FLOP and parameter counts at the GPU's shapes, each under a key of what it depends on: an entry made
for other configs or flags is not used (FLOPs are then counted at start-up; the memory plan is shown as missing).
The key does not cover memory.py's own modelling: after a change there, write the plan into a new file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import importlib
import json
import os
import platform
import shutil
import signal
import sys
import time
import traceback
import types
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_timing, memory  # noqa: E402

PLAN = ROOT / "benchmarks" / "gpu_plan.json"
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "B200": 2250.0}  # dense bf16 peaks (NVIDIA datasheets, SXM)
PROMPTS = [
    "a photo of an astronaut riding a horse on the moon",
    "a watercolor painting of a lighthouse at dawn",
    "an anime girl with silver hair in a rainy city",
    "concept art of a floating castle above the clouds",
]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TINY_HPS = "tiny-hps"  # --rehearse's HPSv2.1 architecture: open_clip config memory.TINY_FLUX["reward"]
CALL_LIMIT_S = {1: 240, 2: 360}  # what each call must fit in, by the timing model and on the GPU (--limit-s)


# ---------------------------------------------------------------------------------------------------
# The model kinds: memory.py's published configs, their reduced depth (call 1) and tiny widths (--rehearse)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    title: str
    memory_kind: str  # memory.MODELS' key
    index: dict  # model_index.json: what check_model_id, has_two_experts and memory.model_kind read
    script: str  # call 1's script: dancegrpo.py, or the kind's recipe script where dancegrpo.py does not train it
    lora_rank: int  # the kind's recipe's (run.sh)
    size: dict  # call 1's size on the GPU: {"resolution"} or {"height", "width", "frames"}
    tiny_size: dict
    reduced: dict | None = None  # call 1's model_config (memory.estimate's): 2 blocks of each type; None = full
    tiny: dict = field(default_factory=dict)  # --rehearse's model_config
    guidance: float = 4.0
    shift: str | None = None  # --shift (videos; None: 5 for Wan2.2-TI2V-5B, else 3)
    call: int = 1  # the call that runs the kind (2: the video kinds call 1 has no time left for)

    @property
    def video(self) -> bool:
        return "frames" in self.size


def clip(config, **kw):
    return dict(config, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, **kw)


T5_TINY = dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
VAE_TINY = memory.TINY_FLUX["vae"]
QWEN3_TINY = dict(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=27, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8)  # fmt: skip
FLUX2_TINY = dict(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                  joint_attention_dim=48, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4))  # fmt: skip
FLUX2_VAE_TINY = dict(block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4,
                      down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)  # fmt: skip
IMAGE, VIDEO = {"resolution": 32}, {"height": 32, "width": 32, "frames": 5}
KINDS = {
    "flux": Kind(
        "FLUX.1-dev", "flux", {"_class_name": "FluxPipeline"}, "dancegrpo.py", 128, {"resolution": 720},
        {"resolution": 64}, guidance=3.5,
        reduced={"denoiser": dict(num_layers=2, num_single_layers=2),
                 "text": [("clip", dict(memory.CLIP_L, num_hidden_layers=2), 77),
                          ("t5", dict(memory.T5_XXL, num_layers=2), 512)]},
        tiny=memory.TINY_FLUX,
    ),
    "flux2-klein": Kind(
        "FLUX.2 [klein] base 4B", "flux2", {"_class_name": "Flux2KleinPipeline", "is_distilled": False},
        "dancegrpo.py", 64, {"resolution": 384}, IMAGE,
        tiny={"denoiser": FLUX2_TINY, "text": [("qwen3", dict(memory.QWEN3_4B, **QWEN3_TINY), 512)],
              "vae": FLUX2_VAE_TINY, "reward": memory.TINY_FLUX["reward"]},
    ),
    "flux2-dev": Kind(
        "FLUX.2 [dev]", "flux2_dev", {"_class_name": "Flux2Pipeline"}, "dancegrpo.py", 64, {"resolution": 512},
        IMAGE, guidance=4.0,
        # the pipeline stacks Mistral's hidden states 10, 20 and 30: 30 of its 40 layers; 2 of Pixtral's 24 (unused)
        reduced={"denoiser": dict(num_layers=2, num_single_layers=2),
                 "text": [("mistral3", {**memory.MISTRAL_SMALL_31,
                                        "text_config": dict(memory.MISTRAL_SMALL_31["text_config"],
                                                            num_hidden_layers=30),
                                        "vision_config": dict(memory.MISTRAL_SMALL_31["vision_config"],
                                                              num_hidden_layers=2)}, 512)]},
        tiny={"denoiser": dict(FLUX2_TINY, guidance_embeds=True), "vae": FLUX2_VAE_TINY,
              "text": [("mistral3", dict(
                  text_config=dict(model_type="mistral", vocab_size=300, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2),
                  vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, head_dim=8, patch_size=4, image_size=64),
                  image_token_index=7, spatial_merge_size=2), 512)],
              "reward": memory.TINY_FLUX["reward"]},
    ),
    "sd35": Kind(
        "SD3.5-Medium", "sd3", {"_class_name": "StableDiffusion3Pipeline"}, "dancegrpo.py", 32, {"resolution": 512},
        IMAGE, guidance=4.5,
        tiny={"denoiser": dict(sample_size=32, num_layers=1, attention_head_dim=16, num_attention_heads=2,
                               joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64,
                               pos_embed_max_size=64),
              "text": [("clip", clip(memory.CLIP_L, projection_dim=32), 77),
                       ("clip", clip(memory.CLIP_G, projection_dim=32), 77),
                       ("t5", dict(memory.T5_XXL, **T5_TINY, ) | {"d_model": 64}, 256)],
              "vae": VAE_TINY, "reward": memory.TINY_FLUX["reward"]},
    ),
    "sd15": Kind(
        "SD1.5", "sd1", {"_class_name": "StableDiffusionPipeline"}, "rlr.py", 4, {"resolution": 512}, IMAGE,
        guidance=5.0,
        tiny={"denoiser": dict(sample_size=16, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
                               attention_head_dim=8, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                               up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), norm_num_groups=8),
              "text": [("clip", clip(memory.CLIP_L), 77)], "vae": VAE_TINY, "reward": memory.TINY_FLUX["reward"]},
    ),
    "qwen-image": Kind(
        "Qwen-Image", "qwen", {"_class_name": "QwenImagePipeline"}, "dancegrpo.py", 64, {"resolution": 512}, IMAGE,
        reduced={"denoiser": dict(num_layers=2),
                 "text": [("qwen25vl", {**memory.QWEN25_VL_7B,
                                        "text_config": dict(memory.QWEN25_VL_7B["text_config"], num_hidden_layers=2),
                                        "vision_config": dict(memory.QWEN25_VL_7B["vision_config"], depth=2,
                                                              fullatt_block_indexes=[1])}, 34 + 256)]},
        tiny=memory.TINY_QWEN,
    ),
    "z-image": Kind(
        "Z-Image", "zimage", {"_class_name": "ZImagePipeline"}, "dancegrpo.py", 64, {"resolution": 512}, IMAGE,
        tiny={"denoiser": dict(dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16,
                               axes_dims=[4, 6, 6], axes_lens=[256, 64, 64]),
              "text": [("qwen3", dict(memory.QWEN3_4B, **QWEN3_TINY, ) | {"num_hidden_layers": 2}, 256)],
              "vae": VAE_TINY, "reward": memory.TINY_FLUX["reward"]},
    ),
    "wan21": Kind(
        "Wan2.1-T2V-1.3B", "wan", {"_class_name": "WanPipeline"}, "dancegrpo.py", 128,
        {"height": 480, "width": 832, "frames": 9}, VIDEO, guidance=5.0, tiny=memory.TINY_WAN,
    ),
    "wan22-5b": Kind(
        "Wan2.2-TI2V-5B", "wan22", {"_class_name": "WanPipeline", "expand_timesteps": True}, "dancegrpo.py", 128,
        {"height": 704, "width": 1280, "frames": 9}, {"height": 64, "width": 64, "frames": 5}, guidance=5.0,
        tiny={**memory.TINY_WAN, "denoiser": {**memory.TINY_WAN["denoiser"], "in_channels": 48, "out_channels": 48},
              "vae": dict(base_dim=8, decoder_base_dim=8, num_res_blocks=1)},
    ),
    "wan22-a14b": Kind(
        "Wan2.2-T2V-A14B", "wan22_a14b",
        {"_class_name": "WanPipeline", "transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.875},
        "dancegrpo.py", 128, {"height": 480, "width": 832, "frames": 9}, VIDEO, guidance=5.0,
        reduced={"denoiser": dict(num_layers=2), "text": [("umt5", dict(memory.UMT5_XXL, num_layers=2), 512)]},
        tiny=memory.TINY_WAN,
    ),
    # LTX-2.3 (video only: no audio VAE or vocoder is built, as LTX2Model drops them) and HunyuanVideo-1.5 in call 2:
    # their recipes' schedules (--shift pipeline) at 2 blocks of each type; LTX's text side is Gemma 3 (2 of its 48
    # layers, so the connectors read 3 stacked hidden states, not 49) through its connectors (2 blocks a stream)
    "ltx2": Kind(
        "LTX-2.3", "ltx2", {"_class_name": "LTX2Pipeline"}, "dancegrpo.py", 32,
        {"height": 320, "width": 320, "frames": 9}, {"height": 32, "width": 32, "frames": 9}, guidance=3.0,
        shift="pipeline", call=2,
        reduced={"denoiser": dict(num_layers=2),
                 "text": [("qwen3", dict(memory.GEMMA3_12B_LM, num_hidden_layers=2 + 2), 1024)],
                 "gemma": {**memory.GEMMA3_12B,
                           "text_config": dict(memory.GEMMA3_12B["text_config"], num_hidden_layers=2),
                           "vision_config": dict(memory.GEMMA3_12B["vision_config"], num_hidden_layers=1)},
                 "connectors": dict(memory.LTX23_TEXT_CONNECTORS, text_proj_in_factor=3, video_connector_num_layers=2,
                                    audio_connector_num_layers=2)},
        tiny={"denoiser": dict(in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=16,
                               cross_attention_dim=32, vae_scale_factors=(4, 4, 4), audio_in_channels=16,
                               audio_out_channels=16, audio_num_attention_heads=2, audio_attention_head_dim=8,
                               audio_cross_attention_dim=16, num_layers=1, caption_channels=16),
              "text": [("qwen3", dict(memory.GEMMA3_12B_LM, **QWEN3_TINY) | {"num_hidden_layers": 2}, 1024)],
              "vae": dict(latent_channels=16, block_out_channels=(8, 16), down_block_types=("LTX2VideoDownBlock3D",) * 2,
                          decoder_block_out_channels=(8, 16), layers_per_block=(1, 1, 1),
                          decoder_layers_per_block=(1, 1, 1), spatio_temporal_scaling=(True, True),
                          decoder_spatio_temporal_scaling=(True, True), decoder_inject_noise=(False,) * 3,
                          downsample_type=("spatiotemporal",) * 2, upsample_type=("spatiotemporal",) * 2,
                          upsample_residual=(True, True), upsample_factor=(2, 2), patch_size=1,
                          spatial_compression_ratio=4, temporal_compression_ratio=4),
              "gemma": dict(text_config=dict(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                             max_position_embeddings=1024, sliding_window=64),
                            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, image_size=28, patch_size=14),
                            mm_tokens_per_image=4, boi_token_index=297, eoi_token_index=298, image_token_index=299),
              "connectors": dict(caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=2,
                                 video_connector_attention_head_dim=16, video_connector_num_layers=1,
                                 audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8,
                                 audio_connector_num_layers=1, video_gated_attn=True, audio_gated_attn=True,
                                 rope_type="split", per_modality_projections=True, video_hidden_dim=32,
                                 audio_hidden_dim=16, proj_bias=True),
              "audio_vae": dict(base_channels=16, ch_mult=(1, 2, 4), num_res_blocks=1, latent_channels=4, mel_bins=16),
              "reward": memory.TINY_FLUX["reward"]},
    ),
    "hunyuan15": Kind(
        "HunyuanVideo-1.5", "hunyuan15", {"_class_name": "HunyuanVideo15Pipeline"}, "dancegrpo.py", 32,
        {"height": 480, "width": 480, "frames": 5}, VIDEO, guidance=1.0, shift="pipeline", call=2,
        reduced={"denoiser": dict(num_layers=2, num_refiner_layers=2),
                 "text": [("qwen25vl", {**memory.QWEN25_VL_7B,
                                        "text_config": dict(memory.QWEN25_VL_7B["text_config"], num_hidden_layers=2),
                                        "vision_config": dict(memory.QWEN25_VL_7B["vision_config"], depth=2,
                                                              fullatt_block_indexes=[1])}, 1108),
                          ("t5", memory.BYT5_SMALL, 256)]},
        tiny={"denoiser": dict(in_channels=17, out_channels=8, num_attention_heads=2, attention_head_dim=16,
                               num_layers=1, num_refiner_layers=1, text_embed_dim=32, text_embed_2_dim=16,
                               image_embed_dim=16, rope_axes_dim=(4, 6, 6), target_size=64, task_type="t2v"),
              "text": [memory.TINY_QWEN["text"][0][:2] + (1108,),
                       ("t5", dict(memory.BYT5_SMALL, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2), 256)],
              "vae": dict(latent_channels=8, block_out_channels=(8, 16, 16), layers_per_block=1,
                          spatial_compression_ratio=4, temporal_compression_ratio=4),
              "reward": memory.TINY_FLUX["reward"]},
    ),
}  # fmt: skip
SCRIPTS = ("dancegrpo.py", "branchgrpo.py", "vgrpo.py", "rlr.py", "diffusionnft.py")


def model_config(kind: str, scale: str) -> dict | None:
    """memory.estimate's model_config of a kind at a scale: 'full' (None: the published configs), 'reduced' (call 1's
    depth), 'tiny' (--rehearse's widths)."""
    k = KINDS[kind]
    return {"full": None, "reduced": k.reduced, "tiny": k.tiny}[scale]


def parts_of(kind: str, scale: str) -> dict:
    """The parts of `kind` at `scale`, as memory.estimate merges a model_config into memory.MODELS."""
    parts = dict(memory.MODELS[KINDS[kind].memory_kind])
    for name, value in (model_config(kind, scale) or {}).items():
        parts[name] = {**parts[name], **value} if name in ("denoiser", "vae") else value
    return parts


# ---------------------------------------------------------------------------------------------------
# Weights built on the device: each part on the meta device, then made there as from_pretrained(dtype) leaves it
# ---------------------------------------------------------------------------------------------------
def fp32_modules(module, dtype) -> set[str]:
    """Names of the modules that loading in `dtype` keeps in float32: diffusers keeps `_keep_in_fp32_modules` in any
    dtype, transformers `_keep_in_fp32_modules_strict` in bf16 and fp16 and `_keep_in_fp32_modules` in fp16."""
    if dtype == torch.float32:
        return set()
    names = set(getattr(module, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16 or not hasattr(module, "_keep_in_fp32_modules_strict"):  # diffusers: always
        names |= set(getattr(module, "_keep_in_fp32_modules", None) or [])
    return names


@torch.no_grad()
def materialize(module, device, dtype):
    """`module`'s parameters, left on the meta device by accelerate.init_empty_weights, made on `device` with random
    values: float ones in `dtype` (float32 for the modules the library keeps so), each once however often it is
    shared (tied embeddings), then every module's own reset_parameters() where it has one (others: 1-D weights 1,
    biases 0, the rest N(0, 0.02)); buffers (made at construction) moved there, the persistent float ones in
    `dtype` and the non-persistent ones as built, as from_pretrained(dtype=...) leaves them."""
    keep = fp32_modules(module, dtype)
    made = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, p in list(sub._parameters.items()):
            if p is None:
                continue
            full = f"{prefix}.{name}" if prefix else name
            if id(p) not in made:
                kept = any(k in full.split(".") for k in keep)
                dt = (torch.float32 if kept else dtype) if p.is_floating_point() else p.dtype
                t = torch.empty(p.shape, dtype=dt, device=device)
                if not t.is_floating_point():
                    t.zero_()
                elif t.ndim == 1:
                    t.fill_(0.0 if name.endswith("bias") else 1.0)
                else:
                    t.normal_(0, 0.02)
                made[id(p)] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
            sub._parameters[name] = made[id(p)]
        for name, b in list(sub._buffers.items()):
            if b is None:
                continue
            full = f"{prefix}.{name}" if prefix else name
            persistent = name not in sub._non_persistent_buffers_set
            kept = any(k in full.split(".") for k in keep)
            dt = dtype if persistent and b.is_floating_point() and not kept else b.dtype
            sub._buffers[name] = torch.zeros(b.shape, dtype=dt, device=device) if b.is_meta else b.to(device, dt)
    for sub in module.modules():
        if callable(getattr(sub, "reset_parameters", None)) and next(sub.parameters(recurse=False), None) is not None:
            sub.reset_parameters()
    return module


def made(device, dtype, factory, *args, **kwargs):
    """factory(*args, **kwargs) built on the meta device (as from_pretrained builds before loading), materialized on
    `device` in `dtype`."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        module = factory(*args, **kwargs)
    materialize(module, device, dtype)
    if callable(getattr(module, "tie_weights", None)):  # transformers ties its embeddings as from_pretrained does
        module.tie_weights()
    return module.eval()


def tokenizers():
    """CLIP and T5 tokenizers built in memory (letters as tokens): the pipelines pad every prompt to their lengths
    (77 CLIP, 256 or 512 T5 / UMT5 tokens), so the sequence shapes are the real ones. UMT5 takes the T5 one."""
    from transformers import CLIPTokenizer, T5Tokenizer

    vocab = [*LETTERS, *(c + "</w>" for c in LETTERS), "<|startoftext|>", "<|endoftext|>"]
    clip_tok = CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=[], model_max_length=77)
    t5_vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0), *((c, -3.0) for c in LETTERS)]
    return clip_tok, T5Tokenizer(vocab=t5_vocab, extra_ids=0)


def mistral_processor():
    """FLUX.2 [dev]'s tokenizer: tests/tiny.py's byte-level one with Mistral's markers and chat template."""
    from transformers import PixtralImageProcessor, PixtralProcessor, Qwen2Tokenizer

    from tests import tiny

    chars = [t for t in sorted(tiny.qwen_tokenizer().get_vocab().items(), key=lambda kv: kv[1]) if t[0][:2] != "<|"]
    vocab = {t: i for i, t in enumerate(tiny.MISTRAL_MARKERS + [c for c, _ in chars])}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<pad>", eos_token="</s>", pad_token="<pad>", bos_token="<s>",
                         additional_special_tokens=tiny.MISTRAL_MARKERS[3:], model_max_length=4096)  # fmt: skip
    return PixtralProcessor(image_processor=PixtralImageProcessor(patch_size=4), tokenizer=tok, patch_size=4,
                            spatial_merge_size=2, chat_template=tiny.MISTRAL_CHAT)  # fmt: skip


def text_encoder(family: str, config: dict, device, dtype, projection: bool = False):
    """One text encoder of memory.py's families, as its pipeline loads it."""
    import transformers as tf

    if family in ("t5", "umt5"):
        cls, cfg = (tf.T5EncoderModel, tf.T5Config) if family == "t5" else (tf.UMT5EncoderModel, tf.UMT5Config)
        return made(device, dtype, cls, cfg(**config, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    if family == "clip":
        cls = tf.CLIPTextModelWithProjection if projection else tf.CLIPTextModel
        return made(device, dtype, cls, tf.CLIPTextConfig(**config, bos_token_id=52, eos_token_id=53, pad_token_id=53))
    if family == "qwen3":  # FLUX.2 [klein]: the causal LM; Z-Image: the model alone (projection=False)
        cls = tf.Qwen3ForCausalLM if projection else tf.Qwen3Model
        return made(device, dtype, cls, tf.Qwen3Config(**config))
    if family == "mistral3":
        return made(device, dtype, tf.Mistral3ForConditionalGeneration, tf.Mistral3Config(**config))
    return made(device, dtype, tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLConfig(**config))


def build_model(kind: str, parts: dict, device, dtype, resolution, num_frames, offload):
    """The common.models model of `kind` from `parts` with random weights on `device`, in `dtype` as load_model
    loads it, then moved as load_model moves it (with `offload`, the frozen parts to the CPU)."""
    import diffusers as d

    from common import models

    mk, den, vae_cfg = KINDS[kind].memory_kind, parts["denoiser"], parts["vae"]
    text = parts["text"]
    clip_tok, t5_tok = tokenizers()
    torch.manual_seed(0)
    if mk == "flux":
        pipe = d.FluxPipeline(
            scheduler=d.FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=made(device, dtype, d.AutoencoderKL, **vae_cfg, shift_factor=0.1159, scaling_factor=0.3611),
            text_encoder=text_encoder(*text[0][:2], device, dtype), tokenizer=clip_tok,
            text_encoder_2=text_encoder(*text[1][:2], device, dtype), tokenizer_2=t5_tok,
            transformer=made(device, dtype, d.FluxTransformer2DModel, **den),
        )  # fmt: skip
        return models.FluxModel(pipe, resolution).to(device, offload=offload)
    if mk == "sd3":
        pipe = d.StableDiffusion3Pipeline(
            transformer=made(device, dtype, d.SD3Transformer2DModel, **den),
            scheduler=d.FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=made(device, dtype, d.AutoencoderKL, **vae_cfg, shift_factor=0.0609, scaling_factor=1.5305),
            text_encoder=text_encoder(*text[0][:2], device, dtype, True), tokenizer=clip_tok,
            text_encoder_2=text_encoder(*text[1][:2], device, dtype, True), tokenizer_2=clip_tok,
            text_encoder_3=text_encoder(*text[2][:2], device, dtype), tokenizer_3=t5_tok,
        )  # fmt: skip
        return models.SD3Model(pipe, resolution).to(device, offload=offload)
    if mk == "sd1":
        scheduler = d.DDIMScheduler(beta_schedule="scaled_linear", clip_sample=False, set_alpha_to_one=False,
                                    steps_offset=1)  # fmt: skip
        pipe = d.StableDiffusionPipeline(
            vae=made(device, dtype, d.AutoencoderKL, **vae_cfg, scaling_factor=0.18215),
            text_encoder=text_encoder(*text[0][:2], device, dtype), tokenizer=clip_tok,
            unet=made(device, dtype, d.UNet2DConditionModel, **den), scheduler=scheduler, safety_checker=None,
            feature_extractor=None, requires_safety_checker=False,
        )  # fmt: skip
        return models.DDIMModel(pipe, resolution).to(device, offload=offload)
    if mk in ("flux2", "flux2_dev"):
        from tests.tiny import qwen_tokenizer

        common = dict(
            scheduler=d.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True,
                                                        time_shift_type="exponential"),
            vae=made(device, dtype, d.AutoencoderKLFlux2, **vae_cfg),
            transformer=made(device, dtype, d.Flux2Transformer2DModel, **den),
        )  # fmt: skip
        if mk == "flux2":
            te = text_encoder(*text[0][:2], device, dtype, True)
            pipe = d.Flux2KleinPipeline(text_encoder=te, tokenizer=qwen_tokenizer(), is_distilled=False, **common)
        else:
            pipe = d.Flux2Pipeline(text_encoder=text_encoder(*text[0][:2], device, dtype),
                                   tokenizer=mistral_processor(), **common)  # fmt: skip
        return models.Flux2Model(pipe, resolution).to(device, offload=offload)
    if mk == "qwen":
        from tests.tiny import qwen_tokenizer

        scheduler = d.FlowMatchEulerDiscreteScheduler(
            base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
            shift_terminal=0.02, use_dynamic_shifting=True, time_shift_type="exponential",
        )  # fmt: skip
        pipe = d.QwenImagePipeline(
            scheduler=scheduler, vae=made(device, dtype, d.AutoencoderKLQwenImage, **vae_cfg),
            text_encoder=text_encoder(*text[0][:2], device, dtype), tokenizer=qwen_tokenizer(),
            transformer=made(device, dtype, d.QwenImageTransformer2DModel, **den),
        )  # fmt: skip
        return models.QwenImageModel(pipe, resolution).to(device, offload=offload)
    if mk == "zimage":
        from tests.tiny import qwen_tokenizer

        pipe = d.ZImagePipeline(
            scheduler=d.FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=made(device, dtype, d.AutoencoderKL, **vae_cfg, scaling_factor=0.3611, shift_factor=0.1159),
            text_encoder=text_encoder(*text[0][:2], device, dtype), tokenizer=qwen_tokenizer(),
            transformer=made(device, dtype, d.ZImageTransformer2DModel, **den),
        )  # fmt: skip
        return models.ZImageModel(pipe, resolution).to(device, offload=offload)
    if mk == "ltx2":  # video only: no audio VAE (its defaults size the audio latents) unless parts name one
        from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration

        from tests.tiny import gemma_tokenizer

        audio = parts.get("audio_vae")
        pipe = d.LTX2Pipeline(
            scheduler=d.FlowMatchEulerDiscreteScheduler(
                use_dynamic_shifting=True, base_image_seq_len=1024, max_image_seq_len=4096, base_shift=0.95,
                max_shift=2.05, time_shift_type="exponential", shift_terminal=0.1),
            vae=made(device, dtype, d.AutoencoderKLLTX2Video, **vae_cfg),
            audio_vae=made(device, dtype, d.AutoencoderKLLTX2Audio, **audio) if audio else None,
            text_encoder=made(device, dtype, Gemma3ForConditionalGeneration,
                              Gemma3Config(**parts.get("gemma", memory.GEMMA3_12B))),
            tokenizer=gemma_tokenizer(),
            connectors=made(device, dtype, LTX2TextConnectors, **parts.get("connectors", memory.LTX23_TEXT_CONNECTORS)),
            transformer=made(device, dtype, d.LTX2VideoTransformer3DModel, **den), vocoder=None,
        )  # fmt: skip
        return models.LTX2Model(pipe, resolution, num_frames).to(device, offload=offload)
    if mk == "hunyuan15":  # Qwen2.5-VL's text model (as the pipeline loads it) and ByT5 over its byte tokenizer
        from diffusers.guiders import ClassifierFreeGuidance
        from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

        from tests.tiny import qwen_tokenizer

        (_, qwen, _), (_, byt5, _) = text
        pipe = d.HunyuanVideo15Pipeline(
            text_encoder=made(device, dtype, Qwen2_5_VLTextModel, Qwen2_5_VLTextConfig(**qwen["text_config"])),
            tokenizer=qwen_tokenizer(), transformer=made(device, dtype, d.HunyuanVideo15Transformer3DModel, **den),
            vae=made(device, dtype, d.AutoencoderKLHunyuanVideo15, **vae_cfg),
            scheduler=d.FlowMatchEulerDiscreteScheduler(shift=5.0),
            text_encoder_2=made(device, dtype, T5EncoderModel, T5Config(**byt5, pad_token_id=0, eos_token_id=1,
                                                                         decoder_start_token_id=0)),
            tokenizer_2=ByT5Tokenizer(), guider=ClassifierFreeGuidance(guidance_scale=6.0),
        )  # fmt: skip
        return models.HunyuanVideo15Model(pipe, resolution, num_frames).to(device, offload=offload)
    # Wan2.1, Wan2.2-TI2V-5B (one timestep per token), Wan2.2-T2V-A14B (two experts, switched at sigma 0.875)
    two = mk == "wan22_a14b"
    pipe = d.WanPipeline(
        tokenizer=t5_tok, text_encoder=text_encoder(*text[0][:2], device, dtype),
        vae=made(device, dtype, d.AutoencoderKLWan, **vae_cfg),
        scheduler=d.FlowMatchEulerDiscreteScheduler(shift=5.0 if mk == "wan22" else 3.0),
        transformer=made(device, dtype, d.WanTransformer3DModel, **den),
        transformer_2=made(device, dtype, d.WanTransformer3DModel, **den) if two else None,
        boundary_ratio=0.875 if two else None, expand_timesteps=mk == "wan22",
    )  # fmt: skip
    return models.WanModel(pipe, resolution, num_frames).to(device, offload=offload)


def random_hps(device, checkpoint=None, arch="ViT-H-14"):
    """The hpsv2.1 reward of common.rewards.hpsv2_1 with ViT-H-14's random initialisation, built on `device` as
    hpsv2_1 builds it, and no checkpoint read; its score is hpsv2_1's."""
    import open_clip

    from common.offload import Offloaded
    from common.rewards import ScoreFn, hps_pixels

    with torch.device(device):
        model = open_clip.create_model(arch, pretrained=None)
    model.eval().requires_grad_(False)
    tokenizer, size = open_clip.get_tokenizer(arch), model.visual.image_size[0]

    def score(images, prompts):
        image_features = model.encode_image(hps_pixels(images.to(device, torch.float32), size), normalize=True)
        text_features = model.encode_text(tokenizer(prompts).to(device), normalize=True)
        return (image_features * text_features).sum(-1)

    return ScoreFn(score, differentiable=True, parts=Offloaded([model], device, False))


@contextlib.contextmanager
def kit_weights(script_module, kind: str, parts: dict, hps_arch: str, built: list):
    """Only inside this block: `script_module.load_model` builds `kind` from `parts` with random weights on the device
    (build_model; a weak reference to the denoiser goes into `built`), and the hpsv2.1 reward builds `hps_arch` with
    random weights (random_hps) and its weights are not looked for on the hub. Everything is restored on leaving."""
    from common import rewards

    def load_model(model_id="shapesbench", device="cpu", dtype=torch.float32, resolution=None, num_frames=None,
                   offload=False):  # fmt: skip
        model = build_model(kind, parts, device, dtype, resolution, num_frames, offload)
        built.append(weakref.ref(model.unet if model.kind == "sd1" else model.transformer))
        return model

    hps, hub_file, loader = rewards.REWARDS["hpsv2.1"], rewards._hub_file, script_module.load_model
    try:
        script_module.load_model = load_model
        rewards.REWARDS["hpsv2.1"] = dataclasses.replace(hps, factory=functools.partial(random_hps, arch=hps_arch))
        rewards._hub_file = lambda name, download=True: None if name == "hpsv2.1" else hub_file(name, download)
        yield
    finally:
        script_module.load_model, rewards.REWARDS["hpsv2.1"], rewards._hub_file = loader, hps, hub_file


def register_tiny_hps(folder: Path) -> None:
    """open_clip config 'tiny-hps' (memory.TINY_FLUX's reward), registered from `folder`."""
    import open_clip

    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{TINY_HPS}.json").write_text(json.dumps(memory.TINY_FLUX["reward"]))
    open_clip.add_model_config(folder)


# ---------------------------------------------------------------------------------------------------
# The cases of the two calls
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str  # a model kind's case: the kind; call 2's scripts on FLUX.1-dev: the script's name
    call: int
    kind: str
    script: str
    scale: str  # 'full' or 'reduced' on the GPU ('tiny' when rehearsed)


def kind_cases(call: int) -> list[Case]:
    """The model kinds' cases run in `call`: each kind's script at the kind's scale."""
    return [Case(k, call, k, spec.script, "reduced" if spec.reduced else "full") for k, spec in KINDS.items()
            if spec.call == call]  # fmt: skip


CASES = {
    1: kind_cases(1),
    2: [Case(s[:-3], 2, "flux", s, "full") for s in SCRIPTS] + kind_cases(2),  # then the video kinds of call 2
}


def size_of(case: Case, tiny: bool) -> dict:
    k = KINDS[case.kind]
    return k.tiny_size if tiny else k.size


def describe(case: Case, tiny: bool) -> str:
    size, k = size_of(case, tiny), KINDS[case.kind]
    depth = {"full": "", "reduced": ", 2 blocks of each type", "tiny": " (tiny)"}["tiny" if tiny else case.scale]
    px = f"{size['height']}x{size['width']} x {size['frames']} frames" if k.video else f"{size['resolution']} px"
    return f"{k.title}{depth}, {px}"


def case_flags(case: Case, tiny: bool, out: Path) -> list[str]:
    """The script's flags: the kind's model folder and size, bf16, LoRA (the recipe's rank; call 2: r128), gradient
    checkpointing, small batches and few steps, one iteration, nothing saved; call 2 with --offload-frozen (the FLUX
    recipes'); the reward hpsv2.1 (videos: + temporal:0.5 on 4 frames, as the Wan recipes)."""
    k, size = KINDS[case.kind], size_of(case, tiny)
    rank = k.lora_rank
    flags = [
        "--model-id", str(out / "models" / case.kind), "--mixed-precision", "bf16", "--gradient-checkpointing",
        "--lora", "--lora-rank", str(rank), "--lora-alpha", str(2 * rank), "--prompts", str(out / "prompts.txt"),
        "--eval-prompts", str(out / "prompts.txt"), "--iterations", "1", "--eval-every", "0", "--sample-every", "0",
        "--weight-decay", "0", "--lr-warmup", "0", "--no-save", "--guidance-scale", str(k.guidance),
    ]  # fmt: skip
    if k.video:
        flags += ["--resolution", str(size["height"])] if size["height"] == size["width"] else []
        flags += ["--num-frames", str(size["frames"]), "--reward-frames", "4", "--reward", "hpsv2.1,temporal:0.5"]
        flags += ["--shift", k.shift or ("5" if k.memory_kind == "wan22" else "3")]
    else:
        flags += ["--resolution", str(size["resolution"]), "--reward", "hpsv2.1"]
    if case.call == 2:
        flags += ["--offload-frozen"]
    return flags + script_flags(case)


def script_flags(case: Case) -> list[str]:
    """Each script's own flags: a recipe's settings with 4 samples (videos: 2) or one 4-leaf tree, 4 steps (call 2: 8,
    the tree 10)."""
    if case.name in KINDS and case.script == "dancegrpo.py":  # a model kind's case
        n = 2 if KINDS[case.kind].video else 4
        return ["--num-steps", "4", "--sde-type", "dance", "--noise-level", "0.3", "--samples-per-device", str(n),
                "--group-size", str(n), "--rollout-batch-size", str(n), "--samples-per-update", str(n),
                "--clip-range", "1e-4", "--kl-beta", "0"]  # fmt: skip
    if case.script == "rlr.py":  # the rlr-sd15 recipe's estimator (FO + HO, a 2-step sub-chain anywhere)
        steps = "4" if case.call == 1 else "8"
        return ["--num-steps", steps, "--group-size", "2", "--samples-per-device", "2", "--rollout-batch-size", "1",
                "--subchain-len", "2", "--terms", "fo+ho", "--subchain-stage", "any"]  # fmt: skip
    steps = ["--num-steps", "8"]
    return {
        "dancegrpo.py": [*steps, "--sde-type", "dance", "--noise-level", "0.3", "--samples-per-device", "4",
                         "--group-size", "4", "--rollout-batch-size", "1", "--samples-per-update", "4",
                         "--same-noise", "--clip-range", "1e-4", "--kl-beta", "0"],
        "branchgrpo.py": ["--pruning", "depth", "--num-steps", "10", "--sde-type", "dance", "--split-schedule",
                          "dense", "--num-splits", "2", "--branch-factor", "2", "--trees-per-device", "1",
                          "--trees-per-update", "1", "--window", "4", "--rollout-batch-size", "4", "--clip-range",
                          "1e-4", "--kl-beta", "0"],
        "vgrpo.py": [*steps, "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "1",
                     "--train-batch-size", "1", "--samples-per-update", "4", "--n-mc", "4", "--clip-range", "6e-3",
                     "--kl-beta", "0"],
        # Flow-Factory's NFT setting (run.sh's diffusionnft-flux-8gpu): 2 of 8 grid timesteps trained per image
        "diffusionnft.py": [*steps, "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "1",
                            "--train-batch-size", "1", "--samples-per-update", "4", "--timestep-fraction", "0.25",
                            "--kl-beta", "0"],
    }[case.script]  # fmt: skip


def write_model_folder(case: Case, out: Path) -> None:
    """--model-id's folder: its model_index.json only (the kind, Wan2.2's experts), for the scripts' own checks."""
    folder = out / "models" / case.kind
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model_index.json").write_text(json.dumps(KINDS[case.kind].index))


# ---------------------------------------------------------------------------------------------------
# FLOPs and parameters, counted on the meta device at the case's shapes
# ---------------------------------------------------------------------------------------------------
def shapes_of(case: Case, scale: str):
    """memory.Shapes of one sample of the case at `scale` ('tiny': the rehearsal's size)."""
    k, size = KINDS[case.kind], size_of(case, scale == "tiny")
    parts = parts_of(case.kind, scale)
    if k.video:
        return memory.Shapes.of(k.memory_kind, parts, (size["height"], size["width"]), size["frames"])
    return memory.Shapes.of(k.memory_kind, parts, size["resolution"])


def lora_rank(case: Case) -> int:
    return KINDS[case.kind].lora_rank


@contextlib.contextmanager
def quiet_diffusers():
    """diffusers' logger at ERROR: not its notes on fp32 modules when memory.py's builders cast a meta model."""
    import logging

    log = logging.getLogger("diffusers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def count_flops(case: Case, scale: str) -> dict[str, float]:
    """_count_flops of the case's kind at `scale` and size (made once per process: call 2's cases share it)."""
    return dict(_count_flops(case.kind, scale, json.dumps(size_of(case, scale == "tiny"))))


@functools.cache
def _count_flops(kind: str, scale: str, size: str) -> dict[str, float]:
    """FLOPs of one row (one image or video; no CFG), counted by FlopCounterMode on the case's denoiser at its shapes,
    called as the scripts call it (memory.denoise): forward_base (no adapter), forward (with the LoRA adapter, as the
    rollout runs it), train (that forward + its backward, the model as common.models.trainable_denoiser prepares it);
    and params: the denoiser's (one expert's for A14B). On the meta device (nothing computed or allocated), attention
    by its math path (matmuls FlopCounterMode counts on every device), without gradient checkpointing."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from common.models import Flux2Model, trainable_denoiser

    case = Case(kind, 1, kind, "", scale)  # the counts depend on the kind, its scale and its size only
    mk, parts, shapes = KINDS[kind].memory_kind, parts_of(kind, scale), shapes_of(case, scale)
    # on the meta device, or as fake tensors where the forward reads values (memory.Plan.reads_values)
    world = memory.fake_world() if memory.PLANS[mk].reads_values else torch.device("meta")
    with quiet_diffusers():
        with world, sdpa_kernel(SDPBackend.MATH):
            module = memory.build_denoiser(mk, parts["denoiser"], torch.bfloat16).requires_grad_(False)
            params = sum(p.numel() for p in module.parameters())
            x = torch.randn(1, *shapes.latent)
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                memory.denoise(shapes, module, x)
            base = float(counter.get_total_flops())
            rank = KINDS[kind].lora_rank
            args = types.SimpleNamespace(lora=True, lora_rank=rank, lora_alpha=2 * rank, gradient_checkpointing=False)
            holder = types.SimpleNamespace(kind=mk, unet=module, transformer=module)
            if mk in memory.FLUX2_KINDS:  # its adapter also covers the single blocks' fused Linears
                holder.lora_targets = Flux2Model.lora_targets
            module = trainable_denoiser(holder, args)
            with FlopCounterMode(display=False) as counter:
                y = memory.denoise(shapes, module, x)
                forward = float(counter.get_total_flops())
                y.square().mean().backward()
            train = float(counter.get_total_flops())
    return {"forward_base": base, "forward": forward, "train": train, "params": float(params)}


def count_params(case: Case, scale: str) -> dict[str, float]:
    """_count_params of the case's kind at `scale` and size (made once per process)."""
    return dict(_count_params(case.kind, scale, json.dumps(size_of(case, scale == "tiny"))))


@functools.cache
def _count_params(kind: str, scale: str, size: str) -> dict[str, float]:
    """Parameters of the frozen parts (text encoders, VAE; built on the meta device) and the VAE's decode FLOPs of
    one sample (FlopCounterMode on the meta device, as memory.vae_decode runs it)."""
    from torch.utils.flop_counter import FlopCounterMode

    case = Case(kind, 1, kind, "", scale)
    mk, parts, shapes = KINDS[kind].memory_kind, parts_of(kind, scale), shapes_of(case, scale)
    with quiet_diffusers(), torch.device("meta"):
        text = sum(
            sum(p.numel() for p in memory.build_text_encoder(fam, cfg, torch.bfloat16, fam == "clip").parameters())
            for fam, cfg, _ in parts["text"]
        )
        vae = memory.build_vae(mk, parts["vae"], torch.bfloat16)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            memory.vae_decode(vae, shapes, torch.zeros(1, *shapes.latent))
    return {"text": float(text), "vae": float(sum(p.numel() for p in vae.parameters())),
            "decode": float(counter.get_total_flops())}  # fmt: skip


def expected_flops(case: Case, scale: str) -> float | None:
    """One row's forward with the adapter by hand, from the configs (FLUX.1, Qwen-Image, FLUX.2, Wan; None for the
    others): 2 FLOPs a multiply-add of every projection on every token, attention's two matmuls (4 n^2 d a layer),
    and the adapter's 4 n r d per adapted d x d projection; the per-sample vectors (time, guidance, pooled embeddings,
    modulation) are left out (under 0.1% at full size)."""
    mk, parts, shapes, r = KINDS[case.kind].memory_kind, parts_of(case.kind, scale), shapes_of(case, scale), 0
    den, r = parts["denoiser"], lora_rank(case)
    if mk not in ("flux", "qwen", "flux2", "flux2_dev", "wan", "wan22", "wan22_a14b"):
        return None
    d = den["num_attention_heads"] * den["attention_head_dim"]
    n_txt, d_txt = shapes.cond["prompt_embeds"]
    if mk in ("flux", "qwen"):  # joint attention on image and text tokens; every block 24 n d^2
        n_img, c_in = shapes.latent
        n, f, p = n_img + n_txt, 4 * d, den["patch_size"]
        layers = den["num_layers"] + den.get("num_single_layers", 0)
        c_out = p * p * (den.get("out_channels") or c_in)
        base = 2 * n_img * c_in * d + 2 * n_txt * d_txt * d + 2 * n_img * d * c_out
        base += layers * (2 * n * (4 * d * d + 2 * d * f) + 4 * n * n * d)
        lora = 4 * r * d * n * (4 * den["num_layers"] + 3 * den.get("num_single_layers", 0))
    elif mk in memory.FLUX2_KINDS:  # a SwiGLU MLP of 3d; every block 26 n d^2; single blocks' fused Linears
        n_img, c_in = shapes.latent
        n = n_img + n_txt
        base = 2 * n_img * c_in * d + 2 * n_txt * d_txt * d + 2 * n_img * d * c_in
        base += (den["num_layers"] + den["num_single_layers"]) * (2 * n * 13 * d * d + 4 * n * n * d)
        lora = 4 * r * d * n * 4 * den["num_layers"] + 2 * r * n * (10 * d + 5 * d) * den["num_single_layers"]
    else:  # Wan: self-attention over the video's patches, cross-attention to the text, a d -> ffn -> d MLP
        c, frames, h, w = shapes.latent
        pt, ph, pw = den["patch_size"]
        n, f, patch = (frames // pt) * (h // ph) * (w // pw), den["ffn_dim"], pt * ph * pw
        base = 2 * n * c * patch * d + 2 * n_txt * (d_txt + d) * d + 2 * n * d * den["out_channels"] * patch
        base += den["num_layers"] * (2 * n * (6 * d * d + 2 * d * f) + 2 * n_txt * 2 * d * d + 4 * n * n * d
                                     + 4 * n * n_txt * d)  # fmt: skip
        if mk == "wan22":  # one timestep per token: its embedding (freq -> d -> d) and modulation (d -> 6d)
            base += 2 * n * (den["freq_dim"] * d + d * d + 6 * d * d)
        lora = 4 * r * d * den["num_layers"] * (6 * n + 2 * n_txt)
    return float(base + lora)


# ---------------------------------------------------------------------------------------------------
# The plan: memory.py's peak, FLOP and parameter counts per case, at the GPU's shapes, keyed
# ---------------------------------------------------------------------------------------------------
def plan_key(case: Case, tiny: bool) -> dict:
    """What a case's plan depends on (compared as JSON reads it back): the parts, the size, the flags."""
    scale = "tiny" if tiny else case.scale
    key = {
        "parts": parts_of(case.kind, scale),
        "size": size_of(case, tiny),
        "flags": case_flags(case, tiny, Path("OUT")),
    }
    return json.loads(json.dumps(key, default=str))


def plan_case(case: Case, tiny: bool = False, memory_plan: bool = True, say=print) -> dict:
    """One case's plan: memory.estimate's peak (GB) for its script and flags with its model_config, and the counts."""
    scale = "tiny" if tiny else case.scale
    entry = {"key": plan_key(case, tiny), "flops": count_flops(case, scale), "parts": count_params(case, scale)}
    entry["expected_forward"] = expected_flops(case, scale)
    if memory_plan:
        flags = case_flags(case, tiny, Path("OUT"))
        flags[flags.index("--model-id") + 1] = str(_index_folder(case))
        est = memory.estimate(case.script, flags, model_config=model_config(case.kind, scale))
        entry |= {"memory_gb": est["peak"], "memory_phase": est["peak_phase"]}
        say(f"planned {case.call}/{case.name}: {est['peak']:.3g} GB ({est['peak_phase']})")
    return entry


def _index_folder(case: Case) -> Path:
    """A folder with the kind's model_index.json, for memory.model_kind (under the system's temporary folder)."""
    import tempfile

    out = Path(tempfile.gettempdir()) / "gpu_check_index"
    write_model_folder(case, out)
    return out / "models" / case.kind


def read_plan(path: Path | None) -> dict:
    """The plan in `path` ({} if there is none)."""
    if path is None or not Path(path).is_file():
        return {}
    return json.loads(Path(path).read_text())


def plan_for(plan: dict, case: Case, tiny: bool) -> dict | None:
    """The plan's entry of `case`, if it was made for the case's current parts, size and flags."""
    entry = plan.get(f"{case.call}/{case.name}" + ("/tiny" if tiny else ""))
    return entry if entry and entry.get("key") == plan_key(case, tiny) else None


# ---------------------------------------------------------------------------------------------------
# The timing model: each case's and each call's GPU seconds, before the GPU is lent
# ---------------------------------------------------------------------------------------------------
TIMING = {
    # assumed, for an H100 / H200 SXM (989 TFLOP/s dense bf16): what fraction of it each kind of work reaches
    "peak_tflops": 989.4,
    "mfu_rollout": 0.45,  # no-grad denoiser forwards of a full-size model (bf16 matmuls and flash attention)
    "mfu_train": 0.35,  # forward + backward with LoRA, gradient checkpointing's recomputed forward on top (below)
    "mfu_small": 0.15,  # the same at 2 blocks of each type or under 1B parameters: launches and small GEMMs
    "mfu_vae": 0.15,  # VAE decodes (convolutions, group norms; Wan's VAE in float32: TF32)
    "recompute": 1.0,  # gradient checkpointing: one more forward per training forward
    "launch_s_per_block": 4e-4,  # a forward's kernel launches per block: the floor of a small model's forward
    # fixed costs (seconds), set from the one GPU run so far (docs/gpu.md: its scripts' start-up and first iteration)
    "start_s": 15.0,  # the process: imports, the CUDA context, the matmul peak (the H200 run: a script's 40 s start
    # was mostly reading 28 GB of weights and the reward's checkpoint, at about 1 GB/s, which the kit does not do)
    "environment_s": 2.0,
    "probe_s": 60.0,  # benchmarks/sdpa_probe.py, every kind and kernel: one process per kernel ("about a minute")
    "case_s": 3.0,  # a script's set-up around its model: Accelerator, run folder, logs, prompts, the reward's build
    "first_iteration_s": 6.0,  # a kind's first iteration in a call (new shapes): kernel loading, cuBLAS / cuDNN
    # heuristics, the offload's first trips; a later case of the same kind and size (call 2) does not pay it
    "first_call_s": 10.0,  # once per process: the first CUDA work (lazy module loading, cuBLAS workspace, allocator)
    "init_gb_s": 100.0,  # building weights on the GPU: bytes initialised per second (random fill, kaiming)
    "modules_s": 2.0,  # building a model's modules on the meta device (Python), per model
    "pcie_gb_s": 12.0,  # --offload-frozen: the frozen parts' trips to and from the GPU, twice per iteration
    "release_s": 1.0,  # gc and empty_cache after a case
    "text_flop_per_token_param": 2.0,  # text encoders: 2 FLOPs per parameter per token (at mfu_rollout)
}


def case_work(entry: dict, rows: dict) -> dict:
    """The FLOPs a case does: its rows (the rehearsal's or the GPU's own count: the same flags give the same rows)
    x the counted FLOPs of one row."""
    f = entry["flops"]
    return {
        "rollout_flop": rows["nograd_rows"] * f["forward"],
        "train_flop": rows["grad_rows"] * f["train"],
        "recompute_flop": rows["grad_rows"] * f["forward"],
    }


def estimate_case(case: Case, entry: dict, rows: dict, timing: dict = TIMING, new_shapes: bool = True) -> dict:
    """GPU seconds of one case by the timing model: building its weights, its FLOPs at the assumed MFU (a small model
    at mfu_small, each forward at least its launches), the VAE's decodes, the text encoders, the offload trips, the
    fixed costs (`new_shapes`: the first iteration on the kind's shapes in this call). `rows`: nograd_rows,
    grad_rows, samples (decoded samples), prompts (encoded), forwards (denoiser calls)."""
    t, peak = dict(timing), timing["peak_tflops"] * 1e12
    f, p = entry["flops"], entry["parts"]
    small = f["params"] < 1.5e9 or case.scale == "reduced"
    experts = 2 if KINDS[case.kind].memory_kind == "wan22_a14b" else 1
    work = case_work(entry, rows)
    mfu_r, mfu_t = (t["mfu_small"], t["mfu_small"]) if small else (t["mfu_rollout"], t["mfu_train"])
    rollout = work["rollout_flop"] / (mfu_r * peak)
    train = (work["train_flop"] + t["recompute"] * work["recompute_flop"]) / (mfu_t * peak)
    blocks = sum(v for k, v in parts_of(case.kind, case.scale)["denoiser"].items() if k in ("num_layers",
                 "num_single_layers", "n_layers", "n_refiner_layers")) or 16  # fmt: skip
    floor = rows.get("forwards", 0) * blocks * t["launch_s_per_block"] * 3  # forward, backward, recompute: at most 3x
    weights_gb = 2 * (f["params"] * experts + p["text"] + p["vae"]) / 1e9 + 4 * 1.0  # bf16 parts, fp32 HPS (1B)
    build = weights_gb / t["init_gb_s"] + t["modules_s"]
    decode = rows.get("samples", 0) * p["decode"] / (t["mfu_vae"] * peak)
    text_flop = rows.get("prompts", 0) * text_tokens(case) * p["text"] * t["text_flop_per_token_param"]
    text = text_flop / (t["mfu_rollout"] * peak)
    frozen_gb = (2 * (p["text"] + p["vae"]) + 4 * 1e9) / 1e9  # bf16 text encoders and VAE, the fp32 HPS
    offload = 2 * frozen_gb / t["pcie_gb_s"] if case.call == 2 else 0.0  # to the GPU and back, once an iteration
    fixed = t["case_s"] + t["first_iteration_s"] * new_shapes + t["release_s"]
    parts = {"build": build, "rollout": max(rollout, floor / 3), "train": max(train, floor * 2 / 3),
             "decode": decode, "text": text, "offload": offload, "fixed": fixed}  # fmt: skip
    return {"total_s": sum(parts.values()), **{f"{k}_s": v for k, v in parts.items()}, **work}


def text_tokens(case: Case) -> int:
    """Tokens per prompt through the text encoders (memory.py's padded lengths)."""
    return sum(n for _, _, n in parts_of(case.kind, case.scale)["text"])


def estimate_call(call: int, cases: dict[str, dict], timing: dict = TIMING) -> dict:
    """A call's GPU seconds: start-up, (call 1) the environment and the probe, the first CUDA work, its cases."""
    fixed = (
        timing["start_s"] + timing["first_call_s"] + (timing["environment_s"] + timing["probe_s"] if call == 1 else 0)
    )
    total = fixed + sum(c["total_s"] for c in cases.values())
    return {"call": call, "fixed_s": fixed, "cases_s": total - fixed, "total_s": total, "limit_s": CALL_LIMIT_S[call]}


# ---------------------------------------------------------------------------------------------------
# Running a case in this process
# ---------------------------------------------------------------------------------------------------
def release() -> None:
    """After a case: accelerate's process-wide state reset (the next case's Accelerator starts afresh), garbage
    collected, the CUDA cache emptied, so that the next case has the GPU's memory."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_case(case: Case, tiny: bool, out: Path, attention: str | None) -> dict:
    """One iteration of the case's script in this process under kit_weights and gpu_timing; its metrics (iteration,
    sampling, peak memory, rewards) from the run folder, and the clock's rows and GPU seconds."""
    from common.flags import parse_flags
    from common.logs import read_metrics

    write_model_folder(case, out)
    flags = case_flags(case, tiny, out) + ["--output-dir", str(out / "runs"), "--exp-name", f"{case.call}_{case.name}"]
    if attention:
        flags += ["--attention-backend", attention]
    module = importlib.import_module(case.script[:-3])
    args = parse_flags(module.Args, flags)
    parts, clock, built = parts_of(case.kind, "tiny" if tiny else case.scale), gpu_timing.Clock(), []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        with kit_weights(module, case.kind, parts, TINY_HPS if tiny else "ViT-H-14", built), gpu_timing.timing(clock):
            module.main(args)
        timings = clock.table()
    finally:
        del module, args, clock
        release()
    r = {"status": "ok", "wall_s": time.perf_counter() - t0, "released": all(ref() is None for ref in built)}
    if torch.cuda.is_available():  # what the case left allocated on the GPU (0: everything released)
        r["left_gb"] = torch.cuda.memory_allocated() / 1e9
    runs = sorted((out / "runs").glob(f"{case.call}_{case.name}__*"))
    metrics = [m for m in read_metrics(runs[-1]) if "perf/iteration_s" in m] if runs else []
    if not metrics:
        return r | {"status": "failed (no iteration logged)"}
    last = metrics[-1]
    r |= {
        "iteration_s": last["perf/iteration_s"], "rollout_s": last["perf/sampling_s"],
        "train_s": last["perf/iteration_s"] - last["perf/sampling_s"], "peak_gb": last["perf/peak_mem_gb"],
        "rewards": {k: v for k, v in last.items() if k.startswith("rewards/")},
    }  # fmt: skip
    if timings:
        t = timings[-1]
        r |= {k: t[k] for k in ("nograd_rows", "nograd_s", "grad_rows", "grad_s", "backward_s")}
    for run_dir in runs:
        shutil.rmtree(run_dir, ignore_errors=True)
    return r


def rows_of(r: dict, case: Case) -> dict:
    """The counts the timing model takes, from a case's result: denoiser rows, forwards, decoded samples, prompts."""
    flags = script_flags(case)
    spd = int(flags[flags.index("--samples-per-device") + 1]) if "--samples-per-device" in flags else 4
    return {"nograd_rows": r.get("nograd_rows", 0), "grad_rows": r.get("grad_rows", 0),
            "forwards": (r.get("nograd_rows", 0) + r.get("grad_rows", 0)) // 2 or 1,
            "samples": spd, "prompts": spd + 1}  # fmt: skip


def add_rates(r: dict, flops: dict | None, peak: float | None) -> None:
    """TFLOP/s and MFU (against the measured matmul peak) of the rollout's forwards and of the training step, and
    the FLOPs done."""
    if "nograd_s" not in r or not flops:
        return
    r["rollout_pflop"] = r["nograd_rows"] * flops["forward"] / 1e15
    r["train_pflop"] = r["grad_rows"] * flops["train"] / 1e15
    r["rollout_tflops"] = r["rollout_pflop"] * 1e3 / max(r["nograd_s"], 1e-9)
    r["train_tflops"] = r["train_pflop"] * 1e3 / max(r["grad_s"] + r["backward_s"], 1e-9)
    for what in ("rollout", "train"):
        r[f"{what}_mfu"] = r[f"{what}_tflops"] / peak if peak else None


def matmul_peak_tflops(n: int = 8192, reps: int = 20) -> float:
    """The GPU's measured dense bf16 peak: an n^3 matmul, `reps` times after a warm-up, timed by CUDA events."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def environment() -> dict:
    """Versions and the device: what a result depends on."""
    import accelerate
    import diffusers
    import peft
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "diffusers": diffusers.__version__, "transformers": transformers.__version__,
           "accelerate": accelerate.__version__, "peft": peft.__version__}  # fmt: skip
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        env |= {"gpu": torch.cuda.get_device_name(), "cudnn": torch.backends.cudnn.version(),
                "gpu_memory_gb": total / 1e9, "gpu_free_gb": free / 1e9,
                "capability": ".".join(map(str, torch.cuda.get_device_capability()))}  # fmt: skip
    return env


# ---------------------------------------------------------------------------------------------------
# The results: every step caught and recorded, written from the start
# ---------------------------------------------------------------------------------------------------
class Stopped(BaseException):
    """A SIGTERM (gpu_check.sh's outer limit) or SIGINT: recorded, then the call ends (not caught as a failure)."""


class OutOfTime(Exception):
    """A step still running when the call's time was up (SIGALRM)."""


def on_signal(signum, frame):
    raise Stopped(f"stopped by {signal.Signals(signum).name}")


def on_alarm(signum, frame):
    raise OutOfTime("the call's time limit (--limit-s) was reached during this step")


def first_lines(text: str, n: int = 6, width: int = 300) -> str:
    return "\n".join([line[:width] for line in str(text).strip().splitlines() if line.strip()][:n])


class Check:
    """The results (gpu_check.json, gpu_check.md, gpu_check.log: every line printed), written to --out and --results,
    each on its own (one that cannot be written does not stop the other)."""

    def __init__(self, out: Path, results_dir: Path | None, device: str, calls: list[int]):
        self.out = out
        same = results_dir is not None and results_dir.resolve() == out.resolve()
        self.dests = [out] + ([results_dir] if results_dir and not same else [])
        self.results = {"device": device, "calls": calls, "status": "running", "steps_s": {}, "failures": [],
                        "cases": {}, "estimates": {}}  # fmt: skip
        self.deadline = float("inf")
        for dest in self.dests:
            self._write(dest, "gpu_check.log", "", "w")
        self.save()

    def _write(self, dest: Path, name: str, text: str, mode: str = "w") -> None:
        try:
            dest.mkdir(parents=True, exist_ok=True)
            with open(dest / name, mode) as f:
                f.write(text)
        except OSError as e:
            print(f"warning: cannot write {dest / name}: {e}", file=sys.stderr, flush=True)

    def say(self, line: str, err: bool = False) -> None:
        print(line, file=sys.stderr if err else sys.stdout, flush=True)
        for dest in self.dests:
            self._write(dest, "gpu_check.log", line + "\n", "a")

    def save(self) -> None:
        text, md = json.dumps(self.results, indent=1, default=str), table(self.results) + "\n"
        for dest in self.dests:
            self._write(dest, "gpu_check.json", text)
            self._write(dest, "gpu_check.md", md)

    def fail(self, step: str, kind: str, message: str, tail: str = "") -> dict:
        record = {"step": step, "type": kind, "message": first_lines(message)}
        if tail:
            record["tail"] = tail
        self.results["failures"].append(record)
        self.say(f"FAILED {step}: {kind}" + (f": {record['message']}" if record["message"] else ""), err=True)
        self.save()
        return record

    def attempt(self, step: str, fn, *args, limit_s: float | None = None):
        """(fn(*args), None), or (None, the failure's record) when it raises (SystemExit too: a script's flags that do
        not parse); `limit_s`: SIGALRM ends it (OutOfTime) after that long."""
        t = time.perf_counter()
        if limit_s is not None:
            previous = signal.signal(signal.SIGALRM, on_alarm)
            signal.setitimer(signal.ITIMER_REAL, max(limit_s, 0.01))
        try:
            return fn(*args), None
        except (Exception, SystemExit) as e:  # Stopped (a signal) is neither and ends the call
            tail = "".join(traceback.format_exception(e)[-8:])[-2000:]
            return None, self.fail(step, type(e).__name__, str(e) or repr(e), tail)
        finally:
            if limit_s is not None:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            self.results["steps_s"][step] = time.perf_counter() - t
            release()

    def left_s(self) -> float:
        return self.deadline - time.perf_counter()


def fmt(x, spec=".3g", none="n/a") -> str:
    return none if x is None else format(x, spec)


def pct(x) -> str:
    return f"{x:.0%}" if x is not None else "n/a"


def table(results: dict) -> str:
    """Markdown: one row per case (status, seconds, peak memory against the plan, rates and MFU, FLOPs done, the
    timing model's estimate), each call's estimate and measured time, and what failed."""
    measured, datasheet = results.get("peak_tflops_measured"), results.get("peak_tflops_datasheet")
    rows = [
        "| call | case | setting | status | rollout s | training s | peak GB | plan GB | rollout TFLOP/s, MFU | "
        "training TFLOP/s, MFU | PFLOP done (rollout, training) | estimate on the GPU, s | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.get("cases", {}).values():
        rates = [f"{r[f'{w}_tflops']:.3g}, {pct(r.get(f'{w}_mfu'))}" if f"{w}_tflops" in r else "" for w in
                 ("rollout", "train")]  # fmt: skip
        done = f"{r['rollout_pflop']:.3g}, {r['train_pflop']:.3g}" if "rollout_pflop" in r else ""
        rows.append(
            f"| {r['call']} | {r['case']} | {r['setting']} | {r['status']} | {fmt(r.get('rollout_s'), '.2f', '')} | "
            f"{fmt(r.get('train_s'), '.2f', '')} | {fmt(r.get('peak_gb'), '.3g', '')} | {fmt(r.get('plan_gb'))} | "
            f"{rates[0]} | {rates[1]} | {done} | {fmt(r.get('estimate_s'), '.0f', '')} | "
            f"{fmt(r.get('wall_s'), '.0f', '')} |"
        )
    peaks = (
        f"MFU against the measured bf16 matmul peak {measured:.0f} TFLOP/s"
        + (f" (datasheet {datasheet:.0f})" if datasheet else "")
        if measured
        else "no GPU: no MFU (the seconds are the CPU's, the peak memory the process's resident set)"
    )
    calls = [
        f"- call {e['call']}: estimated {e['total_s']:.0f} s on an H100 / H200 (fixed {e['fixed_s']:.0f} s + cases "
        f"{e['cases_s']:.0f} s; limit {e['limit_s']} s)"
        + (
            f"; measured {results['calls_s'][str(e['call'])]:.0f} s"
            if str(e["call"]) in results.get("calls_s", {})
            else ""
        )  # fmt: skip
        for e in results.get("estimates", {}).values()
    ]
    failures = [
        f"- {f['step']}: {f['type']}" + (": " + f["message"].replace("\n", " / ") if f.get("message") else "")
        for f in results.get("failures", [])
    ]
    return (
        f"{results['device']}; {peaks}\nstatus: {results['status']}\n"
        + ("timing model (benchmarks/gpu_check.py TIMING):\n" + "\n".join(calls) + "\n" if calls else "")
        + "\n"
        + "\n".join(rows)
        + ("\n\nfailures:\n" + "\n".join(failures) if failures else "")
    )


# ---------------------------------------------------------------------------------------------------
# The calls
# ---------------------------------------------------------------------------------------------------
def chosen(calls: str, cases: str) -> tuple[list[int], list[Case]]:
    """--call (1, 2 or 1,2) and --cases (names of those calls' cases; '' = all): ValueError naming the flag."""
    try:
        numbers = [int(c) for c in calls.split(",")]
    except ValueError:
        numbers = []
    if not numbers or any(n not in CASES for n in numbers) or len(set(numbers)) != len(numbers):
        raise ValueError(f"--call {calls!r}: give 1, 2 or 1,2")
    every = [c for n in numbers for c in CASES[n]]
    names = cases.split(",") if cases else [c.name for c in every]
    unknown = [n for n in names if n not in {c.name for c in every}]
    if unknown:
        raise ValueError(f"--cases {cases!r}: {unknown[0]} is not a case of --call {calls} (of: "
                         f"{', '.join(c.name for c in every)}; comma-separated, each once)")  # fmt: skip
    twice = [n for i, n in enumerate(names) if n in names[:i]]
    if twice:
        raise ValueError(f"--cases {cases!r}: {twice[0]} is given twice")
    return numbers, [c for c in every if c.name in names]


def run_call(check: Check, a, call: int, cases: list[Case], tiny: bool, plan: dict, t_call: float) -> None:
    """One call within its limit: (call 1) the environment and the attention probe, then each case, contained, with
    its line as it finishes, its rates from the plan's FLOP counts and the timing model's estimate; then the call's.
    Its limit counts from `t_call` (the first call's: the check's start, its matmul peak included)."""
    out, results, say = check.out, check.results, check.say
    device = "cpu" if tiny else "cuda"
    check.deadline = t_call + (a.limit_s or CALL_LIMIT_S[call] + (10_000 if tiny else 0))
    if call == 1:
        env, _ = check.attempt("environment", environment)
        results["environment"] = env
        say(f"environment: {json.dumps(env)}")
        from benchmarks import sdpa_probe

        # rehearsed with the math kernel alone (one process: the others are the probe's own tests' concern)
        backends = ["math"] if tiny else None
        limit = min(120.0, check.left_s())  # each of its processes, and the whole probe
        rows, _ = check.attempt("sdpa probe", sdpa_probe.probe, device, None, tiny, say, backends, 3, limit,
                                limit_s=check.left_s())  # fmt: skip
        results["sdpa_probe"] = rows
        bad = [r for r in rows or [] if r["status"] in ("error", "non-finite")]
        say(f"sdpa probe: {len(rows or [])} rows, {len(bad)} error or non-finite")
        check.save()
    estimates, kinds_seen = {}, set()
    for case in cases:
        key = f"{call}/{case.name}"
        setting = describe(case, tiny)
        entry = plan_for(plan, case, tiny)
        if entry is None:  # counted now (seconds on the meta device); no memory plan (minutes: --write-plan)
            entry, _ = check.attempt(f"{key}: FLOP count", plan_case, case, tiny, False)
        r = {"call": call, "case": case.name, "setting": setting, "status": "running"}
        results["cases"][key] = r
        if entry:
            r["plan_gb"] = entry.get("memory_gb")
            counted, expected = entry["flops"], entry.get("expected_forward")
            say(f"{key} {setting}: one row's forward {counted['forward'] / 1e12:.4g} TFLOP counted"
                + (f" ({expected / 1e12:.4g} expected)" if expected else "")
                + f", forward + backward {counted['train'] / 1e12:.4g} TFLOP")  # fmt: skip
        if check.left_s() < 1:
            r["status"] = "skipped: no time left"
            check.fail(key, "skipped", f"{max(check.left_s(), 0):.1f} s left of the call's --limit-s")
            continue
        out_r, failure = check.attempt(key, run_case, case, tiny, out, a.attention_backend, limit_s=check.left_s())
        if failure is not None:
            r["status"] = f"failed: {failure['type']}"
        else:
            r |= out_r
            if r["status"] != "ok":
                check.fail(key, r["status"], "")
        if entry:
            add_rates(r, entry["flops"], results.get("peak_tflops_measured"))
            gpu_entry = entry if not tiny else plan_for(plan, case, False) or gpu_counts(check, case)
            if gpu_entry is not None and "nograd_rows" in r:
                est = estimate_case(case, gpu_entry, rows_of(r, case), new_shapes=case.kind not in kinds_seen)
                kinds_seen.add(case.kind)
                r["estimate_s"] = est["total_s"]
                estimates[case.name] = est
        say(line(r))
        check.save()
    results.setdefault("calls_s", {})[str(call)] = time.perf_counter() - t_call
    if estimates:
        results["estimates"][str(call)] = estimate_call(call, estimates) | {"of_cases": sorted(estimates)}
    check.save()


def gpu_counts(check: Check, case: Case) -> dict | None:
    """A rehearsed case's counts at the GPU's shapes when the plan has none current: counted now (seconds)."""
    entry, _ = check.attempt(f"{case.call}/{case.name}: FLOP count at the GPU's shapes", plan_case, case, False, False)
    return entry


def line(r: dict) -> str:
    if "iteration_s" not in r:
        return f"{r['call']}/{r['case']}: {r['status']}"
    rates = "".join(
        f", {w} {r[f'{w}_tflops']:.3g} TFLOP/s ({pct(r.get(f'{w}_mfu'))})" for w in ("rollout", "train")
        if f"{w}_tflops" in r
    )  # fmt: skip
    return (f"{r['call']}/{r['case']}: ok, rollout {r['rollout_s']:.2f} s, training {r['train_s']:.2f} s, peak "
            f"{r['peak_gb']:.3g} GB (plan {fmt(r.get('plan_gb'))}){rates}, {r['wall_s']:.0f} s in all, model "
            f"{'released' if r['released'] else 'NOT released'}"
            + (f", estimated {r['estimate_s']:.0f} s on an H100" if "estimate_s" in r else ""))  # fmt: skip


def write_plan(path: Path, tiny: bool, say=print) -> dict:
    """Every case of both calls planned (memory.py) and counted, at the GPU's shapes (tiny: the rehearsal's); an
    entry of `path` made for the same parts, size and flags is kept. Written after each case."""
    old = read_plan(path)
    plan = {"made": old.get("made")}
    for cases in CASES.values():
        for case in cases:
            entry = plan_for(old, case, tiny)  # made for the same parts, size and flags: kept
            if entry is None:
                entry, plan["made"] = plan_case(case, tiny, say=say), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            plan[f"{case.call}/{case.name}" + ("/tiny" if tiny else "")] = entry
            path.write_text(json.dumps(plan, indent=1) + "\n")
    say(f"{path}: every case planned (made {plan['made']})")
    return plan


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--call", help="1, 2 or 1,2 (default: 1,2 with --rehearse, else required)")
    p.add_argument("--cases", default="", help="comma-separated cases of the call(s) (default: all): a rerun")
    p.add_argument("--rehearse", action="store_true", help="tiny widths on the CPU: the kit end to end")
    p.add_argument("--out", default="/tmp/gpu_check", help="folder of the runs and the results")
    p.add_argument("--results", help="also write the results here, from the start")
    p.add_argument("--limit-s", type=float, help="each call's time limit (default: 240 for call 1, 360 for call 2)")
    p.add_argument("--plan", default=str(PLAN), help="the plan (--write-plan); an entry made for other flags is unused")
    p.add_argument("--write-plan", help="only plan every case (memory.py, FLOP counts) into this file, then end")
    p.add_argument("--attention-backend", choices=("auto", "flash", "efficient", "math", "cudnn"),
                   help="passed to every script (default: the scripts' own)")  # fmt: skip
    a = p.parse_args(argv)
    for flag, path in (("--plan", a.plan), ("--write-plan", a.write_plan)):
        try:
            read_plan(Path(path) if path else None)
        except (OSError, ValueError) as e:
            p.error(f"{flag} {path}: not a plan ({type(e).__name__}: {e})")
    if not Path(a.plan).is_file() and Path(a.plan) != PLAN:
        p.error(f"--plan {a.plan}: no such file (benchmarks/gpu_check.py --write-plan makes one)")
    if a.write_plan and not Path(a.write_plan).resolve().parent.is_dir():
        p.error(f"--write-plan {a.write_plan}: no such folder")
    if a.write_plan:
        write_plan(Path(a.write_plan), a.rehearse)
        return
    if a.call is None and not a.rehearse:
        p.error("--call: give 1 or 2 (the two calls of a lent GPU; --rehearse runs both by default)")
    try:
        calls, cases = chosen(a.call or "1,2", a.cases)
    except ValueError as e:
        p.error(str(e))
    if a.limit_s is not None and a.limit_s <= 0:
        p.error(f"--limit-s {a.limit_s}: must be > 0")
    tiny, out = a.rehearse, Path(a.out)
    if not tiny and not torch.cuda.is_available():
        p.error("--call: no CUDA GPU here; --rehearse runs the kit on the CPU")
    plan = read_plan(Path(a.plan))
    t_call = time.perf_counter()  # the first call's clock: from here, the matmul peak included
    check = Check(out, Path(a.results) if a.results else None, "CPU (rehearsal)" if tiny else "", calls)
    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        check.results["device"] = "CPU (rehearsal)" if tiny else torch.cuda.get_device_name()
        out.mkdir(parents=True, exist_ok=True)
        (out / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
        shutil.rmtree(out / "runs", ignore_errors=True)
        if tiny:
            register_tiny_hps(out / "open_clip")
        else:
            check.results["peak_tflops_measured"], _ = check.attempt("matmul peak", matmul_peak_tflops)
            name = check.results["device"]
            check.results["peak_tflops_datasheet"] = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        for call in calls:
            run_call(check, a, call, [c for c in cases if c.call == call], tiny, plan, t_call)
            t_call = time.perf_counter()
    except Stopped as e:
        check.fail("the check", "Stopped", str(e))
        check.results["status"] = str(e)
        check.save()
        raise SystemExit(f"error: {e}") from None
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    bad = [f["step"] for f in check.results["failures"]]
    check.results["status"] = "done" if not bad else f"done, not everything ran: {', '.join(bad)}"
    check.save()
    check.say(table(check.results))
    if bad:
        raise SystemExit(f"error: not every step ran: {', '.join(bad)} (results in {out}/gpu_check.md)")


if __name__ == "__main__":
    main()
