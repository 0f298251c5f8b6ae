"""benchmarks/gpu_check.sh, the prepared GPU check, in its tiny mode on the CPU: the harness builds a FLUX and a Wan2.1
text-to-video pipeline with random weights, runs the flow scripts for 2 iterations with the GPU recipes' memory
flags under benchmarks/gpu_timing.py, and reports speed, peak memory next to memory.py's plan, and the denoiser
forwards it counted; a script that fails or overruns is recorded and the check goes on."""

import json
import os
import subprocess

from tests.helpers import ROOT

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def gpu_check(*flags):
    return subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--tiny", *flags], cwd=ROOT, capture_output=True, text=True, env=ENV,
        timeout=600,
    )  # fmt: skip


def test_gpu_check_tiny_mode_runs_the_flux_and_the_video_case(tmp_path):
    out = gpu_check("--out", str(tmp_path / "work"), "--results", str(tmp_path / "results"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads((tmp_path / "results" / "gpu_check.json").read_text())
    assert results["device"] == "CPU" and results["cases"] == ["flux", "wan"]
    flux, wan = results["flux"], results["wan"]
    assert flux["forward_tflop"] > 0 and wan["forward_tflop"] > 0
    assert list(flux["scripts"]) == ["dancegrpo.py", "branchgrpo.py", "vgrpo.py"]
    assert list(wan["scripts"]) == ["dancegrpo.py", "branchgrpo.py"]
    for case in (flux, wan):
        for r in case["scripts"].values():
            assert r["status"] == "ok" and r["iterations"] == 2
            assert r["iteration_s"] > 0 and r["peak_gb"] > 0 and r["estimate_gb"] > 0 and r["rollout_mfu"] is None
            assert r["grad_rows"] > 0 and r["grad_s"] > 0 and r["backward_s"] > 0 and r["train_tflops"] > 0
    # transformer forwards without gradients in the second iteration, counted by the wrapper's hook on the
    # transformer class: 4 images x 4 steps; one tree of 6 steps split at 0 and 3 (K = 2): nodes per depth
    # 1, 2, 2, 2, 4, 4 = 15; V-GRPO adds its behaviour values, 4 images x 4 pairs
    rows = {s: r["nograd_rows"] for s, r in flux["scripts"].items()}
    assert rows == {"dancegrpo.py": 16, "branchgrpo.py": 15, "vgrpo.py": 32}
    # the video case's CFG doubles the rows: one conditional and one unconditional half per video and step
    assert {s: r["nograd_rows"] for s, r in wan["scripts"].items()} == {"dancegrpo.py": 32, "branchgrpo.py": 30}
    work = tmp_path / "work"
    assert not (work / "flux").exists() and not (work / "wan").exists()  # the model folders are cleaned up
    assert not list(work.rglob("final")) and not list(work.rglob("checkpoints"))  # --no-save: nothing written
    table = (tmp_path / "results" / "gpu_check.md").read_text()
    assert all(f"| {s} | ok |" in table for s in ("dancegrpo.py", "branchgrpo.py", "vgrpo.py")) and "n/a" in table
    assert "tiny Wan2.1 video, 32x32 px x 5 frames" in table and "time per phase: " in table
    assert (tmp_path / "results" / "flux_dancegrpo.log").is_file()


def test_gpu_check_records_a_script_that_overruns_and_goes_on(tmp_path):
    out = gpu_check("--out", str(tmp_path), "--cases", "flux", "--script-limit-s", "2")
    assert out.returncode != 0 and "not every script ran" in out.stderr
    scripts = json.loads((tmp_path / "gpu_check.json").read_text())["flux"]["scripts"]
    assert list(scripts) == ["dancegrpo.py", "branchgrpo.py", "vgrpo.py"]  # every script was tried
    assert all(r["status"] == "timed out after 2 s" and "log_tail" in r for r in scripts.values())
    assert "| dancegrpo.py | timed out after 2 s |" in (tmp_path / "gpu_check.md").read_text()
