"""Video (Wan2.1, Wan2.2-TI2V-5B and the two-expert Wan2.2-T2V-A14B text-to-video) on tiny random-weight pipelines
built from configs: the model against the stock WanPipeline, the video rewards, and dancegrpo.py, branchgrpo.py and
vgrpo.py end to end (2 iterations, ratio 1 at the first update, resume bit-equal, rewards logged per component, sample
videos written; on Wan2.2, final/ read by WanPipeline; A14B's experts both trained, also by 2 processes); rlr.py
refuses video."""

import sys

import pytest
import torch
import tyro
from diffusers import WanPipeline
from PIL import Image

import dancegrpo as D
import rlr
from common import InputError
from common.flags import check_run_args
from common.models import WanExperts, WanModel, add_lora, load_model
from common.rewards import CompositeReward, ScoreFn, build_reward, frame_subset, parse_rewards
from common.sampling import sample_ode
from tests.helpers import assert_same_trained_weights, find_run, metrics, run_in_process
from tests.tiny import build_shapes, build_wan, build_wan22_5b, build_wan22_a14b

RES, FRAMES = 32, 5  # latents (16, 2, 4, 4): 2 latent frames of 2 x 2 tokens


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("wan")
    build_wan(path)
    (path / "prompts.txt").write_text("a cat walks\na red car drives\n")
    return path


# ---------------------------------------------------------------- the model
def test_wan_samples_what_the_stock_pipeline_samples(wan_dir):
    """Our Euler sampler on WanModel's velocity and decode, along the pipeline scheduler's sigmas, gives WanPipeline's
    frames: the same timestep scale (1000 sigma), CFG (negative prompt ""), latent normalisation and frame layout."""
    model = load_model(str(wan_dir), resolution=RES, num_frames=FRAMES)
    assert model.kind == "wan" and model.latent_shape() == (16, 2, RES // 8, RES // 8)
    pipe = WanPipeline.from_pretrained(wan_dir)
    pipe.set_progress_bar_config(disable=True)
    prompts, noise = ["a cat walks", "a red car drives"], torch.randn(2, *model.latent_shape())
    for scale in (1.0, 5.0):
        stock = pipe(prompts, height=RES, width=RES, num_frames=FRAMES, num_inference_steps=4, guidance_scale=scale,
                     latents=noise.clone(), output_type="pt").frames  # fmt: skip
        sigmas = pipe.scheduler.sigmas  # set by the call above: 4 shifted steps and the final 0
        ours = sample_ode(model, model.transformer, model.encode_prompts(prompts), noise, sigmas, scale)
        assert ours.shape == stock.shape == (2, FRAMES, 3, RES, RES)
        torch.testing.assert_close(ours, stock, atol=2e-5, rtol=1e-4)
        # and the latents themselves, tightly: a tiny random VAE barely moves its pixels when a latent moves
        stock_latents = pipe(prompts, height=RES, width=RES, num_frames=FRAMES, num_inference_steps=4,
                             guidance_scale=scale, latents=noise.clone(), output_type="latent").frames  # fmt: skip
        model.decode = lambda x: x
        ours_latents = sample_ode(model, model.transformer, model.encode_prompts(prompts), noise, sigmas, scale)
        del model.decode
        torch.testing.assert_close(ours_latents, stock_latents, atol=1e-5, rtol=0)  # 0.1% of CFG 5: 6e-5 off


def test_wan22_5b_feeds_one_timestep_per_token_and_samples_what_the_stock_pipeline_samples(tmp_path):
    """Wan2.2-TI2V-5B (a tiny one): 48 latent channels, 16x in space (the VAE's 2x2 pixel patchify, then 8x), one
    timestep per token as WanPipeline's expand_timesteps path feeds it; our Euler sampler's latents equal the
    pipeline's exactly with CFG 5 and without, and its decoded frames to float rounding. A two-expert Wan2.2 (A14B)
    is refused with the checkpoints that work."""
    build_wan22_5b(tmp_path / "wan22")
    model = load_model(str(tmp_path / "wan22"), resolution=64, num_frames=FRAMES)
    assert model.kind == "wan" and model.per_token and model.latent_shape() == (48, 2, 4, 4)
    native = load_model(str(tmp_path / "wan22"))  # its own 720p and 121 frames: (121 - 1) / 4 + 1, 704 / 16, 1280 / 16
    assert (native.height, native.width, native.num_frames, native.latent_shape()) == (704, 1280, 121, (48, 31, 44, 80))
    pipe = WanPipeline.from_pretrained(tmp_path / "wan22")
    pipe.set_progress_bar_config(disable=True)
    prompts, noise = ["a cat walks", "a red car drives"], torch.randn(2, *model.latent_shape())
    cond = model.encode_prompts(prompts)
    for scale in (1.0, 5.0):
        kw = dict(height=64, width=64, num_frames=FRAMES, num_inference_steps=3, guidance_scale=scale)
        stock = pipe(prompts, latents=noise.clone(), output_type="pt", **kw).frames
        ours = sample_ode(model, model.transformer, cond, noise, pipe.scheduler.sigmas, scale)
        assert ours.shape == stock.shape == (2, FRAMES, 3, 64, 64)
        torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-4)
        stock_latents = pipe(prompts, latents=noise.clone(), output_type="latent", **kw).frames
        model.decode = lambda x: x
        ours_latents = sample_ode(model, model.transformer, cond, noise, pipe.scheduler.sigmas, scale)
        del model.decode
        assert torch.equal(ours_latents, stock_latents)
    two_experts = WanPipeline(**{k: getattr(pipe, k) for k in ("tokenizer", "text_encoder", "vae", "scheduler")},
                              transformer=pipe.transformer, transformer_2=pipe.transformer, boundary_ratio=0.875,
                              expand_timesteps=True)  # fmt: skip
    with pytest.raises(InputError, match="two experts with per-token timesteps"):
        WanModel(two_experts, 64, FRAMES)


def test_wan22_a14b_routes_each_step_to_the_pipelines_expert_and_samples_what_it_samples(tmp_path):
    """Wan2.2-T2V-A14B (a tiny one): 6 steps at shift 3 put sigma 1, 0.94 on the high-noise expert and 0.86 ... on
    transformer_2 (boundary 0.875); our sampler's latents equal WanPipeline's exactly across the switch, with CFG 5
    and without; a batch that mixes the two sides equals each row through its own expert; both experts get LoRA and
    gradients; final/'s two adapters load into the pipeline's two experts."""
    build_wan22_a14b(tmp_path / "a14b")
    model = load_model(str(tmp_path / "a14b"), resolution=RES, num_frames=FRAMES)
    experts = model.transformer
    assert isinstance(experts, WanExperts) and experts.boundary == 875.0 and not model.per_token
    pipe = WanPipeline.from_pretrained(tmp_path / "a14b")
    pipe.set_progress_bar_config(disable=True)
    prompts, noise = ["a cat walks", "a red car drives"], torch.randn(2, *model.latent_shape())
    cond = model.encode_prompts(prompts)
    kw = dict(height=RES, width=RES, num_frames=FRAMES, num_inference_steps=6, output_type="latent")
    for scale in (1.0, 5.0):
        stock = pipe(prompts, latents=noise.clone(), guidance_scale=scale, **kw).frames
        sigmas = pipe.scheduler.sigmas
        assert (sigmas[:-1] >= 0.875).tolist() == [True, True, False, False, False, False]
        model.decode = lambda x: x
        ours = sample_ode(model, model.transformer, cond, noise, sigmas, scale)
        high_only = sample_ode(model, experts.high, cond, noise, sigmas, scale)  # without the switch
        del model.decode
        torch.testing.assert_close(ours, stock, atol=1e-5, rtol=0)
        assert (high_only - stock).abs().max() > 0.1
    # one batch across the switch = each row alone through the expert the pipeline would use
    sigma = torch.tensor([0.95, 0.5])
    both = model.velocity(experts, noise, sigma, cond)
    alone = [model.velocity(e, noise[i : i + 1], sigma[i : i + 1], {k: v[i : i + 1] for k, v in cond.items()})
             for i, e in enumerate((experts.high, experts.low))]  # fmt: skip
    torch.testing.assert_close(both, torch.cat(alone), atol=1e-6, rtol=0)
    # LoRA on both experts; a loss on one side's row still gives the idle expert a (zero) gradient, for DDP
    add_lora(experts, 4, 8)
    assert {n.split(".")[0] for n, p in experts.named_parameters() if p.requires_grad} == {"high", "low"}
    model.velocity(experts, noise[:1], sigma[:1], {k: v[:1] for k, v in cond.items()}).sum().backward()
    grads = {n.split(".")[0]: p.grad for n, p in experts.named_parameters() if "lora_B" in n}
    assert grads["high"].abs().sum() > 0 and grads["low"] is not None and grads["low"].abs().sum() == 0


def test_wan_decode_is_differentiable_and_the_vae_stays_fp32(wan_dir):
    model = load_model(str(wan_dir), dtype=torch.bfloat16, resolution=RES, num_frames=FRAMES)
    assert model.vae.dtype == torch.float32 and model.transformer.dtype == torch.bfloat16
    x = torch.randn(1, *model.latent_shape(), requires_grad=True)
    video = model.decode(x)
    assert video.shape == (1, FRAMES, 3, RES, RES) and video.dtype == torch.float32
    video.mean().backward()
    assert x.grad.abs().sum() > 0


def test_wan_flags_fail_at_start_up(wan_dir):
    def args(*flags, model=str(wan_dir)):
        p = str(wan_dir / "prompts.txt")
        return ["--model-id", model, "--prompts", p, "--eval-prompts", p, "--reward", "jpeg", *flags]

    cases = {
        "--num-frames 6: must be 4k + 1": args("--num-frames", "6"),
        "--num-frames only applies with a video model": args("--num-frames", "5", model="shapesbench"),
        "--reward-frames only applies with a video model": args("--reward-frames", "2", model="shapesbench"),
        "--reward jpeg,temporal: temporal compares neighbouring frames": args(
            "--num-frames", "1", "--reward", "jpeg,temporal"
        ),
    }
    for message, argv in cases.items():
        with pytest.raises(InputError) as e:
            check_run_args(tyro.cli(D.Args, args=argv))
        assert str(e.value).startswith(message), str(e.value)
    with pytest.raises(InputError, match="'temporal' scores videos"):
        check_run_args(tyro.cli(D.Args, args=["--reward", "temporal"]))
    with pytest.raises(InputError, match="is a video model .* trains image models only"):
        rlr.resolve_and_check(tyro.cli(rlr.Args, args=args("--reward", "temporal", "--subchain-len", "2")))
    with pytest.raises(InputError, match="--num-frames 7: must be 4k"):
        load_model(str(wan_dir), resolution=RES, num_frames=7)


# ---------------------------------------------------------------- rewards of videos
def test_image_rewards_score_a_fixed_subset_of_frames():
    assert (
        frame_subset(81, 4) == [0, 27, 53, 80] and frame_subset(5, 8) == [0, 1, 2, 3, 4] and frame_subset(9, 1) == [4]
    )
    mean_red = ScoreFn(lambda im, p: im[:, 0].mean((1, 2)), differentiable=True)
    videos = torch.rand(3, 9, 3, 8, 8, requires_grad=True)
    total, parts = CompositeReward([("red", 2.0, mean_red)], frames=3)(videos, ["a", "b", "c"])
    expected = videos[:, [0, 4, 8], 0].mean((1, 2, 3))  # frames 0, 4, 8
    torch.testing.assert_close(parts["red"], expected.detach())
    torch.testing.assert_close(total, 2 * expected)
    total.sum().backward()
    assert videos.grad[:, [1, 2, 3, 5, 6, 7]].abs().sum() == 0 and videos.grad[:, [0, 4, 8]].abs().sum() > 0


def test_temporal_reward_prefers_smooth_motion_to_stills_and_flicker():
    temporal = build_reward(parse_rewards("temporal"), "cpu")
    frames, size = 9, 16
    still = torch.rand(1, 1, 3, size, size).expand(1, frames, 3, size, size)
    ramp = torch.linspace(0, 1, size).view(1, 1, 1, 1, size)
    moving = (ramp + 0.05 * torch.arange(frames).view(1, frames, 1, 1, 1)).clamp(0, 1).expand(1, frames, 3, size, size)
    a, b = torch.rand(2, 1, 1, 3, size, size)
    flicker = torch.cat([a if f % 2 == 0 else b for f in range(frames)], 1)
    noise = torch.rand(1, frames, 3, size, size)
    score = {name: temporal(v, [""])[1]["temporal"].item() for name, v in
             {"still": still, "moving": moving, "flicker": flicker, "noise": noise}.items()}  # fmt: skip
    assert score["still"] == 0
    assert score["moving"] > 0.02 and score["flicker"] < -0.1 and score["noise"] < -0.1
    # flicker between A and B: first differences |A - B|, second differences 2 |A - B|
    torch.testing.assert_close(score["flicker"], -(a - b).abs().mean().item(), atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- the scripts end to end
TINY = {  # one prompt group (tree) per iteration
    "dancegrpo.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4",
                     "--samples-per-update", "4", "--num-steps", "4"],
    "branchgrpo.py": ["--pruning", "depth", "--trees-per-device", "1", "--trees-per-update", "1", "--num-steps", "6",
                      "--num-splits", "2", "--rollout-batch-size", "4"],
    "vgrpo.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4", "--train-batch-size",
                 "4", "--samples-per-update", "4", "--num-steps", "4", "--n-mc", "3"],
    "dgpo.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4", "--train-batch-size",
                "4", "--samples-per-update", "4", "--num-steps", "4", "--train-timesteps", "2", "--trunc-steps", "2"],
}  # fmt: skip


def tree_counts(records):
    return [{k: v for k, v in r.items() if k.startswith("tree/")} for r in records if "rewards/mean" in r]


@pytest.mark.parametrize("script", TINY)
def test_script_trains_video_resumes_bit_equal_and_writes_videos(script, wan_dir, tmp_path):
    prompts = str(wan_dir / "prompts.txt")
    flags = [*TINY[script], "--model-id", str(wan_dir), "--resolution", str(RES), "--num-frames", str(FRAMES),
             "--prompts", prompts, "--eval-prompts", prompts, "--reward", "jpeg,temporal:0.5", "--guidance-scale", "5",
             "--eval-every", "2", "--eval-samples-per-prompt", "1", "--eval-steps", "4", "--sample-every", "2",
             "--lora-rank", "4"]  # fmt: skip
    run_in_process(script, [*flags, "--iterations", "2", "--exp-name", "whole"], tmp_path)
    for extra in (["--iterations", "1"], ["--iterations", "2", "--resume-from", "latest"]):
        run_in_process(script, [*flags, *extra, "--exp-name", "resumed"], tmp_path)
    assert_same_trained_weights(find_run(tmp_path / "whole"), find_run(tmp_path / "resumed"))

    records = metrics(tmp_path / "whole")
    train = [r for r in records if "rewards/mean" in r]
    assert len(train) == 2 and all("rewards/jpeg" in r and "rewards/temporal" in r for r in train)
    # ratio 1 at the first update: exactly, but for BranchGRPO's packed micro-batches that span two steps with pruning
    # (floating-point batch effects, docs/branchgrpo.md)
    first = "losses/first_ratio_max_dev"
    assert all(r[first] < 1e-6 if script == "branchgrpo.py" else r[first] == 0 for r in train)
    evals = [r for r in records if "eval/reward" in r]
    assert [r["iteration"] for r in evals] == [0, 2] and all("eval/reward_temporal" in r for r in evals)
    run = find_run(tmp_path / "whole")
    gifs = sorted((run / "samples").glob("samples_*.gif"))
    assert [g.name for g in gifs] == ["samples_000000.gif", "samples_000002.gif"]
    with Image.open(gifs[-1]) as gif:
        assert gif.n_frames == FRAMES
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run), size_guidance={"images": 0})
    events.Reload()  # TensorBoard shows the GIF animated, as the videos its add_video writes
    assert [e.encoded_image_string[:6] for e in events.Images("samples")] == [b"GIF89a"] * 2
    assert (run / "final" / "pytorch_lora_weights.safetensors").is_file()
    if script == "branchgrpo.py":  # the same tree as an image run's: 6 steps, splits [0, 3], K 2 -> 4 leaves
        build_shapes(tmp_path / "shapes")
        image_flags = [*TINY[script], "--model-id", str(tmp_path / "shapes"), "--iterations", "2", "--eval-every", "0",
                       "--sample-every", "0", "--exp-name", "image"]  # fmt: skip
        run_in_process(script, image_flags, tmp_path)
        video_tree, image_tree = tree_counts(records), tree_counts(metrics(tmp_path / "image"))
        assert (
            video_tree == image_tree and video_tree[0]["tree/rollout_forwards_per_leaf"] == (1 + 2 + 2 + 2 + 4 + 4) / 4
        )


@pytest.mark.parametrize("script", TINY)
def test_script_trains_wan22_5b_and_the_pipeline_loads_its_lora(script, tmp_path):
    """2 iterations on a tiny Wan2.2-TI2V-5B (per-token timesteps, 48-channel 16x VAE) with CFG 5 and the video
    rewards; WanPipeline.load_lora_weights reads final/ and it changes the pipeline's latents."""
    build_wan22_5b(tmp_path / "wan22")
    (tmp_path / "prompts.txt").write_text("a cat walks\na red car drives\n")
    prompts = str(tmp_path / "prompts.txt")
    flags = [*TINY[script], "--model-id", str(tmp_path / "wan22"), "--resolution", "64", "--num-frames", str(FRAMES),
             "--prompts", prompts, "--eval-prompts", prompts, "--reward", "jpeg,temporal:0.5", "--guidance-scale", "5",
             "--iterations", "2", "--eval-every", "0", "--sample-every", "0", "--lora-rank", "4", "--learning-rate",
             "1e-2", "--exp-name", "wan22"]  # fmt: skip
    run_in_process(script, flags, tmp_path)
    run = find_run(tmp_path / "wan22")
    assert len([r for r in metrics(run) if "rewards/temporal" in r]) == 2
    pipe = WanPipeline.from_pretrained(tmp_path / "wan22")
    pipe.set_progress_bar_config(disable=True)
    kw = dict(height=64, width=64, num_frames=FRAMES, num_inference_steps=2, guidance_scale=1.0, output_type="latent")
    before = pipe(["a cat walks"], generator=torch.Generator().manual_seed(0), **kw).frames
    pipe.load_lora_weights(str(run / "final"))
    after = pipe(["a cat walks"], generator=torch.Generator().manual_seed(0), **kw).frames
    assert not torch.allclose(before, after, atol=1e-6)


@pytest.mark.parametrize("script", TINY)
def test_script_trains_both_a14b_experts_and_the_pipeline_loads_them(script, tmp_path):
    """2 iterations on a tiny Wan2.2-T2V-A14B with CFG 5 (6 steps: 2 on the high-noise expert, 4 on transformer_2);
    final/ holds one adapter per expert, both trained, and WanPipeline loads them into its two experts."""
    from safetensors.torch import load_file

    from common.models.wan import LOW_NOISE_LORA

    build_wan22_a14b(tmp_path / "a14b")
    (tmp_path / "prompts.txt").write_text("a cat walks\na red car drives\n")
    prompts = str(tmp_path / "prompts.txt")
    steps = ["--num-steps", "6"] if script != "branchgrpo.py" else []  # BranchGRPO's tiny tree has 6 already
    flags = [*TINY[script], *steps, "--model-id", str(tmp_path / "a14b"), "--resolution", str(RES), "--num-frames",
             str(FRAMES), "--shift", "3", "--prompts", prompts, "--eval-prompts", prompts, "--reward", "jpeg",
             "--guidance-scale", "5", "--iterations", "2", "--eval-every", "0", "--sample-every", "0", "--lora-rank",
             "4", "--learning-rate", "1e-2", "--exp-name", "a14b"]  # fmt: skip
    run_in_process(script, flags, tmp_path)
    final = find_run(tmp_path / "a14b") / "final"
    for name in ("pytorch_lora_weights.safetensors", LOW_NOISE_LORA):
        lora_b = [v for k, v in load_file(final / name).items() if "lora_B" in k]
        assert lora_b and any(v.abs().sum() > 0 for v in lora_b), name  # each expert trained (B starts at 0)
    pipe = WanPipeline.from_pretrained(tmp_path / "a14b")
    pipe.set_progress_bar_config(disable=True)
    kw = dict(height=RES, width=RES, num_frames=FRAMES, num_inference_steps=6, guidance_scale=1.0, output_type="latent")
    before = pipe(["a cat walks"], generator=torch.Generator().manual_seed(0), **kw).frames
    pipe.load_lora_weights(str(final))
    pipe.load_lora_weights(str(final), weight_name=LOW_NOISE_LORA, load_into_transformer_2=True)
    after = pipe(["a cat walks"], generator=torch.Generator().manual_seed(0), **kw).frames
    assert not torch.allclose(before, after, atol=1e-6)


def test_experts_flag_trains_one_a14b_expert_and_fails_at_start_up_elsewhere(tmp_path, wan_dir):
    """--experts high: the low-noise expert's adapter stays at its initial B = 0 (its 4 of the 6 steps carry no
    gradient), the high-noise one trains; on a one-expert model the flag is refused before anything loads."""
    from safetensors.torch import load_file

    from common.models.wan import LOW_NOISE_LORA

    build_wan22_a14b(tmp_path / "a14b")
    prompts = str(wan_dir / "prompts.txt")
    flags = [*TINY["dancegrpo.py"], "--num-steps", "6", "--resolution", str(RES), "--num-frames", str(FRAMES),
             "--shift", "3", "--prompts", prompts, "--eval-prompts", prompts, "--reward", "jpeg", "--iterations", "1",
             "--eval-every", "0", "--sample-every", "0", "--lora-rank", "4", "--learning-rate", "1e-2",
             "--experts", "high"]  # fmt: skip
    run_in_process("dancegrpo.py", [*flags, "--model-id", str(tmp_path / "a14b"), "--exp-name", "high"], tmp_path)
    final = find_run(tmp_path / "high") / "final"
    b = {n: [v for k, v in load_file(final / n).items() if "lora_B" in k]
         for n in ("pytorch_lora_weights.safetensors", LOW_NOISE_LORA)}  # fmt: skip
    assert any(v.abs().sum() > 0 for v in b["pytorch_lora_weights.safetensors"])
    assert b[LOW_NOISE_LORA] and all(v.abs().sum() == 0 for v in b[LOW_NOISE_LORA])
    args = tyro.cli(D.Args, args=[*flags, "--model-id", str(wan_dir)])
    with pytest.raises(InputError, match="--experts.*two-expert Wan2.2-T2V-A14B"):
        check_run_args(args)


def test_two_processes_train_both_a14b_experts_as_one_does(tmp_path):
    """DDP with two experts: each of DanceGRPO's micro-batches is one timestep, so one expert idles in each backward;
    its zero term keeps every process reducing the same parameters. 2 processes x 2 videos give 1 process x 4's
    adapters (to the all-reduce's float rounding) and identical weights on both processes."""
    from safetensors.torch import load_file

    from common.models.wan import LOW_NOISE_LORA
    from tests.helpers import run_script

    build_wan22_a14b(tmp_path / "a14b")
    (tmp_path / "prompts.txt").write_text("a cat walks\na red car drives\n")
    prompts = str(tmp_path / "prompts.txt")
    flags = ["--group-size", "4", "--rollout-batch-size", "2", "--num-steps", "6", "--model-id", str(tmp_path / "a14b"),
             "--resolution", str(RES), "--num-frames", str(FRAMES), "--shift", "3", "--prompts", prompts,
             "--eval-prompts", prompts, "--reward", "jpeg", "--guidance-scale", "5", "--iterations", "2",
             "--eval-every", "0", "--sample-every", "0", "--lora-rank", "4", "--learning-rate", "1e-2"]  # fmt: skip
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2")
    two = ["--samples-per-device", "2", "--samples-per-update", "2", "--exp-name", "two"]
    run_script("dancegrpo.py", [*flags, *two], tmp_path, launcher, {"ACCELERATE_USE_CPU": "1"})
    run_in_process("dancegrpo.py", [*flags, "--samples-per-device", "4", "--samples-per-update", "4",
                                    "--exp-name", "one"], tmp_path)  # fmt: skip
    last = [r for r in metrics(tmp_path / "two") if "charts/rank_weight_spread" in r][-1]
    assert last["iteration"] == 2 and last["charts/rank_weight_spread"] == 0
    for name in ("pytorch_lora_weights.safetensors", LOW_NOISE_LORA):
        a, b = (load_file(find_run(tmp_path / r) / "final" / name) for r in ("two", "one"))
        assert a.keys() == b.keys() and any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
