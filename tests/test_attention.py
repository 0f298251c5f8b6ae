"""One place sets the attention kernels (common/attention.py): each choice enables exactly its torch switches, a
choice the device cannot run stops at start-up naming the flag, and every entry point that can put a model on a GPU
calls it (the training scripts: run until their first model loads; the other entry points: read from their code,
so that removing the one call fails here)."""

import ast
from pathlib import Path

import pytest
import torch

from common import InputError
from common.attention import ATTENTION_BACKENDS, SWITCHES, enabled_backends, set_attention_backend
from tests.helpers import algorithm_scripts

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tuple(name.removesuffix(".py") for name in algorithm_scripts())


@pytest.fixture(autouse=True)
def restore_switches():
    """The switches are process-wide: put back what the other tests of this worker run with."""
    saved = enabled_backends()
    yield
    for switch in SWITCHES:
        getattr(torch.backends.cuda, f"enable_{switch}_sdp")(switch in saved)


@pytest.mark.parametrize(
    "name, enabled",
    [
        ("auto", ["flash", "mem_efficient", "math"]),
        ("flash", ["flash"]),
        ("math", ["math"]),
        ("cudnn", ["flash", "mem_efficient", "math", "cudnn"]),
    ],
)
def test_each_choice_enables_exactly_its_kernels(name, enabled):
    for switch in SWITCHES:  # start from the opposite of what is expected, so each switch must move
        getattr(torch.backends.cuda, f"enable_{switch}_sdp")(switch not in enabled)
    line = set_attention_backend(name, "cpu")
    assert enabled_backends() == enabled
    first = "cudnn, " if name == "cudnn" else ""  # the line lists torch's order: cuDNN first where it is on
    assert line == f"attention: {name} ({first}{', '.join(e for e in enabled if e != 'cudnn')})"


def test_a_choice_the_device_cannot_run_stops_at_start_up_naming_the_flag():
    # memory-efficient attention has no CPU kernel: the start-up check's attention fails, not a run's first step
    with pytest.raises(InputError, match=r"^--attention-backend efficient cannot run attention on cpu .*auto"):
        set_attention_backend("efficient", "cpu")
    with pytest.raises(InputError, match=r"^--attention-backend fast: choose one of auto, flash, efficient, math"):
        set_attention_backend("fast", "cpu")
    assert ATTENTION_BACKENDS == ("auto", "flash", "efficient", "math", "cudnn")


def test_math_and_flash_agree_on_cpu():
    """The choice changes kernels, not the function: math and flash give the same attention to float tolerance."""
    q, k, v = torch.randn(3, 2, 4, 33, 64, generator=torch.Generator().manual_seed(0)).unbind(0)
    out = {}
    for name in ("math", "flash"):
        set_attention_backend(name, "cpu")
        out[name] = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out["flash"], out["math"], atol=1e-5, rtol=1e-5)


def calls_in(path: Path, function: str) -> set[str]:
    """Names of the functions called in the body of `function` (a def or Class.method) of the file at `path`."""
    tree = ast.parse(path.read_text())
    cls, _, name = function.rpartition(".")
    scope = tree
    if cls:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in ast.walk(scope) if isinstance(n, ast.FunctionDef) and n.name == name)
    return {
        c.func.id if isinstance(c.func, ast.Name) else c.func.attr
        for c in ast.walk(fn)
        if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))
    }


# every entry point that can put a model on a GPU, and the function of it that must call set_attention_backend
ENTRY_POINTS = [
    ("common/runs.py", "Run.__init__"),  # the six training scripts: each main() builds a Run (checked below)
    ("common/evaluate.py", "main"),  # python -m common.evaluate
    ("common/rewards.py", "serve_main"),  # python -m common.rewards serve
    ("benchmarks/gpu/rlr_memory.py", "worker"),  # --device cuda
    ("benchmarks/gpu/gpu_backward_check.py", "one"),  # each variant's child process
]


@pytest.mark.parametrize("path, function", ENTRY_POINTS)
def test_every_entry_point_sets_the_attention_backend(path, function):
    assert "set_attention_backend" in calls_in(ROOT / path, function), f"{path}: {function} must set the backends"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_sets_the_flag_before_its_models(script, monkeypatch, tmp_path):
    """A script's main() (through the Run it builds) sets the backends before any model is loaded: its first
    load_model call, here stopped, finds `--attention-backend math` in force."""
    import importlib

    import tyro

    module = importlib.import_module(script)

    class Loaded(Exception):
        pass

    def stop(*a, **kw):
        raise Loaded(enabled_backends())

    monkeypatch.setattr(module, "load_model", stop)
    set_attention_backend("auto", "cpu")
    args = tyro.cli(module.Args, args=["--attention-backend", "math", "--output-dir", str(tmp_path), "--no-save"])
    with pytest.raises(Loaded) as e:
        module.main(args)
    assert e.value.args[0] == ["math"]


def test_the_flag_reaches_the_run_and_its_banner(tmp_path):
    from accelerate import Accelerator

    from common.flags import RunArgs
    from common.runs import Run

    set_attention_backend("auto", "cpu")
    args = RunArgs(exp_name="t", output_dir=str(tmp_path), lora=False, attention_backend="math")
    run = Run(args, Accelerator(cpu=True), "test")
    assert enabled_backends() == ["math"]
    assert run.attention == "attention: math (math)"


def test_the_server_and_the_evaluator_take_the_flag(monkeypatch, tmp_path):
    """`python -m common.rewards serve --attention-backend math` and `common.evaluate --attention-backend math` set
    math before any model loads (each stopped at its first model)."""
    import types

    from common import evaluate, remote, rewards

    class Loaded(Exception):
        pass

    def stop(*a, **kw):
        raise Loaded(enabled_backends())

    monkeypatch.setitem(rewards.REWARDS, "probe", rewards.RewardKind(stop, differentiable=False))
    monkeypatch.setattr(remote, "serve", lambda *a, **kw: types.SimpleNamespace(server_port=0, serve_forever=None))
    set_attention_backend("auto", "cpu")
    with pytest.raises(Loaded) as e:
        rewards.serve_main(["serve", "--reward", "probe", "--device", "cpu", "--attention-backend", "math"])
    assert e.value.args[0] == ["math"]

    import common.models

    set_attention_backend("auto", "cpu")
    monkeypatch.setattr(common.models, "load_model", stop)
    args = evaluate.EvalArgs(out=str(tmp_path), attention_backend="flash", max_prompts=2, samples_per_prompt=1)
    with pytest.raises(Loaded) as e:
        evaluate.main(args)
    assert e.value.args[0] == ["flash"]
