"""The forward counts the scripts log are the forwards that ran. Each script runs one iteration under
benchmarks/gpu/gpu_timing.py, which counts the rows of every call of the denoiser's class (a hook, not a formula of the
flags): the logged forwards per image (BranchGRPO: per leaf, rollout and training) times the images must equal it."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, find_run, metrics

QUICK = ["--iterations", "1", "--eval-every", "0", "--sample-every", "0", "--no-save"]
CASES = {  # script, flags, images per iteration
    "dancegrpo": ("dancegrpo.py", ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "2",
                                   "--samples-per-update", "4", "--num-steps", "5", "--kl-beta", "0.1"], 4),
    "mixgrpo": ("dancegrpo.py", ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4",
                                 "--samples-per-update", "4", "--num-steps", "6", "--sde-window", "2"], 4),
    "branchgrpo": ("branchgrpo.py", ["--trees-per-device", "1", "--trees-per-update", "1", "--num-steps", "6",
                                     "--num-splits", "2", "--rollout-batch-size", "3", "--pruning", "width"], 4),
    "vgrpo": ("vgrpo.py", ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4",
                           "--train-batch-size", "2", "--samples-per-update", "4", "--num-steps", "4", "--n-mc", "3",
                           "--kl-beta", "0.1", "--kl-ref", "base"], 4),
    "rlr": ("rlr.py", ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "2", "--num-steps",
                       "5", "--subchain-len", "3"], 4),
    "diffusionnft": ("diffusionnft.py", ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "2",
                                         "--train-batch-size", "2", "--samples-per-update", "2", "--num-steps", "5",
                                         "--timestep-fraction", "0.4", "--kl-beta", "0.1"], 4),
    "dgpo": ("dgpo.py", ["--samples-per-device", "4", "--group-size", "2", "--rollout-batch-size", "2",
                         "--train-batch-size", "2", "--samples-per-update", "4", "--num-steps", "5",
                         "--train-timesteps", "2", "--trunc-steps", "3"], 4),
    "dpo": ("dgpo.py", ["--objective", "dpo", "--samples-per-device", "4", "--group-size", "2",
                        "--rollout-batch-size", "2", "--train-batch-size", "2", "--samples-per-update", "4",
                        "--num-steps", "5", "--train-timesteps", "2", "--trunc-steps", "3"], 4),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_logged_forward_counts_are_the_forwards_that_ran(case, tmp_path):
    script, flags, images = CASES[case]
    timings = tmp_path / "timings.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "gpu_timing.py"), str(timings), script, *flags, *QUICK]
    cmd += ["--output-dir", str(tmp_path), "--exp-name", case]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    (counted,) = json.loads(timings.read_text())  # one iteration: rows without and with gradients
    (record,) = [r for r in metrics(find_run(tmp_path / case)) if "rewards/mean" in r]
    if script == "branchgrpo.py":  # per leaf: the tree's node forwards, and the training forwards of its edges
        assert counted["nograd_rows"] == record["tree/rollout_forwards_per_leaf"] * images
        assert counted["grad_rows"] == record["tree/train_forwards_per_leaf"] * images
    else:
        assert counted["nograd_rows"] + counted["grad_rows"] == record["perf/nfe_per_image"] * images
    assert counted["grad_rows"] > 0 and counted["nograd_rows"] > 0
