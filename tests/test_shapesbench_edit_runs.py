"""ShapesBench-Edit in the scripts: `--model-id shapesbench-edit` loads the shipped edit model as the FLUX.1-Kontext kind
it is (its own T5 length), samples what FluxKontextPipeline samples, turns the ShapesBench splits into its edits and
ShapesBench's rewards into scores of each edit against the caption it should give, refuses an instruction that does
not fit its source at start-up, and trains with the edit verifier's figures in the evaluation and badges in the grid."""

import json

import pytest
import torch

from common import InputError
from common.edits import EditPrompt
from common.models import SHAPESBENCH_EDIT_DIR, check_model_id, load_model
from common.prompts import load_prompts
from common.rewards import build_reward, check_shapesbench_prompts, parse_rewards
from common.sampling import sample_ode
from common.shapesbench import load_reward_model
from common.shapesbench.edit import edit_learned_reward, edit_verifier_reward, parse_instruction, source_images
from tests.helpers import find_run, metrics, run_in_process

pytestmark = pytest.mark.skipif(
    not (SHAPESBENCH_EDIT_DIR / "model_index.json").is_file(), reason="the ShapesBench-Edit model is not shipped"
)


@pytest.fixture(scope="module")
def model():
    return load_model("shapesbench-edit")


def test_the_edit_model_is_kontext_and_samples_what_its_pipeline_samples(model):
    from diffusers import FluxKontextPipeline

    assert check_model_id("shapesbench-edit") == "shapes-edit" and model.kind == "shapes-edit"
    assert model.text_tokens == 12 and model.latent_shape() == (16, 16) and model.height == 32
    prompts = load_prompts("shapes-eval", edits=True)[:2]
    pipe = FluxKontextPipeline.from_pretrained(SHAPESBENCH_EDIT_DIR)
    pipe.set_progress_bar_config(disable=True)
    noise = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(0))
    sources = [p.load_images()[0] for p in prompts]
    stock = pipe(image=sources, prompt=[p.text for p in prompts], latents=noise.clone(), height=32, width=32,
                 num_inference_steps=4, guidance_scale=1.0, max_sequence_length=12, _auto_resize=False,
                 max_area=32 * 32, output_type="pt").images  # fmt: skip
    ours = sample_ode(model, model.transformer, model.encode_prompts(prompts), noise, pipe.scheduler.sigmas, 1.0)
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=0)


def test_the_shapesbench_splits_are_the_edits_and_its_rewards_score_the_targets(model):
    train, held_out = load_prompts("shapes-train", edits=True), load_prompts("shapes-eval", edits=True)
    assert len(train) == 3360 and len(held_out) == 192 and all(isinstance(p, EditPrompt) for p in train + held_out)
    assert not {p.images for p in train} & {p.images for p in held_out}  # held-out sources are held out
    assert {parse_instruction(p.text)[0] for p in held_out} == {"fg", "bg", "shape"}  # every kind of instruction
    prompts = held_out[:6]
    images = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    total, parts = build_reward(parse_rewards("shapes:1,verifier:0"), "cpu")(images, prompts)

    sources, texts = source_images(prompts), [p.text for p in prompts]
    torch.testing.assert_close(total, edit_learned_reward(load_reward_model(), images, sources, texts))
    torch.testing.assert_close(parts["verifier"], edit_verifier_reward(images, sources, texts))
    assert edit_verifier_reward(sources, sources, texts).max() < 1  # the unedited source is no edit


def test_an_instruction_that_does_not_fit_its_source_stops_at_start_up(tmp_path):
    row = json.loads((SHAPESBENCH_EDIT_DIR.parent / "eval.jsonl").read_text().splitlines()[0])
    source = str(SHAPESBENCH_EDIT_DIR.parent / row["image"])
    check_shapesbench_prompts([EditPrompt(row["instruction"], [source])], "--eval-prompts")
    for bad in ("make the cat blue", "paint it"):
        with pytest.raises(InputError, match="--eval-prompts: prompt 1: "):
            check_shapesbench_prompts([EditPrompt(bad, [source])], "--eval-prompts")


def test_dancegrpo_trains_the_edit_model_with_the_edit_verifiers_figures(tmp_path):
    flags = ["--model-id", "shapesbench-edit", "--iterations", "1", "--samples-per-device", "8", "--group-size", "4",
             "--rollout-batch-size", "8",
             "--samples-per-update", "8", "--num-steps", "6", "--eval-every", "1", "--eval-max-prompts", "6",
             "--eval-samples-per-prompt", "1", "--eval-steps", "4", "--sample-every", "1", "--exp-name", "e"]  # fmt: skip
    run_in_process("dancegrpo.py", flags, tmp_path)
    run = find_run(tmp_path / "e")
    evals = [r for r in metrics(run) if "eval/edit_acc" in r]
    assert [r["iteration"] for r in evals] == [0, 1]
    for r in evals:
        assert 0 <= r["eval/edit_acc"] <= r["eval/changed_acc"] <= 1 and 0 <= r["eval/kept_acc"] <= 1
        assert "eval/reward_mean" in r and "eval/size_kept_acc" in r
    assert len(list((run / "samples").glob("samples_*.png"))) == 2
