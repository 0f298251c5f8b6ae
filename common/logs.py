"""Where a run's numbers and pictures go: metrics.jsonl, TensorBoard and (with --track) Weights & Biases, and the
sample grids; and the small reductions the scripts log.

    Logs(args, run_dir, is_main)     log(scalars, step), grid(images, captions, ok, step, title), headline, close;
                                     after a resume, drop_records_after(it) and on_record(step, key)
    read_metrics(path)               the records of a metrics.jsonl (read_records: and how many lines are not one)
    summarize(figures, prefix)       an iteration's figures (each micro-batch's tensors) -> logged floats
    reward_stats(rewards, parts)     rewards/mean, rewards/std and each component's mean
    peak_memory_gb(device)           the peak memory of this iteration (CUDA) or of the run (CPU)
"""

from __future__ import annotations

import json
import os
import resource
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from common import InputError, in_the_way, write_atomically
from common.viz import save_grid, save_video_grid

if TYPE_CHECKING:  # for the annotation; at run time imported with the first writer (tensorboard: slow to import)
    from torch.utils.tensorboard import SummaryWriter


def read_records(path) -> tuple[list[dict], int]:
    """(the records of a metrics.jsonl, how many of its lines are not one): a record is a JSON object with an integer
    "iteration"; anything else (a last line cut short by a crash or a full disk, a line edited by hand, bytes that are
    not UTF-8) is skipped. A run folder stands for its metrics.jsonl; what is not a file holds no records."""
    path = Path(path)
    path = path / "metrics.jsonl" if path.is_dir() else path
    records, skipped = [], 0
    for line in path.read_bytes().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line.decode())
            it = record["iteration"] if isinstance(record, dict) else None
        except (ValueError, KeyError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            it = None
        if type(it) is int:
            records.append(record)
        elif line.strip():
            skipped += 1
    return records, skipped


def read_metrics(path) -> list[dict]:
    """The records of a metrics.jsonl (a file or its run folder), in order (read_records: other lines are skipped);
    after a resume the file holds each iteration once (Logs.drop_records_after)."""
    return read_records(path)[0]


def summarize(figures: dict, prefix: str) -> dict[str, float]:
    """{prefix + name: float} of an objective's figures, each a tensor or a list of them (one per micro-batch): the
    max over every value for a name with 'max' in it (ratio_max_dev), else the mean over every value (a per-sample
    figure counts each sample, a per-batch one each batch)."""
    out = {}
    for name, values in figures.items():
        values = torch.cat([v.reshape(-1) for v in (values if isinstance(values, list) else [values])])
        out[prefix + name] = (values.max() if "max" in name else values.mean()).item()
    return out


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


class Logs:
    """The run folder's records, written by the main process only (the others' calls do nothing); nothing is created
    before the first write, so a run that fails at start-up leaves no empty folder.

        metrics.jsonl        one JSON line per iteration (training scalars) and per evaluation
        events.out.tfevents* TensorBoard: the same scalars and the sample grids
        samples/             fixed-seed sample grids (PNG; GIF for videos)
        wandb_run_id         with --track: the W&B run that a resumed run goes on logging to
    """

    HEADLINE = {
        "eval/reward": "reward",
        "eval/shape_acc": "shape",
        "eval/all_acc": "all correct",
        "eval/clean_acc": "clean",
    }

    def __init__(self, args, run_dir: Path, is_main: bool):
        self.args, self.dir, self.is_main = args, run_dir, is_main
        self.tb, self.wandb = None, None
        self.resumed_at, self._on_record = None, set()  # what the interrupted run logged at the resume iteration

    def drop_records_after(self, it: int) -> set[str]:
        """Resumed at iteration `it` (the checkpoint's): keep what the interrupted run logged up to `it`, drop the
        rest (the resumed run logs those iterations again; TensorBoard's events after `it` are dropped by its purge
        step). Returns the keys on record at `it`, and 'samples' if its sample grid was written."""
        self.resumed_at = it
        path = self.dir / "metrics.jsonl"
        if why := in_the_way(path, self.dir):
            raise InputError(f"{self.flag()}: {why}, where the run keeps metrics.jsonl; remove it, or give another run")
        records, skipped = read_records(path)
        kept = [r for r in records if r["iteration"] <= it]
        if path.is_file():
            text = "".join(json.dumps(r) + "\n" for r in kept)
            write_atomically(path, text, self.flag(), "the run", within=self.dir)
        if skipped:
            print(
                f"metrics.jsonl: dropped {skipped} line(s) that are not a record (not a JSON object with an iteration)"
            )
        if len(kept) < len(records):
            print(
                f"metrics.jsonl: dropped {len(records) - len(kept)} record(s) of the interrupted run after iteration {it}"
            )
        grid = any((self.dir / "samples").glob(f"samples_{it:06d}.*"))  # .png, or .gif for videos
        return {k for r in kept if r["iteration"] == it for k in r} | ({"samples"} if grid else set())

    def flag(self) -> str:
        """The flag that named the run folder, for what is in the way inside it."""
        return "--resume-from" if self.args.resume_from else "--output-dir"

    def set_on_record(self, it: int, keys: set[str]) -> None:
        """The keys the interrupted run had logged at the resume iteration `it` (the same on every process)."""
        self.resumed_at, self._on_record = it, keys

    def on_record(self, step: int, key: str) -> bool:
        """Whether the interrupted run this one resumes had already logged `key` at `step` (the resume iteration)."""
        return step == self.resumed_at and key in self._on_record

    def _writers(self) -> SummaryWriter:
        if self.tb is None:
            from torch.utils.tensorboard import SummaryWriter  # heavy: imported when a run first logs

            self.dir.mkdir(parents=True, exist_ok=True)
            # resumed at iteration N: TensorBoard hides the interrupted run's events after N (as drop_records_after
            # drops them from metrics.jsonl), so each step is shown once
            purge = None if self.resumed_at is None else self.resumed_at + 1
            self.tb = SummaryWriter(str(self.dir), purge_step=purge)
            if self.args.track:
                self._start_wandb()
        return self.tb

    def _start_wandb(self) -> None:
        import wandb  # optional: --track only (checked at start-up)

        config = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in asdict(self.args).items()}
        # the same W&B run across resumes: its id is stored in the run folder. W&B refuses steps below its last one,
        # so it keeps the interrupted run's record of a repeated iteration (the same numbers but the timings: the
        # repetition is bitwise)
        id_file = self.dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
        write_atomically(id_file, run_id, self.flag(), "the run", within=self.dir)
        self.wandb = wandb.init(
            project=self.args.wandb_project_name,
            name=self.dir.name,
            id=run_id,
            config=config,
            dir=str(self.dir),
            resume="allow",
        )

    def log(self, scalars: dict, step: int, echo: bool = False) -> None:
        """Scalars to metrics.jsonl (one line), TensorBoard and W&B; echo prints the headline above the progress bar."""
        if not self.is_main:
            return
        tb = self._writers()
        for k, v in scalars.items():
            tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        # appended (one line an iteration, a line cut short by a crash is skipped when read), never through a link
        fd = os.open(self.dir / "metrics.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps({"iteration": step, **scalars}) + "\n")
        if echo:
            tqdm.write(self.headline(scalars, step))

    def headline(self, metrics: dict, step: int) -> str:
        """One line a person reads at a glance: the headline metrics, first evaluation -> this one (the full record is
        in metrics.jsonl)."""
        first = next((r for r in read_metrics(self.dir) if "eval/reward" in r), {"iteration": step})
        keys = [k for k in self.HEADLINE if k in metrics]
        if first["iteration"] == step:
            return f"eval @ {step}: " + ", ".join(f"{self.HEADLINE[k]} {metrics[k]:.3f}" for k in keys)
        shown = [f"{self.HEADLINE[k]} {first[k]:.3f} -> {metrics[k]:.3f}" for k in keys]
        return f"eval @ {step} (from iteration {first['iteration']}): " + ", ".join(shown)

    def grid(self, images, captions, ok, step: int, title: str) -> None:
        """A sample grid PNG into samples/ and TensorBoard; `ok` (verifier verdicts or None) is drawn as a badge.
        Videos (N, F, 3, H, W): the same grid as an animated GIF (video_grid)."""
        if not self.is_main:
            return
        tb = self._writers()
        if images.ndim == 5:
            return self.video_grid(images, captions, step, title)
        path = save_grid(
            self.dir / "samples" / f"samples_{step:06d}.png", images, captions, ok, title=title, within=self.dir
        )
        tb.add_image("samples", np.asarray(Image.open(path)), step, dataformats="HWC")
        if self.wandb is not None:
            import wandb  # optional: --track only

            self.wandb.log({"samples": wandb.Image(str(path))}, step=step)

    def video_grid(self, videos, captions, step: int, title: str) -> None:
        """samples/samples_N.gif, logged to TensorBoard as an animated image (what its add_video writes, without
        the moviepy it needs) and to W&B as a video."""
        from tensorboard.compat.proto.summary_pb2 import Summary  # heavy: imported when a video is first logged

        path = save_video_grid(
            self.dir / "samples" / f"samples_{step:06d}.gif", videos, captions, title=title, within=self.dir
        )
        with Image.open(path) as gif:
            width, height = gif.size
        image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=path.read_bytes())
        self._writers()._get_file_writer().add_summary(Summary(value=[Summary.Value(tag="samples", image=image)]), step)
        if self.wandb is not None:
            import wandb  # optional: --track only

            self.wandb.log({"samples": wandb.Video(str(path), format="gif")}, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
