"""The GPU check's model kinds (memory.py's published configs, their reduced depth for call 1 and tiny widths for
--rehearse) and their weights built on the device: each part on the meta device, then made there as
from_pretrained(dtype) leaves it; `kit_weights` puts these builders in place of the scripts' loaders while a case
runs. Part of benchmarks/gpu/gpu_check.py, whose docstring describes the check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.gpu import memory

LETTERS = "abcdefghijklmnopqrstuvwxyz"
TINY_HPS = "tiny-hps"  # --rehearse's HPSv2.1 architecture: open_clip config memory.TINY_FLUX["reward"]


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
