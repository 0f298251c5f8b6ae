"""The prepared GPU check: full-size models with random weights (built from their published configs; nothing is
downloaded), bf16, LoRA r128, gradient checkpointing and --offload-frozen as in run.sh's recipes, 2 iterations of each
script with small batches, in two cases by default:

  flux   FLUX.1-dev at 512 px: dancegrpo.py, branchgrpo.py --pruning depth, vgrpo.py and diffusionnft.py (8 steps,
         10 for the tree)
  wan    Wan2.1-T2V-1.3B video, 480 x 832 x 9 frames, CFG 5, reward hpsv2.1 on 4 frames + temporal:0.5 (the wan
         recipes' settings): dancegrpo.py (4 videos, rollout batch 4, 8 steps) and branchgrpo.py --pruning depth
         (one tree of 4 leaves, 10 steps)

and, with --models, one case per model kind after those (dancegrpo.py only, with the flux case's flags for an image
and the wan case's for a video; memory.py's published configs; Z-Image is not among them: memory.py has no Z-Image
to plan):

  qwen-image   Qwen-Image (20.4B transformer, Qwen2.5-VL-7B) at 512 px, CFG 4: 58 GB on disk
  flux2-klein  FLUX.2 [klein] base 4B (Qwen3-4B) at 512 px, CFG 4: 16 GB
  wan22-5b     Wan2.2-TI2V-5B video, 704 x 704 x 9 frames, CFG 5, shift 5: 25 GB

For each script it prints seconds per iteration, the peak GPU memory (torch.cuda.max_memory_allocated, as the scripts
log it in perf/peak_mem_gb) next to benchmarks/memory.py's plan for the same flags, and the model FLOP rate and
utilisation of the transformer's forwards without gradients (the rollout) and of the training step, each timed alone.

    bash benchmarks/gpu_check.sh --prepare        # on a machine with the package index: wheels and plans in .whl/,
                                                  # and the command for an offline GPU node (docs/gpu.md)
    bash benchmarks/gpu_check.sh                  # one H100 / H200-class GPU: 8 minutes at most (--limit-s)
    bash benchmarks/gpu_check.sh --cases wan      # one case only (a rerun that fits the time left)
    bash benchmarks/gpu_check.sh --cases none --models qwen-image        # a new model kind alone (--cases none)
    bash benchmarks/gpu_check.sh --cases none --models flux2-klein,wan22-5b
    bash benchmarks/gpu_check.sh --tiny           # the same harness on tiny models, on the CPU (tests run it)

What it measures and what it does not:
- random weights give the real shapes, so memory and speed, not image or video quality or learning;
- the reward is an HPSv2.1 model (open_clip ViT-H-14) with random weights: the real one's size and cost;
- each script runs under benchmarks/gpu_timing.py, which times every transformer forward and backward pass with CUDA
  events; rows (one image or video each; a CFG batch counts both halves) x the FLOPs of one row / that time, against
  the GPU's bf16 matmul peak measured first, and the datasheet's;
- the FLOPs are counted, not assumed: torch.utils.flop_counter on one forward and on one forward + backward of the
  denoiser as the scripts train it (common.models.trainable_denoiser: the LoRA adapter wrapped in, the frozen base
  computing no weight gradients), on the meta device at the real shapes (no memory, no GPU), attention by its math
  path (counted on every device); the recomputed forwards of gradient checkpointing are the hardware's work, not the
  model's, and are not counted. A forward is printed next to the value expected by hand from the configs
  (expected_flops);
- batches and step counts are smaller than the recipes' (4 samples or one 4-leaf tree per iteration, 8-10 steps;
  Wan: 9 frames where the recipes have 33), so the training phase's share of an iteration differs from a real run's.

Every failure is recorded and the check goes on: the reward checkpoint, each model's build, its FLOP count and each
script are caught one by one (the step, the exception's type, the first lines of its message and the end of its
traceback or log) in gpu_check.json ("failures") and gpu_check.md. Before each build and each script the time left
of --limit-s is checked against what it needs (BUILD_S, MIN_SCRIPT_S): one that does not fit is skipped with the
reason. The memory plans, the FLOP counts (both in --plan when prepared) and a disk check come before the clock
starts; a failure there (no CUDA, a plan for other flags, too little disk) stops the check, and is written to the
results too. Every script runs in its own process with its own time limit; a failure or a time-out is recorded with
the end of its log. The runs write no checkpoints or weights (--no-save). {--out}/gpu_check.json, gpu_check.md and
gpu_check.log (every line printed) and --results (the same, with the scripts' logs) are written from the start and
after every step, so a run stopped early keeps what finished; a SIGTERM (gpu_check.sh's outer limit) is recorded
too. Each case's model folder is deleted after its scripts (FLUX.1-dev's is 34 GB, Qwen-Image's 58 GB: the disk
check asks for the largest chosen one and the reward's checkpoint). A bad --cases or --models value stops the check
before anything runs, naming the flag. In --tiny mode the peak memory
is the process's resident set on the CPU, not comparable with the plan, and there is no MFU: that mode checks the
harness, not the figures; its reward is HPSv2.1 too, a tiny open_clip architecture ('tiny-hps', tests/tiny.py's)
saved and loaded by the same path as the real one; the --models cases are tests/tiny.py's models.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}  # dense bf16 tensor-core peak of the SXM parts (NVIDIA datasheets)
LETTERS = "abcdefghijklmnopqrstuvwxyz"
PROMPTS = [
    "a photo of an astronaut riding a horse on the moon",
    "a watercolor painting of a lighthouse at dawn",
    "an anime girl with silver hair in a rainy city",
    "concept art of a floating castle above the clouds",
]
CASES = ("flux", "wan")  # the default check
# --models: one case each after the default ones, dancegrpo.py on the kind's published config (memory.py has it)
MODELS = ("qwen-image", "flux2-klein", "wan22-5b")
KIND = {"flux": "flux", "wan": "wan", "qwen-image": "qwen", "flux2-klein": "flux2", "wan22-5b": "wan22"}  # memory.py's
# The model folder's name under --out: memory.model_kind reads a plan's kind from it (the plans name OUT/<folder>)
FOLDER = {"flux": "flux", "wan": "wan", "qwen-image": "Qwen-Image", "flux2-klein": "FLUX.2-klein-base-4B",
          "wan22-5b": "Wan2.2-TI2V-5B"}  # fmt: skip
LORA_RANK, LORA_ALPHA = 128, 256  # the recipes' adapter
TINY_HPS = "tiny-hps"  # --tiny's HPSv2.1 architecture: open_clip config memory.TINY_FLUX["reward"] (tests/tiny.py's)
RUN_WITH_TINY_HPS = "--run-with-tiny-hps"  # internal: --tiny's scripts run through this file (run_with_tiny_hps)


# ---------------------------------------------------------------------------------------------------
# Pipelines with random weights: FLUX.1-dev- and Wan2.1-T2V-1.3B-shaped
# ---------------------------------------------------------------------------------------------------
def flux_configs(tiny: bool) -> dict:
    """Keyword arguments of each part: FLUX.1-dev's published configs, or the CPU-sized ones, as benchmarks/memory.py
    has them (so its estimate is of the same model)."""
    from benchmarks import memory

    if not tiny:
        return {"transformer": memory.FLUX_DEV, "clip": memory.CLIP_L, "t5": memory.T5_XXL, "vae": memory.VAE_16CH}
    tiny_parts = memory.TINY_FLUX
    (_, clip, _), (_, t5, _) = tiny_parts["text"]
    return {
        "transformer": {**memory.FLUX_DEV, **tiny_parts["denoiser"]},
        "clip": clip,
        "t5": t5,
        "vae": {**memory.VAE_16CH, **tiny_parts["vae"]},
    }


def wan_configs(tiny: bool) -> dict:
    """Wan2.1-T2V-1.3B's published configs (transformer, UMT5-XXL encoder, AutoencoderKLWan), or memory.TINY_WAN's."""
    from benchmarks import memory

    if not tiny:
        return {"transformer": memory.WAN_T2V_1_3B, "umt5": memory.UMT5_XXL, "vae": memory.VAE_WAN}
    tiny_parts = memory.TINY_WAN
    return {
        "transformer": {**memory.WAN_T2V_1_3B, **tiny_parts["denoiser"]},
        "umt5": tiny_parts["text"][0][1],
        "vae": {**memory.VAE_WAN, **tiny_parts["vae"]},
    }


def tokenizers():
    """CLIP and T5 tokenizers built in memory (letters as tokens): the real ones cannot be downloaded here, and the
    pipelines pad every prompt to the same length (77 CLIP, 512 T5 / UMT5 tokens), so the sequence shapes are the
    real ones. Wan2.1's UMT5 takes the T5 one (its ids are within UMT5's vocabulary)."""
    from transformers import CLIPTokenizer, T5Tokenizer

    vocab = [*LETTERS, *(c + "</w>" for c in LETTERS), "<|startoftext|>", "<|endoftext|>"]
    clip = CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=[], model_max_length=77)
    t5_vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0), *((c, -3.0) for c in LETTERS)]
    t5 = T5Tokenizer(vocab=t5_vocab, extra_ids=0)
    return clip, t5


class _DefaultDtype:
    """Initialise in bf16 on the device: FLUX.1-dev's 12B parameters in seconds."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __enter__(self):
        self.saved = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.saved)


@torch.no_grad()
def build_flux(folder: Path, tiny: bool, device, size: dict) -> None:
    """Save a FluxPipeline with random weights into `folder`."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    cfg = flux_configs(tiny)
    clip_tok, t5_tok = tokenizers()
    torch.manual_seed(0)
    with _DefaultDtype(torch.bfloat16), torch.device(device):
        transformer = FluxTransformer2DModel(**cfg["transformer"])
        clip = CLIPTextModel(CLIPTextConfig(**cfg["clip"]))
        t5 = T5EncoderModel(T5Config(**cfg["t5"]))
        vae = AutoencoderKL(**cfg["vae"], shift_factor=0.1159, scaling_factor=0.3611)  # FLUX.1-dev's latent scaling
    pipe = FluxPipeline(FlowMatchEulerDiscreteScheduler(shift=3.0), vae, clip, clip_tok, t5, t5_tok, transformer)
    pipe.save_pretrained(folder)


@torch.no_grad()
def build_wan(folder: Path, tiny: bool, device, size: dict) -> None:
    """Save a WanPipeline (Wan2.1 text-to-video) with random weights into `folder`."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    cfg = wan_configs(tiny)
    _, tokenizer = tokenizers()
    torch.manual_seed(0)
    with _DefaultDtype(torch.bfloat16), torch.device(device):
        transformer = WanTransformer3DModel(**cfg["transformer"])
        text_encoder = UMT5EncoderModel(UMT5Config(**cfg["umt5"]))
    vae = AutoencoderKLWan(**cfg["vae"]).to(device)  # fp32, as the scripts decode (common.models.WanModel)
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )  # fmt: skip
    pipe.save_pretrained(folder)


@torch.no_grad()
def build_qwen_image(folder: Path, tiny: bool, device, size: dict) -> None:
    """Save a QwenImagePipeline with random weights into `folder`: memory.py's published configs (the 20.4B
    transformer, Qwen2.5-VL-7B with its vision tower, the VAE), Qwen-Image's scheduler, tests/tiny.py's byte-level
    tokenizer with the chat markers (the pipeline's template is then more tokens than the real one's 34, and so is
    each prompt). --tiny: tests/tiny.py's build_qwen."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from benchmarks import memory
    from tests import tiny as tiny_models

    if tiny:
        return tiny_models.build_qwen(folder)
    torch.manual_seed(0)
    with _DefaultDtype(torch.bfloat16), torch.device(device):
        transformer = QwenImageTransformer2DModel(**memory.QWEN_IMAGE)
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**memory.QWEN25_VL_7B))
        vae = AutoencoderKLQwenImage(**memory.VAE_QWEN)
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0, shift_terminal=0.02,
        use_dynamic_shifting=True, time_shift_type="exponential",
    )  # fmt: skip
    QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tiny_models.qwen_tokenizer(),
        transformer=transformer,
    ).save_pretrained(folder)  # fmt: skip


@torch.no_grad()
def build_flux2_klein(folder: Path, tiny: bool, device, size: dict) -> None:
    """Save a Flux2KleinPipeline (FLUX.2 [klein] base 4B: CFG with "") with random weights into `folder`: memory.py's
    published configs (the 3.9B transformer, Qwen3-4B, the FLUX.2 VAE), tests/tiny.py's byte-level tokenizer with
    Qwen3's chat template. --tiny: tests/tiny.py's build_flux2_klein."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from benchmarks import memory
    from tests import tiny as tiny_models

    if tiny:
        return tiny_models.build_flux2_klein(folder)
    torch.manual_seed(0)
    with _DefaultDtype(torch.bfloat16), torch.device(device):
        transformer = Flux2Transformer2DModel(**memory.FLUX2_KLEIN_4B)
        text_encoder = Qwen3ForCausalLM(Qwen3Config(**memory.QWEN3_4B))
        vae = AutoencoderKLFlux2(**memory.VAE_FLUX2)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential")
    Flux2KleinPipeline(
        text_encoder=text_encoder, tokenizer=tiny_models.qwen_tokenizer(), is_distilled=False,
        transformer=transformer, vae=vae, scheduler=scheduler,
    ).save_pretrained(folder)  # fmt: skip


@torch.no_grad()
def build_wan22_5b(folder: Path, tiny: bool, device, size: dict) -> None:
    """Save a WanPipeline of Wan2.2-TI2V-5B (one timestep per token: expand_timesteps) with random weights into
    `folder`: memory.py's published configs (the 5.0B transformer, UMT5-XXL, the Wan2.2 VAE in fp32), shift 5.
    --tiny: tests/tiny.py's build_wan22_5b."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from benchmarks import memory

    if tiny:
        from tests.tiny import build_wan22_5b as build_tiny

        return build_tiny(folder)
    _, tokenizer = tokenizers()
    torch.manual_seed(0)
    with _DefaultDtype(torch.bfloat16), torch.device(device):
        transformer = WanTransformer3DModel(**memory.WAN22_TI2V_5B)
        text_encoder = UMT5EncoderModel(UMT5Config(**memory.UMT5_XXL))
    vae = AutoencoderKLWan(**memory.VAE_WAN22).to(device)  # fp32, as the scripts decode
    WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), expand_timesteps=True,
    ).save_pretrained(folder)  # fmt: skip


BUILDERS = {
    "flux": build_flux, "wan": build_wan, "qwen-image": build_qwen_image, "flux2-klein": build_flux2_klein,
    "wan22-5b": build_wan22_5b,
}  # fmt: skip


def build_hps(path: Path, arch: str, device) -> None:
    """An HPSv2.1 checkpoint ({'state_dict': ...}, as HPS_v2.1_compressed.pt) of open_clip `arch` with random weights."""
    import open_clip

    torch.manual_seed(0)
    with torch.device(device):  # initialised on the GPU: seconds on the CPU
        model = open_clip.create_model(arch, pretrained=None)
    torch.save({"state_dict": model.state_dict()}, path)


def register_tiny_hps(folder: Path) -> None:
    """Register open_clip config 'tiny-hps' (memory.TINY_FLUX's reward, tests/tiny.py's TINY_HPS) from `folder`,
    writing it there first if it is not there."""
    import open_clip

    from benchmarks import memory

    folder.mkdir(parents=True, exist_ok=True)
    config = folder / f"{TINY_HPS}.json"
    if not config.is_file():
        config.write_text(json.dumps(memory.TINY_FLUX["reward"]))
    open_clip.add_model_config(folder)


def build_reward_checkpoint(out: Path, tiny: bool, device) -> None:
    """{out}/hps.pt, which every script loads with --reward-ckpt hpsv2.1=...: ViT-H-14 (HPSv2.1's architecture), or in
    --tiny mode 'tiny-hps', registered from {out}/open_clip (the scripts' processes register it from there too)."""
    if tiny:
        register_tiny_hps(out / "open_clip")
    build_hps(out / "hps.pt", TINY_HPS if tiny else "ViT-H-14", device)


def run_with_tiny_hps(config_folder: str, argv: list[str]) -> None:
    """--tiny's script processes: `python gpu_check.py --run-with-tiny-hps FOLDER gpu_timing.py ...` registers the
    'tiny-hps' open_clip config and makes the hpsv2.1 reward build it (as the tests do with
    tests/tiny.py's use_tiny_hps), then runs gpu_timing.py as `python gpu_timing.py ...` would; the checkpoint is read
    from --reward-ckpt as on the GPU."""
    import runpy

    from common import rewards

    register_tiny_hps(Path(config_folder))
    kind = rewards.REWARDS["hpsv2.1"]
    rewards.REWARDS["hpsv2.1"] = dataclasses.replace(kind, factory=functools.partial(kind.factory, arch=TINY_HPS))
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


# ---------------------------------------------------------------------------------------------------
# The cases and their runs
# ---------------------------------------------------------------------------------------------------
# Sizes: FLUX at 512 px; Wan2.1 at its native 480 x 832 (no --resolution) with 9 frames (latents (16, 3, 60, 104))
SIZES = {
    ("flux", False): {"resolution": 512},
    ("flux", True): {"resolution": 64},
    ("wan", False): {"height": 480, "width": 832, "frames": 9},
    ("wan", True): {"height": 32, "width": 32, "frames": 5},
    # --models: the images at 512 px (CFG 4, the pipelines' default); Wan2.2-TI2V-5B square at its native 704 px
    # height (--resolution is a side; the scripts' Wan default is Wan2.1's 480 x 832), 9 frames (latents (48, 3, 44,
    # 44)); --tiny: tests/tiny.py's sizes
    ("qwen-image", False): {"resolution": 512},
    ("qwen-image", True): {"resolution": 32},
    ("flux2-klein", False): {"resolution": 512},
    ("flux2-klein", True): {"resolution": 32},
    ("wan22-5b", False): {"height": 704, "width": 704, "frames": 9},
    ("wan22-5b", True): {"height": 64, "width": 64, "frames": 5},
}
NAMES = {  # case: (the model, its tiny stand-in)
    "flux": ("FLUX.1-dev", "tiny FLUX"), "wan": ("Wan2.1-T2V-1.3B", "tiny Wan2.1"),
    "qwen-image": ("Qwen-Image", "tiny Qwen-Image"), "flux2-klein": ("FLUX.2 [klein] base 4B", "tiny FLUX.2 [klein]"),
    "wan22-5b": ("Wan2.2-TI2V-5B", "tiny Wan2.2-TI2V-5B"),
}  # fmt: skip


def describe(case: str, size: dict, tiny: bool) -> str:
    what = NAMES[case][tiny]
    if case == "flux":
        return f"{what}, {size['resolution']} px"
    if "frames" not in size:
        return f"{what}, {size['resolution']} px, CFG 4"
    return f"{what} video, {size['height']}x{size['width']} px x {size['frames']} frames, CFG 5"


def case_flags(case: str, tiny: bool, out: Path) -> list[str]:
    """The flags a case's scripts share: the model, its size, guidance and reward (HPSv2.1 with random weights from
    {out}/hps.pt: full size, its architecture ViT-H-14; tiny, 'tiny-hps', which run_with_tiny_hps registers)."""
    size = SIZES[case, tiny]
    if case == "flux":
        own = ["--resolution", str(size["resolution"]), "--guidance-scale", "3.5", "--reward", "hpsv2.1"]
    elif case in ("qwen-image", "flux2-klein"):  # true CFG (Qwen-Image with " ", FLUX.2 [klein] base with "")
        own = ["--resolution", str(size["resolution"]), "--guidance-scale", "4", "--reward", "hpsv2.1"]
    else:  # the wan recipes' reward, guidance and shift (Wan2.2-TI2V-5B: square, its scheduler's shift 5)
        full_size_native = case == "wan" and not tiny  # Wan2.1's native 480 x 832: no --resolution
        resolution = [] if full_size_native else ["--resolution", str(size["height"])]
        own = [
            *resolution, "--num-frames", str(size["frames"]), "--reward-frames", "4", "--guidance-scale", "5",
            "--shift", "5" if case == "wan22-5b" else "3", "--reward", "hpsv2.1,temporal:0.5",
        ]  # fmt: skip
    return [
        "--model-id", str(out / FOLDER[case]), "--mixed-precision", "bf16", "--gradient-checkpointing",
        "--offload-frozen",
        "--lora", "--lora-rank", str(LORA_RANK), "--lora-alpha", str(LORA_ALPHA), "--prompts", str(out / "prompts.txt"),
        "--eval-prompts", str(out / "prompts.txt"), "--iterations", "2", "--eval-every", "0", "--sample-every", "0",
        "--weight-decay", "0", "--lr-warmup", "0", *own, "--reward-ckpt", f"hpsv2.1={out / 'hps.pt'}",
    ]  # fmt: skip


def script_flags(case: str, tiny: bool) -> dict[str, list[str]]:
    """Each script's own flags in a case: the recipes' settings with small batches and few steps. A --models case
    runs dancegrpo.py with its modality's flags (the flux case's for an image, the wan case's for a video)."""
    if case in MODELS:
        return {"dancegrpo.py": script_flags("wan" if case == "wan22-5b" else "flux", tiny)["dancegrpo.py"]}
    if case == "flux":
        steps = ["--num-steps", "4" if tiny else "8"]
        return {
            "dancegrpo.py": [*steps, "--sde-type", "dance", "--noise-level", "0.3", "--samples-per-device", "4",
                             "--group-size", "4", "--rollout-batch-size", "1", "--samples-per-update", "4",
                             "--same-noise", "--clip-range", "1e-4", "--kl-beta", "0"],
            "branchgrpo.py": ["--pruning", "depth", "--num-steps", "6" if tiny else "10", "--sde-type", "dance",
                              "--split-schedule", "dense", "--num-splits", "2", "--branch-factor", "2",
                              "--trees-per-device", "1", "--trees-per-update", "1", "--window", "4",
                              "--rollout-batch-size", "4", "--clip-range", "1e-4", "--kl-beta", "0"],
            "vgrpo.py": [*steps, "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "1",
                         "--train-batch-size", "1", "--samples-per-update", "4", "--n-mc", "4", "--clip-range", "6e-3",
                         "--kl-beta", "0"],
            # Flow-Factory's NFT setting (run.sh's diffusionnft-flux-8gpu): 2 of 8 grid timesteps trained per image
            "diffusionnft.py": [*steps, "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "1",
                                "--train-batch-size", "1", "--samples-per-update", "4", "--timestep-fraction", "0.25",
                                "--kl-beta", "0"],
        }  # fmt: skip
    # Wan: the recipes' micro-batch (4 videos, CFG: 8 rows), 4 videos or one tree of 4 leaves per iteration
    return {
        "dancegrpo.py": ["--num-steps", "4" if tiny else "8", "--sde-type", "dance", "--noise-level", "0.3",
                         "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4",
                         "--samples-per-update", "4", "--clip-range", "1e-3", "--kl-beta", "0"],
        "branchgrpo.py": ["--pruning", "depth", "--num-steps", "6" if tiny else "10", "--sde-type", "dance",
                          "--noise-level", "0.3", "--split-schedule", "dense", "--num-splits", "2",
                          "--branch-factor", "2", "--trees-per-device", "1", "--trees-per-update", "1", "--window",
                          "4", "--rollout-batch-size", "4", "--clip-range", "1e-3", "--kl-beta", "0"],
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# FLOPs: counted on the denoiser as the scripts train it, and expected by hand
# ---------------------------------------------------------------------------------------------------
def tiny_config(case: str) -> dict:
    """memory.estimate's model_config of the case's tiny model: memory.TINY_FLUX, TINY_WAN, TINY_QWEN (tests/tiny.py's
    build_qwen), and tests/tiny.py's build_wan22_5b and build_flux2_klein as memory.py's classes take them."""
    from benchmarks import memory

    if case in ("flux", "wan", "qwen-image"):
        return {"flux": memory.TINY_FLUX, "wan": memory.TINY_WAN, "qwen-image": memory.TINY_QWEN}[case]
    if case == "wan22-5b":
        return {
            **memory.TINY_WAN, "denoiser": {**memory.TINY_WAN["denoiser"], "in_channels": 48, "out_channels": 48},
            "vae": dict(base_dim=8, decoder_base_dim=8, num_res_blocks=1),
        }  # fmt: skip
    qwen3 = dict(memory.QWEN3_4B, vocab_size=259, hidden_size=16, intermediate_size=32, num_hidden_layers=27,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=False)  # fmt: skip
    return {
        "denoiser": dict(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                         joint_attention_dim=48, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4)),
        "text": [("qwen3", qwen3, 512)],
        "vae": dict(block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4,
                    down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2),
        "reward": memory.TINY_FLUX["reward"],
    }  # fmt: skip


def model_parts(case: str, tiny: bool) -> dict:
    """benchmarks/memory.py's parts of the case's model (as estimate() merges a model_config into MODELS)."""
    from benchmarks import memory

    parts = dict(memory.MODELS[KIND[case]])
    for name, value in (tiny_config(case) if tiny else {}).items():
        parts[name] = {**parts[name], **value} if name in ("denoiser", "vae") else value
    return parts


def model_shapes(case: str, tiny: bool):
    """memory.Shapes of one sample of the case (FLUX: packed latent tokens; Wan: (16, F', h, w))."""
    from benchmarks import memory

    size, kind = SIZES[case, tiny], KIND[case]
    if "frames" not in size:
        return memory.Shapes.of(kind, model_parts(case, tiny), size["resolution"])
    return memory.Shapes.of(kind, model_parts(case, tiny), (size["height"], size["width"]), size["frames"])


def count_flops(case: str, tiny: bool, device="meta") -> dict[str, float]:
    """FLOPs of one row (one image or video; no CFG), counted by torch.utils.flop_counter.FlopCounterMode on the
    case's denoiser at the real shapes, called as the scripts call it (memory.denoise):
      forward_base   one forward of the model without the adapter
      forward        one forward with the LoRA adapter (r128, as the scripts' rollout runs it)
      train          that forward + its backward, the model as common.models.trainable_denoiser prepares it (the
                     LoRA adapter trainable, the frozen base computing the gradients of its inputs only)
    On the meta device (the default) nothing is computed or allocated. Attention runs its math path (matmuls that
    FlopCounterMode counts on every device: its CPU flash kernel is not counted), and gradient checkpointing is off
    (its recomputed forwards are not model FLOPs)."""
    import logging

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks import memory
    from common.models import Flux2Model, trainable_denoiser

    parts, shapes = model_parts(case, tiny), model_shapes(case, tiny)
    quiet = logging.getLogger("diffusers")  # not "modules that should be kept in float32": none are, here
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with torch.device(device), sdpa_kernel(SDPBackend.MATH):
            torch.manual_seed(0)
            module = memory.build_denoiser(KIND[case], parts["denoiser"], torch.bfloat16).requires_grad_(False)
            x = torch.randn(1, *shapes.latent)
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                memory.denoise(shapes, module, x)
            base = float(counter.get_total_flops())
            args = types.SimpleNamespace(
                lora=True, lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA, gradient_checkpointing=False
            )
            holder = types.SimpleNamespace(kind=KIND[case], unet=module, transformer=module)
            if KIND[case] == "flux2":  # its adapter also covers the single blocks' fused Linears
                holder.lora_targets = Flux2Model.lora_targets
            module = trainable_denoiser(holder, args)
            with FlopCounterMode(display=False) as counter:
                y = memory.denoise(shapes, module, x)
                forward = float(counter.get_total_flops())  # the same operations as without gradients
                y.square().mean().backward()
            train = float(counter.get_total_flops())
    finally:
        quiet.setLevel(level)
    return {"forward_base": base, "forward": forward, "train": train}


def expected_flops(case: str, tiny: bool) -> dict[str, float]:
    """One row's forward by hand, from the configs: 2 FLOPs a multiply-add of every projection on every token
    (embedders, attention's q, k, v, out, the MLP, the output layer) and attention's two matmuls (4 n^2 d a layer,
    n tokens, width d); the per-sample vectors (time, guidance and pooled embeddings, the AdaLN modulation) are left
    out (under 0.1% at full size). "lora": what the adapter adds, 4 n r d for each adapted d x d projection on n
    tokens (r: the rank; common.models.LORA_TARGETS, attention's projections). "forward" = "forward_base" + "lora"."""
    den, shapes, r = model_parts(case, tiny)["denoiser"], model_shapes(case, tiny), LORA_RANK
    d = den["num_attention_heads"] * den["attention_head_dim"]
    n_txt, d_txt = shapes.cond["prompt_embeds"]
    kind = KIND[case]
    if kind in ("flux", "qwen"):  # joint attention on image and text tokens; every block, double or single, 24 n d^2
        n_img, c_in = shapes.latent
        n, f, p = n_img + n_txt, 4 * d, den["patch_size"]
        layers = den["num_layers"] + den.get("num_single_layers", 0)  # Qwen-Image: double-stream blocks only
        c_out = p * p * (den.get("out_channels") or c_in)
        base = 2 * n_img * c_in * d + 2 * n_txt * d_txt * d + 2 * n_img * d * c_out
        base += layers * (2 * n * (4 * d * d + 2 * d * f) + 4 * n * n * d)
        # double blocks: q, k, v, out of both streams (4 a token); single blocks: q, k, v (3 a token)
        lora = 4 * r * d * n * (4 * den["num_layers"] + 3 * den.get("num_single_layers", 0))
    elif kind == "flux2":  # FLUX.2: a SwiGLU MLP of 3d; every block, double or single, 26 n d^2 (13 d^2 a token)
        n_img, c_in = shapes.latent
        n = n_img + n_txt
        base = 2 * n_img * c_in * d + 2 * n_txt * d_txt * d + 2 * n_img * d * c_in
        base += (den["num_layers"] + den["num_single_layers"]) * (2 * n * 13 * d * d + 4 * n * n * d)
        # double blocks: q, k, v, out of both streams; single blocks: the fused d -> 3d + 6d and 4d -> d Linears
        lora = 4 * r * d * n * 4 * den["num_layers"] + 2 * r * n * (10 * d + 5 * d) * den["num_single_layers"]
    else:  # Wan2.1: self-attention over the video's patches, cross-attention to the text, a d -> ffn -> d MLP
        c, frames, h, w = shapes.latent
        pt, ph, pw = den["patch_size"]
        n, f, patch = (frames // pt) * (h // ph) * (w // pw), den["ffn_dim"], pt * ph * pw
        base = 2 * n * c * patch * d + 2 * n_txt * (d_txt + d) * d + 2 * n * d * den["out_channels"] * patch
        block = 2 * n * (6 * d * d + 2 * d * f) + 2 * n_txt * 2 * d * d + 4 * n * n * d + 4 * n * n_txt * d
        base += den["num_layers"] * block
        if kind == "wan22":  # one timestep per token: its embedding (freq -> d -> d) and modulation (d -> 6d) too
            base += 2 * n * (den["freq_dim"] * d + d * d + 6 * d * d)
        lora = 4 * r * d * den["num_layers"] * (6 * n + 2 * n_txt)  # self: q, k, v, out; cross: q, out and k, v
    return {"forward_base": float(base), "lora": float(lora), "forward": float(base + lora)}


def flops_key(case: str, tiny: bool) -> dict:
    """What a count depends on, as JSON reads it back: a prepared count (--plan) is used only if this matches."""
    key = {"denoiser": model_parts(case, tiny)["denoiser"], "size": SIZES[case, tiny], "lora": [LORA_RANK, LORA_ALPHA]}
    return json.loads(json.dumps(key))


def flops_entry(case: str, tiny: bool) -> dict:
    """A case's FLOPs per row (count_flops on the meta device, expected_flops), with its key, as --plan keeps it."""
    return {"key": flops_key(case, tiny), "counted": count_flops(case, tiny), "expected": expected_flops(case, tiny)}


DISK_GB = {("flux", False): 34.0, ("wan", False): 15.0, ("flux", True): 0.1, ("wan", True): 0.1}  # saved folders
# --models, in bf16 as built (the Wan2.2 VAE in fp32): Qwen-Image 20.43B + Qwen2.5-VL-7B 8.29B + VAE 0.13B; FLUX.2
# [klein] 3.88B + Qwen3-4B 4.02B + VAE 0.08B; Wan2.2-TI2V-5B 5.00B + UMT5-XXL 5.68B + VAE 0.71B (2.8 GB)
DISK_GB |= {("qwen-image", False): 58.0, ("flux2-klein", False): 16.0, ("wan22-5b", False): 25.0}
DISK_GB |= {(case, True): 0.1 for case in MODELS}
HPS_GB = 3.94  # the random-weight HPSv2.1 checkpoint (fp32 ViT-H-14)
# Seconds a build needs (docs/gpu.md's budget, its upper end; --tiny: a few), and the least a script's run needs to be
# worth starting: a build is started only if it and one script fit in the time left, a script only if it fits
BUILD_S = {
    ("reward", False): 15, ("flux", False): 90, ("wan", False): 30,
    ("reward", True): 5, ("flux", True): 5, ("wan", True): 5,
    # --models: planned from the flux and wan builds (about 1.7 s a GB written), not measured yet
    ("qwen-image", False): 150, ("flux2-klein", False): 45, ("wan22-5b", False): 60,
    ("qwen-image", True): 5, ("flux2-klein", True): 5, ("wan22-5b", True): 5,
}  # fmt: skip
MIN_SCRIPT_S = {False: 30, True: 10}


def plan(cases, tiny: bool, say=print) -> dict:
    """memory.py's per-GPU plan (GB) of every (case, script), keyed so that a plan made for other flags is refused."""
    from benchmarks import memory

    out = {}
    for case in cases:
        config = tiny_config(case) if tiny else None
        for script, own in script_flags(case, tiny).items():
            flags = case_flags(case, tiny, Path("OUT")) + own  # --model-id OUT/<FOLDER>: the kind by its name
            gb = memory.estimate(script, flags, model_config=config)["peak"]
            out[f"{case}/{script}"] = {"flags": flags, "estimate_gb": gb}
            say(f"planned {case} {script}: {gb:.3g} GB")
    return out


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


def first_lines(text: str, n: int = 6, width: int = 300) -> str:
    """The first `n` non-empty lines of `text`, each cut to `width` characters."""
    return "\n".join([line[:width] for line in str(text).strip().splitlines() if line.strip()][:n])


def error_in_log(text: str) -> tuple[str | None, str]:
    """(type, message) of what a script's log ends with: the exception that ends its last traceback, or else its last
    'error: ...' line (the scripts' refusal of an input); (None, "") when neither."""
    lines = text.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if starts:
        after = lines[starts[-1] + 1 :]
        at = next((i for i, line in enumerate(after) if line and not line[0].isspace()), None)
        if at is not None:
            name, sep, message = after[at].partition(":")
            if sep and re.fullmatch(r"[A-Za-z_][\w.]*", name):
                return name, first_lines("\n".join([message.strip(), *after[at + 1 :]]))
            return after[at][:300], first_lines("\n".join(after[at + 1 :]))
    errors = [line for line in lines if line.startswith("error:")]
    return ("error", errors[-1][len("error:") :].strip()[:300]) if errors else (None, "")


def run_script(script, flags, out: Path, limit_s: float, exp_name: str, tiny_hps: Path | None = None) -> dict:
    """One 2-iteration run under benchmarks/gpu_timing.py, its output in {out}/logs/{exp_name}.log (tiny_hps: the
    folder of the 'tiny-hps' config, for --tiny's reward: the run goes through run_with_tiny_hps). A failure or a
    time-out is returned with the end of the log and the exception it ends with; the process group is killed when
    the run ends early, whatever ends it (a SIGTERM of the check too)."""
    from common.logs import read_metrics

    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    log, timings = logs / f"{exp_name}.log", logs / f"{exp_name}.timings.json"
    cmd = [sys.executable]
    if tiny_hps is not None:
        cmd += [str(Path(__file__).resolve()), RUN_WITH_TINY_HPS, str(tiny_hps)]
    cmd += [str(ROOT / "benchmarks" / "gpu_timing.py"), str(timings), script, *flags]
    cmd += ["--output-dir", str(out / "runs"), "--exp-name", exp_name, "--no-save"]  # no checkpoint, no final weights
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = "ok" if proc.wait(timeout=max(limit_s, 1)) == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit_s:.0f} s"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the script and anything it started
                proc.wait()
    r = {"status": status, "wall_s": time.perf_counter() - t0, "log": str(log)}
    runs = sorted((out / "runs").glob(f"{exp_name}__*"))
    train = [m for m in read_metrics(runs[-1]) if "perf/iteration_s" in m] if runs else []
    if status != "ok" or not train:
        text = log.read_text(errors="replace")
        r["log_tail"] = text[-3000:]
        kind, message = error_in_log(text)
        r["error"] = {"type": kind or status, "message": message or first_lines(text[-600:], n=4)}
        if status == "ok":
            r["status"] = "failed (no iteration logged)"
        return r
    last = train[-1]  # the second iteration: the first one also warms up kernels and caches
    r |= {
        "iterations": len(train),
        "iteration_s": last["perf/iteration_s"],
        "sampling_s": last["perf/sampling_s"],
        "peak_gb": max(m["perf/peak_mem_gb"] for m in train),
        "rewards": {k: v for k, v in last.items() if k.startswith("rewards/")},
    }
    if timings.is_file():
        t = json.loads(timings.read_text())[-1]
        r |= {k: t[k] for k in ("nograd_rows", "nograd_s", "grad_rows", "grad_s", "backward_s")}
    for run_dir in runs:  # its logs and sample grids, if any: the next runs need the disk
        shutil.rmtree(run_dir, ignore_errors=True)
    return r


def add_rates(r: dict, flops: dict | None, peak: float | None) -> None:
    """TFLOP/s of the no-grad forwards (the rollout: rows x one forward with the adapter) and of the training step
    (forwards with gradients + backward: rows x one counted forward + backward), and their MFU against the measured
    matmul peak. No FLOP count (it failed): no rates."""
    if "nograd_s" not in r or not flops:
        return
    r["rollout_tflops"] = r["nograd_rows"] * flops["forward"] / max(r["nograd_s"], 1e-9) / 1e12
    r["train_tflops"] = r["grad_rows"] * flops["train"] / max(r["grad_s"] + r["backward_s"], 1e-9) / 1e12
    for what in ("rollout", "train"):
        r[f"{what}_mfu"] = r[f"{what}_tflops"] / peak if peak else None


def pct(x) -> str:
    return f"{x:.0%}" if x is not None else "n/a"


def gb(x) -> str:
    return f"{x:.3g}" if x is not None else "n/a"


def table(results: dict, cases) -> str:
    """Markdown: the status, the FLOPs of each case, one line per case and script, and what failed or was skipped."""
    measured, datasheet = results.get("peak_tflops_measured"), results.get("peak_tflops_datasheet")
    rows = [
        "| case | script | status | s / iteration | sampling s | peak memory (GB) | plan (GB) | no-grad forwards: "
        "TFLOP/s, MFU | training step: TFLOP/s, MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    counts = []
    for case in cases:
        c = results.get(case, {})
        setting = c.get("setting", case)
        if "forward_tflop" in c:
            counts.append(
                f"- {setting}: one row's forward {c['forward_tflop']:.4g} TFLOP counted (expected "
                f"{c['forward_expected_tflop']:.4g}; without LoRA {c['forward_base_tflop']:.4g}), forward + backward "
                f"{c['train_tflop']:.4g} TFLOP ({c['train_tflop'] / c['forward_tflop']:.2f}x the forward)"
            )
        if c.get("build", {}).get("status", "ok") != "ok":
            rows.append(f"| {setting} | (build) | {c['build']['status']} | | | | | | |")
        for script, r in c.get("scripts", {}).items():
            if "iteration_s" not in r:
                rows.append(f"| {setting} | {script} | {r['status']} | | | | {gb(r.get('estimate_gb'))} | | |")
                continue
            rates = [
                f"{r[f'{w}_tflops']:.3g}, {pct(r[f'{w}_mfu'])}" if f"{w}_tflops" in r else "n/a"
                for w in ("rollout", "train")
            ]
            rows.append(
                f"| {setting} | {script} | {r['status']} | {r['iteration_s']:.1f} | {r['sampling_s']:.1f} | "
                f"{r['peak_gb']:.3g} | {gb(r.get('estimate_gb'))} | {rates[0]} | {rates[1]} |"
            )
    peaks = (
        f"MFU against the measured bf16 matmul peak {measured:.0f} TFLOP/s"
        + (f" (datasheet {datasheet:.0f}: multiply the MFU by {measured / datasheet:.2f})" if datasheet else "")
        if measured
        else "no GPU: no MFU"
    )
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in results.get("phases_s", {}).items())
    failures = [
        f"- {f['case']}: {f['type']}" + (": " + f["message"].replace("\n", " / ") if f.get("message") else "")
        for f in results.get("failures", [])
    ]
    return (
        f"{results['device']}, LoRA r{LORA_RANK}, bf16, gradient checkpointing, --offload-frozen; {peaks}\n"
        f"status: {results['status']}\n"
        f"time per phase: {phases}\n"
        + (
            "FLOPs per row (torch.utils.flop_counter, the LoRA-wrapped denoiser):\n" + "\n".join(counts) + "\n"
            if counts
            else ""
        )
        + "\n"
        + "\n".join(rows)
        + ("\n\nfailures:\n" + "\n".join(failures) if failures else "")
    )


# ---------------------------------------------------------------------------------------------------
# The check: every step caught and recorded, the results written from the start
# ---------------------------------------------------------------------------------------------------
class Stopped(BaseException):
    """A SIGTERM (gpu_check.sh's outer limit) or SIGINT: recorded, then the check ends (not caught as a failure)."""


class OutOfTime(Exception):
    """A build still running when the check's time was up (SIGALRM)."""


def on_signal(signum, frame):
    raise Stopped(f"stopped by {signal.Signals(signum).name}")


def on_alarm(signum, frame):
    raise OutOfTime("the check's time limit (--limit-s) was reached during this step")


class Check:
    """The results of one check (gpu_check.json, gpu_check.md and gpu_check.log, every line printed), written to --out
    and --results (each written to on its own: one that cannot be written does not stop the other)."""

    def __init__(self, out: Path, results_dir: Path | None, cases: list[str], tiny: bool, device_name: str):
        self.out, self.tiny, self.cases = out, tiny, cases
        same = results_dir is not None and results_dir.resolve() == out.resolve()
        self.dests = [out] + ([results_dir] if results_dir and not same else [])
        self.results = {"device": device_name, "cases": cases, "status": "running", "phases_s": {}, "failures": []}
        self.deadline = float("inf")
        for dest in self.dests:
            self._write(dest, "gpu_check.log", "", "w")  # this check's lines only
        self.save()

    def _write(self, dest: Path, name: str, text: str, mode: str = "w") -> None:
        try:
            dest.mkdir(parents=True, exist_ok=True)
            with open(dest / name, mode) as f:
                f.write(text)
        except OSError as e:
            print(f"warning: cannot write {dest / name}: {e}", file=sys.stderr, flush=True)

    def say(self, line: str, err: bool = False) -> None:
        """Print a line (stderr with `err`) and add it to gpu_check.log."""
        print(line, file=sys.stderr if err else sys.stdout, flush=True)
        for dest in self.dests:
            self._write(dest, "gpu_check.log", line + "\n", "a")

    def save(self) -> None:
        """gpu_check.json and gpu_check.md in --out and --results, and the scripts' logs in --results."""
        text, md = json.dumps(self.results, indent=1), table(self.results, self.cases) + "\n"
        for dest in self.dests:
            self._write(dest, "gpu_check.json", text)
            self._write(dest, "gpu_check.md", md)
        logs = self.out / "logs"
        for dest in self.dests[1:]:
            for f in sorted(logs.glob("*.log")) if logs.is_dir() else []:
                try:
                    shutil.copy(f, dest / f.name)
                except OSError as e:
                    print(f"warning: cannot copy {f} to {dest}: {e}", file=sys.stderr, flush=True)

    def fail(self, step: str, kind: str, message: str, tail: str = "") -> dict:
        """Record a failure of `step` (its exception's type or the run's status, the first lines of the message)."""
        record = {"case": step, "type": kind, "message": first_lines(message)}
        if tail:
            record["tail"] = tail
        self.results["failures"].append(record)
        self.say(f"FAILED {step}: {kind}" + (f": {record['message']}" if record["message"] else ""), err=True)
        self.save()
        return record

    def stop(self, reason: str) -> None:
        """A failure before the clock: recorded and written, then the check ends."""
        self.fail("before the clock", "stopped", reason)
        self.results["status"] = f"stopped: {reason}"
        self.save()
        raise SystemExit(f"error: {reason}")

    def attempt(self, step: str, fn, *args, limit_s: float | None = None):
        """(fn(*args), None), or (None, the failure's record) when it raises: recorded with its type, message and the
        end of its traceback, and the check goes on. `limit_s`: a SIGALRM ends it (OutOfTime) after that long."""
        t = time.perf_counter()
        if limit_s is not None:
            previous = signal.signal(signal.SIGALRM, on_alarm)
            signal.setitimer(signal.ITIMER_REAL, max(limit_s, 0.01))
        try:
            return fn(*args), None
        except Exception as e:  # every failure is recorded; Stopped (a signal) is not an Exception and ends the check
            tail = "".join(traceback.format_exception(e)[-8:])[-2000:]
            return None, self.fail(step, type(e).__name__, str(e) or repr(e), tail)
        finally:
            if limit_s is not None:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            self.results["phases_s"][step] = time.perf_counter() - t
            gc.collect()  # what a failed build left (the traceback's frames are gone)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def time_for(self, what: str, need_s: float) -> str | None:
        """None when `need_s` seconds fit in the time left, else the reason to skip `what`."""
        left = self.deadline - time.perf_counter()
        return None if left >= need_s else f"skipped: {max(left, 0):.0f} s left, {what} needs {need_s:.0f} s"

    def left_s(self) -> float:
        return self.deadline - time.perf_counter()


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: the harness, not the figures")
    parser.add_argument("--out", default="/tmp/gpu_check", help="folder for the models, the runs and the results")
    parser.add_argument("--results", help="also write the results (table, JSON, console, logs) here, from the start")
    parser.add_argument("--limit-s", type=float, default=480, help="the whole check's time limit, after planning")
    parser.add_argument("--script-limit-s", type=float, default=180, help="time limit of one script's run")
    parser.add_argument(
        "--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}; or none (with --models)"
    )
    parser.add_argument(
        "--models", default="", help=f"comma-separated, of: {', '.join(MODELS)}: one case each, after --cases"
    )
    parser.add_argument("--plan", help="memory plans and FLOP counts made beforehand (--write-plan); default: here")
    parser.add_argument("--write-plan", help="only write the plans and FLOP counts to this file (--tiny: the tiny's)")
    a = parser.parse_args(argv)
    out, tiny = Path(a.out), a.tiny
    try:
        cases = chosen_cases(a.cases, a.models)
    except ValueError as e:
        parser.error(str(e))
    if a.write_plan:  # every case, --models' too: the prepared plan serves any choice
        every = CASES + MODELS
        data = plan(every, tiny) | {f"flops/{case}": flops_entry(case, tiny) for case in every}
        Path(a.write_plan).write_text(json.dumps(data, indent=1))
        return
    cuda = torch.cuda.is_available()
    name = "CPU" if tiny else torch.cuda.get_device_name() if cuda else "no CUDA GPU"
    check = Check(out, Path(a.results) if a.results else None, cases, tiny, name)
    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        run_check(check, a, cases, tiny)
    except Stopped as e:
        check.fail("the check", "Stopped", str(e))
        check.results["status"] = str(e)
        check.save()
        raise SystemExit(f"error: {e}") from None
    except Exception as e:  # a failure outside any step (a bug of the harness): recorded before it ends the check
        check.fail("the check", type(e).__name__, str(e), "".join(traceback.format_exception(e)[-8:])[-2000:])
        check.results["status"] = f"failed: {type(e).__name__}"
        check.save()
        raise
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def chosen_cases(cases: str, models: str) -> list[str]:
    """The cases to run, in order: --cases (of CASES, or "none"), then --models (of MODELS; "" is none). A bad value
    raises ValueError naming its flag, before anything runs."""
    chosen = []
    for flag, value, allowed in (("--cases", cases, CASES), ("--models", models, MODELS)):
        names = value.split(",") if value else []
        if flag == "--cases" and names == ["none"]:
            continue
        bad = [n for n in names if n not in allowed] or [n for i, n in enumerate(names) if n in names[:i]]
        if flag == "--cases" and not names:
            bad = ["''"]
        if bad:
            none = "; or none" if flag == "--cases" else ""
            raise ValueError(f"{flag} {value!r}: {bad[0]} is not one of {', '.join(allowed)} (comma-separated, each "
                             f"once{none})")  # fmt: skip
        chosen += names
    if not chosen:
        raise ValueError("--cases none and no --models: nothing to run")
    return chosen


def run_check(check: Check, a, cases: list[str], tiny: bool) -> None:
    out, results, say = check.out, check.results, check.say
    device = "cpu" if tiny else "cuda"
    if not tiny and not torch.cuda.is_available():
        check.stop("no CUDA GPU here; `--tiny` runs the harness on the CPU")

    # ---- before the clock: the memory plans, the FLOP counts and the disk
    if a.plan:
        try:
            plans = json.loads(Path(a.plan).read_text())
        except (OSError, ValueError) as e:
            check.stop(f"--plan {a.plan}: cannot be read ({type(e).__name__}: {e})")
        for case in cases:
            for script, own in script_flags(case, tiny).items():
                p = plans.get(f"{case}/{script}")
                if p is None or p["flags"] != case_flags(case, tiny, Path("OUT")) + own:
                    check.stop(f"--plan {a.plan} was made for other flags of {case} {script}; make it anew with "
                               "`bash benchmarks/gpu_check.sh --prepare`")  # fmt: skip
    else:
        plans, _ = check.attempt("memory plans", plan, cases, tiny, say)
        plans = plans or {}
    flops = {}
    for case in cases:
        entry = plans.get(f"flops/{case}")
        if entry is None or entry.get("key") != flops_key(case, tiny):
            entry, _ = check.attempt(f"{case}: FLOP count", flops_entry, case, tiny)
        flops[case] = entry
    need_gb = max(DISK_GB[c, tiny] for c in cases) + (0 if tiny else HPS_GB) + 1  # one case's model at a time
    free_gb = shutil.disk_usage(out).free / 1e9
    if free_gb < need_gb:
        check.stop(f"--out {out} has {free_gb:.1f} GB free; the check writes up to {need_gb:.0f} GB there (one model "
                   "folder at a time and the reward's checkpoint): pass a larger disk")  # fmt: skip
    for stale in ("runs", "logs"):
        shutil.rmtree(out / stale, ignore_errors=True)

    # ---- the clock starts
    t0 = time.perf_counter()
    check.deadline = t0 + a.limit_s
    if not tiny:
        results["peak_tflops_measured"], _ = check.attempt("peak", matmul_peak_tflops)
        name = results["device"]
        results["peak_tflops_datasheet"] = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    peak = results.get("peak_tflops_measured")

    (out / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    no_reward = None  # why the cases cannot run: no reward checkpoint
    if skip := check.time_for("the reward checkpoint and one script", BUILD_S["reward", tiny] + MIN_SCRIPT_S[tiny]):
        check.fail("reward checkpoint", "skipped", skip)
        no_reward = f"no reward checkpoint ({skip})"
    else:
        _, failure = check.attempt(
            "reward checkpoint", build_reward_checkpoint, out, tiny, device, limit_s=check.left_s()
        )
        no_reward = failure and f"no reward checkpoint (failed: {failure['type']})"
    check.save()
    for case in cases:
        run_case(check, a, case, tiny, device, plans, flops[case], peak, no_reward)

    results["total_s"] = time.perf_counter() - t0
    not_ok = [f["case"] for f in results["failures"]]
    results["status"] = "done" if not not_ok else f"done, not everything ran: {', '.join(not_ok)}"
    check.save()
    say(table(results, cases))
    say(f"total {results['total_s']:.0f} s; results in {out}/gpu_check.md" + (f" and {a.results}" if a.results else ""))
    failed = [f"{c} {s}" for c in cases for s, r in results[c]["scripts"].items() if r["status"] != "ok"]
    if failed:
        raise SystemExit(f"error: not every script ran: {', '.join(failed)}; failed or skipped: {', '.join(not_ok)} "
                         f"(logs in {out}/logs)")  # fmt: skip
    if not_ok:
        raise SystemExit(f"error: every script ran, but not every step: {', '.join(not_ok)}")


def run_case(check: Check, a, case: str, tiny: bool, device, plans, flops, peak, no_reward: str | None) -> None:
    """Build the case's model (if the time left allows it), then run each of its scripts (each if the time left
    allows it); every failure and every skip recorded. The model's folder is deleted afterwards, whatever happened."""
    out, results, say = check.out, check.results, check.say
    size = SIZES[case, tiny]
    setting = describe(case, size, tiny)
    c = results[case] = {"setting": setting, "build": {}, "scripts": {}}
    if flops:
        counted, expected = flops["counted"], flops["expected"]
        c |= {
            "forward_tflop": counted["forward"] / 1e12, "forward_base_tflop": counted["forward_base"] / 1e12,
            "train_tflop": counted["train"] / 1e12, "forward_expected_tflop": expected["forward"] / 1e12,
            "forward_base_expected_tflop": expected["forward_base"] / 1e12,
        }  # fmt: skip
        say(f"{setting}: one transformer forward of one row: forward_tflop {c['forward_tflop']:.4g} counted (expected "
            f"{c['forward_expected_tflop']:.4g}; without LoRA {c['forward_base_tflop']:.4g} counted, "
            f"{c['forward_base_expected_tflop']:.4g} expected); forward + backward {c['train_tflop']:.4g} TFLOP "
            f"({c['train_tflop'] / c['forward_tflop']:.2f}x the forward)")  # fmt: skip
    try:
        need = BUILD_S[case, tiny] + MIN_SCRIPT_S[tiny]
        skip = f"skipped: {no_reward}" if no_reward else check.time_for(f"the {case} build and one script", need)
        if skip:
            c["build"] = {"status": skip}
            check.fail(f"{case}: build", "skipped", skip)
        else:
            _, failure = check.attempt(
                f"{case}: build", BUILDERS[case], out / FOLDER[case], tiny, device, size, limit_s=check.left_s()
            )
            c["build"] = {"status": "ok" if failure is None else f"failed: {failure['type']}"}
            c["build_s"] = results["phases_s"][f"{case}: build"]
            if failure is None:
                say(f"built {setting} with random weights in {c['build_s']:.0f} s")
        for script, own in script_flags(case, tiny).items():
            step = f"{case}: {script}"
            estimate = plans.get(f"{case}/{script}", {}).get("estimate_gb")
            if c["build"]["status"] != "ok":
                r = {"status": f"skipped: no model ({case}: build {c['build']['status']})"}
            elif skip := check.time_for(script, MIN_SCRIPT_S[tiny]):
                r = {"status": skip}
                check.fail(step, "skipped", skip)
            else:
                limit = min(a.script_limit_s, check.left_s())
                flags = case_flags(case, tiny, out) + own
                hps = out / "open_clip" if tiny else None
                r, failure = check.attempt(step, run_script, script, flags, out, limit, f"{case}_{script[:-3]}", hps)
                if failure is not None:
                    r = {"status": f"failed: {failure['type']} in the harness"}
                elif r["status"] != "ok":
                    check.fail(step, r["error"]["type"], r["error"]["message"], r["log_tail"][-2000:])
            r["estimate_gb"] = estimate
            add_rates(r, flops and flops["counted"], peak)
            c["scripts"][script] = r
            check.save()
            if "iteration_s" in r:
                say(f"{case} {script}: {r['iteration_s']:.1f} s/it, peak {r['peak_gb']:.3g} GB (plan {gb(estimate)}), "
                    f"no-grad forwards {r.get('rollout_tflops', 0):.3g} TFLOP/s, training "
                    f"{r.get('train_tflops', 0):.3g} TFLOP/s ({r['wall_s']:.0f} s)")  # fmt: skip
            else:
                say(f"{case} {script}: {r['status']}" + (f"\n{r['log_tail']}" if "log_tail" in r else ""))
    finally:
        shutil.rmtree(out / FOLDER[case], ignore_errors=True)  # the next case's model needs the disk (DISK_GB)


if __name__ == "__main__":
    if sys.argv[1:2] == [RUN_WITH_TINY_HPS]:
        run_with_tiny_hps(sys.argv[2], sys.argv[3:])
    else:
        main()
