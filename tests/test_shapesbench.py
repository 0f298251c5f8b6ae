"""ShapesBench: the world, the verifier, the shipped flow model and learned reward, the eval command."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import InputError, shapesbench
from common.prompts import load_prompts
from common.shapesbench.__main__ import sample

ROOT = Path(__file__).resolve().parents[1]


def gt(n, seed=0):
    return shapesbench.sample_batch(n, torch.Generator().manual_seed(seed))


def test_prompt_split_is_fixed_disjoint_and_balanced():
    train, evals = shapesbench.split_prompts("train"), shapesbench.split_prompts("eval")
    assert len(train) == 120 and len(evals) == 48 and not set(train) & set(evals)
    assert sorted(train + evals) == sorted(shapesbench.all_prompts())
    assert [sum(shapesbench.parse_prompt(p)[0] == s for p in evals) for s in range(3)] == [16, 16, 16]
    assert evals[:2] == ["a red circle on a green background", "a red circle on a white background"]


def test_verifier_accepts_ground_truth():
    images, prompts = gt(1000)
    v = shapesbench.verify(images, prompts)
    for key in ("bg", "fg", "shape", "clean", "all"):
        assert v[key].float().mean() >= 0.99, key
    assert shapesbench.verifier_reward(images, prompts).min() == 1.0


def test_verifier_rejects_each_kind_of_error():
    images, prompts = gt(200, seed=1)
    parsed = [shapesbench.parse_prompt(p) for p in prompts]
    # wrong shape: the same colours with the next shape class; at least the shape verdict must fail
    wrong = [
        shapesbench.make_prompt(
            shapesbench.SHAPES[(s + 1) % 3], shapesbench.COLOUR_NAMES[f], shapesbench.COLOUR_NAMES[b]
        )
        for s, f, b in parsed
    ]
    assert shapesbench.verify(images, wrong)["shape"].float().mean() <= 0.05
    # swapped colours: background and foreground verdicts fail
    swapped = [
        shapesbench.make_prompt(shapesbench.SHAPES[s], shapesbench.COLOUR_NAMES[b], shapesbench.COLOUR_NAMES[f])
        for s, f, b in parsed
    ]
    v = shapesbench.verify(images, swapped)
    assert v["bg"].float().mean() == 0 and v["fg"].float().mean() == 0
    # a high-frequency texture over the whole image: colours and shape survive, cleanliness does not
    noisy = (images + 0.2 * torch.randn(images.shape, generator=torch.Generator().manual_seed(2))).clamp(0, 1)
    v = shapesbench.verify(noisy, prompts)
    assert v["bg"].float().mean() >= 0.99 and v["clean"].float().mean() <= 0.05


def test_verifier_fails_periodic_textures_and_blur():
    """A periodic texture (period 2-8 px, amplitude >= 0.03) over a clean render fails the clean check; the renders
    themselves all pass. Strongly blurred renders keep their shape, but their soft edges are neither colour: most fail
    clean (a light blur, sigma < 1 px, passes about half the time; the learned reward ranks those, not the verifier)."""
    images, prompts = gt(1024, seed=5)
    g = torch.Generator().manual_seed(6)
    assert shapesbench.verify(images, prompts)["clean"].all()
    textured = shapesbench.verify(shapesbench.periodic_texture(images, g, amp=(0.03, 0.03)), prompts)
    assert textured["clean"].float().mean() <= 0.05 and textured["bg"].all() and textured["fg"].all()
    for period in range(2, 9):  # every period, at a visible amplitude
        v = shapesbench.verify(
            shapesbench.periodic_texture(images, g, amp=(0.05, 0.1), period=(period, period)), prompts
        )
        assert v["clean"].float().mean() <= 0.05, period
    blurred = shapesbench.verify(shapesbench.blur(images, g, sigma=(1.2, 1.5)), prompts)
    assert blurred["bg"].all() and blurred["shape"].all() and blurred["clean"].float().mean() <= 0.2


def test_verifier_fails_the_texture_a_verifier_reward_run_grew():
    """tests/data/vgrpo_verifier_iter200.png: the 48 held-out prompts (first sample each, row-major 8 x 6) after 200
    V-GRPO iterations on the verifier reward with an earlier base model; a faint periodic texture covers every
    background, which the clean check let through then (73% clean). It must fail now."""
    import numpy as np
    from PIL import Image

    pixels = torch.tensor(np.asarray(Image.open(ROOT / "tests/data/vgrpo_verifier_iter200.png")))  # (192, 256, 3)
    images = pixels.view(6, 32, 8, 32, 3).permute(0, 2, 4, 1, 3).reshape(48, 3, 32, 32).float() / 255
    v = shapesbench.verify(images, shapesbench.split_prompts("eval"))
    assert v["bg"].float().mean() >= 0.95 and v["clean"].sum() == 0


def test_learned_reward_ranks_clean_renders_above_corrupted_ones():
    checks = shapesbench.ranking_checks(shapesbench.load_reward_model(), torch.Generator().manual_seed(7), 512)
    assert checks["texture"] >= 0.95 and checks["blur"] >= 0.90 and checks["blob"] >= 0.90, checks


def test_well_formed_and_confusion_matrix():
    images, prompts = gt(300, seed=3)
    v = shapesbench.verify(images, prompts)
    assert v["well_formed"].all() and v["best_iou"].min() >= shapesbench.WELL_FORMED_IOU
    # a ragged drawing (every other pixel of a 20x20 square in the foreground colour): no template fits it well
    fg, bg = (torch.tensor([shapesbench.parse_prompt(p)[i] for p in prompts]) for i in (1, 2))
    yy, xx = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
    ragged = (((yy + xx) % 2 == 0) & (yy >= 6) & (yy < 26) & (xx >= 6) & (xx < 26)).view(1, 1, 32, 32)
    ragged = torch.where(ragged, shapesbench.PALETTE[fg].view(-1, 3, 1, 1), shapesbench.PALETTE[bg].view(-1, 3, 1, 1))
    assert not shapesbench.verify(ragged, prompts)["well_formed"].any()
    m = shapesbench.evaluate(images, prompts)
    assert m["well_formed_acc"] == 1.0
    conf = shapesbench.confusion_matrix(m)
    requested = [sum(shapesbench.parse_prompt(p)[0] == s for p in prompts) for s in range(3)]
    assert [conf[s][s] for s in range(3)] == requested and sum(map(sum, conf)) == len(prompts)
    assert shapesbench.confusion_matrix({f"eval/{k}": v for k, v in m.items()}) == conf  # as the RL scripts log it


def test_diversity_kept_is_one_for_the_renderer_and_zero_for_copies():
    """diversity_kept = diversity / the renderer's for the same prompts: renders drawn as the world draws them keep
    all of it (up to sampling noise), one image per prompt none."""
    from common.shapesbench import world
    from common.shapesbench.verifier import renderer_diversity

    prompts = [p for p in load_prompts("shapes-eval")[:12] for _ in range(64)]
    g = torch.Generator().manual_seed(0)
    shape, fg, bg = torch.tensor([world.parse_prompt(p) for p in prompts]).unbind(1)
    radius = torch.tensor(world.RADII)[torch.randint(len(world.RADII), (len(prompts),), generator=g)]
    images = world.render(shape, fg, bg, radius, torch.full_like(radius, 16), torch.full_like(radius, 16))
    assert shapesbench.evaluate(images, prompts)["diversity_kept"] == pytest.approx(1.0, abs=0.03)
    copies = images.view(12, 64, 3, 32, 32)[:, :1].expand(-1, 4, -1, -1, -1).reshape(-1, 3, 32, 32)
    assert shapesbench.evaluate(copies, prompts[::16])["diversity_kept"] == 0  # 4 copies of one image per prompt
    # the held-out split, 4 samples per prompt: two sizes per shape, so a perfect policy scores 0.079
    held_out = tuple(p for p in load_prompts("shapes-eval") for _ in range(4))
    assert renderer_diversity(held_out) == pytest.approx(0.0791, abs=1e-4)


def test_diversity_is_zero_for_copies_and_positive_otherwise():
    images, _ = gt(4)
    prompts = ["a red circle on a blue background"] * 4
    assert shapesbench.diversity(images[:1].expand(4, -1, -1, -1), prompts) == 0
    assert shapesbench.diversity(images, prompts) > 0.1


def test_prompt_file_errors_name_the_flag(tmp_path):
    with pytest.raises(InputError, match="--prompts"):
        load_prompts(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("\n# only a comment\n\n")
    with pytest.raises(ValueError, match="--prompts.*no prompts"):
        load_prompts(str(tmp_path / "empty.txt"))
    (tmp_path / "p.txt").write_text("a cat\n\n# skip\n a dog \n")
    assert load_prompts(str(tmp_path / "p.txt")) == ["a cat", "a dog"]
    assert load_prompts("shapes-eval") == shapesbench.split_prompts("eval")
    with pytest.raises(ValueError, match="not a ShapesBench prompt"):
        shapesbench.parse_prompt("a cat on a mat")


def test_shipped_weights_are_small_safetensors():
    files = [f for f in (ROOT / "common/shapesbench/assets").rglob("*") if f.is_file()]
    weights = [f for f in files if f.suffix in (".bin", ".pt", ".pth", ".safetensors")]
    assert weights and all(f.suffix == ".safetensors" for f in weights)
    # the base pipeline (5.1M-parameter transformer 20 MB, text encoders 0.6 MB, 0.95M-parameter VAE 3.7 MB), the
    # reward (0.7 MB) and ShapesBench-Edit's pipeline (2.3M-parameter transformer 8.8 MB, text encoders 0.5 MB, the VAE
    # again 3.7 MB)
    assert sum(f.stat().st_size for f in weights) <= 39 * 2**20


def test_learned_reward_ranks_true_prompt_above_mismatched():
    reward = shapesbench.load_reward_model()
    images, prompts = gt(512, seed=3)
    g = torch.Generator().manual_seed(4)
    all_p = shapesbench.all_prompts()
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
        shapesbench.load_reward_model(tmp_path)


def test_eval_command_prints_json_for_the_shipped_model():
    """The eval command on a reduced setting; the full-setting figures are in docs/shapesbench.md."""
    out = subprocess.run(
        [sys.executable, "-m", "common.shapesbench", "eval", "--samples-per-prompt", "2", "--steps", "4"],
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

    broken = SD3Transformer2DModel.from_pretrained(ROOT / "common/shapesbench/assets/latent/transformer")
    torch.nn.init.zeros_(broken.proj_out.weight)
    torch.nn.init.zeros_(broken.proj_out.bias)
    broken.save_pretrained(tmp_path / "final" / "transformer")
    cmd = [
        sys.executable,
        "-m",
        "common.shapesbench",
        "eval",
        "--samples-per-prompt",
        "1",
        "--steps",
        "2",
        "--threads",
        "1",
    ]
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
    """The base model's band at the eval command's default setting (48 held-out prompts x 4 samples, 20 steps): crisp shapes
    in the right colours on clean backgrounds, following the shape word imperfectly (every class sometimes); and on
    its well-formed samples the learned reward's best shape prompt agrees with the verifier's shape class."""
    from common.models import load_model

    model = load_model("shapesbench")
    prompts = [p for p in shapesbench.split_prompts("eval") for _ in range(4)]
    images = sample(model, prompts, seed=0, steps=20, guidance_scale=1.0)
    result = shapesbench.evaluate(images, prompts)
    assert result["colour_acc"] >= 0.95 and result["clean_acc"] >= 0.95
    assert result["well_formed_acc"] >= 0.90
    assert 0.40 <= result["shape_acc"] <= 0.65
    assert min(result[f"shape_acc_{s}"] for s in shapesbench.SHAPES) >= 0.30
    v = shapesbench.verify(images, prompts)
    wf = v["well_formed"]
    well_formed = [p for p, k in zip(prompts, wf.tolist()) if k]
    reward = shapesbench.load_reward_model()
    # 0.995 on these 192 well-formed samples (the evaluation's noise draw)
    assert shapesbench.shape_agreement(reward, images[wf], well_formed, v["shape_pred"][wf]) >= 0.90


def test_trainers_write_loadable_models(tmp_path):
    """The reward's training command, on a few steps: the reward loads with load_reward_model, and it writes its
    train_log.json with the command (the base model's and the VAE's: test_shapesbench_latent.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reward = tmp_path / "reward"
    cmd = [sys.executable, "-m", "common.shapesbench.train_reward", "--steps", "2", "--batch-size", "8"]
    cmd += ["--negatives", "4", "--model-samples", "8", "--out", str(reward)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    log = json.loads((reward / "train_log.json").read_text())
    assert log["command"].startswith("python -m common.shapesbench.train_reward") and 0 <= log["top1_acc"] <= 1
    images, prompts = gt(4)
    assert shapesbench.load_reward_model(reward)(images, prompts).shape == (4,)
