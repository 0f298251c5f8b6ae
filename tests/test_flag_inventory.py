"""docs/flags.md's flag inventory covers every flag: each field of the training scripts' Args (the shared RunArgs
fields once, as `shared`), of common.evaluate's EvalArgs and each option of `python -m common.rewards serve` has a
row, every row names a flag that exists, and every test a row names is defined in the file it names; a row without
a test gives its reason. A new flag without a row fails here.

The scripts are found, not listed (tests.helpers.algorithm_scripts): a copy such as `cp dancegrpo.py mygrpo.py`,
which the table does not name, is covered by the rows of the listed script it was copied from for each flag it has
unchanged (same name, type and default); a flag new in a fork, in place or in a copy, needs its own row, or a test
that calls the function taking it as a keyword (derived_rows)."""

import ast
import dataclasses
import importlib
import inspect
import re
import types
from functools import cache

from tests.helpers import ROOT, algorithm_scripts

DOC = ROOT / "docs" / "flags.md"
TABLE = "docs/flags.md's table"
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
SCRIPTS = tuple(name.removesuffix(".py") for name in algorithm_scripts())


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def dataclass_flags(script: str, cls, shared: set[str] = frozenset()) -> set[tuple[str, str]]:
    """(script, --flag) per field of the dataclass `cls`, leaving out the `shared` fields (listed once as shared)."""
    return {(script, flag(f.name)) for f in dataclasses.fields(cls) if f.name not in shared}


def serve_options() -> set[str]:
    """The long options of `python -m common.rewards serve`: the fields of its ServeArgs."""
    from common.rewards import ServeArgs

    return {flag(f.name) for f in dataclasses.fields(ServeArgs)}


def all_flags() -> set[tuple[str, str]]:
    """Every (script, --flag) the inventory must list."""
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
    """(script, --flag, cell) per row of the inventory's table: the table under the header `| script | flag | ... |`
    (three columns), wherever it is in the file."""
    rows, inside = [], False
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 3:
            inside = False
            continue
        if cells[:2] == ["script", "flag"]:
            inside = True
        elif inside and not set(cells[0]) <= set("-: "):
            rows.append((cells[0], cells[1].strip("`"), cells[2]))
    assert rows or not text.strip(), f"{TABLE}: no table with the header | script | flag | test or reason |"
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
    problems += [f"{s} {f}: no row in {TABLE}" for s, f in sorted(flags - set(seen))]
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


def passed_by_name(module) -> dict[str, set[str]]:
    """{flag's field name: the functions that take it} for each function defined in the script `module` with a
    keyword-only parameter named like a field of its Args: main() passes each such keyword from the flag of the same
    name (tests/test_flags_applied.py checks it on the calls main() makes)."""
    fields = {f.name for f in dataclasses.fields(module.Args)}
    out = {}
    for fn in vars(module).values():
        if inspect.isfunction(fn) and fn.__module__ == module.__name__:
            for p in inspect.signature(fn).parameters.values():
                if p.kind is p.KEYWORD_ONLY and p.name in fields:
                    out.setdefault(p.name, set()).add(fn.__name__)
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


def derived_rows(modules: dict, test_sources: dict[str, str]) -> list:
    """The rows the inventory derives instead of a hand-written one: a flag main() passes by name to a function
    (passed_by_name) that a test calls with that keyword at a value other than the flag's default (keywords_tested).
    modules: script name -> its imported module."""
    tested, rows = keywords_tested(test_sources), []
    for script, module in modules.items():
        defaults = {f.name: f.default for f in dataclasses.fields(module.Args)}
        for name, functions in sorted(passed_by_name(module).items()):
            for fn in sorted(functions):
                chosen = [(p, t) for v, p, t in tested.get((script, fn, name), []) if v != defaults[name]]
                if chosen:
                    rows.append((script, flag(name), f"`{chosen[0][0]}::{chosen[0][1]}` (derived: {fn}({name}=...))"))
                    break
    return rows


def signature(field: dataclasses.Field):
    """What a copied flag must keep to count as the original's: its type and its default."""
    default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    return str(field.type), repr(default)


def copied_rows(modules: dict, rows: list[tuple[str, str, str]], listed: set[str]) -> list[tuple[str, str, str]]:
    """Rows for the scripts the table does not name (a copy such as mygrpo.py; `listed`: the scripts it names): each
    flag the copy has unchanged from the listed script it shares the most unchanged flags with takes that script's
    row (`rows`: the table's and the derived ones). A flag it adds or changes gets none here."""
    listed = listed & set(modules)
    cells = {(s, f): cell for s, f, cell in rows}
    fields = {s: {f.name: signature(f) for f in dataclasses.fields(m.Args)} for s, m in modules.items()}
    out = []
    for script in sorted(set(modules) - listed):
        same = {s: {n for n, sig in fields[script].items() if fields[s].get(n) == sig} for s in sorted(listed)}
        origin = max(same, key=lambda s: len(same[s]), default=None)
        for name in sorted(same.get(origin, ())):
            if (origin, flag(name)) in cells:
                out.append((script, flag(name), cells[origin, flag(name)]))
    return out


def listed_rows(modules: dict) -> list[tuple[str, str, str]]:
    """The table's rows and a derived row for each flag without one."""
    rows = read_table(DOC.read_text())
    listed = {(s, f) for s, f, _ in rows}
    tests = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "tests").glob("test_*.py"))}
    return rows + [r for r in derived_rows(modules, tests) if r[:2] not in listed]


def repository_rows() -> list[tuple[str, str, str]]:
    """The table's rows, a derived row for each flag without one, and the rows of the copies of a listed script."""
    modules = {s: importlib.import_module(s) for s in SCRIPTS}
    rows = listed_rows(modules)
    table = {s for s, _, _ in read_table(DOC.read_text())}
    have = {(s, f) for s, f, _ in rows}
    return rows + [r for r in copied_rows(modules, rows, table) if r[:2] not in have]


def test_every_flag_has_a_row_and_every_row_a_flag_and_existing_tests():
    problems = check_inventory(all_flags(), repository_rows())
    assert not problems, "\n".join(problems)


FORK = """
from dataclasses import dataclass


@dataclass
class Args:
    group_size: int = 16
    adv_scale: float = 1.0


def combined_advantages(scores, weights, *, group_size, adv_scale=1.0):
    return scores
"""


def module_from(name: str, source: str):
    """A module named `name` made from `source` (a fork's script, as far as the inventory reads it)."""
    module = types.ModuleType(name)
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)
    return module


def test_a_flag_passed_by_name_and_called_at_a_chosen_value_in_a_test_needs_no_row():
    """A fork's new advantage flag: a field of Args and a keyword of the function (main() passes it by name); the test
    that calls the function with it at a value other than its default is its row."""
    fork = module_from("fork", FORK)
    test = "import fork as D\n\ndef test_scale():\n    assert D.combined_advantages(1, 2, group_size=16, adv_scale=-2.0) == 1\n"
    assert passed_by_name(fork) == {"group_size": {"combined_advantages"}, "adv_scale": {"combined_advantages"}}
    me = "tests/test_flag_inventory.py"
    rows = derived_rows({"fork": fork}, {me: test})
    assert rows == [("fork", "--adv-scale", f"`{me}::test_scale` (derived: combined_advantages(adv_scale=...))")]
    assert derived_rows({"fork": fork}, {me: test.replace("-2.0", "1.0")}) == []  # its default: no row
    assert derived_rows({"fork": fork}, {me: test.replace("def test_", "def helper_")}) == []
    assert derived_rows({"fork": fork}, {me: test.replace("fork as D", "other as D")}) == []  # its own
    flags = {("fork", "--group-size"), ("fork", "--adv-scale")}
    assert check_inventory(flags, rows) == [f"fork --group-size: no row in {TABLE}",
                                            f"fork --adv-scale: {me} defines no test_scale"]  # fmt: skip


def test_a_copy_takes_the_rows_of_its_original_and_a_new_flag_needs_its_own():
    """`cp dancegrpo.py mygrpo.py`: every flag as dancegrpo.py's, so dancegrpo.py's rows cover it, and nothing is
    asked of it; a flag the copy adds, or one whose default it changes, has no row until it gets one."""
    me = "tests/test_flag_inventory.py"
    original = module_from("orig", FORK)
    rows = [("orig", "--group-size", f"`{me}::a`"), ("orig", "--adv-scale", f"`{me}::b`")]
    copy = module_from("mine", FORK)
    assert copied_rows({"orig": original, "mine": copy}, rows, {"orig"}) == [
        ("mine", "--adv-scale", f"`{me}::b`"),
        ("mine", "--group-size", f"`{me}::a`"),
    ]
    changed = FORK.replace("adv_scale: float = 1.0", "adv_scale: float = 2.0\n    nll_coef: float = 0.0")
    copy = module_from("mine", changed)
    assert copied_rows({"orig": original, "mine": copy}, rows, {"orig"}) == [("mine", "--group-size", f"`{me}::a`")]
    flags = dataclass_flags("mine", copy.Args) | dataclass_flags("orig", original.Args)
    got = rows + copied_rows({"orig": original, "mine": copy}, rows, {"orig"})
    missing = [p for p in check_inventory(flags, got) if "defines no" not in p]  # the rows' tests are made up here
    assert missing == [f"mine --adv-scale: no row in {TABLE}", f"mine --nll-coef: no row in {TABLE}"]


def test_every_flag_of_a_copy_of_each_script_is_covered_by_its_original():
    """Each script the table lists, copied as it is (its Args under another script name), asks for no row of its own:
    each of its flags takes the original's row, hand-written or derived."""
    from common.flags import RunArgs

    shared = {f.name for f in dataclasses.fields(RunArgs)}
    modules = {s: importlib.import_module(s) for s in SCRIPTS}
    rows = listed_rows(modules)
    listed = {s for s, _, _ in read_table(DOC.read_text())} & set(SCRIPTS)
    assert len(listed) >= 5, listed
    for script in sorted(listed):
        original = modules[script]
        copy = types.SimpleNamespace(Args=original.Args)
        rows_of_copy = copied_rows({script: original, f"my{script}": copy}, rows, listed)
        assert {f for _, f in dataclass_flags(script, original.Args, shared)} <= {f for _, f, _ in rows_of_copy}


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
    assert check_inventory(flags, rows) == [f"fake --new-flag: no row in {TABLE}"]
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
    text = f"# x\n\n| script | flag | test or reason |\n|---|---|---|\n| fake | `--alpha` | {rows[0][2]} |\n"
    assert check_inventory(flags, read_table(text)) == [f"fake --new-flag: no row in {TABLE}"]
