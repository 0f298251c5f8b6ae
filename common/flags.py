"""The flags every training script shares, and their checks: everything about the command line, written once.

RunArgs                  the shared flags (each script's Args extends it)
cli(main, Args)          parse the flags (tyro; parse_flags: a flag that does not parse is one `error:` line) and run
                         main; an InputError becomes one `error:` line and exit status 2, a RunError or a refused
                         write one `error:` line and exit status 1
check_run_args(args)     the shared flags, and every input that can be checked before a model loads: prompt
                         files, --output-dir, --model-id, the rewards (parsed once), --resume-from
check_flags(args, mode_flags)        every float flag finite (nan and inf refused before any check reads them),
                         every number in its declared range, --shift's default by model, and a flag of a mode not
                         in use refused (no dead flags: check_mode_flags)
check_ranges(args), need(ok, message), AllowInf   common/cli.py's, imported from here by the scripts: every flag
                         within the range its declaration gives (Ge, Gt, Le, Lt of annotated-types, written beside
                         the flag: `clip_range: Annotated[float, Gt(0)] = 1e-3`); InputError(message) unless ok
divides(d, n)            a check of a batch size that takes 0
ModeDefault(text)        --help shows `text` as the default of a flag whose default depends on the mode
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

import diffusers
import tyro
from annotated_types import Ge, Gt, Le, Lt  # the range of a flag, declared beside it; check_ranges reads them

from common import InputError, RunError
from common.cli import AllowInf as AllowInf  # the scripts import every flag helper from here
from common.cli import check_numbers, check_ranges, need
from common.cli import flag_metadata as flag_metadata
from common.cli import parse_flags as parse_command_line
from common.edits import check_edit_prompts
from common.models import check_model_id, check_num_frames, has_two_experts, is_video, registered
from common.prompts import HPDV2_HOWTO, SOURCES, load_prompts
from common.rewards import RewardSpec, check_reward_prompts, check_rewards, check_shapesbench_prompts, parse_rewards


def ModeDefault(text: str):
    """Annotated[Optional[T], ModeDefault("0.3 with --sde-type dance, 0.7 with flow")] = None: a flag whose default
    depends on other flags (None until the script's resolve_and_check fills it in), and --help says which."""
    return tyro.conf.arg(help_behavior_hint=f"(default: {text})")


@dataclass
class RunArgs:
    """The flags every script shares (the model, the reward, the prompts, the run around the algorithm); each
    script's Args adds its algorithm's flags. The optimiser defaults are ShapesBench's (LoRA r32, lr 3e-4, 10-step
    warmup, no weight decay, 40 iterations; dancegrpo.py and branchgrpo.py double the learning rate): Adam moves every
    trained weight by about the learning rate per step whatever the gradient, and the low-rank adapter keeps that
    drift near the base model where full fine-tuning collapses it (docs/experiments.md). The real-model recipes
    (run.sh, the scripts' docstrings) pass the papers' values."""

    exp_name: Annotated[Optional[str], ModeDefault("the script's file name and mode")] = None
    """run name, e.g. dancegrpo_mix, branchgrpo_depth (a copied script is its own run family); the run folder is
    {output_dir}/{exp_name}__{seed}__{unix time}"""
    seed: Annotated[int, Ge(0), Lt(2**63)] = 0
    """seed of every random draw (prompts, noise, trained steps, initial weights of LoRA)"""
    output_dir: str = "runs"
    """parent folder of the run folder (TensorBoard logs, sample grids, checkpoints, final weights)"""
    model_id: str = "shapesbench"
    """'shapesbench' (shipped, CPU-sized), or a diffusers FLUX.1 / SD3.5 / Wan2.1 text-to-video (SD1.x for rlr.py)
    folder or hub id; any other model needs --prompts, --eval-prompts and --reward (the ShapesBench defaults are
    refused)"""
    resolution: Annotated[Optional[int], ModeDefault("the model's native size"), Ge(8), Le(8192)] = None
    """square image side in pixels (native video sizes: Wan2.1 and A14B 480 x 832, Wan2.2-TI2V-5B 704 x 1280)"""
    num_frames: Annotated[Optional[int], ModeDefault("the model's own"), Ge(1), Le(1025)] = None
    """video models (Wan) only: frames per video, 4k + 1 (Wan2.1's own: 81 = 5 s at 16 fps; Wan2.2-TI2V-5B's: 121 =
    5 s at 24 fps)"""
    reward_frames: Annotated[int, Ge(1), Le(1025)] = 4
    """video models only: an image reward (hpsv2.1, clip, ...) scores this many evenly spaced frames of each video,
    the first and the last among them, and gives their mean"""
    lora: bool = True
    """train a LoRA adapter (peft) instead of all transformer weights (--no-lora: all of them)"""
    experts: Literal["both", "high", "low"] = "both"
    """Wan2.2-T2V-A14B only: the expert(s) trained, each on the steps the pipeline gives it (high: sigma >= 0.875,
    `transformer`; low: the rest, `transformer_2`); with one, the other stays frozen and its steps carry no gradient"""
    lora_rank: Annotated[int, Ge(1), Le(4096)] = 32
    """LoRA rank (with --lora)"""
    lora_alpha: Annotated[float, Gt(0)] = 64.0
    """LoRA alpha (with --lora)"""
    mixed_precision: Literal["no", "bf16"] = "no"
    """'bf16' runs forwards under autocast and loads the frozen weights in bf16 (with --lora only the adapter is
    fp32); log-probs, samples and trained weights stay fp32"""
    gradient_checkpointing: bool = False
    """recompute the denoiser's activations in the backward (diffusers): the same gradients in less memory, for
    one more forward per backward; on in every GPU recipe of run.sh"""
    attention_backend: Literal["auto", "flash", "efficient", "math", "cudnn"] = "auto"
    """kernels of scaled_dot_product_attention for the whole process (common/attention.py): auto = flash,
    memory-efficient or math (cuDNN's is off: its backward failed on an H200 at FLUX.1-dev's shapes, docs/gpu.md);
    cudnn = torch's own order; python -m common.evaluate takes the same flag (the same choice reproduces a run)"""
    offload_frozen: bool = False
    """keep the text encoders, the VAE and the reward models on the CPU except while they encode, decode and score
    (docs/gpu.md: which recipes need it)"""
    reward: str = "shapes"
    """reward spec 'name:weight,...', e.g. 'shapes:1.0,verifier:0.5' or 'hpsv2.1' ('shapes' and 'verifier' are
    ShapesBench's and hold only for --model-id shapesbench)"""
    reward_ckpt: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """NAME=PATH per reward model, e.g. hpsv2.1=/ckpt/HPS_v2.1_compressed.pt; one flag per reward (repeat it)"""
    reward_url: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """NAME=URL per reward scored by another process: a VLM judge (unifiedreward, ocr_judge) behind an OpenAI-compatible
    server, e.g. unifiedreward=http://host:8000/v1, or any reward hosted by `python -m common.rewards serve`
    (docs/models.md); one flag per reward (repeat it); token, if any, from $REWARD_API_KEY"""
    prompts: str = "shapes-train"
    """training prompts: 'shapes-train' (--model-id shapesbench only; with shapesbench-edit its edits), a text file, one
    prompt per line (HPDv2's: `python -m common.prompts hpdv2 FILE`), or an edit file (docs/editing.md)"""
    eval_prompts: str = "shapes-eval"
    """held-out prompts: 'shapes-eval' (--model-id shapesbench only; with shapesbench-edit its edits), a text file, one
    prompt per line, or an edit file"""
    eval_max_prompts: Annotated[int, Ge(1)] = 48
    """evaluate on at most N held-out prompts, evenly spaced through the list: a fixed subset (ShapesBench's split
    has exactly 48)"""
    iterations: Annotated[int, Ge(1), Le(1_000_000)] = 40
    """training iterations (one rollout + its updates each)"""
    learning_rate: Annotated[float, Gt(0), Le(1)] = 3e-4
    """AdamW learning rate (constant after --lr-warmup)"""
    lr_warmup: Annotated[int, Ge(0)] = 10
    """linear learning-rate warmup over the first N optimizer steps (0 = none): Adam's first steps move every weight
    by about the learning rate whatever the gradient, which can knock a small model out of its skills"""
    weight_decay: Annotated[float, Ge(0), Le(1)] = 0.0
    """AdamW weight decay; with LoRA it pulls the adapter towards 0, i.e. the model towards the base model (0 = off)"""
    max_grad_norm: Annotated[float, Gt(0)] = 1.0
    """gradient clipping norm per optimizer step"""
    guidance_scale: Annotated[float, Ge(0), Le(100)] = 1.0
    """CFG scale for ShapesBench / SD3.5 (<= 1 = off; HunyuanVideo-1.5 guides at every scale but 1, as its pipeline),
    embedded guidance for FLUX.1-dev (3.5 there); same in training"""
    guidance_scale_2: Annotated[Optional[float], ModeDefault("the same as --guidance-scale"), Ge(0), Le(100)] = None
    """Wan2.2-T2V-A14B only: the CFG scale of the low-noise expert (WanPipeline's guidance_scale_2; Wan's own setting
    is 4 for the high-noise expert, 3 for the low-noise one); needs --guidance-scale > 1, as the pipeline's CFG"""
    shift: Annotated[
        Optional[Union[float, Literal["pipeline"]]], ModeDefault("'pipeline'; 3 on ShapesBench"), Gt(0), Le(100)
    ] = None
    """the sigma schedule of the flow models' rollouts and evaluation: a number k warps linspace(1, 0, T + 1) by the
    SD3 time shift s' = k s / (1 + (k - 1) s) (3: SD3.5's scheduler, DanceGRPO's and BranchGRPO's FLUX.1 setting);
    'pipeline' is the grid the model's own diffusers pipeline builds for this size and step count: mu by the image's
    tokens for FLUX.1 and Qwen-Image (whose last sigma is 0.02), by tokens and steps for FLUX.2, the static shift of
    Z-Image's, Wan's and SD3's configs (docs/models.md). The default: the pipeline's grid, which the model was trained
    to sample on; ShapesBench, which has no pipeline of its own, the static 3; not for SD1.x (DDIM timesteps)"""
    eval_every: Annotated[int, Ge(0)] = 50
    """evaluate on --eval-prompts every N iterations (and at the start and the end); 0 = never"""
    eval_samples_per_prompt: Annotated[int, Ge(1), Le(10000)] = 4
    """samples per held-out prompt in evaluation (fixed seeds, ODE)"""
    eval_steps: Annotated[int, Ge(1), Le(10000)] = 20
    """Euler ODE steps in evaluation"""
    sample_every: Annotated[int, Ge(0)] = 25
    """write a fixed-seed sample grid PNG every N iterations; 0 = never"""
    save_every: Annotated[int, Ge(0)] = 25
    """accelerate save_state checkpoint every N iterations; 0 = only at the end"""
    save: bool = True
    """write checkpoints and the final weights (--no-save: neither, for benchmarks and checks; such a run cannot be
    resumed)"""
    checkpoints_total_limit: Annotated[int, Ge(1)] = 2
    """keep only the newest N checkpoints"""
    resume_from: Optional[str] = None
    """'latest' (the newest run of --exp-name in --output-dir), a run folder, or one of its checkpoints/iter_* folders"""
    track: bool = False
    """also log to Weights & Biases (needs `pip install wandb`)"""
    wandb_project_name: str = "diffusion-rl"
    """W&B project (with --track)"""


# errors of the file system a run writes to: they are the machine's, not the code's, and need no traceback
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS)


def cli(main, args_type) -> None:
    """`main(tyro.cli(args_type))`. An InputError (bad flag, file, folder) prints `error: ...` and exits with status
    2; a RunError or a write refused by the file system (full disk, no permission) prints `error: ...` and exits with
    status 1; neither has a traceback. Every other exception is a bug and keeps its traceback."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        args = parse_flags(args_type)  # --help prints and exits here
        import transformers  # heavy: imported once the flags parse, so that --help does not wait for it

        transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars of every tiny part: noise
        diffusers.utils.logging.disable_progress_bar()
        main(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except OSError as e:
        if e.errno not in DISK_ERRORS:
            raise
        print(f"error: cannot write {e.filename or 'the run folder'}: {e.strerror}", file=sys.stderr)
        sys.exit(1)


def parse_flags(args_type, argv: list[str] | None = None, command: str | None = None):
    """common.cli.parse_flags with a script's own flags listed first (own_flags_first)."""
    return parse_command_line(args_type, argv, command, own_flags_first())


@contextlib.contextmanager
def own_flags_first():
    """While parsing, a script's Args lists its own flags (the algorithm's) before the shared RunArgs ones, in --help
    too: a dataclass orders a base class's fields first, and a reader looks for the algorithm's flags first."""
    registry, busy = tyro.constructors.ConstructorRegistry(), []

    @registry.struct_rule
    def reorder(info):
        if busy or not (isinstance(info.type, type) and issubclass(info.type, RunArgs)) or info.type is RunArgs:
            return None
        busy.append(True)  # ask tyro's own rules for the fields, without this one
        try:
            spec = tyro.constructors.ConstructorRegistry.get_struct_spec(info)
        finally:
            busy.pop()
        scripts = info.type.__mro__[: info.type.__mro__.index(RunArgs)]  # Args, and the classes between it and RunArgs
        own = {name for c in scripts for name in vars(c).get("__annotations__", {})}  # learning_rate's new default too
        return dataclasses.replace(spec, fields=tuple(sorted(spec.fields, key=lambda f: f.name not in own)))

    with registry:
        yield


# ---------------------------------------------------------------------------------------------------
# Checks of the shared flags, before any model loads
# ---------------------------------------------------------------------------------------------------
def check_run_args(args, video: bool = True, differentiable: bool = False) -> tuple[list[str], list[str], RewardSpec]:
    """Check the flags every script shares; `video`: whether the script trains video models; `differentiable`: whether
    it backpropagates through the reward. Returns (training
    prompts, held-out prompts, the parsed --reward), read here so that a bad prompt file or reward fails before a
    model loads (the Evaluator takes its --eval-max-prompts subset)."""
    check_ranges(args)  # again: the mode defaults the script filled in since check_flags (--noise-level, ...)
    out = Path(args.output_dir).expanduser()
    need(not out.exists() or out.is_dir(), f"--output-dir {args.output_dir}: exists and is not a folder")
    need(
        not out.is_symlink() or out.is_dir(),
        f"--output-dir {args.output_dir}: a symbolic link to no folder (dangling or looping); give a folder",
    )
    if args.track:
        need(importlib.util.find_spec("wandb") is not None, "--track needs wandb: pip install wandb")
    if args.resume_from not in (None, "latest"):
        need(
            Path(args.resume_from).is_dir(),
            f"--resume-from {args.resume_from}: no such folder (give 'latest', a run "
            "folder or one of its checkpoints/iter_* folders)",
        )
    kind = check_model_id(args.model_id)
    shapesbench = kind in ("shapes", "shapes-edit")  # ShapesBench or its edit task: its prompts and rewards hold
    if not shapesbench:
        check_not_shapesbench(args)
    moving = is_video(kind)
    need(
        video or not moving,
        f"--model-id {args.model_id} is a video model ({kind}), and {Path(sys.argv[0]).name} trains image models only "
        "(as its paper); train video with dancegrpo.py, branchgrpo.py or vgrpo.py",
    )
    check_mode_flags(args, [(f, lambda a: moving, "a video model (Wan2.1)") for f in ("num_frames", "reward_frames")])
    two = moving and has_two_experts(args.model_id)
    check_mode_flags(args, [("experts", lambda a: two, "a two-expert Wan2.2-T2V-A14B")])
    check_guidance_scale_2(args, two)
    check_mode_flags(args, [("shift", lambda a: kind != "sd1", "a flow model (SD1.x samples DDIM timesteps)")])
    check_shift(args.shift, kind)
    if args.num_frames is not None:
        check_num_frames(args.num_frames)
    rewards = parse_rewards(args.reward, args.reward_ckpt, args.reward_url)  # parsed once; every later step reads it
    check_rewards(rewards, moving, None if shapesbench else args.model_id, args.num_frames, differentiable)
    edits = kind == "shapes-edit"  # 'shapes-train' and 'shapes-eval' are then ShapesBench-Edit's splits
    train = load_prompts(args.prompts, "--prompts", edits)
    held_out = load_prompts(args.eval_prompts, "--eval-prompts", edits)
    for prompts, flag in ((train, "--prompts"), (held_out, "--eval-prompts")):
        check_edit_prompts(prompts, registered(kind).images, flag, args.model_id)
    check_reward_prompts(rewards, train, "--prompts"), check_reward_prompts(rewards, held_out, "--eval-prompts")
    if shapesbench:  # the evaluation's verifier figures and the sample grids' badges read the held-out prompts
        check_shapesbench_prompts(held_out, "--eval-prompts")
    return train, held_out, rewards


def check_guidance_scale_2(args, two_experts: bool) -> None:
    """--guidance-scale-2 only on a two-expert Wan2.2-T2V-A14B, and with --guidance-scale > 1 (WanPipeline's CFG)."""
    check_mode_flags(args, [("guidance_scale_2", lambda a: two_experts, "a two-expert Wan2.2-T2V-A14B")])
    need(
        args.guidance_scale_2 is None or args.guidance_scale > 1,
        "--guidance-scale-2 needs --guidance-scale > 1: WanPipeline guides (with either scale) only then",
    )


def default_shift(kind: str) -> float | str | None:
    """--shift's default for a model kind: its diffusers pipeline's own grid ('pipeline'), ShapesBench's static 3
    (it has no pipeline), none for SD1.x (DDIM timesteps, no shift)."""
    return {"shapes": 3.0, "sd1": None}.get(kind, "pipeline")


def check_shift(shift, kind: str) -> None:
    """--shift 'pipeline' only on a model with a diffusers pipeline of its own (not ShapesBench); a number's range is
    its declaration's (check_ranges)."""
    need(
        shift != "pipeline" or kind != "shapes",
        "--shift pipeline: ShapesBench has no diffusers pipeline of its own; give a number (3)",
    )


def check_mode_flags(args, mode_flags) -> None:
    """No dead flags: each (flag, applies(args), mode) of `mode_flags` is an error if the flag is set to other than
    its default while its mode is off."""
    for flag, applies, mode in mode_flags:
        default = type(args).__dataclass_fields__[flag].default
        need(getattr(args, flag) == default or applies(args), f"--{flag.replace('_', '-')} only applies with {mode}")


def divides(d: int, n: int) -> bool:
    """Whether the whole number d >= 1 divides n (a batch size of 0 divides nothing, and raises nothing)."""
    return d >= 1 and n % d == 0


def check_flags(args, mode_flags) -> None:
    """First of a script's checks: every float flag a finite number (inf where its declaration has AllowInf), so that
    nan, which fails every comparison and which min() skips unless it comes first, and inf, which passes `> 0`,
    reach no other check; then every number within its declared range (check_ranges), so that no check computes
    with a huge or negative one; then --shift's default filled in (default_shift) and no dead flags
    (check_mode_flags)."""
    check_numbers(args)
    if isinstance(args, RunArgs) and args.shift is None:  # before the script's checks read it
        args.shift = default_shift(check_model_id(args.model_id))
    check_mode_flags(args, mode_flags)


def check_not_shapesbench(args) -> None:
    """A real model never falls back on ShapesBench's prompts: a missing --prompts or --eval-prompts (or a ShapesBench
    value of one) fails here, before any model loads, naming the flag (its reward: check_rewards)."""
    where = f"ShapesBench's, for --model-id shapesbench only; with --model-id {args.model_id}"
    for flag, value in (("--prompts", args.prompts), ("--eval-prompts", args.eval_prompts)):
        need(
            value not in SOURCES,
            f"{flag} {value}: these prompts are {where} pass {flag} FILE, one prompt per line ({HPDV2_HOWTO})",
        )
