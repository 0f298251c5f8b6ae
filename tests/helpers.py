"""Helpers shared by the script tests: run a script or a run.sh recipe in a subprocess, read its metrics,
compare the final weights of two runs, stop a run with a signal at a chosen moment."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.runs import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "common" / "shapesbench" / "assets" / "latent"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
WEIGHTS = Path("transformer") / "diffusion_pytorch_model.safetensors"  # a full fine-tuning run's final weights


def run_script(script, args, tmp_path, launcher=(sys.executable,), env=None, check=True):
    """`python SCRIPT --output-dir TMP ARGS` (or under `launcher`) on one thread; asserts success unless check=False."""
    cmd = [*launcher, str(ROOT / script), "--output-dir", str(tmp_path), *args]
    out = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    )
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def run_recipe(recipe, args, tmp_path):
    """`bash run.sh RECIPE ARGS --output-dir TMP` with this interpreter; asserts success."""
    out = subprocess.run(
        ["bash", "run.sh", recipe, *args, "--output-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PY": sys.executable, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def find_run(path: Path) -> Path:
    """The run folder of `--output-dir DIR --exp-name NAME` given DIR / NAME: the newest DIR/NAME__{seed}__{time}."""
    if "__" in path.name:  # already a run folder
        return path
    runs = sorted(path.parent.glob(f"{path.name}__*"), key=lambda d: int(d.name.rsplit("__", 1)[-1]))
    assert runs, f"no run folder {path}__*"
    return runs[-1]


def metrics(run_dir):
    return read_metrics(find_run(run_dir))


def assert_same_trained_weights(run_a, run_b):
    """The final weights of two runs (all weights, or a LoRA adapter) are bitwise equal, and training moved them
    away from the shipped model (a LoRA adapter starts with B = 0)."""
    final_a, final_b = find_run(run_a) / "final", find_run(run_b) / "final"
    name = LORA_WEIGHTS if (final_a / LORA_WEIGHTS).is_file() else WEIGHTS
    a, b = load_file(final_a / name), load_file(final_b / name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if name == LORA_WEIGHTS:
        assert any(a[k].abs().sum() > 0 for k in a if "lora_B" in k)
    else:
        base = load_file(SHIPPED / WEIGHTS)
        assert any(not torch.equal(a[k], base[k]) for k in a)


def run_until(script, args, tmp_path, stop_when, sig=signal.SIGKILL, launcher=(sys.executable,), env=None, **popen):
    """Start `python SCRIPT --output-dir TMP ARGS` (or under `launcher`) on one thread and send `sig` the moment
    `stop_when(process)` holds (polled every millisecond) to the process, or to the pid that `stop_when` returns;
    returns the exit status and the output. `popen`: more subprocess.Popen arguments."""
    log = tmp_path / f"log_{time.monotonic_ns()}.txt"
    cmd = [*launcher, str(ROOT / script), "--output-dir", str(tmp_path), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, **popen)
        while proc.poll() is None:
            target = stop_when(proc)
            if target:
                os.kill(proc.pid if target is True else target, sig)
                break
            time.sleep(0.001)
        proc.wait(timeout=300)  # a process left waiting for another (a collective that never comes) fails here
    return proc.returncode, log.read_text()


def logged(run_dir, iteration) -> bool:
    """Whether the newest run folder of `run_dir` (DIR / NAME) has logged the training record of `iteration`."""
    runs = sorted(run_dir.parent.glob(f"{run_dir.name}__*"))
    return bool(runs) and any(r["iteration"] == iteration and "perf/iteration_s" in r for r in read_metrics(runs[-1]))


def checkpoint_begun(run_dir, iteration) -> bool:
    """Whether the checkpoint of `iteration` has begun to be written (its folder, under any name, exists)."""
    return any(run_dir.parent.glob(f"{run_dir.name}__*/checkpoints/*iter_{iteration:06d}"))


def assert_survives_kills(script, args, tmp_path) -> None:
    """A 4-iteration run (`args`: tiny settings, checkpoints every 2 iterations) killed by SIGKILL in iteration 4,
    and again the moment the checkpoint of iteration 4 begins to be written, each time resumed with
    `--resume-from latest`, ends with the weights of an uninterrupted run and logs each iteration once."""
    args = [*args, "--iterations", "4", "--save-every", "2"]
    run_script(script, [*args, "--exp-name", "straight"], tmp_path)
    name, faulty = tmp_path / "faulty", [*args, "--exp-name", "faulty"]
    status, out = run_until(script, faulty, tmp_path, lambda p: logged(name, 3))
    assert status == -signal.SIGKILL, out[-2000:]
    status, out = run_until(script, [*faulty, "--resume-from", "latest"], tmp_path, lambda p: checkpoint_begun(name, 4))
    assert status == -signal.SIGKILL, out[-2000:]
    run_script(script, [*faulty, "--resume-from", "latest"], tmp_path)
    assert_same_trained_weights(tmp_path / "straight", name)
    for run in ("straight", "faulty"):
        assert [r["iteration"] for r in metrics(tmp_path / run) if "charts/lr" in r] == [1, 2, 3, 4]


def worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the process of `rank` started by `accelerate launch` (pid `launcher_pid`), if it is running."""
    children = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split()
    for pid in children:
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return int(pid)
        except OSError:
            continue
    return None
