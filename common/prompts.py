"""Prompt sources: the ShapesBench splits, a text file with one prompt per line (e.g. HPDv2's or Flow-GRPO's OCR
prompts), a GenEval metadata file (`.jsonl`, one JSON object per line: tag, include, [exclude], prompt; each row is
checked against its prompt's template, common.geneval), an edit file (`.jsonl` rows of an instruction and its source
images, for the models that edit: common/edits.py), or a diffusion chain-of-thought file (rlr.py --dcot-prompts).

The papers' prompt sets are fetched once into such files, on a machine that reaches the source, or from a copy with
--from:
    python -m common.prompts NAME OUT [--from COPY]

- hpdv2: HPDv2's 3200 benchmark prompts (the test prompts of the papers' HPSv2.1 evaluations: 800 each of anime,
  concept-art, paintings and photo), from the Hugging Face dataset zhwang/HPDv2, files benchmark/*.json; a text file.
  --from names a folder holding benchmark/*.json. E.g. `python -m common.prompts hpdv2 prompts/hpdv2_test.txt`.
- geneval: GenEval's 553 evaluation prompts with their metadata, djghosh13/geneval at af4902f,
  prompts/evaluation_metadata.jsonl; a .jsonl file.
- flowgrpo-geneval-train, flowgrpo-geneval-test: Flow-GRPO's GenEval training prompts and its 2212-row test set (553
  prompts, each 4 times), yifan123/flow_grpo at ac4c86e, dataset/geneval/{train,test}_metadata.jsonl; .jsonl files.
- flowgrpo-ocr-train, flowgrpo-ocr-test: Flow-GRPO's OCR prompts (the text to render in double quotes) and its 1018
  test prompts, same commit, dataset/ocr/{train,test}.txt; text files.

The GitHub sets are downloaded from raw.githubusercontent.com at the pinned commit, or read from --from FILE (a copy
of that file); either way the bytes must be the pinned version (their git blob id), every row must read as the loader
reads it, and the count must be the known one; OUT is then written whole (the .jsonl sets as JSONL, one row per
line; the OCR sets one prompt per line). E.g. `python -m common.prompts flowgrpo-geneval-test
prompts/flowgrpo_geneval_test.jsonl`.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import hf_hub_download

from common import InputError, RunError, write_atomically
from common.edits import edit_prompts, is_edit_file
from common.sampling import keyed_generator
from common.shapesbench import split_prompts

SOURCES = {"shapes-train": "train", "shapes-eval": "eval"}
HPDV2_REPO, HPDV2_STYLES = "zhwang/HPDv2", ("anime", "concept-art", "paintings", "photo")
HPDV2_HOWTO = (
    "HPDv2's 3200 test prompts, from the Hugging Face dataset zhwang/HPDv2 (benchmark/*.json), are written to one "
    "by `python -m common.prompts hpdv2 prompts/hpdv2_test.txt`"
)


@dataclass(frozen=True)
class PromptSet:
    """One of the papers' prompt files at a pinned commit: `blob` is its git blob id, `rows` its count of rows
    (prompts) where known. A path ending in .jsonl is a GenEval metadata file, any other a text file."""

    repo: str
    commit: str
    path: str
    blob: str
    rows: int | None

    @property
    def url(self) -> str:
        return f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{self.path}"

    @property
    def jsonl(self) -> bool:
        return self.path.endswith(".jsonl")


GENEVAL_COMMIT = "af4902f24d3ca90ebbb446dd9891a59e0f82725f"
FLOWGRPO_COMMIT = "ac4c86e8cae021841f1fde853d340e0db67690dd"
PROMPT_SETS = {
    "geneval": PromptSet(
        "djghosh13/geneval", GENEVAL_COMMIT, "prompts/evaluation_metadata.jsonl",
        "efc21c7e639cd45554a1e44fac87157211f16d51", 553,
    ),
    "flowgrpo-geneval-train": PromptSet(
        "yifan123/flow_grpo", FLOWGRPO_COMMIT, "dataset/geneval/train_metadata.jsonl",
        "0b97e8a6802c08fc7537cd00c76ae79c851bddcb", None,
    ),
    "flowgrpo-geneval-test": PromptSet(  # GenEval's 553 prompts, each 4 times
        "yifan123/flow_grpo", FLOWGRPO_COMMIT, "dataset/geneval/test_metadata.jsonl",
        "27cdaf5cc1356fe15aeadbb8df55682ca74228f0", 2212,
    ),
    "flowgrpo-ocr-train": PromptSet(
        "yifan123/flow_grpo", FLOWGRPO_COMMIT, "dataset/ocr/train.txt",
        "3ce0521b77b0a9031191d66ecc36ebaaf27a3922", None,
    ),
    "flowgrpo-ocr-test": PromptSet(  # the file has no final newline
        "yifan123/flow_grpo", FLOWGRPO_COMMIT, "dataset/ocr/test.txt",
        "8deb4f8d8f2e863f45353354243669b3c991a6a2", 1018,
    ),
}  # fmt: skip
DOWNLOAD_TIMEOUT = 60.0  # seconds without a byte before a download is given up


def expected_rows(name: str) -> int | None:
    """The row count of the known prompt set `name` (hpdv2 or one of PROMPT_SETS), None where it is not known here;
    KeyError for any other name."""
    return 4 * 800 if name == "hpdv2" else PROMPT_SETS[name].rows


def load_prompts(source: str, flag: str = "--prompts", edits: bool = False) -> list[str]:
    """`source` is 'shapes-train', 'shapes-eval', a path ending in .jsonl to a GenEval metadata file (each non-blank
    line one JSON object, checked against its prompt's template: common.geneval.check_metadata), a .jsonl edit file
    (EditPrompts, each row and image checked: common.edits), or a path to a UTF-8 text file, one prompt per line (blank lines and lines starting with '#' are skipped). The prompts in file order,
    repeats kept. `flag` names the CLI option in error messages. With `edits` (the model is ShapesBench-Edit) the
    ShapesBench splits are its edits: 'shapes-train' its 3360 training edits, 'shapes-eval' 192 of its 1344 held-out
    ones, every source's instructions and sizes about equally (common.shapesbench.edit.eval_subset).
    """
    if source in SOURCES and edits:
        from common.shapesbench.builders import EDIT_PATH
        from common.shapesbench.edit import eval_subset

        path = EDIT_PATH / f"{SOURCES[source]}.jsonl"
        prompts = edit_prompts(read_text(path, f"{flag} {source} ({path})"), EDIT_PATH, f"{flag} {source}")
        return eval_subset(prompts) if source == "shapes-eval" else prompts
    if source in SOURCES:
        return split_prompts(SOURCES[source])
    path = Path(source).expanduser()
    if not path.is_file():
        raise InputError(
            f"{flag} {source!r}: no such file; give one of {sorted(SOURCES)}, a text file with one prompt per line "
            f"or a GenEval metadata file (.jsonl); the papers' sets are written by `python -m common.prompts NAME FILE` "
            f"({', '.join(['hpdv2', *PROMPT_SETS])})"
        )
    if is_jsonl(source) and is_edit_file(text := read_text(path, f"{flag} {source}")):
        return edit_prompts(text, path.parent, f"{flag} {source}")  # a first row, so never empty
    if is_jsonl(source):
        prompts = [row["prompt"] for row in metadata_rows(text, f"{flag} {source}")]
        if not prompts:
            raise InputError(
                f"{flag} {source}: the file holds no prompts (a GenEval metadata file: one JSON object per line)"
            )
        return prompts
    prompts = text_prompts(read_lines(path, f"{flag} {source!r}"))
    if not prompts:
        raise InputError(f"{flag} {source!r}: the file holds no prompts (one prompt per line; '#' starts a comment)")
    return prompts


def is_jsonl(path: str | Path) -> bool:
    """Whether a prompt file is read as GenEval metadata (its name ends in .jsonl) rather than as text."""
    return str(path).lower().endswith(".jsonl")


def text_prompts(lines: list[str]) -> list[str]:
    """A text file's prompts: its lines, stripped, less the blank ones and those starting with '#'."""
    return [p for p in (line.strip() for line in lines) if p and not p.startswith("#")]


def metadata_rows(text: str, where: str) -> list[dict]:
    """A GenEval metadata file's rows, in order: each non-blank line one JSON object, checked against its prompt's
    template (common.geneval.check_metadata); `where` (the flag and the file) starts the error message, which names
    the line."""
    from common.geneval import check_metadata  # here, not at the top: `--help` of every script imports this module

    rows = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(
                f"{where}, line {n}: not JSON ({e.msg}, column {e.colno}); a GenEval metadata file holds one JSON "
                "object per line"
            ) from None
        check_metadata(row, f"{where}, line {n}")
        rows.append(row)
    return rows


def read_text(path: Path, where: str) -> str:
    """A UTF-8 text file's text; `where` (the flag and the value) starts the error message."""
    return decode(path.read_bytes(), where)


def decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None


def read_lines(path: Path, where: str) -> list[str]:
    """The lines of a UTF-8 text file; `where` (the flag and the value) starts the error message."""
    return read_text(path, where).splitlines()


def load_dcot(path: str) -> dict[str, tuple[str, str, str]]:
    """Diffusion chain-of-thought prompts: a UTF-8 TSV file, one training prompt per line,
    `prompt<TAB>coarse prompt<TAB>medium prompt<TAB>fine prompt`; blank lines and lines starting with '#' are skipped.
    The reward scores the first column; steps in the first / middle / last third are conditioned on the others."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise InputError(f"--dcot-prompts {path}: no such file")
    out = {}
    for n, line in enumerate(read_lines(file, f"--dcot-prompts {path}"), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split("\t")]
        if len(fields) != 4 or not all(fields):
            raise InputError(
                f"--dcot-prompts {path}, line {n}: expected 4 TAB-separated fields (prompt, coarse, medium, fine)"
            )
        out[fields[0]] = tuple(fields[1:])
    if not out:
        raise InputError(f"--dcot-prompts {path}: the file holds no prompts")
    return out


def hpdv2_prompts(folder: str | None = None) -> list[str]:
    """HPDv2's benchmark prompts in a fixed order (anime, concept-art, paintings, photo; 800 each), from the hub
    dataset zhwang/HPDv2, or from `folder` holding its benchmark/*.json files."""
    prompts = []
    for style in HPDV2_STYLES:
        if folder is not None:
            path = Path(folder) / "benchmark" / f"{style}.json"
        else:
            path = hf_hub_download(HPDV2_REPO, f"{style}.json", subfolder="benchmark", repo_type="dataset")
        prompts += [" ".join(p.split()) for p in json.loads(Path(path).read_text(encoding="utf-8"))]
    return prompts


def git_blob_id(data: bytes) -> str:
    """The id git gives a file with these bytes (`git hash-object`): sha1 of 'blob LENGTH\\0' and the bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def download(url: str, name: str) -> bytes:
    """The bytes at `url`; a RunError of one line, naming `name` and saying to use --from, when it cannot be had."""
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT) as response:
            return response.read()
    except urllib.error.HTTPError as e:
        why = f"HTTP {e.code} {e.reason}"
    except urllib.error.URLError as e:
        why = str(e.reason)
    except (OSError, http.client.HTTPException) as e:  # a timeout, a dropped connection
        why = str(e) or type(e).__name__
    why = " ".join(why.split()) or "no reason given"
    raise RunError(
        f"{name}: cannot download {url} ({why}); copy that file from a machine that can reach it and give "
        f"it with --from FILE"
    )


def fetch_prompt_set(name: str, out: str, copy: str | None = None) -> int:
    """Write prompt set `name` (one of PROMPT_SETS) to `out`, from its pinned URL or from `copy`, a copy of that
    file: the bytes must be the pinned version (git blob id), every row must read as load_prompts reads it and the
    count must be expected_rows(name)'s where known; `out` is written whole (JSONL for a .jsonl set, one row per
    line; else one prompt per line) and the count returned. InputError when the copy or its rows are not those;
    RunError when the download fails."""
    spec = PROMPT_SETS[name]
    if is_jsonl(out) != spec.jsonl:
        kind, want = ("GenEval metadata", "ending in .jsonl") if spec.jsonl else ("text", "not ending in .jsonl")
        raise InputError(f"OUT {out}: {name} is a {kind} file, read by its name; give a path {want}")
    source = f"{spec.repo} at {spec.commit[:7]}, {spec.path}"
    if copy is None:
        where, data = f"{name} {spec.url}", download(spec.url, name)
    else:
        where, path = f"--from {copy}", Path(copy).expanduser()
        if not path.is_file():
            raise InputError(f"{where}: no such file; give a copy of {source}")
        data = path.read_bytes()
    if (blob := git_blob_id(data)) != spec.blob:
        raise InputError(
            f"{where}: git blob {blob}, not the pinned version of {name} ({source}, blob {spec.blob}); give a "
            "copy of that version"
        )
    text = decode(data, where)
    if spec.jsonl:
        rows = metadata_rows(text, where)
        written = "".join(json.dumps(row) + "\n" for row in rows)
    else:
        rows = text_prompts(text.splitlines())
        written = "".join(prompt + "\n" for prompt in rows)
    check_count(name, len(rows), where)
    write_atomically(Path(out), written, "OUT", f"python -m common.prompts {name}")
    return len(rows)


def check_count(name: str, count: int, where: str) -> None:
    """InputError unless `count` rows is what prompt set `name` has (expected_rows; some, where not known)."""
    expected = expected_rows(name)
    if count == 0 or (expected is not None and count != expected):
        raise InputError(f"{where}: {count} rows read, but {name} has {expected or 'some'}; give the whole file")


def evenly_spaced(items: list, n: int) -> list:
    """At most n items, evenly spaced through the list (all of them if there are n or fewer): a fixed subset that
    spans a file sorted by category, as HPDv2's (anime, concept-art, paintings, photo)."""
    return items if len(items) <= n else [items[i * len(items) // n] for i in range(n)]


def draw_prompts(prompts: list[str], n: int, seed: int, iteration: int) -> list[str]:
    """The iteration's n training prompts, the same on every process (keyed on (seed, iteration)): without
    replacement when the prompt list is long enough, else with."""
    gen = keyed_generator(seed, iteration, "prompts")
    if n <= len(prompts):
        pick = torch.randperm(len(prompts), generator=gen)[:n]
    else:
        pick = torch.randint(len(prompts), (n,), generator=gen)
    return [prompts[i] for i in pick.tolist()]


def main(argv: list[str] | None = None) -> None:
    """python -m common.prompts NAME OUT [--from COPY]: write prompt set NAME to OUT (the module's docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m common.prompts",
        description="Fetch one of the papers' prompt sets once into a prompt file (--prompts, --eval-prompts).",
    )
    parser.add_argument("name", metavar="NAME", choices=["hpdv2", *PROMPT_SETS], help="one of %(choices)s")
    parser.add_argument("out", metavar="OUT", help="the file to write (.jsonl for the GenEval sets, else text)")
    parser.add_argument(
        "--from",
        dest="copy",
        metavar="COPY",
        help="read a copy instead of downloading: for hpdv2 a folder holding benchmark/*.json, else the pinned file",
    )
    args = parser.parse_args(argv)
    try:
        if args.name == "hpdv2":
            lines = hpdv2_prompts(args.copy)
            if args.copy is None:  # a folder given with --from may hold a subset
                check_count("hpdv2", len(lines), f"hpdv2 {HPDV2_REPO}")
            write_atomically(Path(args.out), "".join(p + "\n" for p in lines), "OUT", "python -m common.prompts hpdv2")
            count = len(lines)
        else:
            count = fetch_prompt_set(args.name, args.out, args.copy)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"{count} prompts in {args.out}")


if __name__ == "__main__":
    main()
