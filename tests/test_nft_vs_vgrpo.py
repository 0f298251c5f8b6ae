"""vgrpo.py --ema by hand at a non-neutral decay, and the default run (no EMA) unchanged."""

import pytest
import torch
from accelerate import Accelerator

import vgrpo as V
from common.checkpoints import Carried
from common.runs import Run
from tests.test_flags_applied import QUIET, run_flags, train_rows

# ---------------------------------------------------------------- vgrpo.py --ema
TINY = ["--iterations", "1", "--samples-per-device", "8", "--group-size", "4", "--rollout-batch-size", "4",
        "--train-batch-size", "2", "--samples-per-update", "4", "--num-steps", "2", "--n-mc", "2",
        "--learning-rate", "1e-2", *QUIET]  # fmt: skip


def finals_and_registered(monkeypatch):
    """The trained tensors handed to final/ and the Carried tensors registered for checkpointing, recorded."""
    finals, registered = [], []
    save_final, register = Run.save_final, Accelerator.register_for_checkpointing

    def recorded_save_final(self, model, prepared, lora):
        finals.append([p.detach().clone() for p in prepared.parameters() if p.requires_grad])
        return save_final(self, model, prepared, lora)

    def recorded_register(self, *objects):
        registered.extend(o for o in objects if isinstance(o, Carried))  # the run's counters apart
        return register(self, *objects)

    monkeypatch.setattr(Run, "save_final", recorded_save_final)
    monkeypatch.setattr(Accelerator, "register_for_checkpointing", recorded_register)
    return finals, registered


def test_vgrpo_ema_by_hand_at_a_non_neutral_decay(monkeypatch, tmp_path):
    """2 optimizer steps with --ema-max-decay 0.2: the EMA's decay is min(2 / 11, 0.2) = 2/11 after the first step
    and min(3 / 12, 0.2) = 0.2 after the second, so final/ gets 0.2 (2/11 p0 + 9/11 p1) + 0.8 p2; the EMA is carried
    in the checkpoints."""
    finals, registered = finals_and_registered(monkeypatch)
    _, record = run_flags(V, monkeypatch, tmp_path, [*TINY, "--ema", "--ema-max-decay", "0.2"])
    steps = record["steps"]
    assert len(steps) == 2
    (final,) = finals
    for p0, p1, p2, f in zip(steps[0]["before"], steps[0]["after"], steps[1]["after"], final, strict=True):
        torch.testing.assert_close(f, 0.2 * (2 / 11 * p0 + 9 / 11 * p1) + 0.8 * p2, rtol=0, atol=1e-6)
    assert any(not torch.equal(f, p) for f, p in zip(final, steps[1]["after"]))  # not the live weights
    (row,) = train_rows(record)
    assert row["charts/ema_decay"] == pytest.approx(0.2)
    (carried,) = registered
    assert len(carried.tensors["ema"]) == len(final)


def test_vgrpo_default_saves_the_live_weights_and_carries_nothing_more(monkeypatch, tmp_path):
    """Without --ema (the default) final/ gets the last step's weights, nothing more is registered for the checkpoints
    and nothing more is logged: the default run as before the flag."""
    finals, registered = finals_and_registered(monkeypatch)
    _, record = run_flags(V, monkeypatch, tmp_path, TINY)
    (final,) = finals
    assert all(torch.equal(f, p) for f, p in zip(final, record["steps"][-1]["after"], strict=True))
    assert registered == [] and "charts/ema_decay" not in train_rows(record)[0]
    assert not V.Args().ema
