"""benchmarks/gpu/memory.py: the per-GPU memory plan, on a tiny FLUX and a tiny Wan2.1 (fake tensors, a few seconds each).

    .venv/bin/python -m pytest tests/test_memory.py -q                 # ~30 s on one thread
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_memory.py -q

The plan's figures that decide whether a recipe fits: what LoRA keeps in which dtype, what AdamW adds, what gradient
checkpointing saves and what FSDP shards; a video model's phases (CFG rows, the fp32 VAE, decoded videos kept and
concatenated, the reward on a few frames of each); and that every GPU recipe of run.sh parses.
"""

import math

import pytest
import torch

from benchmarks.gpu import memory

GB = memory.GB
# dancegrpo.py on FLUX.1-dev's kind at 64 px (the tiny VAE halves it: 32 x 32 latents, 256 tokens), micro-batch 2
FLAGS = [
    "--model-id", "black-forest-labs/FLUX.1-dev", "--resolution", "64", "--mixed-precision", "bf16",
    "--reward", "hpsv2.1", "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "2",
    "--samples-per-update", "4", "--kl-beta", "0",
]  # fmt: skip
LORA = ["--lora", "--lora-rank", "4", "--lora-alpha", "8"]


def plan(flags, num_processes=1, fsdp=False, blocks=1):
    config = dict(memory.TINY_FLUX, denoiser={**memory.TINY_FLUX["denoiser"], "num_layers": blocks})
    config["denoiser"]["num_single_layers"] = blocks
    return memory.estimate("dancegrpo.py", FLAGS + flags, num_processes, fsdp, model_config=config)


def test_lora_keeps_the_base_in_bf16_and_trains_an_fp32_adapter_with_two_adamw_states():
    e = plan(LORA)
    n_base = e["params"]["denoiser"] - e["params"]["trainable"]
    n_adapter = e["params"]["trainable"]
    assert 0 < n_adapter < n_base / 10
    assert e["gb"]["frozen"] * GB == pytest.approx(2 * n_base)  # bf16 under --mixed-precision bf16
    assert (e["gb"]["trainable"] + e["gb"]["optimizer"]) * GB == pytest.approx(12 * n_adapter)  # fp32 + 2 fp32 states
    assert e["gb"]["grads"] == e["gb"]["trainable"]
    # the peak is the largest phase, and each phase holds at least the resident weights and AdamW state
    assert e["peak"] == max(e["phases"].values()) == e["phases"][e["peak_phase"]]
    resident = sum(e["gb"][k] for k in ("trainable", "frozen", "optimizer", "rollout_data"))
    assert min(e["phases"].values()) > resident


def test_gradient_checkpointing_lowers_the_training_activations():
    plain = plan(LORA, blocks=3)
    checkpointed = plan(LORA + ["--gradient-checkpointing"], blocks=3)
    assert checkpointed["gradient_checkpointing"] and not plain["gradient_checkpointing"]
    assert 0 < checkpointed["gb"]["activations"] < 0.7 * plain["gb"]["activations"]
    # what is resident does not change
    assert checkpointed["gb"]["frozen"] == plain["gb"]["frozen"]


def test_fsdp_shards_full_fine_tuning_weights_gradients_and_adamw_state_by_the_process_count():
    single = plan(["--no-lora"])
    sharded = plan(["--no-lora"], num_processes=8, fsdp=True)
    n = single["params"]["trainable"]
    assert n == single["params"]["denoiser"]  # every weight trains
    assert single["gb"]["trainable"] * GB == pytest.approx(4 * n)  # fp32 master weights
    assert single["gb"]["optimizer"] * GB == pytest.approx(8 * n)
    for part in ("trainable", "grads", "optimizer"):
        assert sharded["gb"][part] == pytest.approx(single["gb"][part] / 8)
    assert sharded["gb"]["frozen"] == 0 and sharded["gb"]["dist_buffers"] > 0  # gathered units instead
    # DDP keeps every weight and adds its gradient buckets
    ddp = plan(["--no-lora"], num_processes=8)
    assert ddp["gb"]["dist_buffers"] == pytest.approx(single["gb"]["grads"])


def test_offloading_the_frozen_parts_takes_them_out_of_the_training_phase():
    kept, offloaded = plan(LORA), plan(LORA + ["--offload-frozen"])
    frozen_parts = sum(kept["gb"][k] for k in ("text_encoders", "vae", "reward"))
    assert kept["phases"]["train"] - offloaded["phases"]["train"] == pytest.approx(frozen_parts)


def test_every_gpu_recipe_of_run_sh_parses_into_a_script_model_and_process_count():
    names = memory.gpu_recipes()
    assert any("flux" in n for n in names) and not any(n.endswith("-multinode") for n in names)
    assert {n for n in names if "wan" in n} >= {"dancegrpo-wan-1gpu", "branchgrpo-wan-8gpu", "vgrpo-wan-8gpu"}
    for name in names:
        r = memory.recipe(name)
        args = memory.parse_args(r.script, r.flags)
        assert memory.model_kind(args.model_id) in memory.MODELS
        assert r.num_processes == (1 if name.endswith("1gpu") else 8)
        assert r.fsdp == ("fsdp" in name) and (not r.fsdp or r.fsdp_config)


# ---------------------------------------------------------------- a video model: Wan2.1 text-to-video
# dancegrpo.py on a tiny Wan2.1 (memory.TINY_WAN): 5 frames at 32 px (latents (16, 2, 4, 4)), CFG 5, 4 videos decoded
# 2 at a time, HPSv2.1 on --reward-frames frames of each and the temporal reward, a 2-video held-out evaluation
WAN = [
    "--model-id", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "--resolution", "32", "--num-frames", "5",
    "--mixed-precision", "bf16", "--reward", "hpsv2.1,temporal:0.5", "--samples-per-device", "4", "--group-size", "4",
    "--rollout-batch-size", "2", "--samples-per-update", "4", "--kl-beta", "0", "--guidance-scale", "5",
    "--eval-every", "1", "--eval-max-prompts", "2", "--eval-samples-per-prompt", "1", "--sample-every", "0", *LORA,
]  # fmt: skip
VIDEO_BYTES = 5 * 3 * 32 * 32 * 4  # one decoded video (F, 3, H, W) in fp32


def wan_plan(flags=()):
    return memory.estimate("dancegrpo.py", WAN + list(flags), model_config=memory.TINY_WAN)


def test_wan_shapes_follow_the_published_configs():
    shapes = memory.Shapes.of("wan", memory.MODELS["wan"], (480, 832), 33)
    assert shapes.latent == (16, 9, 60, 104)  # (F - 1) / 4 + 1 latent frames, 8x smaller in space
    assert shapes.sample == (33, 3, 480, 832) and shapes.cond == {"prompt_embeds": (512, 4096)}
    assert memory.model_kind("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") == "wan"
    with pytest.raises(ValueError, match="not FLUX.1-dev, .*Wan2.1-1.3B, .* or HunyuanVideo-1.5, whose published"):
        memory.model_kind("Wan-AI/Wan2.1-T2V-14B-Diffusers")


def test_a_video_model_doubles_its_rows_for_cfg_decodes_in_fp32_and_keeps_its_videos():
    e = wan_plan()
    assert e["model"] == "wan" and e["frames"] == 5 and e["resolution"] == 32
    assert e["rollout_rows"] == e["train_rows"] == 4  # [uncond; cond] of a 2-video batch
    assert wan_plan(["--guidance-scale", "1"])["train_rows"] == 2
    # the frozen base in bf16, the VAE in fp32 (common.models.WanModel), whatever --mixed-precision says
    assert e["gb"]["frozen"] * GB == pytest.approx(2 * (e["params"]["denoiser"] - e["params"]["trainable"]))
    with memory.fake_world():
        vae = memory.build_vae("wan", {**memory.VAE_WAN, **memory.TINY_WAN["vae"]}, None)
        assert e["gb"]["vae"] * GB == 4 * sum(p.numel() for p in vae.parameters())
    # the 4 decoded videos are kept; decoding holds them twice more (the batches, then their torch.cat)
    assert e["gb"]["rollout_data"] * GB > 4 * VIDEO_BYTES
    resident = sum(e["gb"][k] for k in ("trainable", "frozen", "optimizer", "rollout_data", "vae", "reward")) * GB
    assert e["phases"]["decode"] * GB >= resident + 2 * 4 * VIDEO_BYTES
    assert e["phases"]["evaluate"] * GB >= resident + 2 * 2 * VIDEO_BYTES  # the 2 held-out videos, and their cat


def test_the_image_reward_scores_reward_frames_of_each_video_and_rlr_refuses_videos():
    one, four = wan_plan(["--reward-frames", "1"]), wan_plan()
    assert 0 < one["gb"]["reward_activations"] < four["gb"]["reward_activations"]  # HPS on 4 x 1, then 4 x 4 frames
    with pytest.raises(ValueError, match="video"):
        memory.estimate("rlr.py", ["--model-id", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "--num-frames", "5"])


def test_hpsv3_is_planned_at_its_published_size_in_bf16_beside_hpsv2_and_rlr_refuses_it():
    """HPSv3: Qwen2-VL-7B-Instruct's 8,291,375,616 parameters (its hub config, as published) less its LM head
    (3584 x 152064) plus the reward token's embedding row, in bf16, and the fp32 head (3584 x 1024 + 1024, 1024 x 16 +
    16, 16 x 2 + 2 = 3,687,474 parameters), resident next to HPSv2.1 when --reward names both, its activations on top
    of the decode phase; rlr.py's reward gradient through it is refused."""
    quiet = ["--sample-every", "0", "--eval-every", "0"]  # HPSv3 on the 4 training images, not 36 more (slow)
    hps, both = plan(quiet), plan([*quiet, "--reward", "hpsv2.1:1,hpsv3:0.5"])
    body = 8_291_375_616 - 3584 * 152064 + 3584
    hpsv3 = 2 * body + 4 * 3_687_474  # 15.51 GB
    rotary = 336  # the two rotary embeddings' inverse frequencies (buffers, bf16)
    assert round((both["gb"]["reward"] - hps["gb"]["reward"]) * GB) == hpsv3 + rotary
    assert both["gb"]["reward_activations"] > hps["gb"]["reward_activations"]  # 4 images of 847 positions
    assert both["phases"]["decode"] - hps["phases"]["decode"] > hpsv3 / GB
    with pytest.raises(ValueError, match="HPSv3"):
        memory.estimate("rlr.py", ["--model-id", "black-forest-labs/FLUX.1-dev", "--reward", "hpsv3"])


def test_ema_keeps_one_fp32_copy_of_the_trained_weights():
    """dancegrpo.py --ema (as branchgrpo.py's and vgrpo.py's): the EMA is one more fp32 copy of the trained weights,
    resident through every phase; without it nothing changes."""
    quiet = ["--sample-every", "0", "--eval-every", "0", *LORA]
    off, on = plan(quiet), plan([*quiet, "--ema"])
    assert on["gb"]["trainable"] == pytest.approx(2 * off["gb"]["trainable"])
    for phase, gb in off["phases"].items():
        assert on["phases"][phase] == pytest.approx(gb + off["gb"]["trainable"], abs=1e-9)


def test_geneval_plans_its_detector_and_clip_in_fp32_and_ocr_nothing_on_the_gpu():
    """GenEval's judge: Mask2Former Swin-S (facebook/mask2former-swin-small-coco-instance, 68,741,083 parameters) and
    CLIP ViT-L/14 (openai/clip-vit-large-patch14, 427,616,513), fp32, resident beside HPSv2.1, one copy for geneval and
    geneval_accuracy together (their buffers, Swin's relative-position indices and CLIP's position ids, under 2 MB);
    its activations above HPSv2.1's (an 800 x 800 detector forward per image). OCR's PP-OCR models run on the CPU."""
    quiet = ["--sample-every", "0", "--eval-every", "0"]
    hps = plan(quiet)
    both = plan([*quiet, "--reward", "hpsv2.1:1,geneval:0,geneval_accuracy:0"])
    params = 4 * (68_741_083 + 427_616_513)
    extra = round((both["gb"]["reward"] - hps["gb"]["reward"]) * GB)
    assert params <= extra < params + 2e6
    assert both["gb"]["reward_activations"] > hps["gb"]["reward_activations"] + 0.3
    assert plan([*quiet, "--reward", "hpsv2.1:1,ocr:0"])["gb"]["reward"] == hps["gb"]["reward"]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_fake_tensor_plan_matches_a_real_cpu_run(checkpointing):
    """docs/gpu.md's cross-check, small: one training micro-step of a narrow FLUX.1-dev (1 double + 1 single block,
    2 heads: width 256) at 512 px with a LoRA r128 adapter, the fake-tensor plan against the same micro-step run with
    real tensors (weights, gradients, AdamW state, activations)."""
    narrow = {"denoiser": {"num_layers": 1, "num_single_layers": 1, "num_attention_heads": 2}}
    flags = memory.CROSS_CHECK_FLAGS + (["--gradient-checkpointing"] if checkpointing else [])
    fake = memory.estimate("dancegrpo", flags, model_config=narrow)["gb"]
    real = memory.real_two_blocks(checkpointing, narrow)
    assert sum(fake[k] for k in ("trainable", "frozen", "grads", "optimizer", "activations")) == pytest.approx(
        real["peak"] / GB, rel=1e-3
    )


# ---------------------------------------------------------------- diffusionnft.py: the old policy and the EMA
def test_diffusionnft_keeps_two_more_copies_of_the_trained_weights_and_refuses_fsdp():
    """diffusionnft.py keeps the old policy (a second LoRA adapter, or an fp32 copy) and the EMA beside the trained
    weights: 3 x the adapter's fp32 bytes; its training rows are --train-batch-size (FLUX: no CFG rows); its
    rollout data is the final latents and images only (no trajectory)."""
    nft = ["--model-id", "black-forest-labs/FLUX.1-dev", "--resolution", "64", "--mixed-precision", "bf16",
           "--reward", "hpsv2.1", "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "2",
           "--train-batch-size", "2", "--samples-per-update", "2", "--num-steps", "3", "--timestep-fraction", "0.5"]  # fmt: skip
    config = dict(memory.TINY_FLUX, denoiser={**memory.TINY_FLUX["denoiser"], "num_layers": 1})
    config["denoiser"]["num_single_layers"] = 1
    e = memory.estimate("diffusionnft.py", nft + LORA, model_config=config)
    g = plan(LORA)  # dancegrpo.py: the same tiny FLUX, the same adapter
    assert e["params"]["trainable"] == g["params"]["trainable"]
    assert e["gb"]["trainable"] * GB == pytest.approx(3 * 4 * e["params"]["trainable"])
    for part in ("grads", "optimizer", "frozen"):
        assert e["gb"][part] == pytest.approx(g["gb"][part])
    assert e["train_rows"] == 2 and e["rollout_rows"] == 2  # FLUX.1-dev's embedded guidance: no CFG rows
    # 4 fp32 latents and images, the conditioning of 4 prompts and one more (bf16): no trajectory, no log-probs
    parts = {**memory.MODELS["flux"], "denoiser": {**memory.MODELS["flux"]["denoiser"], **config["denoiser"]}}
    parts |= {"vae": {**memory.MODELS["flux"]["vae"], **config["vae"]}, "text": config["text"]}
    shapes = memory.Shapes.of("flux", parts, 64)
    cond = sum(2 * math.prod(c) for c in shapes.cond.values())
    data = 4 * 4 * (math.prod(shapes.latent) + math.prod(shapes.image)) + 5 * cond
    assert e["gb"]["rollout_data"] * GB == pytest.approx(data)
    # full fine-tuning: the KL's frozen base copy (--kl-beta > 0) and 3 fp32 copies of every weight
    full = memory.estimate("diffusionnft.py", nft + ["--no-lora", "--kl-beta", "1e-4"], model_config=config)
    n = full["params"]["denoiser"]
    assert full["gb"]["trainable"] * GB == pytest.approx(3 * 4 * n)
    assert full["gb"]["frozen"] * GB == pytest.approx(2 * n)
    with pytest.raises(ValueError, match="FSDP"):
        memory.estimate("diffusionnft.py", nft + LORA, 8, fsdp=True, model_config=config)


# ---------------------------------------------------------------- Qwen-Image: true CFG, the VL text encoder, its 3D VAE
def test_qwen_image_plan_doubles_cfg_rows_keeps_its_text_encoder_and_decodes_one_frame():
    """dancegrpo.py on a tiny Qwen-Image (memory.TINY_QWEN) at 64 px: LoRA keeps the base in bf16 and the adapter in
    fp32, true CFG doubles the denoiser rows, the whole Qwen2.5-VL (its vision tower too, as the pipeline loads it) is
    resident, and --offload-frozen takes it out of the training phase."""
    flags = ["--model-id", "Qwen/Qwen-Image", "--resolution", "64", "--mixed-precision", "bf16", "--reward", "hpsv2.1",
             "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "2", "--samples-per-update", "4",
             "--kl-beta", "0", "--guidance-scale", "4", *LORA]  # fmt: skip
    e = memory.estimate("dancegrpo.py", flags, model_config=memory.TINY_QWEN)
    assert e["model"] == "qwen" and e["resolution"] == 64
    assert e["rollout_rows"] == e["train_rows"] == 4  # [uncond; cond] of a 2-image batch
    assert memory.estimate("dancegrpo.py", flags[:-7] + LORA, model_config=memory.TINY_QWEN)["train_rows"] == 2
    assert e["gb"]["frozen"] * GB == pytest.approx(2 * (e["params"]["denoiser"] - e["params"]["trainable"]))
    assert e["gb"]["trainable"] * GB == pytest.approx(4 * e["params"]["trainable"])
    with memory.fake_world():
        te = memory.build_text_encoder("qwen25vl", memory.TINY_QWEN["text"][0][1], torch.bfloat16, False)
        assert (
            e["gb"]["text_encoders"] * GB
            == memory.nbytes(te)
            > 2 * sum(p.numel() for p in te.model.visual.parameters())
        )
    offloaded = memory.estimate("dancegrpo.py", flags + ["--offload-frozen"], model_config=memory.TINY_QWEN)
    assert e["phases"]["train"] - offloaded["phases"]["train"] == pytest.approx(
        sum(e["gb"][k] for k in ("text_encoders", "vae", "reward"))
    )
    assert memory.model_kind("Qwen/Qwen-Image-2512") == "qwen"
    with pytest.raises(ValueError, match="Qwen-Image"):
        memory.model_kind("Qwen/Qwen-Image-Edit")


def test_wan22_5b_plan_has_its_published_sizes_48_channel_16x_latents_and_per_token_timesteps():
    """Wan2.2-TI2V-5B: the transformer (5.00B) and the VAE (0.705B) built from the published configs; its latents are
    (48, F', H/16, W/16); with one timestep per token the training forward keeps more than with one per sample."""
    with memory.fake_world():
        den = memory.build_denoiser("wan22", memory.WAN22_TI2V_5B, torch.bfloat16)
        vae = memory.build_vae("wan22", memory.VAE_WAN22, None)
        assert sum(p.numel() for p in den.parameters()) / 1e9 == pytest.approx(5.00, abs=0.01)
        assert sum(p.numel() for p in vae.parameters()) / 1e9 == pytest.approx(0.705, abs=0.001)
    shapes = memory.Shapes.of("wan22", memory.MODELS["wan22"], (704, 1280), 121)
    assert shapes.latent == (48, 31, 44, 80) and shapes.sample == (121, 3, 704, 1280)
    assert memory.model_kind("Wan-AI/Wan2.2-TI2V-5B-Diffusers") == "wan22"
    tiny = {**memory.TINY_WAN, "denoiser": {**memory.TINY_WAN["denoiser"], "in_channels": 48, "out_channels": 48}}
    tiny["vae"] = dict(base_dim=8, decoder_base_dim=8, num_res_blocks=1)
    flags = [f if f != "Wan-AI/Wan2.1-T2V-1.3B-Diffusers" else "Wan-AI/Wan2.2-TI2V-5B-Diffusers" for f in WAN]
    flags[flags.index("--resolution") + 1] = "64"
    e = memory.estimate("dancegrpo.py", flags, model_config=tiny)
    assert e["model"] == "wan22" and e["frames"] == 5 and e["rollout_rows"] == 4  # CFG rows
    assert e["gb"]["rollout_data"] * GB > 4 * 5 * 3 * 64 * 64 * 4  # the 4 decoded videos are kept


def test_flux2_klein_plan_has_its_published_sizes_and_adapts_the_single_blocks():
    """FLUX.2 [klein] base 4B: the transformer (3.88B), Qwen3-4B (4.02B) and the VAE (84M) built from the published
    configs; 128-channel tokens of 2x2-patchified 32-channel latents; the plan's adapter is the one the scripts add
    (common.models.Flux2Model.lora_targets: the single blocks' fused Linears too). FLUX.2 [dev] is not modelled."""
    with memory.fake_world():
        den = memory.build_denoiser("flux2", memory.FLUX2_KLEIN_4B, torch.bfloat16)
        te = memory.build_text_encoder("qwen3", memory.QWEN3_4B, torch.bfloat16, False)
        vae = memory.build_vae("flux2", memory.VAE_FLUX2, torch.bfloat16)
        sizes = [sum(p.numel() for p in m.parameters()) / 1e9 for m in (den, te, vae)]
    assert sizes == pytest.approx([3.876, 4.022, 0.084], abs=0.001)
    shapes = memory.Shapes.of("flux2", memory.MODELS["flux2"], 384)
    assert (
        shapes.latent == (576, 128)
        and shapes.vae_latent == (32, 48, 48)
        and shapes.cond["prompt_embeds"]
        == (
            512,
            7680,
        )
    )
    assert memory.model_kind("black-forest-labs/FLUX.2-klein-base-4B") == "flux2"
    args = memory.parse_args("dancegrpo", ["--model-id", "x", "--lora", "--lora-rank", "4", "--lora-alpha", "4"])
    with memory.fake_world():
        small = {**memory.FLUX2_KLEIN_4B, "num_layers": 1, "num_single_layers": 1}
        module = memory.trained_module("flux2", small, args, torch.bfloat16, False)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in module.named_parameters() if ".lora_A" in n}
    assert len(adapted) == 8 + 2 and "single_transformer_blocks.0.attn.to_qkv_mlp_proj" in adapted


def test_distinct_prompts_per_process_by_hand():
    """Process r owns global samples [r S, (r + 1) S) of groups of G: 96 samples in groups of 16 are 6 prompts; 12 in
    groups of 8 meet 2 groups ([0, 12) or [12, 24): offsets 0 and 4); 2 in groups of 4 sit in one; 6 in groups of 4
    can straddle 2 ([6, 12): groups 1 and 2)."""
    assert [memory.distinct_prompts(S, G) for S, G in [(96, 16), (12, 8), (2, 4), (6, 4), (4, 4), (5, 1)]] == [
        6, 2, 1, 2, 1, 5,
    ]  # fmt: skip
    for S, G in [(12, 8), (6, 4), (10, 4), (9, 6)]:  # against the layout itself, over enough processes
        most = max(len({k // G for k in range(r * S, (r + 1) * S)}) for r in range(4 * G))
        assert memory.distinct_prompts(S, G) == most, (S, G)


def test_wan22_a14b_plan_counts_both_experts_weights_and_one_experts_activations(tmp_path):
    """Wan2.2-T2V-A14B: each expert has Wan2.1-14B's published size (14.29B); a folder with transformer_2 or the hub
    name plans as two experts: the frozen base and the adapter (its gradients and AdamW state too) twice, the
    activations of one (each forward goes through one expert), against the same plan of one expert."""
    from tests.tiny import build_wan22_a14b

    with memory.fake_world():
        den = memory.build_denoiser("wan22_a14b", memory.WAN22_A14B_EXPERT, torch.bfloat16)
        assert sum(p.numel() for p in den.parameters()) / 1e9 == pytest.approx(14.29, abs=0.01)
    build_wan22_a14b(tmp_path / "a14b")
    assert memory.model_kind(str(tmp_path / "a14b")) == "wan22_a14b"
    assert memory.model_kind("Wan-AI/Wan2.2-T2V-A14B-Diffusers") == "wan22_a14b"
    flags = [f if f != "Wan-AI/Wan2.1-T2V-1.3B-Diffusers" else "Wan-AI/Wan2.2-T2V-A14B-Diffusers" for f in WAN]
    two = memory.estimate("dancegrpo.py", flags, model_config=memory.TINY_WAN)
    one = memory.estimate("dancegrpo.py", flags, model_config={**memory.TINY_WAN, "experts": 1})
    assert two["model"] == "wan22_a14b" and two["params"]["denoiser"] == 2 * one["params"]["denoiser"]
    for part in ("frozen", "trainable", "grads", "optimizer"):
        assert two["gb"][part] == pytest.approx(2 * one["gb"][part]), part
    assert two["gb"]["activations"] == one["gb"]["activations"]


def test_zimage_plan_has_its_published_size_and_calls_the_transformer_as_the_model_does():
    """Z-Image: the transformer at ZImageTransformer2DModel's published defaults (6.15B), the FLUX.1 VAE's latent as
    its input (it patchifies), lists of latents and padded captions as ZImageModel.velocity passes them; a shortened
    one runs the plan's forward and the scripts' adapter lands on its attention projections."""
    with memory.fake_world():
        den = memory.build_denoiser("zimage", memory.Z_IMAGE, torch.bfloat16)
        assert sum(p.numel() for p in den.parameters()) / 1e9 == pytest.approx(6.155, abs=0.001)
    assert memory.model_kind("Tongyi-MAI/Z-Image-Turbo") == memory.model_kind("Tongyi-MAI/Z-Image") == "zimage"
    shapes = memory.Shapes.of("zimage", memory.MODELS["zimage"], 512)
    assert shapes.latent == shapes.vae_latent == (16, 64, 64) and shapes.cond["prompt_embeds"] == (256, 2560)
    args = memory.parse_args("dancegrpo", ["--model-id", "x", "--lora", "--lora-rank", "4", "--lora-alpha", "4"])
    small = {**memory.Z_IMAGE, "n_layers": 1, "n_refiner_layers": 1}
    with memory.fake_world():
        module = memory.trained_module("zimage", small, args, torch.bfloat16, True)
        out = memory.denoise(memory.Shapes.of("zimage", memory.MODELS["zimage"], 64), module, torch.zeros(2, 16, 8, 8))
    assert out.shape == (2, 16, 8, 8)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in module.named_parameters() if ".lora_A" in n}
    assert "layers.0.attention.to_q" in adapted and len(adapted) == 4 * 3  # 1 layer + 1 + 1 refiners, q k v out


def test_flux2_dev_plan_has_its_published_sizes_and_embeds_guidance():
    """FLUX.2 [dev]: the 32.22B transformer (Flux2Transformer2DModel's published defaults) and Mistral-Small-3.1
    (24.0B with its vision tower and untied LM head) built as fake tensors; a local Flux2Pipeline folder or the hub
    name plans as [dev]; a shortened transformer runs the plan's forward with the guidance input."""
    with memory.fake_world():
        den = memory.build_denoiser("flux2_dev", memory.FLUX2_DEV, torch.bfloat16)
        te = memory.build_text_encoder("mistral3", memory.MISTRAL_SMALL_31, torch.bfloat16, False)
        sizes = [sum(p.numel() for p in m.parameters()) / 1e9 for m in (den, te)]
    assert sizes == pytest.approx([32.22, 24.01], abs=0.01)
    assert memory.model_kind("black-forest-labs/FLUX.2-dev") == "flux2_dev"
    shapes = memory.Shapes.of("flux2_dev", memory.MODELS["flux2_dev"], 512)
    assert shapes.latent == (1024, 128) and shapes.cond["prompt_embeds"] == (512, 15360)
    small = {**memory.FLUX2_DEV, "num_layers": 1, "num_single_layers": 1}
    with memory.fake_world():
        module = memory.build_denoiser("flux2_dev", small, torch.bfloat16)
        assert memory.denoise(shapes, module, torch.zeros(1, *shapes.latent)).shape == (1, *shapes.latent)


def test_every_registered_model_kind_has_a_memory_plan():
    """A new model kind (an entry of common.models.REGISTRY) is asked for its plan here: its published sizes in
    MODELS, and its latents, forward and decode in Shapes.of, denoise and vae_decode."""
    from common.models import REGISTRY

    assert {k.name for k in REGISTRY} - {"shapes", "shapes-edit"} <= set(memory.MODELS)  # ShapesBench's are CPU-sized
    assert {k.name for k in REGISTRY if k.video} <= set(memory.VIDEO_KINDS)
    # a kind whose prompts bring images encodes them in its plan (REGISTRY's image range: Kind.images)
    assert {k.name for k in REGISTRY if k.images[1]} - {"shapes-edit", "flux2"} <= {
        kind for kind, plan in memory.PLANS.items() if plan.encodes_images
    }


def test_hunyuan15_plan_runs_its_value_reading_forward_on_fake_tensors():
    """HunyuanVideo-1.5's transformer reads values (text-to-video when the image embeddings are all zero; the valid
    text tokens moved first): the plan's forward gives it real masks and a fake rest, and a shortened 8.3B transformer
    (one block, one refiner block) denoises 480 x 480 x 5 frames' latents (32, 2, 30, 30) to their shape."""
    shapes = memory.Shapes.of("hunyuan15", memory.MODELS["hunyuan15"], 480, 5)
    assert shapes.latent == (32, 2, 30, 30)
    with memory.fake_world():
        module = memory.build_denoiser("hunyuan15", {"num_layers": 1, "num_refiner_layers": 1}, torch.bfloat16)
        out = memory.denoise(shapes, module, torch.zeros(2, *shapes.latent))
    assert out.shape == (2, *shapes.latent) and out.dtype == torch.float32


# ---------------------------------------------------------------- kinds conditioned on images: edits, image-to-video
EDIT = [
    "--mixed-precision", "bf16", "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "2",
    "--samples-per-update", "4", "--kl-beta", "0", "--sample-every", "0", "--eval-every", "0", *LORA,
]  # fmt: skip
ONE_BLOCK = {"kontext": {"num_layers": 1, "num_single_layers": 1}, "qwen-edit": {"num_layers": 1}}


def test_edit_and_i2v_kinds_have_their_published_sizes_and_hub_names(tmp_path):
    """The transformers and the image encoder built from the published configs on the meta device: FLUX.1-Kontext-dev
    is FLUX.1-dev's transformer (11.90B), Qwen-Image-Edit-2509 Qwen-Image's (20.43B), Wan2.1-I2V-14B 16.39B (36 input
    channels, the image keys and values of its cross-attention) with CLIP ViT-H/14's vision tower (630.8M, 257 tokens
    at 224 px), Wan2.2-I2V-A14B two experts of 14.29B; hub ids and local folders plan as their kind."""
    from tests.tiny import build_kontext, build_qwen_edit_plus, build_wan22_i2v_a14b, build_wan_i2v

    kinds = ("flux", "kontext", "qwen-edit", "wan-i2v", "wan-i2v-a14b")
    with torch.device("meta"):
        built = {k: memory.build_denoiser(k, memory.MODELS[k]["denoiser"], torch.bfloat16) for k in kinds}
        sizes = {k: sum(p.numel() for p in module.parameters()) for k, module in built.items()}
        clip = memory.build_text_encoder("clip_vision", memory.CLIP_VIT_H14_VISION, torch.bfloat16, False)
        clip_params = sum(p.numel() for p in clip.parameters())
    assert sizes["kontext"] == sizes["flux"] == 11_901_408_320
    assert sizes["qwen-edit"] == 20_430_401_088 and clip_params == 630_766_080
    assert sizes["wan-i2v"] == 16_394_878_784 and sizes["wan-i2v-a14b"] == 14_288_901_184
    assert memory.MODELS["wan-i2v-a14b"]["experts"] == 2 and {"wan-i2v", "wan-i2v-a14b"} <= set(memory.VIDEO_KINDS)
    hub = {
        "black-forest-labs/FLUX.1-Kontext-dev": "kontext", "black-forest-labs/FLUX.1-dev": "flux",
        "Qwen/Qwen-Image-Edit-2509": "qwen-edit", "Qwen/Qwen-Image-Edit-2511": "qwen-edit", "Qwen/Qwen-Image": "qwen",
        "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": "wan-i2v", "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers": "wan-i2v",
        "Wan-AI/Wan2.2-I2V-A14B-Diffusers": "wan-i2v-a14b", "Wan-AI/Wan2.2-T2V-A14B-Diffusers": "wan22_a14b",
    }  # fmt: skip
    assert {name: memory.model_kind(name) for name in hub} == hub
    with pytest.raises(ValueError, match="whose published configs are here"):  # the first Qwen-Image-Edit: not Plus
        memory.model_kind("Qwen/Qwen-Image-Edit")
    for build, kind in ((build_kontext, "kontext"), (build_qwen_edit_plus, "qwen-edit"), (build_wan_i2v, "wan-i2v"),
                        (build_wan22_i2v_a14b, "wan-i2v-a14b")):  # fmt: skip
        build(tmp_path / kind)
        assert memory.model_kind(str(tmp_path / kind)) == kind


def test_the_plans_condition_is_what_the_kinds_encode(tmp_path):
    """Each conditioned kind's plan keeps per row what the kind's encode_prompts returns for an edit prompt: the same
    keys, and the condition's shape from the model's own configs (FLUX.1-Kontext: the source's packed tokens;
    Qwen-Image-Edit-Plus: the references' tokens; Wan2.1-I2V: the mask and first-frame latents, and the CLIP tokens)."""
    from PIL import Image

    from common.edits import EditPrompt
    from common.models import load_model
    from tests.tiny import build_kontext, build_qwen_edit_plus, build_wan_i2v

    Image.new("RGB", (48, 40), "red").save(tmp_path / "source.png")
    prompt = EditPrompt("make it blue", [str(tmp_path / "source.png")])
    cases = {"kontext": (build_kontext, 32, None, "image_latents"), "qwen-edit": (build_qwen_edit_plus, 32, None,
             "image_latents"), "wan-i2v": (build_wan_i2v, 32, 5, "image_condition")}  # fmt: skip
    for kind, (build, resolution, frames, key) in cases.items():
        build(tmp_path / kind)
        model = load_model(str(tmp_path / kind), resolution=resolution, num_frames=frames)
        cond = model.encode_prompts([prompt])
        parts = {**memory.MODELS[kind], "denoiser": dict(model.transformer.config), "vae": dict(model.vae.config)}
        if kind == "wan-i2v":
            parts["text"] = [parts["text"][0], ("clip_vision", model.pipe.image_encoder.config.to_dict(), None)]
        shapes = memory.Shapes.of(kind, parts, resolution, frames)
        names = {"pooled": "pooled_prompt_embeds"}  # FluxPlan's name of FLUX's pooled CLIP embedding
        assert {names.get(k, k) for k in shapes.cond} == set(cond), kind
        assert shapes.cond[key] == tuple(cond[key].shape[1:]), kind
        if kind == "wan-i2v":
            assert shapes.cond["image_embeds"] == tuple(cond["image_embeds"].shape[1:]) == (10, 24)
            assert cond["image_condition"].dtype == torch.float32 and shapes.cond_bytes["image_condition"] == 4
    published = memory.Shapes.of("wan-i2v", memory.MODELS["wan-i2v"], (480, 832), 33)
    assert published.cond["image_condition"] == (20, 9, 60, 104) and published.cond["image_embeds"] == (257, 1280)


def test_qwen_vl_patches_the_pipelines_condition_image_into_196_tokens():
    """Qwen-Image-Edit-Plus's text encoder reads each reference at the pipeline's condition size (384 x 384 for a
    square, calculate_dimensions(CONDITION_IMAGE_SIZE, 1)): Qwen2-VL's processor makes 28 x 28 patches of it (392 px),
    196 tokens after the 2 x 2 merge, the counts the plan's VL forward and text lengths use."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
    from PIL import Image
    from transformers import Qwen2VLImageProcessor

    side, _ = plus.calculate_dimensions(plus.CONDITION_IMAGE_SIZE, 1.0)
    grid = Qwen2VLImageProcessor()(Image.new("RGB", (side, side)), return_tensors="pt")["image_grid_thw"]
    assert side == 384 and grid.tolist() == [[1, *memory.QWEN_EDIT_CONDITION_PATCHES]] == [[1, 28, 28]]
    assert 28 * 28 // 4 == memory.QWEN_EDIT_IMAGE_TOKENS == 196


def test_an_edit_doubles_the_sequence_and_encodes_its_source_with_the_vae():
    """FLUX.1-Kontext at 256 px (one double + one single block): the source's 256 tokens follow the noisy 256, so a
    training step keeps more than FLUX.1-dev's at the same flags; the packed source tokens are in each row's kept
    conditioning; the prompts' encoding runs the VAE on the sources, which with --offload-frozen visits the GPU then;
    image_similarity's CLIP ViT-L/14 (427,616,513 parameters) is resident in fp32 beside HPSv2.1."""
    flags = ["--resolution", "256", "--guidance-scale", "2.5", "--reward", "hpsv2.1", *EDIT]
    kontext = memory.estimate("dancegrpo", ["--model-id", "black-forest-labs/FLUX.1-Kontext-dev", *flags],
                              model_config={"denoiser": ONE_BLOCK["kontext"]})  # fmt: skip
    flux = memory.estimate("dancegrpo", ["--model-id", "black-forest-labs/FLUX.1-dev", *flags],
                           model_config={"denoiser": ONE_BLOCK["kontext"]})  # fmt: skip
    assert kontext["model"] == "kontext" and kontext["images"] == 1 and flux["images"] == 0
    assert kontext["train_rows"] == 2 and kontext["params"] == flux["params"]  # embedded guidance: no CFG rows
    for part in ("activations", "rollout_activations"):
        assert kontext["gb"][part] > 1.3 * flux["gb"][part], part
    # encoding: the text encoders (T5 on 512 tokens), then the VAE's encoder on the prompts' sources at once
    shapes = memory.Shapes.of("kontext", memory.MODELS["kontext"], 256)
    with memory.fake_world():
        vae = memory.build_vae("kontext", memory.VAE_16CH, torch.bfloat16)
        one, two = (memory.measure(lambda n=n: memory.PLANS["kontext"].encode(shapes, [], vae, n), vae) for n in (1, 2))
    assert 0 < one < two <= kontext["gb"]["encode_activations"] * GB * 2
    source = 2 * 256 * 64  # bf16 packed tokens of one prompt's source (32 x 32 latents, 2 x 2 patches)
    assert kontext["gb"]["rollout_data"] - flux["gb"]["rollout_data"] == pytest.approx(5 * source / GB)  # 4 + 1
    offloaded = memory.estimate(
        "dancegrpo", ["--model-id", "black-forest-labs/FLUX.1-Kontext-dev", *flags, "--offload-frozen"],
        model_config={"denoiser": ONE_BLOCK["kontext"]},
    )  # fmt: skip
    assert offloaded["phases"]["encode"] - offloaded["phases"]["rollout"] > offloaded["gb"]["vae"]
    with_sim = memory.estimate(
        "dancegrpo", ["--model-id", "black-forest-labs/FLUX.1-Kontext-dev", *flags, "--reward",
                      "hpsv2.1:0.5,image_similarity:0.5"], model_config={"denoiser": ONE_BLOCK["kontext"]},
    )  # fmt: skip
    extra = round((with_sim["gb"]["reward"] - kontext["gb"]["reward"]) * GB)
    assert 4 * 427_616_513 <= extra < 4 * 427_616_513 + 1e6  # + CLIP's position ids
    assert with_sim["gb"]["reward_activations"] > kontext["gb"]["reward_activations"]


def test_qwen_edit_plan_doubles_cfg_rows_and_grows_with_its_references():
    """Qwen-Image-Edit-Plus at 256 px (one block): true CFG doubles the rows; each reference adds as many tokens as the
    image (a training step keeps more with 2 than with 1), its tokens to the kept conditioning, and the VL encoder's
    vision tokens to the encoding; the VL model (its vision tower too) is resident while encoding."""
    flags = ["--model-id", "Qwen/Qwen-Image-Edit-2509", "--resolution", "256", "--reward", "hpsv2.1", *EDIT]
    cfg, plain = (memory.estimate("dancegrpo", [*flags, "--guidance-scale", g], model_config={"denoiser": ONE_BLOCK[
        "qwen-edit"]}) for g in ("4", "1"))  # fmt: skip
    assert cfg["model"] == "qwen-edit" and cfg["train_rows"] == 4 and plain["train_rows"] == 2
    assert cfg["gb"]["activations"] > 1.5 * plain["gb"]["activations"]
    two = memory.estimate("dancegrpo", [*flags, "--guidance-scale", "1"],
                          model_config={"denoiser": ONE_BLOCK["qwen-edit"], "images": 2})  # fmt: skip
    assert two["images"] == 2 and two["gb"]["activations"] > 1.3 * plain["gb"]["activations"]
    assert two["gb"]["encode_activations"] > plain["gb"]["encode_activations"]
    # a reference more per prompt: its 256 packed bf16 tokens of 64, and 203 more positions (5 + 198: "Picture 2: " and
    # its vision tokens) in the prompt's and the negative's embeddings (bf16, 3584 wide) and masks (int64)
    picture = memory.QWEN_EDIT_PICTURE_TOKENS
    more = 256 * 64 * 2 + 2 * picture * (3584 * 2 + 8)
    assert picture == 203 and two["gb"]["rollout_data"] - plain["gb"]["rollout_data"] == pytest.approx(5 * more / GB)
    with memory.fake_world():
        vl = memory.build_text_encoder("qwen25vl", memory.QWEN25_VL_7B, torch.bfloat16, False)
        assert cfg["gb"]["text_encoders"] * GB == pytest.approx(memory.nbytes(vl))


def test_wan_i2v_plan_reads_36_channels_clip_tokens_and_encodes_the_whole_first_frame_video():
    """Wan2.1-I2V-14B (one block) at 64 px x 5 frames: the transformer reads 36 channels and 257 CLIP tokens, CFG
    doubles the rows; the first frame's condition (20 channels) is kept per row in fp32; CLIP's vision tower travels
    with UMT5 (the text encoders' bytes); encoding runs the fp32 VAE on [frame, 4 zero frames]. Wan2.2-I2V-A14B: two
    experts, no image encoder."""
    flags = ["--model-id", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "--resolution", "64", "--num-frames", "5",
             "--guidance-scale", "5", "--reward", "hpsv2.1,temporal:0.5", *EDIT]  # fmt: skip
    one_block = {"denoiser": {"num_layers": 1}}
    i2v = memory.estimate("dancegrpo", flags, model_config=one_block)
    a14b = memory.estimate("dancegrpo", [f.replace("Wan2.1-I2V-14B-480P", "Wan2.2-I2V-A14B") for f in flags],
                           model_config=one_block)  # fmt: skip
    assert i2v["model"] == "wan-i2v" and a14b["model"] == "wan-i2v-a14b" and i2v["train_rows"] == 4
    with memory.fake_world():
        umt5 = memory.build_text_encoder("umt5", memory.UMT5_XXL, torch.bfloat16, False)
        clip = memory.build_text_encoder("clip_vision", memory.CLIP_VIT_H14_VISION, torch.bfloat16, False)
        assert i2v["gb"]["text_encoders"] * GB == memory.nbytes(umt5, clip)
        assert a14b["gb"]["text_encoders"] * GB == memory.nbytes(umt5)
    t2v = memory.estimate("dancegrpo", [f.replace("Wan2.1-I2V-14B-480P", "Wan2.2-T2V-A14B") for f in flags],
                          model_config=one_block)  # fmt: skip
    shapes = memory.Shapes.of("wan-i2v", memory.MODELS["wan-i2v"], 64, 5)
    assert shapes.latent == (16, 2, 8, 8) and shapes.cond["image_condition"] == (20, 2, 8, 8)
    condition, clip_tokens = 4 * 20 * 2 * 8 * 8, 2 * 257 * 1280  # fp32 condition, bf16 CLIP tokens, per row
    assert i2v["gb"]["rollout_data"] - a14b["gb"]["rollout_data"] == pytest.approx(5 * clip_tokens / GB)
    assert a14b["gb"]["rollout_data"] - t2v["gb"]["rollout_data"] == pytest.approx(5 * condition / GB)
    # the first frame's [frame, zeros] video through the fp32 VAE while encoding, a video at a time
    with memory.fake_world():
        vae = memory.build_vae("wan-i2v", memory.VAE_WAN, None)
        videos = [memory.measure(lambda n=n: memory.PLANS["wan-i2v"].encode(shapes, [], vae, n), vae) for n in (1, 2)]
    assert 0 < videos[0] < videos[1] < 1.1 * videos[0]  # the second video's kept latents only
    assert a14b["gb"]["encode_activations"] >= t2v["gb"]["encode_activations"]
    # the same denoiser as Wan2.2-T2V-A14B's but for the patch embedding of 36 channels
    assert 0 < a14b["params"]["denoiser"] - t2v["params"]["denoiser"] == 2 * 20 * 4 * 5120  # the wider patch embedding
    offloaded = memory.estimate("dancegrpo", [*flags, "--offload-frozen"], model_config=one_block)
    assert offloaded["phases"]["encode"] - offloaded["phases"]["rollout"] > offloaded["gb"]["vae"]
