"""common/runs.py at values where a wrong constant, bound, sign or cadence shows: each against numbers or text worked
out by hand here. Written for the mutants benchmarks/testing/mutation.py generated that the other tests let pass."""

import types

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from common import InputError
from common.flags import RunArgs
from common.logs import read_metrics
from common.runs import Run, all_finite, weight_spread


def run_of(tmp_path, **kw):
    args = RunArgs(exp_name="t", output_dir=str(tmp_path), **{"lora": False, **kw})
    return Run(args, Accelerator(cpu=True), "the title")


class TwoRanks:
    """An accelerator of two processes whose other process holds `other` (what gather and reduce see of it)."""

    device, num_processes, distributed_type = torch.device("cpu"), 2, DistributedType.MULTI_CPU

    def __init__(self, other):
        self.other = other

    def gather(self, x):
        return torch.cat([x, self.other])

    def reduce(self, x, op):
        assert op == "sum"
        return x + self.other


def test_the_weight_spread_is_the_largest_difference_of_a_tensors_sums_across_processes():
    """Sums on this process (3, 0.5), on the other (3.25, -1.5): differences 0.25 and 2, so 2; identical: 0."""
    params = [torch.tensor([1.0, 2.0]), torch.tensor([[0.5]])]
    assert weight_spread(params, TwoRanks(torch.tensor([3.25, -1.5], dtype=torch.float64))) == 2.0
    assert weight_spread(params, TwoRanks(torch.tensor([3.0, 0.5], dtype=torch.float64))) == 0.0


def test_a_non_finite_norm_on_another_process_skips_the_step_here_too():
    assert all_finite(torch.tensor(2.5), TwoRanks(torch.tensor(0.0)))
    assert not all_finite(torch.tensor(2.5), TwoRanks(torch.tensor(1.0)))  # the other process saw inf or NaN
    assert not all_finite(torch.tensor(float("inf")), TwoRanks(torch.tensor(0.0)))


def test_a_frozen_copy_is_refused_under_fsdp():
    fsdp = types.SimpleNamespace(
        distributed_type=DistributedType.FSDP, device=torch.device("cpu"), is_main_process=True
    )
    with pytest.raises(InputError) as e:
        Run(RunArgs(exp_name="t"), fsdp, "t", frozen_copy=True)
    assert str(e.value) == (
        "--kl-beta > 0 with full fine-tuning keeps an unsharded frozen copy on every GPU; "
        "under FSDP pass --kl-beta 0 or use --lora"
    )


def test_a_run_folder_that_exists_is_refused_naming_both_ways_out(tmp_path, monkeypatch):
    monkeypatch.setattr("time.time", lambda: 1000.0)
    (tmp_path / "t__0__1000").mkdir()
    with pytest.raises(InputError) as e:
        run_of(tmp_path)
    folder = tmp_path / "t__0__1000"
    assert str(e.value) == f"{folder} exists already: pass another --exp-name or --resume-from {folder}"


def test_iterations_and_the_spread_every_ten_iterations_and_at_the_last(tmp_path, capsys):
    """iterations 2..24 of 25; the weights' spread is logged after iterations 9 and 19 (every 10th) and 24 (the last),
    nowhere else; an iteration whose steps were all skipped logs a NaN norm and says how many it skipped."""
    run = run_of(tmp_path, iterations=25)
    its = run.iterations(2)
    assert next(its) == 2
    params = [torch.ones(2)]
    for it in range(2, 25):
        if it == 5:
            run.count_step(1e-4, torch.tensor(float("nan")), False)
            run.count_step(1e-4, torch.tensor(float("inf")), False)
        else:
            run.count_step(1e-4, torch.tensor(float(it)), True)
        run.end_iteration(it, {"rewards/mean": 0.5}, params)
    assert list(its) == list(range(3, 25))
    rows = {r["iteration"]: r for r in read_metrics(run.dir)}
    assert [i for i, r in rows.items() if "charts/rank_weight_spread" in r] == [10, 20, 25]
    assert rows[10]["charts/rank_weight_spread"] == 0.0
    assert rows[6]["charts/grad_norm"] != rows[6]["charts/grad_norm"] and rows[6]["charts/skipped_updates"] == 2
    assert rows[7]["charts/grad_norm"] == 6.0 and rows[25]["charts/optimizer_steps"] == 22
    assert "iteration 5: skipped 2 update(s) with a non-finite gradient norm" in capsys.readouterr().out


def test_checkpoints_every_save_every_iterations_and_at_the_end(tmp_path, capsys):
    run = run_of(tmp_path, save_every=3, checkpoints_total_limit=5)
    for it in (1, 2, 3, 4, 5, 6, 7):
        run.checkpoint(it, final=it == 7)
    assert sorted(p.name for p in run.ckpt.dir.iterdir()) == ["iter_000003", "iter_000006", "iter_000007"]
    run.logs.close()
    resumed = run_of(tmp_path, save_every=3, resume_from="latest")
    assert resumed.resume() == 7
    assert f"resumed from {run.ckpt.dir / 'iter_000007'} at iteration 7" in capsys.readouterr().out
    never = run_of(tmp_path / "never", save_every=0)
    for it in (1, 2, 3):
        never.checkpoint(it, final=False)
    assert not never.ckpt.dir.exists()  # --save-every 0: only at the end


def test_the_banner_by_hand(tmp_path, capsys):
    run = run_of(tmp_path, lora=True, lora_rank=8, gradient_checkpointing=True, offload_frozen=True, iterations=7)
    model = types.SimpleNamespace(kind="shapes", latent_shape=lambda: (4, 8, 8))
    run.banner(model, [torch.zeros(2_000_000), torch.zeros(500_000)], ["line one", "line two"])
    assert capsys.readouterr().out == (
        "***** the title *****\n"
        "  model shapesbench (shapes), latent (4, 8, 8), LoRA r=8, 2.50M trainable params, mixed precision no, "
        f"gradient checkpointing, frozen parts on the CPU between uses, {run.attention}\n"
        "  line one\n  line two\n"
        "  reward shapes, lr 0.0003, iterations 7\n  evaluation off (--eval-every 0)\n"
        f"  run folder {run.dir}\n"
    )
    plain = run_of(tmp_path / "plain")
    plain.banner(model, [torch.zeros(5_000)], [])  # 0.005M, shown as 0.01M (a count over 1,000,001: 0.00M)
    out = capsys.readouterr().out
    assert "latent (4, 8, 8), full fine-tuning, 0.01M trainable params, mixed precision no, " in out
    assert "checkpointing" not in out and "frozen parts" not in out


def test_the_last_line_says_where_the_weights_are_or_that_they_were_not_saved(tmp_path, capsys, monkeypatch):
    run = run_of(tmp_path, save=False, iterations=3)
    run.t_start = 100.0  # the run's start; now 600 s of perf_counter later: 10.0 min
    monkeypatch.setattr("common.runs.time.perf_counter", lambda: 700.0)
    run.save_final(None, None, lora=False)
    assert capsys.readouterr().out == "done: 3 iterations (10.0 min here); trained weights not saved (--no-save)\n"


def test_the_progress_bar_counts_iterations_from_the_resumed_one_on_the_main_process_only(tmp_path, capsys):
    """iterations 2..4 of 5 (resumed at 2): "iterations" from 2/5 to 5/5, each iteration's mean reward and seconds
    after it; another process shows none."""
    run = run_of(tmp_path, iterations=5)
    for it in run.iterations(2):
        run.count_step(1e-4, torch.tensor(1.0), True)
        run.end_iteration(it, {"rewards/mean": 0.25 * it}, [torch.ones(2)])
        seconds = read_metrics(run.dir)[-1]["perf/iteration_s"]
        assert run.bar.postfix == f"reward={0.25 * it:.4f}, s_it={seconds:.1f}"
    err = capsys.readouterr().err
    assert err.startswith("\riterations:  40%|") and "| 2/5 [" in err and "| 5/5 [" in err, err
    other = run_of(tmp_path / "other", iterations=5)
    other.accelerator = types.SimpleNamespace(is_local_main_process=False)  # what iterations() reads of it
    assert list(other.iterations(0)) == [0, 1, 2, 3, 4]
    assert capsys.readouterr().err == ""


def test_a_frozen_copy_is_accepted_without_fsdp(tmp_path):
    Run(RunArgs(exp_name="t", output_dir=str(tmp_path), lora=False), Accelerator(cpu=True), "t", frozen_copy=True)


@pytest.mark.parametrize("save", [True, False])
def test_sigterm_stops_the_run_at_the_checkpoint_with_status_143_and_says_how_to_go_on(tmp_path, capsys, save):
    """SIGTERM (15) noted during iteration 3 of --save-every 10: the checkpoint after it is written anyway (with
    --save), the run exits with 128 + 15 = 143 and names the signal, the iteration and the way to resume."""
    import signal

    run = run_of(tmp_path, save_every=10, save=save)
    run.stop.pending = lambda: signal.SIGTERM
    with pytest.raises(SystemExit) as e:
        run.checkpoint(3, final=False)
    assert e.value.code == 143
    out = capsys.readouterr().out
    if save:
        assert [p.name for p in run.ckpt.dir.iterdir()] == ["iter_000003"]
        expected = f"checkpoint in {run.ckpt.dir}; to go on, run the same command with --resume-from {run.dir}"
    else:
        assert not run.ckpt.dir.exists()
        expected = "no checkpoint (--no-save)"
    assert out == f"SIGTERM: stopped after iteration 3, {expected}\n"


def test_the_iterations_timings_are_durations(tmp_path):
    run = run_of(tmp_path, iterations=2)
    its = run.iterations(0)
    next(its)
    run.end_iteration(0, {"rewards/mean": 0.5}, [torch.ones(1)])
    (row,) = read_metrics(run.dir)
    assert 0 <= row["perf/iteration_s"] <= row["perf/wall_s"] < 600
    assert row["perf/peak_mem_gb"] >= 0


class FsdpOnCpu(Accelerator):
    """A CPU accelerator that says it runs under FSDP: what Run checks of it."""

    distributed_type = DistributedType.FSDP


def test_a_run_without_a_frozen_copy_is_accepted_under_fsdp(tmp_path):
    """rlr.py builds its Run without frozen_copy: under FSDP that run is accepted; one with a frozen copy is not."""
    Run(RunArgs(exp_name="t", output_dir=str(tmp_path), lora=False), FsdpOnCpu(cpu=True), "t")
    with pytest.raises(InputError):
        Run(
            RunArgs(exp_name="t", output_dir=str(tmp_path / "b"), lora=False),
            FsdpOnCpu(cpu=True),
            "t",
            frozen_copy=True,
        )


def test_a_lora_runs_checkpoint_holds_only_the_trained_tensors(tmp_path):
    """With --lora a checkpoint holds the trained parameters only (the adapter), not the frozen base: a model of a
    frozen layer 0 and a trained layer 1 saves 1.weight and 1.bias."""
    from safetensors.torch import load_file

    run = run_of(tmp_path, lora=True)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].requires_grad_(False)
    run.accelerator.prepare(model)
    run.checkpoint(1, final=True)
    assert sorted(load_file(run.ckpt.dir / "iter_000001" / "model.safetensors")) == ["1.bias", "1.weight"]


def test_a_damaged_checkpoint_is_refused_naming_the_resume_flag_as_given(tmp_path):
    """--resume-from a run folder whose newest checkpoint is empty: one error naming the flag's value and the folder."""
    folder = tmp_path / "t__0__5"
    (folder / "checkpoints" / "iter_000002").mkdir(parents=True)
    run = run_of(tmp_path, resume_from=str(folder))
    with pytest.raises(InputError) as e:
        run.resume()
    ckpt = folder / "checkpoints" / "iter_000002"
    assert str(e.value).startswith(f"--resume-from {folder}: {ckpt} is not a checkpoint of this script and settings (")
