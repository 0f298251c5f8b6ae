"""Every script trains an editing model (the tiny FLUX.1-Kontext of tests/tiny.py) on an edit file, and the source image
reaches every forward: the rollout's, the training's, the held-out evaluation's and the sample grid's (each forward
sees the noisy tokens and the source's, and the source tokens are the ones of that row's image). DanceGRPO in its
modes (Flow-GRPO's SDE, DanceGRPO's, CPS, MixGRPO's window, GRPO-Guard), BranchGRPO, V-GRPO, DiffusionNFT, DGPO and its
online DPO, and RLR through the decoder and a differentiable reward."""

import json

import numpy as np
import pytest
from diffusers import FluxTransformer2DModel
from PIL import Image

from common.edits import EditPrompt
from common.models import load_model
from tests.helpers import find_run, metrics, run_in_process
from tests.test_model_kinds import TINY
from tests.tiny import RES, build_kontext

MODES = {  # name: (script, extra flags)
    "dancegrpo": ("dancegrpo.py", []),
    "dancegrpo-dance": ("dancegrpo.py", ["--sde-type", "dance"]),
    "dancegrpo-cps": ("dancegrpo.py", ["--sde-type", "cps"]),
    "mixgrpo": ("dancegrpo.py", ["--sde-window", "2"]),
    "grpo-guard": ("dancegrpo.py", ["--objective", "guard"]),
    "branchgrpo": ("branchgrpo.py", []),
    "vgrpo": ("vgrpo.py", []),
    "diffusionnft": ("diffusionnft.py", []),
    "dgpo": ("dgpo.py", []),
    "dpo": ("dgpo.py", ["--objective", "dpo", "--train-batch-size", "2"]),
}


@pytest.fixture(scope="module")
def edit_setup(tmp_path_factory):
    """The tiny Kontext folder and an edit file: two instructions on two noise images of different sizes."""
    root = tmp_path_factory.mktemp("kontext")
    build_kontext(root / "model")
    rows = []
    for i, size in enumerate([(48, 40), (40, 56)]):
        rng = np.random.default_rng(i)
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(root / f"s{i}.png")
        rows.append({"instruction": ["make the sky red", "remove the cat"][i], "image": f"s{i}.png"})
    (root / "edits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def watch_forwards(monkeypatch):
    """Record, for every transformer forward, its token count and its source tokens (the second half)."""
    seen, forward = [], FluxTransformer2DModel.forward

    def spy(self, hidden_states, *args, **kwargs):
        seen.append((hidden_states.shape[1], hidden_states[:, hidden_states.shape[1] // 2 :].detach().clone()))
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(FluxTransformer2DModel, "forward", spy)
    return seen


@pytest.mark.parametrize("mode", MODES)
def test_every_script_trains_an_edit_model_with_the_source_in_every_forward(mode, edit_setup, tmp_path, monkeypatch):
    script, extra = MODES[mode]
    model = load_model(str(edit_setup / "model"), resolution=RES)
    prompts = [
        EditPrompt(t, [str(edit_setup / f"s{i}.png")]) for i, t in enumerate(["make the sky red", "remove the cat"])
    ]
    sources = model.encode_prompts(prompts)["image_latents"]  # (2, 64, 64): each row's source tokens
    seen = watch_forwards(monkeypatch)
    edits = str(edit_setup / "edits.jsonl")
    flags = [*TINY[script], "--model-id", str(edit_setup / "model"), "--resolution", str(RES), "--prompts", edits,
             "--eval-prompts", edits, "--reward", "jpeg", "--guidance-scale", "3.5", "--iterations", "1",
             "--eval-every", "1", "--eval-samples-per-prompt", "1", "--eval-steps", "2", "--sample-every", "1",
             "--lora-rank", "4", "--learning-rate", "1e-2", "--exp-name", mode, *extra]  # fmt: skip
    run_in_process(script, flags, tmp_path)
    records = metrics(find_run(tmp_path / mode))
    assert [r["iteration"] for r in records if "eval/reward" in r] == [0, 1]
    assert len(seen) > 10
    for tokens, source in seen:  # 64 noisy + 64 source tokens, and each row's source is one of the two images'
        assert tokens == 2 * 64
        for row in source:
            # to 1e-4: the VAE encodes a batch of another size there (2e-6 apart); the other source is 2.5 away
            assert min((row.float() - s).abs().max().item() for s in sources) < 1e-4, "a forward without its source"
    assert {min(range(2), key=lambda k: (row.float() - sources[k]).abs().max()) for _, s in seen for row in s} == {0, 1}


def test_rlr_trains_an_edit_model_through_the_decoder(edit_setup, tmp_path, monkeypatch):
    """rlr.py's first-order term backpropagates through the decoder and a differentiable edit reward (the consistency
    with the source, image_similarity, on a tiny CLIP), its zero-order term perturbs the adapter."""
    from tests.tiny import build_tiny_clip

    build_tiny_clip(tmp_path / "clip", size=32)
    seen = watch_forwards(monkeypatch)
    edits = str(edit_setup / "edits.jsonl")
    argv = ["--model-id", str(edit_setup / "model"), "--resolution", str(RES), "--prompts", edits, "--eval-prompts",
            edits, "--reward", "image_similarity", "--reward-ckpt", f"image_similarity={tmp_path / 'clip'}",
            "--guidance-scale", "3.5", "--iterations", "1", "--samples-per-device", "4", "--group-size", "2",
            "--rollout-batch-size", "2", "--num-steps", "4", "--eval-every", "0", "--sample-every", "0",
            "--terms", "fo+ho+zo", "--subchain-stage", "any", "--subchain-len", "1", "--lora-rank", "4",
            "--exp-name", "rlr"]  # fmt: skip
    run_in_process("rlr.py", argv, tmp_path)
    train = [r for r in metrics(find_run(tmp_path / "rlr")) if "grad/fo_norm" in r]
    assert len(train) == 1 and train[0]["grad/fo_norm"] > 0 and train[0]["grad/zo_norm"] > 0
    assert seen and all(tokens == 2 * 64 for tokens, _ in seen)


def test_an_edit_run_resumes_bitwise_and_two_processes_train_as_one(edit_setup, tmp_path, capsys):
    """The sources travel with the prompts through the iteration's draw, the groups split over processes and a resume:
    1 iteration then a resume to 2 gives the straight 2 iterations' adapter bitwise, and 2 processes x 2 images give
    1 process x 4's (to the all-reduce's rounding)."""
    import sys

    from safetensors.torch import load_file

    from tests.helpers import assert_same_trained_weights, run_script

    edits = str(edit_setup / "edits.jsonl")
    flags = [*TINY["dancegrpo.py"], "--model-id", str(edit_setup / "model"), "--resolution", str(RES), "--prompts",
             edits, "--eval-prompts", edits, "--reward", "jpeg", "--guidance-scale", "3.5", "--iterations", "2",
             "--eval-every", "0", "--sample-every", "0", "--lora-rank", "4", "--learning-rate", "1e-2",
             "--samples-per-update", "2"]  # fmt: skip
    run_in_process("dancegrpo.py", [*flags, "--exp-name", "straight"], tmp_path)
    run_in_process("dancegrpo.py", [*flags, "--exp-name", "cut", "--iterations", "1"], tmp_path)
    capsys.readouterr()
    run_in_process("dancegrpo.py", [*flags, "--exp-name", "cut", "--resume-from", "latest"], tmp_path)
    assert "iter_000001 at iteration 1" in capsys.readouterr().out
    assert_same_trained_weights(tmp_path / "straight", tmp_path / "cut")
    one = [*flags[:-2], "--samples-per-update", "4"]  # 1 optimizer step an iteration, whatever the split
    run_in_process("dancegrpo.py", [*one, "--exp-name", "one"], tmp_path)
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2")
    two = ["--samples-per-device", "2", "--rollout-batch-size", "2", "--samples-per-update", "2", "--exp-name", "two"]
    run_script("dancegrpo.py", [*one, *two], tmp_path, launcher, {"ACCELERATE_USE_CPU": "1"})
    a, b = (load_file(next((find_run(tmp_path / r) / "final").glob("*.safetensors"))) for r in ("one", "two"))
    assert a.keys() == b.keys() and any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)
    for k in a:
        assert (a[k] - b[k]).abs().max() < 1e-4, k
