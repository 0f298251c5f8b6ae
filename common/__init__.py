"""Shared plumbing for the algorithm scripts: model loaders, rewards, prompts, run plumbing, ShapesBench.

Algorithm logic (samplers with log-probs, advantages, losses) deliberately lives in the scripts. The modules form
layers, each importing only from those above it in this list (tests/test_layout.py checks it):

    common (this file)          the errors the scripts print as one line; whether the Hugging Face hub is reachable;
                                write_atomically, the one way the project writes a file
    common.cli, .offload, .viz, .remote, .signals   the command line's parse and declared ranges; parking frozen
                                parts on the CPU; sample grids; rewards over HTTP; SIGTERM and Ctrl-C during training
    common.logs                 metrics.jsonl, TensorBoard, W&B and sample grids of a run; the logged reductions
    common.sampling             the sigma schedule, keyed noise, the deterministic sampler of evaluation
    common.shapesbench          the offline world: renderer, verifier, learned reward, tiny model builders
    common.models, .rewards, .prompts   model loaders, reward wrappers, prompt sources
    common.flags, .checkpoints, .evaluator   the shared flags and their checks; checkpoints, resume and the final
                                weights; held-out evaluation and sample grids during training
    common.runs                 the run around the algorithm: its folder, loop, log line and checkpoints

The command-line tools sit on top: the evaluation of trained weights (`python -m common.evaluate`) and ShapesBench's
(`python -m common.shapesbench eval`, its trainers). They may use every layer, and no library module imports them. Nothing in common/ imports a top-level script.
"""

import contextlib
import os
import socket
from collections.abc import Callable
from pathlib import Path


class InputError(ValueError):
    """An error caused by the user's input (a flag, a file, a folder). The scripts print its message, which names
    the flag and the value, as one line and exit with status 2, without a traceback (common.flags.cli)."""


class RunError(RuntimeError):
    """A failure of the run's surroundings, not of its code: a full disk, an unwritable folder. The scripts print its
    message, which names the folder and what is still intact, as one line and exit with status 1 (common.flags.cli)."""


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub can be reached: False at once under HF_HUB_OFFLINE=1, else one TCP connect."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def in_the_way(path: Path, within: Path | None = None) -> str:
    """'' when a file may be written at `path`; else what is in the way: a folder or anything but a file at `path`, a
    symbolic link there or on the folders between `within` and `path` (written through, the file would land outside
    `within`), a file where one of `path`'s folders goes."""
    path = Path(path)
    below = [] if within is None else [p for p in reversed(path.parents) if Path(within) in p.parents]
    for folder in below:
        if folder.is_symlink():
            return f"{folder} is a symbolic link"
    for folder in reversed(path.parents):
        if folder.exists() and not folder.is_dir():
            return f"{folder} is not a folder"
    if path.is_symlink():
        return f"{path} is a symbolic link"
    if path.exists() and not path.is_file():
        return f"{path} is {'a folder' if path.is_dir() else 'not a file'}"
    return ""


def write_atomically(
    path: Path, data: str | bytes | Callable[[Path], object], flag: str, writer: str, within: Path | None = None
) -> Path:
    """Write `data` (text, bytes, or a function that writes the file at the path it is given, such as torch.save) at
    `path` whole or not at all: under a temporary name in the same folder, then renamed over `path`, so that a crash
    never leaves a partial file. What is in the way (in_the_way: a folder, a symbolic link this function never made,
    a file where a folder goes) is an InputError naming `flag`, e.g. `--out: X is a folder, where the report writes
    results.md; remove it, or give another --out`; a failed write (full disk, quota, no permission, torch.save's
    RuntimeError) is a RunError naming the file. Neither leaves a temporary file behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")

    def refuse(why: str) -> InputError:
        return InputError(f"{flag}: {why}, where {writer} writes {path.name}; remove it, or give another {flag}")

    if why := in_the_way(path, within):
        raise refuse(why)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)  # a leftover, or a link planted under the temporary name
        if callable(data):
            data(tmp)
        else:
            raw = data.encode() if isinstance(data, str) else data
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
        if tmp.is_symlink():  # the writer's own library never makes one: refused rather than renamed into place
            raise OSError(f"{tmp} became a symbolic link while written")
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if why := in_the_way(path, within):
            raise refuse(why) from None
        msg = (str(e).splitlines() or [""])[0][:200]
        raise RunError(
            f"cannot write {path} ({type(e).__name__}: {msg}); free some space or fix the folder's permissions"
        ) from None
    return path
