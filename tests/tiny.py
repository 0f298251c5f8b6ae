"""Tiny random-weight FLUX.1, FLUX.2 [klein], SD3, Qwen-Image, Z-Image, SD1.x, Wan2.1, Wan2.2-TI2V-5B and ShapesBench
models and a tiny HPS reward, built from configs, offline."""

import dataclasses
import functools
import json
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    DDIMScheduler,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    FluxPipeline,
    FluxTransformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    UNet2DConditionModel,
    WanPipeline,
    WanTransformer3DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PixtralImageProcessor,
    PixtralProcessor,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

from common import rewards
from common.shapesbench.builders import build_latent_components, make_pipeline, mark_shapesbench
from common.shapesbench.train_vae import build_vae

PROMPTS = ["a red circle on a blue background", "a green square on a white background"]
RES = 32  # pixels; with the tiny VAEs (scale factor 2) the latents are 16x16
LETTERS = "abcdefghijklmnopqrstuvwxyz"


# ---------------------------------------------------------------- tiny components
def clip_tokenizer():
    # byte-level BPE with no merges: every word is spelled as single letters (the last one carries </w>)
    vocab = [*LETTERS, *(c + "</w>" for c in LETTERS), "<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=[], model_max_length=77)


def clip_config(tok, hidden=32, proj=32):
    return CLIPTextConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=77, projection_dim=proj, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip


def t5(d_model):
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0), *((c, -3.0) for c in LETTERS)]
    tok = T5Tokenizer(vocab=vocab, extra_ids=0)
    cfg = T5Config(vocab_size=len(tok), d_model=d_model, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
                   pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)  # fmt: skip
    return tok, T5EncoderModel(cfg)


def vae(latent_channels, **kw):
    return AutoencoderKL(
        block_out_channels=(16, 32), layers_per_block=1, latent_channels=latent_channels, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, **kw,
    )  # fmt: skip


def build_flux(path):
    torch.manual_seed(0)
    tok = clip_tokenizer()
    tok2, te2 = t5(32)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16 * 4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
        guidance_embeds=True,
    )  # fmt: skip
    FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae(16, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035), text_encoder=CLIPTextModel(clip_config(tok)), tokenizer=tok,
        text_encoder_2=te2, tokenizer_2=tok2, transformer=transformer,
    ).save_pretrained(path)  # fmt: skip


def build_sd3(path):
    torch.manual_seed(0)
    tok = clip_tokenizer()
    tok3, te3 = t5(64)  # T5 width = joint_attention_dim >= sum of the two CLIP widths (the pipeline pads CLIP up)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64,
        pos_embed_max_size=64,
    )  # fmt: skip
    StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae(16, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035),
        text_encoder=CLIPTextModelWithProjection(clip_config(tok)), tokenizer=tok,
        text_encoder_2=CLIPTextModelWithProjection(clip_config(tok)), tokenizer_2=tok,
        text_encoder_3=te3, tokenizer_3=tok3,
    ).save_pretrained(path)  # fmt: skip


def build_sd1(path):
    torch.manual_seed(0)
    tok = clip_tokenizer()
    unet = UNet2DConditionModel(
        sample_size=16, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32, attention_head_dim=8,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
    )  # fmt: skip
    sched = DDIMScheduler(beta_schedule="scaled_linear", clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    StableDiffusionPipeline(
        vae=vae(4, scaling_factor=0.18215), text_encoder=CLIPTextModel(clip_config(tok)), tokenizer=tok, unet=unet,
        scheduler=sched, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    ).save_pretrained(path)  # fmt: skip


def build_wan(path):
    """Wan2.1 text-to-video: UMT5 text encoder, a 3D transformer with 1x2x2 patches, the causal video VAE (8x in
    space, 4x in time after the first frame); 5 frames at 32 px give latents (16, 2, 4, 4)."""
    torch.manual_seed(0)
    tok, _ = t5(32)
    te = UMT5EncoderModel(UMT5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
                                     pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))  # fmt: skip
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
    )  # fmt: skip
    wan_vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    WanPipeline(
        tokenizer=tok, text_encoder=te, transformer=transformer, vae=wan_vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    ).save_pretrained(path)  # fmt: skip


def build_wan22_a14b(path):
    """Wan2.2-T2V-A14B's layout: build_wan's parts with two experts (differently seeded), transformer_2 taking the steps
    below sigma = boundary_ratio 0.875, shift 3 (the real one's 12 leaves few short-schedule steps to the low-noise
    expert); 5 frames at 32 px give latents (16, 2, 4, 4)."""
    build_wan(path)
    pipe = WanPipeline.from_pretrained(path)
    torch.manual_seed(1)
    low = WanTransformer3DModel(**pipe.transformer.config)
    WanPipeline(**{k: getattr(pipe, k) for k in ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")},
                transformer_2=low, boundary_ratio=0.875).save_pretrained(path)  # fmt: skip


def build_wan22_5b(path):
    """Wan2.2-TI2V-5B text-to-video: as build_wan, but the transformer has 48 latent channels and gets one timestep
    per token (expand_timesteps), and the VAE is Wan2.2's: pixels patchified 2x2 (3 -> 12 channels), a residual 8x
    encoder, 48 channels, so 16x in space (scale_factor_spatial must say so: it is a config value); 5 frames at 64 px
    give latents (48, 2, 4, 4), 8 tokens."""
    torch.manual_seed(0)
    tok, _ = t5(32)
    te = UMT5EncoderModel(UMT5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
                                     pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))  # fmt: skip
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=48, out_channels=48,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
    )  # fmt: skip
    stats = torch.rand(2, 48, generator=torch.Generator().manual_seed(1))  # per-channel statistics, exercised
    wan_vae = AutoencoderKLWan(
        base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
        scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=(stats[0] - 0.5).tolist(),
        latents_std=(stats[1] + 0.5).tolist(),
    )  # fmt: skip
    WanPipeline(
        tokenizer=tok, text_encoder=te, transformer=transformer, vae=wan_vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), expand_timesteps=True,
    ).save_pretrained(path)  # fmt: skip


def qwen_tokenizer():
    """Byte-level BPE with no merges (one token per UTF-8 byte, GPT-2's byte-to-character map) and the chat markers
    QwenImagePipeline's prompt template uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = [chr(b) for b in printable] + [chr(256 + k) for k in range(len(others))]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=2048, additional_special_tokens=specials[1:])
    tok.chat_template = QWEN3_CHAT  # Flux2KleinPipeline formats its prompts with it
    return tok


# Qwen3's chat template, reduced to what Flux2KleinPipeline uses: user turns, the generation prompt, enable_thinking
QWEN3_CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_qwen(path):
    """Qwen-Image: a 2-layer Qwen2.5-VL text model (its vision tower, unused for text-to-image, one block), one
    double-stream block of width 32 (RoPE axes 4 + 6 + 6 = the head width 16), the 3D VAE with 8x spatial
    compression (3 downsamplings) and 16 channels: 32 px images are 4 x 4 latents, 4 packed tokens of 64. The
    scheduler config is Qwen-Image's (exponential dynamic shift, terminal sigma 0.02)."""
    torch.manual_seed(0)
    tok = qwen_tokenizer()
    ids = dict(vocab_size=len(tok), bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    text = dict(**ids, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=2048,
                rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6})  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  fullatt_block_indexes=[0], patch_size=14, spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    special = {k: len(tok) - 1 - i for i, k in enumerate(["image_token_id", "video_token_id", "vision_start_token_id",
                                                          "vision_end_token_id"])}  # inside the vocab  # fmt: skip
    te = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**ids, **special, text_config=text, vision_config=vision))
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    qwen_vae = AutoencoderKLQwenImage(base_dim=4, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                      temperal_downsample=[False, True, True])  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0, shift_terminal=0.02,
        use_dynamic_shifting=True, time_shift_type="exponential",
    )  # fmt: skip
    QwenImagePipeline(
        scheduler=scheduler, vae=qwen_vae, text_encoder=te, tokenizer=tok, transformer=transformer
    ).save_pretrained(path)  # fmt: skip


def flux2_parts(guidance_embeds: bool):
    """FLUX.2's transformer (one double and one single block of width 32, 48-wide text features: three stacked
    hidden states of width 16), its VAE (2x compression, 4 latent channels, 16 after the 2x2 patchify, random BatchNorm
    statistics so that decoding un-normalises for real) and its scheduler: 32 px images are 8 x 8 tokens."""
    transformer = Flux2Transformer2DModel(
        in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=48, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )  # fmt: skip
    flux2_vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
    )  # fmt: skip
    flux2_vae.bn.running_mean.normal_(0, 0.5)
    flux2_vae.bn.running_var.uniform_(0.5, 2.0)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential")
    return dict(transformer=transformer, vae=flux2_vae, scheduler=scheduler)


def build_flux2_klein(path, distilled=False):
    """FLUX.2 [klein]: a 27-layer Qwen3 of width 16 (the pipeline stacks hidden states 9, 18 and 27), flux2_parts.
    `distilled`: the guidance-distilled variant (no CFG), else the base one (CFG with "")."""
    torch.manual_seed(0)
    tok = qwen_tokenizer()
    te = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=27, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    ))  # fmt: skip
    Flux2KleinPipeline(
        text_encoder=te, tokenizer=tok, is_distilled=distilled, **flux2_parts(guidance_embeds=False)
    ).save_pretrained(path)  # fmt: skip


MISTRAL_MARKERS = ["<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                    "[IMG_BREAK]", "[IMG_END]"]  # fmt: skip
# Mistral's chat template, reduced to what Flux2Pipeline sends: a system message, then the user's text
MISTRAL_CHAT = (
    "<s>{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{% for c in m['content'] %}{{ c['text'] }}"
    "{% endfor %}[/SYSTEM_PROMPT]{% else %}[INST]{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% else %}[IMG]{% endif %}{% endfor %}[/INST]{% endif %}{% endfor %}"
)


def build_flux2_dev(path):
    """FLUX.2 [dev]: a 30-layer Mistral3 of width 16 behind a PixtralProcessor (the pipeline stacks hidden states 10,
    20 and 30; Mistral's 168-character system message takes 168 of the 512 byte tokens), flux2_parts with the
    guidance embedding."""
    torch.manual_seed(0)
    chars = [t for t in sorted(qwen_tokenizer().get_vocab().items(), key=lambda kv: kv[1]) if not t[0].startswith("<|")]
    vocab = {t: i for i, t in enumerate(MISTRAL_MARKERS + [c for c, _ in chars])}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<pad>", eos_token="</s>", pad_token="<pad>", bos_token="<s>",
                         additional_special_tokens=MISTRAL_MARKERS[3:], model_max_length=4096)  # fmt: skip
    processor = PixtralProcessor(image_processor=PixtralImageProcessor(patch_size=4), tokenizer=tok, patch_size=4,
                                 spatial_merge_size=2, chat_template=MISTRAL_CHAT)  # fmt: skip
    te = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, patch_size=4, image_size=64),
        image_token_index=MISTRAL_MARKERS.index("[IMG]"), spatial_merge_size=2,
    ))  # fmt: skip
    Flux2Pipeline(text_encoder=te, tokenizer=processor, **flux2_parts(guidance_embeds=True)).save_pretrained(path)


def build_zimage(path):
    """Z-Image(-Turbo): a 2-layer Qwen3 (no LM head) of width 16, one refiner and one main block of width 32 (RoPE axes
    4 + 6 + 6 = the head width 16), the FLUX.1-style VAE (2x, 4 channels, Z-Image's scaling and shift factors);
    32 px images are 4 x 16 x 16 latents, 8 x 8 tokens of 2 x 2 patches. The scheduler is Turbo's (static shift 3)."""
    torch.manual_seed(0)
    tok = qwen_tokenizer()
    te = Qwen3Model(Qwen3Config(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    ))  # fmt: skip
    transformer = ZImageTransformer2DModel(
        in_channels=4, dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16,
        axes_dims=[4, 6, 6], axes_lens=[256, 64, 64],
    )  # fmt: skip
    zimage_vae = AutoencoderKL(
        block_out_channels=(8, 16), latent_channels=4, norm_num_groups=4, use_quant_conv=False,
        use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
    )  # fmt: skip
    ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=zimage_vae, text_encoder=te, tokenizer=tok,
        transformer=transformer,
    ).save_pretrained(path)  # fmt: skip


def build_shapes(path):
    """The ShapesBench pipeline's architecture (builders.build_latent_components), one block, a narrow VAE."""
    parts = build_latent_components(4, seed=0, heads=1, layers=1)
    shapes_vae = build_vae(widths=(8, 16, 16), groups=8, seed=0)
    shapes_vae.register_to_config(scaling_factor=0.6, shift_factor=0.2)
    make_pipeline(shapes_vae, parts).save_pretrained(path)
    mark_shapesbench(path)


BUILDERS = {
    "flux": build_flux, "flux2": build_flux2_klein, "flux2-dev": build_flux2_dev, "sd3": build_sd3, "qwen": build_qwen,
    "zimage": build_zimage, "shapes": build_shapes, "sd1": build_sd1, "wan": build_wan, "wan22": build_wan22_5b,
    "wan22_a14b": build_wan22_a14b,
}  # fmt: skip


# HPSv2.1 architecture shrunk: open_clip config 'tiny-hps' (the real one is ViT-H-14)
TINY_HPS = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 224, "layers": 1, "width": 64, "head_width": 32, "patch_size": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def build_tiny_hps(d) -> str:
    """Registers open_clip config 'tiny-hps' and saves random weights in HPS's {'state_dict': ...} format."""
    import open_clip

    (d / "tiny-hps.json").write_text(json.dumps(TINY_HPS))
    open_clip.add_model_config(d)
    torch.manual_seed(0)
    torch.save({"state_dict": open_clip.create_model("tiny-hps", pretrained=None).state_dict()}, d / "tiny.pt")
    return str(d / "tiny.pt")


def use_tiny_hps(monkeypatch) -> None:
    """--reward hpsv2.1 builds the tiny HPS architecture of build_tiny_hps's checkpoints, in this test only."""
    kind = rewards.REWARDS["hpsv2.1"]
    tiny = dataclasses.replace(kind, factory=functools.partial(kind.factory, arch="tiny-hps"))
    monkeypatch.setitem(rewards.REWARDS, "hpsv2.1", tiny)


# ---------------------------------------------------------------- HPSv3: a tiny Qwen2-VL and its processor
# Qwen2-VL-7B-Instruct's chat template, reduced to what HPSv3 formats: a default system turn, user turns of images and
# text, the generation prompt
QWEN2VL_CHAT = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_qwen2vl(path, seed=0):
    """A Qwen2-VL-7B-Instruct folder shrunk, as HPSv3 starts from: the byte-level tokenizer of qwen_tokenizer() with
    Qwen2-VL's vision markers, the chat template above, Qwen2-VL's image processor (its defaults: patch 14, merge 2,
    temporal patch 2, OpenAI CLIP statistics), a config of a 2-layer text model of width 32 (mrope sections 2+3+3 =
    half the head width 16) and a 1-block vision tower of width 16 merged to 32, and its random weights
    (model.safetensors, which the official HPSv3 code starts from). Returns the folder."""
    from transformers import (
        AutoConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    torch.manual_seed(seed)
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = [chr(b) for b in printable] + [chr(256 + k) for k in range(len(others))]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                "<|video_pad|>"]  # fmt: skip
    tok = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(specials + chars)}, merges=[], model_max_length=32768,
                         additional_special_tokens=specials[1:], padding_side="right")  # fmt: skip
    tok.chat_template = QWEN2VL_CHAT
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(), tokenizer=tok, video_processor=Qwen2VLVideoProcessor(),
        chat_template=QWEN2VL_CHAT,
    )  # fmt: skip
    # config.json as the hub's Qwen2-VL-7B-Instruct has it (transformers 4.41's flat layout: the decoder's fields at
    # the top, rope_scaling type "mrope"), shrunk; transformers 5 reads it into text_config
    flat = dict(architectures=["Qwen2VLForConditionalGeneration"], model_type="qwen2_vl", attention_dropout=0.0,
                bos_token_id=tok.pad_token_id, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), hidden_act="silu",
                hidden_size=32, initializer_range=0.02, intermediate_size=64, max_position_embeddings=32768,
                max_window_layers=2, num_attention_heads=2, num_hidden_layers=2, num_key_value_heads=1,
                rms_norm_eps=1e-6, rope_theta=1e6, sliding_window=32768, tie_word_embeddings=False,
                torch_dtype="bfloat16", use_cache=True, use_sliding_window=False, vocab_size=len(tok),
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                vision_config=dict(depth=1, embed_dim=16, mlp_ratio=2, num_heads=2, in_chans=3, hidden_size=32,
                                   patch_size=14, spatial_merge_size=2, spatial_patch_size=14, temporal_patch_size=2),
                **{k: tok.convert_tokens_to_ids(t) for k, t in [("vision_start_token_id", "<|vision_start|>"),
                   ("vision_end_token_id", "<|vision_end|>"), ("image_token_id", "<|image_pad|>"),
                   ("video_token_id", "<|video_pad|>")]})  # fmt: skip
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(flat, indent=2))
    Qwen2VLForConditionalGeneration(AutoConfig.from_pretrained(path)).save_pretrained(path)  # its weights
    (path / "config.json").write_text(json.dumps(flat, indent=2))  # the hub's layout again
    processor.save_pretrained(path)
    return path


# ---------------------------------------------------------------- LTX-2.3 and HunyuanVideo-1.5 text-to-video
def gemma_tokenizer():
    """Gemma's BPE with byte fallback and no merges, its five special tokens, single letters with and without the
    word marker "▁" (LTX2Pipeline pads on the left)."""
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    vocab = {t: i for i, t in enumerate([*specials, "▁", *LETTERS, *("▁" + c for c in LETTERS)])}
    return GemmaTokenizer(vocab=vocab, merges=[], model_max_length=1024)


def build_ltx2(path):
    """LTX-2.3's layout (gated attention, prompt modulation, per-modality connector projections, no caption
    projection: diffusers' LTX-2.3 conversion config) shrunk: a 2-layer Gemma 3 of width 16 (3 stacked hidden states
    of 16), connectors of one block and 128 registers per stream, a one-block transformer of width 32 (video) and 16
    (audio), 16 latent channels on both (the audio VAE's 4 channels x 16 / 4 mel bins), the video VAE 4x in space and
    time with random per-channel statistics, a tiny vocoder; LTX-2's scheduler (exponential dynamic shift, mu 0.95 at
    1024 tokens to 2.05 at 4096, the last sigma stretched to 0.1). 9 frames at 32 x 64 px: 3 x 8 x 16 = 384 video
    tokens and 9 audio tokens of 16."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2Pipeline, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    tok = gemma_tokenizer()
    n = len(tok)
    te = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=dict(vocab_size=n + 3, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
                         sliding_window=64, pad_token_id=0, eos_token_id=1, bos_token_id=2),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=n, eoi_token_index=n + 1, image_token_index=n + 2,
    ))  # fmt: skip
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=16, video_connector_num_layers=1, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1, video_gated_attn=True,
        audio_gated_attn=True, rope_type="split", per_modality_projections=True, video_hidden_dim=32,
        audio_hidden_dim=16, proj_bias=True,
    )  # fmt: skip
    transformer = LTX2VideoTransformer3DModel(
        in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
        vae_scale_factors=(4, 4, 4), gated_attn=True, cross_attn_mod=True, audio_in_channels=16,
        audio_out_channels=16, audio_num_attention_heads=2, audio_attention_head_dim=8, audio_cross_attention_dim=16,
        audio_gated_attn=True, audio_cross_attn_mod=True, num_layers=1, caption_channels=16, rope_type="split",
        use_prompt_embeddings=False, perturbed_attn=True,
    )  # fmt: skip
    vae = AutoencoderKLLTX2Video(
        latent_channels=16, block_out_channels=(8, 16), down_block_types=("LTX2VideoDownBlock3D",) * 2,
        decoder_block_out_channels=(8, 16), layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, True), decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False,) * 3, downsample_type=("spatiotemporal",) * 2,
        upsample_type=("spatiotemporal",) * 2, upsample_residual=(True, True), upsample_factor=(2, 2), patch_size=1,
        decoder_causal=False,
    )  # fmt: skip
    stats = torch.rand(2, 16, generator=torch.Generator().manual_seed(1))
    vae.latents_mean.copy_(stats[0] - 0.5), vae.latents_std.copy_(stats[1] + 0.5)
    audio_vae = AutoencoderKLLTX2Audio(base_channels=16, ch_mult=(1, 2, 4), num_res_blocks=1, latent_channels=4,
                                       mel_bins=16)  # fmt: skip
    vocoder = LTX2Vocoder(in_channels=32, hidden_channels=8, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
                          resnet_kernel_sizes=[3], resnet_dilations=[[1]])  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_image_seq_len=1024, max_image_seq_len=4096, base_shift=0.95, max_shift=2.05,
        time_shift_type="exponential", shift_terminal=0.1,
    )  # fmt: skip
    LTX2Pipeline(
        scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=te, tokenizer=tok, connectors=connectors,
        transformer=transformer, vocoder=vocoder,
    ).save_pretrained(path)  # fmt: skip


def build_hunyuan15(path):
    """HunyuanVideo-1.5 shrunk: a 2-layer Qwen2.5-VL text model of width 32 (qwen_tokenizer's chat template), a 1-layer
    ByT5 (T5 encoder over ByT5's byte tokenizer) of width 16, a one-block transformer of width 32 with one refiner
    block, the VAE 4x in space and time with 8 channels (the transformer takes 2 x 8 + 1); the scheduler's static
    shift 5 (UniRL's). 9 frames at 32 x 64 px give latents (8, 3, 8, 16)."""
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    torch.manual_seed(0)
    tok = qwen_tokenizer()
    te = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2048, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]},
    ))  # fmt: skip
    tok2 = ByT5Tokenizer()
    te2 = T5EncoderModel(T5Config(vocab_size=len(tok2), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                  pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))  # fmt: skip
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=17, out_channels=8, num_attention_heads=2, attention_head_dim=16, num_layers=1,
        num_refiner_layers=1, text_embed_dim=32, text_embed_2_dim=16, image_embed_dim=16, rope_axes_dim=(4, 6, 6),
        target_size=64, task_type="t2v",
    )  # fmt: skip
    vae = AutoencoderKLHunyuanVideo15(latent_channels=8, block_out_channels=(8, 16, 16), layers_per_block=1,
                                      spatial_compression_ratio=4, temporal_compression_ratio=4)  # fmt: skip
    HunyuanVideo15Pipeline(
        text_encoder=te, tokenizer=tok, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=te2, tokenizer_2=tok2,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    ).save_pretrained(path)  # fmt: skip


# ---------------------------------------------------------------- tiny reward models
def build_tiny_clip(d, size: int = 64) -> None:
    """A folder with a tiny random CLIPModel, the real CLIP BPE tokenizer (built offline from open_clip's vocab file)
    and a CLIPImageProcessor at `size` px, as --reward-ckpt expects."""
    import gzip

    import open_clip.tokenizer
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    bpe = Path(open_clip.tokenizer.__file__).parent / "bpe_simple_vocab_16e6.txt.gz"
    merges = [tuple(line.split()) for line in gzip.open(bpe).read().decode().split("\n")[1 : 49152 - 256 - 2 + 1]]
    vocab = list(open_clip.tokenizer.bytes_to_unicode().values())
    vocab += [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    tokenizer = CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=merges, model_max_length=77)

    image_processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=49408,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=49406,
            eos_token_id=49407,
            pad_token_id=49407,
        ),
        vision_config=dict(
            image_size=size,
            patch_size=16,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
        ),
        projection_dim=32,
    )
    CLIPModel(config).save_pretrained(d)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(d)


def build_tiny_geneval(d, num_labels: int = 80) -> None:
    """A --reward-ckpt geneval folder: mask2former/ (a tiny random Swin + Mask2Former with `num_labels` classes, 10
    queries) and clip/ (build_tiny_clip)."""
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig

    swin = SwinConfig(
        embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2], window_size=7,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )  # fmt: skip
    config = Mask2FormerConfig(
        backbone_config=swin, num_labels=num_labels, hidden_dim=32, mask_feature_size=32, feature_size=32,
        encoder_feedforward_dim=64, dim_feedforward=64, decoder_layers=2, encoder_layers=1, num_queries=10,
        num_attention_heads=2, use_pretrained_backbone=False,
    )  # fmt: skip
    torch.manual_seed(0)
    Mask2FormerForUniversalSegmentation(config).save_pretrained(Path(d) / "mask2former")
    build_tiny_clip(Path(d) / "clip")


def build_kontext(path):
    """FLUX.1-Kontext: build_flux's parts (a FLUX transformer with guidance_embeds, CLIP + T5, the 2x VAE) saved as a
    FluxKontextPipeline; 32 px images are 16 x 16 latents, 64 noisy tokens and 64 source tokens of 64."""
    from diffusers import FluxKontextPipeline

    build_flux(path)
    FluxKontextPipeline(**FluxPipeline.from_pretrained(path).components).save_pretrained(path)


def wan_i2v_transformer(**kw):
    """build_wan's transformer taking image-to-video input: 16 noisy + 4 mask + 16 first-frame latent channels."""
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=36, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1, rope_max_seq_len=32, **kw,
    )  # fmt: skip


def build_wan_i2v(path):
    """Wan2.1-I2V-14B's layout: build_wan's UMT5 and VAE, a transformer of 36 input channels whose cross-attention
    also reads CLIP image tokens (image_dim 24, added_kv_proj_dim = its width 16), a 2-layer CLIPVisionModel (the
    pipeline reads the penultimate hidden state) at 24 px with 8 px patches (10 tokens) and its CLIPImageProcessor,
    which resizes the 32 px first frame to 24; 5 frames at 32 px give latents (16, 2, 4, 4)."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    build_wan(path)
    pipe = WanPipeline.from_pretrained(path)
    torch.manual_seed(2)
    transformer = wan_i2v_transformer(image_dim=24, added_kv_proj_dim=16)
    encoder = CLIPVisionModel(CLIPVisionConfig(image_size=24, patch_size=8, hidden_size=24, intermediate_size=48,
                                               num_hidden_layers=2, num_attention_heads=2))  # fmt: skip
    processor = CLIPImageProcessor(size={"shortest_edge": 24}, crop_size={"height": 24, "width": 24})
    WanImageToVideoPipeline(
        tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae, scheduler=pipe.scheduler,
        image_processor=processor, image_encoder=encoder, transformer=transformer,
    ).save_pretrained(path)  # fmt: skip


def build_wan22_i2v_a14b(path):
    """Wan2.2-I2V-A14B's layout: build_wan's UMT5 and VAE, two differently seeded experts of 36 input channels and no
    image encoder, transformer_2 taking the steps below sigma = boundary_ratio 0.9 (the real one's), shift 3; 5
    frames at 32 px give latents (16, 2, 4, 4)."""
    from diffusers import WanImageToVideoPipeline

    build_wan(path)
    pipe = WanPipeline.from_pretrained(path)
    torch.manual_seed(3)
    high = wan_i2v_transformer()
    torch.manual_seed(4)
    low = wan_i2v_transformer()
    WanImageToVideoPipeline(
        tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae, scheduler=pipe.scheduler,
        transformer=high, transformer_2=low, boundary_ratio=0.9,
    ).save_pretrained(path)  # fmt: skip


# ---------------------------------------------------------------- Qwen-Image-Edit-2509 and -2511 (Plus pipeline)
def build_qwen_edit_plus(path, zero_cond_t=False):
    """Qwen-Image-Edit-2509 (zero_cond_t False) or -2511 (zero_cond_t True: the condition tokens are modulated at
    timestep 0) shrunk: build_qwen's transformer, VAE and scheduler, and a Qwen2.5-VL that sees images, so its
    tokenizer (byte-level, no merges) has the vision markers and a Qwen2VLProcessor (Qwen2-VL's image processor at its
    defaults: patch 14, merge 2, at least 56 x 56 pixels) turns each condition image into vision tokens. The text
    model is build_qwen's (2 layers of width 32), the vision tower one block of width 16 merged to 32. The pipeline's
    module constants (VAE_IMAGE_SIZE, CONDITION_IMAGE_SIZE) are its own; tests/test_edit_qwen.py shrinks them."""
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPlusPipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2Tokenizer,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    torch.manual_seed(0)
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = [chr(b) for b in printable] + [chr(256 + k) for k in range(len(others))]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                "<|video_pad|>"]  # fmt: skip
    tok = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(specials + chars)}, merges=[], model_max_length=2048,
                         additional_special_tokens=specials[1:])  # fmt: skip
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(), tokenizer=tok, video_processor=Qwen2VLVideoProcessor()
    )
    ids = dict(vocab_size=len(tok), bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    markers = {k: tok.convert_tokens_to_ids(t) for k, t in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}  # fmt: skip
    text = dict(**ids, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=2048,
                rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6})  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  fullatt_block_indexes=[0], patch_size=14, spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    te = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**ids, **markers, text_config=text, vision_config=vision))
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6), zero_cond_t=zero_cond_t,
    )  # fmt: skip
    qwen_vae = AutoencoderKLQwenImage(base_dim=4, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                      temperal_downsample=[False, True, True])  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0, shift_terminal=0.02,
        use_dynamic_shifting=True, time_shift_type="exponential",
    )  # fmt: skip
    QwenImageEditPlusPipeline(
        scheduler=scheduler, vae=qwen_vae, text_encoder=te, tokenizer=tok, processor=processor, transformer=transformer
    ).save_pretrained(path)
