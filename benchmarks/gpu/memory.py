"""Per-GPU memory plan of every GPU recipe in run.sh, measured without a GPU: fake tensors, real architectures.

    python benchmarks/gpu/memory.py                                # every GPU recipe: a markdown table (~22 min)
    python benchmarks/gpu/memory.py --out docs/gpu_memory.md       # the same, also written to a file
    python benchmarks/gpu/memory.py --recipes vgrpo-flux-8gpu vgrpo-wan-8gpu   # some recipes only
    python benchmarks/gpu/memory.py --command "accelerate launch --num_processes 8 dancegrpo.py --model-id ..."  # any
    OMP_NUM_THREADS=1 python benchmarks/gpu/memory.py --cross-check   # the estimate against a real CPU run (~4 min)

Each recipe's command comes from `bash run.sh --print NAME` (`--list` names them; GPU recipes are those on flux,
kontext, sd35, sd15, wan or qwen, less the multi-node ones, whose per-GPU memory is their 8-GPU twin's); its flags are
parsed
by the script's own `Args` (tyro), and the process count and FSDP come from the accelerate config it names. The
models are built from their published configs (benchmarks/gpu/memory_configs.py) inside `FakeTensorMode`: every
tensor has a shape, a dtype and a size but no data, so FLUX.1-dev's 12B parameters cost nothing, and `MemTracker`
(torch.distributed._tools) follows every storage that each phase allocates and frees. What the repository decides
comes from its code:
`common.models.trainable_denoiser` (the LoRA adapter via `add_lora` and `LORA_TARGETS`, which weights are fp32 and
which stay bf16, gradient checkpointing), `common.models.WanModel.decode` (Wan2.1's fp32 VAE, one video at a time),
`common.rewards` (`hps_pixels`, `CompositeReward`'s frames of a video, `temporal`), each script's `Args` and tree
sizes.
`estimate()` is the same plan for any script and flags (benchmarks/gpu/gpu_check.py prints it next to a measured peak).

An iteration is modelled in phases; the peak is the largest:
    encode      the text encoders on the prompt batch (no grad); a kind whose prompts bring images (FLUX.1-Kontext,
                Qwen-Image-Edit-Plus, Wan I2V) encodes them too: the VAE (visiting with --offload-frozen) on each
                source or first frame (Wan I2V: the whole [frame, zeros] video, fp32), Qwen2.5-VL reading each
                reference inside its chat template (twice: the instruction and the negative prompt), Wan2.1-I2V's
                CLIP vision tower on the first frame
    rollout     no-grad denoiser forwards of the rollout batch (V-GRPO: also its behaviour pass, train-batch x N_MC)
    decode      the VAE on each decode batch (Wan2.1: a video at a time, fp32), the earlier batches' samples kept;
                their torch.cat (the previous iteration's samples are still referenced); then the reward on all of
                them (no grad): HPSv2.1, HPSv3, GenEval and image_similarity (CLIP ViT-L/14 on the
                edits and their sources, fp32), on a video's --reward-frames frames, and 'temporal' on videos
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
A conditioned kind's forward carries its condition: FLUX.1-Kontext and Qwen-Image-Edit-Plus append each source's
tokens after the noisy ones (as many as the image's: the sequence doubles with one source), Wan I2V concatenates the
first frame's mask and latents on channels (36 in) and, Wan2.1-I2V, its 257 CLIP tokens in the cross-attention; the
condition is part of each row's kept conditioning (Wan I2V's in fp32, as the pipeline makes it).
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
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_map_only  # noqa: E402

# the plan's parts, each name importable from here too (memory.FLUX_DEV, memory.estimate, ...): the published
# configurations (data), the fake-tensor world, the model kinds and the estimate itself
from benchmarks.gpu.memory_configs import *  # noqa: E402, F403
from benchmarks.gpu.memory_configs import FLUX_DEV, GB, SCRIPTS  # noqa: E402
from benchmarks.gpu.memory_estimate import *  # noqa: E402, F403
from benchmarks.gpu.memory_estimate import Workload, estimate, grpo_train, parse_args  # noqa: E402
from benchmarks.gpu.memory_fake import *  # noqa: E402, F403
from benchmarks.gpu.memory_fake import Tracker, _total, nbytes  # noqa: E402
from benchmarks.gpu.memory_models import *  # noqa: E402, F403
from benchmarks.gpu.memory_models import MODELS, PLANS, Shapes, trained_module  # noqa: E402


# ---------------------------------------------------------------------------------------------------
# Recipes: run.sh is the source of truth
# ---------------------------------------------------------------------------------------------------
def _run_sh(*args: str) -> str:
    return subprocess.run(["bash", str(ROOT / "run.sh"), *args], capture_output=True, text=True, check=True).stdout


def gpu_recipes() -> list[str]:
    """run.sh's training recipes on FLUX / FLUX.1-Kontext / SD3.5 / SD1.5 / Wan / Qwen-Image GPUs; multi-node ones are
    left out (per GPU as their 8-GPU twin), and so are the evaluation recipes (evaluate-*: no training)."""
    names = [n for n in _run_sh("--list").split() if not n.startswith("evaluate-") and not n.endswith("-multinode")]
    # DiffusionNFT's curriculum: five runs with diffusionnft-sd35-8gpu's batches (its plan), other prompts and rewards
    kinds = ("flux", "kontext", "sd35", "sd15", "wan", "qwen")
    return [n for n in names if any(k in n for k in kinds) and "curriculum" not in n]


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
    if e.get("images") and not e.get("frames"):  # an edit: its sources or references, each as many tokens as the image
        size += f" + {e['images']} source" + ("s" if e["images"] > 1 else "")
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
        f"Made by `python benchmarks/gpu/memory.py` ({seconds / 60:.0f} min on one CPU thread, no GPU): each GPU "
        "recipe of `run.sh` with the flags `bash run.sh --print RECIPE` gives, the models "
        "built from their published configs as fake tensors (method and assumptions: the script's docstring). "
        "**GB = 10^9 bytes** per GPU, as `torch.cuda.max_memory_allocated` counts them (the CUDA allocator reserves "
        "5-15% more). Goal: LoRA at 512 px within 48 GB; LoRA above 512 px or of a denoiser over 12B parameters, "
        "and full fine-tuning (FSDP over 8 GPUs), within 80 GB.\n\n"
        "Resident parts: trainable weights, the frozen denoiser weights, gradients, AdamW state, the text encoders, "
        "the VAE and the reward networks (HPSv2.1, HPSv3, GenEval, image_similarity), the rollout data (latents, "
        "conditioning with an edit's sources or a video's first frame, decoded images or videos), DDP's gradient "
        "buckets or FSDP's gathered units. Transient: `train act.` is one training "
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
