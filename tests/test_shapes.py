"""ShapesBench: the world, the verifier, the shipped flow model and learned reward, the eval command."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import InputError, shapes
from common.prompts import load_prompts

ROOT = Path(__file__).resolve().parents[1]


def gt(n, seed=0):
    return shapes.sample_batch(n, torch.Generator().manual_seed(seed))


def test_prompt_split_is_fixed_disjoint_and_balanced():
    train, evals = shapes.split_prompts("train"), shapes.split_prompts("eval")
    assert len(train) == 120 and len(evals) == 48 and not set(train) & set(evals)
    assert sorted(train + evals) == sorted(shapes.all_prompts())
    assert [sum(shapes.parse_prompt(p)[0] == s for p in evals) for s in range(3)] == [16, 16, 16]
    assert evals[:2] == ["a red circle on a green background", "a red circle on a white background"]


def test_verifier_accepts_ground_truth():
    images, prompts = gt(1000)
    v = shapes.verify(images, prompts)
    for key in ("bg", "fg", "shape", "clean", "all"):
        assert v[key].float().mean() >= 0.99, key
    assert shapes.verifier_reward(images, prompts).min() == 1.0


def test_verifier_rejects_each_kind_of_error():
    images, prompts = gt(200, seed=1)
    parsed = [shapes.parse_prompt(p) for p in prompts]
    # wrong shape: the same colours with the next shape class; at least the shape verdict must fail
    wrong = [
        shapes.make_prompt(shapes.SHAPES[(s + 1) % 3], shapes.COLOUR_NAMES[f], shapes.COLOUR_NAMES[b])
        for s, f, b in parsed
    ]
    assert shapes.verify(images, wrong)["shape"].float().mean() <= 0.05
    # swapped colours: background and foreground verdicts fail
    swapped = [
        shapes.make_prompt(shapes.SHAPES[s], shapes.COLOUR_NAMES[b], shapes.COLOUR_NAMES[f]) for s, f, b in parsed
    ]
    v = shapes.verify(images, swapped)
    assert v["bg"].float().mean() == 0 and v["fg"].float().mean() == 0
    # a high-frequency texture over the whole image: colours and shape survive, cleanliness does not
    noisy = (images + 0.2 * torch.randn(images.shape, generator=torch.Generator().manual_seed(2))).clamp(0, 1)
    v = shapes.verify(noisy, prompts)
    assert v["bg"].float().mean() >= 0.99 and v["clean"].float().mean() <= 0.05


def test_well_formed_and_confusion_matrix():
    images, prompts = gt(300, seed=3)
    v = shapes.verify(images, prompts)
    assert v["well_formed"].all() and v["best_iou"].min() >= shapes.WELL_FORMED_IOU
    # a ragged drawing (every other pixel of a 20x20 square in the foreground colour): no template fits it well
    fg, bg = (torch.tensor([shapes.parse_prompt(p)[i] for p in prompts]) for i in (1, 2))
    yy, xx = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
    ragged = (((yy + xx) % 2 == 0) & (yy >= 6) & (yy < 26) & (xx >= 6) & (xx < 26)).view(1, 1, 32, 32)
    ragged = torch.where(ragged, shapes.PALETTE[fg].view(-1, 3, 1, 1), shapes.PALETTE[bg].view(-1, 3, 1, 1))
    assert not shapes.verify(ragged, prompts)["well_formed"].any()
    m = shapes.evaluate(images, prompts)
    assert m["well_formed_acc"] == 1.0
    conf = shapes.confusion_matrix(m)
    requested = [sum(shapes.parse_prompt(p)[0] == s for p in prompts) for s in range(3)]
    assert [conf[s][s] for s in range(3)] == requested and sum(map(sum, conf)) == len(prompts)
    assert shapes.confusion_matrix({f"eval/{k}": v for k, v in m.items()}) == conf  # as the RL scripts log it


def test_diversity_is_zero_for_copies_and_positive_otherwise():
    images, _ = gt(4)
    prompts = ["a red circle on a blue background"] * 4
    assert shapes.diversity(images[:1].expand(4, -1, -1, -1), prompts) == 0
    assert shapes.diversity(images, prompts) > 0.1


def test_prompt_file_errors_name_the_flag(tmp_path):
    with pytest.raises(InputError, match="--prompts"):
        load_prompts(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("\n# only a comment\n\n")
    with pytest.raises(ValueError, match="--prompts.*no prompts"):
        load_prompts(str(tmp_path / "empty.txt"))
    (tmp_path / "p.txt").write_text("a cat\n\n# skip\n a dog \n")
    assert load_prompts(str(tmp_path / "p.txt")) == ["a cat", "a dog"]
    assert load_prompts("shapes-eval") == shapes.split_prompts("eval")
    with pytest.raises(ValueError, match="not a ShapesBench prompt"):
        shapes.parse_prompt("a cat on a mat")


def test_shipped_weights_are_small_safetensors():
    files = [f for f in shapes.ASSETS.rglob("*") if f.is_file()]
    weights = [f for f in files if f.suffix in (".bin", ".pt", ".pth", ".safetensors")]
    assert weights and all(f.suffix == ".safetensors" for f in weights)
    assert sum(f.stat().st_size for f in weights) <= 40 * 2**20  # v1 model and reward + the 5.1M-parameter v2 candidate


def test_learned_reward_ranks_true_prompt_above_mismatched():
    reward = shapes.load_reward_model()
    images, prompts = gt(512, seed=3)
    g = torch.Generator().manual_seed(4)
    all_p = shapes.all_prompts()
    others = [
        all_p[(all_p.index(p) + int(torch.randint(1, len(all_p), (1,), generator=g))) % len(all_p)] for p in prompts
    ]
    assert (reward(images, prompts) > reward(images, others)).float().mean() >= 0.95
    # differentiable in the images
    x = images[:8].clone().requires_grad_(True)
    reward(x, prompts[:8]).sum().backward()
    assert x.grad.abs().sum() > 0 and torch.isfinite(x.grad).all()


def test_reward_model_missing_names_the_flag(tmp_path):
    with pytest.raises(InputError, match="--reward-ckpt shapes="):
        shapes.load_reward_model(tmp_path)


def test_eval_command_prints_json_for_the_shipped_model():
    """The README's eval command on a reduced setting; the full-setting figures are in the README."""
    out = subprocess.run(
        [sys.executable, "-m", "common.shapes", "eval", "--samples-per-prompt", "2", "--steps", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result = json.loads(out)
    assert result["n"] == 96
    for key in ("bg_acc", "fg_acc", "colour_acc", "shape_acc", "clean_acc", "all_acc", "reward_mean", "diversity"):
        assert 0 <= result[key] <= 1 or key == "reward_mean", key


def test_eval_command_loads_a_runs_trained_weights(tmp_path):
    """--trained FINAL evaluates a run's final/ weights: here the shipped model with its output projection zeroed
    (velocity 0, so every "sample" is its initial noise), which must wreck the verifier's figures."""
    import torch
    from diffusers import SD3Transformer2DModel

    broken = SD3Transformer2DModel.from_pretrained(ROOT / "common/assets/shapes-flow/transformer")
    torch.nn.init.zeros_(broken.proj_out.weight)
    torch.nn.init.zeros_(broken.proj_out.bias)
    broken.save_pretrained(tmp_path / "final" / "transformer")
    cmd = [sys.executable, "-m", "common.shapes", "eval", "--samples-per-prompt", "1", "--steps", "2", "--threads", "1"]
    base = json.loads(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    run = json.loads(
        subprocess.run(
            cmd + ["--trained", str(tmp_path / "final")], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    )
    assert run["model_id"] == f"shapesbench + {tmp_path / 'final'}"
    assert base["bg_acc"] > 0.9 and run["bg_acc"] < 0.2, (base["bg_acc"], run["bg_acc"])
    bad = subprocess.run(cmd + ["--trained", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "--trained" in bad.stderr


def test_shipped_model_leaves_room_for_rl():
    """Issue #2's bar for the base model, at the README's eval setting (48 prompts x 4 samples, 20 steps)."""
    from common.models import load_model

    model = load_model("shapesbench")
    prompts = [p for p in shapes.split_prompts("eval") for _ in range(4)]
    result = shapes.evaluate(shapes.sample_ode(model, prompts, seed=0, steps=20), prompts)
    assert result["colour_acc"] >= 0.9
    assert 0.3 <= result["shape_acc"] <= 0.75
