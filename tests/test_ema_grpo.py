"""--ema in dancegrpo.py and branchgrpo.py, as vgrpo.py has it: an EMA of the trained weights, decay
min((1 + s) / (10 + s), --ema-max-decay) after s optimizer steps, is what the held-out evaluation samples and what
final/ holds, and the checkpoints carry it. Each script on tiny ShapesBench settings (two optimizer steps an
iteration): final/ is the EMA worked out by hand from the recorded per-step weights, the evaluation after training
sees exactly those weights and logs another figure than the run without --ema (whose training is bitwise the same);
a run stopped by SIGTERM and resumed from its checkpoint ends with the straight run's final/ and EMA, bit for bit;
under FSDP --ema is refused at start-up in one line. Without --ema nothing more is registered, logged or saved."""

import os
import signal
import sys

import pytest
import torch
import tyro
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors.torch import load_file

import branchgrpo as B
import dancegrpo as D
from common.checkpoints import Carried
from common.evaluator import Evaluator
from common.models import load_model, trainable_denoiser
from common.runs import Run
from tests.helpers import LORA_WEIGHTS, assert_same_trained_weights, find_run, metrics
from tests.test_flags_applied import run_flags, train_rows

MODULES = {"dancegrpo": D, "branchgrpo": B}
TINY = {  # two optimizer steps per iteration
    "dancegrpo": ["--samples-per-device", "8", "--group-size", "4", "--rollout-batch-size", "4",
                  "--samples-per-update", "4", "--num-steps", "4"],
    "branchgrpo": ["--trees-per-device", "2", "--trees-per-update", "1", "--num-steps", "6", "--num-splits", "2",
                   "--rollout-batch-size", "4"],
}  # fmt: skip
EVAL = ["--eval-every", "1", "--eval-max-prompts", "2", "--eval-samples-per-prompt", "1", "--eval-steps", "2"]
BY_HAND = ["--iterations", "1", "--learning-rate", "1e-2", "--lr-warmup", "0", "--sample-every", "0", "--no-save"]


def recorded(monkeypatch):
    """What main() hands on, recorded: the trained tensors given to final/ (save_final), the Carried objects
    registered for checkpointing, and at each evaluation the trained tensors of the module the evaluator samples."""
    seen = {"final": [], "carried": [], "evaluated": []}
    save_final, register, evaluate = Run.save_final, Accelerator.register_for_checkpointing, Evaluator.__call__

    def recorded_save_final(self, model, prepared, lora):
        seen["final"].append([p.detach().clone() for p in prepared.parameters() if p.requires_grad])
        return save_final(self, model, prepared, lora)

    def recorded_register(self, *objects):
        seen["carried"].extend(o for o in objects if isinstance(o, Carried))  # the run's counters apart
        return register(self, *objects)

    def recorded_evaluate(self, step, final=False):
        seen["evaluated"].append([p.detach().clone() for p in self.module.parameters() if p.requires_grad])
        return evaluate(self, step, final)

    monkeypatch.setattr(Run, "save_final", recorded_save_final)
    monkeypatch.setattr(Accelerator, "register_for_checkpointing", recorded_register)
    monkeypatch.setattr(Evaluator, "__call__", recorded_evaluate)
    return seen


def eval_rewards(record) -> dict:
    return {r["iteration"]: r["eval/reward"] for r in record["metrics"] if "eval/reward" in r}


@pytest.mark.parametrize("script", list(MODULES))
def test_final_and_the_evaluation_are_the_ema_worked_out_by_hand(script, monkeypatch, tmp_path):
    """Two optimizer steps with --ema-max-decay 0.2: the decay is min(2 / 11, 0.2) = 2/11 after the first step and
    min(3 / 12, 0.2) = 0.2 after the second, so the EMA is 0.2 (2/11 p0 + 9/11 p1) + 0.8 p2 from the weights p0
    before and p1, p2 after the steps; final/ and the evaluation after the iteration get it, the evaluation before
    the weights p0 (the EMA starts as a copy). The same run without --ema trains bitwise the same weights, saves p2,
    registers and logs nothing more, and its evaluation after the iteration scores another figure."""
    module, flags = MODULES[script], [*TINY[script], *BY_HAND, *EVAL]
    seen = recorded(monkeypatch)
    _, ema_run = run_flags(module, monkeypatch, tmp_path / "ema", [*flags, "--ema", "--ema-max-decay", "0.2"])
    p0, p1, p2 = ema_run["steps"][0]["before"], ema_run["steps"][0]["after"], ema_run["steps"][1]["after"]
    assert len(ema_run["steps"]) == 2
    (final,) = seen["final"]
    for a, b, c, f in zip(p0, p1, p2, final, strict=True):
        torch.testing.assert_close(f, 0.2 * (2 / 11 * a + 9 / 11 * b) + 0.8 * c, rtol=0, atol=1e-6)
    assert any(not torch.equal(f, c) for f, c in zip(final, p2))  # not the live weights
    start, after = seen["evaluated"]
    assert all(torch.equal(e, a) for e, a in zip(start, p0, strict=True))
    assert all(torch.equal(e, f) for e, f in zip(after, final, strict=True))  # the evaluation samples final/'s
    (row,) = train_rows(ema_run)
    assert row["charts/ema_decay"] == pytest.approx(0.2)
    (carried,) = seen["carried"]
    assert len(carried.tensors["ema"]) == len(final)

    seen.update(final=[], carried=[], evaluated=[])
    _, live_run = run_flags(module, monkeypatch, tmp_path / "live", flags)
    for ema_step, live_step in zip(ema_run["steps"], live_run["steps"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ema_step["after"], live_step["after"], strict=True))
    (final,) = seen["final"]
    assert all(torch.equal(f, c) for f, c in zip(final, p2, strict=True))
    assert seen["carried"] == [] and "charts/ema_decay" not in train_rows(live_run)[0]
    ema_eval, live_eval = eval_rewards(ema_run), eval_rewards(live_run)
    assert list(ema_eval) == list(live_eval) == [0, 1]
    assert ema_eval[0] == live_eval[0] and ema_eval[1] != live_eval[1]


def preempt_in_iteration(monkeypatch, iteration: int):
    """SIGTERM to this process at the end of `iteration` (1-based): the run writes a checkpoint and exits with
    128 + 15 there, as a preempted job does."""
    end_iteration = Run.end_iteration

    def preempted(self, it, scalars, params):
        end_iteration(self, it, scalars, params)
        if it + 1 == iteration:
            os.kill(os.getpid(), signal.SIGTERM)  # noted by the run's handler, obeyed at the checkpoint

    monkeypatch.setattr(Run, "end_iteration", preempted)


def carried_ema(checkpoint) -> list[torch.Tensor]:
    """The EMA a checkpoint folder carries (the Carried object among its custom objects)."""
    (ema,) = [s["ema"] for p in sorted(checkpoint.glob("custom_checkpoint_*.pkl"))
              if "ema" in (s := torch.load(p, weights_only=False))]  # fmt: skip
    return ema


def run(module, argv, out):
    module.main(tyro.cli(module.Args, args=[*argv, "--output-dir", str(out)]))


@pytest.mark.parametrize("script", list(MODULES))
def test_a_run_preempted_and_resumed_ends_with_the_straight_runs_final_and_ema(script, monkeypatch, tmp_path):
    """--ema at the non-neutral --ema-max-decay 0.5, three iterations: one preempted after its first iteration and
    resumed from that checkpoint ends with the straight run's final/ (the EMA's weights) and the EMA its last
    checkpoint carries, bit for bit; the EMA is not the live weights, so a resume that lost it would differ."""
    module = MODULES[script]
    argv = [*TINY[script], "--ema", "--ema-max-decay", "0.5", "--iterations", "3", "--save-every", "1",
            "--eval-every", "0", "--sample-every", "0", "--learning-rate", "1e-2"]  # fmt: skip
    run(module, [*argv, "--exp-name", "straight"], tmp_path)
    with monkeypatch.context() as m:
        preempt_in_iteration(m, 1)
        with pytest.raises(SystemExit) as stopped:
            run(module, [*argv, "--exp-name", "cut"], tmp_path)
    assert stopped.value.code == 128 + signal.SIGTERM
    del stopped  # its traceback holds the stopped run's frames (and its signal handlers)
    cut = find_run(tmp_path / "cut")
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["iter_000001"] and not (cut / "final").exists()
    run(module, [*argv, "--exp-name", "cut", "--resume-from", "latest"], tmp_path)
    assert [r["iteration"] for r in metrics(cut) if "charts/ema_decay" in r] == [1, 2, 3]
    assert_same_trained_weights(tmp_path / "straight", cut)
    last = [find_run(tmp_path / name) / "checkpoints" / "iter_000003" for name in ("straight", "cut")]
    ema_straight, ema_cut = (carried_ema(c) for c in last)
    assert all(torch.equal(a, b) for a, b in zip(ema_straight, ema_cut, strict=True))
    ema = dict(zip(trained_names(module), ema_straight, strict=True))  # the EMA's list is in the parameters' order
    live = load_file(last[0] / "model.safetensors")
    assert sorted(live) == sorted(ema) and any(not torch.equal(ema[k], live[k]) for k in ema)
    final = load_file(find_run(tmp_path / "straight") / "final" / LORA_WEIGHTS)
    for k, v in final.items():  # final/ holds the EMA, under diffusers' adapter names
        assert torch.equal(v, ema[k.removeprefix("transformer.").replace(".weight", ".default.weight")]), k


def trained_names(module) -> list[str]:
    """The names of the trained parameters at the script's defaults (a LoRA adapter), in the parameters' order."""
    denoiser = trainable_denoiser(load_model("shapesbench"), module.Args())
    return [n for n, p in denoiser.named_parameters() if p.requires_grad]


class FsdpOnCpu(Accelerator):
    """A CPU accelerator that says it runs under FSDP."""

    distributed_type = DistributedType.FSDP


@pytest.mark.parametrize("script", list(MODULES))
def test_ema_under_fsdp_is_refused_at_start_up_in_one_line(script, monkeypatch, tmp_path, capsys):
    module = MODULES[script]
    monkeypatch.setattr(module, "Accelerator", FsdpOnCpu)
    monkeypatch.setattr(module, "load_model", lambda *a, **kw: pytest.fail("a model loaded"))
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--ema", "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as done:
        module.cli(module.main, module.Args)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --ema ") and "FSDP" in err and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())  # no run folder
