"""What the README and docs/ say about the code, checked against the code, so that a change of the code that makes a
sentence false fails here: every flag they name exists, a default command's iteration count is the script's default,
the README's layout names every file of the library and nothing that is not there, every `bash run.sh RECIPE` is a
recipe of run.sh, and a run folder is named as common/runs.py names it."""

import ast
import dataclasses
import importlib
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# flags of other programs the docs show (ruff, tensorboard, huggingface-cli, slurm) and a fork's example flag
OTHERS = {"--check", "--logdir", "--local-dir", "--requeue", "--signal", "--help"}
FORKS = {"forking.md": {"--nll-coef", "--advantage"}}


def training_scripts() -> list[Path]:
    """The top-level files that define `class Args` and `def main`: found, not listed, so a copy counts too."""
    out = []
    for path in sorted(ROOT.glob("*.py")):
        names = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
        out += [path] if {"Args", "main"} <= names else []
    return out


@cache
def script_args(stem: str):
    return importlib.import_module(stem).Args


@cache
def known_flags() -> frozenset[str]:
    """Every flag of the scripts' Args, of the dataclasses and argparse parsers in common/, benchmarks/ and scripts/,
    and every option run.sh and the shell kits handle."""
    flags = {
        f"--{f.name.replace('_', '-')}" for p in training_scripts() for f in dataclasses.fields(script_args(p.stem))
    }
    for path in [*ROOT.glob("common/**/*.py"), *ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("scripts/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
            if isinstance(node, ast.ClassDef) and node.decorator_list:  # a dataclass parsed by tyro
                flags |= {f"--{b.target.id.replace('_', '-')}" for b in node.body if isinstance(b, ast.AnnAssign)}
    for path in [*ROOT.glob("*.sh"), *ROOT.glob("benchmarks/**/*.sh"), *ROOT.glob("scripts/*.sh")]:
        flags |= set(re.findall(r"--[a-z][a-z0-9-]*", path.read_text()))
    return frozenset(flags)


def test_every_flag_the_docs_name_exists():
    """A `--flag` (with dashes: the official codes' `--flag_names` are theirs) is one this repository parses; tyro's
    `--no-X` of a boolean `--X` too."""
    wrong = []
    for path in DOCS:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]", line):
                base = flag.replace("--no-", "--", 1)
                if "_" in flag or {flag, base} & (known_flags() | OTHERS | FORKS.get(path.name, set())):
                    continue
                wrong.append(f"{path.relative_to(ROOT)}:{i}: {flag}")
    assert not wrong, "flags that no program here parses: " + "; ".join(wrong)


DEFAULT_COMMAND = re.compile(r"python (?P<script>\w+)\.py(?P<flags>[^#`\n]*)#(?P<comment>[^\n]*)")


def test_a_default_command_learns_in_the_scripts_default_iterations():
    """`python vgrpo.py   # ... in 30 iterations`: a command without --iterations runs the script's default."""
    stems, checked = {p.stem for p in training_scripts()}, 0
    for path in [*DOCS, *training_scripts()]:
        for m in DEFAULT_COMMAND.finditer(path.read_text()):
            said = re.search(r"\b(\d+) iterations\b", m["comment"])
            if m["script"] in stems and said and "--iterations" not in m["flags"]:
                assert int(said[1]) == script_args(m["script"]).iterations, f"{path.name}: {m[0].strip()}"
                checked += 1
    assert checked >= 1


def layout_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout") :]
    return section[: section.index("\n## ", 1)]


def test_the_readme_layout_names_every_file_of_the_library_and_only_what_is_there():
    """Every training script, every module of common/ (its sub-packages' files too), the benchmarks' folders; and
    every file or folder the layout names exists."""
    block = layout_block()
    named = set(re.findall(r"[\w./-]+", block))
    needed = [p.name for p in training_scripts()]
    needed += [p.name for p in (ROOT / "common").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    needed += [f"{p.name}/" for p in sorted((ROOT / "benchmarks").iterdir()) if p.is_dir() and p.name[0] != "_"]
    needed += [
        f"{p.name}/" for p in sorted(ROOT.iterdir()) if p.is_dir() and p.name[0] not in "._" and p.name != "runs"
    ]
    missing = [n for n in needed if n not in named and not any(w.endswith("/" + n) for w in named)]
    assert not missing, f"README's layout does not name {missing}"
    files = {p.name for p in ROOT.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts}
    absent = [w for w in named if re.fullmatch(r"[\w/-]+\.(py|sh|md|json|txt)", w) and w.split("/")[-1] not in files]
    assert not absent, f"README's layout names files that do not exist: {absent}"


@cache
def recipes() -> frozenset[str]:
    out = subprocess.run(["bash", "run.sh", "--list"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return frozenset(out.split())


def test_every_recipe_the_docs_and_scripts_name_is_a_recipe_of_run_sh():
    """`bash run.sh NAME` and `--print NAME` anywhere; the README's table of 8-GPU recipes (`dancegrpo-` `flux`,
    `sd35` -> dancegrpo-flux-8gpu, dancegrpo-sd35-8gpu)."""
    wrong, named = [], 0
    for path in [*DOCS, *training_scripts()]:
        text = path.read_text()
        for name in re.findall(r"run\.sh (?:--print )?([a-z][a-z0-9-]+)", text):
            if name != "has":  # "run.sh has more"
                named += 1
                wrong += [f"{path.name}: {name}"] if name not in recipes() else []
    assert named >= 20 and not wrong, f"not recipes of run.sh: {wrong}"
    table = (ROOT / "README.md").read_text().split("| script | recipes on 8 GPUs")[1].split("\n\n")[0]
    for row in table.splitlines()[2:]:
        cell = row.split("|")[2]
        for group in cell.split(";"):
            words = re.findall(r"`([a-z0-9-]+)`", group)
            prefix = words[0] if words and words[0].endswith("-") else ""
            for word in words[1:] if prefix else words:
                name = prefix + word
                if not name.endswith(("-8gpu", "-fsdp8")):
                    name += "-8gpu"
                assert name in recipes(), f"README's recipe table: {name} is not a recipe of run.sh"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_a_run_folder_is_named_as_runs_names_it(path):
    """common/runs.py writes {output_dir}/{exp_name}__{seed}__{unix time}: a doc that names the run folder by its
    flags or fields says so, and `runs/NAME__...` starts with an experiment name a script or a documented fork gives."""
    text = path.read_text()
    for m in re.finditer(r"\{-*output[-_]dir\}/([^`\s]*)", text):
        assert re.match(r"\{-*exp[-_]name\}__\{-*seed\}__", m[1]), f"{path.name}: run folder {m[0]}"
    stems = tuple(p.stem for p in training_scripts())
    for name in re.findall(r"runs/(\w+?)__", text):
        assert name.startswith(stems) or path.name == "forking.md", f"{path.name}: runs/{name}__ is no script's run"


def default_rows():
    """(doc, flags, values) per row of a table headed `| flag | ShapesBench default | ...` in docs/<script>.md."""
    for path in sorted((ROOT / "docs").glob("*.md")):
        rows, inside = [], False
        for line in path.read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
            inside = bool(cells) and (inside or cells[:2] == ["flag", "ShapesBench default"])
            if inside and cells[0].startswith("`--"):
                rows.append((path, re.findall(r"`(--[a-z-]+)`", cells[0]), cells[1].split(", ")))
        yield from rows


def test_the_defaults_a_doc_tabulates_are_the_scripts():
    """Each value a `ShapesBench default` column gives (a number, a choice, on / off) is the default of its flag in
    the script the doc is named after (a mode's default as the script fills it in)."""
    checked = 0
    for path, flags, values in default_rows():
        assert len(flags) == len(values), f"{path.name}: {flags} against {values}"
        args = script_args(path.stem)()
        importlib.import_module(path.stem).resolve_and_check(args)  # the mode's defaults filled in, as main() does
        for flag, value in zip(flags, values):
            default = getattr(args, flag[2:].replace("-", "_"))
            number = re.search(r"-?\d+(\.\d+)?(e-?\d+)?", value)
            if isinstance(default, bool):
                said = {"on": True, "off": False}.get(value.split(":")[0].split()[0].strip("`"))
                if said is None:
                    continue
                assert said == default, f"{path.name}: {flag} {value}, but the default is {default}"
            elif isinstance(default, (int, float)) and number:
                assert float(number[0]) == default, f"{path.name}: {flag} {value}, but the default is {default}"
            else:
                assert re.match(rf"`?{re.escape(str(default))}\b", value), f"{path.name}: {flag} {value} != {default}"
            checked += 1
    assert checked >= 20, checked
