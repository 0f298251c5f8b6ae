"""A run's checkpoints: written whole or not at all, rotated, resumed from, and the final weights.

{run folder}/checkpoints/iter_N/   accelerate save_state: the trained weights (with --lora the adapter alone),
                                   the optimizer, the RNG states, the loop counters (TrainState)
{run folder}/final/                the trained weights, loadable by diffusers

resolve_resume(output_dir, exp_name, resume_from)   --resume-from -> (run folder, checkpoint folder)
Checkpoints(accelerator, run_dir, lora, keep)       save(iteration), load(path, flag), save_final(...)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from common import InputError, RunError
from common.flags import need
from common.models import save_trained_weights


class TrainState:
    """The loop counters (iterations, optimizer steps), saved inside accelerate checkpoints (register_for_checkpointing)."""

    def __init__(self):
        self.iteration = self.optimizer_steps = 0

    def state_dict(self):
        return {"iteration": self.iteration, "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, d):
        self.iteration, self.optimizer_steps = d["iteration"], d.get("optimizer_steps", 0)


class Carried:
    """Tensors a checkpoint carries besides the trained weights (accelerate register_for_checkpointing), such as
    DiffusionNFT's old policy, which is frozen, so --lora's checkpoint hook (the trained parameters alone) would drop
    it, and an EMA of the weights; restored in place, bit for bit."""

    def __init__(self, **tensors):
        self.tensors = tensors  # name -> list of tensors, restored in place

    def state_dict(self):
        return {k: [t.detach().to("cpu", copy=True) for t in v] for k, v in self.tensors.items()}  # a snapshot

    def load_state_dict(self, state):
        for k, v in self.tensors.items():
            with torch.no_grad():
                for t, saved in zip(v, state[k], strict=True):
                    t.copy_(saved.to(t.device))


def _save_trained_only(models, weights, output_dir) -> None:
    """accelerate save_state hook (--lora): keep only the trained parameters of each model's state dict, and write the
    adapter's configuration (rank, alpha, targets) next to them as adapter_config.json, so that a checkpoint alone is
    a loadable adapter (python -m common.evaluate reads it)."""
    for i, model in enumerate(models):
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        weights[i] = {k: v for k, v in weights[i].items() if k in trained}
    config = getattr(getattr(models[0], "module", models[0]), "peft_config", {}).get("default")
    if config is not None and PartialState().is_main_process:
        (Path(output_dir) / "adapter_config.json").write_text(json.dumps(config.to_dict(), default=sorted))


def _load_trained_only(models, input_dir) -> None:
    """accelerate load_state hook (--lora): load the trained parameters saved by _save_trained_only (the frozen base
    comes from --model-id) and take the models off accelerate's own, strict, loading."""
    for i, model in enumerate(models):
        state = load_file(Path(input_dir) / ("model.safetensors" if i == 0 else f"model_{i}.safetensors"))
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        if set(state) != trained:
            raise ValueError(f"the checkpoint's {len(state)} tensors are not this run's {len(trained)} trained ones")
        model.load_state_dict(state, strict=False)
    models.clear()


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint: checkpoints are written under a hidden name and renamed to iter_N when
    complete (Checkpoints.save), so an iter_N folder is never a partial one."""
    return max((d for d in (run_dir / "checkpoints").glob("iter_*") if d.is_dir()), default=None)


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
        runs = [d for d in Path(output_dir).glob(f"{exp_name}__*") if newest_checkpoint(d) is not None]
        need(
            bool(runs),
            f"--resume-from latest: no run named {exp_name}__* with checkpoints in {output_dir} "
            "(check --exp-name and --output-dir)",
        )
        run_dir = max(runs, key=lambda d: (d.name.rsplit("__", 1)[-1].zfill(12), d.name))
        return run_dir, newest_checkpoint(run_dir)
    path = Path(resume_from)
    if path.name.startswith("iter_") and path.parent.name == "checkpoints":
        return path.parent.parent, path
    ckpt = newest_checkpoint(path)
    need(
        ckpt is not None,
        f"--resume-from {resume_from}: neither a run folder with checkpoints/iter_* inside nor a "
        "checkpoints/iter_* folder",
    )
    return path, ckpt


class Checkpoints:
    """The checkpoints of the run folder `run_dir`: `state` (TrainState) travels inside each; with `lora` a
    checkpoint holds the adapter, not a copy of the frozen base (24 GB for FLUX.1-dev); the newest `keep` are kept.
    Every process takes part in save() and load()."""

    def __init__(self, accelerator, run_dir: Path, lora: bool, keep: int):
        self.accelerator, self.is_main, self.keep = accelerator, accelerator.is_main_process, keep
        self.run_dir, self.dir = run_dir, run_dir / "checkpoints"
        self.state = TrainState()
        accelerator.register_for_checkpointing(self.state)
        if lora:
            accelerator.register_save_state_pre_hook(_save_trained_only)
            accelerator.register_load_state_pre_hook(_load_trained_only)

    def load(self, path: Path, flag: str) -> int:
        """Load the checkpoint `path` (chosen by --resume-from `flag`); returns its iteration."""
        try:
            self.accelerator.load_state(str(path))
        except Exception as e:  # loading the folder the user named failed: a foreign or damaged checkpoint
            msg = str(e).splitlines()[0] if str(e) else ""
            raise InputError(
                f"--resume-from {flag}: {path} is not a checkpoint of this script and settings "
                f"({type(e).__name__}: {msg[:300]})"
            ) from None
        return self.state.iteration

    def save(self, iteration: int) -> None:
        """A checkpoint written whole or not at all: every process writes its part into checkpoints/.partial_iter_N,
        and the main process renames it to iter_N once all have finished, then deletes the oldest beyond `keep`. The
        run folder must be on one file system that every process sees (accelerate's save_state assumes it too),
        where a rename is atomic (local disks, NFS, Lustre, GPFS). A failed write (full disk, no permission) deletes
        the partial folder and stops the run with one error line."""
        self.state.iteration = iteration
        done = self.dir / f"iter_{iteration:06d}"
        partial = self.dir / f".partial_{done.name}"
        if self.is_main and self.dir.is_dir():  # what a crash while saving or deleting left behind
            for leftover in self.dir.glob(".*"):
                shutil.rmtree(leftover, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        try:
            self.accelerator.save_state(str(partial))
            if self.is_main:
                _fsync(*sorted(partial.rglob("*")), partial)
        except Exception as e:
            if self.is_main:
                shutil.rmtree(partial, ignore_errors=True)
            previous = newest_checkpoint(self.run_dir)
            why = (str(e).splitlines() or [""])[0][:200]
            raise RunError(
                f"cannot write the checkpoint of iteration {iteration} into {self.dir} ({type(e).__name__}: "
                f"{why}); "
                + (
                    f"the previous checkpoint {previous.name} is intact: free some space or fix the folder's "
                    f"permissions, then run the same command with --resume-from {self.run_dir}"
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
            _fsync(self.dir)
            for old in sorted(self.dir.glob("iter_*"))[: -self.keep]:
                gone = old.rename(old.with_name(f".deleting_{old.name}"))  # never a half-deleted iter_N
                shutil.rmtree(gone)
            for old in stale:
                shutil.rmtree(old.with_name(f".replaced_{old.name}"))
        self.accelerator.wait_for_everyone()

    def save_final(self, model, prepared, lora: bool) -> Path:
        """The trained weights into final/ (LoRA adapter or the full denoiser), loadable by diffusers; every process
        calls it (under FSDP gathering the state dict is collective)."""
        sharded = self.accelerator.distributed_type == DistributedType.FSDP
        state_dict = self.accelerator.get_state_dict(prepared) if sharded else None
        if self.is_main:
            unwrapped = self.accelerator.unwrap_model(prepared)
            save_trained_weights(model, unwrapped, self.run_dir / "final", lora, state_dict)
        return self.run_dir / "final"
