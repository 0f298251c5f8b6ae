"""Prompt sources: the ShapesBench splits, or a text file with one prompt per line (e.g. HPDv2 prompts)."""

from __future__ import annotations

from pathlib import Path

from common import InputError

SOURCES = {"shapes-train": "train", "shapes-eval": "eval"}


def load_prompts(source: str, flag: str = "--prompts") -> list[str]:
    """`source` is 'shapes-train', 'shapes-eval' or a path to a UTF-8 text file, one prompt per line.

    Blank lines and lines starting with '#' are skipped. `flag` names the CLI option in error messages.
    """
    if source in SOURCES:
        from common.shapesbench import split_prompts

        return split_prompts(SOURCES[source])
    path = Path(source).expanduser()
    if not path.is_file():
        raise InputError(
            f"{flag} {source!r}: no such file; give one of {sorted(SOURCES)} or a text file with one prompt per line"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{flag} {source!r}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
    prompts = [line.strip() for line in text.splitlines()]
    prompts = [p for p in prompts if p and not p.startswith("#")]
    if not prompts:
        raise InputError(f"{flag} {source!r}: the file holds no prompts (one prompt per line; '#' starts a comment)")
    return prompts
