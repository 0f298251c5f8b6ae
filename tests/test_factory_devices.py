"""GPU-only bugs, found without running anything: a torch tensor factory called without `device=` makes its tensor on
the default device, the CPU, and in training the first operation that mixes it with the GPU data fails, never in a
CPU test. tests/test_devices.py catches this in the algorithm functions by running them; this reads the source of the
whole training path (the scripts' main() loops and common/ included): every call of a factory (torch.zeros, ones,
full, empty, arange, linspace, tensor, randn, rand, randint, randperm, eye, as_tensor; the *_like ones inherit the
device) passes `device=`, or says on the line it starts on why the CPU is meant, in a comment `# cpu: <reason>` (keyed
noise drawn with a CPU generator and moved to the device after, a value only Python or the logs read, ...)."""

import ast
import io
import re
import tokenize

from tests.helpers import ROOT, algorithm_scripts

TRAINING_PATH = [
    *algorithm_scripts(),  # the training scripts, found (a fork's own included)
    *(
        f"common/{name}.py"
        for name in (
            "models/__init__", "models/base", "models/sd3", "models/flux", "models/flux2", "models/qwenimage", "models/zimage", "models/wan",
            "models/sd1",
            "rewards", "sampling", "runs", "logs", "evaluator", "checkpoints", "signals", "offload", "remote"
        )
    ),
]  # fmt: skip
FACTORIES = frozenset(
    "zeros ones full empty arange linspace tensor randn rand randint randperm eye as_tensor".split()
)  # fmt: skip
CPU_REASON = re.compile(r"(?:^|\s)# cpu: \S")  # `# cpu: <reason>`, alone or after another comment on the line


def _torch_names(tree: ast.AST) -> tuple[set[str], dict[str, str]]:
    """The names bound to the torch module (`import torch [as th]`) and to its factories (`from torch import zeros
    [as z]`: local name -> factory), anywhere in the module."""
    modules, factories = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "torch"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and node.level == 0:
            factories |= {a.asname or a.name: a.name for a in node.names if a.name in FACTORIES}
    return modules, factories


def factory_name(call: ast.Call, modules: set[str], factories: dict[str, str]) -> str | None:
    """'zeros' for torch.zeros(...) (or th.zeros, or zeros imported from torch), None for any other call."""
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules:
        return f.attr if f.attr in FACTORIES else None
    if isinstance(f, ast.Name):
        return factories.get(f.id)
    return None


def has_device(call: ast.Call) -> bool:
    """A `device=` keyword that names a device (`device=None` is the default device, so it does not count)."""
    return any(
        k.arg == "device" and not (isinstance(k.value, ast.Constant) and k.value.value is None) for k in call.keywords
    )


def comments(source: str) -> dict[int, str]:
    """line number -> the comment on it (only real comments, never text inside a string)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string for t in tokens if t.type == tokenize.COMMENT}


def factory_calls(source: str) -> list[tuple[ast.Call, str, bool]]:
    """Every factory call of `source`: (call, factory, allowed), allowed = it passes `device=` or its first line
    carries a `# cpu: <reason>` comment."""
    tree = ast.parse(source)
    modules, factories = _torch_names(tree)
    notes = comments(source)
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (name := factory_name(node, modules, factories)):
            allowed = has_device(node) or bool(CPU_REASON.search(notes.get(node.lineno, "")))
            calls.append((node, name, allowed))
    return sorted(calls, key=lambda c: (c[0].lineno, c[0].col_offset))


def offending_lines(source: str) -> list[int]:
    """The first line of every factory call in `source` without `device=` and without a `# cpu:` reason."""
    return [call.lineno for call, _, allowed in factory_calls(source) if not allowed]


def test_training_path_factories_name_their_device():
    bad, n_calls = [], 0
    for rel in TRAINING_PATH:
        source = (ROOT / rel).read_text()
        lines = source.splitlines()
        n_calls += len(factory_calls(source))
        bad += [f"{rel}:{n}: {lines[n - 1].strip()}" for n in offending_lines(source)]
    assert n_calls > 50, n_calls  # the scanner sees the factory calls at all
    assert not bad, (
        "tensor factories without device= (they land on the CPU, and a GPU run fails where they meet device tensors); "
        "pass device= (x.device, device, accelerator.device, ...), or say why the CPU is meant with `# cpu: <reason>` "
        "on the line the call starts on:\n" + "\n".join(bad)
    )


# ---------------------------------------------------------------- the scanner itself
def test_scanner_on_sources():
    src = """
import torch
import torch as th
from torch import zeros as z, randn

a = torch.zeros(3)
b = torch.zeros(3, device=x.device)
c = torch.as_tensor(v, device=device)
d = torch.randn(2, generator=gen, device=gen.device)
e = torch.zeros_like(x)
f = torch.ones(3, device=None)
g = torch.randn(2, generator=gen)  # cpu: keyed noise, moved to the device below
h = torch.randn(  # cpu: keyed noise, moved to the device below
    2, generator=gen
)
i = torch.randn(
    2, generator=gen
)  # cpu: on the call's last line, not its first
j = torch.full((2,), 1.0)  # (B,)  # cpu: read by Python only
k = torch.eye(2)  # cpu:
m = torch.tensor([1.0])  # gpu: not a cpu reason
n = th.arange(4)
o = z(2)
p = randn(2, device=device)
q = torch.stack([torch.rand(2), torch.randint(3, (2,), device=d), torch.randperm(3), torch.linspace(0, 1, 3)])
r = "torch.empty(2)  # cpu: inside a string, not a call"
s = torch.empty(2)
t = x.new_zeros(2)
"""
    assert offending_lines(src) == [6, 11, 16, 20, 21, 22, 23, 25, 25, 25, 27]
    names = {name for _, name, _ in factory_calls(src)}
    assert names == FACTORIES  # every factory seen; *_like and new_* are not factories here


KNOWN = [  # (file, function or None for the whole file, assigned name): calls that must keep their device=
    ("common/models/flux.py", None, "guidance"),  # FLUX's embedded guidance, an input of the transformer
]


def assigned_factory_calls(source: str, function: str | None, target: str) -> list[ast.Call]:
    """The factory calls assigned to `target` (also as an element of a tuple assignment) in `function`'s body."""
    tree = ast.parse(source)
    modules, factories = _torch_names(tree)
    scopes = [tree] if function is None else [n for n in ast.walk(tree) if getattr(n, "name", None) == function]
    found = []
    for scope in scopes:
        for node in ast.walk(scope):
            if not isinstance(node, ast.Assign):
                continue
            for tgt in node.targets:
                tuples = isinstance(tgt, ast.Tuple) and isinstance(node.value, ast.Tuple)
                for t, v in zip(tgt.elts, node.value.elts) if tuples else [(tgt, node.value)]:
                    if isinstance(t, ast.Name) and t.id == target and isinstance(v, ast.Call):
                        if factory_name(v, modules, factories) and v not in found:
                            found.append(v)
    return found


def without_device(source: str, call: ast.Call) -> str:
    """`source` with the `device=` keyword of `call` removed (the rest of the file, comments included, as it is)."""
    lines = source.splitlines(keepends=True)
    start = sum(len(line) for line in lines[: call.lineno - 1]) + len(
        lines[call.lineno - 1].encode()[: call.col_offset].decode()
    )
    end = sum(len(line) for line in lines[: call.end_lineno - 1]) + len(
        lines[call.end_lineno - 1].encode()[: call.end_col_offset].decode()
    )
    stripped = ast.Call(call.func, call.args, [k for k in call.keywords if k.arg != "device"])
    return source[:start] + ast.unparse(stripped) + source[end:]


def test_scanner_finds_the_known_calls_and_flags_them_without_device():
    for rel, function, target in KNOWN:
        source = (ROOT / rel).read_text()
        calls = assigned_factory_calls(source, function, target)
        assert len(calls) == 1, f"{rel}: {target} = torch.<factory>(...) in {function or 'the file'}: {len(calls)}"
        call = calls[0]
        assert has_device(call), f"{rel}:{call.lineno}: {target} lost its device="
        assert call.lineno not in offending_lines(source)
        mutated = without_device(source, call)
        assert call.lineno in offending_lines(mutated), f"{rel}:{call.lineno}: not flagged without device="
        assert len(offending_lines(mutated)) == len(offending_lines(source)) + 1


def test_scanner_flags_each_call_of_the_training_scripts_without_its_device():
    """In every training script, each factory call that passes device= (and gives no `# cpu:` reason) is flagged once
    its device= is taken out, and only it (whatever the calls are and wherever they are: a fork's are checked the same way)."""
    seen = 0
    for rel in algorithm_scripts():
        source = (ROOT / rel).read_text()
        before = offending_lines(source)
        lines = source.splitlines()
        for call, _, _ in factory_calls(source):
            if has_device(call) and not CPU_REASON.search(lines[call.lineno - 1]):  # a `# cpu:` line stays allowed
                seen += 1
                after = offending_lines(without_device(source, call))
                assert call.lineno in after and len(after) == len(before) + 1, f"{rel}:{call.lineno}"
    assert seen >= 10, seen
