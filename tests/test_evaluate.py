"""python -m common.evaluate: a run's final/ scored with the run's own evaluation settings gives exactly the run's
last held-out evaluation (and the base model its first); an interrupted evaluation recomputes only the batches it
had not cached; two processes give the table of one; tiny FLUX and tiny Wan end to end; paired differences by hand."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import tyro

from common import evaluate as E
from common.models import add_lora, load_model, save_trained_weights
from tests.helpers import ROOT, find_run, metrics, run_script
from tests.tiny import BUILDERS, RES

TRAIN = ["--iterations", "2", "--samples-per-device", "8", "--group-size", "4", "--rollout-batch-size", "4",
         "--samples-per-update", "4", "--num-steps", "4", "--eval-every", "2", "--eval-samples-per-prompt", "1",
         "--eval-steps", "4", "--eval-max-prompts", "8", "--sample-every", "0"]  # fmt: skip
SAME_AS_TRAINING = ["--num-steps", "4", "--samples-per-prompt", "1", "--max-prompts", "8", "--batch-size", "4"]


def test_a_runs_final_weights_give_its_last_evaluation_and_an_interrupted_evaluation_resumes(tmp_path, monkeypatch):
    run_script("dancegrpo.py", [*TRAIN, "--exp-name", "d"], tmp_path)
    run = find_run(tmp_path / "d")
    evals = {r["iteration"]: r for r in metrics(tmp_path / "d") if "eval/reward" in r}
    out = tmp_path / "eval"
    checkpoint = f"checkpoint={run / 'checkpoints' / 'iter_000002'}"  # the same adapter, from its checkpoint
    argv = [*SAME_AS_TRAINING, "--weights", f"trained={run}", "--weights", checkpoint, "--reward", "shapes"]
    argv += ["--out", str(out)]
    E.main(tyro.cli(E.EvalArgs, args=argv))
    result = json.loads((out / "results.json").read_text())
    for name, iteration in (("base", 0), ("trained", 2)):
        figures = result["figures"][name]
        for key in ("reward", "reward_shapes", "shape_acc", "all_acc", "clean_acc", "bg_acc", "reward_mean"):
            assert figures[key] == evals[iteration][f"eval/{key}"], (name, key)  # exactly
    assert result["figures"]["checkpoint"] == result["figures"]["trained"]
    mean, se = result["deltas"]["trained"]["shapes"]
    assert mean == pytest.approx(figures["reward_shapes"] - result["figures"]["base"]["reward_shapes"], abs=1e-6)
    assert se > 0 and "| trained | " in (out / "results.md").read_text() and (out / "grid.png").stat().st_size > 0
    assert len((out / "scores.jsonl").read_text().splitlines()) == 8

    # interrupted: one batch of the trained model was never written; only it is sampled again
    (out / "cache" / "trained" / "000004.pt").unlink()
    calls = []
    monkeypatch.setattr(E, "sample_prompts", lambda *a, **kw: calls.append(1) or sample_prompts(*a, **kw))
    E.main(tyro.cli(E.EvalArgs, args=argv))
    assert len(calls) == 1 and json.loads((out / "results.json").read_text()) == result
    with pytest.raises(ValueError, match="another evaluation"):  # a cache of other settings is never mixed in
        E.main(tyro.cli(E.EvalArgs, args=[*argv, "--seed", "1"]))
    moved = [f"trained={run / 'checkpoints' / 'iter_000002'}" if a == f"trained={run}" else a for a in argv]
    with pytest.raises(ValueError, match=r"another evaluation's batches \(another trained\)"):  # a row's weights
        E.main(tyro.cli(E.EvalArgs, args=moved))

    # two processes: the same batches, so the same figures
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    two = subprocess.run([*launch, "-m", "common.evaluate", *argv[:-1], str(tmp_path / "two")], cwd=ROOT, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert json.loads((tmp_path / "two" / "results.json").read_text())["figures"] == result["figures"]


sample_prompts = E.sample_prompts


def test_paired_standard_error_by_hand():
    mean, se = E.paired(torch.tensor([1.0, 2.0, 4.0]))  # mean 7/3, unbiased variance 7/3
    assert mean == pytest.approx(7 / 3) and se == pytest.approx(math.sqrt(7 / 3) / math.sqrt(3))


@pytest.mark.parametrize("kind", ["flux", "wan"])
def test_tiny_real_models_against_a_lora_fine_tune(kind, tmp_path):
    """A random LoRA adapter saved as a run saves it, on tiny FLUX / Wan, scored by JPEG size (Wan: and motion);
    HPDv2-style prompts from its benchmark JSON files give the per-style table."""
    BUILDERS[kind](tmp_path / kind)
    frames = ["--num-frames", "5"] if kind == "wan" else []
    model = load_model(str(tmp_path / kind), resolution=RES, num_frames=5 if kind == "wan" else None)
    add_lora(model.transformer, 4, 4.0)
    for name, p in model.transformer.named_parameters():
        if "lora_B" in name:
            p.data = 0.5 * torch.randn_like(p)
    save_trained_weights(model, model.transformer, tmp_path / "final", lora=True)
    for style in ("anime", "concept-art", "paintings", "photo"):
        (tmp_path / "hpd" / "benchmark").mkdir(parents=True, exist_ok=True)
        (tmp_path / "hpd" / "benchmark" / f"{style}.json").write_text(json.dumps([f"a {style} cat", f"a {style} dog"]))
    reward = "jpeg,temporal:0.5" if kind == "wan" else "jpeg"
    argv = ["--model-id", str(tmp_path / kind), "--resolution", str(RES), *frames, "--weights", str(tmp_path / "final"),
            "--prompts", f"hpdv2={tmp_path / 'hpd'}", "--reward", reward, "--samples-per-prompt", "2",
            "--num-steps", "2", "--guidance-scale", "2", "--batch-size", "4", "--out", str(tmp_path / "eval")]  # fmt: skip
    E.main(tyro.cli(E.EvalArgs, args=argv))
    result = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert result["settings"]["n_prompts"] == 8 and len(result["figures"]) == 2
    trained = [m for m in result["figures"] if m != "base"][0]
    assert result["figures"][trained]["reward_jpeg"] != result["figures"]["base"]["reward_jpeg"]  # the adapter acts
    assert set(result["deltas"][trained]) >= {"jpeg", "jpeg/anime", "jpeg/photo"}
    assert "per style" in (tmp_path / "eval" / "results.md").read_text()
    with pytest.raises(ValueError, match="shapes, verifier, --prompts shapes-eval belong to ShapesBench"):
        E.main(tyro.cli(E.EvalArgs, args=["--model-id", str(tmp_path / kind)]))  # ShapesBench's defaults, refused
