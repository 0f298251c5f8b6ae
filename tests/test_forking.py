"""A fork changes few places, and each place is a function, a field of Args or one call in main(): the forks here are
made from the scripts' syntax trees (a function found by its name, one statement of it added or its body replaced;
a field added to Args; a keyword added to the one call of a function in main()), never from their text, so they
are the same forks whatever else a script's lines say, a researcher's fork of it included. Each fork runs one
iteration in this process (its file imported as a module of its own) and is checked by the figures it logs:
  - the objective changed in its one function (doubled; RLR: the weights of its half-order term; DiffusionNFT: its
    NFT term) logs exactly twice the original's figure (the gradient norm, before clipping; RLR: the half-order
    weights; DiffusionNFT: the loss itself) from the same rollout;
  - a term added to `loss` ahead of the KL term is in the loss and its gradient with the KL on;
  - a new term with its flag and figure, a new advantage flag, a new sampler step, a reward registered from the
    fork's own file, a new model kind, and a loss that is NaN (stopped after three iterations, in a process of its
    own) each take the places docs/forking.md's table counts."""

import ast
import dataclasses
import importlib
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch
import tyro
from safetensors.torch import load_file

from common import rewards
from tests.helpers import ROOT, find_run, metrics, run_in_process

QUICK = ["--iterations", "1", "--eval-every", "0", "--sample-every", "0", "--no-save"]
FLAGS = {  # one optimizer step per iteration, so every logged figure comes from the same, unchanged weights
    "dancegrpo.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4",
                     "--samples-per-update", "4", "--num-steps", "4"],
    "branchgrpo.py": ["--trees-per-device", "1", "--trees-per-update", "1", "--num-steps", "6", "--num-splits", "2",
                      "--rollout-batch-size", "4"],
    "vgrpo.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4", "--train-batch-size",
                 "2", "--samples-per-update", "4", "--num-steps", "4", "--n-mc", "2"],
    "rlr.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "2", "--num-steps", "4"],
    "diffusionnft.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4",
                        "--train-batch-size", "4", "--samples-per-update", "4", "--num-steps", "4",
                        "--timestep-fraction", "0.5"],
}  # fmt: skip
# (the objective's function, the variable it assigns first that the edit doubles, the edit, the figure that doubles)
OBJECTIVES = {
    "dancegrpo.py": ("policy_loss", "loss", "loss = 2 * loss", "charts/grad_norm"),
    "branchgrpo.py": ("policy_loss", "loss", "loss = 2 * loss", "charts/grad_norm"),
    "vgrpo.py": ("policy_loss", "loss", "loss = 2 * loss", "charts/grad_norm"),
    "rlr.py": ("term_weights", "w_ho", "w_ho, w_zo = 2 * w_ho, 2 * w_zo", "rlr/ho_adv_abs"),
    "diffusionnft.py": ("policy_loss", "loss", "loss = 2 * loss", "losses/policy"),
}


# ---------------------------------------------------------------- forks, made on the syntax tree
def tree_of(script: str) -> ast.Module:
    return ast.parse((ROOT / script).read_bytes())


def function(tree: ast.Module, name: str) -> ast.FunctionDef:
    """The module-level function `name` (exactly one)."""
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return fn


def statements(source: str) -> list[ast.stmt]:
    return ast.parse(source).body


def names(node: ast.AST) -> set[str]:
    """The variables and functions `node` reads."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def assigns(node: ast.stmt, name: str) -> bool:
    """Whether the statement `node` assigns the variable `name` (alone or in a tuple)."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    names = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
    return any(isinstance(t, ast.Name) and t.id == name for t in names)


def after_first_assignment(tree: ast.Module, fn: str, variable: str, source: str) -> int:
    """Edit one place: `source` inserted right after the first statement of `fn`'s body that assigns `variable`."""
    body = function(tree, fn).body
    i = next(i for i, node in enumerate(body) if assigns(node, variable))
    body[i + 1 : i + 1] = statements(source)
    return 1


def before_return(tree: ast.Module, fn: str, source: str) -> None:
    """`source` inserted right before the last statement of `fn`, its return (part of an edit of `fn`)."""
    body = function(tree, fn).body
    assert isinstance(body[-1], ast.Return), fn
    body[-1:-1] = statements(source)


def add_keyword(tree: ast.Module, fn: str, name: str, default) -> None:
    """A keyword-only argument `name` with its default added to `fn` (part of an edit of `fn`)."""
    args = function(tree, fn).args
    args.kwonlyargs.append(ast.arg(name))
    args.kw_defaults.append(ast.Constant(default))


def add_field(tree: ast.Module, source: str) -> int:
    """Edit one place: a field (`source`: its line and docstring) added at the end of Args."""
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args"]
    cls.body += statements(source)
    return 1


def pass_flag(tree: ast.Module, fn: str, flag: str) -> int:
    """Edit one place: `flag=args.flag` added to the one call of `fn` in main(). None where that call passes every
    keyword-only argument of `fn` by name already (`**flags_of(fn, args)`)."""
    (call,) = [
        c for c in ast.walk(function(tree, "main")) if isinstance(c, ast.Call) and getattr(c.func, "id", "") == fn
    ]
    if any(k.arg is None for k in call.keywords):
        return 0
    call.keywords.append(ast.keyword(flag, ast.Attribute(ast.Name("args", ast.Load()), flag, ast.Load())))
    return 1


def fresh(name: str, taken) -> str:
    """`name`, or `name` with the first number that makes it new: the script forked here may be a fork already, with
    a flag, a figure or a reward of that name of its own."""
    n = 2
    out = name
    while out in taken:
        out, n = f"{name}{n}", n + 1
    return out


def taken_names(script: str, *functions: str) -> set[str]:
    """The flags of `script` and the arguments of its `functions`: what a new flag must not be called."""
    module = original(script)
    names = {f.name for f in dataclasses.fields(module.Args)}
    return names | {p for fn in functions for p in inspect.signature(getattr(module, fn)).parameters}


def load_fork(tree: ast.Module, path, monkeypatch):
    """The fork's file written from `tree` and imported as the module `path.stem`, as its own process would import
    it: a reward it registers goes into a registry of its own, then joins the registry for the test's length."""
    path.parent.mkdir(exist_ok=True)
    path.write_text(ast.unparse(ast.fix_missing_locations(tree)))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, path.stem, module)
    before, mine = rewards.REWARDS, {}
    monkeypatch.setattr(rewards, "REWARDS", mine)
    spec.loader.exec_module(module)
    monkeypatch.setattr(rewards, "REWARDS", {**before, **mine})
    return module


def run(module, flags, out, name) -> list[dict]:
    """module.main() on `flags` in this process: its training rows."""
    module.main(tyro.cli(module.Args, args=[*flags, *QUICK, "--output-dir", str(out), "--exp-name", name]))
    return [r for r in metrics(find_run(out / name)) if "rewards/mean" in r]


def original(script: str):
    return importlib.import_module(script.removesuffix(".py"))


# ---------------------------------------------------------------- the forks
@pytest.mark.parametrize("script", list(OBJECTIVES))
def test_a_fork_changes_its_objective_in_one_function(script, tmp_path, monkeypatch):
    fn, variable, edit, figure = OBJECTIVES[script]
    tree = tree_of(script)
    assert after_first_assignment(tree, fn, variable, edit) == 1  # the one edit
    fork = load_fork(tree, tmp_path / "fork" / f"my_{script}", monkeypatch)
    (before,) = run(original(script), FLAGS[script], tmp_path / "runs", "original")
    (forked,) = run(fork, FLAGS[script], tmp_path / "runs", "fork")
    assert forked[figure] == 2 * before[figure] != 0  # the fork's objective is the one that ran
    assert forked["rewards/mean"] == before["rewards/mean"]  # and the rollout is the same


def dance_inputs():
    """policy_loss's arguments for 3 samples of 2 x 4 latents, the policy and the base model apart."""
    g = torch.Generator().manual_seed(0)
    mean, old_mean, mean_ref = torch.randn(3, 3, 2, 4, generator=g).unbind(0)
    log_prob = torch.randn(3, generator=g).requires_grad_()
    old_log_prob, adv, std = log_prob.detach() + 0.01, torch.tensor([1.0, -0.5, 0.25]), torch.full((3,), 0.3)
    return log_prob, old_log_prob, adv, mean, old_mean, mean_ref, std


LOSSES = {  # script: (its policy_loss called on inputs where the KL term is on (kl_beta 0.5), the log-prob)
    "dancegrpo.py": lambda loss, x: loss(
        x[0], x[1], x[2], x[3], x[4], x[5], x[6], 0.1, objective="clip", clip_range=0.2, kl_mask_threshold=1e-5,
        kl_beta=0.5,
    ),
    "branchgrpo.py": lambda loss, x: loss(x[0], x[1], x[2], x[3], x[5], x[6], clip_range=0.2, kl_beta=0.5),
}  # fmt: skip


@pytest.mark.parametrize("script", list(LOSSES))
def test_a_term_added_to_the_loss_ahead_of_the_kl_stays_in_it(script, tmp_path, monkeypatch):
    """`loss = loss + 0.5 * log_prob` right after `loss` is first assigned (the surrogate): with the KL term on, the
    fork's loss is the original's plus exactly that term, and its gradient in the log-prob 0.5 more."""
    tree = tree_of(script)
    after_first_assignment(tree, "policy_loss", "loss", "loss = loss + 0.5 * log_prob")
    fork = load_fork(tree, tmp_path / "fork" / f"term_{script}", monkeypatch)
    inputs = dance_inputs()
    (mine, figures), (theirs, theirs_figures) = (
        LOSSES[script](m.policy_loss, inputs) for m in (fork, original(script))
    )
    assert theirs_figures["kl"] > 0  # the KL term is on
    torch.testing.assert_close(mine - theirs, 0.5 * inputs[0], rtol=0, atol=1e-6)
    (grad,) = torch.autograd.grad(mine.sum() - theirs.sum(), inputs[0])
    torch.testing.assert_close(grad, torch.full((3,), 0.5))


@pytest.mark.parametrize("script", ["dancegrpo.py", "branchgrpo.py"])
def test_a_new_term_with_its_flag_and_figure_is_three_edits(script, tmp_path, monkeypatch):
    """Edit 1: a field of Args. Edit 2: policy_loss takes it as a keyword argument with a default, adds the term to
    `loss` and returns its figure, which LOGGING writes. Edit 3: main() passes the flag where it calls policy_loss
    (no edit where it passes every keyword with **flags_of)."""
    name = fresh("nll_coef", taken_names(script, "policy_loss"))  # its flag, its keyword and its figure
    tree = tree_of(script)
    places = add_field(tree, f'{name}: float = 0.0\n"""weight of a negative log-likelihood term"""')
    add_keyword(tree, "policy_loss", name, 0.0)
    before_return(tree, "policy_loss", f'loss = loss - {name} * log_prob\nfigures["{name}"] = -log_prob.mean()')
    places += 1 + pass_flag(tree, "policy_loss", name)
    assert places <= 3
    fork = load_fork(tree, tmp_path / "fork" / f"nll_{script}", monkeypatch)
    (before,) = run(original(script), FLAGS[script], tmp_path / "runs", "original")
    (forked,) = run(fork, [*FLAGS[script], f"--{name.replace('_', '-')}", "0.5"], tmp_path / "runs", "fork")
    assert f"losses/{name}" not in before and forked[f"losses/{name}"] != 0  # the new figure, logged
    assert forked["rewards/mean"] == before["rewards/mean"]  # the same rollout,
    assert forked["charts/grad_norm"] != before["charts/grad_norm"]  # another objective: the flag reached it
    (zero,) = run(fork, FLAGS[script], tmp_path / "runs", "zero")  # its default: the original's objective
    assert zero["charts/grad_norm"] == before["charts/grad_norm"]


def test_a_new_advantage_flag_is_three_edits(tmp_path, monkeypatch):
    """Edit 1: a field of Args. Edit 2: the advantage function takes it as a keyword argument and uses it. Edit 3:
    main() passes the flag where it calls the function. Advantages scaled by 2 (below the clip of 5: a group of 4
    has |A| <= 1.5) double the first update's gradient, whose ratio is 1."""
    name = fresh("adv_scale", taken_names("dancegrpo.py", "combined_advantages"))
    tree = tree_of("dancegrpo.py")
    places = add_field(tree, f'{name}: float = 1.0\n"""advantages times this"""')
    add_keyword(tree, "combined_advantages", name, 1.0)
    after_first_assignment(tree, "combined_advantages", "adv", f"adv = {name} * adv")
    places += 1 + pass_flag(tree, "combined_advantages", name)
    assert places <= 3
    fork = load_fork(tree, tmp_path / "fork" / "scaled_dancegrpo.py", monkeypatch)
    (before,) = run(original("dancegrpo.py"), FLAGS["dancegrpo.py"], tmp_path / "runs", "original")
    (forked,) = run(fork, [*FLAGS["dancegrpo.py"], f"--{name.replace('_', '-')}", "2"], tmp_path / "runs", "fork")
    assert forked["rewards/mean"] == before["rewards/mean"]  # the same rollout
    assert forked["charts/grad_norm"] == pytest.approx(2 * before["charts/grad_norm"], rel=1e-5)


HALF_STEP = """
def half_step(x, v, sigma, sigma_next, g, prev_sample=None, noise=None):
    return sde_step(x, v, sigma, sigma_next, g / 2, prev_sample, noise)  # DanceGRPO's step at half its noise
"""


def test_a_new_sampler_step_is_three_edits(tmp_path, monkeypatch):
    """Edit 1: the choice in Args.sde_type's Literal. Edit 2: the step function, with sde_step's arguments and outputs
    (x_next, log_prob, mean, std). Edit 3: the line of main() that picks the step, used by the rollout and by
    training alike. The fork's rollout differs from DanceGRPO's at the same noise level, and its first ratio is
    exactly 1."""
    tree = tree_of("dancegrpo.py")
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args"]
    (field,) = [n for n in cls.body if isinstance(n, ast.AnnAssign) and n.target.id == "sde_type"]
    field.annotation.slice.elts.append(ast.Constant("half"))  # edit 1
    tree.body.insert(tree.body.index(function(tree, "sde_step")) + 1, *statements(HALF_STEP))  # edit 2
    main = function(tree, "main")
    (pick,) = [n for n in ast.walk(main) if isinstance(n, ast.Assign) and names(n.value) >= {"sde_step"}]
    pick.value = ast.parse(f'half_step if args.sde_type == "half" else ({ast.unparse(pick.value)})').body[0].value
    fork = load_fork(tree, tmp_path / "fork" / "half_dancegrpo.py", monkeypatch)  # edit 3, above
    flags = [*FLAGS["dancegrpo.py"], "--noise-level", "0.5"]
    (before,) = run(original("dancegrpo.py"), [*flags, "--sde-type", "dance"], tmp_path / "runs", "original")
    (forked,) = run(fork, [*flags, "--sde-type", "half"], tmp_path / "runs", "fork")
    assert forked["rewards/mean"] != before["rewards/mean"] and forked["losses/first_ratio_max_dev"] == 0


DRGRPO = """
def group_advantages(rewards, group_size):
    R = rewards.view(-1, group_size).double()
    return (R - R.mean(1, keepdim=True)).flatten().float()
"""
REWARD = """
from common.rewards import ScoreFn, register_reward

register_reward("{name}", lambda device, checkpoint=None: ScoreFn(lambda x, p: x.mean((1, 2, 3)), True), True)
"""


def test_a_dancegrpo_fork_changes_loss_advantage_and_reward_each_in_one_place(tmp_path, monkeypatch):
    """docs/forking.md's fork: a higher upper clip in policy_loss (DAPO's clip-higher), group_advantages without the
    std normalisation (Dr. GRPO) and a reward registered from the fork's own file, each in one place; the reward is
    logged with the others and weighs in the sum."""
    original("dancegrpo.py")  # imported: the rewards it registers itself are in the registry
    name = fresh("brightness", rewards.REWARDS)
    tree = tree_of("dancegrpo.py")
    clamps = [
        c
        for c in ast.walk(function(tree, "policy_loss"))
        if isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "clamp" and names(c.args[0]) == {"ratio"}
    ]
    assert len(clamps) == 1
    clamps[0].args[2] = ast.parse("1 + 2 * clip_range").body[0].value  # 1. the loss
    function(tree, "group_advantages").body = statements(DRGRPO)[0].body  # 2. the advantage
    (args,) = [i for i, n in enumerate(tree.body) if isinstance(n, ast.ClassDef) and n.name == "Args"]
    tree.body[args:args] = statements(REWARD.format(name=name))  # 3. the reward, above Args
    fork = load_fork(tree, tmp_path / "fork" / "brightgrpo.py", monkeypatch)
    flags = [*FLAGS["dancegrpo.py"], "--reward", f"shapes:1,{name}:0.5"]
    (record,) = run(fork, flags, tmp_path / "runs", "bright")
    assert 0 < record[f"rewards/{name}"] < 1 and record["rewards/shapes"] != 0
    assert record["rewards/mean"] == pytest.approx(record["rewards/shapes"] + 0.5 * record[f"rewards/{name}"])
    R = torch.tensor([[1.0, 2.0, 4.0, 5.0]])
    assert fork.group_advantages(R.flatten(), 4).tolist() == [-2.0, -1.0, 1.0, 2.0]  # no std normalisation


def test_a_fork_whose_loss_is_nan_stops_after_three_iterations_with_its_checkpoints_intact(tmp_path):
    """A bug that makes every loss NaN (here: the objective times NaN) skips every update; the third iteration in a
    row without a step stops the run with one `error:` line, exit 1, no final/, the checkpoints before it intact."""
    tree = tree_of("dancegrpo.py")
    after_first_assignment(tree, "policy_loss", "loss", "loss = loss * float('nan')")
    fork = tmp_path / "fork" / "nan_dancegrpo.py"
    fork.parent.mkdir()
    fork.write_text(ast.unparse(ast.fix_missing_locations(tree)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    flags = [
        *FLAGS["dancegrpo.py"],
        "--iterations",
        "5",
        "--eval-every",
        "0",
        "--sample-every",
        "0",
        "--save-every",
        "1",
    ]
    cmd = [sys.executable, str(fork), *flags, "--output-dir", str(tmp_path / "runs"), "--exp-name", "nan"]
    done = subprocess.run(cmd, cwd=fork.parent, capture_output=True, text=True, env=env)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert errors[0].startswith("error: every update of iterations 0-2 had a non-finite gradient norm")
    run_dir = find_run(tmp_path / "runs" / "nan")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["iter_000001", "iter_000002"]
    assert not (run_dir / "final").exists()
    assert [r["charts/skipped_updates"] for r in metrics(run_dir)] == [1, 1, 1]


NEW_KIND = '''"""A FLUX.1 fine-tune shipped with a pipeline class of its own, whose adapter goes on the queries and values only."""

from diffusers import FluxPipeline

from common.models.flux import FluxModel


class MyFluxPipeline(FluxPipeline):
    pass


class MyFluxModel(FluxModel):
    kind = "myflux"
    pipeline = MyFluxPipeline  # loads the folder, saves final/
    lora_targets = ["to_q", "to_v"]
'''


@pytest.fixture
def kind_module(tmp_path, monkeypatch):
    """The new kind's module (edit 1), importable; its registration taken out again after the test."""
    from common import models

    (tmp_path / "myflux.py").write_text(NEW_KIND)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "myflux", raising=False)
    import myflux

    yield myflux
    if any(k.cls.kind == "myflux" for k in models.REGISTRY):
        models.unregister_kind("myflux")


def test_a_new_model_kind_is_its_module_and_one_registry_entry(kind_module, tmp_path):
    """Edit 1: the kind's module (its wrapper class: name, pipeline class, LoRA targets). Edit 2: its entry in
    common.models.REGISTRY (here registered at run time, as a fork's own file would). Nothing else: a folder whose
    model_index.json names the new pipeline class loads as the new kind, dancegrpo.py trains an iteration on it with
    the module's LoRA targets, and the pipeline class reads final/."""
    from common import models
    from tests.tiny import RES, build_flux

    entry = models.Kind(kind_module.MyFluxModel, ("MyFluxPipeline",))
    models.register_kind(entry)  # edit 2
    with pytest.raises(ValueError, match="'myflux' is registered already"):
        models.register_kind(entry)
    folder = tmp_path / "model"
    build_flux(folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "MyFluxPipeline"}))
    (tmp_path / "prompts.txt").write_text("a red circle\na green square\n")
    assert models.check_model_id(str(folder)) == "myflux"
    flags = [*FLAGS["dancegrpo.py"], "--model-id", str(folder), "--resolution", str(RES), "--prompts",
             str(tmp_path / "prompts.txt"), "--eval-prompts", str(tmp_path / "prompts.txt"), "--reward", "jpeg",
             "--lora-rank", "4", "--iterations", "1", "--eval-every", "0", "--sample-every", "0", "--exp-name", "new"]  # fmt: skip
    run_in_process("dancegrpo.py", flags, tmp_path / "runs")
    run_dir = find_run(tmp_path / "runs" / "new")
    assert len([r for r in metrics(run_dir) if "rewards/jpeg" in r]) == 1
    layers = load_file(run_dir / "final" / "pytorch_lora_weights.safetensors")
    assert {k.split(".lora_")[0].rsplit(".", 1)[1] for k in layers} == {"to_q", "to_v"}  # the module's targets
    pipe = kind_module.MyFluxPipeline.from_pretrained(folder)
    pipe.load_lora_weights(str(run_dir / "final"))
    assert pipe.transformer.peft_config
    assert models.unregister_kind("myflux") is entry  # and out again: a folder of that class is no kind now
    with pytest.raises(Exception, match="MyFluxPipeline"):
        models.check_model_id(str(folder))
