"""The model's own schedule and the pipelines' other sampling settings, on tiny random-weight pipelines (tests/tiny.py).

`--shift pipeline` (FlowModel.sigmas): each kind's grid is the one its stock diffusers pipeline samples on, read back
from the pipeline's scheduler after a call, at two resolutions, with the real checkpoints' scheduler configs where the
tiny builders' differ (FLUX.1-dev's dynamic one; Qwen-Image's dynamic, exponential one that ends at 0.02; Wan2.1's
UniPC flow sigmas); ShapesBench and SD1.x refuse it at start-up; a script rolls out and evaluates on it. Qwen-Image's
prompts are cut at the pipeline's 512 tokens; Wan2.2-T2V-A14B's --guidance-scale-2 reaches the low-noise expert."""

import json
import sys

import pytest
import torch
import tyro
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    FluxPipeline,
    QwenImagePipeline,
    StableDiffusion3Pipeline,
    UniPCMultistepScheduler,
    WanPipeline,
    ZImagePipeline,
)

import dancegrpo as D
import rlr
from common import InputError, evaluate
from common.flags import check_flags, check_run_args, cli, default_shift
from common.models import load_model, trainable_denoiser
from common.sampling import sample_ode, schedule, sigma_schedule
from tests import tiny
from tests.helpers import run_in_process

# the checkpoints' own scheduler_config.json values
FLUX1_DEV = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                 max_image_seq_len=4096, shift=3.0)  # fmt: skip
QWEN_IMAGE = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
                  max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")  # fmt: skip
WAN21_UNIPC = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
CASES = {  # name: builder, pipeline, scheduler (class, config; None: the builder's), whether mu follows the size
    "flux": (tiny.build_flux, FluxPipeline, (FlowMatchEulerDiscreteScheduler, FLUX1_DEV), True),
    "flux2": (tiny.build_flux2_klein, Flux2KleinPipeline, None, True),  # compute_empirical_mu(tokens, steps)
    "qwen": (tiny.build_qwen, QwenImagePipeline, (FlowMatchEulerDiscreteScheduler, QWEN_IMAGE), True),
    "zimage": (tiny.build_zimage, ZImagePipeline, None, False),  # Turbo's static shift 3
    "wan": (tiny.build_wan, WanPipeline, None, False),  # FlowMatchEuler shift 3: set_timesteps(T) alone
    "wan-unipc": (tiny.build_wan, WanPipeline, (UniPCMultistepScheduler, WAN21_UNIPC), False),
    "sd3": (tiny.build_sd3, StableDiffusion3Pipeline, None, False),  # SD3.5's static shift 3
}
SIZES, FRAMES, STEPS = (32, 64), 5, 4


def set_scheduler(folder, cls, config) -> None:
    """The pipeline folder's scheduler replaced by `cls(**config)` (its config file and model_index.json's entry)."""
    cls(**config).save_config(folder / "scheduler")
    index = json.loads((folder / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", cls.__name__]
    (folder / "model_index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("case", CASES)
def test_the_pipeline_grid_is_the_one_the_stock_pipeline_samples_on(case, tmp_path):
    """At two resolutions the grid of `--shift pipeline` is bit for bit the sigmas the pipeline's scheduler holds
    after a call at that size and step count; where the pipeline shifts by resolution the two grids differ."""
    builder, pipe_cls, scheduler, dynamic = CASES[case]
    builder(tmp_path)
    if scheduler is not None:
        set_scheduler(tmp_path, *scheduler)
    pipe = pipe_cls.from_pretrained(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    video = {"num_frames": FRAMES} if pipe_cls is WanPipeline else {}
    grids = []
    for size in SIZES:
        pipe(prompt="a red circle", height=size, width=size, num_inference_steps=STEPS, output_type="latent", **video)
        model = load_model(str(tmp_path), resolution=size, **video)
        assert type(model.pipe.scheduler) is type(pipe.scheduler)
        ours = schedule(model, STEPS, "pipeline")
        assert ours.dtype == torch.float32 and ours.shape == (STEPS + 1,) and ours[-1] == 0
        assert torch.equal(ours, pipe.scheduler.sigmas.float()), (ours, pipe.scheduler.sigmas)
        assert torch.equal(rlr.make_schedule(model, STEPS, 0.7, "pipeline")["sigmas"], ours)  # rlr.py's own choice
        grids.append(ours)
    assert torch.equal(*grids) != dynamic
    if case == "qwen":  # the terminal stretch: the last sigma before 0 is the config's 0.02
        assert grids[0][-2].item() == pytest.approx(0.02)


def test_shapesbench_and_sd1_refuse_the_pipeline_schedule_at_start_up(tmp_path, monkeypatch, capsys):
    """One `error:` line naming the flag, before any model loads (ShapesBench has no pipeline of its own; SD1.x samples
    DDIM timesteps, so rlr.py refuses any --shift there); a shift <= 0 is refused too, and common.evaluate refuses as
    the scripts do."""
    monkeypatch.setattr(sys, "argv", ["dancegrpo.py", "--shift", "pipeline", "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        cli(D.main, D.Args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: --shift pipeline: ShapesBench has no diffusers pipeline"), err
    assert not list(tmp_path.iterdir())  # nothing written
    with pytest.raises(InputError, match="--shift must be > 0"):
        check_run_args(tyro.cli(D.Args, args=["--shift", "0"]))
    with pytest.raises(InputError, match="--shift pipeline: ShapesBench"):
        evaluate.main(tyro.cli(evaluate.EvalArgs, args=["--shift", "pipeline", "--out", str(tmp_path / "e")]))
    tiny.build_sd1(tmp_path / "sd1")
    (tmp_path / "p.txt").write_text("a cat\n")
    argv = ["--model-id", str(tmp_path / "sd1"), "--prompts", str(tmp_path / "p.txt"), "--eval-prompts",
            str(tmp_path / "p.txt"), "--reward", "jpeg", "--shift", "pipeline"]  # fmt: skip
    for value in ("pipeline", "2"):  # SD1.x samples DDIM timesteps: no --shift applies
        with pytest.raises(InputError, match=r"--shift only applies with a flow model \(SD1.x samples DDIM"):
            rlr.resolve_and_check(tyro.cli(rlr.Args, args=[*argv[:-1], value]))
    # the default: ShapesBench's static 3 (it has no pipeline), none on SD1.x, 'pipeline' on every other kind
    for script in (D, rlr):
        args = script.Args(output_dir=str(tmp_path))
        script.resolve_and_check(args)
        assert args.shift == 3.0
    args = tyro.cli(rlr.Args, args=argv[:-2])
    check_flags(args, [])  # where the default is filled in, first of the checks
    assert args.shift is None
    assert [default_shift(k) for k in ("shapes", "sd1", "sd3", "flux", "qwenimage", "wan")] == [
        3.0, None, "pipeline", "pipeline", "pipeline", "pipeline"]  # fmt: skip


def test_a_script_rolls_out_and_evaluates_on_the_pipeline_grid(tmp_path, monkeypatch):
    """dancegrpo.py on a tiny Qwen-Image (its real, dynamic config) without --shift, whose default on a model with a
    diffusers pipeline is 'pipeline': the rollouts' SDE takes the pipeline's 4-step grid and the held-out evaluation
    its 3-step one, both as QwenImagePipeline builds them at 32 px, and neither is the static shift's;
    `python -m common.evaluate` (its default too) samples on the 3-step one."""
    import common.evaluator

    tiny.build_qwen(tmp_path / "qwen")
    (tmp_path / "p.txt").write_text("a red circle\na green square\n")
    seen = {"rollout": [], "eval": []}
    noise_g, ode_sampler = D.noise_g, common.evaluator.ode_sampler
    monkeypatch.setattr(D, "noise_g", lambda sigmas, *a: seen["rollout"].append(sigmas) or noise_g(sigmas, *a))
    monkeypatch.setattr(
        common.evaluator, "ode_sampler", lambda m, t, sigmas, *a: seen["eval"].append(sigmas) or ode_sampler(m, t, sigmas, *a)
    )  # fmt: skip
    flags = ["--model-id", str(tmp_path / "qwen"), "--resolution", "32", "--prompts", str(tmp_path / "p.txt"),
             "--eval-prompts", str(tmp_path / "p.txt"), "--reward", "jpeg", "--num-steps", "4",
             "--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "2", "--samples-per-update", "4",
             "--iterations", "1", "--eval-every", "1", "--eval-samples-per-prompt", "1", "--eval-steps", "3",
             "--sample-every", "0", "--lora-rank", "4", "--no-save"]  # fmt: skip
    run_in_process("dancegrpo.py", flags, tmp_path)
    monkeypatch.setattr(evaluate, "ode_sampler", lambda m, t, sigmas, *a: seen["eval"].append(sigmas) or ode_sampler(m, t, sigmas, *a))  # fmt: skip
    argv = ["--model-id", str(tmp_path / "qwen"), "--resolution", "32", "--prompts", str(tmp_path / "p.txt"), "--reward",
            "jpeg", "--samples-per-prompt", "1", "--num-steps", "3", "--out", str(tmp_path / "e")]  # fmt: skip
    evaluate.main(tyro.cli(evaluate.EvalArgs, args=argv))
    pipe = QwenImagePipeline.from_pretrained(tmp_path / "qwen")
    pipe.set_progress_bar_config(disable=True)
    for key, steps in (("rollout", 4), ("eval", 3)):
        pipe(prompt="a red circle", height=32, width=32, num_inference_steps=steps, output_type="latent")
        assert len(seen[key]) == {"rollout": 1, "eval": 2}[key]  # the script's evaluator, then common.evaluate
        for sigmas in seen[key]:
            assert torch.equal(sigmas, pipe.scheduler.sigmas), (key, sigmas, pipe.scheduler.sigmas)
            assert sigmas[-2].item() == pytest.approx(0.02) and not torch.equal(sigmas, sigma_schedule(steps, 3))


def test_qwen_image_cuts_a_long_prompt_at_the_pipelines_512_tokens(tmp_path):
    """A 600-token prompt (one token per byte): QwenImagePipeline's call passes max_sequence_length 512 to
    encode_prompt (whose own default is 1024), and our conditioning is what its transformer receives."""
    tiny.build_qwen(tmp_path)
    model = load_model(str(tmp_path), resolution=32)
    pipe = QwenImagePipeline.from_pretrained(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    long = ("a red circle on a green square " * 20)[:600]
    full, _ = pipe.encode_prompt([long])
    assert full.shape[1] >= 600  # the prompt's 600 bytes (and the template's tail) after its first 34 tokens
    received = []

    def grab(p, i, t, tensors):
        received.append(tensors["prompt_embeds"])
        return {}

    pipe(prompt=long, height=32, width=32, num_inference_steps=2, output_type="latent", callback_on_step_end=grab,
         callback_on_step_end_tensor_inputs=["prompt_embeds"])  # fmt: skip
    cond = model.encode_prompts([long])
    assert received[0].shape[1] == cond["prompt_embeds"].shape[1] == 512
    assert torch.equal(cond["prompt_embeds"], received[0]) and torch.equal(cond["prompt_embeds"], full[:, :512])
    assert cond["prompt_embeds_mask"].all()


def test_a14b_takes_its_second_guidance_scale_on_the_low_noise_expert(tmp_path, monkeypatch):
    """--guidance-scale-2: WanPipeline(guidance_scale=5, guidance_scale_2=2)'s latents are our sampler's to float
    rounding (and not those of 5 on both experts); in one batch across the boundary each row gets its expert's scale;
    trainable_denoiser hands the flag to the model, as common.evaluate does; the flag is refused on a one-expert Wan
    and without CFG."""
    tiny.build_wan22_a14b(tmp_path / "a14b")
    model = load_model(str(tmp_path / "a14b"), resolution=32, num_frames=FRAMES)
    pipe = WanPipeline.from_pretrained(tmp_path / "a14b")
    pipe.set_progress_bar_config(disable=True)
    prompts, noise = ["a cat walks", "a red car drives"], torch.randn(2, *model.latent_shape())
    cond = model.encode_prompts(prompts)
    kw = dict(height=32, width=32, num_frames=FRAMES, num_inference_steps=6, output_type="latent")
    stock = pipe(prompts, latents=noise.clone(), guidance_scale=5.0, guidance_scale_2=2.0, **kw).frames
    sigmas = pipe.scheduler.sigmas
    assert (sigmas[:-1] >= 0.875).tolist() == [True, True, False, False, False, False]  # both experts at work
    model.decode = lambda x: x
    same = sample_ode(model, model.transformer, cond, noise, sigmas, 5.0)
    model.guidance_scale_2 = 2.0
    ours = sample_ode(model, model.transformer, cond, noise, sigmas, 5.0)
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=0)
    assert (same - stock).abs().max() > 1e-3
    # one batch across the boundary: the high-noise row at 5, the low-noise row at 2, as each alone
    sigma = torch.tensor([0.95, 0.5])
    both = model.velocity(model.transformer, noise, sigma, cond, 5.0)
    model.guidance_scale_2 = None
    alone = [model.velocity(model.transformer, noise[i : i + 1], sigma[i : i + 1], {k: v[i : i + 1] for k, v in
             cond.items()}, s) for i, s in enumerate((5.0, 2.0))]  # fmt: skip
    torch.testing.assert_close(both, torch.cat(alone), atol=1e-6, rtol=0)
    # the flag reaches the model through trainable_denoiser, and is checked at start-up
    (tmp_path / "p.txt").write_text("a cat walks\n")
    base = ["--prompts", str(tmp_path / "p.txt"), "--eval-prompts", str(tmp_path / "p.txt"), "--reward", "jpeg"]
    args = tyro.cli(D.Args, args=[*base, "--model-id", str(tmp_path / "a14b"), "--guidance-scale", "4",
                                  "--guidance-scale-2", "3"])  # fmt: skip
    check_run_args(args)
    trainable_denoiser(model, args)
    assert model.guidance_scale_2 == 3.0
    scales = []
    ode_sampler = evaluate.ode_sampler
    monkeypatch.setattr(evaluate, "ode_sampler", lambda m, *a: scales.append(m.guidance_scale_2) or ode_sampler(m, *a))
    argv = ["--model-id", str(tmp_path / "a14b"), "--resolution", "32", "--num-frames", str(FRAMES), "--prompts",
            str(tmp_path / "p.txt"), "--reward", "jpeg", "--samples-per-prompt", "1", "--num-steps", "2",
            "--guidance-scale", "4", "--guidance-scale-2", "3", "--out", str(tmp_path / "e")]  # fmt: skip
    evaluate.main(tyro.cli(evaluate.EvalArgs, args=argv))
    assert scales == [3.0]
    with pytest.raises(InputError, match="--guidance-scale-2 needs --guidance-scale > 1"):
        check_run_args(tyro.cli(D.Args, args=[*base, "--model-id", str(tmp_path / "a14b"), "--guidance-scale-2", "3"]))
    tiny.build_wan(tmp_path / "wan")
    one = [*base, "--model-id", str(tmp_path / "wan"), "--guidance-scale", "4", "--guidance-scale-2", "3"]
    with pytest.raises(InputError, match="--guidance-scale-2 only applies with a two-expert Wan2.2-T2V-A14B"):
        check_run_args(tyro.cli(D.Args, args=one))


def test_the_schedules_benchmark_measures_the_static_grids_distance_from_each_pipelines():
    """benchmarks/claims/schedules.py (docs/models.md's table): Qwen-Image's 10-step grid at 512 px is 0.245 from the static
    shift 3's (0.429 vs 0.183 at step 8) and ends at 0.02; Z-Image-Turbo's static shift 3 is ours."""
    from benchmarks.claims.schedules import rows

    found = {(r["model"], r["px"], r["steps"]): r for r in rows()}
    qwen = found["Qwen-Image", 512, 10]
    assert qwen["max_diff"] == pytest.approx(0.245, abs=1e-3) and qwen["step"] == 8
    assert qwen["last"] == pytest.approx(0.02)
    assert found["Z-Image-Turbo", 512, 6]["max_diff"] < 1e-6
