"""common/checkpoints.py piece by piece, in this process: which run and checkpoint --resume-from picks, the exact line
of every refusal, what a checkpoint and final/ hold (LoRA and full weights), the weights-only loading of the carried
tensors. Each value is worked out by hand here; written for the mutants that the run-level tests let pass."""

import hashlib
import json
import types

import accelerate.accelerator
import accelerate.checkpointing
import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.loaders import PeftAdapterMixin, SD3LoraLoaderMixin
from safetensors.torch import load_file

import common.checkpoints
from common import InputError, RunError
from common.checkpoints import Carried, Checkpoints, TrainState, newest_checkpoint, resolve_resume
from common.models import add_lora
from tests.test_checkpoint_trust import Plant, rehash

OWNER = {"script": "tests.unit", "settings": {"seed": 0, "lora_rank": 4}}
NO_EARLIER = "there is no earlier checkpoint: free some space or pass another --output-dir"


class Tiny(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """A denoiser of two layers, diffusers-loadable."""

    @register_to_config
    def __init__(self, width: int = 2):
        super().__init__()
        self.proj, self.out = torch.nn.Linear(width, width), torch.nn.Linear(width, 1)


def lora_tiny():
    torch.manual_seed(0)
    return add_lora(Tiny(), rank=2, alpha=4, target_modules=["proj"])


def half_frozen(frozen=True):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].requires_grad_(not frozen)
    return model


def ckpts(run_dir, accelerator=None, lora=False, keep=5, iterations=None, **settings):
    owner = {**OWNER, "run": run_dir.name, "settings": {**OWNER["settings"], **settings}}
    return Checkpoints(accelerator or Accelerator(cpu=True), run_dir, lora, keep, owner, iterations)


def saved(tmp_path, iteration=2, steps=3, **kw):
    """(Checkpoints, its checkpoint folder) of run t__0__5, saved at `iteration` after `steps` optimizer steps."""
    ck = ckpts(tmp_path / "t__0__5", **kw)
    ck.state.optimizer_steps = steps
    ck.save(iteration)
    return ck, ck.dir / f"iter_{iteration:06d}"


def why(ck, path):
    return ck._problem(path)[0]


def refusal(call, *args, error=InputError):
    with pytest.raises(error) as e:
        call(*args)
    return str(e.value)


def fake_run(out, name, *iterations):
    for it in iterations:
        (out / name / "checkpoints" / f"iter_{it:06d}").mkdir(parents=True)
    (out / name).mkdir(parents=True, exist_ok=True)
    return out / name


# ---------------------------------------------------------------- small pieces
def test_counters_carried_tensors_sha256_remove_and_newest_checkpoint(tmp_path):
    state = TrainState()
    assert state.state_dict() == {"iteration": 0, "optimizer_steps": 0}
    state.load_state_dict({"iteration": 4})  # written before steps were counted: none
    assert (state.iteration, state.optimizer_steps) == (4, 0)
    a, b = torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([3])
    carried = Carried(ema=[a, b])
    snap = carried.state_dict()  # a snapshot, not the live tensors
    with torch.no_grad():
        a.add_(10), b.add_(10)
    assert [t.tolist() for t in snap["ema"]] == [[1.0, 2.0], [3]] and not snap["ema"][0].requires_grad
    carried.load_state_dict(snap)
    assert a.tolist() == [1.0, 2.0] and b.tolist() == [3]
    with pytest.raises(ValueError):
        carried.load_state_dict({"ema": snap["ema"][:1]})  # one tensor short
    (tmp_path / "f").write_bytes(b"abc")
    assert common.checkpoints._sha256(tmp_path / "f") == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "d")
    for name in ("link", "d", "f", "never-there"):  # a link itself, never what it points to; a folder; a file
        common.checkpoints._remove(tmp_path / name)
        assert name != "link" or (tmp_path / "d" / "e").is_dir()
    assert list(tmp_path.iterdir()) == [] and newest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    assert newest_checkpoint(tmp_path) is None
    for name in ("iter_000002", "iter_000010", ".partial_iter_000011", "other"):
        (tmp_path / "checkpoints" / name).mkdir()
    (tmp_path / "checkpoints" / "iter_000099").write_text("a file")
    assert newest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "iter_000010"


# ---------------------------------------------------------------- resolve_resume
def test_latest_is_the_newest_run_of_the_seed_or_of_any_seed(tmp_path):
    fake_run(tmp_path, "t__0__999", 1, 2)
    newer, other_seed = fake_run(tmp_path, "t__0__1000", 1), fake_run(tmp_path, "t__1__1200", 4)
    fake_run(tmp_path, "t__0__2000")  # no checkpoint yet
    fake_run(tmp_path, "tt__0__3000", 1)  # another experiment
    assert resolve_resume(str(tmp_path), "t", "latest", 0) == (newer, newer / "checkpoints" / "iter_000001")
    assert resolve_resume(str(tmp_path), "t", "latest") == (other_seed, other_seed / "checkpoints" / "iter_000004")
    check = "(check --exp-name, --seed and --output-dir)"
    assert refusal(resolve_resume, str(tmp_path), "t", "latest", 2) == (
        f"--resume-from latest: no run named t__2__* with checkpoints in {tmp_path} {check}"
    )
    assert refusal(resolve_resume, str(tmp_path), "u", "latest") == (
        f"--resume-from latest: no run named u__*__* with checkpoints in {tmp_path} {check}"
    )


def test_latest_compares_stamps_as_numbers_across_seeds_and_takes_the_name_as_it_is(tmp_path):
    older = fake_run(tmp_path, "t__1__50", 1)
    assert resolve_resume(str(tmp_path), "t", "latest")[0] == older
    newest = fake_run(tmp_path, "t__0__70", 1)
    assert resolve_resume(str(tmp_path), "t", "latest")[0] == newest
    fake_run(tmp_path, "t__2__8", 1)  # created last, yet the oldest
    assert resolve_resume(str(tmp_path), "t", "latest")[0] == newest
    fake_run(tmp_path, "ab__0__9", 1)
    bracket, star = fake_run(tmp_path, "a[b]__0__5", 1), fake_run(tmp_path, "a*__0__3", 1)
    assert resolve_resume(str(tmp_path), "a[b]", "latest", 0)[0] == bracket
    assert resolve_resume(str(tmp_path), "a*", "latest")[0] == star


def test_a_run_folder_or_a_checkpoint_folder(tmp_path):
    run = fake_run(tmp_path, "iter_a__0__5", 1, 3)
    ckpts_dir = run / "checkpoints"
    assert resolve_resume(str(tmp_path), "x", str(run)) == (run, ckpts_dir / "iter_000003")
    assert resolve_resume(str(tmp_path), "x", str(ckpts_dir / "iter_000001")) == (run, ckpts_dir / "iter_000001")
    assert refusal(resolve_resume, str(tmp_path), "x", str(tmp_path)) == (
        f"--resume-from {tmp_path}: neither a run folder with checkpoints/iter_* inside nor a checkpoints/iter_* folder"
    )


# ---------------------------------------------------------------- save
def test_a_checkpoint_holds_its_files_and_a_manifest_of_them_each_flushed_before_the_rename(tmp_path, monkeypatch):
    flushed, real = [], common.checkpoints._fsync
    monkeypatch.setattr(common.checkpoints, "_fsync", lambda *ps: flushed.append([p.name for p in ps]) or real(*ps))
    ck, ckpt = saved(tmp_path, iteration=7, steps=3)
    names = ["custom_checkpoint_0.pkl", "random_states_0.pkl"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["checkpoint.json", *names]
    assert flushed == [["checkpoint.json", *names, ".partial_iter_000007"], ["checkpoints"]]
    record = {"script": "tests.unit", "settings": {"seed": 0, "lora_rank": 4}, "run": "t__0__5"}
    record |= {"state": {"iteration": 7, "optimizer_steps": 3}}
    record |= {"files": {n: hashlib.sha256((ckpt / n).read_bytes()).hexdigest() for n in names}}
    assert (ckpt / "checkpoint.json").read_text() == json.dumps(record, indent=1)
    default = Checkpoints(Accelerator(cpu=True), tmp_path / "u__0__1", False, 1)
    default.save(1)
    manifest = json.loads((default.dir / "iter_000001" / "checkpoint.json").read_text())
    assert (manifest["script"], manifest["run"], manifest["settings"]) == (None, "u__0__1", {})


def test_saves_by_another_process_past_a_stuck_leftover_and_into_a_manifest_in_the_way(tmp_path, monkeypatch):
    """Another process writes its part only; a leftover that cannot be removed stops no save; a folder where the
    manifest goes is one line."""
    ck = ckpts(tmp_path / "t__0__5")
    (ck.dir / ".partial_iter_000009").mkdir(parents=True)
    ck.is_main = False
    ck.save(1)
    assert sorted(p.name for p in ck.dir.iterdir()) == [".partial_iter_000001", ".partial_iter_000009"]
    assert (ck.dir / ".partial_iter_000001" / "random_states_0.pkl").is_file()  # its part, for the main one
    ck.is_main = True
    monkeypatch.setattr(common.checkpoints, "_remove", lambda p: (_ for _ in ()).throw(OSError(16, "busy")))
    ck.save(1)
    assert sorted(p.name for p in ck.dir.iterdir()) == [".partial_iter_000009", "iter_000001"]
    ck = ckpts(tmp_path / "u__0__5")
    real, manifest = ck.accelerator.save_state, ck.dir / ".partial_iter_000001" / "checkpoint.json"
    monkeypatch.setattr(ck.accelerator, "save_state", lambda path: (real(path), manifest.mkdir()))
    line = f"--output-dir: {manifest} is a folder, where the checkpoint writes checkpoint.json; remove it, or give "
    assert refusal(ck.save, 1, error=RunError) == (
        f"cannot write the checkpoint of iteration 1 into {ck.dir} (InputError: "
        f"{(line + 'another --output-dir')[:200]}); {NO_EARLIER}"
    )
    assert list(ck.dir.glob("*")) == []


def test_saves_rotate_replace_and_clear_leftovers(tmp_path):
    ck = ckpts(tmp_path / "t__0__5", keep=2)
    ck.save(1)
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (ck.dir / ".partial_iter_000009").mkdir()
    (ck.dir / ".deleting_iter_000001").symlink_to(outside)
    (ck.dir / ".notes").write_text("a hidden file")
    (ck.dir / "iter_000002").symlink_to(outside)  # in the place of the next one
    ck.save(2)
    assert sorted(p.name for p in ck.dir.iterdir()) == [".notes", "iter_000001", "iter_000002"]
    assert (ck.dir / "iter_000002").is_dir() and not (ck.dir / "iter_000002").is_symlink()
    assert [p.name for p in outside.iterdir()] == ["sub"]
    ck.save(3)
    assert sorted(p.name for p in ck.dir.glob("iter_*")) == ["iter_000002", "iter_000003"]
    ck.state.optimizer_steps = 8
    ck.save(2)  # resumed from iteration 1 and saved again
    assert sorted(p.name for p in ck.dir.glob("*iter_*")) == ["iter_000002", "iter_000003"]
    assert ck.load(ck.dir / "iter_000002", "x") == 2 and ck.state.optimizer_steps == 8


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), RuntimeError(), ValueError("w" * 250)])
def test_a_failed_save_is_one_line_and_leaves_no_partial_folder(tmp_path, monkeypatch, error):
    ck = ckpts(tmp_path / "t__0__5")
    line = {OSError: "OSError: [Errno 28] No space left on device", RuntimeError: "RuntimeError: "}
    line = line.get(type(error), "ValueError: " + "w" * 200)

    def fail(path):  # a part written, or (no message) nothing
        if error.args:
            (ck.dir / ".partial_iter_000002").mkdir(parents=True, exist_ok=True)
        raise error

    monkeypatch.setattr(ck.accelerator, "save_state", fail)
    head = f"cannot write the checkpoint of iteration 2 into {ck.dir} ({line}); "
    assert refusal(ck.save, 2, error=RunError) == head + NO_EARLIER
    assert list(ck.dir.glob("*")) == []
    monkeypatch.undo()
    ck.save(1)
    monkeypatch.setattr(ck.accelerator, "save_state", fail)
    assert refusal(ck.save, 2, error=RunError) == head + (
        "the previous checkpoint iter_000001 is intact: free some space or fix the folder's permissions, then run "
        f"the same command with --resume-from {ck.run_dir}"
    )


# ---------------------------------------------------------------- the refusals, one line each
def test_each_refusal_of_a_checkpoint_is_its_own_line(tmp_path):
    ck, ckpt = saved(tmp_path, iteration=2)
    assert ck._problem(ckpt) == ("", {"iteration": 2, "optimizer_steps": 3})
    other = ckpts(tmp_path / "t__0__5", lora_rank=8, kl_beta=0.1)
    assert why(other, ckpt) == "another --kl-beta (absent there, 0.1 here), --lora-rank (4 there, 8 here)"
    assert why(ckpts(tmp_path / "t__0__6"), ckpt) == "run t__0__5's, not run t__0__6's, the folder it is in"
    assert why(Checkpoints(Accelerator(cpu=True), ck.run_dir, False, 1), ckpt) == "written by tests.unit, not by None"
    (ck.dir / "iter_000007").write_text("a file")
    (ck.dir / "iter_latest").mkdir()
    for bad in ("iter_000007", "iter_latest", "iter_000008"):
        assert why(ck, ck.dir / bad) == "not a checkpoints/iter_N folder"
    (ck.dir / "iter_000008").mkdir()
    assert why(ck, ck.dir / "iter_000008") == (
        "no checkpoint.json: an incomplete checkpoint, or one written before checkpoints recorded their run"
    )
    for raw, name in ((b"{", "JSONDecodeError"), (b"\xff\xfe\xfa", "UnicodeDecodeError")):
        (ck.dir / "iter_000008" / "checkpoint.json").write_bytes(raw)
        assert why(ck, ck.dir / "iter_000008") == f"checkpoint.json unreadable ({name})"
    record = json.loads((ckpt / "checkpoint.json").read_text())
    for broken in ([record], {**record, "files": []}, {**record, "state": None}):
        (ck.dir / "iter_000008" / "checkpoint.json").write_text(json.dumps(broken))
        assert why(ck, ck.dir / "iter_000008") == "checkpoint.json is not a checkpoint record"


@pytest.mark.parametrize("value", [None, 0, "", "XX?XX"])
def test_a_setting_on_one_side_only_is_another_setting_whatever_its_value(tmp_path, value):
    ck, ckpt = saved(tmp_path, iteration=2)
    assert why(ckpts(ck.run_dir, prompt_set=value), ckpt) == f"another --prompt-set (absent there, {value} here)"
    record = json.loads((ckpt / "checkpoint.json").read_text())
    record["settings"]["prompt_set"] = value
    (ckpt / "checkpoint.json").write_text(json.dumps(record))
    assert why(ck, ckpt) == f"another --prompt-set ({value} there, absent here)"


def test_files_missing_added_linked_or_changed_are_refused(tmp_path):
    ck, ckpt = saved(tmp_path, iteration=2)
    state, link = ckpt / "custom_checkpoint_0.pkl", "is a symbolic link: a checkpoint holds its own files only"
    (ckpt / "extra.bin").write_bytes(b"x")
    assert why(ck, ckpt) == "extra.bin was not written with it"
    (ckpt / "extra.bin").unlink()
    (tmp_path / "copy.pkl").write_bytes(kept := state.read_bytes())
    state.unlink()
    assert why(ck, ckpt) == "custom_checkpoint_0.pkl is missing"
    state.symlink_to(tmp_path / "copy.pkl")  # the very bytes, through a link
    assert why(ck, ckpt) == f"custom_checkpoint_0.pkl {link}"
    state.unlink()
    state.write_bytes(kept + b"\0")
    changed = "does not match its sha256 (changed or replaced since it was written)"
    assert why(ck, ckpt) == f"custom_checkpoint_0.pkl {changed}"
    state.write_bytes(kept)
    (ckpt / "sub").symlink_to(tmp_path)
    assert why(ck, ckpt) == f"sub {link}"
    (ckpt / "sub").unlink()
    ck.dir.rename(tmp_path / "elsewhere")
    ck.dir.symlink_to(tmp_path / "elsewhere")
    assert why(ck, ckpt) == f"{ck.dir} is a symbolic link: a run resumes the checkpoints in its own folder only"


@pytest.mark.parametrize(
    "state, iterations, line",
    [
        ({"iteration": 3}, None, "its iteration 3 is not the folder's 2"),
        ({"iteration": 2.0}, None, "its iteration 2.0 is not the folder's 2"),
        ({"iteration": True}, None, "its iteration True is not the folder's 2"),
        ({}, 1, "its iteration 2 is beyond --iterations 1"),
        ({}, 2, ""),
        ({"optimizer_steps": -1}, None, "its optimizer step count -1 is not a count"),
        ({"optimizer_steps": "3"}, None, "its optimizer step count '3' is not a count"),
        ({"optimizer_steps": 0}, None, ""),
    ],
)
def test_impossible_counters_are_refused(tmp_path, state, iterations, line):
    ck, ckpt = saved(tmp_path, iteration=2)
    rehash(ckpt, **state)
    assert why(ckpts(ck.run_dir, iterations=iterations), ckpt) == line


# ---------------------------------------------------------------- load
def test_a_refused_or_failing_load_is_one_line_naming_the_flag(tmp_path, monkeypatch):
    ck, ckpt = saved(tmp_path, iteration=2)
    head = f"--resume-from latest: {ckpt} is not a checkpoint of this script and settings"
    rehash(ckpt, optimizer_steps=-2)
    assert refusal(ck.load, ckpt, "latest") == f"{head} (its optimizer step count -2 is not a count)"
    rehash(ckpt, optimizer_steps=3)
    for error, line in ((ValueError("first\nsecond"), "ValueError: first"), (RuntimeError(), "RuntimeError: "),
                        (KeyError("k" * 400), "KeyError: '" + "k" * 299)):  # fmt: skip
        monkeypatch.setattr(ck.accelerator, "load_state", lambda path, error=error: (_ for _ in ()).throw(error))
        assert refusal(ck.load, ckpt, "latest") == f"{head} ({line})"


def test_only_the_main_process_reads_the_checkpoint_and_every_one_acts_on_its_verdict(tmp_path, monkeypatch):
    ck, ckpt = saved(tmp_path, iteration=2, steps=5)
    second = ckpts(ck.run_dir)
    second.is_main, real = False, second.accelerator
    second.accelerator = types.SimpleNamespace(num_processes=2, load_state=real.load_state)
    monkeypatch.setattr(Checkpoints, "_problem", lambda self, path: pytest.fail("read on another process"))
    verdict = ["", {"iteration": 2, "optimizer_steps": 5}]  # what the main process sends

    def broadcast(objects):  # what the main process sends
        objects[:] = verdict
        return objects

    monkeypatch.setattr("accelerate.utils.broadcast_object_list", broadcast)
    assert second.load(ckpt, "latest") == 2 and second.state.optimizer_steps == 5
    verdict = ["its iteration 9 is not the folder's 2", {}]
    assert refusal(second.load, ckpt, "latest").endswith("settings (its iteration 9 is not the folder's 2)")


def test_carried_tensors_come_back_bit_for_bit_and_weights_only(tmp_path, monkeypatch):
    ema = [torch.tensor([0.1, 0.2]), torch.tensor([[7]])]
    ck = ckpts(tmp_path / "t__0__5")
    ck.accelerator.register_for_checkpointing(Carried(ema=ema))
    ck.save(1)
    ckpt = ck.dir / "iter_000001"
    ema[0].zero_(), ema[1].fill_(3)
    assert ck.load(ckpt, "x") == 1
    assert ema[0].tolist() == torch.tensor([0.1, 0.2]).tolist() and ema[1].tolist() == [[7]]
    assert accelerate.accelerator.load_custom_state is accelerate.checkpointing.load_custom_state  # put back
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # weights-only whatever the environment says
    marker = tmp_path / "pwned"
    torch.save({"ema": [Plant(marker)]}, ckpt / "custom_checkpoint_1.pkl")
    rehash(ckpt)  # a forged checkpoint: every file agrees with its manifest
    assert "(UnpicklingError: " in refusal(ck.load, ckpt, "x") and not marker.exists()
    state = TrainState()
    with common.checkpoints._carried_loaded_weights_only():
        accelerate.accelerator.load_custom_state(state, ckpt)  # accelerate's signature: index 0 by default
    assert state.state_dict() == {"iteration": 1, "optimizer_steps": 0}


# ---------------------------------------------------------------- LoRA checkpoints and final weights
def test_the_lora_hook_keeps_the_trained_tensors_and_writes_the_adapter_config(tmp_path):
    net, plain, wrapped = lora_tiny(), half_frozen(), torch.nn.Module()
    wrapped.module = net  # what DDP hands the hook
    lora = ["proj.lora_A.default.weight", "proj.lora_B.default.weight"]
    for models, names in (([net, plain], lora), ([wrapped, plain], [f"module.{n}" for n in lora])):
        (out := tmp_path / str(len(names[0]))).mkdir()
        weights = [m.state_dict() for m in models]
        common.checkpoints._save_trained_only(models, weights, out)
        assert [sorted(w) for w in weights] == [names, ["1.bias", "1.weight"]]
        config = json.loads((out / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"], config["target_modules"]) == (2, 4, ["proj"])
    common.checkpoints._save_trained_only([plain], [plain.state_dict()], tmp_path / "none")
    assert not (tmp_path / "none").exists()
    (in_the_way := tmp_path / "in_the_way" / "adapter_config.json").mkdir(parents=True)
    assert refusal(common.checkpoints._save_trained_only, [net], [net.state_dict()], in_the_way.parent) == (
        f"--output-dir: {in_the_way} is a folder, where the checkpoint writes adapter_config.json; remove it, or give "
        "another --output-dir"
    )


def test_a_lora_checkpoint_resumes_the_trained_tensors_of_each_model(tmp_path):
    ck = ckpts(tmp_path / "t__0__5", lora=True)
    models = ck.accelerator.prepare(lora_tiny(), half_frozen())
    ck.save(1)
    ckpt = ck.dir / "iter_000001"
    assert sorted(load_file(ckpt / "model.safetensors")) == ["proj.lora_A.default.weight", "proj.lora_B.default.weight"]
    assert sorted(load_file(ckpt / "model_1.safetensors")) == ["1.bias", "1.weight"]
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    with torch.no_grad():
        for p in [p for m in models for p in m.parameters()]:
            p.add_(1.0)
    assert ck.load(ckpt, "x") == 1
    for m, b in zip(models, before, strict=True):  # the trained tensors back, the frozen ones left as they are
        for k, v in m.state_dict().items():
            assert torch.equal(v, b[k] if "lora" in k or k.startswith("1.") else b[k] + 1), k
    other = ckpts(tmp_path / "t__0__5", lora=True)
    other.accelerator.prepare(lora_tiny(), half_frozen(frozen=False))
    assert refusal(other.load, ckpt, "x").endswith(
        "(ValueError: the checkpoint's 2 tensors are not this run's 4 trained ones)"
    )


class FsdpOnCpu(Accelerator):
    """A CPU accelerator that says it runs under FSDP, whose gathered state dict holds 7s."""

    distributed_type = DistributedType.FSDP

    def get_state_dict(self, model, unwrap=True):
        return {k: torch.full_like(v, 7.0) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fsdp", [False, True])
def test_the_final_weights_are_the_full_denoiser_or_the_adapter(tmp_path, fsdp):
    """Under FSDP the weights, full or the adapter, are taken from the gathered state dict (7s here), not from the main
    process's shard: diffusers' save_pretrained swallows a state_dict keyword and saved the shard."""
    ck, final = ckpts(tmp_path / "t__0__5", FsdpOnCpu(cpu=True) if fsdp else None), tmp_path / "t__0__5" / "final"
    model = types.SimpleNamespace(kind="sd3", pipeline=SD3LoraLoaderMixin)
    full = Tiny()
    assert ck.save_final(model, full, lora=False) == final
    weights = load_file(final / "transformer" / "diffusion_pytorch_model.safetensors")
    assert weights.keys() == full.state_dict().keys()
    for k, v in weights.items():
        assert torch.equal(v, torch.full_like(full.state_dict()[k], 7.0) if fsdp else full.state_dict()[k]), k
    assert Tiny.from_pretrained(final / "transformer").config["width"] == 2  # a folder from_pretrained reads
    net = lora_tiny()
    assert ck.save_final(model, net, lora=True) == final
    adapter = load_file(final / "pytorch_lora_weights.safetensors")
    assert sorted(adapter) == ["transformer.proj.lora_A.weight", "transformer.proj.lora_B.weight"]
    for name in ("lora_A", "lora_B"):
        live = net.state_dict()[f"proj.{name}.default.weight"]
        assert torch.equal(adapter[f"transformer.proj.{name}.weight"], torch.full_like(live, 7.0) if fsdp else live)


def test_checkpoints_are_ordered_by_their_number_not_their_name(tmp_path):
    """iter_1000000 (the last of a million iterations, seven digits) is newer than iter_999999, which sorts after it
    as text; folders that are not iter_N, or not folders, are no checkpoints."""
    from common.checkpoints import checkpoint_folders, newest_checkpoint

    folder = tmp_path / "checkpoints"
    for name in ("iter_999999", "iter_1000000", "iter_000002", "iter_x"):
        (folder / name).mkdir(parents=True)
    (folder / "iter_5").write_text("a file")
    assert [d.name for d in checkpoint_folders(folder)] == ["iter_000002", "iter_999999", "iter_1000000"]
    assert newest_checkpoint(tmp_path) == folder / "iter_1000000"
