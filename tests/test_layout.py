"""The repository's shape: common/ in layers with no import cycle and no import of a script; every block marked
`# same as in X.py` identical to X's."""

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("dancegrpo", "branchgrpo", "vgrpo", "rlr", "diffusionnft")
# common/'s layers, lowest first (common/__init__.py's docstring): a module imports only from its own layer or lower
LAYERS = {
    "common": 0,
    "common.offload": 1,
    "common.remote": 1,
    "common.viz": 1,
    "common.signals": 1,
    "common.logs": 2,
    "common.sampling": 2,
    "common.shapesbench": 3,
    "common.models": 4,
    "common.rewards": 4,
    "common.prompts": 4,
    "common.flags": 5,
    "common.checkpoints": 5,
    "common.evaluator": 5,
    "common.runs": 6,
}
TOOLS = tuple(f"common.shapesbench.{m}" for m in ("__main__", "train_reward", "train_vae", "train_latent"))
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


MARKER = re.compile(r"\s*# same as in (\w+\.py)$", re.M)


def marked_copies():
    """(file, function name, its source without the marker, the source file named by the marker) per marked def."""
    for path in [*ROOT.glob("*.py"), *(ROOT / "common").rglob("*.py")]:
        text = path.read_text()
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef):
                first = text.splitlines()[node.lineno - 1]
                if m := MARKER.search(first):
                    yield path, node.name, MARKER.sub("", ast.get_source_segment(text, node)), ROOT / m[1]


def function_source(path: Path, name: str) -> str:
    text = path.read_text()
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return MARKER.sub("", ast.get_source_segment(text, node))


def test_blocks_marked_same_as_in_are_the_same():
    copies = list(marked_copies())
    assert len(copies) >= 9  # the schedule, the noise coefficient, the SDE step, the loss, ... in three scripts
    for path, name, source, original in copies:
        assert source == function_source(original, name), f"{path.name}: {name} differs from {original.name}'s"
    for path in [*ROOT.glob("*.py"), *(ROOT / "common").rglob("*.py")]:  # no marker the test above does not check
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "# same as in" in line and "`# same as in" not in line:  # a marker, not a mention of one
                assert line.lstrip().startswith("def ") and MARKER.search(line), f"{path.name}:{n} marks no function"


NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve").split()
SCRIPT_COUNT = re.compile(
    r"\b(" + "|".join(NUMBER_WORDS) + r"|\d+)\s+(?:algorithm\s+|training\s+|top-level\s+)?scripts\b", re.IGNORECASE
)


def test_no_text_names_another_count_of_the_algorithm_scripts():
    """The repository's algorithm scripts are the top-level files with an Args and a main(); wherever a doc, a
    docstring or a comment says 'N scripts' (N a number or a number word), N is their count: a sixth script makes
    every stale 'five scripts' fail here."""
    scripts = [
        p.name
        for p in sorted(ROOT.glob("*.py"))
        if "\nclass Args(" in (text := p.read_text()) and "\ndef main(" in text
    ]
    assert scripts == ["branchgrpo.py", "dancegrpo.py", "diffusionnft.py", "rlr.py", "vgrpo.py"]
    files = [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("*.py"), *ROOT.glob("*.sh")]
    files += [*ROOT.glob("common/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py")]
    wrong = []
    for path in files:
        for i, text in enumerate(path.read_text().splitlines(), 1):
            for m in SCRIPT_COUNT.finditer(text):
                n = m.group(1).lower()
                count = int(n) if n.isdigit() else NUMBER_WORDS.index(n)
                if count != len(scripts) and path.name != "test_layout.py":
                    wrong.append(f"{path.relative_to(ROOT)}:{i}: '{m.group(0)}'")
    assert not wrong, f"{len(scripts)} algorithm scripts, but: " + "; ".join(wrong)


def test_every_hand_written_mutant_still_finds_its_line():
    """benchmarks/mutants.py reports a mutant whose text is not in its file exactly once as STALE, only when it runs
    (a benchmark, not CI): a change of the code it targets must update the mutant in the same commit."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutants", ROOT / "benchmarks" / "mutants.py")
    mutants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutants)
    stale = [(n, f, old) for n, (f, old, *_) in enumerate(mutants.MUTANTS, 1) if (ROOT / f).read_text().count(old) != 1]
    assert not stale and len(mutants.MUTANTS) >= 70, stale


def test_the_generated_mutants_leave_marked_copies_to_their_original():
    """benchmarks/mutation.py mutates a function marked `# same as in X.py` in X.py only: rlr.py's copy of
    dancegrpo.py's sde_step is left out, dancegrpo.py's own is in."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import mutation

    rlr = mutation.mutated_names((ROOT / "rlr.py").read_text(), "above_main")
    dance = mutation.mutated_names((ROOT / "dancegrpo.py").read_text(), "above_main")
    assert "x_sde_step" not in rlr and "x_term_weights" in rlr and "x_sde_step" in dance


def test_every_mutation_target_names_test_files_that_exist_and_run_in_process():
    """Each target of benchmarks/mutation.py runs against test files that are there (a renamed one stops the run
    instead of scoring its file without it) and keeps in-process tests to run."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import mutation

    counts = {key: len(mutation.in_process_tests(ROOT, t["tests"])) for key, t in mutation.TARGETS.items()}
    assert min(counts.values()) >= 10, counts
    with pytest.raises(SystemExit, match="no test file matches tests/test_renamed.py"):
        mutation.in_process_tests(ROOT, ["tests/test_server.py", "tests/test_renamed.py"])
