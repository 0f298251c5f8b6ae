"""benchmarks/gpu_check.sh, the prepared GPU check, in its tiny mode on the CPU: the harness builds a FLUX pipeline
with random weights, runs the three flow scripts for 2 iterations with the GPU recipes' memory flags, and reports
speed, peak memory next to memory.py's estimate, and the rollout's FLOPs."""

import json
import os
import subprocess

from tests.helpers import ROOT


def test_gpu_check_tiny_mode_runs_the_three_scripts(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--tiny", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["device"] == "CPU" and results["forward_tflop"] > 0
    for script in ("dancegrpo.py", "branchgrpo.py", "vgrpo.py"):
        r = results[script]
        assert r["iteration_s"] > 0 and r["peak_gb"] > 0 and r["estimate_gb"] > 0 and r["mfu"] is None
    # 4 images x 4 steps; one tree of 6 steps split at 0 and 3 (K = 2): nodes per depth 1, 2, 2, 2, 4, 4 = 15
    assert results["dancegrpo.py"]["rollout_forwards"] == 16 and results["vgrpo.py"]["rollout_forwards"] == 16
    assert results["branchgrpo.py"]["rollout_forwards"] == 15
    table = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {s} |" in table for s in ("dancegrpo.py", "branchgrpo.py", "vgrpo.py")) and "| n/a |" in table
