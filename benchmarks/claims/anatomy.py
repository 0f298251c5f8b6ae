"""What each training script's lines are for: a count by category, read from the scripts' own section banners.

    python benchmarks/claims/anatomy.py                 # the training scripts of this checkout
    python benchmarks/claims/anatomy.py --at REV        # the same at a git revision, e.g. to compare before and after

Categories: header (module docstring and imports), flags (`Args`), algorithm functions (the ALGO LOGIC section),
checks (flag checks and defaults), main's algorithm (SAMPLING, REWARDS & ADVANTAGES, TRAINING), plumbing (SETUP,
MODELS, PROMPTS & REWARDS, OPTIMIZER, RESUME, CHECKPOINT, EVAL, FINAL SAVE, the entry point), logging (LOGGING).
Blank lines count with the section they stand in.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("dancegrpo.py", "branchgrpo.py", "vgrpo.py", "rlr.py", "diffusionnft.py")
COLUMNS = ("header", "flags", "algorithm functions", "checks", "main's algorithm", "plumbing", "logging")
MAIN_SECTIONS = {"SAMPLING": "main's algorithm", "REWARDS & ADVANTAGES": "main's algorithm",
                 "TRAINING": "main's algorithm", "LOGGING": "logging"}  # fmt: skip


def categories(text: str) -> dict[str, int]:
    counts = dict.fromkeys(COLUMNS, 0)
    where = "header"
    for line in text.splitlines():
        banner = re.match(r"\s*# -{20,} ?([A-Z][A-Za-z &,']*)?", line)
        top_banner = re.match(r"# ([A-Z][A-Za-z]+[^\n]*)", line)
        if line.startswith("class Args"):
            where = "flags"
        elif top_banner and "ALGO" in line:
            where = "algorithm functions"
        elif top_banner and ("check" in line.lower() or "default" in line.lower()):
            where = "checks"
        elif line.startswith("def main("):
            where = "plumbing"
        elif line.startswith('if __name__ == "__main__"'):
            where = "plumbing"
        elif banner and banner.group(1) and line.startswith("    "):  # main's phases
            where = MAIN_SECTIONS.get(banner.group(1).strip(), "plumbing")
        counts[where] += 1
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at", help="a git revision (default: the working tree)")
    a = parser.parse_args()
    rows = ["| script | lines | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    for script in SCRIPTS:
        if a.at:
            text = subprocess.run(["git", "show", f"{a.at}:{script}"], cwd=ROOT, capture_output=True, text=True).stdout
        else:
            text = (ROOT / script).read_text()
        c = categories(text)
        rows.append(f"| {script} | {len(text.splitlines())} | " + " | ".join(str(c[k]) for k in COLUMNS) + " |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
