"""Unit tests of the command line's building blocks, in process: in_the_way and write_atomically (common), and the
shared flags' checks, --help's order and cli()'s exit statuses (common.flags). Each expected value is worked out by
hand from the documented behaviour."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import pytest

from common import InputError, RunError, in_the_way, write_atomically
from common.flags import (
    RunArgs,
    check_flags,
    check_guidance_scale_2,
    check_mode_flags,
    check_not_shapesbench,
    check_run_args,
    check_shift,
    cli,
    divides,
    parse_flags,
)
from common.prompts import HPDV2_HOWTO

TAIL = "; free some space or fix the folder's permissions"


# ------------------------------------------------------------------------------------------ in_the_way
def test_in_the_way_folder_fifo_links_and_files(tmp_path):
    (tmp_path / "d").mkdir()
    assert in_the_way(tmp_path / "d") == f"{tmp_path / 'd'} is a folder"
    os.mkfifo(tmp_path / "fifo")
    assert in_the_way(tmp_path / "fifo") == f"{tmp_path / 'fifo'} is not a file"
    (tmp_path / "f").write_text("x")
    assert in_the_way(tmp_path / "f") == ""
    assert in_the_way(tmp_path / "f" / "g.txt") == f"{tmp_path / 'f'} is not a folder"
    (tmp_path / "link").symlink_to(tmp_path / "d")
    assert in_the_way(tmp_path / "link" / "g.txt", within=tmp_path) == f"{tmp_path / 'link'} is a symbolic link"
    assert in_the_way(tmp_path / "link" / "g.txt", within=tmp_path / "link") == ""  # a link above `within`: allowed
    assert in_the_way(tmp_path / "link" / "g.txt") == ""


# ------------------------------------------------------------------------------------------ write_atomically
def test_write_atomically_text_bytes_callable_mode_and_no_leftover(tmp_path, monkeypatch):
    old = os.umask(0o022)
    try:
        out = write_atomically(tmp_path / "a" / "b" / "t.txt", "héllo", "--out", "the test")  # folders made
        assert out == tmp_path / "a" / "b" / "t.txt" and out.read_bytes() == "héllo".encode()
        assert out.stat().st_mode & 0o777 == 0o644
        assert write_atomically(tmp_path / "b.bin", b"\x00\xff", "--out", "the test").read_bytes() == b"\x00\xff"
        write_atomically(tmp_path / "c.txt", lambda p: Path(p).write_text("made"), "--out", "the test")
        assert (tmp_path / "c.txt").read_text() == "made"
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b.bin", "c.txt"]


def test_write_atomically_refuses_what_is_in_the_way(tmp_path):
    (tmp_path / "r.md").mkdir()
    with pytest.raises(InputError) as e:
        write_atomically(tmp_path / "r.md", "x", "--out", "the report")
    assert (
        str(e.value)
        == f"--out: {tmp_path / 'r.md'} is a folder, where the report writes r.md; remove it, or give another --out"
    )


def test_write_atomically_planted_link_at_the_temporary_name(tmp_path, monkeypatch):
    target = tmp_path / "outside.txt"
    target.write_text("keep")
    path = tmp_path / "w.txt"
    tmp = tmp_path / f".w.txt.{os.getpid()}.tmp"
    tmp.symlink_to(target)  # a leftover link: removed, never written through
    write_atomically(path, "new", "--out", "the test")
    assert path.read_text() == "new" and target.read_text() == "keep" and not tmp.is_symlink()

    unlink, calls = Path.unlink, []

    def plant(self, missing_ok=False):  # a link planted between the removal and the open
        calls.append(self)
        unlink(self, missing_ok=missing_ok)
        if len(calls) == 1:
            self.symlink_to(target)

    monkeypatch.setattr(Path, "unlink", plant)
    with pytest.raises(RunError) as e:
        write_atomically(path, "evil", "--out", "the test")
    assert str(e.value) == f"cannot write {path} (FileExistsError: [Errno 17] File exists: '{tmp}'){TAIL}"
    assert target.read_text() == "keep" and path.read_text() == "new" and not tmp.is_symlink()


def test_write_atomically_callable_that_makes_a_link(tmp_path):
    path, tmp = tmp_path / "m.pt", tmp_path / f".m.pt.{os.getpid()}.tmp"
    with pytest.raises(RunError) as e:
        write_atomically(path, lambda p: Path(p).symlink_to(tmp_path), "--out", "the test")
    assert str(e.value) == f"cannot write {path} (OSError: {tmp} became a symbolic link while written){TAIL}"
    assert list(tmp_path.iterdir()) == []


def fail(error):
    def write(p):
        Path(p).write_text("partial")
        raise error

    return write


def test_write_atomically_run_error_messages(tmp_path):
    path = tmp_path / "x.txt"
    cases = [
        (RuntimeError("a" * 250 + "\nsecond line"), f"RuntimeError: {'a' * 200}"),
        (RuntimeError(""), "RuntimeError: "),
        (OSError(errno.ENOSPC, "No space left on device"), "OSError: [Errno 28] No space left on device"),
    ]
    for error, shown in cases:
        with pytest.raises(RunError) as e:
            write_atomically(path, fail(error), "--out", "the test")
        assert str(e.value) == f"cannot write {path} ({shown}){TAIL}"
        assert list(tmp_path.iterdir()) == []


def test_write_atomically_cleanup_error_is_ignored(tmp_path, monkeypatch):
    unlink, calls = Path.unlink, []

    def refuse_second(self, missing_ok=False):
        calls.append(self)
        if len(calls) == 2:
            raise PermissionError(errno.EACCES, "Permission denied")
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse_second)
    with pytest.raises(RunError) as e:
        write_atomically(tmp_path / "y.txt", fail(OSError("full")), "--out", "the test")
    assert str(e.value) == f"cannot write {tmp_path / 'y.txt'} (OSError: full){TAIL}"


def test_write_atomically_link_made_during_the_write_is_an_input_error(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "elsewhere").mkdir()

    def swap(p):  # the folder becomes a link while the file is written
        (tmp_path / "sub").rename(tmp_path / "old")
        (tmp_path / "sub").symlink_to(tmp_path / "elsewhere")
        raise OSError("gone")

    with pytest.raises(InputError) as e:
        write_atomically(tmp_path / "sub" / "f.txt", swap, "--out", "the test", within=tmp_path)
    assert str(e.value) == (
        f"--out: {tmp_path / 'sub'} is a symbolic link, where the test writes f.txt; remove it, or give another --out"
    )


# ------------------------------------------------------------------------------------------ small checks
def test_divides():
    assert [divides(d, 4) for d in (0, 1, 2, 3, 4, 8)] == [False, True, True, False, True, False]
    assert divides(-2, 4) is False


def test_check_shift():
    check_shift("pipeline", "flux")
    check_shift(3.0, "shapes")
    check_shift(None, "sd1")
    with pytest.raises(InputError) as e:
        check_shift("pipeline", "shapes")
    assert str(e.value) == "--shift pipeline: ShapesBench has no diffusers pipeline of its own; give a number (3)"


def test_check_mode_flags():
    args = RunArgs(reward_frames=8)
    check_mode_flags(args, [("reward_frames", lambda a: a.reward_frames == 8, "mode X")])
    check_mode_flags(RunArgs(), [("reward_frames", lambda a: False, "mode X")])  # at its default
    with pytest.raises(InputError) as e:
        check_mode_flags(args, [("lora_rank", lambda a: False, "A"), ("reward_frames", lambda a: False, "mode X")])
    assert str(e.value) == "--reward-frames only applies with mode X"


def test_check_guidance_scale_2():
    check_guidance_scale_2(RunArgs(), False)
    check_guidance_scale_2(RunArgs(guidance_scale_2=3.0, guidance_scale=1.5), True)
    with pytest.raises(InputError) as e:
        check_guidance_scale_2(RunArgs(guidance_scale_2=3.0, guidance_scale=4.0), False)
    assert str(e.value) == "--guidance-scale-2 only applies with a two-expert Wan2.2-T2V-A14B"
    with pytest.raises(InputError) as e:
        check_guidance_scale_2(RunArgs(guidance_scale_2=3.0, guidance_scale=1.0), True)
    assert (
        str(e.value)
        == "--guidance-scale-2 needs --guidance-scale > 1: WanPipeline guides (with either scale) only then"
    )


@dataclass
class NotRunArgs:
    model_id: str = "shapesbench"
    shift: Optional[float] = None
    extra: int = 0


def test_check_flags_fills_shift_of_run_args_only():
    args = RunArgs()
    check_flags(args, [("reward_frames", lambda a: False, "video")])
    assert args.shift == 3.0
    given = RunArgs(shift=2.0)
    check_flags(given, [])
    assert given.shift == 2.0
    other = NotRunArgs()
    check_flags(other, [("extra", lambda a: False, "E")])
    assert other.shift is None
    with pytest.raises(InputError, match="^--extra only applies with E$"):
        check_flags(NotRunArgs(extra=1), [("extra", lambda a: False, "E")])


def test_check_not_shapesbench(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a cat\n")
    check_not_shapesbench(RunArgs(model_id="o/m", prompts=str(f), eval_prompts=str(f)))
    for flag, args in (
        ("--prompts", RunArgs(model_id="o/m", eval_prompts=str(f))),
        ("--eval-prompts", RunArgs(model_id="o/m", prompts=str(f))),
    ):
        value = "shapes-train" if flag == "--prompts" else "shapes-eval"
        with pytest.raises(InputError) as e:
            check_not_shapesbench(args)
        assert str(e.value) == (
            f"{flag} {value}: these prompts are ShapesBench's, for --model-id shapesbench only; with --model-id o/m "
            f"pass {flag} FILE, one prompt per line ({HPDV2_HOWTO})"
        )


# ------------------------------------------------------------------------------------------ check_run_args
def fake_model(folder: Path, pipeline: str, two_experts: bool = False) -> str:
    folder.mkdir()
    index = {"_class_name": pipeline} | (
        {"transformer_2": ["diffusers", "WanTransformer3DModel"]} if two_experts else {}
    )
    (folder / "model_index.json").write_text(json.dumps(index))
    return str(folder)


def refusal(args, **kw) -> str:
    with pytest.raises(InputError) as e:
        check_run_args(args, **kw)
    return str(e.value)


def test_check_run_args_output_dir_track_resume(tmp_path, monkeypatch):
    base = RunArgs(output_dir=str(tmp_path / "runs"))
    check_run_args(base)
    (tmp_path / "file").write_text("x")
    assert refusal(replace(base, output_dir=str(tmp_path / "file"))) == (
        f"--output-dir {tmp_path / 'file'}: exists and is not a folder"
    )
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert refusal(replace(base, output_dir=str(tmp_path / "dangling"))) == (
        f"--output-dir {tmp_path / 'dangling'}: a symbolic link to no folder (dangling or looping); give a folder"
    )
    (tmp_path / "linked").symlink_to(tmp_path)
    check_run_args(replace(base, output_dir=str(tmp_path / "linked")))

    real, wandb = importlib.util.find_spec, []
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: (wandb or [None])[0] if name == "wandb" else real(name, *a)
    )
    assert refusal(replace(base, track=True)) == "--track needs wandb: pip install wandb"
    wandb.append(object())
    check_run_args(replace(base, track=True))

    check_run_args(replace(base, resume_from="latest"))
    check_run_args(replace(base, resume_from=str(tmp_path)))
    assert refusal(replace(base, resume_from=str(tmp_path / "gone"))) == (
        f"--resume-from {tmp_path / 'gone'}: no such folder (give 'latest', a run folder or one of its "
        "checkpoints/iter_* folders)"
    )


def test_check_run_args_mode_flags_on_shapesbench(tmp_path):
    base = RunArgs(output_dir=str(tmp_path))
    assert refusal(replace(base, reward_frames=8)) == "--reward-frames only applies with a video model (Wan2.1)"
    assert refusal(replace(base, num_frames=5)) == "--num-frames only applies with a video model (Wan2.1)"
    assert refusal(replace(base, experts="high")) == "--experts only applies with a two-expert Wan2.2-T2V-A14B"
    assert refusal(replace(base, guidance_scale_2=2.0, guidance_scale=3.0)) == (
        "--guidance-scale-2 only applies with a two-expert Wan2.2-T2V-A14B"
    )
    assert refusal(replace(base, shift="pipeline")) == (
        "--shift pipeline: ShapesBench has no diffusers pipeline of its own; give a number (3)"
    )
    check_run_args(replace(base, shift=2.0))


def test_check_run_args_other_models(tmp_path, monkeypatch):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    base = RunArgs(output_dir=str(tmp_path), prompts=str(prompts), eval_prompts=str(prompts))
    wan = fake_model(tmp_path / "wan", "WanPipeline")
    a14b = fake_model(tmp_path / "a14b", "WanPipeline", two_experts=True)
    sd1 = fake_model(tmp_path / "sd1", "StableDiffusionPipeline")
    assert refusal(replace(base, model_id=wan, prompts="shapes-train")).startswith("--prompts shapes-train: these")
    monkeypatch.setattr(sys, "argv", ["/some/where/trainer.py", "second"])
    assert refusal(replace(base, model_id=wan), video=False) == (
        f"--model-id {wan} is a video model (wan), and trainer.py trains image models only (as its paper); train "
        "video with dancegrpo.py, branchgrpo.py or vgrpo.py"
    )
    assert refusal(replace(base, model_id=wan, num_frames=6)).startswith("--num-frames 6: must be 4k + 1")
    assert refusal(replace(base, model_id=wan, experts="low")) == (
        "--experts only applies with a two-expert Wan2.2-T2V-A14B"
    )
    assert refusal(replace(base, model_id=wan, guidance_scale_2=2.0, guidance_scale=3.0)) == (
        "--guidance-scale-2 only applies with a two-expert Wan2.2-T2V-A14B"
    )
    assert refusal(replace(base, model_id=a14b, guidance_scale_2=2.0)) == (
        "--guidance-scale-2 needs --guidance-scale > 1: WanPipeline guides (with either scale) only then"
    )
    for args in (  # past every flag check: only the ShapesBench reward of a real model is left to refuse
        replace(base, model_id=wan, num_frames=9, reward_frames=2, shift=3.0),
        replace(base, model_id=a14b, experts="high", guidance_scale_2=2.0, guidance_scale=3.0, shift="pipeline"),
        replace(base, model_id=sd1),
    ):
        assert refusal(args).startswith("--reward")
    assert refusal(replace(base, model_id=sd1, shift=3.0)) == (
        "--shift only applies with a flow model (SD1.x samples DDIM timesteps)"
    )


# ------------------------------------------------------------------------------------------ parsing and cli()
@dataclass
class Small(RunArgs):
    zeta_own: int = 1
    """a flag of the script's own"""


def test_own_flags_first_in_help_and_command_name(capsys):
    assert parse_flags(Small, ["--zeta-own", "3", "--seed", "2"], command="small") == Small(zeta_own=3, seed=2)
    with pytest.raises(SystemExit) as e:
        parse_flags(Small, ["--help"], command="small")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: small" in out
    assert out.index("--zeta-own") < out.index("--exp-name") < out.index("--wandb-project-name")
    words = " ".join(" ".join(line.strip(" │|") for line in out.splitlines()).split())  # the box unwrapped
    assert "--resolution" in words and "(default: the model's native size)" in words  # a mode's default, in words


def run_cli(monkeypatch, capsys, error):
    def main(args):
        assert isinstance(args, RunArgs) and os.environ["TOKENIZERS_PARALLELISM"] == "false"
        raise error

    monkeypatch.setattr(sys, "argv", ["prog"])
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    with pytest.raises(SystemExit) as e:
        cli(main, RunArgs)
    return e.value.code, capsys.readouterr()


def test_cli_exit_statuses(monkeypatch, capsys):
    code, seen = run_cli(monkeypatch, capsys, InputError("bad flag"))
    assert (code, seen.err, seen.out) == (2, "error: bad flag\n", "")
    code, seen = run_cli(monkeypatch, capsys, RunError("it broke"))
    assert (code, seen.err, seen.out) == (1, "error: it broke\n", "")
    full = OSError(errno.ENOSPC, "No space left on device", "/runs/x.pt")
    code, seen = run_cli(monkeypatch, capsys, full)
    assert (code, seen.err, seen.out) == (1, "error: cannot write /runs/x.pt: No space left on device\n", "")
    code, seen = run_cli(monkeypatch, capsys, OSError(errno.EACCES, "Permission denied"))
    assert (code, seen.err) == (1, "error: cannot write the run folder: Permission denied\n")


def test_cli_reraises_other_os_errors(monkeypatch, capsys):
    with pytest.raises(FileNotFoundError):
        run_cli(monkeypatch, capsys, FileNotFoundError(errno.ENOENT, "No such file", "/x"))
