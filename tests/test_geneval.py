"""`--reward geneval` and `geneval_accuracy` (common/geneval.py) end to end on a tiny random Mask2Former and CLIP:
mmdetection's pre- and post-processing by hand, the colour classifier's construction, the reward's values against
the rules run on the detector's own output, and every outside input refused at start-up. The rules themselves are
checked against the official code's outputs in tests/test_geneval_rules.py."""

import json
import math

import numpy as np
import pytest
import torch

from common import InputError
from common.geneval import (
    CLASSES,
    COLORS,
    GenEvalJudge,
    detector_inputs,
    evaluate,
    geneval_metadata,
    instance_detections,
    keep_detections,
    load_geneval,
    partial_score,
)
from common.rewards import build_reward, check_reward_prompts, check_rewards, parse_rewards
from tests.tiny import build_tiny_geneval

PROMPTS = [
    "a photo of a cat",
    "a photo of two dogs",
    "a photo of a red car and a blue bench",
    "a photo of a cat left of a dog",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("geneval")
    build_tiny_geneval(d)
    return str(d)


# ---------------------------------------------------------------- mmdetection's test-time processing, by hand
def test_the_detector_sees_mmdetections_resized_normalised_padded_input():
    """Keep-ratio resize into 1333 x 800, then padding to multiples of 32: 512x512 -> 800x800 (scale 800/512, no
    padding); 512x768 -> min(1333/768, 800/512) = 1.5625 -> 800x1200, padded to 800x1216; 1024x1024 -> 800x800. A
    grey of 128 is (128 - 123.675) / 58.395 = 0.07406... in the red channel, and padding is 0 after normalising."""
    x, size = detector_inputs(torch.full((1, 3, 512, 512), 128.0))
    assert x.shape == (1, 3, 800, 800) and size == (800, 800)
    assert x[0, 0, 0, 0].item() == pytest.approx((128 - 123.675) / 58.395, rel=1e-6)
    assert x[0, 2, 5, 5].item() == pytest.approx((128 - 103.53) / 57.375, rel=1e-6)
    x, size = detector_inputs(torch.full((1, 3, 512, 768), 128.0))
    assert x.shape == (1, 3, 800, 1216) and size == (800, 1200)
    assert x[0, :, :, 1200:].abs().max().item() == 0 and x[0, 0, :, 1199].min().item() > 0.07
    assert detector_inputs(torch.zeros(2, 3, 1024, 1024))[1] == (800, 800)


def test_instance_post_processing_by_hand():
    """Two queries on an 8x8 original (no resize, no padding): query 0 is 'cat' with softmax probability p (the other
    logits 0), its mask logit +2 on rows 2-4 and columns 1-5 and -2 elsewhere; query 1's mask is empty. mmdetection
    scores a (query, class) pair p x the mean sigmoid inside the mask = p x sigmoid(2), and boxes the mask as
    [x_min, y_min, x_max + 1, y_max + 1] = [1, 2, 6, 5]; an empty mask scores 0 and boxes to zeros."""
    logits = torch.zeros(2, 81)
    logits[0, CLASSES.index("cat")] = 5.0
    masks = torch.full((2, 8, 8), -2.0)
    masks[0, 2:5, 1:6] = 2.0
    boxes, binary = instance_detections(logits, masks, (8, 8), (8, 8), (8, 8))
    p = math.exp(5) / (math.exp(5) + 80)  # 81 logits: 5 for cat, 0 for the 79 others and "no object"
    cat = boxes[CLASSES.index("cat")]
    assert len(cat) == 2  # query 0 and query 1, both offered as cats (the 100 best pairs of 2 x 80)
    best = cat[np.argmax(cat[:, 4])]
    assert best[:4].tolist() == [1, 2, 6, 5]
    assert best[4] == pytest.approx(p * torch.sigmoid(torch.tensor(2.0)).item(), rel=1e-5)
    assert binary[CLASSES.index("cat")][np.argmax(cat[:, 4])].sum() == 15
    assert sum(len(b) for b in boxes) == 100  # max_per_image pairs in all
    assert all(b.dtype == np.float32 for b in boxes)
    empty = boxes[CLASSES.index("dog")]
    assert (empty[:, 4] == 0).any() and (empty[empty[:, 4] == 0][:, :4] == 0).all()


# ---------------------------------------------------------------- the reward, end to end
def test_the_reward_is_the_rules_on_the_detectors_own_output(folder):
    """geneval (the partial score) and geneval_accuracy (the verdict) equal keep_detections + partial_score /
    evaluate run by hand on the judge's detections and colours; the two share one loaded judge."""
    torch.manual_seed(0)
    images = torch.rand(len(PROMPTS), 3, 64, 64)
    reward = build_reward(
        parse_rewards("geneval,geneval_accuracy:0", [f"geneval={folder}", f"geneval_accuracy={folder}"]), "cpu"
    )
    total, parts = reward(images, PROMPTS)
    judge = load_geneval(folder, "cpu")
    from PIL import Image

    expect_score, expect_correct = [], []
    pixels = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for (boxes, masks), prompt, array in zip(judge.detect(images), PROMPTS, pixels):
        meta = geneval_metadata(prompt)
        kept = keep_detections(boxes, meta["tag"], masks)
        colours = judge.colours(Image.fromarray(array))
        expect_correct.append(float(evaluate(meta, kept, colours)[0]))
        expect_score.append(partial_score(meta, kept, colours)[1])
    assert parts["geneval"].tolist() == pytest.approx(expect_score, abs=1e-6)
    assert parts["geneval_accuracy"].tolist() == expect_correct
    assert total.tolist() == pytest.approx(expect_score, abs=1e-6)  # weight 0 on the verdict
    assert all(-15 <= s <= 1 for s in expect_score)


def test_the_colour_classifier_is_the_mean_of_three_normalised_templates(folder):
    """clip_benchmark's zero-shot classifier: per colour the three templates' unit text embeddings averaged and
    renormalised; a crop's colour is the argmax of its unit image embedding against them."""
    judge = load_geneval(folder, "cpu")
    w = judge.classifier("car")
    assert w.shape[1] == len(COLORS) and torch.allclose(w.norm(dim=0), torch.ones(len(COLORS)), atol=1e-6)
    tokens = judge.processor.tokenizer(
        ["a photo of a blue car", "a photo of a blue-colored car", "a photo of a blue object"],
        padding=True,
        return_tensors="pt",
    )
    e = judge.clip.get_text_features(**tokens)
    e = torch.nn.functional.normalize(getattr(e, "pooler_output", e), dim=-1).mean(0)
    assert torch.allclose(w[:, COLORS.index("blue")], e / e.norm(), atol=1e-6)
    from PIL import Image

    image = Image.fromarray(np.full((32, 32, 3), 200, np.uint8))
    box = np.array([2, 2, 20, 20, 0.9], np.float32)
    got = judge.colours(image)("car", [(box, None), (box, np.ones((32, 32), bool))])
    assert len(got) == 2 and set(got) <= set(COLORS)


# ---------------------------------------------------------------- what is refused, before anything loads
def test_prompts_outside_genevals_templates_are_refused(folder):
    spec = parse_rewards("geneval", [f"geneval={folder}"])
    check_reward_prompts(spec, PROMPTS, "--prompts")
    with pytest.raises(InputError, match=r"--eval-prompts: prompt 2 is not one of GenEval's templates"):
        check_reward_prompts(spec, [PROMPTS[0], "a cat on a mat"], "--eval-prompts")
    with pytest.raises(InputError, match="prompt 1 is not one of GenEval's templates"):
        check_reward_prompts(parse_rewards("jpeg,geneval_accuracy:0"), ["a photo of three unicorns"], "--prompts")


@pytest.mark.parametrize(
    "damage", ["labels", "not_mask2former", "clip_is_mask2former", "missing", "shapes", "swapped", "truncated"]
)
def test_a_wrong_checkpoint_is_one_line_naming_the_flag(tmp_path, folder, damage, monkeypatch):
    """A detector with 10 classes, a folder whose config is another model, a CLIP folder that is a detector, no
    folder, weights whose shapes differ from the config, CLIP's weights in the detector's place, a truncated file:
    each an InputError naming --reward-ckpt geneval at start-up (check_rewards: configs and headers, nothing loaded)
    and when the reward is built."""
    import shutil

    d = tmp_path / "ckpt"
    if damage == "labels":
        build_tiny_geneval(d, num_labels=10)
    elif damage != "missing":
        shutil.copytree(folder, d)
    if damage == "not_mask2former":
        config = json.loads((d / "mask2former" / "config.json").read_text())
        (d / "mask2former" / "config.json").write_text(json.dumps({**config, "model_type": "detr"}))
    if damage == "clip_is_mask2former":
        shutil.rmtree(d / "clip")
        shutil.copytree(d / "mask2former", d / "clip")
    if damage == "shapes":
        config = json.loads((d / "mask2former" / "config.json").read_text())
        (d / "mask2former" / "config.json").write_text(json.dumps({**config, "hidden_dim": 48}))
    if damage == "swapped":
        shutil.copy(d / "clip" / "model.safetensors", d / "mask2former" / "model.safetensors")
    if damage == "truncated":
        data = (d / "clip" / "model.safetensors").read_bytes()
        (d / "clip" / "model.safetensors").write_bytes(data[: len(data) // 2])
    from common import rewards

    monkeypatch.setattr(rewards, "load_geneval", lambda *a, **k: pytest.fail("loaded"), raising=False)
    with pytest.raises(InputError, match=r"^--reward-ckpt geneval=") as e:
        check_rewards(parse_rewards("geneval", [f"geneval={d}"]))
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match=r"^--reward-ckpt geneval=") as e:
        load_geneval(str(d), "cpu")
    assert "\n" not in str(e.value)


def test_a_judge_refuses_a_prompt_it_cannot_read(folder):
    judge = load_geneval(folder, "cpu")
    assert isinstance(judge, GenEvalJudge)
    with pytest.raises(ValueError, match="not one of GenEval's templates"):
        judge.judge(torch.rand(1, 3, 32, 32), ["a cat on a mat"])
