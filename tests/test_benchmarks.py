"""benchmarks/: the overhead timers fit in an iteration without overlapping; branch diversity's MMD."""

import importlib.util
import math
import sys

import pytest

import dancegrpo
from common.logs import read_metrics
from tests.helpers import ROOT
from tests.test_vgrpo import TINY_RUN


def load(name):
    """A benchmark module by its file name, from whichever sub-folder of benchmarks/ holds it."""
    (path,) = ROOT.glob(f"benchmarks/*/{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overhead_timers_fit_in_the_iteration_and_patches_are_undone():
    overhead = load("overhead")
    from accelerate import Accelerator

    import vgrpo
    from common import runs

    before = (Accelerator.backward, Accelerator.clip_grad_norm_, vgrpo.all_finite, runs.Run.end_iteration)
    flags = dict(zip(TINY_RUN[::2], TINY_RUN[1::2]))
    tiny = [x for k, v in flags.items() if k not in ("--iterations", "--eval-every", "--sample-every") for x in (k, v)]
    out = overhead.measure("vgrpo.py", 3, tiny)
    # the timed parts fit in the iteration (a part timed twice, or one timer inside another, would not); the shares
    # themselves sum to 1 by construction ("other" is the rest), so that is not what is checked
    assert out["other_share"] >= -2e-3 and out["forward_share"] > 0 and out["backward_share"] > 0
    assert out["optimizer_share"] > 0 and out["reward_share"] > 0 and out["forward_calls"] > 0
    assert (Accelerator.backward, Accelerator.clip_grad_norm_, vgrpo.all_finite, runs.Run.end_iteration) == before


def test_mmd_is_near_zero_for_two_samples_of_one_distribution_and_large_for_collapsed_samples():
    import torch

    mmd2 = load("branch_diversity").mmd2
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 16, generator=g)
    collapsed = x[:1].expand(64, -1)
    for kernel in ("rbf", "poly"):
        same, apart = mmd2(x, y, kernel), mmd2(x, collapsed, kernel)
        assert abs(same) < 0.05 * apart and apart > 0.3, (kernel, same, apart)


def test_branch_diversity_runs_on_a_small_sample():
    table = load("branch_diversity").measure(1, {"dense, correlated s=4": ("dense", "correlated", 4.0)})
    row, floor = table["dense, correlated s=4"], table["independent vs independent (noise floor)"]
    assert row["splits"] == [0, 3, 6, 9] and row["diversity"] > 0 and floor["diversity"] > 0
    assert all(abs(r[k]) < 1 for r in (row, floor) for k in ("mmd2_rbf", "kid"))


def test_compare_quick_writes_table_plot_grids_tradeoff_and_skips_finished_runs(tmp_path, monkeypatch):
    compare = load("compare")
    small = ["--num-steps", "4", "--eval-steps", "4", "--rollout-batch-size", "4"]
    monkeypatch.setattr(
        compare,
        "METHODS",
        {
            "dancegrpo": (
                "DanceGRPO",
                ["dancegrpo.py", *small, "--samples-per-device", "8", "--group-size", "4", "--samples-per-update", "4"],
            ),
        },
    )  # fmt: skip  (one method and one sweep run: both at once with --jobs 2)
    monkeypatch.setattr(compare, "SWEEP", {"dancegrpo": [("lr / 2", None)]})
    argv = ["compare.py", "--quick", "--out", str(tmp_path), "--threads", "1", "--jobs", "2", "--tradeoff"]
    monkeypatch.setattr(sys, "argv", argv)
    compare.main()
    table = (tmp_path / "results.md").read_text()
    assert "| DanceGRPO | 10 |" in table
    assert "<= 8 min" not in table.split("| DanceGRPO | 10 |")[1].split("\n")[0]  # a tiny run is well within 8 min
    # the sweep ran half of dancegrpo.py's learning rate, and the trade-off table lists it next to the defaults
    (swept,) = (tmp_path / "runs").glob("dancegrpo+lrover2__0__*")
    lrs = [r["charts/lr"] for r in read_metrics(swept) if "charts/lr" in r]
    assert lrs[-1] == pytest.approx(dancegrpo.Args.learning_rate / 2)
    trade = (tmp_path / "tradeoff.md").read_text()
    assert "| DanceGRPO | lr / 2 | 10 |" in trade and "| DanceGRPO | default | 10 |" in trade
    assert (tmp_path / "tradeoff.png").stat().st_size > 0
    assert "(threads per run: 1), 2 runs at a time" in table
    assert (tmp_path / "results.png").stat().st_size > 0
    assert sorted(p.name for p in (tmp_path / "results_grids").iterdir()) == ["dancegrpo.png"]
    finished = compare.run_one("dancegrpo", compare.METHODS["dancegrpo"][1], 0, tmp_path, True, 1)  # returns at once
    assert finished == next((tmp_path / "runs").glob("dancegrpo__0__*"))


def test_overhead_counts_a_frozen_reference_copy_once():
    overhead = load("overhead")
    flags = dict(zip(TINY_RUN[::2], TINY_RUN[1::2]))
    tiny = [x for k, v in flags.items() if k not in ("--iterations", "--eval-every", "--sample-every") for x in (k, v)]
    full = [*tiny, "--no-lora", "--kl-beta", "1"]
    base = overhead.measure("vgrpo.py", 3, [*full, "--kl-ref", "base"])  # + a frozen copy's no-grad pass
    behaviour = overhead.measure("vgrpo.py", 3, [*full, "--kl-ref", "behaviour"])
    # 8 images in micro-batches of 2: the frozen copy adds exactly 4 forwards per iteration, counted once each
    assert base["forward_calls"] - behaviour["forward_calls"] == 8 // 2
    assert base["other_share"] > 0 and base["forward_share"] + base["backward_share"] < 1


def test_gradient_agreement_runs_on_a_small_sample():
    out = load("gradient_agreement").measure(draws=1, images=16)
    assert len(out["DanceGRPO"]) == len(out["V-GRPO"]) == len(out["BranchGRPO"]) == 1
    # both halves have a gradient and they differ (a cosine of exactly +-1 or nan would mean a broken split)
    assert all(math.isfinite(c) and abs(c) < 0.999 for c in (*out["DanceGRPO"], *out["V-GRPO"], *out["BranchGRPO"]))


def test_backward_check_runs_each_variant_and_gets_the_same_gradient():
    """benchmarks/gpu/gpu_backward_check.py on tiny configs, in this process: the scripts' training step (LoRA on a bf16
    base under autocast, checkpointing) gives a finite gradient, and the variants that change only how it is computed
    (no checkpointing, math attention) give the same one; a failure is a result, not an exception."""
    import torch

    check = load("gpu_backward_check")
    norms = {}
    for variant in ("flux", "no-ckpt", "math-sdpa", "wan"):
        r = check.one(variant, tiny=True)
        assert r["status"] == "ok" and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, (variant, r)
        norms[variant] = r["grad_norm"]
    assert norms["no-ckpt"] == pytest.approx(norms["flux"], rel=1e-3) == norms["math-sdpa"]
    torch.backends.cuda.enable_cudnn_sdp(True)  # math-sdpa turned the backends off in this process
    for name in ("flash", "mem_efficient"):
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(True)
