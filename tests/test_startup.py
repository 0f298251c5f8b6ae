"""Start-up stays cheap: `python <script>.py --help` (and `python -m common.evaluate --help`) imports none of the
libraries that only a model, a reward or a run's logs need. They are imported where they are used (common/'s house
style: a local import marked `# heavy`, or common.models' WRAPPERS), and one top-level import of them brings seconds
back to every start and every test that imports a script. No timing here (it would be flaky):
benchmarks/testing/startup.py measures the seconds."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import common.models

ROOT = Path(__file__).resolve().parents[1]
# imported once a model, a reward or a run's logs need them, never by --help
HEAVY = (
    "transformers", "tokenizers", "peft", "open_clip", "timm", "torchvision", "matplotlib", "tensorboard", "wandb",
    "diffusers.models", "diffusers.pipelines", "diffusers.loaders", "common.hpsv3",
    *sorted({f"common.models.{family}" for family in common.models.WRAPPERS.values()}),
)  # fmt: skip


def algorithm_scripts() -> list[str]:
    """The repository's algorithm scripts: the top-level files that define `class Args` and `def main`."""
    found = []
    for path in sorted(ROOT.glob("*.py")):
        names = {
            (type(n), n.name) for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef | ast.FunctionDef)
        }
        if {(ast.ClassDef, "Args"), (ast.FunctionDef, "main")} <= names:
            found.append(path.name)
    return found


# Runs each target's `--help` in turn in one fresh interpreter, as the command line would (runpy, as __main__), and
# prints, per target, the heavy modules that were not imported before it ran: one interpreter, so torch and diffusers
# are imported once for all of them.
PROBE = """
import contextlib, io, json, runpy, sys
targets, heavy = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def imported():
    return {h for h in heavy if any(m == h or m.startswith(h + ".") for m in sys.modules)}
report = {}
for target in targets:
    before, out = imported(), io.StringIO()
    sys.argv = [target, "--help"]
    try:
        with contextlib.redirect_stdout(out):
            if target.endswith(".py"):
                runpy.run_path(target, run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        assert e.code in (0, None), (target, e.code)
    report[target] = {"usage": "usage:" in out.getvalue(), "heavy": sorted(imported() - before)}
print(json.dumps(report))
"""
TARGETS = [*algorithm_scripts(), "common.evaluate"]


@pytest.fixture(scope="module")
def help_imports() -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", PROBE, json.dumps(TARGETS), json.dumps(HEAVY)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("target", TARGETS)
def test_help_imports_no_heavy_library(help_imports, target):
    assert help_imports[target]["usage"], f"`{target} --help` printed no usage"
    heavy = help_imports[target]["heavy"]
    assert not heavy, f"`{target} --help` imports {heavy}: import them where they are used"


def test_the_scripts_are_found():
    assert len(algorithm_scripts()) >= 5, algorithm_scripts()


def test_the_registry_names_each_kind_as_its_class_does():
    """REGISTRY gives each kind's name without importing its module (the checks of --model-id read only names): the
    name must be the class's own `kind`, and every WRAPPERS entry must be a class of its module."""
    for entry in common.models.REGISTRY:
        assert entry.cls.kind == entry.name, (entry.cls, entry.name)
    for name, family in common.models.WRAPPERS.items():
        cls = getattr(common.models, name)
        assert isinstance(cls, type) and cls.__module__ == f"common.models.{family}", (name, cls)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchModel'"):
        common.models.NoSuchModel  # noqa: B018
