"""A training run around the algorithm: its folder, the loop's progress bar and signals, the optimizer steps'
record, the iteration's log line, checkpoints and the final weights. The scripts call, in order:

    run = Run(args, accelerator, title)     the run folder {output_dir}/{exp_name}__{seed}__{unix time} (CleanRL's
                                            naming), or the one --resume-from names
    start = run.resume()                    0, or the iteration of the --resume-from checkpoint
    run.banner(model, params, lines)        the settings, printed once
    for it in run.iterations(start):        a progress bar; SIGTERM / Ctrl-C noted (common/signals.py)
        ... run.optimizer_steps, run.count_step(lr, grad_norm, stepped) around each optimizer step
        run.end_iteration(it, scalars, params)   the iteration's record (common/logs.py)
        run.checkpoint(it + 1, final)       common/checkpoints.py; after a signal: a checkpoint, then exit
    run.save_final(model, denoiser, lora)   final/

    all_finite(value, accelerator)          whether a gradient norm is finite on every process

What survives what (docs/runs.md): a crash or SIGKILL loses the iterations since the last checkpoint, and
--resume-from latest repeats them exactly (bitwise) while metrics.jsonl and TensorBoard keep one record per iteration;
SIGTERM or Ctrl-C finishes the iteration, writes a checkpoint and exits; a full disk or an unwritable folder stops the
run with one `error:` line and leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import DistributedType, broadcast_object_list
from tqdm import tqdm

from common import InputError, RunError
from common.attention import set_attention_backend
from common.checkpoints import Checkpoints, resolve_resume
from common.flags import need
from common.logs import Logs, peak_memory_gb
from common.signals import StopSignals

STALLED = 3  # iterations in a row with every update skipped (non-finite gradient norms) that stop a run
# the settings that shape what a checkpoint holds or how its iterations are drawn: a checkpoint resumes only under its
# own (checkpoint.json records them); --iterations, the cadences and the like may change across a resume
CHECKPOINT_SETTINGS = ("seed", "model_id", "lora", "lora_rank", "lora_alpha", "experts", "resolution", "num_frames")


def check_name(value, flag: str) -> None:
    """A name that becomes a file or folder name (--exp-name): one path component, so that what is written under it
    stays inside the folder it is meant for."""
    ok = isinstance(value, str) and value not in ("", ".", "..") and not any(c in value for c in "/\\\0")
    if not ok:
        raise InputError(
            f"{flag} {json.dumps(value)}: a name, not a path (no /, no \\, not empty, not . or ..), for it names a "
            "folder"
        )


def script_name(args) -> str:
    """The training script whose flags `args` are: its file name without .py (its Args class's module), also when it
    runs as __main__."""
    module = type(args).__module__
    main = sys.modules.get("__main__")
    if module == "__main__" and getattr(main, "__file__", None):
        return Path(main.__file__).stem
    return module


def all_finite(value: torch.Tensor, accelerator) -> bool:
    """Whether `value` (a gradient norm) is finite on every process: the same answer on each, so that a step skipped
    on one process is skipped on all and the weights stay identical across ranks."""
    bad = torch.tensor(float(not torch.isfinite(value)), device=accelerator.device)
    return accelerator.reduce(bad, "sum").item() == 0


def weight_spread(params, accelerator) -> float:
    """Largest difference of any parameter tensor's sum across processes (0 when DDP keeps them identical)."""
    sums = torch.stack([p.detach().double().sum() for p in params]).to(accelerator.device)
    sums = accelerator.gather(sums).view(accelerator.num_processes, -1)
    return (sums.max(0).values - sums.min(0).values).max().item()


class Run:
    """One training run: `dir` (the run folder), `logs` (common/logs.py), `ckpt` (common/checkpoints.py), `stop`
    (common/signals.py). `frozen_copy`: the script keeps an unsharded frozen copy of the denoiser (its KL reference),
    which FSDP cannot shard: refused under FSDP."""

    def __init__(self, args, accelerator, title: str, frozen_copy: bool = False):
        self.args, self.accelerator, self.title, self.is_main = args, accelerator, title, accelerator.is_main_process
        # the attention kernels of the whole process, before any model runs (common/attention.py: why cuDNN's is off
        # by default); the line goes into the banner, so the run's settings record it
        self.attention = set_attention_backend(args.attention_backend, accelerator.device)
        need(
            not (frozen_copy and accelerator.distributed_type == DistributedType.FSDP),
            "--kl-beta > 0 with full fine-tuning keeps an unsharded frozen copy on every GPU; "
            "under FSDP pass --kl-beta 0 or use --lora",
        )
        check_name(args.exp_name, "--exp-name")
        out = Path(args.output_dir)
        need(
            not out.is_symlink() or out.is_dir(),
            f"--output-dir {args.output_dir}: a symbolic link to no folder (dangling or looping); give a folder",
        )
        if args.resume_from:
            self.dir, self.resume_path = resolve_resume(args.output_dir, args.exp_name, args.resume_from, args.seed)
        else:  # one name for all processes: the main process's clock
            stamp = broadcast_object_list([int(time.time())])[0]
            self.dir, self.resume_path = out / f"{args.exp_name}__{args.seed}__{stamp}", None
            need(
                not self.dir.exists() and not self.dir.is_symlink(),
                f"{self.dir} exists already: pass another --exp-name or --resume-from {self.dir}",
            )
        settings = {k: getattr(args, k) for k in CHECKPOINT_SETTINGS if hasattr(args, k)}
        if not args.lora:  # a full fine-tune's checkpoint does not depend on the adapter's shape
            settings = {k: v for k, v in settings.items() if not k.startswith("lora_")}
        owner = {"script": script_name(args), "run": self.dir.name, "settings": settings}
        self.ckpt = Checkpoints(accelerator, self.dir, args.lora, args.checkpoints_total_limit, owner, args.iterations)
        self.logs = Logs(args, self.dir, self.is_main)
        self.stop = StopSignals(accelerator)
        self.grad_norms, self.skipped, self.lr = [], 0, args.learning_rate  # this iteration's optimizer steps
        self.idle = 0  # iterations in a row in which every update was skipped (STALLED of them stop the run)
        self.eval_line = "evaluation off (--eval-every 0)"  # set by the Evaluator
        self.t_start = self.t_iter = time.perf_counter()

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken so far, across resumes: the learning-rate warmup and every schedule read it. A step
        skipped for a non-finite gradient norm is not one of them: it changed no weight, so no schedule moves."""
        return self.ckpt.state.optimizer_steps

    def resume(self) -> int:
        """Load the checkpoint chosen by --resume-from (if any); returns the iteration to start from. What the
        interrupted run logged after that iteration is dropped: the resumed run logs it again."""
        if self.resume_path is None:
            return 0
        it = self.ckpt.load(self.resume_path, self.args.resume_from)
        on_record = [self.logs.drop_records_after(it) if self.is_main else None]
        self.logs.set_on_record(it, broadcast_object_list(on_record)[0])  # the Evaluator's choices agree everywhere
        self.accelerator.print(f"resumed from {self.resume_path} at iteration {it}")
        return it

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
            + f", {self.attention}\n"
            + "".join(f"  {line}\n" for line in lines)
            + f"  reward {a.reward}, lr {a.learning_rate}, iterations {a.iterations}\n  {self.eval_line}\n"
            + f"  run folder {self.dir}"
        )

    def iterations(self, start: int):
        """The training iterations start..--iterations - 1 under a progress bar; times each one (t_iter). While they
        run, SIGTERM and SIGINT are noted (StopSignals) and obeyed at the next checkpoint()."""
        self.t_start = time.perf_counter()
        self.bar = tqdm(
            range(start, self.args.iterations),
            initial=start,
            total=self.args.iterations,
            desc="iterations",
            disable=not self.accelerator.is_local_main_process,
        )
        with self.stop:
            for it in self.bar:
                self.t_iter = time.perf_counter()
                yield it

    def count_step(self, lr: float, grad_norm: torch.Tensor, stepped: bool) -> None:
        """Record an optimizer step for the iteration's log (learning rate, gradient norm, or a skipped step) and count
        a step taken in optimizer_steps (which the warmup, the schedules and a resumed run read); a skipped one counts
        in `skipped` only, so the step after it gets the learning rate it would have had."""
        self.lr = lr
        if stepped:
            self.ckpt.state.optimizer_steps += 1
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
            "charts/optimizer_steps": self.optimizer_steps,  # so far, this iteration's included
            "perf/iteration_s": time.perf_counter() - self.t_iter,
            "perf/wall_s": time.perf_counter() - self.t_start,
            "perf/peak_mem_gb": peak_memory_gb(self.accelerator.device),  # this iteration's (CUDA) or the run's (CPU)
        }
        if (it + 1) % 10 == 0 or it + 1 == self.args.iterations:
            scalars["charts/rank_weight_spread"] = weight_spread(params, self.accelerator)
        if self.skipped:
            self.accelerator.print(f"iteration {it}: skipped {self.skipped} update(s) with a non-finite gradient norm")
        self.logs.log(scalars, it + 1)
        self.bar.set_postfix(reward=f"{scalars['rewards/mean']:.4f}", s_it=f"{scalars['perf/iteration_s']:.1f}")
        self.idle = self.idle + 1 if self.skipped and not self.grad_norms else 0
        self.grad_norms, self.skipped = [], 0
        if self.idle == STALLED:  # the same answer on every process: all_finite agreed on every skip
            raise RunError(
                f"every update of iterations {it + 1 - STALLED}-{it} had a non-finite gradient norm (a NaN or inf "
                "loss: look at losses/* in metrics.jsonl), so nothing has trained since; lower --learning-rate or "
                "--max-grad-norm, or check the reward; the run stops here, its last checkpoint intact"
            )

    def checkpoint(self, iteration: int, final: bool) -> None:
        """A checkpoint every --save-every iterations, at the end, and after SIGTERM or Ctrl-C, which then ends the
        run here (exit status 128 + the signal's number) with a line saying how to resume; every process takes part."""
        signum = self.stop.pending()
        due = (self.args.save_every and iteration % self.args.save_every == 0) or final or signum
        if due and self.args.save:
            self.ckpt.save(iteration)
        if signum:
            self.accelerator.print(
                f"{signal.Signals(signum).name}: stopped after iteration {iteration}, "
                + (
                    f"checkpoint in {self.ckpt.dir}; to go on, run the same command with --resume-from {self.dir}"
                    if self.args.save
                    else "no checkpoint (--no-save)"
                )
            )
            self.logs.close()
            sys.exit(128 + signum)

    def save_final(self, model, prepared, lora: bool) -> None:
        """The trained weights into final/ (LoRA adapter or the full denoiser), loadable by diffusers."""
        where = "trained weights not saved (--no-save)"
        if self.args.save:
            where = f"trained weights in {self.ckpt.save_final(model, prepared, lora)}"
        minutes = (time.perf_counter() - self.t_start) / 60
        self.accelerator.print(f"done: {self.args.iterations} iterations ({minutes:.1f} min here); {where}")
        self.logs.close()
