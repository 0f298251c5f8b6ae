"""LTX-2.3 (video only) and HunyuanVideo-1.5 text-to-video on tiny random-weight pipelines built from configs
(tests/tiny.py): our Euler sampler on the kind's velocity equals the stock diffusers pipeline with the same noise
(CFG on and off, a non-square size; HunyuanVideo-1.5 at CFG 0.5 too), in bf16 the transformer gets the pipeline's
timestep bit for bit, `--shift pipeline` is the pipeline's own sigma grid, the LoRA targets exist,
dancegrpo.py, branchgrpo.py and vgrpo.py train one iteration and final/ loads back into the pipeline; the real
transformers' parameter counts, built from their published configs on the meta device, against the published
sizes."""

import pytest
import torch

from common.models import load_model, trainable_denoiser
from common.sampling import sample_ode
from tests.helpers import LORA_WEIGHTS, find_run, metrics, run_in_process
from tests.tiny import build_hunyuan15, build_ltx2

PROMPTS = ["a cat walks", "a red car drives"]
FRAMES = 9  # LTX: (9 - 1) / 4 + 1 = 3 latent frames with the tiny VAE's 4x in time


@pytest.fixture(scope="module")
def ltx2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ltx2")
    build_ltx2(path)
    (path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return path


def no_decode(model):
    """The model with decode() returning the latents themselves (the sampler's last state)."""
    model.decode = lambda x: x
    return model


# ---------------------------------------------------------------- LTX-2.3
LTX_PLAIN_CFG = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0,
                     guidance_rescale=0.0, audio_guidance_rescale=0.0)  # fmt: skip


def test_ltx2_samples_what_the_stock_pipeline_samples(ltx2_dir):
    """At 32 x 64 px and 9 frames (384 video tokens, 9 audio tokens of 16 channels): the pipeline's sigma grid (dynamic
    mu from the video tokens) is --shift pipeline's; our Euler latents, video and audio tokens together, equal
    LTX2Pipeline's (packed video and audio noise handed in) within 1e-5 (measured 1e-6 without CFG, 2e-6 with CFG 4, on
    latents of size ~6), its decoded frames within 1e-5 (measured 3e-6)."""
    from diffusers import LTX2Pipeline

    from common.models.ltx2 import LTX2Model

    model = LTX2Model(LTX2Pipeline.from_pretrained(ltx2_dir), (32, 64), FRAMES)
    assert model.kind == "ltx2" and model.video_grid() == (3, 8, 16) and model.latent_shape() == (384 + 9, 16)
    pipe = LTX2Pipeline.from_pretrained(ltx2_dir)
    pipe.set_progress_bar_config(disable=True)
    noise, n = torch.randn(2, *model.latent_shape()), model.video_tokens()
    cond = model.encode_prompts(PROMPTS)
    for scale in (1.0, 4.0):
        kw = dict(height=32, width=64, num_frames=FRAMES, num_inference_steps=3, guidance_scale=scale,
                  audio_guidance_scale=scale, latents=noise[:, :n].clone(), audio_latents=noise[:, n:].clone(),
                  **LTX_PLAIN_CFG)  # fmt: skip
        stock = pipe(PROMPTS, output_type="latent", **kw).frames  # un-normalised (B, C, F', h, w)
        sigmas = pipe.scheduler.sigmas
        torch.testing.assert_close(model.sigmas(3), sigmas, atol=1e-6, rtol=0)
        ours = sample_ode(no_decode(model), model.transformer, cond, noise, sigmas, scale)
        del model.decode
        ours = pipe._denormalize_latents(pipe._unpack_latents(ours[:, :n], 3, 8, 16), pipe.vae.latents_mean,
                                         pipe.vae.latents_std, pipe.vae.config.scaling_factor)  # fmt: skip
        torch.testing.assert_close(ours, stock, atol=1e-5, rtol=0)
        frames = pipe(PROMPTS, output_type="pt", **kw).frames
        ours = sample_ode(model, model.transformer, cond, noise, sigmas, scale)
        assert ours.shape == frames.shape == (2, FRAMES, 3, 32, 64)
        torch.testing.assert_close(ours, frames, atol=1e-5, rtol=0)
    assert model.pipe.audio_vae is None and model.pipe.vocoder is None  # video only: nothing decodes audio


def test_ltx2_loads_by_its_folder_and_checks_sizes(ltx2_dir):
    from common import InputError

    model = load_model(str(ltx2_dir), resolution=64, num_frames=FRAMES)
    assert model.kind == "ltx2" and model.latent_shape() == (3 * 16 * 16 + 9, 16)
    native = load_model(str(ltx2_dir))  # 512 x 768, 121 frames: (121 - 1) / 4 + 1 = 31 latent frames here
    assert (native.height, native.width, native.num_frames) == (512, 768, 121)
    with pytest.raises(InputError, match="--num-frames 7: must be 4k"):
        load_model(str(ltx2_dir), resolution=64, num_frames=7)
    with pytest.raises(InputError, match="--resolution 48 must be a multiple of 32"):
        load_model(str(ltx2_dir), resolution=48, num_frames=FRAMES)


def test_ltx2_lora_lands_on_every_attention_of_both_streams(ltx2_dir):
    """LORA_TARGETS reach q, k, v and out of the 6 attentions of each block: video self, video-text, audio self,
    audio-text, audio-to-video and video-to-audio."""
    from types import SimpleNamespace

    model = load_model(str(ltx2_dir), resolution=32, num_frames=FRAMES)
    flags = SimpleNamespace(lora=True, lora_rank=4, lora_alpha=4.0, gradient_checkpointing=False)
    module = trainable_denoiser(model, flags)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in module.named_parameters() if ".lora_A" in n}
    attentions = {n.rsplit(".", 2)[0] if n.endswith(".to_out.0") else n.rsplit(".", 1)[0] for n in adapted}
    assert len(adapted) == 4 * 6 * module.config.num_layers and len(attentions) == 6


TINY = {  # one prompt group (tree) per iteration
    "dancegrpo.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4",
                     "--samples-per-update", "4", "--num-steps", "3", "--sde-type", "cps"],
    "branchgrpo.py": ["--pruning", "depth", "--trees-per-device", "1", "--trees-per-update", "1", "--num-steps", "4",
                      "--num-splits", "1", "--rollout-batch-size", "4"],
    "vgrpo.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4", "--train-batch-size",
                 "4", "--samples-per-update", "4", "--num-steps", "3", "--n-mc", "2"],
}  # fmt: skip


@pytest.mark.parametrize("script", TINY)
def test_script_trains_ltx2_and_the_pipeline_loads_its_lora(script, ltx2_dir, tmp_path):
    """One iteration with CFG 4 and the video rewards at --shift pipeline; LTX2Pipeline.load_lora_weights reads
    final/ and it changes the pipeline's latents."""
    from diffusers import LTX2Pipeline

    prompts = str(ltx2_dir / "prompts.txt")
    flags = [*TINY[script], "--model-id", str(ltx2_dir), "--resolution", "32", "--num-frames", str(FRAMES),
             "--shift", "pipeline", "--prompts", prompts, "--eval-prompts", prompts, "--reward", "jpeg,temporal:0.5",
             "--guidance-scale", "4", "--iterations", "1", "--eval-every", "0", "--sample-every", "0", "--lora-rank",
             "4", "--learning-rate", "1e-2", "--exp-name", "ltx2"]  # fmt: skip
    run_in_process(script, flags, tmp_path)
    run = find_run(tmp_path / "ltx2")
    assert len([r for r in metrics(run) if "rewards/temporal" in r]) == 1
    pipe = LTX2Pipeline.from_pretrained(ltx2_dir)
    pipe.set_progress_bar_config(disable=True)
    kw = dict(height=32, width=32, num_frames=FRAMES, num_inference_steps=2, guidance_scale=1.0, output_type="latent",
              **LTX_PLAIN_CFG)  # fmt: skip
    before = pipe(PROMPTS[:1], generator=torch.Generator().manual_seed(0), **kw).frames
    pipe.load_lora_weights(str(run / "final"))
    after = pipe(PROMPTS[:1], generator=torch.Generator().manual_seed(0), **kw).frames
    assert not torch.allclose(before, after, atol=1e-6)


# ---------------------------------------------------------------- the published sizes
def count_on_meta(cls, config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in cls(**config).parameters())


def test_ltx23_has_its_published_size():
    """LTX-2.3 is published as a 22B audio-video model: its transformer and text connectors built from the
    conversion configs benchmarks/gpu/memory.py keeps (LTX23, LTX23_TEXT_CONNECTORS: those of diffusers' LTX-2.3
    conversion) on the meta device hold 18.99B + 3.17B = 22.16B, within 1% of 22B, and the memory plan's constants
    are these counts; Gemma 3 12B's config holds the published 12.19B."""
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from benchmarks.gpu import memory

    transformer = count_on_meta(LTX2VideoTransformer3DModel, memory.LTX23)
    connectors = count_on_meta(LTX2TextConnectors, memory.LTX23_TEXT_CONNECTORS)
    # its text encoder as benchmarks/gpu/gpu_build.py builds it: Gemma 3 12B, 12.19B with its SigLIP tower
    gemma = count_on_meta(lambda **c: Gemma3ForConditionalGeneration(Gemma3Config(**c)), memory.GEMMA3_12B)
    assert abs(gemma / 12.19e9 - 1) < 1e-3, gemma
    assert abs((transformer + connectors) / 22e9 - 1) < 0.01, (transformer, connectors)
    assert (
        abs(transformer / memory.LTX23_TRANSFORMER - 1) < 1e-3 and abs(connectors / memory.LTX23_CONNECTORS - 1) < 1e-3
    )


def test_ltx2_recipe_follows_the_published_cps_setting_and_its_memory_plan_has_the_joint_state():
    """dancegrpo-ltx2-8gpu parses with dancegrpo.py's Args: CPS at eta 0.8, a 3-step SDE window that sweeps the first
    10 of 24 steps over 200 iterations, the pipeline's grid, LoRA, offload. Its memory plan's state is LTX-2.3's
    video tokens at 512 x 768 x 121 (16 x 16 x 24) and 126 audio tokens of 128 channels."""
    import shlex
    import subprocess

    import tyro

    import dancegrpo
    from benchmarks.gpu import memory
    from tests.helpers import ROOT

    out = subprocess.run(["bash", "run.sh", "--print", "dancegrpo-ltx2-8gpu"], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PROMPTS": "p.txt"})  # fmt: skip
    words = shlex.split(out.stdout)
    args = tyro.cli(dancegrpo.Args, args=words[words.index("dancegrpo.py") + 1 :])
    assert (args.sde_type, args.noise_level, args.sde_window, args.num_steps, args.shift) == (
        "cps",
        0.8,
        3,
        24,
        "pipeline",
    )
    windows = {dancegrpo.sde_steps(24, 3, args.window_shift_every, i)[0] for i in range(args.iterations)}
    assert windows == set(range(8)) and args.clip_range == 1e-4 and args.learning_rate == 3e-4
    assert args.lora and args.offload_frozen and args.num_frames == 81 and memory.model_kind(args.model_id) == "ltx2"
    shapes = memory.Shapes.of("ltx2", memory.MODELS["ltx2"], (512, 768), 121)
    assert shapes.latent == (16 * 16 * 24 + 126, 128) and shapes.vae_latent == (128, 16, 16, 24)


# ---------------------------------------------------------------- HunyuanVideo-1.5
@pytest.fixture(scope="module")
def hy_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hunyuan15")
    build_hunyuan15(path)
    (path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return path


def test_hunyuan15_samples_what_the_stock_pipeline_samples(hy_dir):
    """At 32 x 64 px and 9 frames (latents (8, 3, 8, 16)), one prompt with quoted text (the ByT5 glyph path): the sigma
    grid (static shift 5) is --shift pipeline's; our Euler latents equal HunyuanVideo15Pipeline's exactly without CFG
    and within 1e-5 with its guider at CFG 4 (measured 1.7e-6: two forwards there, one batch here) and at CFG 0.5,
    where its guider guides as well (measured 4e-7; 1.1e-2 when a scale below 1 meant no CFG here); its decoded frames
    (one video: the stock VAE's attention fails on a batch of two) exactly and within 1e-5 (measured 1e-6)."""
    from diffusers import HunyuanVideo15Pipeline
    from diffusers.guiders import ClassifierFreeGuidance

    from common.models.hunyuan15 import HunyuanVideo15LoraPipeline, HunyuanVideo15Model

    model = HunyuanVideo15Model(HunyuanVideo15LoraPipeline.from_pretrained(hy_dir), (32, 64), FRAMES)
    assert model.kind == "hunyuan15" and model.latent_shape() == (8, 3, 8, 16)
    pipe = HunyuanVideo15Pipeline.from_pretrained(hy_dir)
    pipe.set_progress_bar_config(disable=True)
    prompts, noise = ["a cat walks", 'a sign that says "hi"'], torch.randn(2, *model.latent_shape())
    cond = model.encode_prompts(prompts)
    for scale in (1.0, 4.0, 0.5):
        pipe.guider = ClassifierFreeGuidance(guidance_scale=scale)
        kw = dict(height=32, width=64, num_frames=FRAMES, num_inference_steps=3)
        stock = pipe(prompts, latents=noise.clone(), output_type="latent", **kw).frames
        sigmas = pipe.scheduler.sigmas
        torch.testing.assert_close(model.sigmas(3), sigmas, atol=1e-6, rtol=0)
        ours = sample_ode(no_decode(model), model.transformer, cond, noise, sigmas, scale)
        del model.decode
        torch.testing.assert_close(ours, stock, atol=1e-5 if scale != 1 else 0, rtol=0)
        frames = pipe(prompts[:1], latents=noise[:1].clone(), output_type="pt", **kw).frames
        ours = sample_ode(model, model.transformer, model.encode_prompts(prompts[:1]), noise[:1], sigmas, scale)
        assert ours.shape == frames.shape == (1, FRAMES, 3, 32, 64)
        torch.testing.assert_close(ours, frames, atol=1e-5, rtol=0)


def forwards(module) -> list:
    """Every forward of `module` from now on, as (args, kwargs, output)."""
    calls = []
    module.register_forward_hook(lambda m, args, kwargs, out: calls.append((args, kwargs, out)), with_kwargs=True)
    return calls


@pytest.mark.parametrize("kind", ["ltx2", "hunyuan15"])
def test_the_transformer_gets_the_pipelines_timestep_bit_for_bit_in_bf16(kind, ltx2_dir, hy_dir):
    """In bf16, at every step of the pipeline's grid (32 x 32 px, 9 frames, 3 steps, no CFG), on the pipeline's own
    latents, our velocity passes the transformer the pipeline's timestep, bit for bit and in its dtype: LTX2Pipeline's
    float32 t = 1000 sigma uncast (as `timestep` and `sigma`; a bf16 cast here rounded 635.5 to 636 and put the
    velocity 4.7e-2 off), HunyuanVideo15Pipeline's t cast to the latents' bf16."""
    from diffusers import HunyuanVideo15Pipeline, LTX2Pipeline

    bf16 = torch.bfloat16
    folder, pipe_cls = (ltx2_dir, LTX2Pipeline) if kind == "ltx2" else (hy_dir, HunyuanVideo15Pipeline)
    model = load_model(str(folder), dtype=bf16, resolution=32, num_frames=FRAMES)
    pipe = pipe_cls.from_pretrained(folder, dtype=bf16)
    pipe.set_progress_bar_config(disable=True)
    theirs, ours = forwards(pipe.transformer), forwards(model.transformer)
    kw = dict(height=32, width=32, num_frames=FRAMES, num_inference_steps=3, output_type="latent")
    if kind == "ltx2":
        kw |= dict(guidance_scale=1.0, audio_guidance_scale=1.0, **LTX_PLAIN_CFG)
    else:
        from diffusers.guiders import ClassifierFreeGuidance

        pipe.guider = ClassifierFreeGuidance(guidance_scale=1.0)
    pipe(list(PROMPTS), generator=torch.Generator().manual_seed(0), **kw)
    sigmas = pipe.scheduler.sigmas[:-1]
    assert len(theirs) == len(sigmas) == 3
    cond, channels = model.encode_prompts(list(PROMPTS)), model.latent_shape()[0]
    with torch.no_grad():
        for sigma, (_, k, _) in zip(sigmas, theirs):  # ltx2: the video and audio tokens; hunyuan15: the latents
            if kind == "ltx2":
                x = torch.cat([k["hidden_states"], k["audio_hidden_states"]], 1)
            else:
                x = k["hidden_states"][:, :channels]  # then the condition latents and mask, zero
            model.velocity(model.transformer, x, sigma.expand(len(x)), cond)
    dtype = torch.float32 if kind == "ltx2" else bf16
    for (_, k, _), (_, our_k, _) in zip(theirs, ours):
        assert our_k["timestep"].dtype == k["timestep"].dtype == dtype
        assert torch.equal(our_k["timestep"], k["timestep"]), (our_k["timestep"], k["timestep"])
        if kind == "ltx2":
            assert torch.equal(our_k["sigma"], k["sigma"])
    # 1000 sigma is no bf16 number on this grid: a cast changes LTX-2's timestep, and is HunyuanVideo-1.5's own
    assert any((s * 1000).to(bf16).float() != s * 1000 for s in sigmas)


def test_hunyuan15_lora_lands_on_every_attention():
    """LORA_TARGETS reach the double-stream blocks' q, k, v, out and the text stream's add_* projections and
    to_add_out (8 per block), and the token refiner's attention (4 per refiner block)."""
    from types import SimpleNamespace

    from diffusers import HunyuanVideo15Transformer3DModel

    module = HunyuanVideo15Transformer3DModel(
        in_channels=17, out_channels=8, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_refiner_layers=1, text_embed_dim=32, text_embed_2_dim=16, image_embed_dim=16, rope_axes_dim=(4, 6, 6),
    )  # fmt: skip
    holder = SimpleNamespace(kind="hunyuan15", transformer=module)
    flags = SimpleNamespace(lora=True, lora_rank=4, lora_alpha=4.0, gradient_checkpointing=False)
    adapted = {
        n.rsplit(".lora_A", 1)[0] for n, _ in trainable_denoiser(holder, flags).named_parameters() if ".lora_A" in n
    }
    assert sum(n.startswith("transformer_blocks.") for n in adapted) == 8 * 2 and len(adapted) >= 8 * 2 + 4


@pytest.mark.parametrize("script", TINY)
def test_script_trains_hunyuan15_and_its_transformer_loads_the_lora(script, hy_dir, tmp_path):
    """One iteration at --shift pipeline with CFG 4 and the video rewards; final/ is read by the stock pipeline's
    transformer (`load_lora_adapter(final, prefix="transformer")`: HunyuanVideo15Pipeline has no load_lora_weights) and
    changes its latents."""
    from diffusers import HunyuanVideo15Pipeline

    prompts = str(hy_dir / "prompts.txt")
    flags = [*TINY[script], "--model-id", str(hy_dir), "--resolution", "32", "--num-frames", str(FRAMES), "--shift",
             "pipeline", "--prompts", prompts, "--eval-prompts", prompts, "--reward", "jpeg,temporal:0.5",
             "--guidance-scale", "4", "--iterations", "1", "--eval-every", "0", "--sample-every", "0", "--lora-rank",
             "4", "--learning-rate", "1e-2", "--exp-name", "hy"]  # fmt: skip
    run_in_process(script, flags, tmp_path)
    run = find_run(tmp_path / "hy")
    assert len([r for r in metrics(run) if "rewards/temporal" in r]) == 1
    pipe = HunyuanVideo15Pipeline.from_pretrained(hy_dir)
    pipe.set_progress_bar_config(disable=True)
    kw = dict(height=32, width=32, num_frames=FRAMES, num_inference_steps=2, output_type="latent")
    before = pipe(PROMPTS[:1], generator=torch.Generator().manual_seed(0), **kw).frames
    pipe.transformer.load_lora_adapter(str(run / "final"), prefix="transformer", weight_name=LORA_WEIGHTS)
    after = pipe(PROMPTS[:1], generator=torch.Generator().manual_seed(0), **kw).frames
    assert not torch.allclose(before, after, atol=1e-6)


def test_hunyuan15_transformer_has_its_published_size():
    """HunyuanVideo-1.5 is published as an 8.3B model: HunyuanVideo15Transformer3DModel's defaults (its 480p
    text-to-video config in diffusers) on the meta device hold 8.33B."""
    from diffusers import HunyuanVideo15Transformer3DModel

    n = count_on_meta(HunyuanVideo15Transformer3DModel, {})
    assert abs(n / 8.3e9 - 1) < 0.01, n
