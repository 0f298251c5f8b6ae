"""`--reward ocr`, Flow-GRPO's OCR reward (common/ocr.py): the rule by hand on strings, then the real PP-OCRv4 models
shipped in the rapidocr-onnxruntime wheel on text rendered with PIL (black on white, 48 px), loaded once for the
module; a prompt without quoted text refused at start-up."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from common import InputError
from common.ocr import ocr_score, ocr_target
from common.rewards import REWARDS, build_reward, check_reward_prompts, parse_rewards


def render(*lines: str, size: int = 512, font_size: int = 48) -> torch.Tensor:
    """(3, size, size) in [0, 1]: `lines` in black on white, one under the other, in PIL's scalable default font."""
    image = Image.new("RGB", (size, size), "white")
    draw, font = ImageDraw.Draw(image), ImageFont.load_default(size=font_size)
    y = size / 2 - len(lines) * font_size * 0.7
    for line in lines:
        draw.text((24, y), line, fill="black", font=font)
        y += font_size * 1.4
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


@pytest.fixture(scope="module")
def ocr():
    """The registered reward, built once: the engine takes about 0.4 s to load, each 512 px image about 0.25 s."""
    return build_reward(parse_rewards("ocr"), "cpu")


def scores(ocr, images: list[torch.Tensor], prompts: list[str]) -> list[float]:
    return ocr(torch.stack(images), prompts)[1]["ocr"].tolist()


# ---------------------------------------------------------------- the rule, without the model
def test_the_rule_by_hand():
    """flow_grpo `flow_grpo/ocr.py`: ' ' removed and lower-cased on both sides; contained = distance 0; else the
    Levenshtein distance capped at the target's length, over that length."""
    assert ocr_score("Hello World", "hello world") == 1.0
    assert ocr_score("HELLOWORLD", "Hello   World") == 1.0  # case and spaces do not count
    assert ocr_score("Menu: HELLO WORLD today", "hello world") == 1.0  # contained in longer text
    assert ocr_score("Helo World", "Hello World") == pytest.approx(1 - 1 / 10)  # one deletion of 10 letters
    assert ocr_score("Hallo World", "Hello World") == pytest.approx(1 - 1 / 10)  # one substitution
    assert ocr_score("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert ocr_score("ab", "abc") == pytest.approx(1 - 1 / 3)
    assert ocr_score("hello\tworld", "hello world") == pytest.approx(1 - 1 / 10)  # only ' ' goes, as the official
    assert ocr_score("", "Hello") == 0.0  # nothing recognised
    assert ocr_score("a much longer unrelated text", "xyz") == 0.0  # distance 24, capped at 3
    assert ocr_score("B", "A") == 0.0
    with pytest.raises(ValueError, match="empty target"):
        ocr_score("anything", "   ")


def test_the_target_is_the_first_span_between_straight_double_quotes():
    assert ocr_target('a sign that says "Hello World" next to "Exit"') == "Hello World"
    assert ocr_target('"A"') == "A"
    assert ocr_target('a banner " Big  Sale " at noon') == " Big  Sale "  # as written: ocr_score drops the spaces
    assert ocr_target("a sign that says OPEN") is None
    assert ocr_target('a sign that says ""') is None  # the official would divide by 0
    assert ocr_target('a sign that says "   "') is None  # the same, once the spaces are removed
    assert ocr_target('a sign that says "OPEN') is None  # unclosed
    assert ocr_target("a sign that says \u201cOPEN\u201d") is None  # curly quotes: the official splits on '"' only


def test_a_prompt_without_quoted_text_is_refused_at_start_up(tmp_path, monkeypatch):
    """The official divides by the target's length: a prompt with nothing quoted (or only spaces) would be a
    ZeroDivisionError mid-run. One line before anything loads, for `ocr` weighted or logged at weight 0."""
    good = ['a sign that says "OPEN"', 'a neon "Hello World" over a door']
    check_reward_prompts(parse_rewards("ocr"), good, "--prompts")
    message = (
        "{flag}: prompt {i} quotes no text for ocr to read: it reads the first span between straight double quotes, "
        'e.g. a sign that says "OPEN"'
    )
    for spec, prompts, flag, i in (
        ("ocr", [*good, "a sign that says OPEN"], "--prompts", 3),
        ("jpeg,ocr:0", ['a sign ""', *good], "--eval-prompts", 1),
        ("ocr:2", [good[0], 'a sign " "'], "--prompts", 2),
    ):
        with pytest.raises(InputError) as e:
            check_reward_prompts(parse_rewards(spec), prompts, flag)
        assert str(e.value) == message.format(flag=flag, i=i)
    check_reward_prompts(parse_rewards("jpeg"), ["no quotes"], "--prompts")  # no ocr: any prompt
    # through a script's start-up: the prompt file is read and checked before a model or the reward loads
    import common.flags
    import dancegrpo

    monkeypatch.setattr(common.flags, "check_not_shapesbench", lambda args: None)
    (tmp_path / "p.txt").write_text('a sign that says "OPEN"\na sign that says nothing\n')
    args = dancegrpo.Args(reward="ocr", prompts=str(tmp_path / "p.txt"), eval_prompts=str(tmp_path / "p.txt"))
    with pytest.raises(InputError) as e:
        dancegrpo.resolve_and_check(args)
    assert str(e.value) == message.format(flag="--prompts", i=2)


# ---------------------------------------------------------------- the real PP-OCRv4 models on rendered text
def test_the_reward_is_registered_as_not_differentiable_and_takes_no_checkpoint(ocr):
    assert REWARDS["ocr"].differentiable is False and not REWARDS["ocr"].judge and ocr.differentiable is False
    with pytest.raises(InputError, match="reward 'ocr' takes no checkpoint"):
        REWARDS["ocr"].factory("cpu", "/some/path")


@pytest.mark.parametrize(
    "lines, prompt, expected",
    [
        (["Hello World"], 'a sign that says "Hello World"', 1.0),
        (["Hello World"], 'a sign that says "Hello Warld"', 1 - 1 / 10),  # one letter of 10 off
        (["Welcome to", "Hello World", "Cafe"], 'a storefront with "Hello World" on it', 1.0),  # contained
        (["OPEN 24 HOURS"], 'a neon sign reading "open 24 hours"', 1.0),  # read as OPEN24HOURS; asked in lower case
        ([], 'a sign that says "Hello World"', 0.0),  # nothing recognised
    ],
    ids=["exact", "one-letter-off", "words-around", "case-and-spaces", "blank"],
)
def test_rendered_text_scores_by_the_rule(ocr, lines, prompt, expected):
    assert scores(ocr, [render(*lines)], [prompt]) == [pytest.approx(expected)]


def test_the_scores_are_float32_on_the_images_device_without_a_graph(ocr):
    images = torch.stack([render("Spring Sale"), render()]).requires_grad_()
    total, parts = ocr(images, ['a poster "Spring Sale"', 'a poster "Spring Sale"'])
    assert total.dtype == torch.float32 and total.shape == (2,) and total.device == images.device
    assert total.tolist() == parts["ocr"].tolist() == [1.0, 0.0] and not total.requires_grad


def test_tiny_images_score_0_without_an_error(ocr, capsys):
    """ShapesBench's 32 x 32 renders, a blank and a noise image of that size, and 16 px text in it: the engine finds
    no text in any (nothing is read at that size), so each scores 0, and nothing fails (no warning printed)."""
    from common.shapesbench.world import sample_batch

    shapes, _ = sample_batch(4, torch.Generator().manual_seed(0))
    noise = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(0))
    images = [*shapes, torch.ones(3, 32, 32), noise, render("Hi", size=32, font_size=16)]
    assert scores(ocr, images, ['a sign that says "Hi"'] * 7) == [0.0] * 7
    assert "warning" not in capsys.readouterr().err


def test_a_failure_of_the_engine_scores_0_with_a_warning(ocr, monkeypatch, capsys):
    """As the official (an exception inside PaddleOCR gives the maximum distance, printed): that image scores 0, the
    others of the batch are scored."""
    from rapidocr_onnxruntime import RapidOCR

    calls, run = [], RapidOCR.__call__

    def fails_second(self, pixels, *args, **kwargs):
        calls.append(pixels.shape)
        if len(calls) == 2:
            raise RuntimeError("onnxruntime: out of memory")
        return run(self, pixels, *args, **kwargs)

    monkeypatch.setattr(RapidOCR, "__call__", fails_second)
    images = [render("Hello World")] * 3
    assert scores(ocr, images, ['"Hello World"'] * 3) == [1.0, 0.0, 1.0]
    assert calls == [(512, 512, 3)] * 3  # uint8 HWC, one image at a time
    err = capsys.readouterr().err
    assert err == "warning: ocr failed on image 1 (RuntimeError: onnxruntime: out of memory); it scores 0\n"
