"""The prepared GPU check: full-size models with random weights (built from their published configs; nothing is
downloaded), bf16, LoRA r128, gradient checkpointing and --offload-frozen as in run.sh's recipes, 2 iterations of each
script with small batches, in two cases:

  flux   FLUX.1-dev at 512 px: dancegrpo.py, branchgrpo.py --pruning depth and vgrpo.py (8 steps, 10 for the tree)
  wan    Wan2.1-T2V-1.3B video, 480 x 832 x 9 frames, CFG 5, reward hpsv2.1 on 4 frames + temporal:0.5 (the wan
         recipes' settings): dancegrpo.py (4 videos, rollout batch 4, 8 steps) and branchgrpo.py --pruning depth
         (one tree of 4 leaves, 10 steps)

For each script it prints seconds per iteration, the peak GPU memory (torch.cuda.max_memory_allocated, as the scripts
log it in perf/peak_mem_gb) next to benchmarks/memory.py's plan for the same flags, and the model FLOP rate and
utilisation of the transformer's forwards without gradients (the rollout) and of the training step, each timed alone.

    bash benchmarks/gpu_check.sh --prepare        # on a machine with the package index: wheels and plans in .whl/,
                                                  # and the command for an offline GPU node (docs/gpu.md)
    bash benchmarks/gpu_check.sh                  # one H100 / H200-class GPU: 8 minutes at most (--limit-s)
    bash benchmarks/gpu_check.sh --cases wan      # one case only (a rerun that fits the time left)
    bash benchmarks/gpu_check.sh --tiny           # the same harness on tiny models, on the CPU (tests run it)

What it measures and what it does not:
- random weights give the real shapes, so memory and speed, not image or video quality or learning;
- the reward is an HPSv2.1 model (open_clip ViT-H-14) with random weights: the real one's size and cost;
- each script runs under benchmarks/gpu_timing.py, which times every transformer forward and backward pass with CUDA
  events; rows (one image or video each; a CFG batch counts both halves) x the FLOPs of one forward (counted by
  torch.utils.flop_counter on the real model) / that time, against the GPU's bf16 matmul peak measured first, and
  the datasheet's; the training step counts 2x the forward's FLOPs per row (LoRA: no weight gradients of the base);
- batches and step counts are smaller than the recipes' (4 samples or one 4-leaf tree per iteration, 8-10 steps;
  Wan: 9 frames where the recipes have 33), so the training phase's share of an iteration differs from a real run's.
The memory plans and a disk check come before the clock starts. Every script runs in its own process with its own
time limit; a failure or a time-out is recorded with the end of its log and the check goes on. The runs write no
checkpoints or weights (--no-save). {--out}/gpu_check.json and gpu_check.md (and --results, with the logs) are
written after every script, so a run stopped early keeps what finished. Each case's model folder is deleted after
its scripts (FLUX.1-dev's is 34 GB). In --tiny mode the peak memory is the process's resident set on the CPU, not
comparable with the plan, and there is no MFU: that mode checks the harness, not the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.logs import read_metrics  # noqa: E402

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
    with torch.device(device):  # initialised on the GPU: seconds on the CPU
        model = open_clip.create_model(arch, pretrained=None)
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
                             "--group-size", "4", "--rollout-batch-size", "1", "--samples-per-update", "4",
                             "--same-noise", "--clip-range", "1e-4", "--kl-beta", "0"],
            "branchgrpo.py": ["--pruning", "depth", "--num-steps", "6" if tiny else "10", "--sde-type", "dance",
                              "--split-schedule", "dense", "--num-splits", "2", "--branch-factor", "2",
                              "--trees-per-device", "1", "--trees-per-update", "1", "--window", "4",
                              "--rollout-batch-size", "4", "--clip-range", "1e-4", "--kl-beta", "0"],
            "vgrpo.py": [*steps, "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "1",
                         "--train-batch-size", "1", "--samples-per-update", "4", "--n-mc", "4", "--clip-range", "6e-3",
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


# FLOPs per forward row: forward (1) + the backward to the activations (1); with LoRA the frozen base computes no weight
# gradients, and the recomputed forwards of gradient checkpointing are the hardware's work, not the model's
TRAIN_FLOPS_PER_FORWARD = 2
DISK_GB = {("flux", False): 34.0, ("wan", False): 15.0, ("flux", True): 0.1, ("wan", True): 0.1}  # saved folders
HPS_GB = 3.94  # the random-weight HPSv2.1 checkpoint (fp32 ViT-H-14)


def plan(cases, tiny: bool) -> dict:
    """memory.py's per-GPU plan (GB) of every (case, script), keyed so that a plan made for other flags is refused."""
    from benchmarks import memory

    out = {}
    for case in cases:
        config = None if not tiny else memory.TINY_FLUX if case == "flux" else memory.TINY_WAN
        for script, own in script_flags(case, tiny).items():
            flags = case_flags(case, tiny, Path("OUT")) + own  # --model-id OUT/flux or OUT/wan: the kind by its name
            gb = memory.estimate(script, flags, model_config=config)["peak"]
            out[f"{case}/{script}"] = {"flags": flags, "estimate_gb": gb}
            print(f"planned {case} {script}: {gb:.3g} GB", flush=True)
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


def run_script(script, flags, out: Path, limit_s: float, exp_name: str) -> dict:
    """One 2-iteration run under benchmarks/gpu_timing.py, its output in {out}/logs/{exp_name}.log. Never raises: a
    failure or a time-out is recorded with the end of the log, and the check goes on to the next script."""
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    log, timings = logs / f"{exp_name}.log", logs / f"{exp_name}.timings.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_timing.py"), str(timings), script, *flags]
    cmd += ["--output-dir", str(out / "runs"), "--exp-name", exp_name, "--no-save"]  # no checkpoint, no final weights
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = "ok" if proc.wait(timeout=max(limit_s, 1)) == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the script and anything it started
            proc.wait()
            status = f"timed out after {limit_s:.0f} s"
    r = {"status": status, "wall_s": time.perf_counter() - t0, "log": str(log)}
    runs = sorted((out / "runs").glob(f"{exp_name}__*"))
    train = [m for m in read_metrics(runs[-1]) if "perf/iteration_s" in m] if runs else []
    if status != "ok" or not train:
        r["log_tail"] = log.read_text()[-3000:]
        return r
    last = train[-1]  # the second iteration: the first one also warms up kernels and caches
    r |= {
        "iterations": len(train),
        "iteration_s": last["perf/iteration_s"],
        "sampling_s": last["perf/sampling_s"],
        "peak_gb": max(m["perf/peak_mem_gb"] for m in train),
    }
    if timings.is_file():
        t = json.loads(timings.read_text())[-1]
        r |= {k: t[k] for k in ("nograd_rows", "nograd_s", "grad_rows", "grad_s", "backward_s")}
    for run_dir in runs:  # its logs and sample grids, if any: the next runs need the disk
        shutil.rmtree(run_dir, ignore_errors=True)
    return r


def add_rates(r: dict, flops: float, peak: float | None) -> None:
    """TFLOP/s of the no-grad forwards (the rollout) and of the training step (forwards with gradients + backward),
    and their MFU against the measured matmul peak and the datasheet's."""
    if "nograd_s" not in r:
        return
    r["rollout_tflops"] = r["nograd_rows"] * flops / max(r["nograd_s"], 1e-9) / 1e12
    train_s = r["grad_s"] + r["backward_s"]
    r["train_tflops"] = TRAIN_FLOPS_PER_FORWARD * r["grad_rows"] * flops / max(train_s, 1e-9) / 1e12
    for what in ("rollout", "train"):
        r[f"{what}_mfu"] = r[f"{what}_tflops"] / peak if peak else None


def pct(x) -> str:
    return f"{x:.0%}" if x is not None else "n/a"


def table(results: dict, cases) -> str:
    """Markdown: one line per case and script."""
    measured, datasheet = results.get("peak_tflops_measured"), results.get("peak_tflops_datasheet")
    rows = [
        "| case | script | status | s / iteration | sampling s | peak memory (GB) | plan (GB) | no-grad forwards: "
        "TFLOP/s, MFU | training step: TFLOP/s, MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        c = results.get(case, {})
        for script, r in c.get("scripts", {}).items():
            if "iteration_s" not in r:
                rows.append(f"| {c['setting']} | {script} | {r['status']} | | | | {r['estimate_gb']:.3g} | | |")
                continue
            rates = [
                f"{r[f'{w}_tflops']:.3g}, {pct(r[f'{w}_mfu'])}" if f"{w}_tflops" in r else "n/a"
                for w in ("rollout", "train")
            ]
            rows.append(
                f"| {c['setting']} | {script} | {r['status']} | {r['iteration_s']:.1f} | {r['sampling_s']:.1f} | "
                f"{r['peak_gb']:.3g} | {r['estimate_gb']:.3g} | {rates[0]} | {rates[1]} |"
            )
    peaks = (
        f"MFU against the measured bf16 matmul peak {measured:.0f} TFLOP/s"
        + (f" (datasheet {datasheet:.0f}: multiply the MFU by {measured / datasheet:.2f})" if datasheet else "")
        if measured
        else "no GPU: no MFU"
    )
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in results.get("phases_s", {}).items())
    return (
        f"{results['device']}, LoRA r128, bf16, gradient checkpointing, --offload-frozen; {peaks}\n"
        f"time per phase: {phases}\n\n" + "\n".join(rows)
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: the harness, not the figures")
    parser.add_argument("--out", default="/tmp/gpu_check", help="folder for the models, the runs and the results")
    parser.add_argument("--results", help="also copy the results (table, JSON, logs) here after every script")
    parser.add_argument("--limit-s", type=float, default=480, help="the whole check's time limit, after planning")
    parser.add_argument("--script-limit-s", type=float, default=180, help="time limit of one script's run")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    parser.add_argument("--plan", help="memory plans made beforehand (--write-plan); default: made here, untimed")
    parser.add_argument("--write-plan", help="only write the memory plans to this file (--tiny: the tiny case's)")
    a = parser.parse_args()
    out, tiny = Path(a.out), a.tiny
    cases = [c for c in a.cases.split(",") if c]
    if any(c not in CASES for c in cases):
        raise SystemExit(f"error: --cases {a.cases}: choose among {', '.join(CASES)}")
    if a.write_plan:
        Path(a.write_plan).write_text(json.dumps(plan(CASES, tiny), indent=1))
        return
    device = "cpu" if tiny else "cuda"
    if not tiny and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU here; `--tiny` runs the harness on the CPU")

    # ---- before the clock: the memory plans and the disk
    if a.plan:
        plans = json.loads(Path(a.plan).read_text())
        for case in cases:
            for script, own in script_flags(case, tiny).items():
                p = plans.get(f"{case}/{script}")
                if p is None or p["flags"] != case_flags(case, tiny, Path("OUT")) + own:
                    raise SystemExit(f"error: --plan {a.plan} was made for other flags of {case} {script}; make it "
                                     "anew with `bash benchmarks/gpu_check.sh --prepare`")  # fmt: skip
    else:
        plans = plan(cases, tiny)
    out.mkdir(parents=True, exist_ok=True)
    need_gb = max(DISK_GB[c, tiny] for c in cases) + (0 if tiny else HPS_GB) + 1  # one case's model at a time
    free_gb = shutil.disk_usage(out).free / 1e9
    if free_gb < need_gb:
        raise SystemExit(f"error: --out {out} has {free_gb:.1f} GB free; the check writes up to {need_gb:.0f} GB "
                         "there (one model folder at a time and the reward's checkpoint): pass a larger disk")  # fmt: skip
    for stale in ("runs", "logs"):
        shutil.rmtree(out / stale, ignore_errors=True)

    # ---- the clock starts
    t0 = time.perf_counter()
    deadline = t0 + a.limit_s
    name = torch.cuda.get_device_name() if not tiny else "CPU"
    results = {"device": name, "cases": cases, "phases_s": {}}
    if not tiny:
        results["peak_tflops_measured"] = matmul_peak_tflops()
        results["peak_tflops_datasheet"] = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    peak = results.get("peak_tflops_measured")

    def save():
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1))
        (out / "gpu_check.md").write_text(table(results, cases) + "\n")
        if a.results:
            dest = Path(a.results)
            dest.mkdir(parents=True, exist_ok=True)
            for f in ("gpu_check.json", "gpu_check.md"):
                shutil.copy(out / f, dest / f)
            for f in sorted((out / "logs").glob("*.log")) if (out / "logs").is_dir() else []:
                shutil.copy(f, dest / f.name)

    t = time.perf_counter()
    if not tiny:
        build_hps(out / "hps.pt", "ViT-H-14", device)  # HPSv2.1's architecture, shared by the cases
    (out / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    results["phases_s"]["reward checkpoint"] = time.perf_counter() - t
    save()
    for case in cases:
        size = SIZES[case, tiny]
        setting = describe(case, size, tiny)
        results[case] = {"setting": setting, "scripts": {}}
        t_build = time.perf_counter()
        flops = (build_flux if case == "flux" else build_wan)(out / case, tiny, device, size)
        gc.collect()
        if not tiny:
            torch.cuda.empty_cache()  # the scripts run in their own processes: this one's GPU memory goes back
        t_build = time.perf_counter() - t_build
        results["phases_s"][f"{case}: build"] = t_build
        print(f"built {setting} with random weights in {t_build:.0f} s; one transformer forward of one sample: "
              f"{flops / 1e12:.3g} TFLOP", flush=True)  # fmt: skip
        results[case] |= {"forward_tflop": flops / 1e12, "build_s": t_build}
        for script, own in script_flags(case, tiny).items():
            flags = case_flags(case, tiny, out) + own
            left = deadline - time.perf_counter()
            if left < 10:
                r = {"status": "skipped: the check's time limit was reached"}
            else:
                r = run_script(script, flags, out, min(a.script_limit_s, left), f"{case}_{script[:-3]}")
                results["phases_s"][f"{case}: {script}"] = r["wall_s"]
            r["estimate_gb"] = plans[f"{case}/{script}"]["estimate_gb"]
            add_rates(r, flops, peak)
            results[case]["scripts"][script] = r
            save()
            if "iteration_s" in r:
                print(f"{case} {script}: {r['iteration_s']:.1f} s/it, peak {r['peak_gb']:.3g} GB (plan "
                      f"{r['estimate_gb']:.3g}), no-grad forwards {r.get('rollout_tflops', 0):.3g} TFLOP/s, training "
                      f"{r.get('train_tflops', 0):.3g} TFLOP/s ({r['wall_s']:.0f} s)", flush=True)  # fmt: skip
            else:
                print(f"{case} {script}: {r['status']}" + (f"\n{r['log_tail']}" if "log_tail" in r else ""), flush=True)
        shutil.rmtree(out / case)  # the next case's model needs the disk (FLUX.1-dev's folder is 34 GB)

    results["total_s"] = time.perf_counter() - t0
    save()
    print(table(results, cases))
    print(
        f"total {results['total_s']:.0f} s; results in {out}/gpu_check.md" + (f" and {a.results}" if a.results else "")
    )
    failed = [f"{c} {s}" for c in cases for s, r in results[c]["scripts"].items() if r["status"] != "ok"]
    if failed:
        raise SystemExit(f"error: not every script ran: {', '.join(failed)} (logs in {out}/logs)")


if __name__ == "__main__":
    main()
