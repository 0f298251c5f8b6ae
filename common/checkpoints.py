"""A run's checkpoints: written whole or not at all, rotated, resumed from, and the final weights.

{run folder}/checkpoints/iter_N/   accelerate save_state: the trained weights (with --lora the adapter alone),
                                   the optimizer, the RNG states, the tensors a script carries (Carried); and
                                   checkpoint.json: the loop counters (TrainState), the script, the run and the
                                   settings it belongs to, and the sha256 of every other file in the folder
{run folder}/final/                the trained weights, loadable by diffusers

A checkpoint is data, never code: it is resumed only by its own script, run, seed and settings, after every file
matched its sha256, and nothing in it is unpickled with code execution (accelerate's own loads are weights-only; the
carried tensors are loaded weights-only here, where accelerate would unpickle them whole).

resolve_resume(output_dir, exp_name, resume_from, seed)   --resume-from -> (run folder, checkpoint folder)
Checkpoints(accelerator, run_dir, lora, keep, owner, iterations)   save(iteration), load(path, flag), save_final(...)
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import accelerate.accelerator
import torch
from accelerate import PartialState
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from common import InputError, RunError, write_atomically
from common.flags import need
from common.models import save_trained_weights

MANIFEST = "checkpoint.json"  # in each checkpoint: what it belongs to, its counters, its files' sha256


class TrainState:
    """The loop counters (iterations, optimizer steps). Resumed from checkpoint.json; still registered for accelerate's
    checkpointing (custom_checkpoint_0.pkl, never read back) so that the tensors a script carries keep their file
    names (custom_checkpoint_1.pkl, ...) whatever the order they are registered in."""

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
        config = json.dumps(config.to_dict(), default=sorted)
        write_atomically(Path(output_dir) / "adapter_config.json", config, "--output-dir", "the checkpoint")


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


def _remove(path: Path) -> None:
    """Delete a file, a folder, or a symbolic link itself (never what it points to)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: Path) -> dict[str, Path]:
    """{path relative to `folder`: path} of every entry below it but folders and the manifest; symbolic links too,
    which _problem refuses."""
    found = {}
    for root, dirs, names in os.walk(folder):
        for name in names + [d for d in dirs if Path(root, d).is_symlink()]:
            found[str(Path(root, name).relative_to(folder))] = Path(root, name)
    found.pop(MANIFEST, None)
    return found


@contextlib.contextmanager
def _carried_loaded_weights_only():
    """accelerate's load_state unpickles each registered object's custom_checkpoint_N.pkl with weights_only=False,
    which runs whatever code a replaced file holds; here they are read weights-only (tensors, lists, dicts, numbers),
    all that TrainState and Carried save."""

    def load_custom_state(obj, path, index=0):
        obj.load_state_dict(torch.load(Path(path) / f"custom_checkpoint_{index}.pkl", map_location="cpu",
                                       weights_only=True))  # fmt: skip

    real = accelerate.accelerator.load_custom_state
    accelerate.accelerator.load_custom_state = load_custom_state
    try:
        yield
    finally:
        accelerate.accelerator.load_custom_state = real


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint: checkpoints are written under a hidden name and renamed to iter_N when
    complete (Checkpoints.save), so an iter_N folder is never a partial one."""
    return max(checkpoint_folders(run_dir / "checkpoints"), key=lambda d: int(d.name[5:]), default=None)


def checkpoint_folders(folder: Path) -> list[Path]:
    """The iter_N folders in `folder`, oldest first by N as a number (iter_1000000 after iter_999999; not as text)."""
    found = [d for d in folder.glob("iter_*") if d.is_dir() and re.fullmatch(r"iter_\d+", d.name)]
    return sorted(found, key=lambda d: int(d.name[5:]))


def _fsync(*paths: Path) -> None:
    """Flush files or folders (their entries) to disk: a checkpoint renamed complete must not lose its data to a
    machine crash."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def resolve_resume(output_dir: str, exp_name: str, resume_from: str, seed: int | None = None) -> tuple[Path, Path]:
    """--resume-from -> (run folder, checkpoint folder). 'latest': the newest checkpoint of the newest run named
    {exp_name}__{seed}__* under output_dir (any seed's with seed None); a run folder: its newest checkpoint; a
    checkpoints/iter_* folder: that one."""
    if resume_from == "latest":
        # the name's characters taken as they are: a * or [ in --exp-name must not match another experiment's runs
        name = f"{exp_name}__{'*' if seed is None else seed}__"
        pattern = glob.escape(f"{exp_name}__") + ("*__" if seed is None else f"{seed}__") + "*"
        runs = [d for d in Path(output_dir).glob(pattern) if newest_checkpoint(d) is not None]
        need(
            bool(runs),
            f"--resume-from latest: no run named {name}* with checkpoints in {output_dir} "
            "(check --exp-name, --seed and --output-dir)",
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
    `owner`: what each checkpoint records it belongs to and a resumed one must match, {script, run, settings}
    (common/runs.py: the script's name, the run folder's name, the seed and the settings that shape what a checkpoint
    holds); `iterations`: the run's --iterations, beyond which no checkpoint is resumed. Every process takes part in
    save() and load()."""

    def __init__(self, accelerator, run_dir: Path, lora: bool, keep: int, owner: dict | None = None,
                 iterations: int | None = None):  # fmt: skip
        self.accelerator, self.is_main, self.keep = accelerator, accelerator.is_main_process, keep
        self.run_dir, self.dir = run_dir, run_dir / "checkpoints"
        self.owner = json.loads(json.dumps(owner or {"script": None, "run": run_dir.name, "settings": {}}))
        self.iterations = iterations
        self.state = TrainState()
        accelerator.register_for_checkpointing(self.state)
        if lora:
            accelerator.register_save_state_pre_hook(_save_trained_only)
            accelerator.register_load_state_pre_hook(_load_trained_only)

    def _problem(self, path: Path) -> tuple[str, dict]:
        """('', the checkpoint's counters) when the checkpoint `path` may be resumed by this run; else (why not, {})."""
        for p in (self.dir, path):
            if p.is_symlink():
                return f"{p} is a symbolic link: a run resumes the checkpoints in its own folder only", {}
        number = re.fullmatch(r"iter_(\d+)", path.name)
        if not path.is_dir() or number is None:
            return "not a checkpoints/iter_N folder", {}
        files, manifest_path = _files(path), path / MANIFEST
        links = [name for name, p in files.items() if p.is_symlink()] + [MANIFEST] * manifest_path.is_symlink()
        if links:
            return f"{links[0]} is a symbolic link: a checkpoint holds its own files only", {}
        if not manifest_path.is_file():
            return f"no {MANIFEST}: an incomplete checkpoint, or one written before checkpoints recorded their run", {}
        try:
            manifest = json.loads(manifest_path.read_bytes())
        except ValueError as e:  # not UTF-8, not JSON
            return f"{MANIFEST} unreadable ({type(e).__name__})", {}
        if not (
            isinstance(manifest, dict)
            and all(isinstance(manifest.get(k), dict) for k in ("settings", "state", "files"))
        ):
            return f"{MANIFEST} is not a checkpoint record", {}
        mine = self.owner
        if manifest.get("script") != mine["script"]:
            return f"written by {manifest.get('script')}, not by {mine['script']}", {}
        if manifest.get("run") != mine["run"]:
            return f"run {manifest.get('run')}'s, not run {mine['run']}'s, the folder it is in", {}
        theirs = manifest["settings"]
        both = sorted(mine["settings"].keys() | theirs.keys())
        differ = [k for k in both if k not in theirs or k not in mine["settings"] or theirs[k] != mine["settings"][k]]
        if differ:
            say = lambda side, k: side.get(k, "absent")  # noqa: E731
            return "another " + ", ".join(f"--{k.replace('_', '-')} ({say(theirs, k)} there, {say(mine['settings'], k)} "
                                          "here)" for k in differ), {}  # fmt: skip
        listed = manifest["files"]
        for name in sorted(listed.keys() | files.keys()):
            if name not in files:
                return f"{name} is missing", {}
            if name not in listed:
                return f"{name} was not written with it", {}
            if _sha256(files[name]) != listed[name]:
                return f"{name} does not match its sha256 (changed or replaced since it was written)", {}
        state = manifest["state"]
        it, steps = state.get("iteration"), state.get("optimizer_steps")
        if type(it) is not int or it != int(number.group(1)):
            return f"its iteration {it!r} is not the folder's {int(number.group(1))}", {}
        if self.iterations is not None and it > self.iterations:
            return f"its iteration {it} is beyond --iterations {self.iterations}", {}
        if type(steps) is not int or steps < 0:
            return f"its optimizer step count {steps!r} is not a count", {}
        return "", {"iteration": it, "optimizer_steps": steps}

    def load(self, path: Path, flag: str) -> int:
        """Load the checkpoint `path` (chosen by --resume-from `flag`) once _problem found nothing wrong with it;
        returns its iteration."""
        from accelerate.utils import broadcast_object_list

        # the main process reads and hashes every file once; every process acts on its verdict
        why, state = self._problem(path) if self.is_main else ("", {})
        if self.accelerator.num_processes > 1:
            why, state = broadcast_object_list([why, state])
        if why:
            raise InputError(f"--resume-from {flag}: {path} is not a checkpoint of this script and settings ({why})")
        try:
            with _carried_loaded_weights_only():
                self.accelerator.load_state(str(path))
        except Exception as e:  # loading the folder the user named failed: a foreign or damaged checkpoint
            msg = str(e).splitlines()[0] if str(e) else ""
            raise InputError(
                f"--resume-from {flag}: {path} is not a checkpoint of this script and settings "
                f"({type(e).__name__}: {msg[:300]})"
            ) from None
        self.state.load_state_dict(state)
        return self.state.iteration

    def _write_manifest(self, folder: Path) -> None:
        files = {name: _sha256(p) for name, p in sorted(_files(folder).items())}
        manifest = {**self.owner, "state": self.state.state_dict(), "files": files}
        write_atomically(folder / MANIFEST, json.dumps(manifest, indent=1), "--output-dir", "the checkpoint")

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
                with contextlib.suppress(OSError):
                    if leftover.is_symlink() or leftover.is_dir():  # a link itself, never the folder it points to
                        _remove(leftover)
        self.accelerator.wait_for_everyone()
        try:
            self.accelerator.save_state(str(partial))
            self.accelerator.wait_for_everyone()  # every process's files are in before they are hashed
            if self.is_main:
                self._write_manifest(partial)
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
            # an earlier save of this iteration, when resumed from before it (or a link in its place)
            stale = [done] if done.exists() or done.is_symlink() else []
            for old in stale:
                old.rename(old.with_name(f".replaced_{old.name}"))
            partial.rename(done)
            _fsync(self.dir)
            for old in checkpoint_folders(self.dir)[: -self.keep]:
                _remove(old.rename(old.with_name(f".deleting_{old.name}")))  # never a half-deleted iter_N
            for old in stale:
                _remove(old.with_name(f".replaced_{old.name}"))
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
