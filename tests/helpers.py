"""Helpers shared by the script tests: run a script or a run.sh recipe in a subprocess, read its metrics,
compare the final weights of two runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "common" / "shapesbench" / "assets" / "flow"
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
    return [json.loads(line) for line in (find_run(run_dir) / "metrics.jsonl").read_text().splitlines()]


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
