"""Generated mutants: mutmut 3 mutates every algorithm function of a file (each comparison, operator, constant, argument
and call it can change, one at a time) and runs the tests that reach that function against each mutant. A mutant the
tests let pass SURVIVED: either the suite cannot see that change (a test to write) or the change does not alter what
the code computes (an equivalent mutant, listed with its reason on the target's page in docs/mutation/).
benchmarks/testing/mutants.py keeps the hand-written ones.

    python benchmarks/testing/mutation.py                       # every target below, one after another (hours on 2 cores)
    python benchmarks/testing/mutation.py diffusionnft.py       # one file
    python benchmarks/testing/mutation.py dancegrpo.py --functions group_advantages,policy_loss
    python benchmarks/testing/mutation.py dancegrpo.py --survivors  # the last run's survivors again, after new tests
    python benchmarks/testing/mutation.py rlr.py --resume --ref 8ab4aab   # go on with an interrupted run (its copy kept)
    python benchmarks/testing/mutation.py dancegrpo.py --survivors --ref afe9141 --overlay tests/test_properties_dancegrpo.py

Each file is mutated in a fresh copy of the commit (`--ref`, default HEAD) under /tmp/mutation/<file>, never in this
working tree; mutmut forks one test process per mutant (one at a time, niced, one thread) and stops a mutant's tests
at the first failure or at its time limit (15 x the tests' own time + 5 s of CPU, and --wall-limit
240 s of wall-clock time for a process that blocks: either counts as killed). The scores
go to benchmarks/testing/mutation_out/<file>.json and to the target's page in docs/mutation/ (dancegrpo.md,
dancegrpo_flags.md, common_runs.md, ...: survivors with their diffs; the page's notes, below its NOTES line, are kept). The tool is pinned in
benchmarks/testing/requirements-mutation.txt (`pip install -r benchmarks/testing/requirements-mutation.txt`).

What is mutated: for the six scripts, the module-level functions and the methods of the classes above main() (not
main(), not the flags class Args); for common/runs.py, common/remote.py, common/evaluate.py, common/checkpoints.py
and common/flags.py every function but an entry point's main(); for common/__init__.py the atomic writer; for
common/rewards.py, the served-reward path (how requests are made and their answers combined) and the parser of
--reward. Tests: only in-process ones (a test that starts the script in another process is
left out: mutmut cannot tell which functions it reaches, and it takes minutes).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "testing" / "mutation_out"
PAGES = ROOT / "docs" / "mutation"  # one page per target: its report, then the notes kept from the page it replaces
NOTES = "<!-- the notes below are kept when benchmarks/testing/mutation.py writes this page again -->"
WORK = Path("/tmp/mutation")

# tests that reach every script's main() in this process
MAIN_TESTS = [
    "tests/test_flags_applied.py",
    "tests/test_direction.py",
    "tests/test_schedules.py",
    "tests/test_aggregation.py",
]


def script(name: str) -> dict:
    """The algorithm functions (above main(), but its flag checks) against the script's tests and those that run its
    main(); the flag checks against the tests that give flags (every main() test calls them: a surviving mutant of a
    check would run all of them)."""
    own = [f"tests/test_{name}*.py", f"tests/test_properties_{name}.py"]  # its tests, the methods' files too
    return {
        f"{name}.py": {"tests": [*own, *MAIN_TESTS], "scope": "above_main", "exclude": ["resolve_and_check"]},
        f"{name}.py:flags": {"tests": [*own, "tests/test_inputs.py"], "scope": ["resolve_and_check"]},
    }


TARGETS = {
    **script("diffusionnft"),
    **script("dancegrpo"),
    **script("branchgrpo"),
    **script("vgrpo"),
    **script("rlr"),
    **script("dgpo"),
    "common/geneval.py": {"tests": ["tests/test_geneval_rules.py", "tests/test_geneval.py"], "scope": "all"},
    "common/runs.py": {
        "tests": ["tests/test_runs.py", "tests/test_properties_runs.py"],
        "scope": "all",
    },
    "common/remote.py": {
        "tests": ["tests/test_remote.py", "tests/test_server.py", "tests/test_judge_parser.py"],
        "scope": "all",
    },
    "common/evaluate.py": {
        "tests": ["tests/test_evaluate.py", "tests/test_evaluate_stats.py"],
        "scope": "all",
    },
    "common/checkpoints.py": {
        "tests": [
            "tests/test_checkpoint_trust.py",
            "tests/test_checkpoint_units.py",
            "tests/test_runs.py",
            "tests/test_properties_runs.py",
        ],
        "scope": "all",
    },
    "common/flags.py": {
        # every check of the command line; test_flags_applied.py: each script's main() given flags, in this process
        "tests": [
            "tests/test_cli_units.py",
            "tests/test_flag_walk.py",
            "tests/test_flag_walk_tools.py",
            "tests/test_inputs.py",
            "tests/test_help.py",
            "tests/test_pipeline_schedules.py",
            "tests/test_checkpoint_trust.py",
            "tests/test_flags_applied.py",
        ],
        "scope": "all",
    },
    "common/__init__.py": {
        # the atomic writer and its check of what is in the way
        "tests": [
            "tests/test_cli_units.py",
            "tests/test_checkpoint_trust.py",
            "tests/test_evaluate_stats.py",
            "tests/test_runs.py",
        ],
        "scope": ["in_the_way", "write_atomically"],
    },
    "common/rewards.py": {
        # test_flags_applied.py: serve_main given every option, in this process
        "tests": [
            "tests/test_rewards.py",
            "tests/test_remote.py",
            "tests/test_server.py",
            "tests/test_flags_applied.py",
        ],
        "scope": ["CompositeReward", "serve_main", "parse_rewards", "check_rewards", "_canonical", "_needs_url"],
    },
}

# a test whose source has one of these starts a process (or a whole run): left out
OUT_OF_PROCESS = re.compile(r"\brun_script\b|\bsubprocess\b|\bassert_survives_kills\b|(?<![\w.])run\(")


def copy_commit(ref: str, dest: Path, worktree: bool) -> None:
    """`ref`'s tracked files (or, with --worktree, this working tree's tracked and untracked ones) into dest."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    if worktree:
        files = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout.split(b"\0")
        for f in filter(None, files):
            src = ROOT / f.decode()
            if src.is_file():
                (dest / f.decode()).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / f.decode())
    else:
        archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    # what the copy is of: --resume and --harvest report it, whatever --ref they are given
    (dest / ".mutation_ref").write_text("worktree" if worktree else ref)


def mutated_names(source: str, scope, exclude=()) -> list[str]:
    """mutmut's mangled names (x_fn, xǁClassǁmethod) of the functions to mutate. A function marked `# same as in
    X.py` is left out: it is mutated in X.py against X.py's tests, and any change of the copy fails
    scripts/check.py's copy check."""
    tree = ast.parse(source)
    lines = source.splitlines()
    main_line = next((n.lineno for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), float("inf"))
    names = []
    for node in tree.body:
        if scope == "above_main" and node.lineno > main_line:
            continue
        if (
            isinstance(scope, list)
            and getattr(node, "name", None) not in scope
            or getattr(node, "name", None) in exclude
        ):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "main":
            if "# same as in " not in lines[node.lineno - 1]:
                names.append(f"x_{node.name}")
        elif isinstance(node, ast.ClassDef) and not node.name.endswith("Args"):
            for m in node.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.append(f"xǁ{node.name}ǁ{m.name}")
    return names


def undecorate(source: str, names: list[str]) -> str:
    """The same module with each decorator of the chosen functions applied by an assignment after the function
    (`f = torch.no_grad()(f)` for `@torch.no_grad()`): mutmut leaves decorated functions out."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []  # (first line, last line, replacement of the decorator lines, line after the function)
    for node in tree.body:
        scope = [(node, "")]
        if isinstance(node, ast.ClassDef):
            scope = [(m, " " * m.col_offset) for m in node.body]
        for fn, indent in scope:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.decorator_list:
                continue
            key = f"x_{fn.name}" if not indent else f"xǁ{node.name}ǁ{fn.name}"
            if key not in names:
                continue
            applied = fn.name
            for d in reversed(fn.decorator_list):
                applied = f"({ast.get_source_segment(source, d)})({applied})"
            first = fn.decorator_list[0].lineno - 1
            edits.append((first, fn.lineno - 1, fn.end_lineno, f"{indent}{fn.name} = {applied}\n"))
    for first, def_line, end, assignment in sorted(edits, reverse=True):
        lines[end:end] = [assignment]
        del lines[first:def_line]
    return "".join(lines)


def in_process_tests(copy: Path, files: list[str]) -> list[str]:
    """pytest node ids: the files' test functions that run in this process."""
    ids = []
    missing = [f for f in files if not any(copy.glob(f))]
    if missing:  # a test file renamed or never written: its target would be scored without it, silently
        raise SystemExit(f"error: no test file matches {', '.join(missing)} in the copy of the commit")
    paths = dict.fromkeys(p for f in files for p in sorted(copy.glob(f)))  # patterns expanded, each file once
    for path in paths:
        f = str(path.relative_to(copy))
        source = path.read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                if not OUT_OF_PROCESS.search(ast.get_source_segment(source, node)):
                    ids.append(f"{f}::{node.name}")
    return ids


def configure(copy: Path, target: str, tests: list[str]) -> None:
    others = [p.name for p in copy.iterdir() if p.name not in ("tests", ".git") and p.name != target]
    if "/" in target:  # a module of common/: the package is copied beside its mutated module
        others = [p for p in others if p != target.split("/")[0]]
        others += [str(p.relative_to(copy)) for p in (copy / target).parent.iterdir() if p.name != Path(target).name]
    config = {
        "source_paths": [target],
        "also_copy": sorted(others),
        "pytest_add_cli_args": ["-p", "no:cacheprovider", "-q"],
        "pytest_add_cli_args_test_selection": tests,
        "timeout_multiplier": 15.0,
        "timeout_constant": 5.0,
        # each mutant's process forked from a server that only imported the tests, not from mutmut's own process,
        # where the stats run left threads (TensorBoard writers, tqdm) whose locks a fork inherits held
        "process_isolation": "forkserver",
    }
    lines = ["", "[tool.mutmut]"] + [f"{k} = {json.dumps(v)}" for k, v in config.items()]
    with open(copy / "pyproject.toml", "a") as f:
        f.write("\n".join(lines) + "\n")


def run_target(key: str, args) -> dict:
    spec = TARGETS[key]
    target = key.split(":")[0]  # the file
    ref = _commit(args.ref)  # now: HEAD may move while mutmut runs
    slug = key.replace("/", "_").replace(":", "_")
    copy = WORK / slug
    overlay_commit = _commit("HEAD")
    reuse = args.harvest or args.resume  # the copy of an interrupted run, as it was left
    if reuse:  # its file as committed at --ref
        shown = subprocess.run(["git", "show", f"{ref}:{target}"], cwd=ROOT, capture_output=True, text=True)
        if shown.returncode or not (copy / "mutants" / f"{target}.meta").is_file():
            flag = "--harvest" if args.harvest else "--resume"
            raise SystemExit(f"{flag}: no run of {target} at --ref {args.ref} in {copy}")
        source = shown.stdout
    else:
        copy_commit(ref, copy, args.worktree)
        for path in args.overlay:  # a test file of today's commit over an older commit's tree
            text = subprocess.run(
                ["git", "show", f"{overlay_commit}:{path}"], cwd=ROOT, capture_output=True, check=True
            )
            (copy / path).write_bytes(text.stdout)
        source = (copy / target).read_text()
    names = mutated_names(source, spec["scope"], spec.get("exclude", ()))
    if not reuse:
        (copy / target).write_text(undecorate(source, names))
    if args.functions:
        wanted = set(args.functions.split(","))
        names = [n for n in names if n.split("ǁ")[-1].removeprefix("x_") in wanted]
    tests = in_process_tests(copy, spec["tests"])
    if not reuse:
        configure(copy, target, tests)
    module = target.removesuffix(".py").replace("/", ".").removesuffix(".__init__")  # a package: its own name
    patterns = [f"{module}.{n}__mutmut_*" for n in names]
    sha = hashlib.sha256(source.encode()).hexdigest()[:16]
    earlier = None
    if args.survivors:  # only the last run's survivors, against today's tests; the file itself must be unchanged
        earlier = json.loads((OUT / f"{slug}.json").read_text())
        if earlier["source_sha"] != sha or earlier["functions"] != names:
            raise SystemExit(f"{key} changed since its last run: run it whole")
        run_names = [s["mutant"] for s in earlier["survivors"]]
        if args.mutants:  # only these of them (the others judged equivalent: rerunning them runs every test)
            wanted = set(args.mutants.split(","))
            run_names = [n for n in run_names if n.split(".")[-1] in wanted]
    elif args.resume:  # the mutants the interrupted run did not reach; mutmut keeps the others' verdicts
        codes = json.loads((copy / "mutants" / f"{target}.meta").read_text())["exit_code_by_key"]
        run_names = [k for k, v in codes.items() if v is None and any(re.fullmatch(_glob(p), k) for p in patterns)]
    else:
        run_names = patterns
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    mutmut = str(Path(sys.executable).with_name("mutmut"))
    print(f"{key}: {len(names)} functions, {len(tests)} tests, in {copy}", flush=True)
    start = time.time()
    if args.harvest:  # from the copy's configuration to mutmut's last word
        seconds = (copy / "mutmut.log").stat().st_mtime - (copy / "pyproject.toml").stat().st_mtime
    else:
        before = (copy / "mutmut.log").stat().st_mtime - (copy / "pyproject.toml").stat().st_mtime if reuse else 0
        logged = len((copy / "mutmut.log").read_text(errors="replace")) if reuse else 0  # the earlier run's lines
        with open(copy / "mutmut.log", "a" if reuse else "w") as log:
            proc = subprocess.Popen(
                ["nice", "-n", "19", mutmut, "run", "--max-children", "1", *run_names],
                cwd=copy,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            watch(proc, copy / "mutmut.log", args.wall_limit, logged)
        seconds = before + time.time() - start
    meta = json.loads((copy / "mutants" / f"{target}.meta").read_text())
    codes = {k: v for k, v in meta["exit_code_by_key"].items() if any(re.fullmatch(_glob(p), k) for p in patterns)}
    untested = sum(v is None for v in codes.values())  # an interrupted run's mutants not reached (--harvest)
    codes = {k: v for k, v in codes.items() if v is not None}
    if earlier:
        codes = {**earlier["codes"], **{k: codes[k] for k in run_names}}
        seconds += earlier["seconds"]
    if not codes:
        raise SystemExit(f"{key}: no mutant ran; see {copy / 'mutmut.log'}")
    killed_codes = {1, 3, 36, 24, -24, 152, 255, -9}  # a failing test, pytest's internal error, a time limit
    per_function: dict[str, list[int]] = {}
    survivors = []
    for name, code in sorted(codes.items(), key=lambda kv: _order(kv[0])):
        fn = name.removeprefix(module + ".").split("__mutmut_")[0]
        killed = code in killed_codes
        per_function.setdefault(fn, [0, 0])
        per_function[fn][0] += killed
        per_function[fn][1] += 1
        if not killed:
            survivors.append({"mutant": name, "status": _status(code)})
    diffs = mutant_diffs(copy, target, [s["mutant"] for s in survivors], env)
    for s in survivors:
        s["diff"] = diffs[s["mutant"]]
    killed = sum(k for k, _ in per_function.values())
    marker = copy / ".mutation_ref"  # the commit the copy is of (a copy made before the marker existed: --ref)
    made_from = marker.read_text() if marker.is_file() else "worktree" if args.worktree else ref
    result = {
        "file": key,
        "ref": made_from,
        "source_sha": sha,
        "functions": names,
        "killed": killed,
        "total": len(codes),
        "killed_by_wall_limit": sum(code == -9 for code in codes.values()),
        "untested": untested,
        "seconds": round(seconds),
        "tests": tests,
        "per_function": per_function,
        "survivors": survivors,
        "codes": codes,
        "survivors_rerun_at": ref if earlier else None,
        "overlay": {path: overlay_commit for path in args.overlay},
    }
    OUT.mkdir(exist_ok=True)
    (OUT / f"{slug}.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    write_page(page_of(key), markdown(result))
    left = f", {untested} mutants not reached (an interrupted run)" if untested else ""
    print(f"{key}: {killed}/{len(codes)} killed ({100 * killed / len(codes):.1f}%) in {seconds / 60:.1f} min{left}")
    return result


def watch(proc: subprocess.Popen, log: Path, limit: float, start: int = 0) -> None:
    """Wait for mutmut; once it tests mutants, kill a mutant's test process still running after `limit` seconds of
    wall-clock time. mutmut's own limit is on CPU time, which a process blocked on a lock (a fork that inherited one
    held) never spends: such a mutant is recorded with exit -9 and counted as killed by a time limit."""
    ticks, testing = os.sysconf("SC_CLK_TCK"), False
    while proc.poll() is None:
        time.sleep(5)
        testing = testing or "Running mutation testing" in log.read_text(errors="replace")[start:]  # this run's
        if not testing:
            continue
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        for mutmut_pid in [proc.pid, *_children(proc.pid)]:  # nice -> mutmut -> one forked test process
            for pid in _children(mutmut_pid):
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if uptime - int(stat[19]) / ticks > limit and _children(pid) == [] and mutmut_pid != proc.pid:
                    os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


DIFFS = """
import json, sys
from pathlib import Path
from mutmut.mutation.diff_apply import get_diff_for_mutant
target, names = sys.argv[1], json.loads(sys.stdin.read())
print(json.dumps({n: get_diff_for_mutant(n, path=Path(target)) for n in names}))
"""


def mutant_diffs(copy: Path, target: str, names: list[str], env: dict) -> dict[str, list[str]]:
    """Each mutant's changed lines (- the original, + the mutant), from mutmut's own record of it."""
    done = subprocess.run(
        [sys.executable, "-c", DIFFS, target],
        cwd=copy,
        env=env,
        input=json.dumps(names),
        capture_output=True,
        text=True,
    )
    diffs = json.loads(done.stdout)
    return {
        n: [line for line in d.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
        for n, d in diffs.items()
    }


def markdown(r: dict) -> str:
    lines = [
        f"# {r['file']} at {r['ref']}: {r['killed']}/{r['total']} killed in {r['seconds'] / 60:.1f} min"
        + (f" ({r['untested']} mutants not reached: an interrupted run)" if r.get("untested") else ""),
        "",
        "| function | killed / total |",
        "|---|---|",
    ]
    lines += [f"| {fn} | {k} / {n} |" for fn, (k, n) in r["per_function"].items()]
    lines += ["", "## Survivors", ""]
    for s in r["survivors"]:
        lines += [f"### {s['mutant']} ({s['status']})", "```diff", *s["diff"], "```", ""]
    return "\n".join(lines) + "\n"


def page_of(key: str) -> Path:
    """A target's page: docs/mutation/dancegrpo.md, dancegrpo_flags.md (dancegrpo.py:flags), common_runs.md, ..."""
    return PAGES / (key.replace(".py", "").replace("/", "_").replace(":", "_") + ".md")


def write_page(path: Path, report: str) -> None:
    """The run's report, then the notes of the page it replaces (from NOTES on: the tests written for its survivors,
    the equivalent ones and why), which a person writes and a run keeps."""
    old = path.read_text() if path.exists() else ""
    notes = old[old.index(NOTES) :] if NOTES in old else NOTES + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report + "\n" + notes)


def _glob(pattern: str) -> str:
    return re.escape(pattern).replace(r"\*", ".*")


def _order(name: str):
    fn, _, n = name.rpartition("__mutmut_")
    return fn, int(n) if n.isdigit() else 0


def _status(code) -> str:
    return {0: "survived", None: "not checked", 5: "no tests", 33: "no tests", 34: "skipped"}.get(code, f"exit {code}")


def _commit(ref: str) -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "--verify", f"{ref}^{{commit}}"], cwd=ROOT, capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(f"--ref {ref}: not a commit here")
    return out.stdout.strip()


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("targets", nargs="*", help=f"files to mutate (default: all): {', '.join(TARGETS)}")
    p.add_argument("--functions", help="only these functions (comma-separated names)")
    p.add_argument("--ref", default="HEAD", help="the commit to mutate (a fresh copy of it)")
    p.add_argument("--worktree", action="store_true", help="copy this working tree instead of a commit")
    p.add_argument(
        "--survivors",
        action="store_true",
        help="run only the last run's survivors (benchmarks/testing/mutation_out/<file>.json) against this commit's tests; "
        "the file's source must be unchanged; the others keep their verdicts and the times add up",
    )
    p.add_argument(
        "--mutants", help="with --survivors: only these survivors (names as x_fn__mutmut_3, comma-separated)"
    )
    p.add_argument("--wall-limit", type=float, default=240, help="seconds of wall-clock time a mutant's tests may take")
    p.add_argument(
        "--harvest",
        action="store_true",
        help="score what an interrupted run (stopped with Ctrl-C or a kill) tested, from its copy under /tmp/mutation "
        "(give the --ref it ran at); the mutants it did not reach are counted apart",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="go on with an interrupted run in its copy under /tmp/mutation (give the --ref it ran at): only the "
        "mutants it did not reach run; the others keep their verdicts and the times add up",
    )
    p.add_argument(
        "--overlay",
        action="append",
        default=[],
        help="a file (e.g. a new test file) taken from HEAD into the copy of --ref: an older commit's survivors "
        "against a newer test, with --survivors",
    )
    args = p.parse_args()
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        p.error(f"not a target: {', '.join(unknown)}")
    results = [run_target(t, args) for t in (args.targets or TARGETS)]
    print("\n| file | killed / total | score | time |\n|---|---|---|---|")
    for r in results:
        print(
            f"| {r['file']} | {r['killed']} / {r['total']} | {100 * r['killed'] / r['total']:.1f}% | "
            f"{r['seconds'] / 60:.1f} min |"
        )


if __name__ == "__main__":
    cli()
