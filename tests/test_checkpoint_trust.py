"""What a run reads back and where it writes, when its folders hold what it did not put there: a checkpoint resumes
only into its own run, script, seed and settings, with every file the one written and nothing unpickled with code
execution; metrics.jsonl is read line by line; names never become paths; links are never written through."""

import dataclasses
import hashlib
import json
import shutil

import pytest
import torch
from accelerate import Accelerator

from common import InputError, RunError, write_atomically
from common.flags import RunArgs
from common.logs import read_metrics
from common.runs import Run


def run_of(tmp_path, args_type=RunArgs, **kw):
    args = args_type(**{"exp_name": "t", "output_dir": str(tmp_path), "lora": False, **kw})
    return Run(args, Accelerator(cpu=True), "test")


def saved_run(tmp_path, monkeypatch, stamp=1000, iterations=(2,), **kw):
    """A run (folder t__{seed}__{stamp}) with a checkpoint at each of `iterations`."""
    monkeypatch.setattr("time.time", lambda: float(stamp))
    run = run_of(tmp_path, save_every=1, **kw)
    for it in iterations:
        run.checkpoint(it, final=False)
    run.logs.close()
    return run


def refused(tmp_path, **kw) -> str:
    """The one error of resuming with these flags."""
    with pytest.raises(InputError) as e:
        run_of(tmp_path, **kw).resume()
    return str(e.value)


def rehash(ckpt, **state) -> None:
    """Make checkpoint.json (when there is one) agree with the files as they are now, with `state` in its counters:
    what someone who forged a checkpoint would do."""
    manifest = ckpt / "checkpoint.json"
    if not manifest.is_file():
        return
    record = json.loads(manifest.read_text())
    record["files"] = {n: hashlib.sha256((ckpt / n).read_bytes()).hexdigest() for n in record["files"]}
    record["state"].update(state)
    manifest.write_text(json.dumps(record))


class Plant:
    """Unpickled with code execution, it creates the file `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.mark.parametrize("forged", [False, True], ids=["replaced", "replaced-and-rehashed"])
def test_a_planted_pickle_in_a_checkpoint_runs_nothing(tmp_path, monkeypatch, forged):
    run = saved_run(tmp_path / "runs", monkeypatch)
    ckpt, marker = run.ckpt.dir / "iter_000002", tmp_path / "pwned"
    torch.save({"iteration": Plant(marker), "optimizer_steps": 0}, ckpt / "custom_checkpoint_0.pkl")
    if forged:
        rehash(ckpt)
    why = refused(tmp_path / "runs", resume_from="latest")
    assert not marker.exists()
    assert why.startswith(f"--resume-from latest: {ckpt} is not a checkpoint of this script and settings (")
    if not forged:
        assert "custom_checkpoint_0.pkl does not match its sha256" in why


def test_another_runs_checkpoint_copied_or_linked_in_is_refused(tmp_path, monkeypatch):
    mine = saved_run(tmp_path, monkeypatch, stamp=1000)
    other = saved_run(tmp_path, monkeypatch, stamp=2000, iterations=(2, 3))
    shutil.rmtree(other.dir)  # 'latest' is this run again
    theirs = saved_run(tmp_path / "elsewhere", monkeypatch, stamp=3000, iterations=(3,))
    shutil.copytree(theirs.ckpt.dir / "iter_000003", mine.ckpt.dir / "iter_000003")
    why = refused(tmp_path, resume_from="latest")
    assert "(run t__0__3000's, not run t__0__1000's, the folder it is in)" in why
    shutil.rmtree(mine.ckpt.dir / "iter_000003")
    (mine.ckpt.dir / "iter_000003").symlink_to(theirs.ckpt.dir / "iter_000003")
    assert "is a symbolic link" in refused(tmp_path, resume_from="latest")


def test_a_file_swapped_for_another_runs_is_refused(tmp_path, monkeypatch):
    mine = saved_run(tmp_path, monkeypatch, stamp=1000)
    torch.manual_seed(123)  # other RNG states in the other run's checkpoint
    theirs = saved_run(tmp_path / "elsewhere", monkeypatch, stamp=2000)
    name = "random_states_0.pkl"
    shutil.copy(theirs.ckpt.dir / "iter_000002" / name, mine.ckpt.dir / "iter_000002" / name)
    assert f"({name} does not match its sha256 (changed or replaced since it was written))" in refused(
        tmp_path, resume_from=str(mine.dir)
    )


def test_another_seeds_or_another_scripts_checkpoint_is_refused(tmp_path, monkeypatch):
    run = saved_run(tmp_path, monkeypatch)
    assert "(another --seed (0 there, 1 here))" in refused(tmp_path, resume_from=str(run.dir), seed=1)
    assert "no run named t__1__* with checkpoints" in refused(tmp_path, resume_from="latest", seed=1)

    @dataclasses.dataclass
    class OtherScriptArgs(RunArgs):  # another script's flags: its module is this file
        pass

    why = refused(tmp_path, args_type=OtherScriptArgs, resume_from=str(run.dir))
    assert "(written by common.flags, not by tests.test_checkpoint_trust)" in why


@pytest.mark.parametrize("iteration", [-5, 1_000_000, "2", 3])
def test_an_impossible_iteration_in_the_training_state_is_refused(tmp_path, monkeypatch, iteration):
    """A checkpoint of iteration 2 whose counters say otherwise (each file agreeing with the manifest): refused, as is
    a checkpoint beyond --iterations."""
    run = saved_run(tmp_path, monkeypatch)
    ckpt = run.ckpt.dir / "iter_000002"
    torch.save({"iteration": iteration, "optimizer_steps": 0}, ckpt / "custom_checkpoint_0.pkl")
    rehash(ckpt, iteration=iteration)
    assert f"(its iteration {iteration!r} is not the folder's 2)" in refused(tmp_path, resume_from="latest")


def test_a_checkpoint_beyond_iterations_and_one_without_its_manifest_are_refused(tmp_path, monkeypatch):
    saved_run(tmp_path, monkeypatch, iterations=(2, 5))
    assert "(its iteration 5 is beyond --iterations 4)" in refused(tmp_path, resume_from="latest", iterations=4)
    resumed = run_of(tmp_path, resume_from="latest", iterations=5)
    assert resumed.resume() == 5
    (resumed.ckpt.dir / "iter_000005" / "checkpoint.json").unlink()
    assert "(no checkpoint.json: " in refused(tmp_path, resume_from="latest", iterations=5)


def test_the_own_checkpoint_resumes_its_counters(tmp_path, monkeypatch):
    monkeypatch.setattr("time.time", lambda: 1000.0)
    run = run_of(tmp_path, save_every=1)
    run.ckpt.state.optimizer_steps = 7
    run.checkpoint(3, final=False)
    resumed = run_of(tmp_path, resume_from="latest")
    assert resumed.resume() == 3 and resumed.optimizer_steps == 7


def test_rotating_a_symlinked_checkpoint_removes_the_link_only(tmp_path, monkeypatch):
    run = saved_run(tmp_path / "runs", monkeypatch, iterations=(1, 2), checkpoints_total_limit=2)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("kept")
    shutil.rmtree(run.ckpt.dir / "iter_000001")
    (run.ckpt.dir / "iter_000001").symlink_to(outside)
    (run.ckpt.dir / ".partial_iter_000003").symlink_to(outside)  # a planted leftover: removed, not written through
    run.checkpoint(3, final=False)
    assert sorted(p.name for p in run.ckpt.dir.iterdir()) == ["iter_000002", "iter_000003"]
    assert [p.name for p in outside.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("link", ["dangling", "looping"])
def test_an_output_dir_link_to_no_folder_is_one_error(tmp_path, link):
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "nowhere" if link == "dangling" else out)
    with pytest.raises(InputError, match="--output-dir .*: a symbolic link to no folder"):
        run_of(out)


@pytest.mark.parametrize("name", ["../../escaped", "a/b", "", "..", "."])
def test_an_exp_name_that_is_a_path_is_one_error(tmp_path, name):
    with pytest.raises(InputError, match="--exp-name .*: a name, not a path"):
        run_of(tmp_path / "a" / "b", exp_name=name)
    assert not (tmp_path / "escaped").exists()


def test_metrics_lines_that_are_not_records_are_skipped_on_resume(tmp_path, monkeypatch, capsys):
    run = saved_run(tmp_path, monkeypatch)
    path = run.dir / "metrics.jsonl"
    path.write_bytes(b'{"iteration": 1, "a": 1.0}\n[1, 2]\n"text"\n5\n{"no": "iteration"}\n{"iteration": "1"}\n'
                     b'\xff\xfe{"iteration": 2}\n{"iteration": 2, "a": 2.0}\n{"iteration": 3, "a": 3.0}\n')  # fmt: skip
    assert [r["iteration"] for r in read_metrics(run.dir)] == [1, 2, 3]
    resumed = run_of(tmp_path, resume_from="latest")
    assert resumed.resume() == 2
    assert "dropped 6 line(s) that are not a record" in capsys.readouterr().out
    assert path.read_text().splitlines() == ['{"iteration": 1, "a": 1.0}', '{"iteration": 2, "a": 2.0}']


@pytest.mark.parametrize("what", ["folder", "link"])
def test_a_metrics_file_that_is_a_folder_or_a_link_is_one_error_on_resume(tmp_path, monkeypatch, what):
    run = saved_run(tmp_path / "runs", monkeypatch)
    path, target = run.dir / "metrics.jsonl", tmp_path / "target.jsonl"
    if what == "folder":
        path.mkdir()
    else:
        target.write_text('{"iteration": 1}\n{"iteration": 5}\n')
        path.symlink_to(target)
    why = refused(tmp_path / "runs", resume_from="latest")
    assert why.startswith("--resume-from: ") and "where the run keeps metrics.jsonl" in why
    assert what == "folder" or target.read_text() == '{"iteration": 1}\n{"iteration": 5}\n'


def test_the_atomic_writer_refuses_links_and_turns_disk_errors_into_one_line(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("theirs")
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.txt").symlink_to(outside)
    with pytest.raises(InputError, match=r"--out: .*a.txt is a symbolic link, where the report writes a.txt"):
        write_atomically(out / "a.txt", "mine", "--out", "the report", out)
    (out / "sub").symlink_to(tmp_path)
    with pytest.raises(InputError, match=r"--out: .*sub is a symbolic link"):
        write_atomically(out / "sub" / "b.txt", "mine", "--out", "the report", out)
    assert outside.read_text() == "theirs" and not (tmp_path / "b.txt").exists()

    def torn(tmp):  # what torch.save raises on a full disk, after writing part of the file
        tmp.write_bytes(b"part")
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    with pytest.raises(RunError, match=r"cannot write .*c.pt \(RuntimeError: PytorchStreamWriter failed"):
        write_atomically(out / "c.pt", torn, "--out", "the cache", out)
    assert not [p for p in out.iterdir() if ".tmp" in p.name] and not (out / "c.pt").exists()
