"""With an EMA (diffusionnft.py by default, vgrpo.py with --ema), every evaluation during training sees the EMA
weights, not the live ones the optimizer steps: the docs promise that eval/* is the EMA's. The last evaluation of a
run and its final/ adapter (the EMA's, as the official checkpoints) must hold the same trained tensors, and after a
few optimizer steps the live weights differ from them."""

import pytest
from safetensors.torch import load_file

from common.evaluator import Evaluator
from tests.helpers import LORA_WEIGHTS, find_run, run_in_process

TINY_EVAL = ["--eval-every", "1", "--eval-max-prompts", "2", "--eval-samples-per-prompt", "1", "--eval-steps", "2"]
FLAGS = {  # two optimizer steps per iteration, two iterations: the EMA lags the live weights
    "diffusionnft.py": ["--samples-per-device", "8", "--group-size", "4", "--rollout-batch-size", "4",
                        "--train-batch-size", "4", "--samples-per-update", "4", "--num-steps", "4",
                        "--timestep-fraction", "0.5"],
    "vgrpo.py": ["--ema", "--samples-per-device", "8", "--group-size", "4", "--rollout-batch-size", "4",
                 "--train-batch-size", "4", "--samples-per-update", "4", "--num-steps", "4", "--n-mc", "2"],
}  # fmt: skip


def fingerprint(tensors) -> list[tuple]:
    """The trained tensors as a sorted list of (shape, sum of squares): independent of names and of their order."""
    return sorted((tuple(t.shape), round(float(t.double().square().sum()), 10)) for t in tensors)


@pytest.mark.parametrize("script", list(FLAGS))
def test_every_evaluation_during_training_sees_the_ema_weights(script, tmp_path, monkeypatch):
    seen = []  # per evaluation: the trained tensors of the module the evaluator samples, and those live after it
    call = Evaluator.__call__

    def recording(self, step, final=False):
        trained = [p for p in self.module.parameters() if p.requires_grad]
        seen.append(fingerprint(p.detach() for p in trained))
        return call(self, step, final)

    monkeypatch.setattr(Evaluator, "__call__", recording)
    flags = [*FLAGS[script], *TINY_EVAL, "--iterations", "2", "--sample-every", "0", "--exp-name", "ema"]
    run_in_process(script, flags, tmp_path)
    final = load_file(find_run(tmp_path / "ema") / "final" / LORA_WEIGHTS)
    ema = fingerprint(final.values())
    assert len(seen) == 3  # at the start, after iteration 1, after iteration 2
    assert seen[-1] == ema  # the last evaluation sampled the EMA weights that final/ holds
    assert seen[1] != seen[-1]  # the weights moved between the evaluations
