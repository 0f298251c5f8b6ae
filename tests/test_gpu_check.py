"""benchmarks/gpu_check.sh, the prepared GPU check, in its tiny mode on the CPU: the harness builds a FLUX and a Wan2.1
text-to-video pipeline with random weights, runs the flow scripts for 2 iterations with the GPU recipes' memory
flags, and reports speed, peak memory next to memory.py's estimate, and the rollout's FLOPs."""

import json
import os
import subprocess

from tests.helpers import ROOT


def test_gpu_check_tiny_mode_runs_the_flux_and_the_video_case(tmp_path):
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
    assert results["device"] == "CPU" and results["cases"] == ["flux", "wan"]
    flux, wan = results["flux"], results["wan"]
    assert flux["forward_tflop"] > 0 and wan["forward_tflop"] > 0
    assert list(flux["scripts"]) == ["dancegrpo.py", "branchgrpo.py", "vgrpo.py"]
    assert list(wan["scripts"]) == ["dancegrpo.py", "branchgrpo.py"]
    for case in (flux, wan):
        for r in case["scripts"].values():
            assert r["iteration_s"] > 0 and r["peak_gb"] > 0 and r["estimate_gb"] > 0 and r["mfu"] is None
    # 4 images x 4 steps; one tree of 6 steps split at 0 and 3 (K = 2): nodes per depth 1, 2, 2, 2, 4, 4 = 15
    assert (
        flux["scripts"]["dancegrpo.py"]["rollout_forwards"] == 16
        and flux["scripts"]["vgrpo.py"]["rollout_forwards"] == 16
    )
    assert flux["scripts"]["branchgrpo.py"]["rollout_forwards"] == 15
    # the video case's CFG doubles them: one conditional and one unconditional forward per video and step
    assert (
        wan["scripts"]["dancegrpo.py"]["rollout_forwards"] == 32
        and wan["scripts"]["branchgrpo.py"]["rollout_forwards"] == 30
    )
    assert not (tmp_path / "flux").exists() and not (tmp_path / "wan").exists()  # the model folders are cleaned up
    table = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {s} |" in table for s in ("dancegrpo.py", "branchgrpo.py", "vgrpo.py")) and "| n/a |" in table
    assert "tiny Wan2.1 video, 32x32 px x 5 frames" in table
