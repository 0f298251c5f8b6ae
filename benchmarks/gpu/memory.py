"""Per-GPU memory plan of every GPU recipe in run.sh, measured without a GPU: fake tensors, real architectures.

    python benchmarks/memory.py                                # every GPU recipe: a markdown table (~3 min)
    python benchmarks/memory.py --out docs/gpu_memory.md       # the same, also written to a file
    python benchmarks/memory.py --recipes vgrpo-flux-8gpu vgrpo-wan-8gpu   # some recipes only
    python benchmarks/memory.py --command "accelerate launch --num_processes 8 dancegrpo.py --model-id ..."  # any
    OMP_NUM_THREADS=1 python benchmarks/memory.py --cross-check   # the estimate against a real CPU run (~4 min)

Each recipe's command comes from `bash run.sh --print NAME` (`--list` names them; GPU recipes are those on flux,
sd35, sd15, wan or qwen, less the multi-node ones, whose per-GPU memory is their 8-GPU twin's); its flags are parsed by the
script's own `Args` (tyro), and the process count and FSDP come from the accelerate config it names. The models are
built from their published configs (the constants below) inside `FakeTensorMode`: every tensor has a shape, a dtype
and a size but no data, so FLUX.1-dev's 12B parameters cost nothing, and `MemTracker` (torch.distributed._tools)
follows every storage that each phase allocates and frees. What the repository decides comes from its code:
`common.models.trainable_denoiser` (the LoRA adapter via `add_lora` and `LORA_TARGETS`, which weights are fp32 and
which stay bf16, gradient checkpointing), `common.models.WanModel.decode` (Wan2.1's fp32 VAE, one video at a time),
`common.rewards` (`hps_pixels`, `CompositeReward`'s frames of a video, `temporal`), each script's `Args` and tree
sizes.
`estimate()` is the same plan for any script and flags (benchmarks/gpu_check.py prints it next to a measured peak).

An iteration is modelled in phases; the peak is the largest:
    encode      the text encoders on the prompt batch (no grad)
    rollout     no-grad denoiser forwards of the rollout batch (V-GRPO: also its behaviour pass, train-batch x N_MC)
    decode      the VAE on each decode batch (Wan2.1: a video at a time, fp32), the earlier batches' samples kept;
                their torch.cat (the previous iteration's samples are still referenced); then the reward on all of
                them (no grad): HPSv2.1 and HPSv3, on a video's --reward-frames frames, and 'temporal' on videos
    train       one training micro-step: the micro-batch's forward (and the KL reference's), backward, AdamW step,
                with the gradients of the earlier micro-steps accumulated; RLR: its first-order term (the last step,
                the VAE and HPS with a graph), then its half-order sub-chain
    evaluate    Evaluator: the sample grid (16 samples) and the held-out evaluation (at most --eval-max-prompts x
                --eval-samples-per-prompt), each sampled and decoded a rollout batch at a time, kept, concatenated
                and scored at once
Resident in every phase: the trainable weights, the frozen denoiser weights, the AdamW state (2 fp32 tensors per
trainable parameter), DDP's gradient buckets (one more fp32 copy of the gradients), the rollout data (latents of every
trajectory or tree node, conditioning, decoded images or videos (fp32), in the dtypes the scripts keep them) and the
frozen parts. A video model (Wan2.1) has latents (16, F', H/8, W/8), F' = (F - 1) / 4 + 1, and CFG rows as SD3.
With --offload-frozen the text encoders are on the GPU only while encoding; the VAE and the reward model leave it
before each training phase and after each evaluation (the scripts and the Evaluator park them) and come back for
decoding and scoring.

Modelling assumptions (each moves a figure by a few percent at most):
  * bytes are what tensors occupy (rounded up to 512 B, as the CUDA caching allocator does): what
    torch.cuda.max_memory_allocated counts, not what the allocator reserves (fragmentation, its cache; expect
    nvidia-smi to show 5-15% more), nor the CUDA context (~0.5 GB), cuBLAS / NCCL workspaces and buffers;
  * bf16 autocast runs on the CPU (a fake CUDA tensor cannot run a backward without a GPU), with CUDA's op policy:
    CPU autocast casts matmuls, convolutions and attention to bf16 as CUDA does, and `_CudaAutocastPolicy` adds
    CUDA's fp32 ops (layer / group norm, softmax, pow, exp, log, rsqrt), whose outputs are fp32 on a GPU; attention
    is a fused kernel on both (flash attention on the CPU, flash / memory-efficient on CUDA: no L x L matrix);
  * AdamW runs its foreach implementation (the default on CUDA), whose temporaries count in the train phase;
  * FSDP (FULL_SHARD, one unit per block class named in the accelerate config) is modelled, not run: fp32 weights,
    gradients and AdamW state are divided by the process count; the working set is the root unit and two gathered
    block units (the current one and the prefetched one) in bf16, plus one unit's unsharded bf16 gradients; the
    activations are measured on the unsharded module in bf16, each gradient freed once accumulated (FSDP
    reduce-scatters it); the config's fsdp_activation_checkpointing counts as --gradient-checkpointing;
  * the GRPO scripts' loss maths (log-probs and ratios on (micro-batch, *latent) fp32 tensors, a few MB) is a mean
    square of the denoiser output here; RLR's loss runs in full, through the VAE and HPS;
  * the held-out evaluation is sized for --eval-max-prompts prompts (fewer if the prompt file is shorter);
  * Wan2.1: the VAE's causal 3D convolutions count what PyTorch allocates (outputs, padding copies, the frame cache),
    not cuDNN's conv3d workspace; the transformer's few modules that diffusers keeps in fp32 on loading (time
    embedder, norms, modulation tables: a few MB) are bf16 here.
The cross-check (--cross-check) runs one training micro-step of a real FLUX.1-dev with 1 double + 1 single block at
full width on the CPU and extrapolates it per block to 19 + 38 blocks: it came within 0.5% of the estimate, with
gradient checkpointing and without.
GB are 10^9 bytes throughout.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_map_only  # noqa: E402

GB = 1e9
SCRIPTS = ("dancegrpo", "branchgrpo", "vgrpo", "rlr", "diffusionnft")

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
# The real parts, for benchmarks/gpu_check.py's builder: google/gemma-3-12b-it's config (12.19B with its SigLIP tower, the
# published 12B) and LTX2TextConnectors as diffusers' LTX-2.3 conversion builds it (3.17B)
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

# A CPU-sized FLUX for tests and `benchmarks/gpu_check.py --tiny` (a model_config of estimate()): the same classes with
# gpu_check.py's tiny sizes, and tests/tiny.py's HPS (open_clip config 'tiny-hps')
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
# 3), the same classes; as TINY_FLUX, for tests and `benchmarks/gpu_check.py --tiny`
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


# ---------------------------------------------------------------------------------------------------
# Recipes: run.sh is the source of truth
# ---------------------------------------------------------------------------------------------------
def _run_sh(*args: str) -> str:
    return subprocess.run(["bash", str(ROOT / "run.sh"), *args], capture_output=True, text=True, check=True).stdout


def gpu_recipes() -> list[str]:
    """run.sh's training recipes on FLUX / SD3.5 / SD1.5 / Wan / Qwen-Image GPUs; multi-node ones are left out (per
    GPU as their 8-GPU twin), and so are the evaluation recipes (evaluate-*: no training)."""
    names = [n for n in _run_sh("--list").split() if not n.startswith("evaluate-") and not n.endswith("-multinode")]
    # DiffusionNFT's curriculum: five runs with diffusionnft-sd35-8gpu's batches (its plan), other prompts and rewards
    return [n for n in names if any(k in n for k in ("flux", "sd35", "sd15", "wan", "qwen")) and "curriculum" not in n]


@dataclass
class Recipe:
    name: str
    script: str  # e.g. "dancegrpo"
    flags: list[str]  # the script's flags
    num_processes: int
    fsdp: bool
    fsdp_config: dict  # the accelerate config's fsdp_config ({} without FSDP)


def parse_command(name: str, line: str) -> Recipe:
    """One recipe's command line -> Recipe: the flags are the words after the script; processes and FSDP come from
    the launcher's --config_file (num_processes, distributed_type) or --num_processes."""
    import yaml

    words = shlex.split(line)
    at = next(i for i, w in enumerate(words) if Path(w).stem in SCRIPTS and w.endswith(".py"))
    launcher, config = words[:at], {}
    if "--config_file" in launcher:
        config = yaml.safe_load((ROOT / launcher[launcher.index("--config_file") + 1]).read_text())
    num = int(launcher[launcher.index("--num_processes") + 1]) if "--num_processes" in launcher else None
    fsdp = config.get("distributed_type") == "FSDP"
    return Recipe(
        name, Path(words[at]).stem, words[at + 1 :], num or config.get("num_processes", 1), fsdp,
        config.get("fsdp_config", {}) if fsdp else {},
    )  # fmt: skip


def recipe(name: str) -> Recipe:
    return parse_command(name, _run_sh("--print", name).strip())


# ---------------------------------------------------------------------------------------------------
# The fake-tensor world and the memory tracker
# ---------------------------------------------------------------------------------------------------
def _fake_apply(self, fn, recurse=True):
    """nn.Module._apply for fake tensors: `module.to(...)` swaps parameter tensors, which fake tensors refuse
    ("Couldn't swap"); assigning `.data` works and frees the old storage just the same."""
    if recurse:
        for child in self.children():
            child._apply(fn)
    with torch.no_grad():
        for p in self._parameters.values():
            if p is not None:
                p.data = fn(p)
    for key, b in self._buffers.items():
        if b is not None:
            self._buffers[key] = fn(b)
    return self


_WORLD: list = []  # the FakeTensorMode of the fake_world being run


@contextlib.contextmanager
def fake_world():
    """Build and run modules with fake tensors on the CPU: shapes, dtypes and sizes without data or compute."""
    import diffusers
    from torch._subclasses.fake_tensor import FakeTensorMode

    diffusers.utils.logging.set_verbosity_error()  # "modules that should be kept in float32: []" on every .to(dtype)
    original = torch.nn.Module._apply
    torch.nn.Module._apply = _fake_apply
    try:
        with FakeTensorMode() as mode, torch.device("cpu"):
            _WORLD.append(mode)
            yield
    finally:
        torch.nn.Module._apply = original
        _WORLD.clear()


# CUDA autocast computes these in fp32 (and returns fp32) where CPU autocast keeps the input dtype
_FP32_OPS = {
    F.layer_norm, F.group_norm, F.softmax, F.log_softmax, torch.layer_norm, torch.group_norm, torch.softmax,
    torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax, torch.pow, torch.Tensor.pow,
    torch.Tensor.__pow__, torch.exp, torch.Tensor.exp, torch.log, torch.Tensor.log, torch.rsqrt, torch.Tensor.rsqrt,
}  # fmt: skip


class _CudaAutocastPolicy(TorchFunctionMode):
    """Inside CPU autocast, run CUDA autocast's fp32 ops in fp32, so activations get the dtypes they have on a GPU
    (e.g. a LayerNorm output is fp32 there, and so is the modulation that follows it in FLUX / SD3 blocks)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FP32_OPS and torch.is_autocast_enabled("cpu"):
            up = lambda t: t.float() if t.dtype in (torch.bfloat16, torch.float16) else t
            args, kwargs = tree_map_only(torch.Tensor, up, (args, kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def autocast(mixed_precision: str):
    """The scripts' `accelerator.autocast()`: bf16 autocast with CUDA's op policy under --mixed-precision bf16."""
    if mixed_precision != "bf16":
        yield
        return
    with torch.autocast("cpu", dtype=torch.bfloat16), _CudaAutocastPolicy():
        yield


def checkpoint_under_policy(module, *args):
    """diffusers' default gradient checkpointing (non-reentrant torch.utils.checkpoint), whose recomputation in the
    backward also runs under _CudaAutocastPolicy: torch.utils.checkpoint restores the autocast state there, but a
    function mode is not active inside the backward call."""
    from torch.utils.checkpoint import checkpoint

    policy = lambda: (contextlib.nullcontext(), _CudaAutocastPolicy())
    return checkpoint(module.__call__, *args, use_reentrant=False, context_fn=policy)


class _NoHook:
    def remove(self):
        pass


class Tracker(MemTracker):
    """MemTracker, for the device-wide peak only. The stock tracker also keeps every module's own peak, walking every
    tracked module at every op (minutes per forward for FLUX's 3000 modules), installs gradient hooks on frozen
    parameters too, which fails ("cannot register a hook on a tensor that doesn't require gradient"), and refuses a
    second top-level call of a module (a KL reference forward, RLR's sub-chain), taking it for a second iteration."""

    def _pre_fw_hook(self, module, inputs) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                del self.memory_tracking[module]  # its per-module stats start again; the device peak is unaffected
        super()._pre_fw_hook(module, inputs)

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        for p in module.parameters():
            if not p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if snap["Total"] > self._peak_mem.get(dev, 0):
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)


def _total(snapshot: dict) -> int:
    return sum(s["Total"] for s in snapshot.values())


def measure(run, *resident, tracker: MemTracker | None = None) -> int:
    """Peak bytes that `run()` allocates on top of `resident` (every module, optimizer and tensor it uses that exists
    before it: the tracker must know them, or their first use would count as new memory). `tracker`: one to use
    (and read in hooks), instead of a new one."""
    tracker = tracker or Tracker()
    with warnings.catch_warnings():  # AdamW's state holds a None per parameter, which the tracker reports and skips
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
        tracker.track_external(*resident)
        with tracker:
            start = _total(tracker.get_tracker_snapshot())
            run()
    return _total(tracker.get_tracker_snapshot("peak")) - start


def nbytes(*tensors_or_modules) -> int:
    """Bytes of tensors, or of the parameters and buffers of modules."""
    n = 0
    for x in tensors_or_modules:
        if isinstance(x, torch.nn.Module):
            n += sum(t.numel() * t.element_size() for t in [*x.parameters(), *x.buffers()])
        elif x is not None:
            n += x.numel() * x.element_size()
    return n


# ---------------------------------------------------------------------------------------------------
# Building the parts (inside fake_world)
# ---------------------------------------------------------------------------------------------------
def build_text_encoder(family: str, config: dict, dtype, with_projection: bool):
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
        UMT5Config,
        UMT5EncoderModel,
    )

    if family == "t5":
        return T5EncoderModel(T5Config(**config)).to(dtype).eval()
    if family == "umt5":
        return UMT5EncoderModel(UMT5Config(**config)).to(dtype).eval()
    if family == "mistral3":  # FLUX.2 [dev]'s: the whole Mistral3 model (language model, vision tower, LM head)
        from transformers import Mistral3Config, Mistral3ForConditionalGeneration

        return Mistral3ForConditionalGeneration(Mistral3Config(**config)).to(dtype).eval()
    if family == "qwen3":  # FLUX.2 [klein]'s: the causal LM as the pipeline loads it
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(**config)).to(dtype).eval()
    if family == "qwen25vl":  # the whole VL model, as QwenImagePipeline loads it (its vision tower unused)
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config)).to(dtype).eval()
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel  # SD3's CLIPs have a projection
    return cls(CLIPTextConfig(**config)).to(dtype).eval()


def build_reward(name: str, config: dict | None):
    """A reward network as common/rewards.py loads it: HPSv2.1's CLIP in fp32 (hpsv2_1 never casts it), HPSv3's
    Qwen2-VL in bf16 with its fp32 head and the added reward token (one more embedding row)."""
    import logging

    import open_clip

    if name == "hpsv3":
        from transformers import Qwen2VLConfig

        from common.hpsv3 import HPSv3

        config = Qwen2VLConfig(**{**config, "vocab_size": config["vocab_size"] + 1})  # + <|Reward|>
        config._attn_implementation = "sdpa"  # transformers' default on a GPU
        return HPSv3(config, reward_token_id=config.text_config.vocab_size - 1).eval()
    if config is not None:
        return open_clip.CLIP(**config).eval()
    root, level = logging.getLogger(), logging.getLogger().level
    root.setLevel(logging.ERROR)  # not "No pretrained weights loaded for model 'ViT-H-14'": none are wanted
    try:
        return open_clip.create_model("ViT-H-14", pretrained=None).eval()
    finally:
        root.setLevel(level)


def encode_text(encoders, batch: int):
    """The pipelines' prompt encoding: every text encoder on `batch` prompts padded to its token count."""
    with torch.no_grad():
        for family, module, tokens in encoders:
            ids = torch.zeros(batch, tokens, dtype=torch.long)
            if family == "umt5":  # WanPipeline passes the attention mask, then zeroes the embeddings past each prompt
                out = module(ids, torch.ones_like(ids)).last_hidden_state
                torch.stack([torch.cat([u[:1], u.new_zeros(tokens - 1, u.shape[1])]) for u in out])
                continue
            if family in ("qwen3", "mistral3"):  # every hidden state (the pipeline stacks three), with the mask
                module(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, use_cache=False)
                continue
            if family == "qwen25vl":  # the last hidden layer of the language model, with the mask
                module(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
                continue
            module(ids, output_hidden_states=family == "clip")  # SD3 reads CLIP's penultimate hidden states


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
        return "flux" in name and "flux.2" not in name

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


def score_samples(nets: dict, spec: str, frames: int, samples):
    """The scripts' reward call (common.rewards.CompositeReward, no grad) on decoded samples, images (n, 3, H, W) or
    videos (n, F, 3, H, W), with the components that hold GPU memory: HPSv2.1 and HPSv3 (`nets`: name -> network), on
    `frames` evenly spaced frames of each video (--reward-frames), and 'temporal' (videos). Others (jpeg, ...) are
    left out: they work on the CPU or are not modelled (reward_model refuses pickscore and clip)."""
    from common.rewards import CompositeReward, ScoreFn, parse_rewards, temporal

    scores = {"hpsv2.1": hps_score, "hpsv3": hpsv3_score}
    parts = []
    for name, weight in parse_rewards(spec).weights.items():
        if name in nets:
            fn = lambda x, prompts, net=nets[name], score=scores[name]: score(net, x)  # noqa: E731
            parts.append((name, weight, ScoreFn(fn, differentiable=True)))
        elif name == "temporal":
            parts.append((name, weight, temporal("cpu")))
    return CompositeReward(parts, frames, check=False)(samples, [""] * len(samples))  # fake tensors: no values


# ---------------------------------------------------------------------------------------------------
# What each script does per phase (batch sizes from its flags; rollout data it keeps)
# ---------------------------------------------------------------------------------------------------
@dataclass
class Workload:
    """Batch sizes of the phases (rows = denoiser batch, CFG included) and the rollout data kept on the GPU."""

    prompts: int  # distinct prompts encoded at once (encode_prompts encodes each once)
    rollout_rows: int  # no-grad denoiser batch (rollout, V-GRPO's behaviour pass)
    decode: int  # images per VAE decode
    reward: int  # images per reward call
    train_rows: int  # denoiser batch of a training forward (GRPO) or of one RLR step
    kl_forward: bool  # a no-grad reference forward inside the micro-step (its graph alive)
    kl_copy: bool  # a frozen bf16 copy of the denoiser as KL reference (full fine-tuning)
    data: int  # bytes of rollout data resident through the iteration
    rlr: dict | None = None  # RLR: first-order rows, sub-chain length h, zero-order term
    copies: int = 0  # fp32 copies of the trained weights kept beside them (DiffusionNFT: the old policy, the EMA)


def _bytes(shape, count=1, element=4) -> int:
    n = count * element
    for s in shape:
        n *= s
    return n


def distinct_prompts(S: int, G: int) -> int:
    """The most groups a process's S samples meet, groups of G in global order (process r owns samples [r S, (r + 1)
    S), which start gcd(S, G)-aligned within a group, at most G - gcd(S, G) into it): the prompts encode_prompts
    encodes, each distinct prompt once."""
    return min(S, (G - math.gcd(S, G) + S - 1) // G + 1)


def workload(script: str, args, shapes: Shapes, cfg: bool, frozen_bytes: int) -> Workload:
    """From the script's parsed Args: its batches and the tensors it keeps (fp32 latents and images or videos,
    conditioning in the text encoders' dtype), read off its main loop."""
    mult = 2 if cfg else 1
    L, img = shapes.latent, shapes.sample  # an image, or a video (F, 3, H, W)
    cond = sum(_bytes(s, element=frozen_bytes) for s in shapes.cond.values())  # per prompt (CFG's uncond: one more)
    if script == "dancegrpo":
        S, R, T = args.samples_per_device, args.rollout_batch_size, args.num_steps
        # chunks: latents (S, T + 1, *L), each step's mean (S, T, *L) and log-probs (S, T); images (S, 3, H, W); the
        # prompts' conditioning
        data = _bytes(L, S * (T + 1)) + _bytes(L, S * T) + _bytes((S, T)) + _bytes(img, S) + cond * (S + 1)
        full_ft_kl = args.kl_beta > 0 and not args.lora
        P = distinct_prompts(S, args.group_size)
        return Workload(P, R * mult, R, S, R * mult, args.kl_beta > 0, full_ft_kl, data)
    if script == "branchgrpo":
        import branchgrpo

        splits = branchgrpo.split_steps(args.split_schedule, args.num_steps, args.num_splits)
        sizes = branchgrpo.Tree(args.num_steps, tuple(splits), args.branch_factor).sizes  # nodes per depth
        P, Pu, M, R = args.trees_per_device, args.trees_per_update, sizes[-1], args.rollout_batch_size
        # every tree's node states (fp32) and edge log-probs; every leaf's image; the trees' conditioning
        data = _bytes(L, P * sum(sizes)) + _bytes((P * sum(sizes[1:]),)) + _bytes(img, P * M) + cond * (P + 1)
        full_ft_kl = args.kl_beta > 0 and not args.lora
        return Workload(Pu, R * mult, Pu * M, P * M, R * mult, args.kl_beta > 0, full_ft_kl, data)
    if script == "vgrpo":
        S, R, B, N = args.samples_per_device, args.rollout_batch_size, args.train_batch_size, args.n_mc
        kl = args.kl_beta > 0
        # final latents (S, *L), images, conditioning, behaviour values; with KL the reference's x0 (S, N, *L)
        data = _bytes(L, S) + _bytes(img, S) + cond * (S + 1) + _bytes((S, N)) + (_bytes(L, S * N) if kl else 0)
        full_ft_kl = kl and args.kl_ref == "base" and not args.lora
        P = distinct_prompts(S, args.group_size)
        return Workload(P, max(R, B * N) * mult, R, S, B * N * mult, False, full_ft_kl, data)
    if script == "rlr":
        S, B, T = args.samples_per_device, args.rollout_batch_size, args.num_steps
        h = args.subchain_len
        if h is None:
            import rlr

            h = (
                rlr.optimal_subchain_len(
                    args.memory_budget_gb, T, args.ho_step_gb, args.zo_step_gb, args.variance_ratio
                )
                if args.memory_budget_gb is not None
                else min(2, T - 1)
            )
        h = h if "ho" in args.terms else 0
        # chunks: latents (S, T, *L) and their step noise (S, T - 1, *L) on the device; conditioning
        data = _bytes(L, S * T) + _bytes(L, S * (T - 1)) + cond * (S + 1)
        zo = "zo" in args.terms
        P = distinct_prompts(S, args.group_size)
        return Workload(P, B * mult, B, B, B * mult, False, False, data, rlr={"rows": B, "h": h, "zo": zo})
    if script == "diffusionnft":
        S, R, B = args.samples_per_device, args.rollout_batch_size, args.train_batch_size
        # final latents (S, *L) and decoded images, each chunk's sent to the reward as it is decoded; conditioning.
        # The old policy's and the base's no-grad forwards run before the trained one's, so no graph is alive then.
        # copies=2: the old policy and the EMA; evaluation swaps the EMA in one tensor at a time (no third copy).
        data = _bytes(L, S) + _bytes(img, S) + cond * (S + 1)
        full_ft_kl = args.kl_beta > 0 and not args.lora
        P = distinct_prompts(S, args.group_size)
        return Workload(P, R * mult, R, R, B * mult, False, full_ft_kl, data, copies=2)
    raise ValueError(f"unknown script {script}")


def grpo_train(shapes: Shapes, module, work: Workload, mp: str, optimizer, tracker=None) -> int:
    """Peak of one GRPO micro-step above its resident state: the micro-batch's forward with a graph (and the KL
    reference's no-grad forward while that graph is alive), backward, and the AdamW step (None under FSDP)."""

    def step():
        x = torch.zeros(work.train_rows, *shapes.latent)
        with autocast(mp):
            v = denoise(shapes, module, x)
        loss = v.square().mean()
        if work.kl_forward:  # LoRA: the adapter switched off; full fine-tuning: a frozen copy (same activations)
            with torch.no_grad(), autocast(mp):
                v_ref = denoise(shapes, module, x)
            loss = loss + (v - v_ref).square().mean()
        loss.backward()
        if optimizer is not None:
            optimizer.step()

    return measure(step, module, *([optimizer] if optimizer is not None else []), tracker=tracker)


def rlr_train(shapes: Shapes, module, vae, reward, work: Workload, cfg: bool, mp: str, optimizer) -> int:
    """Peak of rlr.py's train phase above its resident state, the larger of its two backward passes: the first-order
    term (the last step with a graph, the VAE decode and HPS, backward) and the half-order term (h steps with a graph
    from a constant x_j, backward; then the AdamW step)."""
    import rlr

    rows, h = work.rlr["rows"], work.rlr["h"]

    def transition(x):  # rlr.transition: CFG as common.models._cfg, then the DDIM step (SD1.x) or the flow SDE step
        with autocast(mp):
            out = denoise(shapes, module, torch.cat([x, x]) if cfg else x)
        if cfg:
            uncond, cond = out.chunk(2)
            out = uncond + 5.0 * (cond - uncond)
        if shapes.kind == "sd1":
            return rlr.ddim_step(x, out, 0.5, 0.6, 1.0)
        return rlr.sde_step(x, out, 0.5, 0.4, 0.7, prev_sample=x)[2:]

    def first_order():
        mean, _ = transition(torch.zeros(rows, *shapes.latent))
        (-hps_score(reward, vae_decode(vae, shapes, mean)).sum()).backward()

    def half_order():
        x, target = torch.zeros(rows, *shapes.latent), torch.zeros(rows, *shapes.latent)  # x_j and x_{j+h}
        for k in range(h):
            mean, std = transition(x)
            if k < h - 1:
                x = mean + std * torch.zeros_like(mean)  # the window's inner noises are fixed
        (((target - mean) ** 2) / (2 * std**2)).flatten(1).sum(1).sum().backward()
        if optimizer is not None:
            optimizer.step()

    if reward is None:
        raise ValueError("rlr.py's first-order term needs a differentiable reward model (HPSv2.1 here)")
    resident = [module, vae, reward, *([optimizer] if optimizer is not None else [])]
    return max(measure(first_order, *resident), measure(half_order, *resident) if h else 0)


# ---------------------------------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------------------------------
_CACHE: dict = {}


def _cached(key, fn):
    """Phases with the same key (same module, batch, flags) measure the same: 1- and 8-GPU recipes share them."""
    key = json.dumps(key, sort_keys=True, default=str)
    if key not in _CACHE:
        _CACHE[key] = fn()
    return _CACHE[key]


def _units(module, names) -> tuple[int, int]:
    """(largest unit, root) parameter counts of FSDP units wrapping the module classes `names`."""
    units = [m for m in module.modules() if type(m).__name__ in names]
    in_units = {id(p) for u in units for p in u.parameters()}
    root = sum(p.numel() for p in module.parameters() if id(p) not in in_units)
    return max((sum(p.numel() for p in u.parameters()) for u in units), default=0), root


def parse_args(script: str, flags: list[str]):
    """The script's own Args (tyro), as `accelerate launch script.py FLAGS` would parse them."""
    import tyro

    module = importlib.import_module(script)
    return tyro.cli(module.Args, args=list(flags))


def reward_model(spec: str, parts: dict) -> dict:
    """The reward networks' configs for --reward: name -> config, HPSv2.1's and HPSv3's ({}: the reward has no
    network, e.g. jpeg)."""
    from common.rewards import parse_rewards

    names = set(parse_rewards(spec).weights)  # every component runs, weight 0 too (for logging)
    unknown = names & {"pickscore", "clip"}
    if unknown:
        raise ValueError(f"--reward {spec}: {', '.join(sorted(unknown))} is not modelled here (HPSv2.1 and HPSv3 are)")
    return {n: c for n, c in (("hpsv2.1", parts["reward"]), ("hpsv3", QWEN2_VL_7B)) if n in names}


def estimate(
    script: str,
    flags: list[str],
    num_processes: int = 1,
    fsdp: bool = False,
    model_config: dict | None = None,
    *,
    fsdp_config: dict | None = None,
) -> dict:
    """Per-GPU memory plan of `script` ("dancegrpo" or "dancegrpo.py", ...) run with `flags` on `num_processes` GPUs:
    data parallel, or FSDP (FULL_SHARD) with `fsdp`, `fsdp_config` being the accelerate config's fsdp_config (units to
    wrap, activation checkpointing). `model_config` overrides parts of the --model-id kind's published configuration
    (keys of MODELS[kind]: `denoiser` and `vae` are merged into the published dicts, `text`, `reward`,
    `resolution` and `frames` replace them), e.g. TINY_FLUX or TINY_WAN. A video model (Wan2.1) decodes, keeps and
    scores videos of --num-frames frames.

    Returns {"peak": GB, "peak_phase", "phases": {phase: GB}, "gb": {component: GB}, "goal": GB, "fits", "params":
    {"denoiser", "trainable"}, and the setting (model, resolution, frames, lora, checkpointing, offload, batches,
    ...)}."""
    script = Path(script).stem
    args = parse_args(script, flags)
    kind = model_kind(args.model_id)
    parts = dict(MODELS[kind])
    for name, value in (model_config or {}).items():
        parts[name] = {**parts[name], **value} if name in ("denoiser", "vae") else value
    if script == "rlr" and kind in VIDEO_KINDS:
        raise ValueError(f"rlr.py trains image models only; --model-id {args.model_id} is a video model")
    resolution = args.resolution or parts["resolution"]  # a side, or (height, width) (Wan2.1's native 480 x 832)
    frames = (args.num_frames or parts["frames"]) if kind in VIDEO_KINDS else None
    shapes = Shapes.of(kind, parts, resolution, frames)
    height, width = shapes.image[1:]
    mp = args.mixed_precision
    frozen_dtype, esize = (torch.bfloat16, 2) if mp == "bf16" else (torch.float32, 4)  # load_model's dtype
    fsdp_config = fsdp_config or {}
    checkpointing = args.gradient_checkpointing or (fsdp and bool(fsdp_config.get("fsdp_activation_checkpointing")))
    offload, ddp = args.offload_frozen, num_processes > 1 and not fsdp
    cfg = PLANS[kind].cfg and args.guidance_scale > 1  # FLUX.1-dev's guidance is embedded
    work = workload(script, args, shapes, cfg, esize)
    if fsdp and work.copies:
        raise ValueError(f"{script}.py refuses FSDP: it keeps the old policy and the EMA beside the trained weights")
    if fsdp and work.kl_copy:
        raise ValueError("the scripts refuse a frozen KL reference copy under FSDP (--kl-beta 0, or --lora)")
    evaluates = args.eval_every > 0 or args.sample_every > 0
    n_eval = args.eval_max_prompts * args.eval_samples_per_prompt if args.eval_every > 0 else 0  # at most
    # Evaluator.grid: 8 prompts x 2 seeds, sampled and decoded in chunks of the Evaluator's batch (the rollout batch)
    n_grid_all = 16 if args.sample_every > 0 else 0
    n_grid = min(n_grid_all, args.rollout_batch_size)
    reward_cfg = reward_model(args.reward, parts)
    if script == "rlr" and "hpsv3" in reward_cfg:
        raise ValueError(
            "rlr.py's first-order term backpropagates through the reward: through HPSv3 it is not modelled"
        )
    key = dict(kind=kind, den=parts["denoiser"], latent=shapes.latent, mp=mp, lora=args.lora, rank=args.lora_rank)
    key |= dict(alpha=args.lora_alpha, ckpt=checkpointing, fsdp=fsdp)

    with fake_world():
        # ---------------------------------------------------------------- the denoiser, as trained
        if fsdp:  # modelled: the unsharded module in the FSDP compute dtype; the fp32 shards are counted below
            module = build_denoiser(kind, parts["denoiser"], frozen_dtype).train()
            if checkpointing:
                module.enable_gradient_checkpointing(checkpoint_under_policy)
        else:
            module = trained_module(kind, parts["denoiser"], args, frozen_dtype, checkpointing)
        n_all = sum(p.numel() for p in module.parameters())
        trainable = [p for p in module.parameters() if p.requires_grad]
        n_train = sum(p.numel() for p in trainable)
        if fsdp:
            unit, root = _units(module, fsdp_config.get("fsdp_transformer_layer_cls_to_wrap") or parts["fsdp_units"])
            w_train = g_train = 4 * n_train / num_processes  # fp32 shards of the flat parameters and gradients
            opt, frozen = 8 * n_train / num_processes, 0
            working = esize * (root + 2 * unit)  # the gathered root unit and two block units
            working_train = working + esize * unit  # + one unit's unsharded gradients before the reduce-scatter
        else:
            w_train = sum(nbytes(p) for p in trainable)
            frozen = sum(nbytes(p) for p in module.parameters() if not p.requires_grad)
            g_train, opt = w_train, 2 * w_train  # gradients like the weights (fp32); AdamW exp_avg, exp_avg_sq
            working = working_train = 0
        experts = parts.get("experts", 1)  # Wan2.2-A14B: both experts' weights and state, one expert's activations
        w_train, g_train, opt, frozen = (experts * v for v in (w_train, g_train, opt, frozen))
        n_all, n_train = experts * n_all, experts * n_train
        frozen += n_all * esize if work.kl_copy else 0  # frozen_copy(): the KL reference of full fine-tuning
        buckets = g_train if ddp else 0  # DDP's gradient buckets, allocated at prepare()

        # ---------------------------------------------------------------- no-grad forwards: rollout, grid
        def forward(rows):
            with torch.no_grad(), autocast(mp):
                denoise(shapes, module, torch.zeros(rows, *shapes.latent))

        act_rollout = _cached(
            [key, "forward", work.rollout_rows], lambda: measure(lambda: forward(work.rollout_rows), module)
        )
        grid_rows = n_grid * (2 if cfg else 1)
        act_grid = (
            _cached([key, "forward", grid_rows], lambda: measure(lambda: forward(grid_rows), module)) if n_grid else 0
        )

        # ---------------------------------------------------------------- the training micro-step
        optimizer = None
        if fsdp:  # each gradient is reduce-scattered (and freed) once accumulated; AdamW steps on the shards below
            for p in trainable:
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        else:  # a micro-step after the first: the gradients accumulated so far and the AdamW state exist
            for p in trainable:
                p.grad = torch.zeros_like(p)
            optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=True)
            optimizer.step()
        vae = build_vae(kind, parts["vae"], frozen_dtype)
        nets = {name: build_reward(name, c) for name, c in reward_cfg.items()}
        reward = nets.get("hpsv2.1")  # rlr.py's differentiable reward
        if work.rlr is not None:  # the first-order term backpropagates through the VAE and the reward model
            act_train = _cached(
                [key, "rlr", work.rlr, cfg, parts["vae"], reward_cfg],
                lambda: rlr_train(shapes, module, vae, reward, work, cfg, mp, optimizer),
            )
        else:
            act_train = _cached(
                [key, "train", work.train_rows, work.kl_forward],
                lambda: grpo_train(shapes, module, work, mp, optimizer),
            )
        act_step = 0
        if fsdp:  # AdamW (foreach) on this process's fp32 shard, after the backward passes
            shard = torch.zeros(max(1, n_train // num_processes), requires_grad=True)
            shard.grad = torch.zeros_like(shard)
            shard_optimizer = torch.optim.AdamW([shard], lr=1e-4, foreach=True)
            shard_optimizer.step()
            act_step = measure(shard_optimizer.step, shard, shard_optimizer)

        # ---------------------------------------------------------------- frozen parts: encode, decode, score
        encoders = [
            (f, build_text_encoder(f, c, frozen_dtype, PLANS[kind].clip_projection), n) for f, c, n in parts["text"]
        ]
        text = sum(nbytes(m) for _, m, _ in encoders)
        act_encode = _cached(
            [kind, parts["text"], mp, "encode", work.prompts],
            lambda: measure(lambda: encode_text(encoders, work.prompts), *[m for _, m, _ in encoders]),
        )

        def decode(n):
            with torch.no_grad():
                vae_decode(vae, shapes, torch.zeros(n, *shapes.latent))

        def score(n):  # above the decoded samples, which the scripts keep (torch.cat of the decode batches)
            samples = torch.zeros(n, *shapes.sample)
            with torch.no_grad():
                run = lambda: score_samples(nets, args.reward, args.reward_frames, samples)  # noqa: E731
                return measure(run, *nets.values(), samples)

        vae_key = [kind, parts["vae"], shapes.vae_latent, shapes.sample, mp, "decode"]
        act_decode = _cached([*vae_key, work.decode], lambda: measure(lambda: decode(work.decode), vae))
        act_decode_grid = _cached([*vae_key, n_grid], lambda: measure(lambda: decode(n_grid), vae)) if n_grid else 0
        score_key = [reward_cfg, args.reward, args.reward_frames if frames else None, shapes.sample, "score"]
        act_reward = _cached([*score_key, work.reward], lambda: score(work.reward))
        act_reward_grid = _cached([*score_key, n_grid_all], lambda: score(n_grid_all)) if n_grid_all else 0
        act_reward_eval = _cached([*score_key, n_eval], lambda: score(n_eval)) if n_eval else 0
        vae_bytes, reward_bytes = nbytes(vae), nbytes(*nets.values())

    # ---------------------------------------------------------------- phases: resident state + the phase's own
    state = w_train * (1 + work.copies) + frozen + opt + buckets + work.data
    zo = 2 * w_train if work.rlr and work.rlr["zo"] else 0  # RLR's ZO: a saved copy of the weights + a perturbation
    scorers = vae_bytes + reward_bytes
    text_out = 0 if offload else text  # text encoders outside the encode phase
    # with --offload-frozen the scripts park the VAE and the reward before training and the Evaluator parks them after
    # its work; rlr.py's first-order term (in the train phase here) fetches them chunk by chunk
    scorers_sampling = scorers if not offload else 0
    scorers_train = scorers if not offload or work.rlr else 0
    # decoded samples (images or videos, fp32) are kept: the batches decoded so far, then their torch.cat, while the
    # previous iteration's (in work.data) are still referenced; then the reward scores them all at once
    sample = lambda n: _bytes(shapes.sample, max(n, 0))  # noqa: E731
    decoding = max(sample(work.reward - work.decode) + act_decode, 2 * sample(work.reward), act_reward)
    phases = {
        "encode": state + text + scorers_sampling + act_encode,
        "rollout": state + text_out + scorers_sampling + working + act_rollout + zo,
        "decode": state + text_out + scorers + decoding,
        "train": state + text_out + scorers_train + g_train + working_train + max(act_train, act_step) + zo,
    }
    if work.rlr is not None:  # decoding and scoring happen in the first-order term, inside the train phase
        del phases["decode"]
    if evaluates:  # Evaluator: the grid, then the held-out evaluation
        resident = 0 if offload else scorers  # --offload-frozen: training parked the VAE and the reward before
        # sample_prompts: a batch (the rollout batch) at a time, the earlier batches' samples kept, then torch.cat
        grid_kept, eval_kept = sample(n_grid_all - n_grid), sample(n_eval - args.rollout_batch_size)
        steps = [
            (text if offload else 0) + scorers + act_encode,  # prompts: the text encoders visit
            resident + grid_kept + act_grid,  # the grid's denoiser forwards
            (vae_bytes if offload else scorers) + grid_kept + act_decode_grid,  # and their VAE decodes
            scorers + sample(n_grid_all) + max(sample(n_grid_all), act_reward_grid),  # torch.cat, then the reward
        ]
        if n_eval:
            steps += [
                scorers + eval_kept + max(act_rollout, act_decode),  # the held-out evaluation's sampling
                scorers + sample(n_eval) + max(sample(n_eval), act_reward_eval),  # its torch.cat, then the reward
            ]
        phases["evaluate"] = state + text_out + working + max(steps)
    peak_phase = max(phases, key=phases.get)
    n_base = n_all - (n_train if args.lora else 0)  # the model's own weights (FLUX.1-dev: 11.9B, under 12B)
    goal = 80 if not args.lora or max(height, width) > 512 or n_base > 12e9 else 48  # Qwen-Image's 20B: one 80 GB GPU
    peak = phases[peak_phase] / GB
    return {
        "script": script,
        "model": kind,
        "resolution": height if height == width else f"{height}x{width}",
        "frames": frames,
        "lora": args.lora,
        "lora_rank": args.lora_rank if args.lora else None,
        "num_processes": num_processes,
        "fsdp": fsdp,
        "gradient_checkpointing": bool(checkpointing),
        "offload_frozen": offload,
        "train_rows": work.train_rows,
        "rollout_rows": work.rollout_rows,
        "params": {"denoiser": n_all, "trainable": n_train},
        "gb": {
            "trainable": w_train * (1 + work.copies) / GB,  # DiffusionNFT: with its old policy and EMA copies
            "frozen": frozen / GB,
            "grads": g_train / GB,
            "optimizer": opt / GB,
            "activations": max(act_train, act_step) / GB,
            "text_encoders": text / GB,
            "vae": vae_bytes / GB,
            "vae_decode": act_decode / GB,
            "reward": reward_bytes / GB,
            "reward_activations": act_reward / GB,
            "encode_activations": act_encode / GB,
            "rollout_activations": act_rollout / GB,
            "grid_activations": max(act_grid, act_decode_grid) / GB,
            "rollout_data": work.data / GB,
            "dist_buffers": (buckets + working_train) / GB,
        },
        "phases": {name: v / GB for name, v in phases.items()},
        "peak": peak,
        "peak_phase": peak_phase,
        "goal": goal,
        "fits": peak <= goal,
    }


def recipe_estimate(r: Recipe) -> dict:
    return estimate(r.script, r.flags, r.num_processes, r.fsdp, fsdp_config=r.fsdp_config)


# ---------------------------------------------------------------------------------------------------
# Cross-check: a real run of a 2-block FLUX.1-dev on the CPU, extrapolated per block
# ---------------------------------------------------------------------------------------------------
# FLUX.1-dev LoRA as run.sh's recipes train it (r128, alpha 256, bf16), at 512 px, micro-batch 1
CROSS_CHECK_FLAGS = [
    "--model-id", "black-forest-labs/FLUX.1-dev", "--resolution", "512", "--mixed-precision", "bf16", "--lora",
    "--lora-rank", "128", "--lora-alpha", "256", "--reward", "hpsv2.1", "--rollout-batch-size", "1",
    "--samples-per-device", "12", "--group-size", "12", "--samples-per-update", "4", "--kl-beta", "0",
]  # fmt: skip
TWO_BLOCKS = {"denoiser": {"num_layers": 1, "num_single_layers": 1}}


class Bf16ViaFp32(TorchDispatchMode):
    """bf16 matmuls and attention computed in fp32 and rounded to bf16: the same tensors up to rounding, at fp32 speed
    (a CPU without bf16 units multiplies bf16 matrices ~200x slower). Entered below the memory tracker in the mode
    stack, so the tracker sees bf16 kernels and never these fp32 temporaries."""

    aten = torch.ops.aten
    OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
    ATTENTION = {
        aten._scaled_dot_product_flash_attention_for_cpu.default,  # outputs (out, logsumexp): only out is bf16
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,  # outputs (dq, dk, dv)
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.OPS | self.ATTENTION or not any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in args
        ):
            return func(*args, **kwargs)
        up = lambda t: t.float() if t.dtype == torch.bfloat16 else t
        out = func(*tree_map_only(torch.Tensor, up, args), **tree_map_only(torch.Tensor, up, kwargs))
        if func is self.aten._scaled_dot_product_flash_attention_for_cpu.default:
            return (out[0].bfloat16(), *out[1:])
        return tree_map_only(torch.Tensor, lambda t: t.bfloat16(), out)


def real_two_blocks(checkpointing: bool, model_config: dict = TWO_BLOCKS) -> dict:
    """One training micro-step of a real FLUX.1-dev with 1 double + 1 single block at full width (random weights),
    made as the estimate makes it (trainable_denoiser, gradients of earlier micro-steps and AdamW state present),
    on the CPU with real tensors under MemTracker. Returns bytes: `resident` (weights, gradients, AdamW state),
    `peak` (the whole micro-step's peak), `kept` (per block kind: what its forward leaves alive, saved activations
    and output) and `block` (per block kind: its resident weights, gradients and AdamW state). model_config: the
    denoiser's config overrides (the test uses a narrow one)."""
    args = parse_args("dancegrpo", CROSS_CHECK_FLAGS + (["--gradient-checkpointing"] if checkpointing else []))
    parts = dict(MODELS["flux"], denoiser={**FLUX_DEV, **model_config["denoiser"]})
    shapes = Shapes.of("flux", parts, args.resolution)
    torch.manual_seed(0)
    module = trained_module("flux", parts["denoiser"], args, torch.bfloat16, checkpointing)
    trainable = [p for p in module.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=True)
    optimizer.step()
    tracker, marks = Tracker(), {}

    def mark(key):
        if key not in marks:  # the forward, not the recomputation in the backward
            marks[key] = _total(tracker.get_tracker_snapshot())

    blocks = {"double": module.transformer_blocks[0], "single": module.single_transformer_blocks[0]}
    for name, block in blocks.items():
        block.register_forward_pre_hook(lambda m, a, name=name: mark(name + " in"))
        block.register_forward_hook(lambda m, a, o, name=name: mark(name + " out"))
    work = Workload(1, 1, 1, 1, 1, False, False, 0)
    with Bf16ViaFp32():
        above = grpo_train(shapes, module, work, "bf16", optimizer, tracker=tracker)
    resident = nbytes(module) + 3 * sum(nbytes(p) for p in trainable)  # + gradients, exp_avg, exp_avg_sq
    per_block = {
        n: nbytes(b) + 3 * sum(nbytes(p) for p in b.parameters() if p.requires_grad) for n, b in blocks.items()
    }
    kept = {n: marks[n + " out"] - marks[n + " in"] for n in blocks}
    return {"resident": resident, "peak": resident + above, "kept": kept, "block": per_block}


def cross_check() -> None:
    """Two estimates of FLUX.1-dev LoRA training at 512 px, micro-batch 1, gradient checkpointing off and on: the
    estimator's (fake tensors, 19 + 38 blocks), and a real CPU run of 1 + 1 blocks extrapolated per block: its peak
    plus, for each of the 18 double and 37 single blocks it lacks, that block's weights, gradients and AdamW state
    and what its forward keeps alive until the backward. Only the denoiser's micro-step is compared (no text
    encoders, VAE, reward or rollout data). The extrapolation assumes the peak comes when the backward starts, with
    every block's kept memory alive, as in a deep network it does."""
    t0 = time.perf_counter()
    n_double, n_single = FLUX_DEV["num_layers"], FLUX_DEV["num_single_layers"]
    rows = []
    for ckpt in (False, True):
        flags = CROSS_CHECK_FLAGS + (["--gradient-checkpointing"] if ckpt else [])
        train = lambda e: sum(e["gb"][k] for k in ("trainable", "frozen", "grads", "optimizer", "activations"))
        fake_full, fake_two = (
            train(estimate("dancegrpo", flags)),
            train(estimate("dancegrpo", flags, model_config=TWO_BLOCKS)),
        )
        real = real_two_blocks(ckpt)
        extra = {"double": n_double - 1, "single": n_single - 1}
        full = real["peak"] + sum(n * (real["block"][k] + real["kept"][k]) for k, n in extra.items())
        rows.append((ckpt, fake_two, real["peak"] / GB, fake_full, full / GB, real["kept"]))
        print(f"checkpointing {'on' if ckpt else 'off'} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(
        "\nFLUX.1-dev LoRA r128, 512 px, micro-batch 1: peak of one training micro-step of the denoiser (weights,"
        " gradients, AdamW state, activations), GB\n"
    )
    print(
        "| checkpointing | fake, 1+1 blocks | real, 1+1 blocks | fake, 19+38 blocks | real, extrapolated | fake / real |"
    )
    print("|---|---|---|---|---|---|")
    for ckpt, fake_two, real_two, fake_full, real_full, _ in rows:
        print(
            f"| {'on' if ckpt else 'off'} | {fake_two:.2f} | {real_two:.2f} | {fake_full:.2f} | {real_full:.2f} | "
            f"{fake_full / real_full:.3f} |"
        )
    for ckpt, *_, kept in rows:
        print(
            f"kept by each block's forward (real), checkpointing {'on' if ckpt else 'off'}: double "
            f"{kept['double'] / GB:.3f} GB, single {kept['single'] / GB:.3f} GB"
        )
    print(f"({time.perf_counter() - t0:.0f} s)")


# ---------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------
MODEL_NAMES = {kind: plan.name for kind, plan in PLANS.items()}


def setting(e: dict) -> str:
    """One line of what a plan is for, e.g. 'FLUX.1-dev 720 px, LoRA r128, rows 1, ckpt, offload, 8 x DDP' or
    'Wan2.1-1.3B 480x832 px x 33 frames, ...'."""
    mode = f"LoRA r{e['lora_rank']}" if e["lora"] else "full"
    gpus = f"{e['num_processes']} x {'FSDP' if e['fsdp'] else 'DDP'}" if e["num_processes"] > 1 else "1 GPU"
    flags = [f for f, on in (("ckpt", e["gradient_checkpointing"]), ("offload", e["offload_frozen"])) if on]
    size = f"{MODEL_NAMES[e['model']]} {e['resolution']} px" + (f" x {e['frames']} frames" if e.get("frames") else "")
    return ", ".join([size, mode, f"rows {e['train_rows']}", *flags, gpus])


def table(rows: list[tuple[str, dict]]) -> str:
    """Markdown: one line per recipe, what each part holds per GPU, then the peak, its phase and the goal."""
    head = (
        "| recipe | setting | trainable | frozen base | grads | AdamW | train act. | text enc. | VAE + decode | "
        "HPS + act. | grid | rollout data | DDP / FSDP | peak | phase | goal | fits |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, e in rows:
        g = e["gb"]
        cells = [
            name, setting(e), g["trainable"], g["frozen"], g["grads"], g["optimizer"], g["activations"],
            g["text_encoders"], f"{g['vae']:.1f} + {g['vae_decode']:.1f}",
            f"{g['reward']:.1f} + {g['reward_activations']:.1f}", g["grid_activations"], g["rollout_data"],
            g["dist_buffers"], f"**{e['peak']:.1f}**", e["peak_phase"], e["goal"], "yes" if e["fits"] else "**no**",
        ]  # fmt: skip
        lines.append("| " + " | ".join(f"{c:.1f}" if isinstance(c, float) else str(c) for c in cells) + " |")
    return "\n".join(lines)


def phase_table(rows: list[tuple[str, dict]]) -> str:
    phases = ["encode", "rollout", "decode", "train", "evaluate"]
    lines = ["| recipe | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
    for name, e in rows:
        cells = [f"{e['phases'][p]:.1f}" if p in e["phases"] else "-" for p in phases]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(rows: list[tuple[str, dict]], seconds: float) -> str:
    return (
        "# Per-GPU memory plan of the GPU recipes\n\n"
        f"Made by `python benchmarks/memory.py` ({seconds / 60:.0f} min on one CPU thread, no GPU): each recipe of "
        "`run.sh` on FLUX.1-dev, SD3.5-Medium, SD1.5 or Wan2.1-T2V-1.3B with the flags `bash run.sh --print RECIPE` "
        "gives, the models "
        "built from their published configs as fake tensors (method and assumptions: the script's docstring). "
        "**GB = 10^9 bytes** per GPU, as `torch.cuda.max_memory_allocated` counts them (the CUDA allocator reserves "
        "5-15% more). Goal: LoRA at 512 px within 48 GB; LoRA above 512 px and full fine-tuning (FSDP over 8 GPUs) "
        "within 80 GB.\n\n"
        "Resident parts: trainable weights, the frozen denoiser weights, gradients, AdamW state, the text encoders, "
        "the VAE and the reward networks (HPSv2.1, HPSv3), the rollout data (latents, conditioning, decoded images or "
        "videos), DDP's gradient buckets or FSDP's gathered units. Transient: `train act.` is one training "
        "micro-step's peak above them (forward saved for backward, backward, AdamW step), `+ decode` and `+ act.` the "
        "VAE's decode and the reward's scoring of their batches, `grid` the sample grid's forward or VAE decode of one "
        "rollout batch. `rows` is the denoiser batch of a training forward (CFG included); ckpt = "
        "--gradient-checkpointing, offload = --offload-frozen. "
        "The peak is the largest phase:\n\n"
        + table(rows)
        + "\n\nEach phase's total (GB; evaluate = the sample grid and the held-out evaluation):\n\n"
        + phase_table(rows)
        + "\n"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the report (markdown) here, e.g. docs/gpu_memory.md")
    parser.add_argument("--recipes", nargs="+", help="these run.sh recipes only (default: every GPU recipe)")
    parser.add_argument("--json", help="also write the estimates as JSON here")
    parser.add_argument(
        "--command",
        help="plan this launch line instead of run.sh's recipes, e.g. 'accelerate launch --num_processes 8 "
        "dancegrpo.py --model-id Qwen/Qwen-Image --resolution 512 ...' (the model's kind from its name)",
    )
    parser.add_argument("--cross-check", action="store_true", help="compare with a real CPU run of a 2-block FLUX")
    a = parser.parse_args()
    if a.cross_check:
        cross_check()
        return
    t0 = time.perf_counter()
    rows = []
    for name in ["command"] if a.command else a.recipes or gpu_recipes():
        t = time.perf_counter()
        e = recipe_estimate(parse_command(name, a.command) if a.command else recipe(name))
        rows.append((name, e))
        print(f"{name}: peak {e['peak']:.1f} GB in {e['peak_phase']} ({time.perf_counter() - t:.0f} s)", flush=True)
    text = report(rows, time.perf_counter() - t0)
    print("\n" + text)
    if a.out:
        Path(a.out).write_text(text)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(rows), indent=1))


if __name__ == "__main__":
    main()
