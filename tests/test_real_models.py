"""The real-model path (FLUX.1 / SD3.5 / SD1.5 on GPUs), tested on tiny random-weight models built from configs:
ShapesBench defaults never apply to a real model, the memory settings (bf16 frozen base under LoRA, gradient
checkpointing, --offload-frozen), the evaluation subset, run.sh as the one source of GPU commands."""

import json
import os
import re
import shlex
import subprocess
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import tyro

import branchgrpo
import dancegrpo as D
import dgpo
import diffusionnft
import rlr
import vgrpo
from common import InputError
from common.flags import check_run_args
from common.models import load_model, trainable_denoiser
from common.offload import Offloaded
from common.prompts import evenly_spaced
from tests.helpers import ROOT
from tests.tiny import BUILDERS, PROMPTS, RES

SCRIPTS = {
    "dancegrpo.py": D,
    "branchgrpo.py": branchgrpo,
    "vgrpo.py": vgrpo,
    "rlr.py": rlr,
    "diffusionnft.py": diffusionnft,
    "dgpo.py": dgpo,
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """kind -> folder of a tiny random model of that kind, each built once per module."""
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = tmp_path_factory.mktemp(kind)
            BUILDERS[kind](cache[kind])
        return cache[kind]

    return get


# ---------------------------------------------------------------- ShapesBench defaults never reach a real model
@pytest.mark.parametrize("script", SCRIPTS)
def test_real_model_without_prompts_fails_before_it_loads(script, tmp_path):
    """A FLUX (SD1.x for rlr.py) --model-id without --prompts: one `error:` line naming the flag, exit 2, no run
    folder. The model's weights are deleted, so a run that loaded it would fail with another message."""
    kind = "sd1" if script == "rlr.py" else "flux"
    BUILDERS[kind](tmp_path / kind)
    for weights in (tmp_path / kind).glob("*/diffusion_pytorch_model.safetensors"):
        weights.unlink()
    out = subprocess.run(
        [sys.executable, script, "--model-id", str(tmp_path / kind), "--output-dir", str(tmp_path / "runs")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
            **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"},  # packages installed with --target
        },  # fmt: skip
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: --prompts shapes-train: ") and "zhwang/HPDv2" in errors[0]
    assert not (tmp_path / "runs").exists()


def run_args(model_id, **flags):
    return tyro.cli(D.Args, args=["--model-id", model_id] + [w for k, v in flags.items() for w in (f"--{k}", v)])


def test_each_shapesbench_default_is_refused_for_a_real_model(tiny_dir, tmp_path):
    (tmp_path / "p.txt").write_text("a cat\na dog\n")
    flux, prompts = str(tiny_dir("flux")), str(tmp_path / "p.txt")
    cases = {
        "--eval-prompts shapes-eval": {"prompts": prompts},
        "--prompts shapes-train": {"prompts": "shapes-train", "eval-prompts": prompts},
        "--reward shapes: shapes is ShapesBench's": {"prompts": prompts, "eval-prompts": prompts},
        "--reward hpsv2.1,verifier:0.5: verifier is": {
            "prompts": prompts,
            "eval-prompts": prompts,
            "reward": "hpsv2.1,verifier:0.5",
        },
    }
    for message, flags in cases.items():
        with pytest.raises(InputError) as e:
            check_run_args(run_args(flux, **flags))
        assert str(e.value).startswith(message) and f"--model-id {flux}" in str(e.value)
    # the same flags on ShapesBench are its defaults; a real model with a real reward passes
    assert len(check_run_args(run_args("shapesbench"))[1]) == 48
    train, held_out, _ = check_run_args(run_args(flux, prompts=prompts, **{"eval-prompts": prompts, "reward": "jpeg"}))
    assert train == held_out == ["a cat", "a dog"]


def test_evaluation_uses_a_fixed_evenly_spaced_subset():
    # HPDv2's benchmark file order: 800 prompts per style; 48 evenly spaced ones take 12 of each
    prompts = [f"{style} {i}" for style in ("anime", "concept-art", "paintings", "photo") for i in range(800)]
    subset = evenly_spaced(prompts, 48)
    assert len(subset) == 48 and len(set(subset)) == 48 and subset == evenly_spaced(prompts, 48)
    assert [sum(p.startswith(s) for p in subset) for s in ("anime", "concept", "paintings", "photo")] == [12] * 4
    assert evenly_spaced(prompts[:5], 48) == prompts[:5]


def test_hpdv2_prompt_file_from_the_benchmark_jsons(tmp_path):
    """`python -m common.prompts hpdv2 OUT --from FOLDER` (FOLDER as the hub dataset lays it out)."""
    (tmp_path / "benchmark").mkdir()
    for style in ("anime", "concept-art", "paintings", "photo"):
        (tmp_path / "benchmark" / f"{style}.json").write_text(json.dumps([f"{style} one", f"{style}\ntwo "]))
    cmd = [sys.executable, "-m", "common.prompts", "hpdv2", str(tmp_path / "out.txt"), "--from", str(tmp_path)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    lines = (tmp_path / "out.txt").read_text().splitlines()
    assert lines[:3] == ["anime one", "anime two", "concept-art one"] and len(lines) == 8


# ---------------------------------------------------------------- memory: dtypes, checkpointing, offload
def denoiser_args(lora=True, checkpointing=False):
    return SimpleNamespace(lora=lora, lora_rank=4, lora_alpha=4.0, gradient_checkpointing=checkpointing)


@pytest.mark.parametrize("kind", ["flux", "sd3", "sd1", "wan"])
def test_lora_keeps_the_frozen_base_in_bf16_and_the_adapter_in_fp32(kind, tiny_dir):
    model = load_model(str(tiny_dir(kind)), dtype=torch.bfloat16, resolution=RES)
    denoiser = trainable_denoiser(model, denoiser_args())
    trained = [p for p in denoiser.parameters() if p.requires_grad]
    frozen = [p for p in denoiser.parameters() if not p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    fp32 = denoiser._keep_in_fp32_modules or []  # diffusers keeps Wan's time embedding and modulation in fp32
    assert frozen and all(p.dtype == torch.bfloat16 for n, p in denoiser.named_parameters()
                          if not p.requires_grad and not any(k in n.split(".") for k in fp32))  # fmt: skip
    assert all(p.dtype == torch.bfloat16 for m in model.text_encoders for p in m.parameters())
    vae_dtype = torch.float32 if kind == "wan" else torch.bfloat16  # Wan decodes in fp32, as its authors do
    assert all(p.dtype == vae_dtype for p in model.vae.parameters())
    # full fine-tuning: fp32 master weights for the optimizer
    full = trainable_denoiser(
        load_model(str(tiny_dir(kind)), dtype=torch.bfloat16, resolution=RES), denoiser_args(False)
    )
    assert all(p.dtype == torch.float32 and p.requires_grad for p in full.parameters())


@pytest.mark.parametrize("kind", ["flux", "sd3", "wan"])
def test_gradient_checkpointing_gives_ratio_one_and_the_same_gradient(kind, tiny_dir):
    """One DanceGRPO micro-batch (rollout, then the clipped loss on two SDE steps), with and without checkpointing:
    the first ratio is exactly 1 and the LoRA gradients are equal."""
    grads, path = [], str(tiny_dir(kind))
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the same LoRA init
        model = load_model(path, resolution=RES)
        transformer = trainable_denoiser(model, denoiser_args(checkpointing=checkpointing))
        with torch.no_grad():  # a non-zero adapter, so the gradient reaches lora_A too
            for name, p in transformer.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(hash(name) % 1000))
        assert transformer.is_gradient_checkpointing == checkpointing
        sigmas = D.sigma_schedule(4, 3.0)
        g = D.noise_g(sigmas, "flow", 0.7)
        gen = torch.Generator().manual_seed(1)
        x0 = torch.randn(2, *model.latent_shape(), generator=gen)
        noise = torch.randn(2, 4, *model.latent_shape(), generator=gen)
        cond = model.encode_prompts(PROMPTS)
        transformer.eval()
        latents, old_log_probs, means = D.rollout(
            model, transformer, cond, x0, noise, sigmas, g, [0, 1, 2], 1.0, nullcontext, D.sde_step
        )
        transformer.train()
        adv = torch.tensor([1.0, -1.0])
        for i in (0, 2):
            v = model.velocity(transformer, latents[:, i], sigmas[i].expand(2), cond)
            _, log_prob, mean, std = D.sde_step(
                latents[:, i], v, sigmas[i], sigmas[i + 1], g[i], prev_sample=latents[:, i + 1]
            )
            loss, figures = D.policy_loss(
                log_prob, old_log_probs[:, i], adv, mean, means[:, i], None, std, sigmas[i] - sigmas[i + 1],
                objective="clip", clip_range=1e-3, kl_mask_threshold=1e-5, kl_beta=0,
            )  # fmt: skip
            assert torch.equal(figures["ratio_mean"], torch.ones(2))
            loss.mean().backward()
        grads.append({n: p.grad.clone() for n, p in transformer.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and any(g.abs().sum() > 0 for g in grads[0].values())
    for name in grads[0]:
        assert torch.equal(grads[1][name], grads[0][name]), name  # recomputed on the CPU: bit-equal


def test_offload_frozen_moves_the_frozen_parts_only_around_their_work(tiny_dir, monkeypatch, tmp_path):
    """With --offload-frozen the text encoders visit the device for encode_prompts and leave after it; the VAE and
    the reward models come for decoding and scoring and leave at park(). (On this CPU-only machine the device is the
    CPU, so the moves are recorded rather than seen.)"""
    from common.rewards import build_reward, parse_rewards
    from tests.tiny import build_tiny_hps

    moves = []
    monkeypatch.setattr(
        Offloaded, "_to", lambda self, device: moves.append((self, str(device))) if self.enabled else None
    )
    model = load_model(str(tiny_dir("flux")), resolution=RES, offload=True)

    ckpt = build_tiny_hps(tmp_path)
    from tests.tiny import use_tiny_hps

    use_tiny_hps(monkeypatch)
    reward = build_reward(parse_rewards("hpsv2.1", [f"hpsv2.1={ckpt}"]), "cpu", offload=True)
    text, vae, hps = model._text, model._vae, reward.components[0][2].parts
    assert moves == [(hps, "cpu")]  # built, then parked
    cond = model.encode_prompts(PROMPTS)
    assert moves[1:] == [(text, "cpu"), (text, "cpu")]  # fetched to the device (here the CPU), then parked
    images = model.decode(torch.randn(2, *model.latent_shape()))
    reward(images, PROMPTS)
    model.park(), reward.park()
    assert moves[3:] == [(vae, "cpu"), (hps, "cpu"), (vae, "cpu"), (hps, "cpu")]
    assert cond["prompt_embeds"].shape[0] == 2 and text.modules == model.text_encoders and vae.modules == [model.vae]


# ---------------------------------------------------------------- run.sh: the one source of GPU commands
def recipe(name, **env):
    out = subprocess.run(
        ["bash", "run.sh", "--print", name],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **env},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def gpu_recipes():
    names = subprocess.run(["bash", "run.sh", "--list"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    return [n for n in names if re.search("flux|kontext|sd35|sd15|wan|qwen", n)]


CURRICULUM = {  # DiffusionNFT's five stages: prompts, reward, cumulative iterations
    "PICKAPIC_PROMPTS": "pickscore,hpsv2.1,clip", "GENEVAL_PROMPTS": "geneval", "OCR_PROMPTS": "ocr",
}  # fmt: skip
HELD_OUT = {
    "PICKAPIC_PROMPTS": "PICKAPIC_PROMPTS",
    "GENEVAL_PROMPTS": "GENEVAL_EVAL_PROMPTS",
    "OCR_PROMPTS": "OCR_EVAL_PROMPTS",
}


def test_the_curriculum_recipe_runs_five_stages_each_resuming_the_last():
    env = {k: f"{k}.txt" for k in [*CURRICULUM, *HELD_OUT.values()]}
    stages = [shlex.split(line) for line in recipe("diffusionnft-sd35-curriculum-8gpu", **env).splitlines()]
    args = [tyro.cli(diffusionnft.Args, args=w[w.index("diffusionnft.py") + 1 :]) for w in stages]
    order = ["PICKAPIC_PROMPTS", "GENEVAL_PROMPTS", "PICKAPIC_PROMPTS", "GENEVAL_PROMPTS", "OCR_PROMPTS"]
    assert [a.prompts for a in args] == [f"{k}.txt" for k in order]
    assert [a.eval_prompts for a in args] == [f"{HELD_OUT[k]}.txt" for k in order]
    assert [a.reward for a in args] == [CURRICULUM[k] for k in order]
    assert [a.iterations for a in args] == [800, 1100, 1300, 1500, 1600]
    assert [a.resume_from for a in args] == [None] + ["latest"] * 4 and {a.exp_name for a in args} == {
        "diffusionnft-curriculum"
    }
    assert [a.beta for a in args] == [0.1, 1, 0.1, 1, 0.1] and args[-1].samples_per_update == 72
    assert all(a.gradient_checkpointing and a.mixed_precision == "bf16" and a.lora_rank == 32 for a in args)
    later = recipe("diffusionnft-sd35-curriculum-8gpu", FROM_STAGE="4", **env).splitlines()  # a restart at stage 4
    assert later == recipe("diffusionnft-sd35-curriculum-8gpu", **env).splitlines()[3:]


NEW_KINDS = {  # recipe name part -> the model its recipes train (FLUX.2 [klein]: the base, which takes CFG)
    "qwen": "Qwen/Qwen-Image", "flux2": "black-forest-labs/FLUX.2-klein-base-4B", "wan22": "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    "kontext": "black-forest-labs/FLUX.1-Kontext-dev", "qwen-edit": "Qwen/Qwen-Image-Edit-2509",
    "wan-i2v": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
}  # fmt: skip
EDIT_KINDS = {  # the recipes that read an edit file (EDITS): their reward, HPSv2.1 and image_similarity's weight
    "kontext": "hpsv2.1:0.5,image_similarity:0.5", "qwen-edit": "hpsv2.1:0.8,image_similarity:0.2",
    "wan-i2v": "hpsv2.1,temporal:0.5",
}  # fmt: skip
EDIT_RECIPES = {"dancegrpo-kontext-8gpu", "diffusionnft-kontext-8gpu", "dancegrpo-qwen-edit-8gpu",
                "diffusionnft-qwen-edit-8gpu", "dancegrpo-wan-i2v-8gpu"}  # fmt: skip
# recipes whose official code samples on a static shift where the kind's other recipes take the pipeline's grid
OFFICIAL_STATIC_SHIFT = {"dancegrpo-qwen-edit-8gpu": 3.0}  # DanceGRPO's Qwen-Image-Edit script: sd3_time_shift(3)


def recipe_kind(name: str) -> str | None:
    """The NEW_KINDS key a recipe's name holds, the longest first (qwen-edit before qwen)."""
    return next((k for k in sorted(NEW_KINDS, key=len, reverse=True) if k in name), None)


def test_every_gpu_recipe_parses_and_uses_the_memory_settings():
    assert len(gpu_recipes()) >= 15
    assert {"dancegrpo-qwen-8gpu", "branchgrpo-qwen-8gpu", "vgrpo-qwen-8gpu", "diffusionnft-qwen-8gpu"} <= set(
        gpu_recipes()
    ) and {"dancegrpo-flux2-8gpu", "dancegrpo-wan22-8gpu"} | EDIT_RECIPES <= set(gpu_recipes())
    for name in gpu_recipes():
        if "curriculum" in name:  # five commands (the test above)
            continue
        env = dict(PROMPTS="p.txt", EDITS="e.jsonl", NUM_MACHINES="2", MAIN_IP="ip", MACHINE_RANK="0")
        words = shlex.split(recipe(name, **env))
        task = next((t for t in ("geneval", "ocr") if f"-{t}" in name), None)  # the yardsticks' recipes
        if "common.evaluate" in words:  # the evaluation recipes: bf16, their prompt set, the evaluation sampler
            from common.evaluate import EvalArgs

            args = tyro.cli(EvalArgs, args=words[words.index("common.evaluate") + 1 :])
            prompts = {None: "hpdv2", "geneval": "prompts/geneval.jsonl", "ocr": "prompts/flowgrpo_ocr_test.txt"}
            assert args.mixed_precision == "bf16" and args.prompts == prompts[task] and args.num_steps in (28, 40), name
            continue
        script = next(w for w in words if w in SCRIPTS)
        flags = words[words.index(script) + 1 :]
        args = tyro.cli(SCRIPTS[script].Args, args=flags)  # a typo in a recipe fails here
        assert args.gradient_checkpointing and args.mixed_precision == "bf16", name
        if task:  # Flow-GRPO's prompt sets, as python -m common.prompts writes them, and the task's reward
            ext = ".jsonl" if task == "geneval" else ".txt"
            assert args.prompts == f"prompts/flowgrpo_{task}_train{ext}", name
            assert args.eval_prompts == f"prompts/flowgrpo_{task}_test{ext}" and args.reward == task, name
            continue
        kind = recipe_kind(name)
        edits = kind in EDIT_KINDS  # an edit file, HPSv2.1 with image_similarity beside it
        assert args.prompts == args.eval_prompts == ("e.jsonl" if edits else "p.txt") and not args.reward_ckpt, name
        reward = EDIT_KINDS[kind] if edits else "hpsv2.1,temporal:0.5" if "wan" in name else "hpsv2.1"
        assert args.reward == reward and (name in EDIT_RECIPES) == edits, name
        assert args.model_id != "shapesbench" and (args.num_frames is not None) == ("wan" in name)
        if "wan" in name:  # videos of 4k + 1 frames, scored on 4 of them
            assert (args.num_frames - 1) % 4 == 0 and args.reward_frames == 4, name
        if kind:  # the recipes of the newer kinds: their published model, LoRA
            assert args.model_id == NEW_KINDS[kind] and args.lora and args.offload_frozen, name
        # the model's own pipeline schedule where that pipeline shifts by resolution (Qwen-Image, FLUX.2) and for
        # DiffusionNFT (its official code samples on the pipeline's grid); FLUX.1's DanceGRPO, BranchGRPO and V-GRPO
        # keep their official code's static shift 3, as SD3.5's GRPO recipes and Wan's theirs; SD1.5 takes none (DDIM)
        # FLUX.1-Kontext's pipeline shifts by resolution as FLUX.1's; DanceGRPO's Qwen-Image-Edit its static 3
        dynamic = name not in OFFICIAL_STATIC_SHIFT and re.search("qwen|flux2|kontext|diffusionnft|ltx2|hunyuan", name)
        static = 5.0 if "wan22" in name else 3.0 if re.search("flux|wan|sd35", name) else None
        assert args.shift == ("pipeline" if dynamic else OFFICIAL_STATIC_SHIFT.get(name, static)), name


def test_gpu_recipe_without_prompts_says_where_to_get_them(tmp_path):
    out = subprocess.run(["bash", "run.sh", "branchgrpo-flux-8gpu"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("error: run.sh branchgrpo-flux-8gpu: set PROMPTS")
    assert "python -m common.prompts hpdv2" in out.stderr and "zhwang/HPDv2" in out.stderr
    assert "--reward-ckpt hpsv2.1=/h/HPS.pt" in recipe("vgrpo-flux-1gpu", PROMPTS="p.txt", HPS="/h/HPS.pt")
    printed = recipe("dancegrpo-flux-8gpu")
    assert "--prompts $PROMPTS --eval-prompts $PROMPTS" in printed and "/path/to" not in printed
    # the editing and image-to-video recipes read an edit file instead, and say what one holds
    out = subprocess.run(["bash", "run.sh", "dancegrpo-qwen-edit-8gpu"], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PROMPTS": "p.txt"})  # fmt: skip
    assert out.returncode == 2 and out.stderr.startswith("error: run.sh dancegrpo-qwen-edit-8gpu: set EDITS")
    assert '"instruction"' in out.stderr and "docs/editing.md" in out.stderr
    assert "--prompts $EDITS --eval-prompts $EDITS" in recipe("dancegrpo-wan-i2v-8gpu")
    assert "--reward-ckpt image_similarity=/c" in recipe("dancegrpo-kontext-8gpu", EDITS="e.jsonl", CLIP_SIM="/c")


def print_blocks(text):
    """(recipe, command) for each `bash run.sh --print NAME` line followed by the command it printed."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"bash run\.sh --print ([a-z0-9-]+)\s*$", line)
        if m:
            yield m.group(1), lines[i + 1].strip()


def test_docs_show_each_gpu_command_as_run_sh_prints_it():
    """Every FLUX / SD3.5 / SD1.5 / Wan2.1 command in the README, docs/ and the scripts is run.sh's own, printed by
    `bash run.sh --print RECIPE`; no hand-copied variant."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *(ROOT / s for s in SCRIPTS)]
    shown = 0
    for f in files:
        text = f.read_text()
        printed = dict(print_blocks(text))
        for name, command in printed.items():
            assert command == recipe(name), f"{f.name}: the command under `bash run.sh --print {name}` is stale"
        shown += len(printed)
        for line in text.splitlines():  # any other launch line with a real model would be a hand copy
            if "benchmarks/gpu/memory.py --command" in line:  # a memory plan of a setting, not a launch command
                continue
            if re.search(r"--model-id (black-forest-labs|stabilityai|stable-diffusion-v1-5|Wan-AI)/", line):
                assert line.strip() in printed.values(), f"{f.name}: a GPU command that is not a run.sh recipe: {line}"
    assert shown >= 3
