"""The papers' prompt sets as prompt sources: a GenEval metadata file (.jsonl) read and checked row by row, and
`python -m common.prompts NAME OUT [--from COPY]`, which fetches a pinned file once (its git blob id checked, its rows
read as the loader reads them, its count checked) and writes it whole. No test reads the network or a mirror: the
files are written here, the download is stubbed."""

import io
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

import common.prompts as P
from common import InputError, RunError
from common.prompts import PromptSet, expected_rows, fetch_prompt_set, git_blob_id, load_prompts
from tests.helpers import ROOT

ROWS = [  # one row of each of GenEval's six templates, as its generator writes them
    {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"},
    {
        "tag": "two_object",
        "include": [{"class": "bench", "count": 1}, {"class": "sports ball", "count": 1}],
        "prompt": "a photo of a bench and a sports ball",
    },
    {
        "tag": "counting",
        "include": [{"class": "wine glass", "count": 2}],
        "exclude": [{"class": "wine glass", "count": 3}],
        "prompt": "a photo of two wine glasses",
    },
    {
        "tag": "colors",
        "include": [{"class": "fire hydrant", "count": 1, "color": "blue"}],
        "prompt": "a photo of a blue fire hydrant",
    },
    {
        "tag": "position",
        "include": [{"class": "teddy bear", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}],
        "prompt": "a photo of a dog right of a teddy bear",
    },
    {
        "tag": "color_attr",
        "include": [
            {"class": "handbag", "count": 1, "color": "pink"},
            {"class": "scissors", "count": 1, "color": "black"},
        ],
        "prompt": "a photo of a pink handbag and a black scissors",
    },
]
PROMPTS = [row["prompt"] for row in ROWS]


def jsonl(rows) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


# ---------------------------------------------------------------- the loader
def test_a_metadata_file_of_every_template_reads_in_order_with_repeats_and_blank_lines(tmp_path):
    path = tmp_path / "geneval.jsonl"
    path.write_text(jsonl(ROWS[:3]) + "\n  \n" + jsonl(ROWS[3:] + ROWS[:1]).rstrip("\n"))  # no final newline
    assert load_prompts(str(path), "--eval-prompts") == PROMPTS + PROMPTS[:1]  # the repeat kept (Flow-GRPO's test set)
    assert len(set(load_prompts(str(path)))) == 6


def test_a_text_file_still_reads_one_prompt_per_line(tmp_path):
    path = tmp_path / "ocr.txt"
    path.write_text('# a comment\nA sign that says "Open"\n\n  A mug reading "Hi"  ')
    assert load_prompts(str(path)) == ['A sign that says "Open"', 'A mug reading "Hi"']


BAD_ROWS = {
    "not JSON": '{"tag": "single_object", "include": [',
    "no include": json.dumps({"tag": "single_object", "prompt": "a photo of a bench"}),
    "disagrees with its prompt": json.dumps({**ROWS[2], "include": [{"class": "wine glass", "count": 3}]}),
    "other class": json.dumps({**ROWS[0], "include": [{"class": "cat", "count": 1}]}),
    "outside the templates": json.dumps({"tag": "single_object", "include": [], "prompt": "a photo of a dragon"}),
    "not an object": json.dumps("a photo of a bench"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_a_bad_row_is_one_line_naming_the_flag_the_file_and_the_line(tmp_path, case):
    path = tmp_path / "bad.jsonl"
    path.write_text(jsonl(ROWS[:1]) + "\n" + BAD_ROWS[case] + "\n" + jsonl(ROWS[1:]))  # the bad row on line 3
    with pytest.raises(InputError) as e:
        load_prompts(str(path), "--eval-prompts")
    message = str(e.value)
    assert message.startswith(f"--eval-prompts {path}, line 3") and "\n" not in message


def test_an_empty_metadata_file_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n \n")
    with pytest.raises(InputError) as e:
        load_prompts(str(path), "--prompts")
    assert str(e.value).startswith(f"--prompts {path}") and "\n" not in str(e.value)


def test_a_metadata_file_that_is_not_utf8_is_refused(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({**ROWS[0], "note": "caf\xe9"}, ensure_ascii=False).encode("latin-1"))
    with pytest.raises(InputError) as e:
        load_prompts(str(path), "--prompts")
    assert str(e.value).startswith(f"--prompts {path}") and "UTF-8" in str(e.value)


# ---------------------------------------------------------------- the pinned sets
def test_the_pinned_sets_and_their_known_counts():
    assert expected_rows("geneval") == 553
    assert expected_rows("flowgrpo-geneval-test") == 2212
    assert expected_rows("flowgrpo-ocr-test") == 1018
    assert expected_rows("hpdv2") == 3200
    with pytest.raises(KeyError):
        expected_rows("no-such-set")
    for name, spec in P.PROMPT_SETS.items():
        assert len(spec.blob) == 40 and int(spec.blob, 16) >= 0, name
        assert len(spec.commit) == 40 and spec.url.startswith("https://raw.githubusercontent.com/"), name
        assert spec.jsonl == ("geneval" in name), name


def test_git_blob_id_is_gits():
    assert git_blob_id(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"  # `git hash-object /dev/null`
    assert git_blob_id(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"


@pytest.fixture
def pinned(tmp_path, monkeypatch):
    """A test-only set in the pinned table: (name, the copy with its pinned bytes)."""

    def pin(name, data: bytes, path: str, rows):
        copy = tmp_path / "copies" / path.rpartition("/")[2]
        copy.parent.mkdir(exist_ok=True)
        copy.write_bytes(data)
        monkeypatch.setitem(P.PROMPT_SETS, name, PromptSet("someone/repo", "0" * 40, path, git_blob_id(data), rows))
        return copy

    return pin


def test_a_copy_of_another_version_is_refused_and_nothing_written(tmp_path):
    copy = tmp_path / "evaluation_metadata.jsonl"
    copy.write_text(jsonl(ROWS))
    out = tmp_path / "out" / "geneval.jsonl"
    with pytest.raises(InputError) as e:
        fetch_prompt_set("geneval", str(out), str(copy))
    message = str(e.value)
    assert message.startswith(f"--from {copy}:") and git_blob_id(copy.read_bytes()) in message
    assert P.PROMPT_SETS["geneval"].blob in message and "\n" not in message
    assert not out.exists()


def test_a_missing_copy_is_refused(tmp_path):
    with pytest.raises(InputError) as e:
        fetch_prompt_set("flowgrpo-ocr-test", str(tmp_path / "out.txt"), str(tmp_path / "nowhere.txt"))
    assert str(e.value).startswith(f"--from {tmp_path / 'nowhere.txt'}:")


def test_a_pinned_metadata_copy_is_written_whole_with_its_count(tmp_path, pinned):
    rows = ROWS + ROWS[:2]  # repeats kept
    copy = pinned("test-geneval", jsonl(rows).rstrip("\n").encode(), "data/test_metadata.jsonl", len(rows))
    out = tmp_path / "out" / "set.jsonl"
    out.parent.mkdir()
    out.write_text("an older file\n")
    assert fetch_prompt_set("test-geneval", str(out), str(copy)) == 8
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    assert out.read_text().endswith("}\n")
    assert load_prompts(str(out)) == [row["prompt"] for row in rows]
    assert [p.name for p in out.parent.iterdir()] == ["set.jsonl"]  # no temporary file left beside it


def test_a_pinned_text_copy_is_written_one_prompt_per_line(tmp_path, pinned):
    copy = pinned("test-ocr", b'A sign that says "Open"\nA mug reading "Hi"', "data/ocr/test.txt", 2)
    out = tmp_path / "ocr.txt"
    assert fetch_prompt_set("test-ocr", str(out), str(copy)) == 2
    assert out.read_text() == 'A sign that says "Open"\nA mug reading "Hi"\n'


def test_an_unknown_count_takes_any_number_of_rows(tmp_path, pinned):
    copy = pinned("test-train", jsonl(ROWS[:4]).encode(), "data/train_metadata.jsonl", None)
    assert fetch_prompt_set("test-train", str(tmp_path / "train.jsonl"), str(copy)) == 4


def test_a_wrong_count_is_refused_and_the_old_file_kept(tmp_path, pinned):
    copy = pinned("test-geneval", jsonl(ROWS).encode(), "data/test_metadata.jsonl", 7)
    out = tmp_path / "set.jsonl"
    out.write_text("an older file\n")
    with pytest.raises(InputError) as e:
        fetch_prompt_set("test-geneval", str(out), str(copy))
    message = str(e.value)
    assert message.startswith(f"--from {copy}:") and "\n" not in message
    assert {"6", "7"} <= set(re.findall(r"\b\d+\b", message.removeprefix(f"--from {copy}:")))  # read, expected
    assert out.read_text() == "an older file\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "copies",
        "set.jsonl",
    ]


def test_a_failed_write_leaves_the_old_file_whole(tmp_path, pinned, monkeypatch):
    copy = pinned("test-geneval", jsonl(ROWS).encode(), "data/test_metadata.jsonl", 6)
    out = tmp_path / "out" / "set.jsonl"
    out.parent.mkdir()
    out.write_text("an older file\n")

    def replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(RunError):
        fetch_prompt_set("test-geneval", str(out), str(copy))
    assert out.read_text() == "an older file\n" and [p.name for p in out.parent.iterdir()] == ["set.jsonl"]


def test_a_pinned_copy_with_a_bad_row_is_refused_naming_the_line(tmp_path, pinned):
    copy = pinned("test-geneval", (jsonl(ROWS[:2]) + BAD_ROWS["no include"]).encode(), "data/m.jsonl", 3)
    with pytest.raises(InputError) as e:
        fetch_prompt_set("test-geneval", str(tmp_path / "set.jsonl"), str(copy))
    assert str(e.value).startswith(f"--from {copy}, line 3")
    assert not (tmp_path / "set.jsonl").exists()


@pytest.mark.parametrize("name, out", [("geneval", "set.txt"), ("flowgrpo-ocr-test", "set.jsonl")])
def test_out_must_be_read_back_as_the_set_is(tmp_path, name, out):
    """A .jsonl path is read as GenEval metadata, any other as text: OUT's name must match the set's kind."""
    with pytest.raises(InputError) as e:
        fetch_prompt_set(name, str(tmp_path / out), str(tmp_path / "unread"))
    assert str(e.value).startswith(f"OUT {tmp_path / out}:")


# ---------------------------------------------------------------- the download
class Response(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def test_a_download_is_checked_as_a_copy_is(tmp_path, pinned, monkeypatch):
    data = jsonl(ROWS).encode()
    pinned("test-geneval", data, "data/test_metadata.jsonl", 6)
    asked = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: asked.append((url, timeout)) or Response(data))
    assert fetch_prompt_set("test-geneval", str(tmp_path / "set.jsonl")) == 6
    assert asked == [
        (f"https://raw.githubusercontent.com/someone/repo/{'0' * 40}/data/test_metadata.jsonl", asked[0][1])
    ]
    assert 0 < asked[0][1] <= 300  # a timeout, not a wait for ever
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: Response(data + b"\n"))
    with pytest.raises(InputError):  # another version
        fetch_prompt_set("test-geneval", str(tmp_path / "other.jsonl"))


@pytest.mark.parametrize(
    "failure",
    [
        urllib.error.URLError(OSError(-2, "Name or service not known")),
        urllib.error.HTTPError("https://x", 404, "Not Found", None, None),
        TimeoutError("The read operation timed out"),
    ],
)
def test_an_unreachable_source_is_one_line_that_says_to_use_from(tmp_path, monkeypatch, capsys, failure):
    def urlopen(url, timeout):
        raise failure

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    with pytest.raises(RunError) as e:
        fetch_prompt_set("flowgrpo-ocr-test", str(tmp_path / "ocr.txt"))
    message = str(e.value)
    assert message.startswith("flowgrpo-ocr-test:") and "--from" in message and "\n" not in message
    assert P.PROMPT_SETS["flowgrpo-ocr-test"].url in message
    with pytest.raises(SystemExit) as exit:
        P.main(["flowgrpo-ocr-test", str(tmp_path / "ocr.txt")])
    assert exit.value.code == 1 and capsys.readouterr().err == f"error: {message}\n"
    assert not (tmp_path / "ocr.txt").exists()


# ---------------------------------------------------------------- the command line
def test_main_writes_and_counts(tmp_path, pinned, capsys):
    copy = pinned("test-geneval", jsonl(ROWS).encode(), "data/test_metadata.jsonl", 6)
    P.main(["test-geneval", str(tmp_path / "set.jsonl"), "--from", str(copy)])
    assert capsys.readouterr().out.split()[0] == "6" and load_prompts(str(tmp_path / "set.jsonl")) == PROMPTS


def test_main_refuses_a_bad_copy_with_one_line_and_status_2(tmp_path, capsys):
    copy = tmp_path / "test.txt"
    copy.write_text("a prompt\n")
    with pytest.raises(SystemExit) as exit:
        P.main(["flowgrpo-ocr-test", str(tmp_path / "out.txt"), "--from", str(copy)])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith(f"error: --from {copy}:") and err.count("\n") == 1


def test_hpdv2_from_the_hub_is_checked_for_its_count(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(P, "hpdv2_prompts", lambda folder: ["a prompt"] * (3200 if folder is None else 3))
    P.main(["hpdv2", str(tmp_path / "hpd.txt")])
    assert len(load_prompts(str(tmp_path / "hpd.txt"))) == 3200
    P.main(["hpdv2", str(tmp_path / "few.txt"), "--from", str(tmp_path)])  # a folder may hold a subset
    assert len(load_prompts(str(tmp_path / "few.txt"))) == 3
    monkeypatch.setattr(P, "hpdv2_prompts", lambda folder: ["a prompt"] * 3199)
    with pytest.raises(SystemExit) as exit:
        P.main(["hpdv2", str(tmp_path / "short.txt")])
    assert exit.value.code == 2 and not (tmp_path / "short.txt").exists()


def test_usage_errors_exit_non_zero_with_a_usage_line():
    out = subprocess.run([sys.executable, "-m", "common.prompts"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0 and out.stderr.startswith("usage: ") and not out.stdout
