"""A fork changes one place: each script copied into a folder of its own, the body of its objective function changed
(the clipped term of `policy_loss` doubled; RLR: the weight of its half-order term in `term_weights`; DiffusionNFT:
its NFT term), runs one iteration and logs exactly twice the original's figure (the gradient norm, before clipping: at
the first update the ratio is 1 and a group's surrogate averages to 0; RLR: the half-order weights; DiffusionNFT: the
loss itself). A DanceGRPO fork also changes its advantage and registers a
reward from its own file, as docs/forking.md shows."""

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from tests.helpers import ROOT, find_run, metrics, run_in_process

QUICK = ["--iterations", "1", "--eval-every", "0", "--sample-every", "0", "--no-save"]
FLAGS = {  # one optimizer step per iteration, so every logged figure comes from the same, unchanged weights
    "dancegrpo.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4",
                     "--samples-per-update", "4", "--num-steps", "4"],
    "branchgrpo.py": ["--trees-per-device", "1", "--trees-per-update", "1", "--num-steps", "6", "--num-splits", "2",
                      "--rollout-batch-size", "4"],
    "vgrpo.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4", "--train-batch-size",
                 "2", "--samples-per-update", "4", "--num-steps", "4", "--n-mc", "2"],
    "rlr.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "2", "--num-steps", "4"],
    "diffusionnft.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4",
                        "--train-batch-size", "4", "--samples-per-update", "4", "--num-steps", "4",
                        "--timestep-fraction", "0.5"],
}  # fmt: skip
# (function, text in its body, replacement, the logged figure that doubles)
LOSS_EDITS = {
    "dancegrpo.py": ("policy_loss", "surrogate = torch.maximum(", "surrogate = 2 * torch.maximum(", "charts/grad_norm"),
    "branchgrpo.py": ("policy_loss", "surrogate = torch.maximum(", "surrogate = 2 * torch.maximum(", "charts/grad_norm"),
    "vgrpo.py": ("policy_loss", "surrogate = torch.maximum(", "surrogate = 2 * torch.maximum(", "charts/grad_norm"),
    "rlr.py": ("term_weights", "w_ho, w_zo = rewards - loo_baseline(", "w_ho, w_zo = 2 * rewards - 2 * loo_baseline(",
               "rlr/ho_adv_abs"),
    "diffusionnft.py": ("policy_loss", "loss = adv_clip_max * (", "loss = 2 * adv_clip_max * (", "losses/policy"),
}  # fmt: skip


def body(source: str, function: str) -> tuple[int, int]:
    """Where the module-level `function`'s definition starts and ends in `source`."""
    start = source.index(f"\ndef {function}(")
    return start, source.index("\ndef ", start + 1)


def edit(source: str, function: str, old: str, new: str) -> str:
    """`source` with `old` replaced by `new` once, inside `function` and nowhere else."""
    start, end = body(source, function)
    assert source.count(old) == 1 and start < source.index(old) < end, (function, old)
    return source.replace(old, new)


def run(script_path, flags, out, name):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # the fork imports the repository's common/
    cmd = [sys.executable, str(script_path), *flags, *QUICK, "--output-dir", str(out), "--exp-name", name]
    done = subprocess.run(cmd, cwd=script_path.parent, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return [r for r in metrics(find_run(out / name)) if "rewards/mean" in r]


@pytest.mark.parametrize("script", list(LOSS_EDITS))
def test_a_fork_changes_its_objective_in_one_function(script, tmp_path):
    function, old, new, figure = LOSS_EDITS[script]
    fork = tmp_path / "fork" / f"my_{script}"
    fork.parent.mkdir()
    fork.write_text(edit((ROOT / script).read_text(), function, old, new))
    original = run(ROOT / script, FLAGS[script], tmp_path / "runs", "original")
    forked = run(fork, FLAGS[script], tmp_path / "runs", "fork")
    assert len(forked) == len(original) == 1
    assert forked[0][figure] == 2 * original[0][figure] != 0  # the fork's objective is the one that ran
    assert forked[0]["rewards/mean"] == original[0]["rewards/mean"]  # and the rollout is the same


def test_a_dancegrpo_fork_changes_loss_advantage_and_reward_each_in_one_place(tmp_path):
    source = (ROOT / "dancegrpo.py").read_text()
    source = edit(
        source,
        "policy_loss",
        "torch.clamp(ratio, 1 - clip_range, 1 + clip_range)",
        "torch.clamp(ratio, 1 - clip_range, 1 + 2 * clip_range)",
    )  # fmt: skip  (a higher upper clip)
    source = edit(source, "group_advantages", " / (R.std(1, keepdim=True) + 1e-8)", "")  # no std normalisation
    reward = """
from common.rewards import ScoreFn, register_reward  # noqa: E402

register_reward("brightness", lambda device, checkpoint=None: ScoreFn(lambda x, p: x.mean((1, 2, 3)), True), True)
"""
    source = source.replace("\n\n@dataclass\nclass Args(", reward + "\n\n@dataclass\nclass Args(", 1)
    fork = tmp_path / "fork" / "brightgrpo.py"
    fork.parent.mkdir()
    fork.write_text(source)
    flags = [*FLAGS["dancegrpo.py"], "--reward", "shapes:1,brightness:0.5"]
    (record,) = run(fork, flags, tmp_path / "runs", "bright")
    assert 0 < record["rewards/brightness"] < 1 and record["rewards/shapes"] != 0
    assert record["rewards/mean"] == pytest.approx(record["rewards/shapes"] + 0.5 * record["rewards/brightness"])


@pytest.mark.parametrize("script", ["dancegrpo.py", "branchgrpo.py"])
def test_a_new_term_with_its_flag_and_figure_is_two_edits(script, tmp_path):
    """Edit 1: a field of Args. Edit 2: policy_loss takes it as a keyword argument (main() passes every keyword
    argument from the flag of the same name), adds the term and returns its figure, which LOGGING writes."""
    source = (ROOT / script).read_text()
    source = source.replace(
        "class Args(RunArgs):",
        'class Args(RunArgs):\n    nll_coef: float = 0.0\n    """weight of a negative log-likelihood term"""\n',
        1,
    )  # edit 1: the flag
    start, end = body(source, "policy_loss")
    loss_fn = source[start:end]
    new_fn = loss_fn.replace("kl_beta):", "kl_beta, nll_coef):", 1).replace(
        "    return loss, {",
        '    loss, figures["nll"] = loss - nll_coef * log_prob, -log_prob.mean()\n    return loss, {',
    )  # edit 2: the objective
    assert new_fn.count("nll") == 3
    fork = tmp_path / "fork" / f"nll_{script}"
    fork.parent.mkdir()
    fork.write_text(source[:start] + new_fn + source[end:])
    original = run(ROOT / script, FLAGS[script], tmp_path / "runs", "original")
    (forked,) = run(fork, [*FLAGS[script], "--nll-coef", "0.5"], tmp_path / "runs", "fork")
    assert "losses/nll" not in original[0] and forked["losses/nll"] != 0  # the new figure, logged
    assert forked["rewards/mean"] == original[0]["rewards/mean"]  # the same rollout,
    assert forked["charts/grad_norm"] != original[0]["charts/grad_norm"]  # another objective: the flag reached it


def test_a_new_advantage_flag_is_two_edits(tmp_path):
    """Edit 1: a field of Args. Edit 2: the advantage function takes it as a keyword argument and uses it (main()
    passes each of its keyword arguments from the flag of the same name). Advantages scaled by 2 (below the clip of 5:
    a group of 4 has |A| <= 1.5) double the first update's gradient, whose ratio is 1."""
    source = (ROOT / "dancegrpo.py").read_text()
    source = source.replace(
        "class Args(RunArgs):", 'class Args(RunArgs):\n    adv_scale: float = 1.0\n    """advantages times this"""\n', 1
    )  # edit 1: the flag
    source = edit(source, "combined_advantages", "group_size, adv_clip_max)", "group_size, adv_clip_max, adv_scale)")
    source = edit(source, "combined_advantages", "return adv.clamp(", "return (adv_scale * adv).clamp(")  # edit 2
    fork = tmp_path / "fork" / "scaled_dancegrpo.py"
    fork.parent.mkdir()
    fork.write_text(source)
    original = run(ROOT / "dancegrpo.py", FLAGS["dancegrpo.py"], tmp_path / "runs", "original")
    (forked,) = run(fork, [*FLAGS["dancegrpo.py"], "--adv-scale", "2"], tmp_path / "runs", "fork")
    assert forked["rewards/mean"] == original[0]["rewards/mean"]  # the same rollout
    assert forked["charts/grad_norm"] == pytest.approx(2 * original[0]["charts/grad_norm"], rel=1e-5)


def test_a_new_sampler_step_is_three_edits(tmp_path):
    """Edit 1: the choice in Args.sde_type's Literal. Edit 2: the step function, with sde_step's arguments and outputs
    (x_next, log_prob, mean, std). Edit 3: the line that picks the step, used by the rollout and by training alike.
    The fork's rollout differs from DanceGRPO's at the same noise level, and its first ratio is exactly 1."""
    source = (ROOT / "dancegrpo.py").read_text()
    old = 'sde_type: Literal["dance", "flow", "cps"]'
    assert source.count(old) == 1
    source = source.replace(old, 'sde_type: Literal["dance", "flow", "cps", "half"]')  # edit 1
    step = """

def half_step(x, v, sigma, sigma_next, g, prev_sample=None, noise=None):
    return sde_step(x, v, sigma, sigma_next, g / 2, prev_sample, noise)  # DanceGRPO's step at half its noise
"""
    source = source.replace("\n\ndef group_advantages(", step + "\n\ndef group_advantages(", 1)  # edit 2
    old = 'step = cps_step if args.sde_type == "cps" else sde_step'
    new = 'step = cps_step if args.sde_type == "cps" else half_step if args.sde_type == "half" else sde_step'
    assert source.count(old) == 1
    source = source.replace(old, new)  # edit 3
    fork = tmp_path / "fork" / "half_dancegrpo.py"
    fork.parent.mkdir()
    fork.write_text(source)
    flags = [*FLAGS["dancegrpo.py"], "--noise-level", "0.5"]
    (original,) = run(ROOT / "dancegrpo.py", [*flags, "--sde-type", "dance"], tmp_path / "runs", "original")
    (forked,) = run(fork, [*flags, "--sde-type", "half"], tmp_path / "runs", "fork")
    assert forked["rewards/mean"] != original["rewards/mean"] and forked["losses/first_ratio_max_dev"] == 0


def test_a_fork_whose_loss_is_nan_stops_after_three_iterations_with_its_checkpoints_intact(tmp_path):
    """A bug that makes every loss NaN (here: the objective times NaN) skips every update; the third iteration in a
    row without a step stops the run with one `error:` line, exit 1, no final/, the checkpoints before it intact."""
    source = edit(
        (ROOT / "dancegrpo.py").read_text(),
        "policy_loss",
        "    loss = surrogate\n",
        "    loss = surrogate * float('nan')\n",
    )
    fork = tmp_path / "fork" / "nan_dancegrpo.py"
    fork.parent.mkdir()
    fork.write_text(source)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    flags = [
        *FLAGS["dancegrpo.py"],
        "--iterations",
        "5",
        "--eval-every",
        "0",
        "--sample-every",
        "0",
        "--save-every",
        "1",
    ]
    cmd = [sys.executable, str(fork), *flags, "--output-dir", str(tmp_path / "runs"), "--exp-name", "nan"]
    done = subprocess.run(cmd, cwd=fork.parent, capture_output=True, text=True, env=env)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert errors[0].startswith("error: every update of iterations 0-2 had a non-finite gradient norm")
    run = find_run(tmp_path / "runs" / "nan")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000001", "iter_000002"]
    assert not (run / "final").exists()
    assert [r["charts/skipped_updates"] for r in metrics(run)] == [1, 1, 1]


NEW_KIND = '''"""A FLUX.1 fine-tune shipped with a pipeline class of its own, whose adapter goes on the queries and values only."""

from diffusers import FluxPipeline

from common.models.flux import FluxModel


class MyFluxPipeline(FluxPipeline):
    pass


class MyFluxModel(FluxModel):
    kind = "myflux"
    pipeline = MyFluxPipeline  # loads the folder, saves final/
    lora_targets = ["to_q", "to_v"]
'''


def test_a_new_model_kind_is_its_module_and_one_registry_entry(tmp_path, monkeypatch):
    """Edit 1: the kind's module (its wrapper class: name, pipeline class, LoRA targets). Edit 2: its entry in
    common.models.REGISTRY. Nothing else: a folder whose model_index.json names the new pipeline class loads as the
    new kind, dancegrpo.py trains an iteration on it with the module's LoRA targets, and the pipeline class reads
    final/."""
    from common import models
    from tests.tiny import RES, build_flux

    (tmp_path / "myflux.py").write_text(NEW_KIND)  # edit 1
    monkeypatch.syspath_prepend(str(tmp_path))
    import myflux

    entry = models.Kind(myflux.MyFluxModel, ("MyFluxPipeline",))
    monkeypatch.setattr(models, "REGISTRY", [*models.REGISTRY, entry])  # edit 2
    folder = tmp_path / "model"
    build_flux(folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "MyFluxPipeline"}))
    (tmp_path / "prompts.txt").write_text("a red circle\na green square\n")
    assert models.check_model_id(str(folder)) == "myflux"
    flags = [*FLAGS["dancegrpo.py"], "--model-id", str(folder), "--resolution", str(RES), "--prompts",
             str(tmp_path / "prompts.txt"), "--eval-prompts", str(tmp_path / "prompts.txt"), "--reward", "jpeg",
             "--lora-rank", "4", "--iterations", "1", "--eval-every", "0", "--sample-every", "0", "--exp-name", "new"]  # fmt: skip
    run_in_process("dancegrpo.py", flags, tmp_path / "runs")
    run = find_run(tmp_path / "runs" / "new")
    assert len([r for r in metrics(run) if "rewards/jpeg" in r]) == 1
    layers = load_file(run / "final" / "pytorch_lora_weights.safetensors")
    assert {k.split(".lora_")[0].rsplit(".", 1)[1] for k in layers} == {"to_q", "to_v"}  # the module's targets
    pipe = myflux.MyFluxPipeline.from_pretrained(folder)
    pipe.load_lora_weights(str(run / "final"))
    assert pipe.transformer.peft_config
