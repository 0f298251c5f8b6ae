"""Bad input to the scripts: one line naming the flag, exit status 2, no traceback, no run folder left behind;
a flag of a mode not in use refused; --help shows the default of a flag that depends on the mode."""

import importlib
import re
import subprocess
import sys

import pytest
import torch
import tyro

from common import InputError
from tests.helpers import ROOT

SCRIPTS = ["dancegrpo.py", "branchgrpo.py", "vgrpo.py", "rlr.py", "diffusionnft.py"]


def bad_inputs(tmp):
    """(case name, extra flags, text the message must hold); every path lives under tmp."""
    (tmp / "latin1.txt").write_bytes("a red circle on a blue background caf\xe9\n".encode("latin-1"))
    (tmp / "a_file").write_text("not a folder\n")
    fake_rw = tmp / "fake_rw"
    (fake_rw / "model").mkdir(parents=True)
    (fake_rw / "tokenizer").mkdir()
    (fake_rw / "model" / "config.json").write_text("{ not json")
    fake_ckpt = tmp / "run__0__1" / "checkpoints" / "iter_000002"
    fake_ckpt.mkdir(parents=True)
    (fake_ckpt / "model.safetensors").write_bytes(b"garbage")
    return {
        "model-dir": (["--model-id", "/nonexistent/model-dir"], "--model-id /nonexistent/model-dir"),
        "prompts": (["--prompts", "/nonexistent/prompts.txt"], "--prompts '/nonexistent/prompts.txt'"),
        "reward-ckpt": (["--reward-ckpt", "shapes=/nonexistent/rw"], "--reward-ckpt shapes=/nonexistent/rw"),
        "output-dir": (["--output-dir", str(tmp / "a_file")], "--output-dir"),
        "not-utf8": (["--eval-prompts", str(tmp / "latin1.txt")], "not UTF-8"),
        "reward-not-a-checkpoint": (["--reward-ckpt", f"shapes={fake_rw}"], "not a ShapesBench reward model"),
        "resume-foreign": (["--resume-from", str(fake_ckpt), "--eval-every", "0"], "is not a checkpoint"),
        "hub-offline": (["--model-id", "black-forest-labs/FLUX.1-dev"], "not in the local Hugging Face cache"),
        "reward-offline": (["--reward", "hpsv2.1"], "--reward-ckpt hpsv2.1="),
    }


ALL = [
    "model-dir",
    "prompts",
    "reward-ckpt",
    "output-dir",
    "not-utf8",
    "reward-not-a-checkpoint",
    "resume-foreign",
    "hub-offline",
    "reward-offline",
]
# every case on dancegrpo.py; the four the review found on each of the others
CASES = [("dancegrpo.py", c) for c in ALL] + [(s, c) for s in SCRIPTS[1:] for c in ALL[:4]]


@pytest.mark.parametrize("script,case", CASES)
def test_bad_input_is_one_clear_line(tmp_path, script, case):
    flags, expected = bad_inputs(tmp_path)[case]
    out_dir = tmp_path / "runs"
    cmd = [sys.executable, script, "--output-dir", str(out_dir), "--iterations", "1", *flags]
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and expected in last, last
    assert not out_dir.exists() or not any(out_dir.iterdir())  # no empty run folder left behind


@pytest.mark.parametrize(
    "script, flags, message",
    [
        ("dancegrpo", ["--window-shift-every", "5"], "--window-shift-every only applies with --sde-window"),
        ("branchgrpo", ["--window", "3"], "--window only applies with --pruning depth or mix"),
        ("vgrpo", ["--kl-ref", "behaviour"], "--kl-ref only applies with --kl-beta > 0"),
        ("rlr", ["--zo-scale", "0.01"], "--zo-scale only applies with --terms with zo"),
        ("rlr", ["--ho-step-gb", "4"], "--ho-step-gb only applies with --memory-budget-gb"),
        ("rlr", ["--terms", "fo", "--subchain-len", "3"], "--subchain-len only applies with --terms with ho"),
    ],
)
def test_a_flag_of_a_mode_not_in_use_is_refused(script, flags, message):
    module = importlib.import_module(script)
    with pytest.raises(InputError, match=re.escape(message)):
        module.resolve_and_check(tyro.cli(module.Args, args=flags))


@pytest.mark.parametrize(
    "script, shown, nones",
    [
        (
            "dancegrpo",
            [
                "(default: 0.3 with --sde-type dance, 0.7 with flow, 0.8 with cps)",
                "(default: 0.6; 1.0 with --sde-window)",
                "(default: 1e-3; 1e-5 with --sde-type cps, 2e-6 with --objective guard)",
                "(default: 5; none with --objective dppo)",
            ],
            1,
        ),
        ("branchgrpo", ["(default: the steps after the last split for depth, 4 for mix)"], 1),
        ("rlr", ["(default: 2, the paper's)", "(default: one per rollout chunk)"], 3),
    ],
)
def test_help_shows_the_default_of_a_flag_that_depends_on_the_mode(script, shown, nones, capsys):
    module = importlib.import_module(script)
    with pytest.raises(SystemExit):
        tyro.cli(module.Args, args=["--help"])
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())  # the help box's lines joined
    for default in shown:
        assert default in text
    # None only where it is the value: --resume-from (a new run); rlr's --memory-budget-gb and --dcot-prompts (off)
    assert text.count("(default: None)") == nones


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--kl-beta", "abc"], "--kl-beta FLOAT"),
        (["--group-size", "2.5"], "--group-size INT"),
        (["--sde-type", "sde"], "--sde-type"),
        (["--kl-bet", "1"], "perhaps you meant --kl-beta FLOAT"),
    ],
)
def test_a_flag_that_does_not_parse_is_one_error_line(argv, named, capsys):
    import dancegrpo
    from common.flags import parse_flags

    with pytest.raises(SystemExit) as e:
        parse_flags(dancegrpo.Args, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and named in err[0], err


def test_the_reward_servers_flags_that_do_not_parse_are_one_error_line():
    out = subprocess.run([sys.executable, "-m", "common.rewards", "serve", "--reward", "jpeg", "--port", "x"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: Error parsing --port: invalid literal for int() with base 10: 'x' (expected --port INT); `python -m "
        "common.rewards serve --help` lists every flag"
    ]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_reward_that_gives_a_non_finite_score_stops_the_run_naming_it(bad, monkeypatch):
    from common import RunError, rewards

    score = lambda x, p: x.mean((1, 2, 3)) * torch.tensor([1.0, bad])  # noqa: E731
    kind = rewards.RewardKind(lambda device, checkpoint=None: rewards.ScoreFn(score, True), differentiable=True)
    monkeypatch.setitem(rewards.REWARDS, "broken", kind)
    composite = rewards.build_reward(rewards.parse_rewards("jpeg:1,broken:0"), "cpu")  # even at weight 0 (logged)
    with pytest.raises(RunError, match=r"reward 'broken' gave (nan|inf) for image 1 \(prompt 'b'\)"):
        composite(torch.rand(2, 3, 8, 8), ["a", "b"])
