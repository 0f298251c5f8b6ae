"""The GPU check's cases of its two calls, their FLOP and parameter counts on the meta device at the case's shapes,
the plan entries (memory.py's peak and those counts, keyed by what they depend on) and the timing model (each
case's and each call's GPU seconds, before the GPU is lent). Part of benchmarks/gpu/gpu_check.py, whose docstring
describes the check.
"""

from __future__ import annotations

import contextlib
import functools
import json
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.gpu import memory
from benchmarks.gpu.gpu_build import KINDS, SCRIPTS, model_config, parts_of

CALL_LIMIT_S = {1: 240, 2: 360}  # what each call must fit in, by the timing model and on the GPU (--limit-s)


# ---------------------------------------------------------------------------------------------------
# The cases of the two calls
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str  # a model kind's case: the kind; call 2's scripts on FLUX.1-dev: the script's name
    call: int
    kind: str
    script: str
    scale: str  # 'full' or 'reduced' on the GPU ('tiny' when rehearsed)


def kind_cases(call: int) -> list[Case]:
    """The model kinds' cases run in `call`: each kind's script at the kind's scale."""
    return [Case(k, call, k, spec.script, "reduced" if spec.reduced else "full") for k, spec in KINDS.items()
            if spec.call == call]  # fmt: skip


CASES = {
    1: kind_cases(1),
    2: [Case(s[:-3], 2, "flux", s, "full") for s in SCRIPTS] + kind_cases(2),  # then the video kinds of call 2
}


def size_of(case: Case, tiny: bool) -> dict:
    k = KINDS[case.kind]
    return k.tiny_size if tiny else k.size


def describe(case: Case, tiny: bool) -> str:
    size, k = size_of(case, tiny), KINDS[case.kind]
    depth = {"full": "", "reduced": ", 2 blocks of each type", "tiny": " (tiny)"}["tiny" if tiny else case.scale]
    px = f"{size['height']}x{size['width']} x {size['frames']} frames" if k.video else f"{size['resolution']} px"
    return f"{k.title}{depth}, {px}"


def case_flags(case: Case, tiny: bool, out: Path) -> list[str]:
    """The script's flags: the kind's model folder and size, bf16, LoRA (the recipe's rank; call 2: r128), gradient
    checkpointing, small batches and few steps, one iteration, nothing saved; call 2 with --offload-frozen (the FLUX
    recipes'); the reward hpsv2.1 (videos: + temporal:0.5 on 4 frames, as the Wan recipes)."""
    k, size = KINDS[case.kind], size_of(case, tiny)
    rank = k.lora_rank
    flags = [
        "--model-id", str(out / "models" / case.kind), "--mixed-precision", "bf16", "--gradient-checkpointing",
        "--lora", "--lora-rank", str(rank), "--lora-alpha", str(2 * rank), "--prompts", str(out / "prompts.txt"),
        "--eval-prompts", str(out / "prompts.txt"), "--iterations", "1", "--eval-every", "0", "--sample-every", "0",
        "--weight-decay", "0", "--lr-warmup", "0", "--no-save", "--guidance-scale", str(k.guidance),
    ]  # fmt: skip
    if k.video:
        flags += ["--resolution", str(size["height"])] if size["height"] == size["width"] else []
        flags += ["--num-frames", str(size["frames"]), "--reward-frames", "4", "--reward", "hpsv2.1,temporal:0.5"]
        flags += ["--shift", k.shift or ("5" if k.memory_kind == "wan22" else "3")]
    else:
        flags += ["--resolution", str(size["resolution"]), "--reward", "hpsv2.1"]
    if case.call == 2:
        flags += ["--offload-frozen"]
    return flags + script_flags(case)


def script_flags(case: Case) -> list[str]:
    """Each script's own flags: a recipe's settings with 4 samples (videos: 2) or one 4-leaf tree, 4 steps (call 2: 8,
    the tree 10)."""
    if case.name in KINDS and case.script == "dancegrpo.py":  # a model kind's case
        n = 2 if KINDS[case.kind].video else 4
        return ["--num-steps", "4", "--sde-type", "dance", "--noise-level", "0.3", "--samples-per-device", str(n),
                "--group-size", str(n), "--rollout-batch-size", str(n), "--samples-per-update", str(n),
                "--clip-range", "1e-4", "--kl-beta", "0"]  # fmt: skip
    if case.script == "rlr.py":  # the rlr-sd15 recipe's estimator (FO + HO, a 2-step sub-chain anywhere)
        steps = "4" if case.call == 1 else "8"
        return ["--num-steps", steps, "--group-size", "2", "--samples-per-device", "2", "--rollout-batch-size", "1",
                "--subchain-len", "2", "--terms", "fo+ho", "--subchain-stage", "any"]  # fmt: skip
    steps = ["--num-steps", "8"]
    return {
        "dancegrpo.py": [*steps, "--sde-type", "dance", "--noise-level", "0.3", "--samples-per-device", "4",
                         "--group-size", "4", "--rollout-batch-size", "1", "--samples-per-update", "4",
                         "--same-noise", "--clip-range", "1e-4", "--kl-beta", "0"],
        "branchgrpo.py": ["--pruning", "depth", "--num-steps", "10", "--sde-type", "dance", "--split-schedule",
                          "dense", "--num-splits", "2", "--branch-factor", "2", "--trees-per-device", "1",
                          "--trees-per-update", "1", "--window", "4", "--rollout-batch-size", "4", "--clip-range",
                          "1e-4", "--kl-beta", "0"],
        "vgrpo.py": [*steps, "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "1",
                     "--train-batch-size", "1", "--samples-per-update", "4", "--n-mc", "4", "--clip-range", "6e-3",
                     "--kl-beta", "0"],
        # Flow-Factory's NFT setting (run.sh's diffusionnft-flux-8gpu): 2 of 8 grid timesteps trained per image
        "diffusionnft.py": [*steps, "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "1",
                            "--train-batch-size", "1", "--samples-per-update", "4", "--timestep-fraction", "0.25",
                            "--kl-beta", "0"],
    }[case.script]  # fmt: skip


def write_model_folder(case: Case, out: Path) -> None:
    """--model-id's folder: its model_index.json only (the kind, Wan2.2's experts), for the scripts' own checks."""
    folder = out / "models" / case.kind
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model_index.json").write_text(json.dumps(KINDS[case.kind].index))


# ---------------------------------------------------------------------------------------------------
# FLOPs and parameters, counted on the meta device at the case's shapes
# ---------------------------------------------------------------------------------------------------
def shapes_of(case: Case, scale: str):
    """memory.Shapes of one sample of the case at `scale` ('tiny': the rehearsal's size)."""
    k, size = KINDS[case.kind], size_of(case, scale == "tiny")
    parts = parts_of(case.kind, scale)
    if k.video:
        return memory.Shapes.of(k.memory_kind, parts, (size["height"], size["width"]), size["frames"])
    return memory.Shapes.of(k.memory_kind, parts, size["resolution"])


def lora_rank(case: Case) -> int:
    return KINDS[case.kind].lora_rank


@contextlib.contextmanager
def quiet_diffusers():
    """diffusers' logger at ERROR: not its notes on fp32 modules when memory.py's builders cast a meta model."""
    import logging

    log = logging.getLogger("diffusers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def count_flops(case: Case, scale: str) -> dict[str, float]:
    """_count_flops of the case's kind at `scale` and size (made once per process: call 2's cases share it)."""
    return dict(_count_flops(case.kind, scale, json.dumps(size_of(case, scale == "tiny"))))


@functools.cache
def _count_flops(kind: str, scale: str, size: str) -> dict[str, float]:
    """FLOPs of one row (one image or video; no CFG), counted by FlopCounterMode on the case's denoiser at its shapes,
    called as the scripts call it (memory.denoise): forward_base (no adapter), forward (with the LoRA adapter, as the
    rollout runs it), train (that forward + its backward, the model as common.models.trainable_denoiser prepares it);
    and params: the denoiser's (one expert's for A14B). On the meta device (nothing computed or allocated), attention
    by its math path (matmuls FlopCounterMode counts on every device), without gradient checkpointing."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from common.models import Flux2Model, trainable_denoiser

    case = Case(kind, 1, kind, "", scale)  # the counts depend on the kind, its scale and its size only
    mk, parts, shapes = KINDS[kind].memory_kind, parts_of(kind, scale), shapes_of(case, scale)
    # on the meta device, or as fake tensors where the forward reads values (memory.Plan.reads_values)
    world = memory.fake_world() if memory.PLANS[mk].reads_values else torch.device("meta")
    with quiet_diffusers():
        with world, sdpa_kernel(SDPBackend.MATH):
            module = memory.build_denoiser(mk, parts["denoiser"], torch.bfloat16).requires_grad_(False)
            params = sum(p.numel() for p in module.parameters())
            x = torch.randn(1, *shapes.latent)
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                memory.denoise(shapes, module, x)
            base = float(counter.get_total_flops())
            rank = KINDS[kind].lora_rank
            args = types.SimpleNamespace(lora=True, lora_rank=rank, lora_alpha=2 * rank, gradient_checkpointing=False)
            holder = types.SimpleNamespace(kind=mk, unet=module, transformer=module)
            if mk in memory.FLUX2_KINDS:  # its adapter also covers the single blocks' fused Linears
                holder.lora_targets = Flux2Model.lora_targets
            module = trainable_denoiser(holder, args)
            with FlopCounterMode(display=False) as counter:
                y = memory.denoise(shapes, module, x)
                forward = float(counter.get_total_flops())
                y.square().mean().backward()
            train = float(counter.get_total_flops())
    return {"forward_base": base, "forward": forward, "train": train, "params": float(params)}


def count_params(case: Case, scale: str) -> dict[str, float]:
    """_count_params of the case's kind at `scale` and size (made once per process)."""
    return dict(_count_params(case.kind, scale, json.dumps(size_of(case, scale == "tiny"))))


@functools.cache
def _count_params(kind: str, scale: str, size: str) -> dict[str, float]:
    """Parameters of the frozen parts (text encoders, VAE; built on the meta device) and the VAE's decode FLOPs of
    one sample (FlopCounterMode on the meta device, as memory.vae_decode runs it)."""
    from torch.utils.flop_counter import FlopCounterMode

    case = Case(kind, 1, kind, "", scale)
    mk, parts, shapes = KINDS[kind].memory_kind, parts_of(kind, scale), shapes_of(case, scale)
    with quiet_diffusers(), torch.device("meta"):
        text = sum(
            sum(p.numel() for p in memory.build_text_encoder(fam, cfg, torch.bfloat16, fam == "clip").parameters())
            for fam, cfg, _ in parts["text"]
        )
        vae = memory.build_vae(mk, parts["vae"], torch.bfloat16)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            memory.vae_decode(vae, shapes, torch.zeros(1, *shapes.latent))
    return {"text": float(text), "vae": float(sum(p.numel() for p in vae.parameters())),
            "decode": float(counter.get_total_flops())}  # fmt: skip


def expected_flops(case: Case, scale: str) -> float | None:
    """One row's forward with the adapter by hand, from the configs (FLUX.1, Qwen-Image, FLUX.2, Wan; None for the
    others): 2 FLOPs a multiply-add of every projection on every token, attention's two matmuls (4 n^2 d a layer),
    and the adapter's 4 n r d per adapted d x d projection; the per-sample vectors (time, guidance, pooled embeddings,
    modulation) are left out (under 0.1% at full size)."""
    mk, parts, shapes, r = KINDS[case.kind].memory_kind, parts_of(case.kind, scale), shapes_of(case, scale), 0
    den, r = parts["denoiser"], lora_rank(case)
    if mk not in ("flux", "qwen", "flux2", "flux2_dev", "wan", "wan22", "wan22_a14b"):
        return None
    d = den["num_attention_heads"] * den["attention_head_dim"]
    n_txt, d_txt = shapes.cond["prompt_embeds"]
    if mk in ("flux", "qwen"):  # joint attention on image and text tokens; every block 24 n d^2
        n_img, c_in = shapes.latent
        n, f, p = n_img + n_txt, 4 * d, den["patch_size"]
        layers = den["num_layers"] + den.get("num_single_layers", 0)
        c_out = p * p * (den.get("out_channels") or c_in)
        base = 2 * n_img * c_in * d + 2 * n_txt * d_txt * d + 2 * n_img * d * c_out
        base += layers * (2 * n * (4 * d * d + 2 * d * f) + 4 * n * n * d)
        lora = 4 * r * d * n * (4 * den["num_layers"] + 3 * den.get("num_single_layers", 0))
    elif mk in memory.FLUX2_KINDS:  # a SwiGLU MLP of 3d; every block 26 n d^2; single blocks' fused Linears
        n_img, c_in = shapes.latent
        n = n_img + n_txt
        base = 2 * n_img * c_in * d + 2 * n_txt * d_txt * d + 2 * n_img * d * c_in
        base += (den["num_layers"] + den["num_single_layers"]) * (2 * n * 13 * d * d + 4 * n * n * d)
        lora = 4 * r * d * n * 4 * den["num_layers"] + 2 * r * n * (10 * d + 5 * d) * den["num_single_layers"]
    else:  # Wan: self-attention over the video's patches, cross-attention to the text, a d -> ffn -> d MLP
        c, frames, h, w = shapes.latent
        pt, ph, pw = den["patch_size"]
        n, f, patch = (frames // pt) * (h // ph) * (w // pw), den["ffn_dim"], pt * ph * pw
        base = 2 * n * c * patch * d + 2 * n_txt * (d_txt + d) * d + 2 * n * d * den["out_channels"] * patch
        base += den["num_layers"] * (2 * n * (6 * d * d + 2 * d * f) + 2 * n_txt * 2 * d * d + 4 * n * n * d
                                     + 4 * n * n_txt * d)  # fmt: skip
        if mk == "wan22":  # one timestep per token: its embedding (freq -> d -> d) and modulation (d -> 6d)
            base += 2 * n * (den["freq_dim"] * d + d * d + 6 * d * d)
        lora = 4 * r * d * den["num_layers"] * (6 * n + 2 * n_txt)
    return float(base + lora)


# ---------------------------------------------------------------------------------------------------
# The plan: memory.py's peak, FLOP and parameter counts per case, at the GPU's shapes, keyed
# ---------------------------------------------------------------------------------------------------
def plan_key(case: Case, tiny: bool) -> dict:
    """What a case's plan depends on (compared as JSON reads it back): the parts, the size, the flags."""
    scale = "tiny" if tiny else case.scale
    key = {
        "parts": parts_of(case.kind, scale),
        "size": size_of(case, tiny),
        "flags": case_flags(case, tiny, Path("OUT")),
    }
    return json.loads(json.dumps(key, default=str))


def plan_case(case: Case, tiny: bool = False, memory_plan: bool = True, say=print) -> dict:
    """One case's plan: memory.estimate's peak (GB) for its script and flags with its model_config, and the counts."""
    scale = "tiny" if tiny else case.scale
    entry = {"key": plan_key(case, tiny), "flops": count_flops(case, scale), "parts": count_params(case, scale)}
    entry["expected_forward"] = expected_flops(case, scale)
    if memory_plan:
        flags = case_flags(case, tiny, Path("OUT"))
        flags[flags.index("--model-id") + 1] = str(_index_folder(case))
        est = memory.estimate(case.script, flags, model_config=model_config(case.kind, scale))
        entry |= {"memory_gb": est["peak"], "memory_phase": est["peak_phase"]}
        say(f"planned {case.call}/{case.name}: {est['peak']:.3g} GB ({est['peak_phase']})")
    return entry


def _index_folder(case: Case) -> Path:
    """A folder with the kind's model_index.json, for memory.model_kind (under the system's temporary folder)."""
    import tempfile

    out = Path(tempfile.gettempdir()) / "gpu_check_index"
    write_model_folder(case, out)
    return out / "models" / case.kind


def read_plan(path: Path | None) -> dict:
    """The plan in `path` ({} if there is none)."""
    if path is None or not Path(path).is_file():
        return {}
    return json.loads(Path(path).read_text())


def plan_for(plan: dict, case: Case, tiny: bool) -> dict | None:
    """The plan's entry of `case`, if it was made for the case's current parts, size and flags."""
    entry = plan.get(f"{case.call}/{case.name}" + ("/tiny" if tiny else ""))
    return entry if entry and entry.get("key") == plan_key(case, tiny) else None


# ---------------------------------------------------------------------------------------------------
# The timing model: each case's and each call's GPU seconds, before the GPU is lent
# ---------------------------------------------------------------------------------------------------
TIMING = {
    # assumed, for an H100 / H200 SXM (989 TFLOP/s dense bf16): what fraction of it each kind of work reaches
    "peak_tflops": 989.4,
    "mfu_rollout": 0.45,  # no-grad denoiser forwards of a full-size model (bf16 matmuls and flash attention)
    "mfu_train": 0.35,  # forward + backward with LoRA, gradient checkpointing's recomputed forward on top (below)
    "mfu_small": 0.15,  # the same at 2 blocks of each type or under 1B parameters: launches and small GEMMs
    "mfu_vae": 0.15,  # VAE decodes (convolutions, group norms; Wan's VAE in float32: TF32)
    "recompute": 1.0,  # gradient checkpointing: one more forward per training forward
    "launch_s_per_block": 4e-4,  # a forward's kernel launches per block: the floor of a small model's forward
    # fixed costs (seconds), set from the one GPU run so far (docs/gpu_check.md: its scripts' start-up and first iteration)
    "start_s": 15.0,  # the process: imports, the CUDA context, the matmul peak (the H200 run: a script's 40 s start
    # was mostly reading 28 GB of weights and the reward's checkpoint, at about 1 GB/s, which the kit does not do)
    "environment_s": 2.0,
    "probe_s": 60.0,  # benchmarks/gpu/sdpa_probe.py, every kind and kernel: one process per kernel ("about a minute")
    "case_s": 3.0,  # a script's set-up around its model: Accelerator, run folder, logs, prompts, the reward's build
    "first_iteration_s": 6.0,  # a kind's first iteration in a call (new shapes): kernel loading, cuBLAS / cuDNN
    # heuristics, the offload's first trips; a later case of the same kind and size (call 2) does not pay it
    "first_call_s": 10.0,  # once per process: the first CUDA work (lazy module loading, cuBLAS workspace, allocator)
    "init_gb_s": 100.0,  # building weights on the GPU: bytes initialised per second (random fill, kaiming)
    "modules_s": 2.0,  # building a model's modules on the meta device (Python), per model
    "pcie_gb_s": 12.0,  # --offload-frozen: the frozen parts' trips to and from the GPU, twice per iteration
    "release_s": 1.0,  # gc and empty_cache after a case
    "text_flop_per_token_param": 2.0,  # text encoders: 2 FLOPs per parameter per token (at mfu_rollout)
}


def case_work(entry: dict, rows: dict) -> dict:
    """The FLOPs a case does: its rows (the rehearsal's or the GPU's own count: the same flags give the same rows)
    x the counted FLOPs of one row."""
    f = entry["flops"]
    return {
        "rollout_flop": rows["nograd_rows"] * f["forward"],
        "train_flop": rows["grad_rows"] * f["train"],
        "recompute_flop": rows["grad_rows"] * f["forward"],
    }


def estimate_case(case: Case, entry: dict, rows: dict, timing: dict = TIMING, new_shapes: bool = True) -> dict:
    """GPU seconds of one case by the timing model: building its weights, its FLOPs at the assumed MFU (a small model
    at mfu_small, each forward at least its launches), the VAE's decodes, the text encoders, the offload trips, the
    fixed costs (`new_shapes`: the first iteration on the kind's shapes in this call). `rows`: nograd_rows,
    grad_rows, samples (decoded samples), prompts (encoded), forwards (denoiser calls)."""
    t, peak = dict(timing), timing["peak_tflops"] * 1e12
    f, p = entry["flops"], entry["parts"]
    small = f["params"] < 1.5e9 or case.scale == "reduced"
    experts = 2 if KINDS[case.kind].memory_kind == "wan22_a14b" else 1
    work = case_work(entry, rows)
    mfu_r, mfu_t = (t["mfu_small"], t["mfu_small"]) if small else (t["mfu_rollout"], t["mfu_train"])
    rollout = work["rollout_flop"] / (mfu_r * peak)
    train = (work["train_flop"] + t["recompute"] * work["recompute_flop"]) / (mfu_t * peak)
    blocks = sum(v for k, v in parts_of(case.kind, case.scale)["denoiser"].items() if k in ("num_layers",
                 "num_single_layers", "n_layers", "n_refiner_layers")) or 16  # fmt: skip
    floor = rows.get("forwards", 0) * blocks * t["launch_s_per_block"] * 3  # forward, backward, recompute: at most 3x
    weights_gb = 2 * (f["params"] * experts + p["text"] + p["vae"]) / 1e9 + 4 * 1.0  # bf16 parts, fp32 HPS (1B)
    build = weights_gb / t["init_gb_s"] + t["modules_s"]
    decode = rows.get("samples", 0) * p["decode"] / (t["mfu_vae"] * peak)
    text_flop = rows.get("prompts", 0) * text_tokens(case) * p["text"] * t["text_flop_per_token_param"]
    text = text_flop / (t["mfu_rollout"] * peak)
    frozen_gb = (2 * (p["text"] + p["vae"]) + 4 * 1e9) / 1e9  # bf16 text encoders and VAE, the fp32 HPS
    offload = 2 * frozen_gb / t["pcie_gb_s"] if case.call == 2 else 0.0  # to the GPU and back, once an iteration
    fixed = t["case_s"] + t["first_iteration_s"] * new_shapes + t["release_s"]
    parts = {"build": build, "rollout": max(rollout, floor / 3), "train": max(train, floor * 2 / 3),
             "decode": decode, "text": text, "offload": offload, "fixed": fixed}  # fmt: skip
    return {"total_s": sum(parts.values()), **{f"{k}_s": v for k, v in parts.items()}, **work}


def text_tokens(case: Case) -> int:
    """Tokens per prompt through the text encoders (memory.py's padded lengths)."""
    return sum(n for _, _, n in parts_of(case.kind, case.scale)["text"])


def estimate_call(call: int, cases: dict[str, dict], timing: dict = TIMING) -> dict:
    """A call's GPU seconds: start-up, (call 1) the environment and the probe, the first CUDA work, its cases."""
    fixed = (
        timing["start_s"] + timing["first_call_s"] + (timing["environment_s"] + timing["probe_s"] if call == 1 else 0)
    )
    total = fixed + sum(c["total_s"] for c in cases.values())
    return {"call": call, "fixed_s": fixed, "cases_s": total - fixed, "total_s": total, "limit_s": CALL_LIMIT_S[call]}
