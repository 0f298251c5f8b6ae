"""Edit data (common/edits.py): an EditPrompt is its instruction and its images, in hashing, equality, pickling and a
model's encode_prompts dedup; an edit file is read with every row and image checked, each bad row stopping with one
line that names the file and the line; the kind's image range is enforced; classifier-free guidance keeps the image
condition in both halves."""

import copy
import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from common import InputError
from common.edits import MAX_IMAGE_PIXELS, EditPrompt, centre_square, check_edit_prompts, load_image
from common.models.base import _cfg
from common.prompts import draw_prompts, load_prompts


def png(path, size=(12, 10), colour=(200, 30, 30)):
    Image.new("RGB", size, colour).save(path)
    return path


def test_an_edit_prompt_is_its_text_and_its_images():
    a, b = EditPrompt("make it blue", ["x.png"]), EditPrompt("make it blue", ["y.png"])
    assert str(a) == "make it blue" and type(str(a)) is str and a.text == "make it blue" and a.startswith("make")
    assert a != b and hash(a) != hash(b) and a == EditPrompt("make it blue", ("x.png",))
    assert a != "make it blue" and "make it blue" != a  # a plain prompt is another condition
    assert len({a, b, EditPrompt("make it blue", ["x.png"])}) == 2
    assert list(dict.fromkeys([a, b, a])) == [a, b]  # encode_prompts' dedup keeps both images
    for copied in (pickle.loads(pickle.dumps(a)), copy.deepcopy(a)):
        assert copied == a and copied.images == ("x.png",)
    assert [p.images for p in draw_prompts([a, b], 4, 0, 3)] == [p.images for p in draw_prompts([a, b], 4, 0, 3)]
    with pytest.raises(ValueError):
        EditPrompt("no image", [])


def test_an_edit_file_is_read_with_paths_relative_to_it(tmp_path):
    (tmp_path / "src").mkdir()
    png(tmp_path / "src" / "a.png"), png(tmp_path / "b.png", (7, 9))
    rows = [{"instruction": "make  the circle\tblue", "image": "src/a.png"},
            {"instruction": "swap them", "images": [str(tmp_path / "b.png"), "src/a.png"]}]  # fmt: skip
    (tmp_path / "edits.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    prompts = load_prompts(str(tmp_path / "edits.jsonl"))
    assert prompts == [EditPrompt("make the circle blue", [str(tmp_path / "src" / "a.png")]),
                       EditPrompt("swap them", [str(tmp_path / "b.png"), str(tmp_path / "src" / "a.png")])]  # fmt: skip
    assert [im.size for im in prompts[1].load_images()] == [(7, 9), (12, 10)]
    assert all(im.mode == "RGB" for im in prompts[1].load_images())


BAD_ROWS = {  # a second row -> the words the one-line error must hold
    "missing image": ({"instruction": "x", "image": "nope.png"}, "line 2: image", "does not exist"),
    "unreadable": ({"instruction": "x", "image": "junk.png"}, "line 2:", "not a readable image"),
    "too big": ({"instruction": "x", "image": "big.png"}, "line 2: image", "over the"),
    "no instruction": ({"image": "ok.png"}, "line 2:", '"instruction" is missing'),
    "empty instruction": ({"instruction": "  ", "image": "ok.png"}, "line 2:", "instruction"),
    "no image field": ({"instruction": "x"}, "line 2:", 'give "image"'),
    "both fields": ({"instruction": "x", "image": "ok.png", "images": ["ok.png"]}, "line 2:", "exactly one"),
    "empty list": ({"instruction": "x", "images": []}, "line 2:", "non-empty list"),
    "unknown field": ({"instruction": "x", "image": "ok.png", "mask": "m.png"}, "line 2:", "unknown field"),
    "not an object": (["x"], "line 2:", "JSON object"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_bad_edit_data_stops_with_one_line_naming_the_file_and_the_row(case, tmp_path, monkeypatch):
    png(tmp_path / "ok.png")
    (tmp_path / "junk.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    png(tmp_path / "big.png", (40, 30))
    monkeypatch.setattr("common.edits.MAX_IMAGE_PIXELS", 40 * 30 - 1)
    row, where, why = BAD_ROWS[case]
    path = tmp_path / "e.jsonl"
    path.write_text(json.dumps({"instruction": "fine", "image": "ok.png"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(InputError) as e:
        load_prompts(str(path), "--eval-prompts")
    msg = str(e.value)
    assert msg.startswith(f"--eval-prompts {path}, {where}") and why in msg and "\n" not in msg, msg


def test_the_size_cap_is_read_from_the_header_and_a_truncated_body_is_caught(tmp_path):
    assert MAX_IMAGE_PIXELS == 4096 * 4096
    full = tmp_path / "full.png"
    Image.effect_noise((64, 64), 50).convert("RGB").save(full)
    cut = tmp_path / "cut.png"
    cut.write_bytes(full.read_bytes()[:200])
    with pytest.raises(InputError, match="not a readable image"):
        load_image(cut, "--prompts e.jsonl, line 1")


def test_centre_square_takes_the_middle_and_resizes():
    img = Image.new("RGB", (6, 4), (0, 0, 0))
    for x in range(6):
        img.putpixel((x, 0), (x * 40, 0, 0))
    square = centre_square(img, 4)
    assert square.size == (4, 4) and [square.getpixel((x, 0))[0] for x in range(4)] == [40, 80, 120, 160]
    assert centre_square(Image.new("RGB", (5, 9)), 3).size == (3, 3)


def test_the_kinds_image_range_is_enforced_with_one_line():
    edits, plain = [EditPrompt("a", ["x.png"]), EditPrompt("b", ["x.png", "y.png"])], ["a cat"]
    check_edit_prompts(plain, (0, 0), "--prompts", "m")
    check_edit_prompts(edits, (1, 2), "--prompts", "m")
    check_edit_prompts(edits[:1] * 2, (0, 2), "--prompts", "m")  # FLUX.2: references optional, one count a file
    with pytest.raises(InputError, match=r"--prompts: prompts bring \[0, 1, 2\] images; --model-id m takes"):
        check_edit_prompts(plain + edits, (0, 2), "--prompts", "m")
    with pytest.raises(InputError, match="--prompts: an edit file .* makes images from text alone"):
        check_edit_prompts(edits, (0, 0), "--prompts", "m")
    with pytest.raises(InputError, match="--eval-prompts: prompt 1 brings no image, but --model-id m edits"):
        check_edit_prompts(plain, (1, 1), "--eval-prompts", "m")
    with pytest.raises(InputError, match="--prompts: prompt 2 brings 2 images; --model-id m takes at most 1"):
        check_edit_prompts(edits, (1, 1), "--prompts", "m")


def test_cfg_keeps_the_image_condition_in_both_halves():
    """uncond has the text only; the forward sees [uncond text; cond text] with the rows' own images twice."""
    seen = {}

    def forward(x, t, c):
        seen.update(c)
        return c["text"].sum(-1, keepdim=True) + 10 * c["image"].sum(-1, keepdim=True) + 0 * x

    cond = {"text": torch.tensor([[1.0], [2.0]]), "image": torch.tensor([[3.0], [4.0]])}
    out = _cfg(forward, torch.zeros(2, 1), torch.zeros(2), cond, lambda: {"text": torch.tensor([[0.5]])}, 3.0)
    assert seen["text"].flatten().tolist() == [0.5, 0.5, 1.0, 2.0]
    assert seen["image"].flatten().tolist() == [3.0, 4.0, 3.0, 4.0]
    # u + 3 (c - u) with u = 0.5 + 10 img, c = text + 10 img
    assert out.flatten().tolist() == pytest.approx([30.5 + 3 * 0.5, 40.5 + 3 * 1.5])


def test_image_similarity_is_clips_cosine_of_the_edit_and_its_cut_source(tmp_path):
    """Flow-GRPO's consistency reward: CLIP's projected image features of the edit and of the source, cut to the
    edit's square frame, cosine; 1 for the source itself; differentiable; a plain prompt refused at start-up and a
    served copy refused (a request carries no image)."""
    from transformers import CLIPModel, CLIPProcessor

    from common.rewards import build_reward, check_reward_prompts, check_rewards, clip_pixels, parse_rewards
    from tests.tiny import build_tiny_clip

    build_tiny_clip(tmp_path / "clip", size=32)
    src = tmp_path / "s.png"
    Image.effect_noise((40, 30), 60).convert("RGB").save(src)  # cut to its middle 30x30, then 16x16
    prompts = [EditPrompt("make it red", [str(src)]), EditPrompt("make it blue", [str(src)])]
    spec = parse_rewards("image_similarity", [f"image_similarity={tmp_path / 'clip'}"])
    reward = build_reward(spec, "cpu")
    square = centre_square(Image.open(src).convert("RGB"), 16)
    source = torch.from_numpy(np.array(square)).permute(2, 0, 1).float() / 255  # (3, 16, 16)
    edited = torch.stack([source, torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(0))]).requires_grad_()
    total, parts = reward(edited, prompts)
    model = CLIPModel.from_pretrained(tmp_path / "clip")
    processor = CLIPProcessor.from_pretrained(tmp_path / "clip")
    feats = lambda x: torch.nn.functional.normalize(
        model.get_image_features(pixel_values=clip_pixels(x, processor)).pooler_output, dim=-1
    )  # noqa: E731
    expected = (feats(edited.detach()) * feats(source.expand(2, -1, -1, -1))).sum(-1)
    torch.testing.assert_close(total.detach(), expected, atol=1e-6, rtol=0)
    assert total[0].item() == pytest.approx(1.0, abs=1e-6) and total[1].item() < 0.999
    total.sum().backward()
    assert edited.grad.abs().sum() > 0
    with pytest.raises(InputError, match="--prompts: prompt 1 brings no source image, and --reward image_similarity"):
        check_reward_prompts(spec, ["a cat", *prompts], "--prompts")
    served = parse_rewards("image_similarity", (), ["image_similarity=http://127.0.0.1:9"])
    with pytest.raises(InputError, match="--reward-url image_similarity: an edit reward reads each prompt's source"):
        check_rewards(served)


def test_judge_scores_reads_one_json_score_list_or_nothing():
    from common.remote import judge_scores

    assert judge_scores('{"score": [7, 3], "reasoning": "ok"}', 2) == [7.0, 3.0]
    assert judge_scores('```json\n{"score": [10, 0.5], "reasoning": "a {b}"}\n```', 2) == [10.0, 0.5]
    assert judge_scores('{"score": [7, 3]} then again {"score": [7, 3]}', 2) == [7.0, 3.0]  # the same twice is one
    for bad in ('{"score": [7, 3]} no, {"score": [6, 3]}', '{"score": [7]}', '{"score": [11, 3]}',
                '{"score": [-1, 3]}', '{"score": ["7", 3]}', '{"score": [true, 3]}', "7 and 3", ""):  # fmt: skip
        assert judge_scores(bad, 2) is None, bad


def test_the_edit_judge_sees_the_source_then_the_edit_and_scores_as_viescore(tmp_path, monkeypatch):
    """Two chat completions per edit: [source, edit] + the instruction, then [edit] alone; the score is
    sqrt(min(consistency) * min(quality)) / 10; an edit whose answers never parse gets the batch's mean, counted."""
    import base64
    import io

    from common import remote
    from common.rewards import build_reward, check_rewards, parse_rewards
    from tests.test_remote import fake_vlm, start

    monkeypatch.setattr(remote.time, "sleep", lambda s: None)
    src = png(tmp_path / "s.png", (20, 16), (10, 200, 30))
    prompts = [EditPrompt("make it red", [str(src)]), EditPrompt("make it blue", [str(src)])]
    answers = ['{"score": [8, 6], "reasoning": "."}', '{"score": [9, 4]}',  # edit 1: sqrt(6 * 4) / 10
               "no idea", "still none"]  # fmt: skip  # edit 2: its consistency never parses
    calls = []
    url = start(fake_vlm(answers, calls)) + "/v1"
    spec = parse_rewards("edit_judge", (), [f"edit_judge={url}"])
    check_rewards(spec)  # served, as every judge; the images travel in the request
    reward = build_reward(spec, "cpu")
    judge = reward.components[0][2]
    judge.concurrency, judge.max_unparsed = 1, 0.5  # the answers in order; one of two may fail to parse
    edits = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    total, parts = reward(edits, prompts)
    assert total.tolist() == pytest.approx([24**0.5 / 10] * 2)  # the unparsed one filled with the mean
    assert parts["edit_judge_unparsed"].tolist() == [0.0, 1.0]
    first, second = calls[0]["messages"][0]["content"], calls[1]["messages"][0]["content"]
    assert [c["type"] for c in first] == ["image_url", "image_url", "text"] and "make it red" in first[2]["text"]
    assert [c["type"] for c in second] == ["image_url", "text"]
    decoded = Image.open(io.BytesIO(base64.b64decode(first[0]["image_url"]["url"].split(",")[1])))
    assert decoded.size == (8, 8) and decoded.getpixel((4, 4)) == (10, 200, 30)  # the source, cut to the edit's frame
    assert first[1]["image_url"] == second[0]["image_url"]  # the edit
