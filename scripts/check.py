"""The repository's own bookkeeping, which a fork may drop: what an edit of one script makes stale elsewhere in this
repository, and what its maintainers keep in step by hand. `.ci/run` runs it after ruff and before the test suite;
a fork that edits a script in place (and keeps its behaviour under test, as tests/ checks) can delete this file.

    .venv/bin/python scripts/check.py        # one line per problem, exit status 1 if there is one

It checks:
  - every function marked `# same as in X.py` is X.py's function of that name, character for character (a fork
    that changes such a copy deletes its marker), and no other line carries the marker;
  - every hand-written mutant of benchmarks/testing/mutants.py finds the text it mutates exactly once in its file
    (the benchmark reports the others as STALE only when it runs), and there are at least 70;
  - benchmarks/testing/mutation.py mutates a marked copy in its original only (rlr.py's copy of dancegrpo.py's
    sde_step is left out, dancegrpo.py's own is in), and each of its targets names test files that exist and keeps
    at least 10 in-process tests to run;
  - wherever a doc, a docstring or a comment says "N scripts" (N a number or a number word), N is the number of
    training scripts (the top-level files that define `class Args` and `def main`).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"\s*# same as in (\w+\.py)$", re.M)
NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()
SCRIPT_COUNT = re.compile(
    r"\b(" + "|".join(NUMBER_WORDS) + r"|\d+)\s+(?:algorithm\s+|training\s+|top-level\s+)?scripts\b", re.IGNORECASE
)


def python_files() -> list[Path]:
    return [*sorted(ROOT.glob("*.py")), *sorted((ROOT / "common").rglob("*.py"))]


def training_scripts() -> list[str]:
    """The top-level files that define `class Args` and `def main` at module level, sorted."""
    found = []
    for path in sorted(ROOT.glob("*.py")):
        body = ast.parse(path.read_bytes()).body
        if {"Args"} <= {n.name for n in body if isinstance(n, ast.ClassDef)} and "main" in {
            n.name for n in body if isinstance(n, ast.FunctionDef)
        }:
            found.append(path.name)
    return found


def function_source(path: Path, name: str) -> str | None:
    """The module-level function `name` of `path`, its marker taken out; None if there is none."""
    text = path.read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return MARKER.sub("", ast.get_source_segment(text, node))
    return None


def marked_copies() -> list[str]:
    problems, copies = [], 0
    for path in python_files():
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and (m := MARKER.search(lines[node.lineno - 1])):
                copies += 1
                original = ROOT / m[1]
                mine = MARKER.sub("", ast.get_source_segment(text, node))
                if not original.is_file() or mine != function_source(original, node.name):
                    problems.append(f"{path.relative_to(ROOT)}: {node.name} differs from {m[1]}'s (`# same as in`)")
        for n, line in enumerate(lines, 1):  # a marker the check above does not see
            if "# same as in" in line and "`# same as in" not in line:  # a marker, not a mention of one
                if not (line.lstrip().startswith("def ") and MARKER.search(line)):
                    problems.append(f"{path.relative_to(ROOT)}:{n}: `# same as in` marks no function")
    if copies < 9:  # the schedule, the noise coefficient, the SDE step, the loss, ... in three scripts
        problems.append(f"only {copies} functions marked `# same as in X.py`: the check no longer sees them")
    return problems


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def hand_written_mutants() -> list[str]:
    mutants = load(ROOT / "benchmarks" / "testing" / "mutants.py", "mutants")
    problems = [
        f"benchmarks/testing/mutants.py: mutant {n} ({f}) does not find its text exactly once: {old!r}"
        for n, (f, old, *_) in enumerate(mutants.MUTANTS, 1)
        if (ROOT / f).read_text().count(old) != 1
    ]
    if len(mutants.MUTANTS) < 70:
        problems.append(f"benchmarks/testing/mutants.py: {len(mutants.MUTANTS)} mutants, fewer than 70")
    return problems


def generated_mutants() -> list[str]:
    mutation = load(ROOT / "benchmarks" / "testing" / "mutation.py", "mutation")
    problems = []
    rlr = mutation.mutated_names((ROOT / "rlr.py").read_text(), "above_main")
    dance = mutation.mutated_names((ROOT / "dancegrpo.py").read_text(), "above_main")
    if "x_sde_step" in rlr or "x_term_weights" not in rlr or "x_sde_step" not in dance:
        problems.append("benchmarks/testing/mutation.py: a marked copy is mutated outside its original (or not at all)")
    for key, target in mutation.TARGETS.items():
        try:
            n = len(mutation.in_process_tests(ROOT, target["tests"]))
        except SystemExit as e:  # a test file that is not there
            problems.append(f"benchmarks/testing/mutation.py: target {key}: {e}")
            continue
        if n < 10:
            problems.append(f"benchmarks/testing/mutation.py: target {key} keeps {n} in-process tests, fewer than 10")
    try:
        mutation.in_process_tests(ROOT, ["tests/test_server.py", "tests/test_renamed.py"])
        problems.append("benchmarks/testing/mutation.py: a missing test file does not stop the run")
    except SystemExit as e:
        if "no test file matches tests/test_renamed.py" not in str(e):
            problems.append(f"benchmarks/testing/mutation.py: a missing test file stops the run with {e}")
    return problems


def script_counts() -> list[str]:
    count = len(training_scripts())
    files = [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("*.py"), *ROOT.glob("*.sh")]
    files += [*ROOT.glob("common/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/**/*.py")]
    files += [*ROOT.glob("scripts/*.py"), *ROOT.glob("scripts/*.sh")]
    problems = []
    for path in sorted(set(files)):
        if path.resolve() == Path(__file__).resolve():
            continue
        for i, text in enumerate(path.read_text().splitlines(), 1):
            for m in SCRIPT_COUNT.finditer(text):
                n = m.group(1).lower()
                if (int(n) if n.isdigit() else NUMBER_WORDS.index(n)) != count:
                    problems.append(f"{path.relative_to(ROOT)}:{i}: '{m.group(0)}', and there are {count} scripts")
    return problems


def main() -> int:
    problems = marked_copies() + hand_written_mutants() + generated_mutants() + script_counts()
    for line in problems:
        print(line)
    print(f"scripts/check.py: {len(problems)} problems" if problems else "scripts/check.py: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
