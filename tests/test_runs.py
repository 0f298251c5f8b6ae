"""The run plumbing in-process (common/runs.py, checkpoints.py, logs.py): checkpoints written whole or not at all, rotation, one record per
iteration after a resume, the W&B run id kept across resumes. The scripts' fault tests (SIGKILL, SIGTERM, a full
disk) are in tests/test_<script>.py."""

import errno
import json
import math
import os
import sys
import types

import pytest
from accelerate import Accelerator

from common import RunError
from common.checkpoints import resolve_resume
from common.flags import RunArgs
from common.logs import read_metrics
from common.runs import Run


@pytest.fixture
def make_run(tmp_path):
    def make(**kw):
        args = RunArgs(exp_name="t", output_dir=str(tmp_path), lora=False, **kw)
        return Run(args, Accelerator(cpu=True), "test")

    return make


def test_no_save_writes_no_checkpoint(make_run):
    run = make_run(save_every=1, save=False)
    for it in (1, 2):
        run.checkpoint(it, final=it == 2)
    assert not run.ckpt.dir.exists()


def test_checkpoints_are_renamed_complete_and_rotated(make_run):
    run = make_run(save_every=1, checkpoints_total_limit=2)
    for it in (1, 2, 3):
        run.checkpoint(it, final=False)
    assert sorted(p.name for p in run.ckpt.dir.iterdir()) == ["iter_000002", "iter_000003"]  # nothing hidden left
    (run.ckpt.dir / ".partial_iter_000004").mkdir()  # what a crash while writing the next one leaves
    assert resolve_resume(run.args.output_dir, "t", "latest") == (run.dir, run.ckpt.dir / "iter_000003")
    run.checkpoint(4, final=False)  # the next save clears it
    assert sorted(p.name for p in run.ckpt.dir.iterdir()) == ["iter_000003", "iter_000004"]


def test_a_failed_write_leaves_the_previous_checkpoint_and_says_so(make_run, monkeypatch):
    run = make_run(save_every=1)
    run.checkpoint(1, final=False)
    real_save = run.accelerator.save_state

    def full_disk(path):  # writes part of the checkpoint, then the disk is full
        real_save(path)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run.accelerator, "save_state", full_disk)
    with pytest.raises(RunError, match="the previous checkpoint iter_000001 is intact") as e:
        run.checkpoint(2, final=False)
    assert "No space left on device" in str(e.value) and f"--resume-from {run.dir}" in str(e.value)
    assert [p.name for p in run.ckpt.dir.iterdir()] == ["iter_000001"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders (the full-disk case is tested)")
def test_an_unwritable_checkpoint_folder_is_one_error(make_run):
    run = make_run(save_every=1)
    run.checkpoint(1, final=False)
    run.ckpt.dir.chmod(0o555)
    try:
        with pytest.raises(RunError, match="iter_000001 is intact"):
            run.checkpoint(2, final=False)
    finally:
        run.ckpt.dir.chmod(0o755)


def test_a_file_where_the_checkpoint_folder_must_go_is_one_error_even_as_root(make_run):
    """What no permission bit can stop root from: a file where the checkpoint's partial folder must be written."""
    run = make_run(save_every=1)
    run.checkpoint(1, final=False)
    (run.ckpt.dir / ".partial_iter_000002").write_text("in the way")
    with pytest.raises(RunError, match="iter_000001 is intact"):
        run.checkpoint(2, final=False)
    assert (run.ckpt.dir / "iter_000001").is_dir() and not (run.ckpt.dir / "iter_000002").exists()


def test_a_resume_drops_the_records_after_its_checkpoint(make_run):
    run = make_run(save_every=2)
    for it in range(5):  # the interrupted run: evaluations at 0, 2, 4, trained up to 4, checkpoint at 2
        if it % 2 == 0:
            run.logs.log({"eval/reward": 0.1}, it)
        run.logs.log({"charts/lr": 1.0}, it + 1)
    run.checkpoint(2, final=False)
    with open(run.dir / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 6, "charts/l')  # cut short by the kill
    assert len(read_metrics(run.dir)) == 8  # the torn line is skipped
    run.logs.close()
    resumed = make_run(resume_from="latest")
    assert resumed.dir == run.dir and resumed.resume() == 2
    assert [tuple(r.items())[:2] for r in read_metrics(run.dir)] == [
        (("iteration", 0), ("eval/reward", 0.1)),
        (("iteration", 1), ("charts/lr", 1.0)),
        (("iteration", 2), ("charts/lr", 1.0)),
        (("iteration", 2), ("eval/reward", 0.1)),
    ]
    assert resumed.logs.on_record(2, "eval/reward") and not resumed.logs.on_record(2, "samples")
    assert not resumed.logs.on_record(0, "eval/reward")  # only the resume iteration's records count


def test_wandb_goes_on_logging_to_the_same_run(make_run, monkeypatch):
    calls = []
    fake = types.SimpleNamespace(
        init=lambda **kw: calls.append(kw) or types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None),
        util=types.SimpleNamespace(generate_id=lambda: f"id{len(calls)}"),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = make_run(track=True, save_every=1)
    run.logs.log({"charts/lr": 1.0}, 1)
    run.checkpoint(1, final=False)
    run.logs.close()
    resumed = make_run(track=True, resume_from="latest")
    resumed.resume()
    resumed.logs.log({"charts/lr": 1.0}, 2)
    assert [c["id"] for c in calls] == ["id0", "id0"] and calls[1]["resume"] == "allow"
    assert (run.dir / "wandb_run_id").read_text() == "id0"
    assert json.loads((run.dir / "metrics.jsonl").read_text().splitlines()[-1])["iteration"] == 2


def test_summarize_takes_the_max_of_a_max_figure_and_the_mean_over_every_value_of_the_others():
    import torch

    from common.logs import summarize

    figures = {
        "ratio_max_dev": [torch.tensor(0.125), torch.tensor(0.375)],  # one per micro-batch
        "clipfrac": [torch.tensor(0.25), torch.tensor(0.75)],
        "ratio_mean": [torch.tensor([1.0, 2.0]), torch.tensor([6.0])],  # per sample: each sample counts once
        "kl": torch.tensor(2.5),  # a single value, not a list
    }
    assert summarize(figures, "losses/") == {
        "losses/ratio_max_dev": 0.375,
        "losses/clipfrac": 0.5,
        "losses/ratio_mean": 3.0,
        "losses/kl": 2.5,
    }


def test_a_run_turns_off_cudnn_attention(make_run):
    """cuDNN's attention backward failed on an H200 with torch 2.11 (an illegal memory access at FLUX.1-dev's shapes,
    benchmarks/gpu/gpu_backward_check.py): every training run uses flash / memory-efficient attention instead."""
    import torch

    torch.backends.cuda.enable_cudnn_sdp(True)
    make_run()
    assert not torch.backends.cuda.cudnn_sdp_enabled()


# ---------------------------------------------------------------- the step guard: a non-finite gradient norm
def test_all_finite_refuses_inf_minus_inf_and_nan_and_passes_large_finite_norms():
    import torch

    from common.runs import all_finite

    accelerator = Accelerator(cpu=True)
    for bad in (float("inf"), float("-inf"), float("nan")):
        assert not all_finite(torch.tensor(bad), accelerator), bad
    for good in (0.0, 2.5, 3.0e38):
        assert all_finite(torch.tensor(good), accelerator), good


def test_skipped_steps_are_counted_logged_and_not_optimizer_steps(make_run):
    """Two steps taken (norms 2 and 5) around an inf and a -inf: 2 optimizer steps (what the warmup and the schedules
    read), 2 skipped, the mean norm of the steps taken only, the last learning rate."""
    import torch

    run = make_run(iterations=3)
    iterations = run.iterations(0)
    next(iterations)
    for lr, norm, stepped in ((1e-4, 2.0, True), (2e-4, float("inf"), False), (2e-4, float("-inf"), False),
                              (2e-4, 5.0, True)):  # fmt: skip
        run.count_step(lr, torch.tensor(norm), stepped)
    assert run.optimizer_steps == 2 and run.skipped == 2
    run.end_iteration(0, {"rewards/mean": 0.5}, [])
    (row,) = read_metrics(run.dir)
    assert row["charts/optimizer_steps"] == 2 and row["charts/skipped_updates"] == 2
    assert row["charts/grad_norm"] == 3.5 and row["charts/lr"] == 2e-4
    assert run.skipped == 0 and run.grad_norms == []  # the next iteration counts afresh


def test_three_iterations_in_a_row_without_a_step_stop_the_run_after_logging_them(make_run):
    """A NaN loss every time (every update skipped) trains nothing: the run stops with one RunError after the third such
    iteration in a row, its records written. An iteration with one step taken among skipped ones resets the count."""
    import torch

    from common import RunError
    from common.runs import STALLED

    assert STALLED == 3
    run = make_run(iterations=8)
    iterations = run.iterations(0)
    pattern = [[False], [False], [False, True], [False], [False]]  # per iteration, whether each update was taken
    for it, steps in enumerate(pattern):
        next(iterations)
        for stepped in steps:
            run.count_step(1e-4, torch.tensor(1.0 if stepped else float("nan")), stepped)
        run.end_iteration(it, {"rewards/mean": 0.5}, [])
    assert run.idle == 2  # iterations 3 and 4; iteration 2 took a step
    next(iterations)
    run.count_step(1e-4, torch.tensor(float("inf")), False)
    with pytest.raises(RunError) as e:
        run.end_iteration(5, {"rewards/mean": 0.5}, [])
    assert str(e.value) == (
        "every update of iterations 3-5 had a non-finite gradient norm (a NaN or inf loss: look at losses/* in "
        "metrics.jsonl), so nothing has trained since; lower --learning-rate or --max-grad-norm, or check the reward; "
        "the run stops here, its last checkpoint intact"
    )
    assert [r["charts/skipped_updates"] for r in read_metrics(run.dir)] == [1, 1, 1, 1, 1, 1]  # all six on record


# each script's tiny run with one optimizer step per iteration (the flags of its tests/test_<script>.py)
ONE_STEP = {
    "dancegrpo": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4",
                  "--samples-per-update", "4", "--num-steps", "4"],
    "branchgrpo": ["--trees-per-device", "1", "--trees-per-update", "1", "--num-steps", "6", "--num-splits", "2",
                   "--rollout-batch-size", "4"],
    "vgrpo": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4", "--train-batch-size", "2",
              "--samples-per-update", "4", "--num-steps", "4", "--n-mc", "2"],
    "rlr": ["--samples-per-device", "4", "--group-size", "2", "--rollout-batch-size", "2", "--num-steps", "4"],
    "diffusionnft": ["--samples-per-device", "4", "--group-size", "2", "--rollout-batch-size", "4",
                     "--train-batch-size", "4", "--samples-per-update", "4", "--num-steps", "4",
                     "--timestep-fraction", "0.5"],
    "dgpo": ["--samples-per-device", "4", "--group-size", "2", "--rollout-batch-size", "4", "--train-batch-size", "4",
             "--samples-per-update", "4", "--num-steps", "4", "--train-timesteps", "2", "--trunc-steps", "2"],
}  # fmt: skip


@pytest.mark.parametrize("script", list(ONE_STEP))
def test_an_inf_and_a_minus_inf_gradient_norm_skip_the_step_and_move_no_schedule(script, monkeypatch, tmp_path):
    """Three iterations of one optimizer step each, --learning-rate 2e-4 --lr-warmup 4; the gradient norm is real,
    then inf, then -inf. Only the first step is taken (one AdamW step, at 2e-4 x 1/4); the two skipped ones are
    counted and leave the warmup where the first step left it: the learning rate of iterations 2 and 3 is
    2e-4 x (1 + 1) / 4 = 1e-4 (counting skipped steps would give 1.5e-4 at iteration 3). DiffusionNFT's schedules
    read the same count: its EMA decay stays min((1 + 1) / (10 + 1), 0.9) = 2/11 and the old policy's eta
    min(0.001 x 1, 0.5) = 0.001, and its EMA of a LoRA B matrix (0 at the start) stays 9/11 of the trained one."""
    import importlib

    import torch
    from safetensors.torch import load_file

    from tests.helpers import LORA_WEIGHTS
    from tests.test_flags_applied import run_flags, train_rows

    norms = iter([None, float("inf"), float("-inf")])  # None: the real norm
    real_clip = Accelerator.clip_grad_norm_

    def clip(self, params, max_norm):
        norm, fake = real_clip(self, params, max_norm), next(norms)
        return norm if fake is None else torch.tensor(fake)

    monkeypatch.setattr(Accelerator, "clip_grad_norm_", clip)
    module = importlib.import_module(script)
    argv = [*ONE_STEP[script], "--iterations", "3", "--learning-rate", "2e-4", "--lr-warmup", "4", "--eval-every", "0",
            "--sample-every", "0", "--save-every", "3"]  # fmt: skip
    _, record = run_flags(module, monkeypatch, tmp_path, argv)
    assert [s["lr"] for s in record["steps"]] == [pytest.approx(5e-5)]  # one AdamW step: the skipped ones are not
    rows = train_rows(record)
    assert [r["charts/optimizer_steps"] for r in rows] == [1, 1, 1]
    assert [r["charts/skipped_updates"] for r in rows] == [0, 1, 1]
    assert [r["charts/lr"] for r in rows] == pytest.approx([5e-5, 1e-4, 1e-4])
    assert math.isfinite(rows[0]["charts/grad_norm"]) and all(math.isnan(r["charts/grad_norm"]) for r in rows[1:])
    if script == "diffusionnft":
        assert [r["nft/ema_decay"] for r in rows] == pytest.approx([2 / 11] * 3)
        assert [r["nft/old_eta"] for r in rows] == pytest.approx([0.001] * 3)
        run = record["runs"][-1]
        trained = load_file(run / "checkpoints" / "iter_000003" / "model.safetensors")
        ema = load_file(run / "final" / LORA_WEIGHTS)
        live = {k: trained[k.removeprefix("transformer.").replace(".weight", ".default.weight")] for k in ema}
        assert sum(live[k].abs().sum() > 0 for k in ema if "lora_B" in k) >= 4  # B matrices the step moved
        for k in (k for k in ema if "lora_B" in k):
            torch.testing.assert_close(ema[k], live[k] * 9 / 11, rtol=1e-5, atol=1e-12)  # B ~ 1e-5: no atol
