"""Prompt sources: the ShapesBench splits, a text file with one prompt per line (e.g. HPDv2 prompts), or a
diffusion chain-of-thought file (rlr.py --dcot-prompts).

HPDv2's 3200 benchmark prompts (the test prompts of the papers' HPSv2.1 evaluations: 800 each of anime, concept-art,
paintings and photo, from the Hugging Face dataset zhwang/HPDv2, files benchmark/*.json) as a prompt file, on a
machine that reaches the hub:
    python -m common.prompts hpdv2 prompts/hpdv2_test.txt
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from huggingface_hub import hf_hub_download

from common import InputError
from common.sampling import keyed_generator
from common.shapesbench import split_prompts

SOURCES = {"shapes-train": "train", "shapes-eval": "eval"}
HPDV2_REPO, HPDV2_STYLES = "zhwang/HPDv2", ("anime", "concept-art", "paintings", "photo")
HPDV2_HOWTO = (
    "HPDv2's 3200 test prompts, from the Hugging Face dataset zhwang/HPDv2 (benchmark/*.json), are written to one "
    "by `python -m common.prompts hpdv2 prompts/hpdv2_test.txt`"
)


def load_prompts(source: str, flag: str = "--prompts") -> list[str]:
    """`source` is 'shapes-train', 'shapes-eval' or a path to a UTF-8 text file, one prompt per line.

    Blank lines and lines starting with '#' are skipped. `flag` names the CLI option in error messages.
    """
    if source in SOURCES:
        return split_prompts(SOURCES[source])
    path = Path(source).expanduser()
    if not path.is_file():
        raise InputError(
            f"{flag} {source!r}: no such file; give one of {sorted(SOURCES)} or a text file with one prompt per line"
        )
    prompts = [line.strip() for line in read_lines(path, f"{flag} {source!r}")]
    prompts = [p for p in prompts if p and not p.startswith("#")]
    if not prompts:
        raise InputError(f"{flag} {source!r}: the file holds no prompts (one prompt per line; '#' starts a comment)")
    return prompts


def read_lines(path: Path, where: str) -> list[str]:
    """The lines of a UTF-8 text file; `where` (the flag and the value) starts the error message."""
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None


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


if __name__ == "__main__":
    # python -m common.prompts hpdv2 OUT.txt [--from FOLDER]: HPDv2's benchmark prompts, one per line
    argv = sys.argv[1:]
    if len(argv) not in (2, 4) or argv[0] != "hpdv2" or (len(argv) == 4 and argv[2] != "--from"):
        sys.exit("usage: python -m common.prompts hpdv2 OUT.txt [--from FOLDER with benchmark/*.json]")
    lines = hpdv2_prompts(argv[3] if len(argv) == 4 else None)
    Path(argv[1]).parent.mkdir(parents=True, exist_ok=True)
    Path(argv[1]).write_text("".join(p + "\n" for p in lines), encoding="utf-8")
    print(f"{len(lines)} prompts in {argv[1]}")
