"""The published configurations the memory plan builds its models from (no weights are read: the hub configs'
values), and the CPU-sized ones of the tests and the GPU check's --tiny. benchmarks/gpu/memory.py measures with
them."""

GB = 1e9
SCRIPTS = ("dancegrpo", "branchgrpo", "vgrpo", "rlr", "diffusionnft", "dgpo")

# ---------------------------------------------------------------------------------------------------
# Published configurations (no weights are read; these are the hub configs' values)
# ---------------------------------------------------------------------------------------------------
# black-forest-labs/FLUX.1-dev transformer/config.json: diffusers' FluxTransformer2DModel defaults with the guidance
# embedding (19 double + 38 single blocks, width 3072, 11.9B parameters)
FLUX_DEV = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
# stabilityai/stable-diffusion-3.5-medium transformer/config.json (2.24B parameters built from it). Not verified
# against the file here (no hub access): dual_attention_layers = blocks 0-12 and pos_embed_max_size 384 are from
# memory; the other values are SD3-Medium's, which 3.5-Medium shares.
SD35_MEDIUM = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
    joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)  # fmt: skip
# stable-diffusion-v1-5/stable-diffusion-v1-5 unet/config.json: diffusers' UNet2DConditionModel defaults with CLIP-L's
# width as cross-attention width (860M parameters)
SD15_UNET = dict(cross_attention_dim=768, sample_size=64)
# openai/clip-vit-large-patch14 text config (FLUX.1 and SD3 text_encoder, SD1.5 text_encoder; 123M)
CLIP_L = dict(
    vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768,
)  # fmt: skip
# SD3 text_encoder_2/config.json, the text tower of laion/CLIP-ViT-bigG-14 (695M)
CLIP_G = dict(
    vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
    max_position_embeddings=77, hidden_act="gelu", projection_dim=1280,
)  # fmt: skip
# FLUX.1-dev / SD3 text_encoder_2 (_3)/config.json: the T5 v1.1 XXL encoder (4.76B)
T5_XXL = dict(
    vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, feed_forward_proj="gated-gelu",
    relative_attention_num_buckets=32, relative_attention_max_distance=128,
)  # fmt: skip
# FLUX.1-dev vae/config.json (SD3.5's VAE has the same architecture, other scaling / shift factors; 84M)
VAE_16CH = dict(
    latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    use_quant_conv=False, use_post_quant_conv=False,
)  # fmt: skip
# stable-diffusion-v1-5 vae/config.json (84M)
VAE_4CH = dict(
    latent_channels=4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
)  # fmt: skip
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json (1.42B parameters built from it): the values of diffusers'
# scripts/convert_wan_to_diffusers.py for Wan-T2V-1.3B; rope_max_seq_len is WanTransformer3DModel's default (not in
# that script's dict, so not checked against the hub file)
WAN_T2V_1_3B = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=1024,
)  # fmt: skip
# Wan2.1 text_encoder/config.json: google/umt5-xxl's encoder (5.68B; every layer has its own relative position bias)
UMT5_XXL = dict(
    vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, feed_forward_proj="gated-gelu",
    relative_attention_num_buckets=32, relative_attention_max_distance=128,
)  # fmt: skip
# Wan2.1 vae/config.json: AutoencoderKLWan's defaults (127M), 8x in space, 4x in time after the first frame; kept in
# fp32 by common.models.WanModel, which decodes one video at a time
VAE_WAN = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
# Qwen/Qwen-Image transformer/config.json: QwenImageTransformer2DModel's defaults are the released model (60 double-stream
# blocks, width 3072, 20.43B parameters); its text_encoder is Qwen2.5-VL-7B-Instruct (8.29B, of which the vision tower,
# loaded by QwenImagePipeline but unused for text-to-image, is 0.68B); its VAE AutoencoderKLQwenImage's defaults (127M)
QWEN_IMAGE = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
QWEN25_VL_7B = dict(
    vocab_size=152064, tie_word_embeddings=False,
    text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                     rope_scaling={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                       fullatt_block_indexes=[7, 15, 23, 31], patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, window_size=112),
)  # fmt: skip
VAE_QWEN = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
# Qwen/Qwen-Image-Edit-2509 (QwenImageEditPlusPipeline): Qwen-Image's transformer (20.43B), Qwen2.5-VL-7B (which now
# reads each reference image: Qwen2-VL's processor patches the pipeline's 384 x 384 condition image at 392 x 392, 28 x
# 28 patches of 14 merged 2 x 2 into 196 tokens) and VAE; -2511's transformer differs by zero_cond_t (the reference
# tokens modulated at timestep 0; the same parameters). In the chat template each image is "Picture k: " (5 tokens:
# Qwen2's pre-tokenizer splits off the spaces, the digit and the colon), <|vision_start|>, its 196 tokens and
# <|vision_end|>; the template's first 64 tokens (the system turn) are dropped after encoding and its last 5
# ("<|im_end|>\n<|im_start|>assistant\n") kept
QWEN_EDIT_IMAGE_TOKENS, QWEN_EDIT_PICTURE_PREFIX, QWEN_EDIT_DROPPED, QWEN_EDIT_SUFFIX = 196, 5, 64, 5
QWEN_EDIT_PICTURE_TOKENS = QWEN_EDIT_PICTURE_PREFIX + 1 + QWEN_EDIT_IMAGE_TOKENS + 1  # 203 per image
QWEN_EDIT_CONDITION_PATCHES = (28, 28)  # Qwen2-VL patches of the 392 x 392 condition image (before the 2 x 2 merge)
# black-forest-labs/FLUX.2-klein-base-4B: the transformer (3.88B: 5 double + 20 single blocks, width 3072, 128-channel
# tokens), Qwen3-4B as text encoder (4.02B; the pipeline stacks its hidden states 9, 18, 27: 7680 wide), the FLUX.2 VAE
# (AutoencoderKLFlux2's defaults, 84M: 32 channels, 8x)
FLUX2_KLEIN_4B = dict(
    in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=7680, guidance_embeds=False, axes_dims_rope=(32, 32, 32, 32),
)  # fmt: skip
# black-forest-labs/FLUX.2-dev: Flux2Transformer2DModel's defaults (32.22B: 8 double and 48 single blocks of 6144,
# guidance embedded) and Mistral-Small-3.1-24B (Mistral3ForConditionalGeneration: a 40-layer 5120-wide language model
# and the Pixtral vision tower, loaded but unused for text-to-image; the pipeline stacks hidden states 10, 20 and 30)
FLUX2_DEV = dict(
    in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128, num_attention_heads=48,
    joint_attention_dim=15360, guidance_embeds=True, axes_dims_rope=(32, 32, 32, 32),
)  # fmt: skip
MISTRAL_SMALL_31 = dict(
    text_config=dict(
        model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    vision_config=dict(
        model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
        image_size=1540, patch_size=14,
    ),
    tie_word_embeddings=False,
)  # fmt: skip
QWEN3_4B = dict(
    vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960,
)  # fmt: skip
VAE_FLUX2 = dict()
# Wan-AI/Wan2.2-TI2V-5B-Diffusers: the transformer of Wan's wan_ti2v_5B config (5.00B: width 3072, 30 layers, 48 latent
# channels) and the Wan2.2 VAE (705M: pixels patchified 2x2, a residual 8x encoder, 48 channels; 16x in space; its 48
# published latent statistics' values do not change a memory plan)
WAN22_TI2V_5B = dict(
    patch_size=(1, 2, 2), num_attention_heads=24, attention_head_dim=128, in_channels=48, out_channels=48,
    text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=1024,
)  # fmt: skip
# Tongyi-MAI/Z-Image-Turbo (and Z-Image) transformer/config.json: ZImageTransformer2DModel's defaults (6.15B: width
# 3840, 30 layers and 2 + 2 refiner layers, 30 heads, Qwen3-4B captions of 2560); Qwen3-4B and the FLUX.1 VAE
Z_IMAGE = dict(dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30, n_kv_heads=30, cap_feat_dim=2560, in_channels=16)
# Wan-AI/Wan2.2-T2V-A14B-Diffusers: two experts (transformer, transformer_2), each Wan2.1-T2V-14B's architecture
# (14.29B: width 5120, 40 layers, 40 heads, FFN 13824), on Wan2.1's UMT5-XXL and 16-channel 8x VAE
WAN22_A14B_EXPERT = {**WAN_T2V_1_3B, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers (and -720P) transformer/config.json, as diffusers' convert_wan_to_diffusers.py
# writes it: Wan2.1-14B's blocks taking 36 input channels (16 noisy + 4 mask + 16 first-frame latents) and, in each
# cross-attention, keys and values of the first frame's CLIP tokens (image_dim 1280 lifted to the width 5120): 16.39B
WAN21_I2V_14B = {**WAN22_A14B_EXPERT, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}
# its image_encoder: CLIP ViT-H/14's vision tower (laion/CLIP-ViT-H-14-laion2B-s32B-b79K; CLIPVisionModel, 630.8M: 32
# layers of width 1280, 257 tokens at 224 px; WanImageToVideoPipeline.encode_image reads the penultimate hidden state)
CLIP_VIT_H14_VISION = dict(
    hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16, patch_size=14,
    image_size=224, hidden_act="gelu", projection_dim=1024,
)  # fmt: skip
# Wan-AI/Wan2.2-I2V-A14B-Diffusers: two experts (transformer, transformer_2) of Wan2.1-14B's blocks taking the same 36
# channels, without the image cross-attention (no image encoder): 14.29B each; Wan2.1's UMT5-XXL and VAE
WAN22_I2V_A14B_EXPERT = {**WAN22_A14B_EXPERT, "in_channels": 36}
VAE_WAN22 = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
    temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
    scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=[0.0] * 48, latents_std=[1.0] * 48,
)  # fmt: skip
# Lightricks/LTX-2.3 (LTX2Pipeline), the values of diffusers' scripts/convert_ltx2_to_diffusers.py for version 2.3: the
# audio-video transformer (18.99B: 48 blocks, video width 4096, audio width 2048, gated attention and prompt
# modulation), the text connectors (3.17B: 8 blocks per stream; 18.99B + 3.17B = the published 22B), the video VAE
# (726M: 32x in space, 8x in time, 128 channels). Its text encoder is Gemma 3 12B (12.19B: an 11.77B language model of
# 48 layers, width 3840, and a 0.42B SigLIP tower; LTX2Pipeline stacks all 49 hidden states of 1024 left-padded tokens)
LTX23 = dict(
    in_channels=128, out_channels=128, num_attention_heads=32, attention_head_dim=128, cross_attention_dim=4096,
    gated_attn=True, cross_attn_mod=True, audio_in_channels=128, audio_out_channels=128, audio_num_attention_heads=32,
    audio_attention_head_dim=64, audio_cross_attention_dim=2048, audio_gated_attn=True, audio_cross_attn_mod=True,
    num_layers=48, caption_channels=3840, rope_type="split", use_prompt_embeddings=False, perturbed_attn=True,
)  # fmt: skip
LTX23_TRANSFORMER, LTX23_CONNECTORS = 18_988_838_144, 3_172_227_584  # parameters built from the configs
VAE_LTX23 = dict(
    latent_channels=128, block_out_channels=(256, 512, 1024, 1024), decoder_block_out_channels=(256, 512, 512, 1024),
    layers_per_block=(4, 6, 4, 2, 2), decoder_layers_per_block=(4, 6, 4, 2, 2), spatio_temporal_scaling=(True,) * 4,
    decoder_spatio_temporal_scaling=(True,) * 4, decoder_inject_noise=(False,) * 5,
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    upsample_type=("spatiotemporal", "spatiotemporal", "temporal", "spatial"), upsample_residual=(False,) * 4,
    upsample_factor=(2, 2, 1, 2), patch_size=4, decoder_causal=False, decoder_spatial_padding_mode="zeros",
    spatial_compression_ratio=32, temporal_compression_ratio=8,
)  # fmt: skip
# LTX-2.3's text side, built here as one Qwen3ForCausalLM of Gemma 3 12B's shape (its widths, heads, head width and
# tied 262k vocabulary; build_text_encoder has no Gemma or connector family) with 64 layers instead of 48: 15.35B, the
# bytes of Gemma 3 12B (12.19B with its SigLIP tower) and the connectors (3.17B: 8 blocks per stream) together; its
# encoding activations are those of a 64-layer stack over 1024 tokens
GEMMA3_12B_LM = dict(
    vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=64, num_attention_heads=16,
    num_key_value_heads=8, head_dim=256, tie_word_embeddings=True, max_position_embeddings=131072,
)  # fmt: skip
# The real parts, for the GPU check's builder (benchmarks/gpu/gpu_build.py): google/gemma-3-12b-it's config (12.19B with
# its SigLIP tower, the published 12B) and LTX2TextConnectors as diffusers' LTX-2.3 conversion builds it (3.17B)
GEMMA3_12B = dict(
    text_config=dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=256, sliding_window=1024,
                     query_pre_attn_scalar=256, max_position_embeddings=131072),
    vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                       image_size=896, patch_size=14, vision_use_head=False),
    mm_tokens_per_image=256, boi_token_index=255999, eoi_token_index=256000, image_token_index=262144,
)  # fmt: skip
LTX23_TEXT_CONNECTORS = dict(
    caption_channels=3840, text_proj_in_factor=49, video_connector_num_attention_heads=32,
    video_connector_attention_head_dim=128, video_connector_num_layers=8, video_gated_attn=True,
    audio_connector_num_attention_heads=32, audio_connector_attention_head_dim=64, audio_connector_num_layers=8,
    audio_gated_attn=True, rope_type="split", per_modality_projections=True, video_hidden_dim=4096,
    audio_hidden_dim=2048, proj_bias=True,
)  # fmt: skip
# hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v: HunyuanVideo15Transformer3DModel's defaults (8.33B, the published
# 8.3B: 54 blocks of width 2048, 65 input channels = latents, condition latents and mask), AutoencoderKLHunyuanVideo15's
# defaults (1.26B: 16x in space, 4x in time, 32 channels); text: Qwen2.5-VL-7B (the pipeline loads its text model
# alone, 7.07B; the plan builds the whole VL model, 8.29B) and a ByT5-small glyph encoder (218M)
HUNYUAN15 = dict()
VAE_HUNYUAN15 = dict()
BYT5_SMALL = dict(vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
                  feed_forward_proj="gated-gelu")  # fmt: skip
# HPSv2.1 is open_clip's ViT-H-14 (986M), kept in fp32 by common/rewards.py; None = open_clip's registered config
HPS = None
# HPSv3 (common/hpsv3.py): Qwen/Qwen2-VL-7B-Instruct's config.json (8.29B parameters with its LM head; HPSv3 drops the
# 545M head and adds one token: 7.75B in bf16, 15.5 GB) and an fp32 head of 3.7M. Its input per image: 256 merged image
# tokens (Qwen2-VL's smart resize to 256 x 28 x 28 pixels, any aspect), the chat turn around the official instruction
# (527 tokens with Qwen2's BPE: counted once with Qwen's qwen.tiktoken ranks, which Qwen2's tokenizer shares) and the
# prompt (64 tokens allowed), so 847 positions
QWEN2_VL_7B = dict(
    model_type="qwen2_vl", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, vocab_size=152064, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768,
    tie_word_embeddings=False, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    vision_config=dict(depth=32, embed_dim=1280, mlp_ratio=4, num_heads=16, in_chans=3, hidden_size=3584, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2),
)  # fmt: skip
HPSV3_TEXT_TOKENS = 527 + 64  # the instruction's chat turn and the prompt
# GenEval (common/geneval.py): facebook/mask2former-swin-small-coco-instance's config (Swin-S backbone, 100 queries, 80
# classes; 68.7M parameters) and openai/clip-vit-large-patch14's (427.6M), both fp32 as transformers loads them
MASK2FORMER_SWIN_S = dict(
    backbone_config=dict(model_type="swin", embed_dim=96, depths=[2, 2, 18, 2], num_heads=[3, 6, 12, 24], window_size=7,
                         image_size=224, out_features=["stage1", "stage2", "stage3", "stage4"]),
    num_labels=80, num_queries=100, use_pretrained_backbone=False,
)  # fmt: skip
CLIP_VIT_L14 = dict(
    text_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                     max_position_embeddings=77),
    vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       patch_size=14, image_size=224),
    projection_dim=768,
)  # fmt: skip

# A CPU-sized FLUX for tests and the GPU check's --rehearse (a model_config of estimate()): the same classes with
# benchmarks/gpu/gpu_build.py's tiny sizes, and tests/tiny.py's HPS (open_clip config 'tiny-hps')
TINY_FLUX = {
    "denoiser": dict(
        num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, axes_dims_rope=(4, 4, 8),
    ),
    "text": [
        ("clip", dict(CLIP_L, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2), 77),
        ("t5", dict(T5_XXL, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2), 512),
    ],
    "vae": dict(
        block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
    ),
    "reward": {
        "embed_dim": 32,
        "vision_cfg": {"image_size": 224, "layers": 1, "width": 64, "head_width": 32, "patch_size": 32},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    },
}  # fmt: skip
# A CPU-sized Wan2.1 (tests/tiny.py's build_wan: 1 block of width 16, a 1-layer UMT5 of width 32, a VAE of base width
# 3), the same classes; as TINY_FLUX, for tests and the GPU check's --rehearse
TINY_WAN = {
    "denoiser": dict(
        num_attention_heads=2, attention_head_dim=8, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1,
        rope_max_seq_len=32,
    ),
    "text": [("umt5", dict(UMT5_XXL, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2), 512)],
    "vae": dict(base_dim=3, dim_mult=[1, 1, 1, 1], num_res_blocks=1),
    "reward": TINY_FLUX["reward"],
}  # fmt: skip
# A CPU-sized Qwen-Image (tests/tiny.py's build_qwen: one block of width 32, a 2-layer Qwen2.5-VL of width 32, a VAE of
# base width 4), the same classes
TINY_QWEN = {
    "denoiser": dict(num_layers=1, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                     axes_dims_rope=(4, 6, 6)),
    "text": [("qwen25vl", dict(
        vocab_size=264, text_config=dict(vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                                         rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0]),
    ), 34 + 64)],
    "vae": dict(base_dim=4),
    "reward": TINY_FLUX["reward"],
}  # fmt: skip
