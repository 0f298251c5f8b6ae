"""ShapesBench-Edit: instructions and targets, reading scenes from pixels, the edit metrics and rewards, the data files,
the training forward against FluxKontextPipeline's, and the shipped pipeline folder (common/shapesbench/edit.py,
train_edit.py).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_shapesbench_edit.py -q -p no:randomly -n 0
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.edits import EditPrompt, edit_prompts
from common.prompts import load_prompts
from common.shapesbench import edit, world
from common.shapesbench.edit import (
    edit_metrics,
    edit_target,
    edit_verifier_reward,
    parse_instruction,
    read_radius,
    read_scene,
    render_caption,
)
from common.shapesbench.world import COLOUR_NAMES, RADII, SHAPES

SRC = "a red circle on a blue background"
SHIPPED = Path(edit.__file__).parent / "assets" / "edit"


def img(caption, radius=8):
    return render_caption(caption, radius)


# ---------------------------------------------------------------------------------------------------- instructions
def test_parse_and_target_of_every_template():
    assert parse_instruction("make the circle green") == ("fg", COLOUR_NAMES.index("green"))
    assert parse_instruction("make the background white") == ("bg", COLOUR_NAMES.index("white"))
    assert parse_instruction("turn the circle into a triangle") == ("shape", SHAPES.index("triangle"))
    assert parse_instruction("  Make the  BACKGROUND white ") == ("bg", COLOUR_NAMES.index("white"))
    assert parse_instruction(EditPrompt("make the square red", ["x.png"])) == ("fg", 0)
    assert edit_target(SRC, "make the circle green") == "a green circle on a blue background"
    assert edit_target(SRC, "make the background white") == "a red circle on a white background"
    assert edit_target(SRC, "turn the circle into a triangle") == "a red triangle on a blue background"


@pytest.mark.parametrize(
    "text",
    ["paint it black", "make the circle", "make the hexagon red", "make the circle teal", "make the background",
     "turn the circle into a circle", "turn the circle into a hexagon", "a red circle on a blue background", ""],
)  # fmt: skip
def test_parse_refuses_what_is_not_an_edit(text):
    with pytest.raises(ValueError, match="edit"):
        parse_instruction(text)


@pytest.mark.parametrize(
    "text",
    ["make the circle red", "make the circle blue", "make the background blue", "make the background red",
     "make the square green", "turn the square into a circle"],
)  # fmt: skip
def test_target_refuses_an_instruction_that_does_not_fit_the_source(text):
    with pytest.raises(ValueError, match="source|fit"):
        edit_target(SRC, text)


def test_every_source_has_14_instructions_that_change_exactly_the_named_attribute():
    for caption in world.all_prompts():
        scene = world.parse_prompt(caption)
        texts = edit.instructions_for(caption)
        assert len(texts) == len(set(texts)) == 14
        for text in texts:
            attr, value = parse_instruction(text)
            target = world.parse_prompt(edit_target(caption, text))
            differs = [a for a, before, after in zip(("shape", "fg", "bg"), scene, target) if before != after]
            assert differs == [attr] and target[("shape", "fg", "bg").index(attr)] == value
            assert target[1] != target[2]  # the shape never takes the background's colour


# ---------------------------------------------------------------------------------------------------- reading pixels
def test_read_scene_and_radius_are_exact_on_every_clean_render():
    keys = [(c, r) for c in world.all_prompts() for r in RADII]
    images = torch.stack([img(c, r) for c, r in keys])  # (336, 3, 32, 32)
    truth = torch.tensor([world.parse_prompt(c) for c, _ in keys])
    shape, fg, bg = read_scene(images)
    assert torch.equal(shape, truth[:, 0]) and torch.equal(fg, truth[:, 1]) and torch.equal(bg, truth[:, 2])
    radius, nearest = read_radius(images)
    assert torch.equal(nearest, torch.tensor([r for _, r in keys]))
    assert (radius / nearest - 1).abs().max() < 0.02  # the equivalent radius: within 1.5% on renders


# ---------------------------------------------------------------------------------------------------- metrics, rewards
def test_edit_metrics_on_hand_made_cases():
    """Source: a red circle on blue, radius 8; instruction "make the circle green". Five results, worked out by hand:

    result                      edit  changed  kept  size_kept  verifier reward vs "a green circle on a blue..."
    green circle r8 (perfect)    1      1       1       1        1    (bg, fg, shape, clean)
    the source unchanged         0      0       1       1        0.25 (bg; no green pixels: no shape; red stray)
    yellow circle r8 (wrong)     0      0       1       1        0.25 (likewise)
    green square r8 (unnamed)    0      1       0       1        0.75 (all but the shape)
    green circle r10 (size)      1      1       1       0        1    (the verifier does not judge size)
    """
    edited = torch.stack(
        [img("a green circle on a blue background"), img(SRC), img("a yellow circle on a blue background"),
         img("a green square on a blue background"), img("a green circle on a blue background", 10)]
    )  # fmt: skip
    sources, texts = torch.stack([img(SRC)] * 5), ["make the circle green"] * 5
    m = edit_metrics(edited, sources, texts)
    assert m["edit"].tolist() == [True, False, False, False, True]
    assert m["changed"].tolist() == [True, False, False, True, True]
    assert m["kept"].tolist() == [True, True, True, False, True]
    assert m["size_kept"].tolist() == [True, True, True, True, False]
    assert m["clean"].all() and m["well_formed"].all()  # every result is a clean render of something
    assert (m["edit_acc"], m["changed_acc"], m["kept_acc"], m["size_kept_acc"]) == pytest.approx((0.4, 0.6, 0.8, 0.8))
    assert m["edit_acc_fg"] == pytest.approx(0.4) and m["n"] == 5
    assert edit_verifier_reward(edited, sources, texts).tolist() == [1.0, 0.25, 0.25, 0.75, 1.0]


def test_edit_metrics_of_the_other_templates_and_size_across_shapes():
    """A change of shape keeps the size when the new shape is drawn at the source's radius (its area differs: a
    triangle of radius 8 has 146 px, the circle 208); the unchanged source scores the verifier's 0.75 on a change of
    shape and 0.5 on a recolour of the background."""
    texts = ["turn the circle into a triangle"] * 3 + ["make the background white"] * 2
    edited = torch.stack(
        [img("a red triangle on a blue background"), img("a red triangle on a blue background", 10), img(SRC),
         img("a red circle on a white background"), img(SRC)]
    )  # fmt: skip
    m = edit_metrics(edited, torch.stack([img(SRC)] * 5), texts)
    assert m["edit"].tolist() == [True, True, False, True, False]
    assert m["size_kept"].tolist() == [True, False, True, True, True]
    assert m["kept"].all() and m["changed"].tolist() == [True, True, False, True, False]
    assert m["edit_acc_shape"] == pytest.approx(2 / 3) and m["edit_acc_bg"] == pytest.approx(0.5)
    assert edit_verifier_reward(edited, torch.stack([img(SRC)] * 5), texts).tolist() == [1.0, 1.0, 0.75, 1.0, 0.5]


def test_edit_implies_changed_and_kept_and_reward_one_exactly_on_edits():
    """One instruction of each kind on a source, judged on every radius-8 render of the world (168 results): "edit"
    exactly on the target's render, and then changed and kept; the verifier reward 1.0 exactly there."""
    results = world.all_prompts()
    everything = torch.stack([img(c) for c in results])  # (168, 3, 32, 32)
    caption = "a white triangle on a black background"
    texts = ["make the triangle orange", "make the background green", "turn the triangle into a square"]
    edited, sources = everything.repeat(3, 1, 1, 1), torch.stack([img(caption)] * 3 * len(results))
    instructions = [t for t in texts for _ in results]
    m = edit_metrics(edited, sources, instructions)
    targets = [edit_target(caption, t) for t in instructions]
    assert m["edit"].tolist() == [c == t for c, t in zip(results * 3, targets)] and m["edit"].sum() == 3
    assert not (m["edit"] & ~(m["changed"] & m["kept"])).any()
    assert torch.equal(edit_verifier_reward(edited, sources, instructions) == 1, m["edit"])


def test_learned_reward_scores_against_the_target_and_is_differentiable():
    from common.shapesbench.reward import load_reward_model

    model = load_reward_model()
    texts = ["make the circle green", "make the background white", "turn the circle into a square"]
    right = torch.stack(
        [img("a green circle on a blue background"), img("a red circle on a white background"),
         img("a red square on a blue background")]
    ).requires_grad_(True)  # fmt: skip
    sources = torch.stack([img(SRC)] * 3)
    r = edit.edit_learned_reward(model, right, sources, texts)
    assert r.shape == (3,) and (r > edit.edit_learned_reward(model, sources, sources, texts)).all()
    r.sum().backward()
    assert right.grad is not None and right.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------- the data
def test_data_files_rows_images_and_bytes(tmp_path):
    rows = edit.write_edit_data(tmp_path / "a")
    assert len(rows["train"]) == 120 * 14 * 2 == 3360 and len(rows["eval"]) == 48 * 14 * 2 == 1344
    evals = set(world.split_prompts("eval"))
    pngs = sorted(p.name for p in (tmp_path / "a" / "sources").iterdir())
    assert len(pngs) == 168 * 2
    for split in ("train", "eval"):
        lines = (tmp_path / "a" / f"{split}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == rows[split]
        for row in rows[split][::7]:
            shape, fg, bg, r = Path(row["image"]).stem.split("_")
            caption = world.make_prompt(shape, fg, bg)
            assert (caption in evals) == (split == "eval")
            with Image.open(tmp_path / "a" / row["image"]) as im:
                pixels = torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32) / 255).permute(2, 0, 1)
            assert torch.equal(pixels, render_caption(caption, int(r[1:])))  # lossless: the exact render
            edit_target(caption, row["instruction"])  # fits its source
    edit.write_edit_data(tmp_path / "b")
    for f in ["train.jsonl", "eval.jsonl", *(f"sources/{p}" for p in pngs)]:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    subset = edit.eval_subset(rows["eval"])
    kinds = [parse_instruction(r["instruction"])[0] for r in subset]
    assert len(subset) == 192 and len({json.dumps(r) for r in subset}) == 192
    assert kinds.count("shape") >= 20 and kinds.count("fg") >= 70 and kinds.count("bg") >= 70


@pytest.mark.skipif(not (SHIPPED / "train.jsonl").is_file(), reason="the edit data are not shipped here")
def test_shipped_data_are_what_write_edit_data_writes_and_common_edits_reads_them(tmp_path):
    edit.write_edit_data(tmp_path)
    for f in ("train.jsonl", "eval.jsonl", "sources/triangle_black_white_r10.png"):
        assert (SHIPPED / f).read_bytes() == (tmp_path / f).read_bytes(), f
    for split, n in (("train", 3360), ("eval", 1344)):
        prompts = load_prompts(str(SHIPPED / f"{split}.jsonl"))
        assert len(prompts) == n and all(isinstance(p, EditPrompt) and len(p.images) == 1 for p in prompts)
        assert prompts == edit_prompts((SHIPPED / f"{split}.jsonl").read_text(), SHIPPED, split)
    p = prompts[0]
    sources = edit.source_images([p])
    assert edit.target_captions(sources, [p]) == [edit_target(world.split_prompts("eval")[0], p.text)]


# ---------------------------------------------------------------------------------------------------- the model
def test_training_forward_is_the_pipelines():
    """train_edit's conditioning and forward (encode_instructions, World's source latents, kontext_velocity) give the
    transformer output of FluxKontextPipeline's first step on the same source, instruction and noise."""
    from diffusers import AutoencoderKL

    from common.shapesbench import builders, train_edit

    vae = AutoencoderKL.from_pretrained(builders.VAE_PATH).eval()
    parts = train_edit.build_edit_components(0, 4, heads=2, double=1, single=1)
    pipe = train_edit.make_edit_pipeline(vae, parts)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.tokenizer_2.model_max_length == train_edit.TEXT_TOKENS == 12
    ids = pipe.tokenizer_2(["turn the triangle into a circle"]).input_ids[0]
    assert len(ids) == 7 and pipe.tokenizer_2.unk_token_id not in ids  # one token a word, then </s>
    assert pipe.tokenizer.unk_token_id not in pipe.tokenizer(["turn the triangle into a circle"]).input_ids[0]
    seen = {}
    hook = parts["transformer"].register_forward_hook(
        lambda m, a, kw, out: seen.update(kw, out=out[0]), with_kwargs=True
    )

    pixels = (img(SRC) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    text, noise = "make the circle green", torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pipe(
            prompt=[text], image=[Image.fromarray(pixels)], height=32, width=32, max_area=1024, _auto_resize=False,
            max_sequence_length=12, guidance_scale=1.0, num_inference_steps=1, latents=noise, output_type="latent",
        )  # fmt: skip
        hook.remove()
        z = vae.encode(img(SRC)[None] * 2 - 1).latent_dist.mode()
        source = pipe._pack_latents((z - vae.config.shift_factor) * vae.config.scaling_factor, 1, 4, 8, 8)
        embeds, pooled = train_edit.encode_instructions(pipe, [text])
        ids = train_edit.kontext_ids(pipe, 8)
        v = train_edit.kontext_velocity(parts["transformer"], noise, torch.ones(1), source, embeds, pooled, ids)
    assert torch.equal(seen["img_ids"], ids) and torch.allclose(seen["hidden_states"][:, 16:], source, atol=1e-4)
    assert torch.equal(seen["encoder_hidden_states"], embeds) and seen["guidance"] is None
    assert torch.allclose(v, seen["out"][:, :16], atol=1e-5)
    sched = pipe.scheduler
    sched.set_timesteps(sigmas=[1.0, 0.5], mu=0.3)  # static shift: the pipeline's mu is ignored
    assert sched.sigmas[1].item() == pytest.approx(3 * 0.5 / (1 + 2 * 0.5))


@pytest.mark.skipif(not (SHIPPED / "model" / "model_index.json").is_file(), reason="no shipped edit model")
def test_shipped_pipeline_loads_and_edits():
    from diffusers import FluxKontextPipeline

    from common.shapesbench import builders

    index = json.loads((SHIPPED / "model" / "model_index.json").read_text())
    assert index["_class_name"] == "FluxKontextPipeline" and builders.SHAPESBENCH_KEY in index
    pipe = FluxKontextPipeline.from_pretrained(SHIPPED / "model")
    pipe.set_progress_bar_config(disable=True)
    assert pipe.tokenizer_2.model_max_length == 12 and not pipe.transformer.config.guidance_embeds
    assert pipe.scheduler.config.use_dynamic_shifting is False and pipe.scheduler.config.shift == 3.0
    log = json.loads((SHIPPED / "model" / "train_log.json").read_text())
    assert log["eval"]["n"] == 192 and "edit_acc" in log["eval"]
    p = load_prompts(str(SHIPPED / "eval.jsonl"))[0]
    out = pipe(
        prompt=p.text, image=p.load_images()[0], height=32, width=32, max_area=1024, _auto_resize=False,
        max_sequence_length=12, num_inference_steps=4, guidance_scale=1.0, output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images  # fmt: skip
    assert out.shape == (1, 3, 32, 32)


def test_train_edit_smoke_and_bitwise_resume(tmp_path, monkeypatch):
    """Four steps of a small model write a FluxKontextPipeline folder with train_log.json and the data; a run stopped
    right after its step-2 state is saved, then run again, ends with the same weights as the run never stopped."""
    import os
    import sys

    from safetensors.torch import load_file

    from common.shapesbench import train_edit

    def train(out, stop=False):
        argv = ["train_edit", "--steps", "4", "--save-every", "2", "--log-every", "1", "--eval-steps", "1"]
        argv += ["--batch-size", "8", "--heads", "1", "--double", "1", "--single", "1", "--threads", "1"]
        monkeypatch.setattr(sys, "argv", [*argv, "--data", str(tmp_path / "data"), "--out", str(out)])
        if stop:  # an interrupt just after the state file is in place

            def replace_then_stop(a, b):
                os.rename(a, b)
                raise KeyboardInterrupt

            monkeypatch.setattr(train_edit.os, "replace", replace_then_stop)
        try:
            train_edit.main()
        except KeyboardInterrupt:
            assert stop
        monkeypatch.setattr(train_edit.os, "replace", os.replace)

    train(tmp_path / "a")
    train(tmp_path / "b", stop=True)
    assert (tmp_path / "b" / "train_state.pt").is_file() and not (tmp_path / "b" / "model_index.json").exists()
    train(tmp_path / "b")
    weights = Path("transformer") / "diffusion_pytorch_model.safetensors"
    a, b = load_file(tmp_path / "a" / weights), load_file(tmp_path / "b" / weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "b" / "train_state.pt").exists()
    log = json.loads((tmp_path / "a" / "train_log.json").read_text())
    assert log["steps"] == 4 and log["eval"]["n"] == 192 and "all" in log["target"] and len(log["history"]) == 4
    index = json.loads((tmp_path / "a" / "model_index.json").read_text())
    assert index["_class_name"] == "FluxKontextPipeline" and index["_shapesbench"] == train_edit.EDIT_KEY_TEXT
    assert (tmp_path / "data" / "eval.jsonl").is_file()
