"""The prepared GPU check: FLUX.1-dev at full size with random weights (built from its published config; nothing is
downloaded), bf16, LoRA r128, 512 px, gradient checkpointing and --offload-frozen as in run.sh's recipes, 2
iterations each of dancegrpo.py, branchgrpo.py --pruning depth and vgrpo.py with small batches. For each script it
prints seconds per iteration, the peak GPU memory (torch.cuda.max_memory_allocated, as the scripts log it in
perf/peak_mem_gb) next to benchmarks/memory.py's estimate for the same flags, and the rollout's model FLOP utilisation.

    bash benchmarks/gpu_check.sh                  # one H100 / H200-class GPU: ~6 min, at most 8 (its own time limit)
    bash benchmarks/gpu_check.sh --tiny           # the same harness on tiny models, on the CPU (tests run it)

What it measures and what it does not:
- random weights give the real shapes, so memory and speed, not image quality or learning;
- the reward is an HPSv2.1 model (open_clip ViT-H-14) with random weights: the real one's size and cost;
- the rollout's FLOP utilisation = rollout transformer forwards x FLOPs of one forward (counted by
  torch.utils.flop_counter on the real model) / perf/sampling_s / the GPU's dense bf16 peak. perf/sampling_s also
  holds the prompt encoding and, with --offload-frozen, the text encoders' trips over PCIe: a lower bound;
- batches are smaller than the recipes' (4 images or one 4-leaf tree per iteration), so the training phase's share
  of an iteration differs from a real run's.
Writes {--out}/gpu_check.json and gpu_check.md (the table docs/gpu.md quotes). In --tiny mode the peak memory is the
process's resident set on the CPU, not comparable with the estimate: that mode checks the harness, not the figures.
"""

from __future__ import annotations

import argparse
import json
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


# ---------------------------------------------------------------------------------------------------
# A FLUX.1-dev-shaped pipeline with random weights
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


def tokenizers():
    """CLIP and T5 tokenizers built in memory (letters as tokens): the real ones cannot be downloaded here, and the
    pipeline pads every prompt to the same length (77 CLIP, 512 T5 tokens), so the sequence shapes are the real ones."""
    from transformers import CLIPTokenizer, T5Tokenizer

    vocab = [*LETTERS, *(c + "</w>" for c in LETTERS), "<|startoftext|>", "<|endoftext|>"]
    clip = CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=[], model_max_length=77)
    t5_vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0), *((c, -3.0) for c in LETTERS)]
    t5 = T5Tokenizer(vocab=t5_vocab, extra_ids=0)
    return clip, t5


@torch.no_grad()
def build_flux(folder: Path, tiny: bool, device) -> float:
    """Save a FluxPipeline with random weights into `folder`; returns the FLOPs of one transformer forward of one
    image at --resolution (counted on the model while it is in memory)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    cfg = flux_configs(tiny)
    clip_tok, t5_tok = tokenizers()
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialise in bf16 on the device: 12B parameters in seconds
    try:
        with torch.device(device):
            transformer = FluxTransformer2DModel(**cfg["transformer"])
            clip = CLIPTextModel(CLIPTextConfig(**cfg["clip"]))
            t5 = T5EncoderModel(T5Config(**cfg["t5"]))
            vae = AutoencoderKL(**cfg["vae"], shift_factor=0.1159, scaling_factor=0.3611)  # FLUX.1-dev's latent scaling
    finally:
        torch.set_default_dtype(default_dtype)
    pipe = FluxPipeline(FlowMatchEulerDiscreteScheduler(shift=3.0), vae, clip, clip_tok, t5, t5_tok, transformer)
    flops = forward_flops(pipe, RESOLUTION[tiny])
    pipe.save_pretrained(folder)
    return flops


def forward_flops(pipe, resolution: int) -> float:
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


def build_hps(path: Path, arch: str, device) -> None:
    """An HPSv2.1 checkpoint ({'state_dict': ...}, as HPS_v2.1_compressed.pt) of open_clip `arch` with random weights."""
    import open_clip

    torch.manual_seed(0)
    model = open_clip.create_model(arch, pretrained=None, device=device)
    torch.save({"state_dict": model.state_dict()}, path)


# ---------------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------------
RESOLUTION = {False: 512, True: 64}


def script_flags(tiny: bool) -> dict[str, list[str]]:
    """Each script's own flags: the recipes' settings with small batches."""
    steps = ["--num-steps", "4" if tiny else "16"]
    return {
        "dancegrpo.py": [*steps, "--sde-type", "dance", "--noise-level", "0.3", "--samples-per-device", "4",
                         "--group-size", "4", "--rollout-batch-size", "1", "--trajectories-per-update", "4",
                         "--same-noise", "--clip-range", "1e-4", "--kl-beta", "0"],
        "branchgrpo.py": ["--pruning", "depth", "--num-steps", "6" if tiny else "20", "--sde-type", "dance",
                          "--split-schedule", "dense", "--num-splits", "2", "--branch-factor", "2",
                          "--trees-per-device", "1", "--trees-per-update", "1", "--window", "4",
                          "--rollout-batch-size", "4", "--clip-range", "1e-4", "--kl-beta", "0"],
        "vgrpo.py": [*steps, "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "1",
                     "--train-batch-size", "1", "--images-per-update", "4", "--n-mc", "4", "--clip-range", "6e-3",
                     "--kl-beta", "0"],
    }  # fmt: skip


def rollout_forwards(script: str, flags: list[str]) -> int:
    """Transformer forwards (one image each) of one iteration's rollout, from the script's own Args."""
    import tyro

    module = __import__(script[:-3])
    a = tyro.cli(module.Args, args=flags)
    if script == "branchgrpo.py":
        splits = module.split_steps(a.split_schedule, a.num_steps, a.num_splits)
        return a.trees_per_device * module.tree_counts(a.num_steps, splits, a.branch_factor)[0]
    return a.samples_per_device * a.num_steps  # Euler / DPM-Solver++(2M): one forward per step; FLUX has no CFG


def run_script(script, flags, out: Path, tiny: bool, limit_s: float) -> dict:
    """One 2-iteration run; returns its metrics of the last iteration and the peak over both."""
    name = script[:-3]
    cmd = [sys.executable, str(ROOT / script), *flags, "--output-dir", str(out / "runs"), "--exp-name", name]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit_s)
    if proc.returncode != 0:
        raise SystemExit(f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    run_dir = max((out / "runs").glob(f"{name}__*"))
    rows = read_metrics(run_dir)
    train = [r for r in rows if "perf/iteration_s" in r]
    return {
        "wall_s": time.perf_counter() - t0,
        "iteration_s": train[-1]["perf/iteration_s"],  # the second: the first one also warms up kernels and caches
        "sampling_s": train[-1]["perf/sampling_s"],
        "peak_gb": max(r["perf/peak_mem_gb"] for r in train),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: the harness, not the figures")
    parser.add_argument("--out", default="/tmp/gpu_check", help="folder for the model, the runs and the results")
    parser.add_argument("--limit-s", type=float, default=150, help="time limit of one script's run")
    a = parser.parse_args()
    out, tiny = Path(a.out), a.tiny
    device = "cpu" if tiny else "cuda"
    if not tiny and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU here; `--tiny` runs the harness on the CPU")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    flops = build_flux(out / "flux", tiny, device)
    reward = ["--reward", "jpeg"]  # tiny: no registered tiny HPS architecture in the scripts' processes
    if not tiny:
        build_hps(out / "hps.pt", "ViT-H-14", device)  # HPSv2.1's architecture
        reward = ["--reward", "hpsv2.1", "--reward-ckpt", f"hpsv2.1={out / 'hps.pt'}"]
        torch.cuda.empty_cache()  # the scripts run in their own processes: this one's GPU memory goes back
    (out / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    t_build = time.perf_counter() - t0
    print(f"built a FLUX.1-dev-{'tiny' if tiny else 'sized'} pipeline with random weights in {t_build:.0f} s; "
          f"one forward of one {RESOLUTION[tiny]} px image: {flops / 1e12:.3g} TFLOP")  # fmt: skip

    common = [
        "--model-id", str(out / "flux"), "--resolution", str(RESOLUTION[tiny]), "--mixed-precision", "bf16",
        "--gradient-checkpointing", "--offload-frozen", "--lora", "--lora-rank", "128", "--lora-alpha", "256",
        *reward, "--prompts", str(out / "prompts.txt"), "--eval-prompts", str(out / "prompts.txt"),
        "--guidance-scale", "3.5", "--iterations", "2", "--eval-every", "0", "--sample-every", "0",
        "--weight-decay", "0", "--lr-warmup", "0",
    ]  # fmt: skip
    name = torch.cuda.get_device_name() if not tiny else "CPU"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    from benchmarks import memory

    results = {"device": name, "resolution": RESOLUTION[tiny], "forward_tflop": flops / 1e12, "build_s": t_build}
    for script, own in script_flags(tiny).items():
        flags = common + own
        r = run_script(script, flags, out, tiny, a.limit_s)
        r["estimate_gb"] = memory.estimate(script, flags, model_config=memory.TINY_FLUX if tiny else None)["peak"]
        fwd = rollout_forwards(script, flags)
        r["rollout_forwards"] = fwd
        r["rollout_tflops"] = fwd * flops / r["sampling_s"] / 1e12
        r["mfu"] = r["rollout_tflops"] / peak if peak else None
        results[script] = r
        print(f"{script}: {r['iteration_s']:.1f} s/it, peak {r['peak_gb']:.3g} GB (estimate {r['estimate_gb']:.3g}), "
              f"rollout {r['rollout_tflops']:.3g} TFLOP/s" + (f" = {r['mfu']:.0%} MFU" if peak else ""))  # fmt: skip

    rows = [
        "| script | s / iteration | peak memory (GB) | memory.py estimate (GB) | rollout TFLOP/s | rollout MFU |",
        "|---|---|---|---|---|---|",
    ]
    for script in script_flags(tiny):
        r = results[script]
        mfu = f"{r['mfu']:.0%}" if r["mfu"] is not None else "n/a"
        rows.append(
            f"| {script} | {r['iteration_s']:.1f} | {r['peak_gb']:.3g} | {r['estimate_gb']:.3g} | "
            f"{r['rollout_tflops']:.3g} | {mfu} |"
        )
    table = f"{name}, {RESOLUTION[tiny]} px, LoRA r128, bf16, gradient checkpointing, --offload-frozen\n\n" + "\n".join(
        rows
    )
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    (out / "gpu_check.md").write_text(table + "\n")
    print(table)
    print(f"total {time.perf_counter() - t0:.0f} s; results in {out}/gpu_check.md")


if __name__ == "__main__":
    main()
