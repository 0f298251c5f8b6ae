"""The repository's shape: common/ in layers with no import cycle and no import of a training script (the scripts
found as tests.helpers.algorithm_scripts finds them, so a fork's own script counts). The repository's own bookkeeping
that a fork may drop (the blocks marked `# same as in X.py`, the hand-written mutants, the count of scripts the docs
name) is scripts/check.py's, run by .ci/run."""

import ast
from pathlib import Path

from tests.helpers import ROOT, algorithm_scripts

SCRIPTS = tuple(name.removesuffix(".py") for name in algorithm_scripts())
# common/'s layers, lowest first (common/__init__.py's docstring): a module imports only from its own layer or lower
LAYERS = {
    "common": 0,
    "common.cli": 1,
    "common.offload": 1,
    "common.remote": 1,
    "common.viz": 1,
    "common.signals": 1,
    "common.logs": 2,
    "common.sampling": 2,
    "common.edits": 2,
    "common.shapesbench": 3,
    "common.models": 4,
    "common.rewards": 4,
    "common.prompts": 4,
    "common.flags": 5,
    "common.checkpoints": 5,
    "common.evaluator": 5,
    "common.runs": 6,
}
TOOLS = tuple(
    f"common.shapesbench.{m}" for m in ("__main__", "train_reward", "train_vae", "train_latent", "train_edit")
)
TOOLS += ("common.evaluate",)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    while module not in LAYERS:
        module = module.rpartition(".")[0]
    return LAYERS[module]


def imports(path: Path, modules=()) -> set[str]:
    """Every module `path` imports, at the top or inside a function; `from P import m` counts as importing P.m alone
    when P.m is one of `modules`."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
            out |= subs if len(subs) == len(node.names) else {node.module, *subs}
    return out


def test_common_is_layered_without_cycles_or_script_imports():
    files = {module_name(p): p for p in (ROOT / "common").rglob("*.py")}
    graph = {m: {i for i in imports(p, files) if i in files} - {m} for m, p in files.items()}
    for module, deps in graph.items():
        outside = {i.split(".")[0] for i in imports(files[module])} & {*SCRIPTS, "benchmarks", "tests"}
        assert not outside, f"{module} imports {outside}: common/ must not depend on a script"
        for dep in deps if module not in TOOLS else ():  # the tools sit on top: they may import anything in common/
            assert dep not in TOOLS, f"{module} imports the command-line tool {dep}"
            assert layer(dep) <= layer(module), f"{module} (layer {layer(module)}) imports {dep} ({layer(dep)})"
    seen, stack = set(), []

    def visit(m):  # depth-first search for a cycle
        assert m not in stack, f"import cycle: {' -> '.join(stack[stack.index(m) :] + [m])}"
        if m in seen:
            return
        stack.append(m)
        for dep in graph[m]:
            visit(dep)
        stack.pop()
        seen.add(m)

    for m in graph:
        visit(m)
