"""The VLM judge's answer parser (common/remote.py, unifiedreward_score) and the Judge's limit on unparsed answers,
without a server: answers with one, two or no score lines, out-of-range scores, the max_unparsed limit at, below and
above its boundary (including a fraction whose product with the batch size rounds below the limit), and hypothesis
properties over arbitrary text around the score line."""

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common import RunError, remote

parse = remote.unifiedreward_score


def test_one_score_line_is_read_with_or_without_bold_and_text_around_it():
    assert parse("The caption matches.\nFinal Score: 4", "a cat") == 4.0
    assert parse("Good detail.\n**Final Score:** 2.5\nThanks.", "a cat") == 2.5
    assert parse("Final Score: **3**", "a cat") == 3.0


def test_two_score_lines_that_differ_are_unparsed_and_two_that_agree_are_read():
    """The first and the last of two different scores are each wrong in some answer (a judge revising itself; one
    quoting an example): neither is taken silently."""
    assert parse("Final Score: 2\nOn reflection the colours are right.\nFinal Score: 4", "a cat") is None
    assert parse("Final Score: 4\n(For example, Final Score: 1 would mean no match.)", "a cat") is None
    assert parse("Final Score: 4\nTo repeat: Final Score: 4.0", "a cat") == 4.0  # the same number twice


def test_scores_outside_one_to_five_and_answers_without_a_score_are_unparsed():
    for answer in ("Final Score: 0", "Final Score: 5.5", "Final Score: 7", "Final Score: -3", "Final Score: none",
                   "Final score 4", "I cannot tell.", ""):  # fmt: skip
        assert parse(answer, "a cat") is None, answer
    assert parse("Final Score: 1", "") == 1.0 and parse("Final Score: 5.0", "") == 5.0  # the ends are in


def offline_judge(answers: dict[str, str], max_unparsed: float) -> remote.Judge:
    """A unifiedreward Judge whose chat completion is `answers[prompt]` (no server): __init__ only asks /models."""
    judge = remote.Judge.__new__(remote.Judge)
    judge.name, judge.base, judge.token, judge.concurrency, judge.timeout = "unifiedreward", "offline", None, 1, 1.0
    judge.template, judge.parse = remote.JUDGES["unifiedreward"]
    judge.max_unparsed = max_unparsed
    judge._ask = lambda image_b64, prompt: answers[prompt]
    return judge


def judge_batch(n: int, n_unparsed: int, max_unparsed: float):
    """n images, the first n_unparsed answered without a score, the others "Final Score: 2" or "Final Score: 5"."""
    answers = {f"p{k}": "no score" if k < n_unparsed else f"Final Score: {2 if k % 2 else 5}" for k in range(n)}
    judge = offline_judge(answers, max_unparsed)
    return judge, judge(torch.zeros(n, 3, 4, 4), list(answers))


@pytest.mark.parametrize(
    ("n", "max_unparsed", "limit"),
    [(10, 0.3, 3), (100, 0.29, 29)],  # 0.29 x 100 is 28.999999999999996 in floating point: still a limit of 29
)
def test_max_unparsed_allows_the_limit_and_stops_one_past_it(n, max_unparsed, limit):
    for k in (limit - 1, limit):
        judge, scores = judge_batch(n, k, max_unparsed)
        parsed = [2.0 if j % 2 else 5.0 for j in range(k, n)]
        fill = sum(parsed) / len(parsed)  # the unparsed images get the batch's mean parsed score
        assert scores.tolist() == pytest.approx([fill] * k + parsed)
        assert judge.unparsed.tolist() == [1.0] * k + [0.0] * (n - k)
    with pytest.raises(RunError, match=f"{limit + 1} of {n} answers had no score"):
        judge_batch(n, limit + 1, max_unparsed)


# ---------------------------------------------------------------- properties over arbitrary answers
text = st.text(st.characters(codec="utf-8"), max_size=80).filter(lambda s: "Final Score" not in s)
in_range = st.one_of(st.integers(1, 5).map(str), st.sampled_from(["1.5", "2.25", "3.0", "4.75", "4.99"]))


@settings(max_examples=200, deadline=None)
@given(before=text, after=text, score=in_range, bold=st.booleans())
def test_property_one_score_line_anywhere_is_read_exactly(before, after, score, bold):
    line = f"Final Score: **{score}**" if bold else f"Final Score: {score}"
    assert parse(f"{before}\n{line}\n{after}", "p") == float(score)


@settings(max_examples=200, deadline=None)
@given(before=text, middle=text, a=in_range, b=in_range)
def test_property_two_different_scores_are_never_read(before, middle, a, b):
    got = parse(f"{before}\nFinal Score: {a}\n{middle}\nFinal Score: {b}", "p")
    assert got == (float(a) if float(a) == float(b) else None)


@settings(max_examples=300, deadline=None)
@given(answer=st.text(max_size=200) | st.builds(lambda a, s: f"{a}Final Score: {s}", st.text(max_size=40),
                                                 st.floats(0, 1000, allow_nan=False).map(str)))  # fmt: skip
def test_property_any_answer_parses_to_none_or_a_score_in_one_to_five(answer):
    got = parse(answer, "p")
    assert got is None or 1 <= got <= 5


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), data=st.data())
def test_property_the_judge_stops_exactly_when_the_unparsed_share_passes_the_limit(n, data):
    n_unparsed = data.draw(st.integers(0, n))
    max_unparsed = data.draw(st.sampled_from([0.0, 0.1, 0.25, 0.3, 0.5, 0.7, 1.0]))
    over = Fraction(n_unparsed, n) > Fraction(str(max_unparsed))  # exactly (round(2.5) = 2 would misjudge 0.25)
    if over:
        with pytest.raises(RunError, match=f"{n_unparsed} of {n} answers"):
            judge_batch(n, n_unparsed, max_unparsed)
    else:
        judge, scores = judge_batch(n, n_unparsed, max_unparsed)
        assert judge.unparsed.sum().item() == n_unparsed and torch.isfinite(scores).all()
