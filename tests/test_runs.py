"""The run plumbing in-process (common/runs.py, checkpoints.py, logs.py): checkpoints written whole or not at all, rotation, one record per
iteration after a resume, the W&B run id kept across resumes. The scripts' fault tests (SIGKILL, SIGTERM, a full
disk) are in tests/test_<script>.py."""

import errno
import json
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
    benchmarks/gpu_backward_check.py): every training run uses flash / memory-efficient attention instead."""
    import torch

    torch.backends.cuda.enable_cudnn_sdp(True)
    make_run()
    assert not torch.backends.cuda.cudnn_sdp_enabled()
