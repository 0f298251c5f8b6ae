"""The prepared GPU check: full-size models with random weights (built from their published configs; nothing is
downloaded), bf16, LoRA r128, gradient checkpointing and --offload-frozen as in run.sh's recipes, 2 iterations of each
script with small batches, in two cases:

  flux   FLUX.1-dev at 512 px: dancegrpo.py, branchgrpo.py --pruning depth and vgrpo.py (8 steps, 10 for the tree)
  wan    Wan2.1-T2V-1.3B video, 480 x 832 x 9 frames, CFG 5, reward hpsv2.1 on 4 frames + temporal:0.5 (the wan
         recipes' settings): dancegrpo.py (4 videos, rollout batch 4, 8 steps) and branchgrpo.py --pruning depth
         (one tree of 4 leaves, 10 steps)

For each script it prints seconds per iteration, the peak GPU memory (torch.cuda.max_memory_allocated, as the scripts
log it in perf/peak_mem_gb) next to benchmarks/memory.py's estimate for the same flags, and the rollout's model FLOP
utilisation.

    bash benchmarks/gpu_check.sh                  # one H100 / H200-class GPU: ~7 min, at most 8 (its own time limit)
    bash benchmarks/gpu_check.sh --cases wan      # one case only (a rerun that fits the time left)
    bash benchmarks/gpu_check.sh --tiny           # the same harness on tiny models, on the CPU (tests run it)

What it measures and what it does not:
- random weights give the real shapes, so memory and speed, not image or video quality or learning;
- the reward is an HPSv2.1 model (open_clip ViT-H-14) with random weights: the real one's size and cost;
- the rollout's FLOP utilisation = rollout transformer forwards (one image or video each; CFG's unconditional half
  counts as one more) x FLOPs of one forward (counted by torch.utils.flop_counter on the real model) /
  perf/sampling_s / the GPU's dense bf16 peak. perf/sampling_s also holds the prompt encoding and, with
  --offload-frozen, the text encoders' trips over PCIe: a lower bound;
- batches and step counts are smaller than the recipes' (4 samples or one 4-leaf tree per iteration, 8-10 steps;
  Wan: 9 frames where the recipes have 33), so the training phase's share of an iteration differs from a real run's.
Writes {--out}/gpu_check.json and gpu_check.md (the table docs/gpu.md quotes) after every script, so a run stopped by
the time limit keeps what finished. Each case's model folder is deleted after its scripts (FLUX.1-dev's is 34 GB).
In --tiny mode the peak memory is the process's resident set on the CPU, not comparable with the estimate: that mode
checks the harness, not the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.runs import read_metrics  # noqa: E402

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}  # dense bf16 tensor-core peak of the SXM parts (NVIDIA datasheets)
LETTERS = "abcdefghijklmnopqrstuvwxyz"
PROMPTS = [
    "a photo of an astronaut riding a horse on the moon",
    "a watercolor painting of a lighthouse at dawn",
    "an anime girl with silver hair in a rainy city",
    "concept art of a floating castle above the clouds",
]
CASES = ("flux", "wan")


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
def build_flux(folder: Path, tiny: bool, device, size: dict) -> float:
    """Save a FluxPipeline with random weights into `folder`; returns the FLOPs of one transformer forward of one
    image at size["resolution"] (counted on the model while it is in memory)."""
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
    flops = flux_forward_flops(pipe, size["resolution"])
    pipe.save_pretrained(folder)
    return flops


def flux_forward_flops(pipe, resolution: int) -> float:
    """FLOPs of one transformer forward of one image, counted by torch.utils.flop_counter (matmuls and attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    t = pipe.transformer
    scale = pipe.vae_scale_factor
    tokens = (resolution // scale // 2) ** 2
    dev, dt = t.device, t.dtype
    with FlopCounterMode(display=False) as counter:
        t(
            hidden_states=torch.zeros(1, tokens, t.config.in_channels, device=dev, dtype=dt),
            encoder_hidden_states=torch.zeros(1, 512, t.config.joint_attention_dim, device=dev, dtype=dt),
            pooled_projections=torch.zeros(1, t.config.pooled_projection_dim, device=dev, dtype=dt),
            timestep=torch.ones(1, device=dev, dtype=dt),
            guidance=torch.full((1,), 3.5, device=dev, dtype=dt),
            txt_ids=torch.zeros(512, 3, device=dev, dtype=dt),
            img_ids=torch.zeros(tokens, 3, device=dev, dtype=dt),
        )
    return float(counter.get_total_flops())


@torch.no_grad()
def build_wan(folder: Path, tiny: bool, device, size: dict) -> float:
    """Save a WanPipeline (Wan2.1 text-to-video) with random weights into `folder`; returns the FLOPs of one
    transformer forward of one video of size["height"] x size["width"] x size["frames"]."""
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
    flops = wan_forward_flops(pipe, size)
    pipe.save_pretrained(folder)
    return flops


def wan_forward_flops(pipe, size: dict) -> float:
    """FLOPs of one Wan transformer forward of one video (no CFG: one row), counted by torch.utils.flop_counter."""
    from torch.utils.flop_counter import FlopCounterMode

    t = pipe.transformer
    s, st = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    latent = (t.config.in_channels, (size["frames"] - 1) // st + 1, size["height"] // s, size["width"] // s)
    dev, dt = t.device, t.dtype
    with FlopCounterMode(display=False) as counter:
        t(
            hidden_states=torch.zeros(1, *latent, device=dev, dtype=dt),
            timestep=torch.ones(1, device=dev),
            encoder_hidden_states=torch.zeros(1, 512, t.config.text_dim, device=dev, dtype=dt),
        )
    return float(counter.get_total_flops())


def build_hps(path: Path, arch: str, device) -> None:
    """An HPSv2.1 checkpoint ({'state_dict': ...}, as HPS_v2.1_compressed.pt) of open_clip `arch` with random weights."""
    import open_clip

    torch.manual_seed(0)
    model = open_clip.create_model(arch, pretrained=None, device=device)
    torch.save({"state_dict": model.state_dict()}, path)


# ---------------------------------------------------------------------------------------------------
# The cases and their runs
# ---------------------------------------------------------------------------------------------------
# Sizes: FLUX at 512 px; Wan2.1 at its native 480 x 832 (no --resolution) with 9 frames (latents (16, 3, 60, 104))
SIZES = {
    ("flux", False): {"resolution": 512},
    ("flux", True): {"resolution": 64},
    ("wan", False): {"height": 480, "width": 832, "frames": 9},
    ("wan", True): {"height": 32, "width": 32, "frames": 5},
}


def describe(case: str, size: dict, tiny: bool) -> str:
    what = "tiny FLUX" if tiny else "FLUX.1-dev"
    if case == "flux":
        return f"{what}, {size['resolution']} px"
    what = "tiny Wan2.1" if tiny else "Wan2.1-T2V-1.3B"
    return f"{what} video, {size['height']}x{size['width']} px x {size['frames']} frames, CFG 5"


def case_flags(case: str, tiny: bool, out: Path) -> list[str]:
    """The flags a case's scripts share: the model, its size, guidance and reward (full size: HPSv2.1's architecture
    with random weights; tiny: jpeg, the scripts' processes have no tiny HPS architecture registered)."""
    size = SIZES[case, tiny]
    if case == "flux":
        reward = ["--reward", "jpeg"] if tiny else ["--reward", "hpsv2.1"]
        own = ["--resolution", str(size["resolution"]), "--guidance-scale", "3.5", *reward]
    else:  # the wan recipes' reward, guidance and shift
        reward = ["--reward", "jpeg,temporal:0.5"] if tiny else ["--reward", "hpsv2.1,temporal:0.5"]
        resolution = ["--resolution", str(size["height"])] if tiny else []  # full size: Wan2.1's native 480 x 832
        own = [
            *resolution, "--num-frames", str(size["frames"]), "--reward-frames", "4", "--guidance-scale", "5",
            "--shift", "3", *reward,
        ]  # fmt: skip
    if not tiny:
        own += ["--reward-ckpt", f"hpsv2.1={out / 'hps.pt'}"]
    return [
        "--model-id", str(out / case), "--mixed-precision", "bf16", "--gradient-checkpointing", "--offload-frozen",
        "--lora", "--lora-rank", "128", "--lora-alpha", "256", "--prompts", str(out / "prompts.txt"),
        "--eval-prompts", str(out / "prompts.txt"), "--iterations", "2", "--eval-every", "0", "--sample-every", "0",
        "--weight-decay", "0", "--lr-warmup", "0", *own,
    ]  # fmt: skip


def script_flags(case: str, tiny: bool) -> dict[str, list[str]]:
    """Each script's own flags in a case: the recipes' settings with small batches and few steps."""
    if case == "flux":
        steps = ["--num-steps", "4" if tiny else "8"]
        return {
            "dancegrpo.py": [*steps, "--sde-type", "dance", "--noise-level", "0.3", "--samples-per-device", "4",
                             "--group-size", "4", "--rollout-batch-size", "1", "--trajectories-per-update", "4",
                             "--same-noise", "--clip-range", "1e-4", "--kl-beta", "0"],
            "branchgrpo.py": ["--pruning", "depth", "--num-steps", "6" if tiny else "10", "--sde-type", "dance",
                              "--split-schedule", "dense", "--num-splits", "2", "--branch-factor", "2",
                              "--trees-per-device", "1", "--trees-per-update", "1", "--window", "4",
                              "--rollout-batch-size", "4", "--clip-range", "1e-4", "--kl-beta", "0"],
            "vgrpo.py": [*steps, "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "1",
                         "--train-batch-size", "1", "--images-per-update", "4", "--n-mc", "4", "--clip-range", "6e-3",
                         "--kl-beta", "0"],
        }  # fmt: skip
    # Wan: the recipes' micro-batch (4 videos, CFG: 8 rows), 4 videos or one tree of 4 leaves per iteration
    return {
        "dancegrpo.py": ["--num-steps", "4" if tiny else "8", "--sde-type", "dance", "--noise-level", "0.3",
                         "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4",
                         "--trajectories-per-update", "4", "--clip-range", "1e-3", "--kl-beta", "0"],
        "branchgrpo.py": ["--pruning", "depth", "--num-steps", "6" if tiny else "10", "--sde-type", "dance",
                          "--noise-level", "0.3", "--split-schedule", "dense", "--num-splits", "2",
                          "--branch-factor", "2", "--trees-per-device", "1", "--trees-per-update", "1", "--window",
                          "4", "--rollout-batch-size", "4", "--clip-range", "1e-3", "--kl-beta", "0"],
    }  # fmt: skip


def rollout_forwards(script: str, flags: list[str], cfg: bool) -> int:
    """Transformer forwards (one image or video each; with CFG its unconditional half is one more) of one
    iteration's rollout, from the script's own Args."""
    import tyro

    module = __import__(script[:-3])
    a = tyro.cli(module.Args, args=flags)
    if script == "branchgrpo.py":
        splits = module.split_steps(a.split_schedule, a.num_steps, a.num_splits)
        n = a.trees_per_device * module.tree_counts(a.num_steps, splits, a.branch_factor)[0]
    else:
        n = a.samples_per_device * a.num_steps  # Euler / DPM-Solver++(2M): one forward per step
    return n * (2 if cfg else 1)  # FLUX.1-dev's guidance is embedded: no CFG


def run_script(script, flags, out: Path, tiny: bool, limit_s: float, exp_name: str) -> dict:
    """One 2-iteration run; returns its metrics of the last iteration and the peak over both."""
    cmd = [sys.executable, str(ROOT / script), *flags, "--output-dir", str(out / "runs"), "--exp-name", exp_name]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit_s)
    if proc.returncode != 0:
        raise SystemExit(f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    run_dir = max((out / "runs").glob(f"{exp_name}__*"))
    rows = read_metrics(run_dir)
    train = [r for r in rows if "perf/iteration_s" in r]
    return {
        "wall_s": time.perf_counter() - t0,
        "iteration_s": train[-1]["perf/iteration_s"],  # the second: the first one also warms up kernels and caches
        "sampling_s": train[-1]["perf/sampling_s"],
        "peak_gb": max(r["perf/peak_mem_gb"] for r in train),
    }


def table(results: dict, cases) -> str:
    """Markdown: one line per case and script."""
    rows = [
        "| case | script | s / iteration | peak memory (GB) | memory.py estimate (GB) | rollout TFLOP/s | rollout MFU |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        c = results.get(case, {})
        for script, r in c.get("scripts", {}).items():
            mfu = f"{r['mfu']:.0%}" if r["mfu"] is not None else "n/a"
            rows.append(
                f"| {c['setting']} | {script} | {r['iteration_s']:.1f} | {r['peak_gb']:.3g} | {r['estimate_gb']:.3g} | "
                f"{r['rollout_tflops']:.3g} | {mfu} |"
            )
    return f"{results['device']}, LoRA r128, bf16, gradient checkpointing, --offload-frozen\n\n" + "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: the harness, not the figures")
    parser.add_argument("--out", default="/tmp/gpu_check", help="folder for the models, the runs and the results")
    parser.add_argument("--limit-s", type=float, default=150, help="time limit of one script's run")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    a = parser.parse_args()
    out, tiny = Path(a.out), a.tiny
    cases = [c for c in a.cases.split(",") if c]
    if any(c not in CASES for c in cases):
        raise SystemExit(f"error: --cases {a.cases}: choose among {', '.join(CASES)}")
    device = "cpu" if tiny else "cuda"
    if not tiny and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU here; `--tiny` runs the harness on the CPU")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not tiny:
        build_hps(out / "hps.pt", "ViT-H-14", device)  # HPSv2.1's architecture, shared by the cases
    (out / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    name = torch.cuda.get_device_name() if not tiny else "CPU"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    from benchmarks import memory

    results = {"device": name, "cases": cases}

    def save():
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1))
        (out / "gpu_check.md").write_text(table(results, cases) + "\n")

    for case in cases:
        size = SIZES[case, tiny]
        t_build = time.perf_counter()
        flops = (build_flux if case == "flux" else build_wan)(out / case, tiny, device, size)
        gc.collect()
        if not tiny:
            torch.cuda.empty_cache()  # the scripts run in their own processes: this one's GPU memory goes back
        t_build = time.perf_counter() - t_build
        setting = describe(case, size, tiny)
        print(f"built {setting} with random weights in {t_build:.0f} s; one transformer forward of one sample: "
              f"{flops / 1e12:.3g} TFLOP", flush=True)  # fmt: skip
        results[case] = {"setting": setting, "forward_tflop": flops / 1e12, "build_s": t_build, "scripts": {}}
        tiny_config = memory.TINY_FLUX if case == "flux" else memory.TINY_WAN
        for script, own in script_flags(case, tiny).items():
            flags = case_flags(case, tiny, out) + own
            r = run_script(script, flags, out, tiny, a.limit_s, f"{case}_{script[:-3]}")
            r["estimate_gb"] = memory.estimate(script, flags, model_config=tiny_config if tiny else None)["peak"]
            fwd = rollout_forwards(script, flags, cfg=case == "wan")
            r["rollout_forwards"] = fwd
            r["rollout_tflops"] = fwd * flops / r["sampling_s"] / 1e12
            r["mfu"] = r["rollout_tflops"] / peak if peak else None
            results[case]["scripts"][script] = r
            save()
            print(f"{case} {script}: {r['iteration_s']:.1f} s/it, peak {r['peak_gb']:.3g} GB (estimate "
                  f"{r['estimate_gb']:.3g}), rollout {r['rollout_tflops']:.3g} TFLOP/s"
                  + (f" = {r['mfu']:.0%} MFU" if peak else "") + f" ({r['wall_s']:.0f} s)", flush=True)  # fmt: skip
        shutil.rmtree(out / case)  # the next case's model needs the disk (FLUX.1-dev's folder is 34 GB)

    save()
    print(table(results, cases))
    print(f"total {time.perf_counter() - t0:.0f} s; results in {out}/gpu_check.md")


if __name__ == "__main__":
    main()
