"""Run plumbing shared by the four training scripts: everything around the algorithm, written once.

    RunArgs                    the flags every script shares (each script's Args extends it)
    cli(main, Args)            parse the flags (tyro); an InputError becomes one line on stderr and exit status 2
    check_run_args(args)       the flags every script shares, and every input that can be checked before a model
                               loads: prompt files, --output-dir, --model-id, reward names and weights, --resume-from
    Run(args, accelerator)     the run folder {output_dir}/{exp_name}__{seed}__{unix time} (CleanRL's naming), resume,
                               metrics.jsonl + TensorBoard (+ W&B), checkpoints with rotation, the final weights
    Evaluator                  held-out evaluation and the fixed-seed sample grid
    sample_ode                 deterministic Euler sampler of a flow model, for evaluation and grids

What the scripts keep: the algorithm (rollout with log-probs, rewards to advantages, the loss, the update).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Literal, Optional

import torch
import tyro
from tqdm import tqdm

from common import InputError, RunError
from common.sampling import fixed_noise, keyed_generator, ode_sampler, sample_prompts, sigma_schedule


@dataclass
class RunArgs:
    """The flags every script shares (the model, the reward, the prompts, the run around the algorithm); each
    script's Args adds its algorithm's flags. The optimiser defaults are ShapesBench's (LoRA r32, lr 3e-4, 10-step
    warmup, no weight decay, 40 iterations; dancegrpo.py and branchgrpo.py double the learning rate): Adam moves every
    trained weight by about the learning rate per step whatever the gradient, and the low-rank adapter keeps that
    drift near the base model where full fine-tuning collapses it (docs/experiments.md). The real-model recipes
    (run.sh, the scripts' docstrings) pass the papers' values."""

    exp_name: Optional[str] = None
    """run name (if unset: the script's file name and mode, e.g. dancegrpo_mix, branchgrpo_depth: a copied script is its
    own run family); the run folder is {output_dir}/{exp_name}__{seed}__{unix time}"""
    seed: int = 0
    """seed of every random draw (prompts, noise, trained steps, initial weights of LoRA)"""
    output_dir: str = "runs"
    """parent folder of the run folder (TensorBoard logs, sample grids, checkpoints, final weights)"""
    model_id: str = "shapesbench"
    """'shapesbench' (shipped, CPU-sized), or a diffusers FLUX.1 / SD3.5 / Wan2.1 text-to-video (SD1.x for rlr.py)
    folder or hub id; any other model needs --prompts, --eval-prompts and --reward (the ShapesBench defaults are
    refused)"""
    resolution: Optional[int] = None
    """square image side in pixels; None = the model's native size (Wan2.1: 480 x 832)"""
    num_frames: Optional[int] = None
    """video models (Wan2.1) only: frames per video, 4k + 1 (if unset: the model's own, 81 = 5 s at 16 fps)"""
    reward_frames: int = 4
    """video models only: an image reward (hpsv2.1, clip, ...) scores this many evenly spaced frames of each video,
    the first and the last among them, and gives their mean"""
    lora: bool = True
    """train a LoRA adapter (peft) instead of all transformer weights (--no-lora: all of them)"""
    lora_rank: int = 32
    """LoRA rank (with --lora)"""
    lora_alpha: float = 64.0
    """LoRA alpha (with --lora)"""
    mixed_precision: Literal["no", "bf16"] = "no"
    """'bf16' runs forwards under autocast and loads the frozen weights in bf16 (with --lora only the adapter is
    fp32); log-probs, samples and trained weights stay fp32"""
    gradient_checkpointing: bool = False
    """recompute the denoiser's activations in the backward (diffusers): the same gradients in less memory, for
    one more forward per backward; on in every GPU recipe of run.sh"""
    offload_frozen: bool = False
    """keep the text encoders, the VAE and the reward models on the CPU except while they encode, decode and score
    (docs/gpu.md: which recipes need it)"""
    reward: str = "shapes"
    """reward spec 'name:weight,...', e.g. 'shapes:1.0,verifier:0.5' or 'hpsv2.1' ('shapes' and 'verifier' are
    ShapesBench's and hold only for --model-id shapesbench)"""
    reward_ckpt: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """NAME=PATH per reward model, e.g. hpsv2.1=/ckpt/HPS_v2.1_compressed.pt; one flag per reward (repeat it)"""
    reward_url: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """NAME=URL per reward scored by another process: a VLM judge (unifiedreward, ocr) behind an OpenAI-compatible
    server, e.g. unifiedreward=http://host:8000/v1, or any reward hosted by `python -m common.rewards serve`
    (docs/models.md); one flag per reward (repeat it); token, if any, from $REWARD_API_KEY"""
    prompts: str = "shapes-train"
    """training prompts: 'shapes-train' (--model-id shapesbench only) or a text file, one prompt per line
    (HPDv2's: `python -m common.prompts hpdv2 FILE`)"""
    eval_prompts: str = "shapes-eval"
    """held-out prompts: 'shapes-eval' (--model-id shapesbench only) or a text file, one prompt per line"""
    eval_max_prompts: int = 48
    """evaluate on at most N held-out prompts, evenly spaced through the list: a fixed subset (ShapesBench's split
    has exactly 48)"""
    iterations: int = 40
    """training iterations (one rollout + its updates each)"""
    learning_rate: float = 3e-4
    """AdamW learning rate (constant after --lr-warmup)"""
    lr_warmup: int = 10
    """linear learning-rate warmup over the first N optimizer steps (0 = none): Adam's first steps move every weight
    by about the learning rate whatever the gradient, which can knock a small model out of its skills"""
    weight_decay: float = 0.0
    """AdamW weight decay; with LoRA it pulls the adapter towards 0, i.e. the model towards the base model (0 = off)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm per optimizer step"""
    guidance_scale: float = 1.0
    """CFG scale for ShapesBench / SD3.5 (1 = off), embedded guidance for FLUX.1-dev (3.5 there); same in training"""
    eval_every: int = 50
    """evaluate on --eval-prompts every N iterations (and at the start and the end); 0 = never"""
    eval_samples_per_prompt: int = 4
    """samples per held-out prompt in evaluation (fixed seeds, ODE)"""
    eval_steps: int = 20
    """Euler ODE steps in evaluation"""
    sample_every: int = 25
    """write a fixed-seed sample grid PNG every N iterations; 0 = never"""
    save_every: int = 25
    """accelerate save_state checkpoint every N iterations; 0 = only at the end"""
    save: bool = True
    """write checkpoints and the final weights (--no-save: neither, for benchmarks and checks; such a run cannot be
    resumed)"""
    checkpoints_total_limit: int = 2
    """keep only the newest N checkpoints"""
    resume_from: Optional[str] = None
    """'latest' (the newest run of --exp-name in --output-dir), a run folder, or one of its checkpoints/iter_* folders"""
    track: bool = False
    """also log to Weights & Biases (needs `pip install wandb`)"""
    wandb_project_name: str = "diffusion-rl"
    """W&B project (with --track)"""

    def reward_checkpoints(self) -> dict[str, str]:
        """The --reward-ckpt NAME=PATH and --reward-url NAME=URL items as {NAME: PATH or URL}."""
        for flag, items, what in (
            ("--reward-ckpt", self.reward_ckpt, "PATH"),
            ("--reward-url", self.reward_url, "URL"),
        ):
            for item in items:
                need("=" in item, f"{flag} {item!r}: expected NAME={what}")
        urls = dict(item.split("=", 1) for item in self.reward_url)
        for name, url in urls.items():
            need(url.startswith(("http://", "https://")), f"--reward-url {name}={url}: expected an http(s):// URL")
        paths = dict(item.split("=", 1) for item in self.reward_ckpt)
        both = sorted(set(paths) & set(urls))
        need(not both, f"{', '.join(both)}: give --reward-ckpt or --reward-url, not both")
        return {**paths, **urls}


def need(ok: bool, message: str) -> None:
    """Raise InputError(message) unless ok; the message names the flag to change."""
    if not ok:
        raise InputError(message)


# errors of the file system a run writes to: they are the machine's, not the code's, and need no traceback
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS)


def cli(main, args_type) -> None:
    """`main(tyro.cli(args_type))`. An InputError (bad flag, file, folder) prints `error: ...` and exits with status
    2; a RunError or a write refused by the file system (full disk, no permission) prints `error: ...` and exits with
    status 1; neither has a traceback. Every other exception is a bug and keeps its traceback."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import diffusers
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars of every tiny part: noise
    diffusers.utils.logging.disable_progress_bar()
    try:
        main(tyro.cli(args_type))  # tyro answers --help and malformed flags itself (exit status 2)
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


# ---------------------------------------------------------------------------------------------------
# Checks of the shared flags, before any model loads
# ---------------------------------------------------------------------------------------------------
def check_run_args(args, video: bool = True) -> tuple[list[str], list[str]]:
    """Check the flags every script shares; `video`: whether the script trains video models. Returns (training
    prompts, held-out prompts), read here so that a bad prompt file fails before a model loads (the Evaluator takes
    its --eval-max-prompts subset)."""
    from common.models import VIDEO_KINDS, check_model_id, check_num_frames
    from common.prompts import load_prompts
    from common.rewards import VIDEO_REWARDS, check_reward_weights, parse_reward_spec

    need(args.iterations >= 1, f"--iterations must be >= 1 (got {args.iterations})")
    need(args.learning_rate > 0, f"--learning-rate must be > 0 (got {args.learning_rate})")
    need(args.lr_warmup >= 0, "--lr-warmup must be >= 0")
    for name in ("eval_every", "sample_every", "save_every"):
        need(getattr(args, name) >= 0, f"--{name.replace('_', '-')} must be >= 0")
    need(
        args.eval_samples_per_prompt >= 1 and args.eval_steps >= 1 and args.eval_max_prompts >= 1,
        "--eval-samples-per-prompt, --eval-steps and --eval-max-prompts must be >= 1",
    )
    need(args.checkpoints_total_limit >= 1, "--checkpoints-total-limit must be >= 1")
    out = Path(args.output_dir).expanduser()
    need(not out.exists() or out.is_dir(), f"--output-dir {args.output_dir}: exists and is not a folder")
    if args.track:
        import importlib.util

        need(importlib.util.find_spec("wandb") is not None, "--track needs wandb: pip install wandb")
    if args.resume_from not in (None, "latest"):
        need(
            Path(args.resume_from).is_dir(),
            f"--resume-from {args.resume_from}: no such folder (give 'latest', a run "
            "folder or one of its checkpoints/iter_* folders)",
        )
    kind = check_model_id(args.model_id)
    if kind != "shapes":
        check_not_shapesbench(args)
    is_video = kind in VIDEO_KINDS
    need(
        video or not is_video,
        f"--model-id {args.model_id} is a video model ({kind}), and {Path(sys.argv[0]).name} trains image models only "
        "(as its paper); train video with dancegrpo.py, branchgrpo.py or vgrpo.py",
    )
    check_mode_flags(args, [(f, lambda a: is_video, "a video model (Wan2.1)") for f in ("num_frames", "reward_frames")])
    need(args.reward_frames >= 1, "--reward-frames must be >= 1")
    if args.num_frames is not None:
        check_num_frames(args.num_frames)
    check_reward_weights(args.reward, args.reward_checkpoints(), video=is_video)
    moving = [name for name, _ in parse_reward_spec(args.reward) if name in VIDEO_REWARDS]
    need(
        not moving or args.num_frames != 1,
        f"--reward {args.reward}: {' and '.join(moving)} compares neighbouring frames, and --num-frames 1 gives one",
    )
    return load_prompts(args.prompts, "--prompts"), load_prompts(args.eval_prompts, "--eval-prompts")


def check_mode_flags(args, mode_flags) -> None:
    """No dead flags: each (flag, applies(args), mode) of `mode_flags` is an error if the flag is set to other than
    its default while its mode is off."""
    for flag, applies, mode in mode_flags:
        default = type(args).__dataclass_fields__[flag].default
        need(getattr(args, flag) == default or applies(args), f"--{flag.replace('_', '-')} only applies with {mode}")


def check_not_shapesbench(args) -> None:
    """A real model never falls back on ShapesBench's prompts or reward: a missing --prompts, --eval-prompts or
    --reward (or a ShapesBench value of one) fails here, before any model loads, naming the flag."""
    from common.prompts import HPDV2_HOWTO, SOURCES

    where = f"ShapesBench's, for --model-id shapesbench only; with --model-id {args.model_id}"
    for flag, value in (("--prompts", args.prompts), ("--eval-prompts", args.eval_prompts)):
        need(
            value not in SOURCES,
            f"{flag} {value}: these prompts are {where} pass {flag} FILE, one prompt per line ({HPDV2_HOWTO})",
        )
    from common.rewards import SHAPESBENCH_REWARDS, parse_reward_spec

    shapes = [name for name, _ in parse_reward_spec(args.reward) if name in SHAPESBENCH_REWARDS]
    need(
        not shapes,
        f"--reward {args.reward}: {' and '.join(shapes)} {'is' if len(shapes) == 1 else 'are'} {where} pass a reward "
        "of real images, e.g. --reward hpsv2.1 (or pickscore, clip, aesthetic, jpeg)",
    )


def evenly_spaced(items: list, n: int) -> list:
    """At most n items, evenly spaced through the list (all of them if there are n or fewer): a fixed subset that
    spans a file sorted by category, as HPDv2's (anime, concept-art, paintings, photo)."""
    return items if len(items) <= n else [items[i * len(items) // n] for i in range(n)]


# ---------------------------------------------------------------------------------------------------
# The run: folder, resume, logging, checkpoints, final weights
# ---------------------------------------------------------------------------------------------------
class TrainState:
    """The loop counters (iterations, optimizer steps), saved inside accelerate checkpoints (register_for_checkpointing)."""

    def __init__(self):
        self.iteration = self.optimizer_steps = 0

    def state_dict(self):
        return {"iteration": self.iteration, "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, d):
        self.iteration, self.optimizer_steps = d["iteration"], d.get("optimizer_steps", 0)


def _save_trained_only(models, weights, output_dir) -> None:
    """accelerate save_state hook (--lora): keep only the trained parameters of each model's state dict, and write the
    adapter's configuration (rank, alpha, targets) next to them as adapter_config.json, so that a checkpoint alone is
    a loadable adapter (python -m common.evaluate reads it)."""
    for i, model in enumerate(models):
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        weights[i] = {k: v for k, v in weights[i].items() if k in trained}
    from accelerate import PartialState

    config = getattr(getattr(models[0], "module", models[0]), "peft_config", {}).get("default")
    if config is not None and PartialState().is_main_process:
        (Path(output_dir) / "adapter_config.json").write_text(json.dumps(config.to_dict(), default=sorted))


def _load_trained_only(models, input_dir) -> None:
    """accelerate load_state hook (--lora): load the trained parameters saved by _save_trained_only (the frozen base
    comes from --model-id) and take the models off accelerate's own, strict, loading."""
    from safetensors.torch import load_file

    for i, model in enumerate(models):
        state = load_file(Path(input_dir) / ("model.safetensors" if i == 0 else f"model_{i}.safetensors"))
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        if set(state) != trained:
            raise ValueError(f"the checkpoint's {len(state)} tensors are not this run's {len(trained)} trained ones")
        model.load_state_dict(state, strict=False)
    models.clear()


def _newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint: checkpoints are written under a hidden name and renamed to iter_N when
    complete (Run.checkpoint), so an iter_N folder is never a partial one."""
    return max((d for d in (run_dir / "checkpoints").glob("iter_*") if d.is_dir()), default=None)


def read_metrics(path) -> list[dict]:
    """The records of a metrics.jsonl (a file or its run folder), in order. A last line cut short by a crash or a
    full disk is skipped; after a resume the file holds each iteration once (Run.resume)."""
    path = Path(path)
    path = path / "metrics.jsonl" if path.is_dir() else path
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _fsync(*paths: Path) -> None:
    """Flush files or folders (their entries) to disk: a checkpoint renamed complete must not lose its data to a
    machine crash."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def resolve_resume(output_dir: str, exp_name: str, resume_from: str) -> tuple[Path, Path]:
    """--resume-from -> (run folder, checkpoint folder). 'latest': the newest checkpoint of the newest run named
    {exp_name}__* under output_dir; a run folder: its newest checkpoint; a checkpoints/iter_* folder: that one."""
    if resume_from == "latest":
        runs = [d for d in Path(output_dir).glob(f"{exp_name}__*") if _newest_checkpoint(d) is not None]
        need(
            bool(runs),
            f"--resume-from latest: no run named {exp_name}__* with checkpoints in {output_dir} "
            "(check --exp-name and --output-dir)",
        )
        run_dir = max(runs, key=lambda d: (d.name.rsplit("__", 1)[-1].zfill(12), d.name))
        return run_dir, _newest_checkpoint(run_dir)
    path = Path(resume_from)
    if path.name.startswith("iter_") and path.parent.name == "checkpoints":
        return path.parent.parent, path
    ckpt = _newest_checkpoint(path)
    need(
        ckpt is not None,
        f"--resume-from {resume_from}: neither a run folder with checkpoints/iter_* inside nor a "
        "checkpoints/iter_* folder",
    )
    return path, ckpt


class Run:
    """One training run's folder and everything written into it, on the main process (other processes write
    nothing but their share of sharded checkpoints). Nothing is created before the first write, so a run that fails
    at start-up leaves no empty folder.

        {output_dir}/{exp_name}__{seed}__{unix time}/
            metrics.jsonl        one JSON line per iteration (training scalars) and per evaluation
            events.out.tfevents* TensorBoard: the same scalars and the sample grids
            samples/             fixed-seed sample grids (PNG)
            checkpoints/iter_N/  accelerate save_state: trained weights (with --lora the adapter alone), optimizer,
                                 RNG, the iteration (newest kept); written whole or not at all
            final/               the trained weights, loadable by diffusers
            wandb_run_id         with --track: the W&B run that a resumed run goes on logging to

    What survives what (docs/runs.md): a crash or SIGKILL loses the iterations since the last checkpoint, and
    --resume-from latest repeats them exactly (bitwise) while metrics.jsonl and TensorBoard keep one record per
    iteration; SIGTERM or Ctrl-C finishes the iteration, writes a checkpoint and exits; a full disk or an
    unwritable folder stops the run with one `error:` line and leaves the previous checkpoint intact.
    """

    def __init__(self, args, accelerator, title: str, frozen_copy: bool = False):
        """`frozen_copy`: the script keeps an unsharded frozen copy of the denoiser (its KL reference), which FSDP
        cannot shard: refused under FSDP."""
        from accelerate.utils import DistributedType, broadcast_object_list

        self.args, self.accelerator, self.is_main = args, accelerator, accelerator.is_main_process
        need(
            not (frozen_copy and accelerator.distributed_type == DistributedType.FSDP),
            "--kl-beta > 0 with full fine-tuning keeps an unsharded frozen copy on every GPU; "
            "under FSDP pass --kl-beta 0 or use --lora",
        )
        if args.resume_from:
            self.dir, self.resume_path = resolve_resume(args.output_dir, args.exp_name, args.resume_from)
        else:  # one name for all processes: the main process's clock
            stamp = broadcast_object_list([int(time.time())])[0]
            self.dir, self.resume_path = Path(args.output_dir) / f"{args.exp_name}__{args.seed}__{stamp}", None
            need(
                not self.dir.exists(), f"{self.dir} exists already: pass another --exp-name or --resume-from {self.dir}"
            )
        self.ckpt_dir = self.dir / "checkpoints"
        self.state = TrainState()
        accelerator.register_for_checkpointing(self.state)
        if args.lora:  # checkpoints hold the adapter, not a copy of the frozen base (24 GB for FLUX.1-dev)
            accelerator.register_save_state_pre_hook(_save_trained_only)
            accelerator.register_load_state_pre_hook(_load_trained_only)
        self.title, self._tb, self._wandb = title, None, None
        self.resumed_at, self._on_record = None, set()  # what the interrupted run logged at the resume iteration
        self._signal, self._handlers = 0, {}  # SIGTERM / SIGINT received (see iterations())
        self.grad_norms, self.skipped = [], 0  # this iteration's optimizer steps (see step())
        self.lr = args.learning_rate  # the last optimizer step's learning rate (see --lr-warmup)
        self.eval_line = "evaluation off (--eval-every 0)"  # set by the Evaluator
        self.t_start = self.t_iter = time.perf_counter()

    def resume(self) -> int:
        """Load the checkpoint chosen by --resume-from (if any); returns the iteration to start from."""
        if self.resume_path is None:
            return 0
        try:
            self.accelerator.load_state(str(self.resume_path))
        except Exception as e:  # loading the folder the user named failed: a foreign or damaged checkpoint
            msg = str(e).splitlines()[0] if str(e) else ""
            raise InputError(
                f"--resume-from {self.args.resume_from}: {self.resume_path} is not a checkpoint of this "
                f"script and settings ({type(e).__name__}: {msg[:300]})"
            ) from None
        from accelerate.utils import broadcast_object_list

        self.resumed_at = it = self.state.iteration
        on_record = [self._drop_records_after(it) if self.is_main else None]
        self._on_record = broadcast_object_list(on_record)[0]  # the Evaluator's choices must agree on all processes
        self.accelerator.print(f"resumed from {self.resume_path} at iteration {it}")
        return it

    def _drop_records_after(self, it: int) -> set[str]:
        """Keep what the interrupted run logged up to iteration `it` (the checkpoint's), drop the rest: the resumed
        run logs those iterations again. TensorBoard's events after `it` are dropped by its purge step (_writers).
        Returns the keys on record at `it`, and 'samples' if its sample grid was written."""
        path = self.dir / "metrics.jsonl"
        records = read_metrics(path)
        kept = [r for r in records if r["iteration"] <= it]
        if path.is_file():
            partial = path.with_name(".metrics.jsonl.partial")
            partial.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(partial, path)
        if len(kept) < len(records):
            print(
                f"metrics.jsonl: dropped {len(records) - len(kept)} record(s) of the interrupted run after iteration {it}"
            )
        grid = any((self.dir / "samples").glob(f"samples_{it:06d}.*"))  # .png, or .gif for videos
        return {k for r in kept if r["iteration"] == it for k in r} | ({"samples"} if grid else set())

    def on_record(self, step: int, key: str) -> bool:
        """Whether the interrupted run this one resumes had already logged `key` at `step` (the resume iteration)."""
        return step == self.resumed_at and key in self._on_record

    def banner(self, model, params, lines: list[str]) -> None:
        """Print the run's settings: the model and what is trained, the script's own `lines`, the run folder."""
        a = self.args
        mode = f"LoRA r={a.lora_rank}" if a.lora else "full fine-tuning"
        n = sum(p.numel() for p in params) / 1e6
        self.accelerator.print(
            f"***** {self.title} *****\n  model {a.model_id} ({model.kind}), latent {tuple(model.latent_shape())}, "
            f"{mode}, {n:.2f}M trainable params, mixed precision {a.mixed_precision}"
            + (", gradient checkpointing" if a.gradient_checkpointing else "")
            + (", frozen parts on the CPU between uses" if a.offload_frozen else "")
            + "\n"
            + "".join(f"  {line}\n" for line in lines)
            + f"  reward {a.reward}, lr {a.learning_rate}, iterations {a.iterations}\n  {self.eval_line}\n"
            + f"  run folder {self.dir}"
        )

    def iterations(self, start: int):
        """The training iterations start..--iterations - 1 under a progress bar; times each one (t_iter). While they
        run, SIGTERM (a cluster's preemption) and SIGINT (Ctrl-C) are noted, not obeyed at once: the iteration
        finishes and the next checkpoint() writes a checkpoint and exits. A second signal acts at once."""
        self.t_start = time.perf_counter()
        self.bar = tqdm(
            range(start, self.args.iterations),
            initial=start,
            total=self.args.iterations,
            desc="iterations",
            disable=not self.accelerator.is_local_main_process,
        )
        self._handlers = {s: signal.signal(s, self._note_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for it in self.bar:
                self.t_iter = time.perf_counter()
                yield it
        finally:
            for s, handler in self._handlers.items():
                signal.signal(s, handler)

    def _note_signal(self, signum, frame) -> None:
        self._signal = signum
        signal.signal(signum, self._handlers[signum])  # the next one is not caught
        if self.accelerator.is_local_main_process:
            tqdm.write(
                f"{signal.Signals(signum).name}: the run stops after this iteration, with a checkpoint "
                "(the same signal again stops it now, losing the iteration)"
            )

    def all_finite(self, value: torch.Tensor) -> bool:
        """Whether `value` (a gradient norm) is finite on every process: the same answer on each, so that a step
        skipped on one process is skipped on all and the weights stay identical across ranks."""
        bad = torch.tensor(float(not torch.isfinite(value)), device=self.accelerator.device)
        return self.accelerator.reduce(bad, "sum").item() == 0

    def optimizer_step(self, optimizer, params) -> None:
        """One optimizer step over the accumulated gradients: the learning rate warmed up linearly over --lr-warmup
        steps, the gradients clipped to --max-grad-norm, the step skipped on every process if a gradient norm is not
        finite (all_finite), the gradients zeroed, and the step counted (count_step)."""
        a = self.args
        lr = a.learning_rate * min(1.0, (self.state.optimizer_steps + 1) / max(1, a.lr_warmup))
        for group in optimizer.param_groups:
            group["lr"] = lr
        norm = self.accelerator.clip_grad_norm_(params, a.max_grad_norm)
        if stepped := self.all_finite(norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.count_step(lr, norm, stepped)

    def count_step(self, lr: float, grad_norm: torch.Tensor, stepped: bool) -> None:
        """Record an optimizer step for the iteration's log (learning rate, gradient norm, or a skipped step) and count
        it (state.optimizer_steps, which the learning-rate warmup and a resumed run read)."""
        self.lr = lr
        self.state.optimizer_steps += 1
        if stepped:
            self.grad_norms.append(float(grad_norm))
        else:
            self.skipped += 1

    def end_iteration(self, it: int, scalars: dict, params) -> None:
        """Log iteration `it`'s scalars with the optimizer steps' gradient norm (NaN if every step was skipped), the
        timings, and every 10 iterations the weights' spread across processes (0 = identical, as DDP must keep them)."""
        scalars = {
            **scalars,
            "charts/grad_norm": sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms else float("nan"),
            "charts/skipped_updates": self.skipped,
            "charts/lr": self.lr,
            "perf/iteration_s": time.perf_counter() - self.t_iter,
            "perf/wall_s": time.perf_counter() - self.t_start,
            "perf/peak_mem_gb": peak_memory_gb(self.accelerator.device),  # this iteration's (CUDA) or the run's (CPU)
        }
        if (it + 1) % 10 == 0 or it + 1 == self.args.iterations:
            scalars["charts/rank_weight_spread"] = self.weight_spread(params)
        if self.skipped:
            self.accelerator.print(f"iteration {it}: skipped {self.skipped} update(s) with a non-finite gradient norm")
        self.log(scalars, it + 1)
        self.bar.set_postfix(reward=f"{scalars['rewards/mean']:.4f}", s_it=f"{scalars['perf/iteration_s']:.1f}")
        self.grad_norms, self.skipped = [], 0

    # ---------------------------------------------------------------- logging
    def _writers(self):
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self.dir.mkdir(parents=True, exist_ok=True)
            # resumed at iteration N: TensorBoard hides the interrupted run's events after N (as _drop_records_after
            # drops them from metrics.jsonl), so each step is shown once
            purge = None if self.resumed_at is None else self.resumed_at + 1
            self._tb = SummaryWriter(str(self.dir), purge_step=purge)
            if self.args.track:
                import wandb

                config = {
                    k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in asdict(self.args).items()
                }
                # the same W&B run across resumes: its id is stored in the run folder. W&B refuses steps below its
                # last one, so it keeps the interrupted run's record of a repeated iteration (the same numbers but
                # the timings: the repetition is bitwise)
                id_file = self.dir / "wandb_run_id"
                run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
                id_file.write_text(run_id)
                self._wandb = wandb.init(
                    project=self.args.wandb_project_name,
                    name=self.dir.name,
                    id=run_id,
                    config=config,
                    dir=str(self.dir),
                    resume="allow",
                )
        return self._tb

    def log(self, scalars: dict, step: int, echo: bool = False) -> None:
        """Scalars to metrics.jsonl (one line), TensorBoard and W&B; echo prints the headline (headline()) above the
        progress bar."""
        if not self.is_main:
            return
        tb = self._writers()
        for k, v in scalars.items():
            tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"iteration": step, **scalars}) + "\n")
        if echo:
            tqdm.write(self.headline(scalars, step))

    HEADLINE = {
        "eval/reward": "reward",
        "eval/shape_acc": "shape",
        "eval/all_acc": "all correct",
        "eval/clean_acc": "clean",
    }

    def headline(self, metrics: dict, step: int) -> str:
        """One line a person reads at a glance: the headline metrics, first evaluation -> this one (the full record is
        in metrics.jsonl)."""
        first = next((r for r in read_metrics(self.dir) if "eval/reward" in r), {"iteration": step})
        keys = [k for k in self.HEADLINE if k in metrics]
        if first["iteration"] == step:
            return f"eval @ {step}: " + ", ".join(f"{self.HEADLINE[k]} {metrics[k]:.3f}" for k in keys)
        shown = [f"{self.HEADLINE[k]} {first[k]:.3f} -> {metrics[k]:.3f}" for k in keys]
        return f"eval @ {step} (from iteration {first['iteration']}): " + ", ".join(shown)

    def log_grid(self, images, captions, ok, step: int) -> None:
        """A sample grid PNG into samples/ and TensorBoard; `ok` (verifier verdicts or None) is drawn as a badge.
        Videos (N, F, 3, H, W): the same grid as an animated GIF (log_video_grid)."""
        if not self.is_main:
            return
        import numpy as np
        from PIL import Image

        from common.viz import save_grid

        tb = self._writers()
        title = f"{self.title}, iteration {step}" + (
            ": badge = verifier verdict (right colours, shape, clean background)" if ok is not None else ""
        )
        if images.ndim == 5:
            return self.log_video_grid(images, captions, step, title)
        path = save_grid(self.dir / "samples" / f"samples_{step:06d}.png", images, captions, ok, ncol=8, title=title)
        tb.add_image("samples", np.asarray(Image.open(path)), step, dataformats="HWC")
        if self._wandb is not None:
            import wandb

            self._wandb.log({"samples": wandb.Image(str(path))}, step=step)

    def log_video_grid(self, videos, captions, step: int, title: str) -> None:
        """samples/samples_N.gif, logged to TensorBoard as an animated image (what its add_video writes, without
        the moviepy it needs) and to W&B as a video."""
        from PIL import Image
        from tensorboard.compat.proto.summary_pb2 import Summary

        from common.viz import save_video_grid

        path = save_video_grid(self.dir / "samples" / f"samples_{step:06d}.gif", videos, captions, title=title)
        with Image.open(path) as gif:
            width, height = gif.size
        image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=path.read_bytes())
        self._writers()._get_file_writer().add_summary(Summary(value=[Summary.Value(tag="samples", image=image)]), step)
        if self._wandb is not None:
            import wandb

            self._wandb.log({"samples": wandb.Video(str(path), format="gif")}, step=step)

    # ---------------------------------------------------------------- checkpoints and weights
    def checkpoint(self, iteration: int, final: bool) -> None:
        """save_state every --save-every iterations, at the end, and after SIGTERM or Ctrl-C, which then ends the run
        here (exit status 128 + the signal's number) with a line saying how to resume; every process takes part."""
        signum = self._stop_signal()
        due = (self.args.save_every and iteration % self.args.save_every == 0) or final or signum
        if due and self.args.save:
            self._save_state(iteration)
        if signum:
            self.accelerator.print(
                f"{signal.Signals(signum).name}: stopped after iteration {iteration}, "
                + (
                    f"checkpoint in {self.ckpt_dir}; to go on, run the same command with --resume-from {self.dir}"
                    if self.args.save
                    else "no checkpoint (--no-save)"
                )
            )
            self.close()
            sys.exit(128 + signum)

    def _stop_signal(self) -> int:
        """The signal to stop on (0: none), the same on every process: one process's SIGTERM stops them all at the
        same iteration."""
        flag = torch.tensor([self._signal], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.gather(flag)
        return int(flag.max())

    def _save_state(self, iteration: int) -> None:
        """A checkpoint written whole or not at all: every process writes its part into checkpoints/.partial_iter_N,
        and the main process renames it to iter_N once all have finished, then deletes the oldest beyond
        --checkpoints-total-limit. The run folder must be on one file system that every process sees (accelerate's
        save_state assumes it too), where a rename is atomic (local disks, NFS, Lustre, GPFS). A failed write (full
        disk, no permission) deletes the partial folder and stops the run with one error line."""
        self.state.iteration = iteration
        done = self.ckpt_dir / f"iter_{iteration:06d}"
        partial = self.ckpt_dir / f".partial_{done.name}"
        if self.is_main and self.ckpt_dir.is_dir():  # what a crash while saving or deleting left behind
            for leftover in self.ckpt_dir.glob(".*"):
                shutil.rmtree(leftover, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        try:
            self.accelerator.save_state(str(partial))
            if self.is_main:
                _fsync(*sorted(partial.rglob("*")), partial)
        except Exception as e:
            if self.is_main:
                shutil.rmtree(partial, ignore_errors=True)
            previous = _newest_checkpoint(self.dir)
            why = (str(e).splitlines() or [""])[0][:200]
            raise RunError(
                f"cannot write the checkpoint of iteration {iteration} into {self.ckpt_dir} ({type(e).__name__}: "
                f"{why}); "
                + (
                    f"the previous checkpoint {previous.name} is intact: free some space or fix the folder's "
                    f"permissions, then run the same command with --resume-from {self.dir}"
                    if previous
                    else "there is no earlier checkpoint: free some space or pass another --output-dir"
                )
            ) from None
        self.accelerator.wait_for_everyone()
        if self.is_main:
            stale = [done] if done.exists() else []  # an earlier save of this iteration, when resumed from before it
            for old in stale:
                old.rename(old.with_name(f".replaced_{old.name}"))
            partial.rename(done)
            _fsync(self.ckpt_dir)
            for old in sorted(self.ckpt_dir.glob("iter_*"))[: -self.args.checkpoints_total_limit]:
                gone = old.rename(old.with_name(f".deleting_{old.name}"))  # never a half-deleted iter_N
                shutil.rmtree(gone)
            for old in stale:
                shutil.rmtree(old.with_name(f".replaced_{old.name}"))
        self.accelerator.wait_for_everyone()

    def save_final(self, model, prepared, lora: bool) -> None:
        """The trained weights into final/ (LoRA adapter or the full denoiser), loadable by diffusers."""
        from accelerate.utils import DistributedType

        from common.models import save_trained_weights

        sharded = self.accelerator.distributed_type == DistributedType.FSDP
        save = self.args.save
        state_dict = self.accelerator.get_state_dict(prepared) if sharded and save else None  # collective under FSDP
        if self.is_main:
            if save:
                save_trained_weights(
                    model, self.accelerator.unwrap_model(prepared), self.dir / "final", lora, state_dict
                )
            minutes = (time.perf_counter() - self.t_start) / 60
            where = f"trained weights in {self.dir / 'final'}" if save else "trained weights not saved (--no-save)"
            print(f"done: {self.args.iterations} iterations ({minutes:.1f} min here); {where}")
        self.close()

    def weight_spread(self, params) -> float:
        """Largest difference of any parameter tensor's sum across processes (0 when DDP keeps them identical)."""
        sums = torch.stack([p.detach().double().sum() for p in params]).to(self.accelerator.device)
        sums = self.accelerator.gather(sums).view(self.accelerator.num_processes, -1)
        return (sums.max(0).values - sums.min(0).values).max().item()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


# ---------------------------------------------------------------------------------------------------
# Evaluation and sample grids
# ---------------------------------------------------------------------------------------------------
def reward_stats(rewards: torch.Tensor, parts: dict) -> dict[str, float]:
    """rewards/mean, rewards/std and each component's mean (rewards/<name>) of an iteration's gathered rewards (N,)."""
    components = {f"rewards/{k}": v.mean().item() for k, v in parts.items()}
    return {"rewards/mean": rewards.mean().item(), "rewards/std": rewards.std().item(), **components}


def peak_memory_gb(device) -> float:
    """Peak memory in GB: on CUDA the allocator's peak since the previous call (then reset), else this process's
    max resident set size so far."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 1e9
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def draw_prompts(prompts: list[str], n: int, seed: int, iteration: int) -> list[str]:
    """The iteration's n training prompts, the same on every process (keyed on (seed, iteration)): without
    replacement when the prompt list is long enough, else with."""
    gen = keyed_generator(seed, iteration, "prompts")
    if n <= len(prompts):
        pick = torch.randperm(len(prompts), generator=gen)[:n]
    else:
        pick = torch.randint(len(prompts), (n,), generator=gen)
    return [prompts[i] for i in pick.tolist()]


@contextmanager
def eval_mode(module):
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


class Evaluator:
    """Held-out evaluation (--eval-every) and the fixed-seed sample grid (--sample-every).

    `sampler(cond, noise) -> images (B, 3, H, W)` (videos (B, F, 3, H, W)) is the script's deterministic sampler. Every process computes the
    same images with the prepared module (FSDP needs all ranks in each forward; under DDP the others would only
    wait); the main process logs them. On ShapesBench the verifier's accuracies, the learned reward and diversity
    are added to the reward (common.shapesbench.evaluate).
    """

    def __init__(self, args, model, module, reward_fn, eval_prompts, run: Run, batch_size: int, sampler=None):
        """`sampler`: None for the Euler ODE of a flow model on sigma_schedule(--eval-steps, --shift)."""
        if sampler is None:
            sigmas = sigma_schedule(args.eval_steps, args.shift)
            sampler = ode_sampler(model, module, sigmas, args.guidance_scale, run.accelerator.autocast)
        self.args, self.model, self.module, self.sampler, self.reward_fn, self.run = (
            args,
            model,
            module,
            sampler,
            reward_fn,
            run,
        )
        self.batch_size = batch_size
        held_out, eval_prompts = eval_prompts, evenly_spaced(eval_prompts, args.eval_max_prompts)
        subset = f" of {len(held_out)}, evenly spaced" if len(eval_prompts) < len(held_out) else ""
        run.eval_line = (
            f"evaluation every {args.eval_every} iterations: {len(eval_prompts)}{subset} prompts of "
            f"{args.eval_prompts} x {args.eval_samples_per_prompt} samples, {args.eval_steps}-step ODE"
            if args.eval_every
            else run.eval_line
        )
        self.prompts = [p for p in eval_prompts for _ in range(args.eval_samples_per_prompt)]
        # 8 held-out prompts spread over the list (on ShapesBench all three shapes) x 2 seeds
        self.grid_prompts = [p for p in eval_prompts[:: max(1, len(eval_prompts) // 8)][:8] for _ in range(2)]
        self.shapes_reward = None
        if model.kind == "shapes":
            from common.shapesbench import load_reward_model

            self.shapes_reward = load_reward_model(
                args.reward_checkpoints().get("shapes"), device=run.accelerator.device
            )

    def _sample(self, prompts: list[str], tag: str, desc: str) -> torch.Tensor:
        """ODE samples (N, 3, H, W) of `prompts` from noise keyed on (seed, tag, index), a batch at a time."""
        noise = fixed_noise(self.args.seed, tag, self.model.latent_shape(), 0, len(prompts))
        bar = partial(tqdm, desc=desc, leave=False, disable=not self.run.accelerator.is_local_main_process)
        return sample_prompts(self.sampler, self.model, prompts, noise, self.batch_size, bar)

    @torch.no_grad()
    def evaluate(self, step: int) -> dict:
        """ODE samples of the held-out prompts with fixed seeds -> metrics (also logged)."""
        from common import shapesbench

        images = self._sample(self.prompts, "eval", f"eval @ {step}")
        total, parts = self.reward_fn(images, self.prompts)
        metrics = {
            "eval/reward": total.mean().item(),
            **{f"eval/reward_{k}": v.mean().item() for k, v in parts.items()},
        }
        if self.model.kind == "shapes":
            metrics.update(
                {
                    f"eval/{k}": v
                    for k, v in shapesbench.evaluate(images.cpu(), self.prompts, self.shapes_reward).items()
                }
            )
        self.run.log(metrics, step, echo=True)
        return metrics

    @torch.no_grad()
    def grid(self, step: int) -> None:
        prompts = self.grid_prompts
        images = self._sample(prompts, "grid", f"grid @ {step}")
        r, _ = self.reward_fn(images, prompts)
        ok = None
        if self.model.kind == "shapes":
            from common import shapesbench

            ok = shapesbench.verify(images, prompts)["all"].tolist()
        self.run.log_grid(images, [f"{p}\nreward {x:.3f}" for p, x in zip(prompts, r.tolist())], ok, step)

    def __call__(self, step: int, final: bool = False) -> None:
        """Evaluate and/or draw the grid if step is due (every N iterations, at the start and at the end), unless
        the interrupted run that this one resumes at `step` had done it already."""
        due = lambda every, key: every > 0 and (step % every == 0 or final) and not self.run.on_record(step, key)  # noqa: E731
        with eval_mode(self.module):
            if due(self.args.sample_every, "samples"):
                self.grid(step)
            if due(self.args.eval_every, "eval/reward"):
                self.evaluate(step)
        self.model.park()  # --offload-frozen: the VAE and the reward models leave the GPU until they are needed
        self.reward_fn.park()
        self.run.accelerator.wait_for_everyone()
