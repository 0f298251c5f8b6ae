"""docs/testing.md's "Flag inventory" covers every flag: each field of the training scripts' Args (the shared RunArgs
fields once, as `shared`), of common.evaluate's EvalArgs and each option of `python -m common.rewards serve` has a
row, every row names a flag that exists, and every test a row names is defined in the file it names; a row without
a test gives its reason. A new flag without a row fails here."""

import argparse
import ast
import dataclasses
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "testing.md"
SECTION = "## Flag inventory"
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
SCRIPTS = ("dancegrpo", "branchgrpo", "vgrpo", "rlr", "diffusionnft")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def dataclass_flags(script: str, cls, shared: set[str] = frozenset()) -> set[tuple[str, str]]:
    """(script, --flag) per field of the dataclass `cls`, leaving out the `shared` fields (listed once as shared)."""
    return {(script, flag(f.name)) for f in dataclasses.fields(cls) if f.name not in shared}


def serve_options() -> set[str]:
    """The long options of `python -m common.rewards serve`, read from the parser serve_main builds (stopped at
    parse_args, before anything loads)."""
    from common import rewards

    class Built(Exception):
        pass

    def capture(self, *a, **kw):
        raise Built(self)

    saved = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture
    try:
        rewards.serve_main(["serve"])
    except Built as e:
        parser = e.args[0]
    else:
        pytest.fail("serve_main built no parser")
    finally:
        argparse.ArgumentParser.parse_args = saved
    return {
        max(a.option_strings, key=len) for a in parser._actions if a.option_strings and "--help" not in a.option_strings
    }


def all_flags() -> set[tuple[str, str]]:
    """Every (script, --flag) the inventory must list."""
    import importlib

    from common.evaluate import EvalArgs
    from common.flags import RunArgs

    shared = {f.name for f in dataclasses.fields(RunArgs)}
    flags = dataclass_flags("shared", RunArgs)
    for script in SCRIPTS:
        flags |= dataclass_flags(script, importlib.import_module(script).Args, shared)
    flags |= dataclass_flags("evaluate", EvalArgs)
    flags |= {("serve", option) for option in serve_options()}
    return flags


def read_table(text: str) -> list[tuple[str, str, str]]:
    """(script, --flag, cell) per row of the Flag inventory section's table."""
    assert SECTION in text, f"docs/testing.md has no '{SECTION}' section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 3 or cells[0] in ("script", "---"):
            continue
        rows.append((cells[0], cells[1].strip("`"), cells[2]))
    return rows


@cache
def functions_in(path: str) -> frozenset[str]:
    """The names of the functions defined in a test file (ast: nothing is imported or run)."""
    file = ROOT / path
    if not file.is_file():
        return frozenset()
    tree = ast.parse(file.read_text())
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def check_inventory(flags: set[tuple[str, str]], rows: list[tuple[str, str, str]]) -> list[str]:
    """What is wrong with the table `rows` for the flags `flags`: a flag without a row, a row twice, a row whose flag
    does not exist, a named test that is not defined, a row with neither a test nor a reason."""
    problems = []
    seen = [(script, name) for script, name, _ in rows]
    problems += [f"{s} {f}: no row in docs/testing.md's {SECTION}" for s, f in sorted(flags - set(seen))]
    problems += [f"{s} {f}: a row, but no such flag" for s, f in sorted(set(seen) - flags)]
    problems += [f"{s} {f}: more than one row" for s, f in sorted({k for k in seen if seen.count(k) > 1})]
    for script, name, cell in rows:
        refs = TEST_REF.findall(cell)
        if not refs and not (cell.startswith("Reason:") and len(cell) > len("Reason:") + 20):
            problems.append(f"{script} {name}: neither a test (`tests/FILE.py::TEST`) nor 'Reason: ...'")
        for path, test in refs:
            if test not in functions_in(path):
                problems.append(f"{script} {name}: {path} defines no {test}")
    return problems


def passed_by_name(source: str) -> dict[str, str]:
    """{keyword-only parameter: its function} for each function the script `source` calls as
    `fn(..., **flags_of(fn, args))`: main() passes those flags by name, so each is a field of Args of the same name."""
    tree = ast.parse(source)
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    out = {}
    for node in ast.walk(tree):
        for kw in getattr(node, "keywords", []) if isinstance(node, ast.Call) else []:
            value = kw.value
            if kw.arg is None and isinstance(value, ast.Call) and getattr(value.func, "id", None) == "flags_of":
                fn = value.args[0].id
                out |= {a.arg: fn for a in defs[fn].args.kwonlyargs}
    return out


def keywords_tested(test_sources: dict[str, str]) -> dict[tuple[str, str, str], list[tuple]]:
    """{(module, function, keyword): [(value, test file, test), ...]} for every call `M.function(..., keyword=CONSTANT)`
    (M a module the file imports, under its name or an alias) or `function(..., keyword=CONSTANT)` (imported from
    its module) inside a test function of `test_sources` (path -> text), the value read with ast.literal_eval: where a
    test calls a script's function with the flag's keyword at a value it chose."""
    out = {}
    for path, text in sorted(test_sources.items()):
        tree, names = ast.parse(text), {}  # local name -> (module, None) or (module, function)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {a.asname or a.name: (a.name, None) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names |= {a.asname or a.name: (node.module, a.name) for a in node.names}
        for test in tree.body:
            if not (isinstance(test, ast.FunctionDef) and test.name.startswith("test_")):
                continue
            for node in ast.walk(test):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in names:
                    where = (names[f.value.id][0], f.attr)
                elif isinstance(f, ast.Name) and names.get(f.id, (None, None))[1]:
                    where = names[f.id]
                else:
                    continue
                for kw in node.keywords:
                    try:
                        value = ast.literal_eval(kw.value)
                    except ValueError:
                        continue
                    out.setdefault((*where, kw.arg), []).append((value, path, test.name))
    return out


def derived_rows(scripts: dict[str, str], defaults: dict[str, dict], test_sources: dict[str, str]) -> list:
    """The rows the inventory derives instead of a hand-written one: a flag main() passes by name to a function
    (passed_by_name) that a test calls with that keyword at a value other than the flag's default (keywords_tested).
    scripts: module name -> source; defaults: module name -> {field: default}."""
    tested, rows = keywords_tested(test_sources), []
    for script, source in scripts.items():
        for name, fn in passed_by_name(source).items():
            calls = tested.get((script, fn, name), [])
            chosen = [(path, test) for value, path, test in calls if value != defaults[script][name]]
            if chosen:
                rows.append((script, flag(name), f"`{chosen[0][0]}::{chosen[0][1]}` (derived: {fn}({name}=...))"))
    return rows


def repository_rows() -> list[tuple[str, str, str]]:
    """The table's rows, and a derived row for each flag without one."""
    import importlib

    rows = read_table(DOC.read_text())
    listed = {(s, f) for s, f, _ in rows}
    scripts = {s: (ROOT / f"{s}.py").read_text() for s in SCRIPTS}
    defaults = {s: {f.name: f.default for f in dataclasses.fields(importlib.import_module(s).Args)} for s in SCRIPTS}
    tests = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "tests").glob("test_*.py"))}
    return rows + [r for r in derived_rows(scripts, defaults, tests) if r[:2] not in listed]


def test_every_flag_has_a_row_and_every_row_a_flag_and_existing_tests():
    problems = check_inventory(all_flags(), repository_rows())
    assert not problems, "\n".join(problems)


def test_a_flag_passed_by_name_and_called_at_a_chosen_value_in_a_test_needs_no_row():
    """A fork's new advantage flag: a field of Args and a keyword of the function (main() passes it with flags_of);
    the test that calls the function with it at a value other than its default is its row."""
    script = (
        "def combined_advantages(scores, weights, *, group_size, adv_scale):\n    return scores\n\n"
        "def main(args):\n    combined_advantages(1, 2, **flags_of(combined_advantages, args))\n"
    )
    test = "import fork as D\n\ndef test_scale():\n    assert D.combined_advantages(1, 2, group_size=16, adv_scale=-2.0) == 1\n"
    defaults = {"fork": {"group_size": 16, "adv_scale": 1.0}}
    assert passed_by_name(script) == {"group_size": "combined_advantages", "adv_scale": "combined_advantages"}
    me = "tests/test_flag_inventory.py"
    rows = derived_rows({"fork": script}, defaults, {me: test})
    assert rows == [("fork", "--adv-scale", f"`{me}::test_scale` (derived: combined_advantages(adv_scale=...))")]
    assert derived_rows({"fork": script}, defaults, {me: test.replace("-2.0", "1.0")}) == []  # its default: no row
    assert derived_rows({"fork": script}, defaults, {me: test.replace("def test_", "def helper_")}) == []
    assert derived_rows({"fork": script}, defaults, {me: test.replace("fork as D", "other as D")}) == []  # its own
    flags = {("fork", "--group-size"), ("fork", "--adv-scale")}
    assert check_inventory(flags, rows) == [f"fork --group-size: no row in docs/testing.md's {SECTION}",
                                            f"fork --adv-scale: {me} defines no test_scale"]  # fmt: skip


def test_the_inventory_reads_the_serve_options_and_the_shared_flags_once():
    flags = all_flags()
    assert {"--reward", "--host", "--port", "--max-pixels"} <= {f for s, f in flags if s == "serve"}
    assert ("shared", "--learning-rate") in flags and ("dancegrpo", "--learning-rate") not in flags  # redefined there
    assert ("dancegrpo", "--sde-window") in flags and ("evaluate", "--out") in flags


def test_the_checker_fails_on_a_flag_without_a_row_a_row_without_a_flag_and_a_missing_test():
    @dataclasses.dataclass
    class Fake:
        alpha: float = 1.0
        new_flag: int = 0

    flags = dataclass_flags("fake", Fake)
    me = "tests/test_flag_inventory.py"
    rows = [("fake", "--alpha", f"`{me}::test_every_flag_has_a_row_and_every_row_a_flag_and_existing_tests`")]
    assert check_inventory(flags, rows) == [f"fake --new-flag: no row in docs/testing.md's {SECTION}"]
    rows.append(("fake", "--new-flag", "Reason: only where files go; every end-to-end test exercises it."))
    assert check_inventory(flags, rows) == []
    assert check_inventory(flags, [*rows, ("fake", "--gone", "Reason: a flag that was removed long ago, say.")]) == [
        "fake --gone: a row, but no such flag"
    ]
    broken = [rows[0], ("fake", "--new-flag", f"`{me}::no_such_test`")]
    assert check_inventory(flags, broken) == [f"fake --new-flag: {me} defines no no_such_test"]
    assert check_inventory(flags, [rows[0], ("fake", "--new-flag", "later")]) == [
        "fake --new-flag: neither a test (`tests/FILE.py::TEST`) nor 'Reason: ...'"
    ]
    text = (
        f"# x\n\n{SECTION}\n\n| script | flag | test or reason |\n|---|---|---|\n| fake | `--alpha` | {rows[0][2]} |\n"
    )
    assert check_inventory(flags, read_table(text)) == [f"fake --new-flag: no row in docs/testing.md's {SECTION}"]
