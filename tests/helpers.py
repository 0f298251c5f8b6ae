"""Helpers shared by the script tests: run a script or a run.sh recipe in a subprocess, read its metrics,
compare the final weights of two runs, stop a run with a signal at a chosen moment."""

import ast
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.logs import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "common" / "shapesbench" / "assets" / "latent"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
WEIGHTS = Path("transformer") / "diffusion_pytorch_model.safetensors"  # a full fine-tuning run's final weights


def algorithm_scripts(root: Path = ROOT) -> list[str]:
    """The training scripts' file names, sorted: the top-level *.py files that define `class Args` and `def main` at
    module level (found by ast, so a copy such as `cp dancegrpo.py mygrpo.py` is one as soon as it is there)."""
    found = []
    for path in sorted(root.glob("*.py")):
        body = ast.parse(path.read_bytes()).body
        classes = {n.name for n in body if isinstance(n, ast.ClassDef)}
        functions = {n.name for n in body if isinstance(n, ast.FunctionDef)}
        if "Args" in classes and "main" in functions:
            found.append(path.name)
    return found


def run_script(script, args, tmp_path, launcher=(sys.executable,), env=None, check=True):
    """`python SCRIPT --output-dir TMP ARGS` (or under `launcher`) on one thread; asserts success unless check=False."""
    cmd = [*launcher, str(ROOT / script), "--output-dir", str(tmp_path), *args]
    out = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    )
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def run_in_process(script, args, tmp_path):
    """`python SCRIPT --output-dir TMP ARGS` in this process, its main() on its Args: a subprocess would spend most of
    its time importing. For runs whose exit status and output do not matter (run_script checks those)."""
    import importlib

    import tyro

    module = importlib.import_module(script.removesuffix(".py"))
    module.main(tyro.cli(module.Args, args=[*args, "--output-dir", str(tmp_path)]))


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


def assert_final_loads(run_dir, model_id="shapesbench") -> None:
    """diffusers' own loader (`load_lora_weights`) reads the run's final/ LoRA adapter into the model's pipeline, and
    the adapter is in its denoiser; on ShapesBench it also changes the velocity."""
    from common.models import load_model

    model = load_model(model_id)
    denoiser = "unet" if model.kind == "sd1" else "transformer"
    if model.kind == "shapes":
        x, sigma = (
            torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(0)),
            torch.ones(2) * 0.7,
        )
        cond = model.encode_prompts(["a red circle on a blue background", "a green square on a white background"])
        with torch.no_grad():
            base = model.velocity(model.transformer, x, sigma, cond)
    model.pipe.load_lora_weights(str(run_dir / "final"))
    assert getattr(model.pipe, denoiser).peft_config
    if model.kind == "shapes":
        with torch.no_grad():
            assert not torch.allclose(model.velocity(model.pipe.transformer, x, sigma, cond), base, atol=1e-6)


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
    """The faults a cluster delivers, each followed by `--resume-from latest`, change nothing: a 6-iteration run
    (`args`: tiny settings; checkpoints every 2 iterations) is preempted by SIGTERM in iteration 2 (it finishes the
    iteration, writes a checkpoint and exits with 128 + 15), meets a full disk (a file-size limit) while writing its
    next checkpoint (one `error:` line, the previous checkpoint intact, nothing partial), is killed by SIGKILL the
    moment that checkpoint begins to be written and again in iteration 6; the last resume ends with the weights of an
    uninterrupted run, each iteration logged once."""
    args = [*args, "--iterations", "6", "--save-every", "2"]
    run_script(script, [*args, "--exp-name", "straight"], tmp_path)
    name, faulty = tmp_path / "faulty", [*args, "--exp-name", "faulty"]
    resume = [*faulty, "--resume-from", "latest"]
    status, out = run_until(script, faulty, tmp_path, lambda p: logged(name, 1), signal.SIGTERM)
    assert status == 128 + signal.SIGTERM and "SIGTERM: stopped after iteration" in out, out[-2000:]
    stopped = int(out.split("SIGTERM: stopped after iteration ")[1].split(",")[0])
    checkpoints = find_run(name) / "checkpoints"
    assert stopped in (1, 2) and sorted(p.name for p in checkpoints.iterdir()) == [f"iter_{stopped:06d}"]
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # noqa: E731
    status, out = run_until(script, resume, tmp_path, lambda p: False, preexec_fn=limit)
    due = 2 * (stopped // 2 + 1)  # the next checkpoint
    assert status == 1 and f"error: cannot write the checkpoint of iteration {due}" in out, out[-2000:]
    assert f"the previous checkpoint iter_{stopped:06d} is intact" in out and "Traceback" not in out
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"iter_{stopped:06d}"]
    status, out = run_until(script, resume, tmp_path, lambda p: checkpoint_begun(name, due))
    assert status == -signal.SIGKILL, out[-2000:]
    status, out = run_until(script, resume, tmp_path, lambda p: logged(name, 5))
    assert status == -signal.SIGKILL, out[-2000:]
    run_script(script, resume, tmp_path)
    assert_same_trained_weights(tmp_path / "straight", name)
    for run in ("straight", "faulty"):
        assert [r["iteration"] for r in metrics(tmp_path / run) if "charts/lr" in r] == [1, 2, 3, 4, 5, 6]


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


def replace_flags(argv: list[str], values: dict[str, str]) -> list[str]:
    """`argv` with the value after each flag of `values` replaced, e.g. {"--samples-per-device": "4"}."""
    return [values.get(prev, word) for prev, word in zip(["", *argv], argv)]
