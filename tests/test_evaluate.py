"""python -m common.evaluate: a run's final/ scored with the run's own evaluation settings gives exactly the run's
last held-out evaluation (and the base model its first); an interrupted evaluation recomputes only the batches it
had not cached, and a truncated or foreign batch file is computed again; --weights that are not this model's are
refused before anything is sampled; two processes give the table of one; tiny FLUX and tiny Wan end to end; paired
differences by hand."""

import copy
import hashlib
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import zipfile

import pytest
import torch
import tyro
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import InputError, RunError, remote
from common import evaluate as E
from common.models import add_lora, load_model, save_trained_weights
from tests.helpers import ROOT, SHIPPED, find_run, metrics, run_script
from tests.tiny import BUILDERS, RES

TRAIN = ["--iterations", "2", "--samples-per-device", "8", "--group-size", "4", "--rollout-batch-size", "4",
         "--samples-per-update", "4", "--num-steps", "4", "--eval-every", "2", "--eval-samples-per-prompt", "1",
         "--eval-steps", "4", "--eval-max-prompts", "8", "--sample-every", "0"]  # fmt: skip
SAME_AS_TRAINING = ["--num-steps", "4", "--samples-per-prompt", "1", "--max-prompts", "8", "--batch-size", "4"]


def test_a_runs_final_weights_give_its_last_evaluation_and_an_interrupted_evaluation_resumes(tmp_path, monkeypatch):
    run_script("dancegrpo.py", [*TRAIN, "--exp-name", "d"], tmp_path)
    run = find_run(tmp_path / "d")
    evals = {r["iteration"]: r for r in metrics(tmp_path / "d") if "eval/reward" in r}
    out = tmp_path / "eval"
    checkpoint = f"checkpoint={run / 'checkpoints' / 'iter_000002'}"  # the same adapter, from its checkpoint
    argv = [*SAME_AS_TRAINING, "--weights", f"trained={run}", "--weights", checkpoint, "--reward", "shapes"]
    argv += ["--out", str(out)]
    E.main(tyro.cli(E.EvalArgs, args=argv))
    result = json.loads((out / "results.json").read_text())
    for name, iteration in (("base", 0), ("trained", 2)):
        figures = result["figures"][name]
        for key in ("reward", "reward_shapes", "shape_acc", "all_acc", "clean_acc", "bg_acc", "reward_mean"):
            assert figures[key] == evals[iteration][f"eval/{key}"], (name, key)  # exactly
    assert result["figures"]["checkpoint"] == result["figures"]["trained"]
    mean, se = result["deltas"]["trained"]["shapes"]
    assert mean == pytest.approx(figures["reward_shapes"] - result["figures"]["base"]["reward_shapes"], abs=1e-6)
    assert se > 0 and "| trained | " in (out / "results.md").read_text() and (out / "grid.png").stat().st_size > 0
    assert len((out / "scores.jsonl").read_text().splitlines()) == 8

    # interrupted: one batch of the trained model was never written; only it is sampled again
    (out / "cache" / "trained" / "batch_00001.pt").unlink()
    calls = []
    monkeypatch.setattr(E, "sample_prompts", lambda *a, **kw: calls.append(1) or sample_prompts(*a, **kw))
    E.main(tyro.cli(E.EvalArgs, args=argv))
    assert len(calls) == 1 and json.loads((out / "results.json").read_text()) == result
    with pytest.raises(ValueError, match="another evaluation"):  # a cache of other settings is never mixed in
        E.main(tyro.cli(E.EvalArgs, args=[*argv, "--seed", "1"]))
    moved = [f"trained={run / 'checkpoints' / 'iter_000002'}" if a == f"trained={run}" else a for a in argv]
    with pytest.raises(
        ValueError, match=r"another evaluation's batches \(another trained: the weights' contents differ"
    ):  # a row's weights
        E.main(tyro.cli(E.EvalArgs, args=moved))

    # two processes: the same batches, so the same figures
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    two = subprocess.run([*launch, "-m", "common.evaluate", *argv[:-1], str(tmp_path / "two")], cwd=ROOT, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert json.loads((tmp_path / "two" / "results.json").read_text())["figures"] == result["figures"]


sample_prompts = E.sample_prompts
SMALL = ["--num-steps", "2", "--samples-per-prompt", "2", "--max-prompts", "6", "--batch-size", "4", "--reward", "shapes",
         "--grid-prompts", "2"]  # fmt: skip  # 12 samples: 3 batches of the base model


def test_a_truncated_or_another_batchs_cache_file_is_computed_again(tmp_path, monkeypatch, capsys):
    """Each batch file is checked on reload (it loads; its key, batch index, prompts, shapes): one that fails is
    computed again, with a line naming it, and the results are a clean evaluation's exactly."""
    out, other = tmp_path / "eval", tmp_path / "other"
    E.main(tyro.cli(E.EvalArgs, args=[*SMALL, "--out", str(out)]))
    clean = json.loads((out / "results.json").read_text())
    E.main(tyro.cli(E.EvalArgs, args=[*SMALL, "--seed", "1", "--out", str(other)]))  # other settings, same shapes
    cache = out / "cache" / "base"
    shutil.copy(cache / "batch_00001.pt", cache / "batch_00002.pt")  # another batch's record
    shutil.copy(other / "cache" / "base" / "batch_00001.pt", cache / "batch_00001.pt")  # another evaluation's
    data = (cache / "batch_00000.pt").read_bytes()
    (cache / "batch_00000.pt").write_bytes(data[: len(data) // 2])  # cut off, as by a full disk
    capsys.readouterr()
    calls = []
    monkeypatch.setattr(E, "sample_prompts", lambda *a, **kw: calls.append(1) or sample_prompts(*a, **kw))
    E.main(tyro.cli(E.EvalArgs, args=[*SMALL, "--out", str(out)]))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cache:")]
    assert len(lines) == 3, lines
    assert re.fullmatch(rf"cache: {re.escape(str(cache))}/batch_00000.pt unreadable \((OSError|EOFError|RuntimeError)\), "
                        "computed again", lines[0])  # fmt: skip  # the error depends on where the file ends
    assert lines[1:] == [
        f"cache: {cache / 'batch_00001.pt'} is another evaluation's or another model's (its key differs), computed again",
        f"cache: {cache / 'batch_00002.pt'} holds batch 1, not batch 2, computed again",
    ]
    assert len(calls) == 3 and json.loads((out / "results.json").read_text()) == clean
    assert not [p for p in cache.iterdir() if ".tmp" in p.name]  # written under a temporary name, then renamed

    E.main(tyro.cli(E.EvalArgs, args=[*SMALL, "--out", str(out)]))  # now every batch is a good one
    assert len(calls) == 3 and "cache:" not in capsys.readouterr().out
    (out / "cache" / "settings.json").write_text('{"settings": ')  # the cache's index, changed by hand: refused
    with pytest.raises(InputError, match=r"settings.json unreadable \(JSONDecodeError\); give another --out"):
        E.main(tyro.cli(E.EvalArgs, args=[*SMALL, "--out", str(out)]))


def test_weights_that_are_not_this_models_are_refused_before_anything_is_sampled(tmp_path, monkeypatch):
    """A folder with a foreign config.json (a VAE's) and an empty folder: one `error:` line naming --weights and the
    folder, exit status 2, no traceback, and nothing written to --out (the base model was not scored)."""
    vae, empty = tmp_path / "vae", tmp_path / "empty"
    vae.mkdir()
    empty.mkdir()
    (vae / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL", "latent_channels": 4}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for folder, why in ((vae, "config of AutoencoderKL, not of SD3Transformer2DModel"), (empty, "holds no weights")):
        run = subprocess.run([sys.executable, "-m", "common.evaluate", *SMALL, "--weights", str(folder), "--out",
                              str(tmp_path / "eval")], cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
        errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
        assert run.returncode == 2 and len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
        assert errors[0].startswith(f"error: --weights {folder}: ") and why in errors[0], errors
        assert "expected a run folder" in errors[0]  # and what it takes
        assert not (tmp_path / "eval").exists()  # no batch file, no settings.json: nothing was sampled

    # a transformer folder of this class but other shapes, or without its weights: refused the same way
    config = json.loads((SHIPPED / "transformer" / "config.json").read_text())
    for name, changes, why in (("shallow", {"num_layers": 2}, "num_layers 2, not 4"),
                               ("bare", {}, "has no diffusion_pytorch_model.safetensors")):  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config | changes))
        monkeypatch.setattr(E, "sample_prompts", lambda *a, **kw: pytest.fail("sampled"))
        with pytest.raises(InputError, match=re.escape(f"--weights {tmp_path / name}: ") + f".*{why}"):
            E.main(
                tyro.cli(E.EvalArgs, args=[*SMALL, "--weights", str(tmp_path / name), "--out", str(tmp_path / "eval")])
            )
        assert not (tmp_path / "eval").exists()


def test_paired_standard_error_by_hand():
    mean, se = E.paired(torch.tensor([1.0, 2.0, 4.0]))  # mean 7/3, unbiased variance 7/3
    assert mean == pytest.approx(7 / 3) and se == pytest.approx(math.sqrt(7 / 3) / math.sqrt(3))


@pytest.mark.parametrize("kind", ["flux", "wan", "wan22_a14b"])
def test_tiny_real_models_against_a_lora_fine_tune(kind, tmp_path):
    """A random LoRA adapter saved as a run saves it, on tiny FLUX / Wan / Wan2.2-A14B (an adapter on each expert),
    scored by JPEG size (Wan: and motion); HPDv2-style prompts from its benchmark JSON files give the per-style
    table."""
    BUILDERS[kind](tmp_path / kind)
    video = kind.startswith("wan")
    frames = ["--num-frames", "5"] if video else []
    model = load_model(str(tmp_path / kind), resolution=RES, num_frames=5 if video else None)
    add_lora(model.transformer, 4, 4.0)
    for name, p in model.transformer.named_parameters():
        if "lora_B" in name:
            p.data = 0.5 * torch.randn_like(p)
    save_trained_weights(model, model.transformer, tmp_path / "final", lora=True)
    for style in ("anime", "concept-art", "paintings", "photo"):
        (tmp_path / "hpd" / "benchmark").mkdir(parents=True, exist_ok=True)
        (tmp_path / "hpd" / "benchmark" / f"{style}.json").write_text(json.dumps([f"a {style} cat", f"a {style} dog"]))
    reward = "jpeg,temporal:0.5" if video else "jpeg"
    argv = ["--model-id", str(tmp_path / kind), "--resolution", str(RES), *frames, "--weights", str(tmp_path / "final"),
            "--prompts", f"hpdv2={tmp_path / 'hpd'}", "--reward", reward, "--samples-per-prompt", "2",
            "--num-steps", "2", "--guidance-scale", "2", "--batch-size", "4", "--out", str(tmp_path / "eval")]  # fmt: skip
    E.main(tyro.cli(E.EvalArgs, args=argv))
    result = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert result["settings"]["n_prompts"] == 8 and len(result["figures"]) == 2
    trained = [m for m in result["figures"] if m != "base"][0]
    assert result["figures"][trained]["reward_jpeg"] != result["figures"]["base"]["reward_jpeg"]  # the adapter acts
    assert set(result["deltas"][trained]) >= {"jpeg", "jpeg/anime", "jpeg/photo"}
    assert "per style" in (tmp_path / "eval" / "results.md").read_text()
    with pytest.raises(ValueError, match="shapes, verifier, --prompts shapes-eval belong to ShapesBench"):
        E.main(tyro.cli(E.EvalArgs, args=["--model-id", str(tmp_path / kind)]))  # ShapesBench's defaults, refused


def cli(argv, monkeypatch, capsys) -> tuple[int, list[str], str]:
    """`python -m common.evaluate ARGV` in this process: (exit status, its `error:` lines, stderr)."""
    from common import flags

    monkeypatch.setattr("sys.argv", ["common/evaluate.py", *argv])
    try:
        flags.cli(E.main, E.EvalArgs)
        code = 0
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("error:")], err


def flip(path, offset: int, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def test_a_flipped_bit_in_a_cached_score_or_image_is_never_used(tmp_path, monkeypatch, capsys):
    """torch.load reads a batch file with a flipped bit without complaint (its zip's CRC is not checked): each
    record's checksum is, before the record is used, and a record that fails it is computed again. A record whose
    checksum was made to match a NaN score is refused too."""
    out = tmp_path / "eval"
    E.main(tyro.cli(E.EvalArgs, args=[*SMALL, "--out", str(out)]))
    clean = json.loads((out / "results.json").read_text())
    cache = out / "cache" / "base"
    record = torch.load(cache / "batch_00000.pt", weights_only=True)
    score = record["scores"]["shapes"][1].item()
    data = (cache / "batch_00000.pt").read_bytes()
    at = data.find(struct.pack("<f", score))  # the score's float32 bytes, little-endian, as torch.save stores them
    assert at > 0
    flip(cache / "batch_00000.pt", at + 2, 6)  # the mantissa's top bit: the score moves by a quarter or more
    tampered = torch.load(cache / "batch_00000.pt", weights_only=True)["scores"]
    assert score in (tampered["total"][1].item(), tampered["shapes"][1].item()) and not torch.equal(
        tampered["total"], tampered["shapes"])  # fmt: skip  # the attack: it loads, one score changed (total = shapes)
    grid = zipfile.ZipFile(cache / "batch_00001.pt").infolist()
    largest = max(grid, key=lambda i: i.file_size)  # the grid's images, stored uncompressed
    flip(cache / "batch_00001.pt", largest.header_offset + 30 + len(largest.filename) + largest.file_size // 2, 5)
    record = torch.load(cache / "batch_00002.pt", weights_only=True)
    record["scores"]["total"][0] = float("nan")  # a NaN written with a checksum that matches it
    record["checksum"] = E.record_digest(record)
    torch.save(record, cache / "batch_00002.pt")
    capsys.readouterr()
    calls = []
    monkeypatch.setattr(E, "sample_prompts", lambda *a, **kw: calls.append(1) or sample_prompts(*a, **kw))
    E.main(tyro.cli(E.EvalArgs, args=[*SMALL, "--out", str(out)]))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cache:")]
    assert lines == [
        f"cache: {cache / 'batch_00000.pt'} does not match its checksum (changed since it was written), computed again",
        f"cache: {cache / 'batch_00001.pt'} does not match its checksum (changed since it was written), computed again",
        f"cache: {cache / 'batch_00002.pt'} holds a score that is not a finite number, computed again",
    ]
    assert len(calls) == 3 and json.loads((out / "results.json").read_text()) == clean


def test_weights_replaced_under_the_same_path_do_not_get_the_old_scores(tmp_path, monkeypatch, capsys):
    """The cache is keyed on the weights' contents, not their path: new weights under a row's old path are refused
    at start-up (the --out holds the old weights' batches), and with that record gone, every batch is computed
    again (its key differs)."""
    weights, out = tmp_path / "w", tmp_path / "eval"
    shutil.copytree(SHIPPED / "transformer", weights)
    argv = [*SMALL, "--weights", f"w={weights}", "--out", str(out)]
    E.main(tyro.cli(E.EvalArgs, args=argv))
    before = json.loads((out / "results.json").read_text())["figures"]
    assert before["w"] == before["base"]  # the shipped weights: the base's figures exactly
    from safetensors.torch import load_file, save_file

    state = load_file(weights / "diffusion_pytorch_model.safetensors")
    state = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in state.items()}
    save_file(state, weights / "diffusion_pytorch_model.safetensors")  # other weights, the same path
    code, errors, _ = cli(argv, monkeypatch, capsys)
    assert code == 2 and errors == [f"error: --out {out}: its cache holds another evaluation's batches (another w: the "
                                    "weights' contents differ, so none is used); give another --out"]  # fmt: skip
    (out / "cache" / "settings.json").unlink()
    E.main(tyro.cli(E.EvalArgs, args=argv))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cache:")]
    assert lines == [f"cache: {out / 'cache' / 'w' / f'batch_0000{b}.pt'} is another evaluation's or another "
                     "model's (its key differs), computed again" for b in range(3)]  # fmt: skip
    after = json.loads((out / "results.json").read_text())["figures"]
    assert after["base"] == before["base"] and after["w"] != before["w"]


def test_a_weights_row_added_and_a_prompt_file_edited_under_an_existing_out(tmp_path, monkeypatch, capsys):
    """An added --weights row computes only its own batches, and its figures are a fresh evaluation's (the shipped
    weights: the base's, exactly); a prompt file edited since the cache was written is refused, naming the prompts,
    before anything is sampled: a changed prompt never gets another prompt's cached score."""
    from common.prompts import load_prompts

    prompts, out, weights = tmp_path / "prompts.txt", tmp_path / "eval", tmp_path / "w"
    lines = load_prompts("shapes-eval")[:6]
    prompts.write_text("\n".join(lines) + "\n")
    shutil.copytree(SHIPPED / "transformer", weights)
    argv = [*SMALL, "--prompts", str(prompts), "--out", str(out)]
    E.main(tyro.cli(E.EvalArgs, args=argv))
    base = json.loads((out / "results.json").read_text())["figures"]["base"]
    calls = []
    monkeypatch.setattr(E, "sample_prompts", lambda *a, **kw: calls.append(1) or sample_prompts(*a, **kw))
    E.main(tyro.cli(E.EvalArgs, args=[*argv, "--weights", f"w={weights}"]))
    figures = json.loads((out / "results.json").read_text())["figures"]
    assert len(calls) == 3 and figures == {"base": base, "w": base}  # w's 3 batches, none of the base's
    E.main(tyro.cli(E.EvalArgs, args=[*SMALL, "--prompts", str(prompts), "--weights", f"w={weights}", "--out",
                                      str(tmp_path / "fresh")]))  # fmt: skip
    assert json.loads((tmp_path / "fresh" / "results.json").read_text())["figures"] == figures
    prompts.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")  # the same prompts, two swapped
    calls.clear()
    code, errors, _ = cli(argv, monkeypatch, capsys)
    assert code == 2 and len(errors) == 1 and not calls, errors
    assert "(another prompts_digest: the prompts' contents differ, so none is used); give another --out" in errors[0]


def test_a_cache_path_that_is_a_folder_is_one_error_line_and_leaves_no_temporary_file(tmp_path, monkeypatch, capsys):
    out = tmp_path / "eval"
    E.main(tyro.cli(E.EvalArgs, args=[*SMALL, "--out", str(out)]))
    batch = out / "cache" / "base" / "batch_00001.pt"
    batch.unlink()
    (batch / "inside").mkdir(parents=True)
    code, errors, err = cli([*SMALL, "--out", str(out)], monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err and errors == [
        f"error: --out: {batch} is not a file, where the cache keeps a batch; remove it, or give another --out"]  # fmt: skip
    batch.rename(tmp_path / "moved")
    settings = out / "cache" / "settings.json"
    settings.unlink()
    (settings / "inside").mkdir(parents=True)
    code, errors, err = cli([*SMALL, "--out", str(out)], monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err and errors == [
        f"error: --out: {settings} is a folder, where the cache writes settings.json; remove it, or give another --out"]  # fmt: skip
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), min_size=1, max_size=3))
def test_the_cache_reader_never_gives_back_a_record_other_than_the_one_written(tmp_path_factory, flips):
    """Any bits flipped anywhere in a batch file: load_batch gives back the record as written, or None with a reason;
    never another record."""
    path = tmp_path_factory.mktemp("cache") / "batch_00000.pt"
    record = {"batch": 0, "start": 0, "key": "k", "prompts": ["a", "b"], "grid": torch.rand(1, 3, 4, 4),
              "scores": {"total": torch.tensor([0.25, 0.5]), "shapes": torch.tensor([0.25, 0.5])},
              "images": torch.zeros(0)}  # fmt: skip
    record["checksum"] = E.record_digest(record)
    torch.save(record, path)
    size = path.stat().st_size
    for offset, bit in flips:
        flip(path, offset % size, bit)
    expect = dict(batch=0, start=0, key="k", prompts=["a", "b"], grid=1, images=False)
    loaded, problem = E.load_batch(path, expect)
    assert (loaded is None) == bool(problem)
    if loaded is not None:
        assert E.record_digest(loaded) == record["checksum"] and torch.equal(loaded["grid"], record["grid"])


# ---------------------------------------------------------------- the --weights checks, each message by hand
@pytest.fixture(scope="module")
def shapes_model():
    return load_model("shapesbench")  # SD3Transformer2DModel: 4 blocks of width 192


def test_the_tensor_differences_name_the_first_of_each_kind_with_its_count():
    own = {"a": (2,), "b": (3, 4), "c": (5,)}
    assert E._differences({"a": (2,), "b": [3, 4], "c": (5,)}, own, own) == ""  # a header's shape is a list
    assert E._differences({"a": (2,)}, own, ["a"]) == ""  # only `every` must be there
    state = {"a": (7,), "z": (1,), "y": (1,)}
    assert E._differences(state, own, own) == (
        "2 missing, e.g. b; 2 unknown, e.g. y; 1 of other shapes, e.g. a (7,), not (2,)"
    )


class _Tiny(torch.nn.Module):
    """Modules of known in / out sizes: proj (6 x 4), conv (8 x 3 x 3 x 3), act (no weight)."""

    def __init__(self):
        super().__init__()
        self.proj, self.conv, self.act = torch.nn.Linear(4, 6), torch.nn.Conv2d(3, 8, 3), torch.nn.GELU()


def test_a_lora_file_is_checked_against_each_modules_in_and_out_sizes_and_one_rank():
    m, T = _Tiny(), "transformer."
    good = {T + "proj.lora_A.weight": (2, 4), T + "proj.lora_B.weight": (6, 2)}
    good |= {T + "conv.lora_A.weight": (3, 3, 3, 3), T + "conv.lora_B.weight": (8, 3, 1, 1)}  # another rank: its own
    assert E._lora_differences(good, m) == ""
    cases = [
        ({"proj.lora_A.weight": (2, 4)}, "proj.lora_A.weight is no module of it"),  # no transformer. prefix
        ({T + "proj.weight": (6, 4)}, "transformer.proj.weight is no module of it"),  # no .lora_
        ({T + "nope.lora_A.weight": (2, 4)}, "transformer.nope.lora_A.weight is no module of it"),
        ({T + "act.lora_A.weight": (2, 4)}, "transformer.act.lora_A.weight: (2, 4), not for a weightless module"),
        ({T + "proj.lora_A.weight": (2, 5)}, "transformer.proj.lora_A.weight: (2, 5), not for a (6, 4) module"),
        ({T + "proj.lora_A.weight": (4,)}, "transformer.proj.lora_A.weight: (4,), not for a (6, 4) module"),
        (
            {T + "proj.lora_A.weight": (2, 4), T + "proj.lora_B.weight": (7, 2)},
            "transformer.proj.lora_B.weight: (7, 2), not for a (6, 4) module",
        ),
        (
            {T + "proj.lora_A.weight": (2, 4), T + "proj.lora_B.weight": (6, 3)},
            "proj: lora_A and lora_B of other ranks",
        ),
        ({T + "proj.lora_A.weight": (2, 4, 1)}, "transformer.proj.lora_A.weight: (2, 4, 1), not for a (6, 4) module"),
        ({T + "proj.lora_A.weight": (2, 4)}, "proj: lora_A without lora_B"),  # diffusers would fail after scoring
        ({T + "proj.lora_B.weight": (6, 2)}, "proj: lora_B without lora_A"),
        ({}, "no lora_A tensors"),
    ]
    for state, expected in cases:
        assert E._lora_differences(state, m) == expected, state
    # a module whose own name holds ".lora_": split at the last one, so that its sizes are checked too
    gated = torch.nn.ModuleDict({"blocks": torch.nn.ModuleDict({"lora_gate": torch.nn.Linear(4, 6)})})
    key = T + "blocks.lora_gate.lora_A.weight"
    assert E._lora_differences({key: (2, 4), key.replace("_A.", "_B."): (6, 2)}, gated) == ""
    assert E._lora_differences({key: (2, 5)}, gated) == f"{key}: (2, 5), not for a (6, 4) module"


def test_a_weights_json_that_is_unreadable_or_not_an_object_is_refused_naming_the_flag(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(InputError) as e:
        E._read_json("runs/x", tmp_path / "broken.json")
    assert str(e.value) == f"--weights runs/x: {tmp_path / 'broken.json'} unreadable (JSONDecodeError); {E.EXPECTED}"
    with pytest.raises(InputError) as e:
        E._read_json("runs/x", tmp_path / "list.json")
    assert str(e.value) == f"--weights runs/x: {tmp_path / 'list.json'} is not a JSON object; {E.EXPECTED}"
    (tmp_path / "ok.json").write_text('{"r": 4}')
    assert E._read_json("runs/x", tmp_path / "ok.json") == {"r": 4}


def test_a_checkpoints_adapter_config_is_tried_on_an_empty_copy_and_one_that_does_not_fit_is_refused(
    shapes_model, tmp_path
):
    transformer = shapes_model.transformer  # SD3Transformer2DModel: 4 blocks of width 192
    before = {k: (tuple(v.shape), v.device.type) for k, v in transformer.state_dict().items()}
    (tmp_path / "fits.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["to_q"]}))
    shapes = E._with_adapter("runs/x", transformer, tmp_path / "fits.json")
    lora = {k: s for k, s in shapes.items() if ".lora_" in k}
    assert lora == {
        f"transformer_blocks.{i}.attn.to_q.lora_{ab}.default.weight": (4, 192) if ab == "A" else (192, 4)
        for i in range(4)
        for ab in "AB"
    }
    base = {k.replace(".to_q.base_layer.", ".to_q."): s for k, s in shapes.items() if ".lora_" not in k}
    assert base == {k: s for k, (s, _) in before.items()}  # the base: peft names a wrapped layer's own base_layer
    assert {k: (tuple(v.shape), v.device.type) for k, v in transformer.state_dict().items()} == before  # untouched
    name = "no_such_module_" * 14  # a long name: the reason is cut at 160 characters
    (tmp_path / "misses.json").write_text(json.dumps({"r": 4, "target_modules": [name]}))
    with pytest.raises(InputError) as e:
        E._with_adapter("runs/x", transformer, tmp_path / "misses.json")
    head = (
        f"--weights runs/x: {tmp_path / 'misses.json'} does not fit SD3Transformer2DModel (NoMatchingPeftModuleError: "
    )
    assert str(e.value).startswith(head) and str(e.value).endswith(")") and len(str(e.value)) == len(head) + 160 + 1
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(InputError, match=r"^--weights runs/x: .*broken\.json unreadable \(JSONDecodeError\)"):
        E._with_adapter("runs/x", transformer, tmp_path / "broken.json")


def test_each_kind_of_weights_folder_is_found_and_named_and_anything_else_refused_with_the_reason(tmp_path):
    run = tmp_path / "r1"
    (run / "final").mkdir(parents=True)
    (run / "final" / E.LORA_FILE).write_bytes(b"")  # only names are read here
    iter_5 = run / "checkpoints" / "iter_5"
    iter_5.mkdir(parents=True)
    (iter_5 / "model.safetensors").write_bytes(b"")
    (tmp_path / "full" / "transformer").mkdir(parents=True)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text("{}")
    assert E.weights_folder(str(run)) == ("r1", run / "final")  # a run folder: its final/, named after the run
    assert E.weights_folder(f"best={run}") == ("best", run / "final")
    assert E.weights_folder(f"lr=3e-4={run}") == ("lr=3e-4", run / "final")  # the name ends at the last "="
    assert E.weights_folder(str(iter_5)) == ("r1/iter_5", iter_5)  # a checkpoint: run and iteration
    assert E.weights_folder(str(tmp_path / "full")) == ("full", tmp_path / "full")
    assert E.weights_folder(str(tmp_path / "cfg")) == ("cfg", tmp_path / "cfg")
    kinds = [E.weights_kind(f) for f in (run / "final", iter_5, tmp_path / "full", tmp_path / "cfg", tmp_path)]
    assert kinds == ["lora", "checkpoint", "transformer", "transformer", None]
    unfinished = tmp_path / "r2"
    (unfinished / "checkpoints").mkdir(parents=True)
    (tmp_path / "file").write_text("")
    for spec, reason in [
        (str(tmp_path / "nothing"), "no such folder"),
        (str(tmp_path / "file"), "not a folder"),
        (
            str(unfinished),
            f"{unfinished} holds no weights that this command reads (a run folder without a "
            "complete final/: give one of its checkpoints/iter_N)",
        ),
        (
            str(tmp_path / "full" / "transformer"),
            f"{tmp_path / 'full' / 'transformer'} holds no weights that this command reads",
        ),
    ]:
        with pytest.raises(InputError) as e:
            E.weights_folder(spec)
        assert str(e.value) == f"--weights {spec}: {reason}; {E.EXPECTED}"


def refusal(model, spec: str, folder) -> str:
    with pytest.raises(InputError) as e:
        E.check_weights(model, spec, folder)
    return str(e.value)


def test_a_checkpoint_is_checked_tensor_by_tensor_full_or_lora(shapes_model, tmp_path):
    """A run's checkpoints/iter_N: model.safetensors of a full fine-tune (every tensor, under DDP's "module."
    prefix) or of --lora (the adapter's tensors alone, with the adapter_config.json it is read with)."""
    from safetensors.torch import save_file

    tr, spec = shapes_model.transformer, "runs/x/checkpoints/iter_2"
    state = {k: v.contiguous() for k, v in tr.state_dict().items()}
    full = tmp_path / "full"
    full.mkdir()
    save_file({"module." + k: v for k, v in state.items()}, full / "model.safetensors")
    E.check_weights(shapes_model, spec, full)  # DDP's prefix taken off
    moved = {k: v.double() + 1 for k, v in state.items()}  # float64 on disk: cast to the model's float32
    save_file({"module." + k: v for k, v in moved.items()}, full / "model.safetensors")
    E.check_weights(shapes_model, spec, full)
    loaded = loaded_into_a_copy(tr, full)
    assert all(torch.equal(loaded[k], moved[k].float()) for k in state)
    first = sorted(state)[0]
    save_file({k: v for k, v in state.items() if k != first}, full / "model.safetensors")
    assert refusal(shapes_model, spec, full) == (
        f"--weights {spec}: {full / 'model.safetensors'} holds tensors that are not SD3Transformer2DModel's (1 "
        f"missing, e.g. {first}); another --model-id?"
    )
    lora = tmp_path / "lora"
    lora.mkdir()
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q"]}
    shapes = E._with_adapter(spec, tr, _json(tmp_path / "c.json", config))
    adapter = {k: torch.zeros(s) for k, s in shapes.items() if ".lora_" in k}  # 8 tensors: lora_A, lora_B of 4 blocks
    save_file(adapter, lora / "model.safetensors")
    assert refusal(shapes_model, spec, lora) == (
        f"--weights {spec}: a LoRA checkpoint without adapter_config.json (written since 2026-12); give final/"
    )
    _json(lora / "adapter_config.json", config)
    E.check_weights(shapes_model, spec, lora)  # the adapter alone: the base comes from --model-id
    (lora / "adapter_config.json").write_text("{")
    assert refusal(shapes_model, spec, lora) == (
        f"--weights {spec}: {lora / 'adapter_config.json'} unreadable (JSONDecodeError); {E.EXPECTED}"
    )
    _json(lora / "adapter_config.json", config)
    adapter = {k: torch.randn(v.shape) for k, v in adapter.items()}
    save_file(adapter, lora / "model.safetensors")
    loaded = loaded_into_a_copy(tr, lora)
    assert all(torch.equal(loaded[k], adapter[k]) for k in adapter) and len(loaded) == len(state) + len(adapter)
    dropped = sorted(adapter)[-1]
    save_file({k: v for k, v in adapter.items() if k != dropped}, lora / "model.safetensors")
    assert refusal(shapes_model, spec, lora) == (
        f"--weights {spec}: {lora / 'model.safetensors'} holds tensors that are not SD3Transformer2DModel's (1 "
        f"missing, e.g. {dropped}); another --model-id?"
    )
    (lora / "model.safetensors").write_bytes(b"\x08" + bytes(7) + b"{}")  # a header 8 bytes long, in 2
    try:
        E.safe_open(lora / "model.safetensors", framework="pt")
    except Exception as e:
        why = f"{type(e).__name__}: {str(e)[:120]}"
    assert refusal(shapes_model, spec, lora) == f"--weights {spec}: {lora / 'model.safetensors'} unreadable ({why})"
    missing = tmp_path / ("a_long_folder_name_" * 8) / "model.safetensors"  # the reason cut at 120 characters
    with pytest.raises(InputError) as e:
        E._header(spec, missing)
    head = f"--weights {spec}: {missing} unreadable (FileNotFoundError: "
    assert str(e.value).startswith(head) and len(str(e.value)) == len(head) + 120 + 1


def loaded_into_a_copy(transformer, folder) -> dict:
    """The state dict of a copy of `transformer` after load_weights(folder)."""
    from types import SimpleNamespace

    model = SimpleNamespace(transformer=copy.deepcopy(transformer))
    E.load_weights(model, folder)
    return model.transformer.state_dict()


def _json(path, data):
    path.write_text(json.dumps(data))
    return path


def test_a_transformer_folder_and_a_lora_file_are_checked_against_this_model(shapes_model, tmp_path):
    from safetensors.torch import save_file

    tr, spec = shapes_model.transformer, "runs/y"
    config = dict(tr.config)
    model_folder = tmp_path / "pipeline"  # a diffusers pipeline folder: its transformer/ is read
    moved = copy.deepcopy(tr)
    with torch.no_grad():
        for p in moved.parameters():
            p += 1
    moved.save_pretrained(model_folder / "transformer")
    E.check_weights(shapes_model, spec, model_folder)
    loaded = loaded_into_a_copy(tr, model_folder)
    assert all(torch.equal(loaded[k], v) for k, v in moved.state_dict().items())  # parameters + 1, buffers as they were
    source = model_folder / "transformer"
    # another diffusers version's config, and one without an entry this version added, are the same model
    _json(
        source / "config.json", {k: v for k, v in config.items() if k != "qk_norm"} | {"_diffusers_version": "0.30.0"}
    )
    E.check_weights(shapes_model, spec, model_folder)
    expected = (
        f"--weights {spec}: {source / 'config.json'} is another SD3Transformer2DModel than this --model-id's "
        "(num_layers 2, not 4, attention_head_dim 32, not 64)"
    )
    _json(source / "config.json", config | {"num_layers": 2, "attention_head_dim": 32})
    assert refusal(shapes_model, spec, model_folder) == expected
    for theirs, what in (
        ({"_class_name": "AutoencoderKL"}, "the config of AutoencoderKL"),
        ({}, "no diffusers model's config"),
    ):
        _json(source / "config.json", {k: v for k, v in config.items() if k != "_class_name"} | theirs)
        assert refusal(shapes_model, spec, model_folder) == (
            f"--weights {spec}: {source / 'config.json'} is {what}, not of SD3Transformer2DModel (this --model-id's "
            f"transformer); {E.EXPECTED}"
        )
    (source / "config.json").write_text("{")
    assert refusal(shapes_model, spec, model_folder) == (
        f"--weights {spec}: {source / 'config.json'} unreadable (JSONDecodeError); {E.EXPECTED}"
    )
    (source / "config.json").unlink()
    assert refusal(shapes_model, spec, model_folder) == f"--weights {spec}: {source} has no config.json; {E.EXPECTED}"
    # a LoRA file: lora_A (r, in) and lora_B (out, r) of a module of this model
    lora, q = tmp_path / "final", "transformer.transformer_blocks.0.attn.to_q"
    lora.mkdir()
    a, b = torch.randn(4, 192), torch.randn(192, 4)
    save_file({f"{q}.lora_A.weight": a, f"{q}.lora_B.weight": b}, lora / E.LORA_FILE)
    E.check_weights(shapes_model, spec, lora)
    loaded = loaded_into_a_copy(tr, lora)  # diffusers' loader names the adapter default_0
    block = q.removeprefix("transformer.")
    assert torch.equal(loaded[f"{block}.lora_A.default_0.weight"], a)
    assert torch.equal(loaded[f"{block}.lora_B.default_0.weight"], b)
    save_file({f"{q}.lora_A.weight": torch.zeros(4, 192), f"{q}.lora_B.weight": torch.zeros(7, 4)}, lora / E.LORA_FILE)
    assert refusal(shapes_model, spec, lora) == (
        f"--weights {spec}: {lora / E.LORA_FILE} is not a LoRA adapter of SD3Transformer2DModel ({q}.lora_B.weight: "
        "(7, 4), not for a (192, 192) module); another --model-id?"
    )
    (lora / E.LORA_FILE).write_bytes(b"")
    assert refusal(shapes_model, spec, lora).startswith(f"--weights {spec}: {lora / E.LORA_FILE} unreadable (")


def test_a_full_fine_tune_of_wan22_a14bs_two_experts_is_refused_by_name(tmp_path):
    from types import SimpleNamespace

    from common.models.wan import WanExperts

    model = SimpleNamespace(transformer=WanExperts(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), 875.0))
    _json(tmp_path / "config.json", {"_class_name": "WanTransformer3DModel"})
    assert refusal(model, "w", tmp_path) == (
        "--weights w: full fine-tunes of Wan2.2-T2V-A14B's two experts are not read here (LoRA adapters are)"
    )


# ---------------------------------------------------------------- the cache: each reason a batch is not used, by hand
def test_each_reason_a_cached_batch_is_not_used_is_named_by_hand():
    record = {"batch": 0, "start": 0, "key": "k", "prompts": ["a", "b"], "grid": torch.rand(1, 3, 4, 4),
              "scores": {"total": torch.tensor([0.25, 0.5]), "shapes": torch.tensor([0.25, 0.5])},
              "images": torch.zeros(0)}  # fmt: skip
    expect = dict(batch=0, start=0, key="k", prompts=["a", "b"], grid=1, images=False)

    def sealed(**changes):  # the record with `changes`, and a checksum that matches them
        r = record | changes
        return r | {"checksum": E.record_digest(r)}

    assert E.batch_problem(sealed(), expect) == ""
    assert E.batch_problem(sealed(grid=torch.rand(1, 3, 2, 4, 4)), expect) == ""  # a video's grid: (n, C, F, H, W)
    assert E.batch_problem(sealed(grid=torch.rand(1, 3, 2, 2, 4, 4)), expect) == "its grid images are not 1 images"
    odd = type("Q" * 100, (), {})()  # what no batch record holds; its type's name cut at 80 characters
    cases = [
        ([sealed()], "holds a list, not a batch record"),
        (record | {"extra": odd}, f"holds what no batch record does (TypeError: {('a ' + 'Q' * 100)[:80]})"),
        (sealed() | {"checksum": "0" * 64}, "does not match its checksum (changed since it was written)"),
        (sealed(key="j"), "is another evaluation's or another model's (its key differs)"),
        (sealed(batch=1), "holds batch 1, not batch 0"),
        (sealed(start=2), "holds batch 0, not batch 0"),
        (sealed(prompts=["b", "a"]), "holds other prompts"),
        (sealed(scores={"shapes": torch.tensor([0.25, 0.5])}), "its scores are not 2 numbers per reward"),
        (sealed(scores={"total": torch.tensor([0.25])}), "its scores are not 2 numbers per reward"),
        (sealed(scores={"total": torch.tensor([1, 2])}), "its scores are not 2 numbers per reward"),
        (sealed(scores={"total": torch.zeros(2, 1)}), "its scores are not 2 numbers per reward"),
        (sealed(scores={"total": torch.tensor([0.5, float("inf")])}), "holds a score that is not a finite number"),
        (sealed(grid=torch.rand(2, 3, 4, 4)), "its grid images are not 1 images"),
        (sealed(grid=torch.rand(1, 4, 4)), "its grid images are not 1 images"),
        (sealed(images=torch.rand(2, 3, 4, 4)), "holds images it should not"),
    ]
    for bad, why in cases:
        assert E.batch_problem(bad, expect) == why, why
    kept = expect | {"images": True}  # --save-images: every image is kept
    assert E.batch_problem(sealed(images=torch.rand(2, 3, 4, 4)), kept) == ""
    for images in (torch.zeros(0), torch.rand(2, 3, 8, 8), torch.rand(1, 3, 4, 4)):
        assert E.batch_problem(sealed(images=images), kept) == "its images are not 2 images"


def test_the_weights_digest_covers_the_bytes_of_the_files_load_weights_reads_and_no_other(tmp_path, monkeypatch):
    ckpt, lora, pipe, flat = (tmp_path / n for n in ("iter_4", "final", "pipe", "flat"))
    files = {
        ckpt: ["model.safetensors", "adapter_config.json", "optimizer.bin"],
        lora: [E.LORA_FILE, E.LOW_NOISE_LORA, "notes.txt"],
        pipe: ["transformer/config.json", "transformer/s-2.safetensors", "transformer/s-1.safetensors", "vae/x"],
        flat: ["config.json", "diffusion_pytorch_model.safetensors"],
    }
    for folder, names in files.items():
        for name in names:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(name.encode())
    index = pipe / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(
        json.dumps({"weight_map": {"a": "s-2.safetensors", "b": "s-1.safetensors", "c": "s-1.safetensors"}})
    )
    t = pipe / "transformer"
    assert E.weights_files(ckpt) == [ckpt / "model.safetensors", ckpt / "adapter_config.json"]
    assert E.weights_files(lora) == [lora / E.LORA_FILE, lora / E.LOW_NOISE_LORA]
    assert E.weights_files(pipe) == [t / "config.json", index, t / "s-1.safetensors", t / "s-2.safetensors"]
    assert E.weights_files(flat) == [flat / "config.json", flat / "diffusion_pytorch_model.safetensors"]
    index.write_text("{")  # a malformed index: its shards unknown here (check_weights refuses it, naming it)
    assert E.weights_files(pipe) == [t / "config.json", index]
    (ckpt / "adapter_config.json").unlink()
    assert E.weights_files(ckpt) == [ckpt / "model.safetensors"]

    # the digest by hand: each file's name, size and bytes, in weights_files' order
    by_hand = hashlib.sha256(b"config.json\x0011\x00config.json" + b"diffusion_pytorch_model.safetensors\x0035\x00"
                             b"diffusion_pytorch_model.safetensors").hexdigest()  # fmt: skip
    assert E.weights_digest("f", flat) == by_hand
    (flat / "notes.txt").write_text("not read")
    assert E.weights_digest("f", flat) == by_hand
    (flat / "config.json").write_bytes(b"config.jsoN")  # one byte, the same size
    assert E.weights_digest("f", flat) != by_hand
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_bytes(bytes(3 << 20) + b"\x01")  # past the first 1 MB block
    blob = bytes(3 << 20) + b"\x01"
    assert E.weights_digest("b", big) == hashlib.sha256(f"config.json\0{len(blob)}\0".encode() + blob).hexdigest()

    def refuse(*a, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(E, "open", refuse, raising=False)
    with pytest.raises(InputError) as e:
        E.weights_digest("f", flat)
    assert (
        str(e.value)
        == f"--weights f: {flat / 'config.json'} unreadable (PermissionError: [Errno 13] Permission denied)"
    )


class _Planted:
    """A pickled object whose unpickling would leave a mark: the cache never unpickles it."""

    unpickled = []

    def __reduce__(self):
        return (_Planted.unpickled.append, ("ran",))


def test_the_cache_key_and_reader_hold_under_their_inputs(tmp_path):
    setting = {"num_steps": 4, "prompts_digest": "ab", "out": tmp_path}  # a Path: written as its text
    key = E.cache_key(setting, "w", "d1")
    assert len(key) == 16 and set(key) <= set("0123456789abcdef")  # 16 hex digits
    assert E.cache_key(dict(reversed(list(setting.items()))), "w", "d1") == key  # the settings' order does not count
    others = {E.cache_key(setting | {"num_steps": 5}, "w", "d1"), E.cache_key(setting, "v", "d1"),
              E.cache_key(setting, "w", "d2"), E.cache_key(setting, "w", None)}  # fmt: skip
    assert key not in others and len(others) == 4
    path = tmp_path / "batch_00000.pt"
    torch.save({"batch": 0, "planted": _Planted()}, path)
    assert E.load_batch(path, {"prompts": []}) == (None, "unreadable (UnpicklingError)") and not _Planted.unpickled


def test_a_rewards_stop_is_told_as_the_evaluations_which_takes_no_resume_flag():
    for told in (f"http://h/score failed after 5 tries (HTTP 503); {remote.RESUME}", f"a NaN score; {remote.STOPS}"):
        with pytest.raises(RunError) as e:
            with E.stops_as_an_evaluation():
                raise RunError(told)
        assert str(e.value) == told.rsplit("; ", 1)[0] + "; " + E.AGAIN
        assert "--resume-from" not in str(e.value)


def test_a_sharded_transformer_folder_is_read_through_its_index_and_each_refusal_named(shapes_model, tmp_path):
    tr, spec = shapes_model.transformer, "runs/z"
    folder = tmp_path / "sharded"
    tr.save_pretrained(folder, max_shard_size="5MB")  # diffusers writes shards and their index
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    assert index.is_file() and len(list(folder.glob("diffusion_pytorch_model-*.safetensors"))) > 1
    E.check_weights(shapes_model, spec, folder)
    loaded = loaded_into_a_copy(tr, folder)
    assert all(torch.equal(loaded[k], v) for k, v in tr.state_dict().items())
    weight_map = json.loads(index.read_text())["weight_map"]
    first = sorted(weight_map)[0]
    _json(index, {"weight_map": {k: f for k, f in weight_map.items() if k != first}})  # a shard's tensor unlisted
    E.check_weights(shapes_model, spec, folder)  # the shard is read whole: the tensor is still there
    shard = weight_map[first]
    _json(index, {"weight_map": {k: f for k, f in weight_map.items() if f != shard}})  # a whole shard unlisted
    assert refusal(shapes_model, spec, folder).startswith(f"--weights {spec}: {folder}'s weights are not ")
    broken = folder / shard
    kept = broken.read_bytes()
    broken.write_bytes(b"not a safetensors file")
    _json(index, {"weight_map": weight_map})
    assert refusal(shapes_model, spec, folder).startswith(f"--weights {spec}: {broken} unreadable (")
    broken.write_bytes(kept)
    _json(index, {"metadata": {}})
    assert refusal(shapes_model, spec, folder) == f"--weights {spec}: {index} has no weight_map"
    index.write_text("{")
    assert (
        refusal(shapes_model, spec, folder) == f"--weights {spec}: {index} unreadable (JSONDecodeError); {E.EXPECTED}"
    )
    index.unlink()
    assert refusal(shapes_model, spec, folder) == (
        f"--weights {spec}: {folder} has no diffusion_pytorch_model.safetensors; {E.EXPECTED}"
    )
    config = dict(tr.config)
    changes = {"num_layers": 2, "attention_head_dim": 32, "joint_attention_dim": 64, "pooled_projection_dim": 64}
    _json(folder / "config.json", config | changes)  # four differences: the first three are named
    assert refusal(shapes_model, spec, folder) == (
        f"--weights {spec}: {folder / 'config.json'} is another SD3Transformer2DModel than this --model-id's "
        "(num_layers 2, not 4, attention_head_dim 32, not 64, joint_attention_dim 64, not 128)"
    )


def test_the_batch_checksum_covers_every_key_and_every_leaf():
    record = {"batch": 0, "start": 8, "key": "k", "prompts": ["a", "b"], "none": None, "x": 0.5,
              "scores": {"total": torch.tensor([0.25, 0.5])}}  # fmt: skip
    digest = E.record_digest(record)
    assert E.record_digest(record | {"checksum": "anything"}) == digest  # the checksum itself is left out
    changed = [
        record | {"start": 9},
        record | {"key": "j"},
        record | {"prompts": ["a", "c"]},
        record | {"prompts": ["a", "b", ""]},
        record | {"none": 0},
        record | {"x": 0.25},
        {("starts" if k == "start" else k): v for k, v in record.items()},  # a key renamed, its value the same
        record | {"scores": {"total": torch.tensor([0.25, 0.75])}},
        record | {"scores": {"total": torch.tensor([0.25, 0.5], dtype=torch.float64)}},
        record | {"scores": {"total": torch.tensor([[0.25, 0.5]])}},
    ]
    digests = [E.record_digest(r) for r in changed]
    assert digest not in digests and len(set(digests)) == len(changed)


def test_the_prompt_sets_styles_and_subsets_by_hand(tmp_path, monkeypatch):
    folder = tmp_path / "hpd=v2"  # an "=" in the folder's name: the source is split at the first one
    (folder / "benchmark").mkdir(parents=True)
    counts = {"anime": 2, "concept-art": 2, "paintings": 2, "photo": 3}  # 9: not a multiple of the 4 styles
    for style, n in counts.items():
        _json(folder / "benchmark" / f"{style}.json", [f"{style}  {k}" for k in range(n)])
    prompts, styles = E.load_prompt_set(f"hpdv2={folder}", 0)
    assert prompts[:2] == ["anime 0", "anime 1"] and prompts[-1] == "photo 2"  # whitespace collapsed
    assert styles == ["anime"] * 2 + ["concept-art"] * 2 + ["paintings"] * 2 + ["photo"] * 3
    assert E.load_prompt_set(f"hpdv2={folder}", 1) == (["anime 0"], ["anime"])
    assert E.load_prompt_set(f"hpdv2={folder}", 3) == (  # prompts 0, 3, 6 of 9
        ["anime 0", "concept-art 1", "photo 0"],
        ["anime", "concept-art", "photo"],
    )
    shapes, plain = E.load_prompt_set("shapes-eval", 0)
    assert len(shapes) > 1 and plain == [""] * len(shapes)
    nowhere = tmp_path / ("n" * 230)  # the reason cut at 200 characters
    with pytest.raises(InputError) as e:
        E.load_prompt_set(f"hpdv2={nowhere}", 0)
    missing = nowhere / "benchmark" / "anime.json"
    why = f"FileNotFoundError: {str(FileNotFoundError(2, 'No such file or directory', str(missing)))[:200]}"
    assert str(e.value) == f"--prompts hpdv2={nowhere}: {why}; give hpdv2=FOLDER"
    monkeypatch.setattr(E, "hpdv2_prompts", lambda folder: [f"from {folder}"] * 4)  # the hub's, stubbed
    assert E.load_prompt_set("hpdv2", 0) == (["from None"] * 4, ["anime", "concept-art", "paintings", "photo"])


def test_a_cache_file_that_cannot_be_written_names_what_is_in_the_way(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError) as e:
        E.save_atomically({"a": 1}, tmp_path / "file" / "x.json")
    assert str(e.value) == (
        f"--out: {tmp_path / 'file'} is not a folder, where the cache writes x.json; remove it, or give another --out"
    )
    E.save_atomically({"a": 1}, tmp_path / "ok" / "x.json")
    assert json.loads((tmp_path / "ok" / "x.json").read_text()) == {"a": 1}

    def full(obj, f):  # a full disk: torch.save's RuntimeError after part of the file
        open(f, "wb").write(b"part")
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(E.torch, "save", full)  # any failure of the write: one line naming the file
    with pytest.raises(RunError, match=r"cannot write .*batch_00000.pt \(RuntimeError: PytorchStreamWriter failed"):
        E.save_atomically({"a": torch.zeros(1)}, tmp_path / "ok" / "batch_00000.pt")
    assert sorted(p.name for p in (tmp_path / "ok").iterdir()) == ["x.json"]  # no temporary file left


def test_a_row_name_that_is_a_path_is_one_error_naming_weights(tmp_path, monkeypatch, capsys):
    """--weights NAME=PATH: the name names the row's cache folder, so ../ in it would write outside --out."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text("{}")
    out = tmp_path / "a" / "b" / "eval"
    for name in ("../../../X", "a//b", "."):
        code, errors, err = cli([*SMALL, "--out", str(out), "--weights", f"{name}={tmp_path / 'cfg'}"], monkeypatch,
                                capsys)  # fmt: skip
        assert code == 2 and "Traceback" not in err and len(errors) == 1, err
        assert errors[0].startswith(f"error: --weights {name}={tmp_path / 'cfg'}: the row name "), errors
    assert not (tmp_path / "X").exists() and not out.exists()


@pytest.mark.parametrize("what", ["folder", "link"])
def test_a_report_file_that_is_a_folder_or_a_link_is_one_error_and_nothing_is_written_through(
    tmp_path, monkeypatch, capsys, what
):
    out, outside = tmp_path / "eval", tmp_path / "outside.md"
    E.main(tyro.cli(E.EvalArgs, args=[*SMALL, "--out", str(out)]))
    for name in ("results.md", "grid.png"):
        (out / name).unlink()
        if what == "folder":
            (out / name / "inside").mkdir(parents=True)
        else:
            outside.write_text("theirs")
            (out / name).symlink_to(outside)
        code, errors, err = cli([*SMALL, "--out", str(out)], monkeypatch, capsys)
        kind = "a folder" if what == "folder" else "a symbolic link"
        assert code == 2 and "Traceback" not in err and errors == [
            f"error: --out: {out / name} is {kind}, where the report writes {name}; remove it, or give another --out"]  # fmt: skip
        assert what == "folder" or outside.read_text() == "theirs"
        shutil.rmtree(out / name) if what == "folder" else (out / name).unlink()
        E.main(tyro.cli(E.EvalArgs, args=[*SMALL, "--out", str(out)]))
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]


def test_a_config_is_compared_value_by_value_whatever_its_key_order_and_types(tmp_path):
    """A transformer config may hold a dict (compared whatever the order of its keys) or a set (written as a list)."""
    from types import SimpleNamespace

    from diffusers import ConfigMixin, ModelMixin
    from diffusers.configuration_utils import register_to_config
    from safetensors.torch import save_file

    class Roped(ModelMixin, ConfigMixin):
        @register_to_config
        def __init__(self, rope: dict | None = None, scale: dict | None = None, axes: set | None = None):
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)

    # each dict's keys in the other order on each side: the model's `rope`, the file's `scale`
    model = SimpleNamespace(
        transformer=Roped(rope={"theta": 10000, "dims": [16, 56]}, scale={"a": 1, "b": 2}, axes={3})
    )
    config = {
        "_class_name": "Roped",
        "rope": {"dims": [16, 56], "theta": 10000},
        "scale": {"b": 2, "a": 1},
        "axes": [3],
    }
    _json(tmp_path / "config.json", config)
    save_file({k: v.contiguous() for k, v in model.transformer.state_dict().items()},
              tmp_path / "diffusion_pytorch_model.safetensors")  # fmt: skip
    E.check_weights(model, "r", tmp_path)
    _json(tmp_path / "config.json", config | {"rope": {"dims": [16, 56], "theta": 500}})
    assert refusal(model, "r", tmp_path).startswith(f"--weights r: {tmp_path / 'config.json'} is another Roped than")
