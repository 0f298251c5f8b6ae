"""How long `--help` takes beyond `import torch, diffusers`: the start-up that the repository's own imports add.

    .venv/bin/python benchmarks/testing/startup.py                      # this working tree
    .venv/bin/python benchmarks/testing/startup.py --root /tmp/old     # another checkout, e.g. `git archive` of a commit

For each algorithm script (the top-level files with `class Args` and `def main`) and `python -m common.evaluate`, it
runs `python -c "import torch, diffusers"` and `python <script>.py --help` back to back, --pairs times (default 5),
alternating, so that both see the same load; and prints a markdown table of the medians: wall seconds and CPU seconds
(user + sys of the child, less sensitive to other work on the machine), each with the difference. The goal is a
difference within 1.5 s on an idle machine. tests/test_startup.py checks, without timing, that --help imports none of
the heavy libraries.
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASELINE = ["-c", "import torch, diffusers"]


def algorithm_scripts(root: Path) -> list[str]:
    """The top-level files of `root` that define `class Args` and `def main`."""
    found = []
    for path in sorted(root.glob("*.py")):
        body = ast.parse(path.read_text()).body
        names = {(type(n), n.name) for n in body if isinstance(n, ast.ClassDef | ast.FunctionDef)}
        if {(ast.ClassDef, "Args"), (ast.FunctionDef, "main")} <= names:
            found.append(path.name)
    return found


def timed(args: list[str], root: Path) -> tuple[float, float]:
    """(wall seconds, user + sys CPU seconds) of `python *args` in `root`, its output discarded."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, *args], cwd=root, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"python {' '.join(args)} exited with {child.returncode}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose scripts run (default: this one)")
    parser.add_argument("--pairs", type=int, default=5, help="alternating (baseline, command) pairs per command")
    args = parser.parse_args()
    root = args.root.resolve()
    commands = [[script, "--help"] for script in algorithm_scripts(root)] + [["-m", "common.evaluate", "--help"]]
    print(f"{sys.executable}, {root}, {args.pairs} pairs; load average {os.getloadavg()[0]:.1f} at the start\n")
    print(
        "| command | wall: baseline | wall: command | wall: difference | CPU: baseline | CPU: command | CPU: difference |"
    )
    print("|---|---|---|---|---|---|---|")
    for command in commands:
        base, own = [], []
        for _ in range(args.pairs):
            base.append(timed(BASELINE, root))
            own.append(timed(command, root))
        (bw, bc), (ow, oc) = ([statistics.median(t[i] for t in runs) for i in (0, 1)] for runs in (base, own))
        name = "python " + " ".join(command)
        print(f"| `{name}` | {bw:.2f} | {ow:.2f} | {ow - bw:+.2f} | {bc:.2f} | {oc:.2f} | {oc - bc:+.2f} |", flush=True)
    print(f"\nbaseline: python {' '.join(BASELINE)}; load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
