"""The field's yardsticks in `python -m common.evaluate`: GenEval's summary table (per task, the overall mean of the
six, all images) from geneval_accuracy with its paired errors, by hand and end to end on a tiny SD3 with a tiny
detector; OCR accuracy beside it; and a peft adapter folder (as Flow-GRPO releases its LoRAs) read as peft reads it."""

import json
import math

import pytest
import torch
import tyro

from common import InputError
from common import evaluate as E
from common.models import load_model
from tests.tiny import BUILDERS, RES, build_tiny_geneval


# ---------------------------------------------------------------- GenEval's summary, by hand
def test_the_geneval_table_by_hand():
    """Two tasks (counting: prompts 0-1; position: 2-4). Base verdicts (1, 0 | 0, 0, 1), trained (1, 1 | 1, 0, 1):
    base counting 1/2, position 1/3, overall (1/2 + 1/3) / 2 = 5/12, all images 2/5; trained 1, 2/3, 5/6, 4/5.
    Paired differences: counting (0, 1): mean 1/2, se = std(0, 1) / sqrt 2 = 0.7071 / 1.4142 = 1/2; position
    (1, 0, 0): mean 1/3, se = sqrt(1/3) / sqrt 3 = 1/3; overall mean (1/2 + 1/3) / 2 = 5/12 with se
    sqrt(1/4 + 1/9) / 2."""
    styles = ["counting"] * 2 + ["position"] * 3
    per_prompt = {
        "base": {"geneval_accuracy": torch.tensor([1.0, 0, 0, 0, 1])},
        "run": {"geneval_accuracy": torch.tensor([1.0, 1, 1, 0, 1])},
    }
    figures, lines = E.geneval_table(per_prompt, styles)
    assert figures["base"]["counting"] == 0.5 and figures["base"]["position"] == pytest.approx(1 / 3)
    assert figures["base"]["overall"] == pytest.approx(5 / 12) and figures["base"]["all_images"] == pytest.approx(0.4)
    assert figures["run"]["overall"] == pytest.approx(5 / 6) and figures["run"]["all_images"] == pytest.approx(0.8)
    deltas = figures["run"]["deltas"]
    assert deltas["counting"] == pytest.approx((0.5, 0.5))
    assert deltas["position"] == pytest.approx((1 / 3, 1 / 3))
    assert deltas["overall"] == pytest.approx((5 / 12, math.sqrt(1 / 4 + 1 / 9) / 2))
    assert lines[3].split(" | ")[1:3] == ["counting", "position"]  # GenEval's task order, the tasks present only


# ---------------------------------------------------------------- end to end
GENEVAL_ROWS = [
    "a photo of a cat",
    "a photo of a dog and a bench",
    "a photo of two cats",
    "a photo of a red car",
    "a photo of a cat left of a dog",
    "a photo of a red car and a blue bench",
]


def test_geneval_and_ocr_tables_end_to_end_on_tiny_models(tmp_path, capsys):
    """A GenEval metadata file (one prompt of each task) through a tiny SD3 scored by a tiny random detector: the
    report's GenEval table has the six tasks, and its figures equal the per-prompt verdicts of scores.jsonl; then an
    OCR prompt file scored by the shipped PP-OCR models (OCR accuracy: the mean of the OCR reward)."""
    from common.geneval import geneval_metadata

    BUILDERS["sd3"](tmp_path / "sd3")
    build_tiny_geneval(tmp_path / "det")
    rows = [geneval_metadata(p) for p in GENEVAL_ROWS]
    (tmp_path / "geneval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--model-id", str(tmp_path / "sd3"), "--resolution", str(RES), "--num-steps", "2",
              "--samples-per-prompt", "2", "--batch-size", "4", "--grid-prompts", "2"]  # fmt: skip
    E.main(tyro.cli(E.EvalArgs, args=[*common, "--prompts", str(tmp_path / "geneval.jsonl"), "--reward",
                                      "geneval_accuracy,geneval:0", "--reward-ckpt", f"geneval={tmp_path / 'det'}",
                                      "--reward-ckpt", f"geneval_accuracy={tmp_path / 'det'}",
                                      "--out", str(tmp_path / "eval")]))  # fmt: skip
    out = capsys.readouterr().out
    assert "GenEval: correct images per task" in out
    result = json.loads((tmp_path / "eval" / "results.json").read_text())
    table = result["figures"]["base"]["geneval"]
    tags = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]
    scores = [json.loads(line) for line in (tmp_path / "eval" / "scores.jsonl").read_text().splitlines()]
    assert [s["style"] for s in scores] == tags
    for tag, s in zip(tags, scores):
        assert table[tag] == pytest.approx(s["base"]["geneval_accuracy"])
    assert table["overall"] == pytest.approx(sum(table[t] for t in tags) / 6)

    (tmp_path / "ocr.txt").write_text('a sign that says "OPEN"\na poster reading "Hello World"\n')
    E.main(tyro.cli(E.EvalArgs, args=[*common, "--prompts", str(tmp_path / "ocr.txt"), "--reward", "ocr,jpeg:0",
                                      "--out", str(tmp_path / "eval_ocr")]))  # fmt: skip
    result = json.loads((tmp_path / "eval_ocr" / "results.json").read_text())
    assert 0 <= result["figures"]["base"]["reward_ocr"] <= 1


# ---------------------------------------------------------------- a peft adapter folder
def peft_adapter(transformer, folder, targets, seed=0):
    """Save a random LoRA (r 4, alpha 8: scale 2) on `transformer` as peft saves it (adapter_model.safetensors,
    base_model.model.* names), and return the wrapped model's forward for comparison."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(transformer, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn_like(p)
    model.save_pretrained(folder)
    return model


def test_a_peft_adapter_folder_loads_as_peft_applies_it(tmp_path):
    """Flow-GRPO saves its LoRA with peft's save_pretrained: weights_kind says 'peft', check_weights accepts it, and
    the loaded transformer's velocity equals the PeftModel's own (the scale alpha / r = 2 included); an adapter of
    another model, or one without its config, is one line naming --weights."""
    BUILDERS["sd3"](tmp_path / "sd3")
    reference = load_model(str(tmp_path / "sd3"), resolution=RES)
    wrapped = peft_adapter(reference.transformer, tmp_path / "lora", ["to_q", "to_k", "to_v"])
    assert E.weights_kind(tmp_path / "lora") == "peft"
    model = load_model(str(tmp_path / "sd3"), resolution=RES)
    E.check_weights(model, str(tmp_path / "lora"), tmp_path / "lora")
    E.load_weights(model, tmp_path / "lora")
    torch.manual_seed(1)
    x = torch.randn(1, *model.latent_shape())
    t = torch.tensor([0.5])
    cond = model.encode_prompts(["a cat"])
    with torch.no_grad():
        got = model.velocity(model.transformer, x, t, cond)
        want = model.velocity(wrapped, x, t, cond)  # the reference: peft's own model, the same adapter
    assert got.abs().max() > 0 and torch.allclose(got, want, atol=1e-5)

    BUILDERS["flux"](tmp_path / "flux")
    flux = load_model(str(tmp_path / "flux"), resolution=RES)
    peft_adapter(flux.transformer, tmp_path / "flux_lora", ["to_q"])
    other = load_model(str(tmp_path / "sd3"), resolution=RES)
    with pytest.raises(InputError, match=r"--weights X: .*adapter_model.safetensors is not a LoRA adapter of"):
        E.check_weights(other, "X", tmp_path / "flux_lora")
    (tmp_path / "lora" / "adapter_config.json").unlink()
    with pytest.raises(InputError, match="needs its adapter_config.json"):
        E.check_weights(other, "Y", tmp_path / "lora")
