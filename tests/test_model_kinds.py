"""The newer model kinds on tiny random-weight pipelines built from configs (tests/tiny.py): Qwen-Image
(common/models/qwenimage.py), FLUX.2 [klein] (common/models/flux2.py, base and guidance-distilled) and Z-Image
(common/models/zimage.py: time reversed, output negated, captions of their own lengths). Our velocity,
Euler sampler and decode give each pipeline's own images and latents with guidance on and off; Qwen-Image's padded,
masked CFG batch equals two separate forwards; the LoRA targets exist in each transformer; and every script trains on
each kind, its final/ read by the pipeline's load_lora_weights. In bf16 the transformer of each image kind (FLUX.1's
too) gets the pipeline's timestep bit for bit."""

import pytest
import torch
import tyro
from diffusers import Flux2KleinPipeline, Flux2Pipeline, FluxPipeline, QwenImagePipeline, ZImagePipeline

from common import InputError
from common.models import LORA_TARGETS, load_model
from common.sampling import sample_ode
from tests.helpers import find_run, metrics, run_in_process
from tests.tiny import RES, build_flux, build_flux2_dev, build_flux2_klein, build_qwen, build_zimage

# of different lengths: Qwen-Image's mask matters. A tuple: ZImagePipeline writes its chat template into the prompt list
# it is given, and each call below gets its own list
PROMPTS = ("a red circle", "a green square on a white background")
KINDS = {  # kind: builder, pipeline class, its guidance arguments at scale s, what its output_type="latent" holds
    "qwen": (build_qwen, QwenImagePipeline, lambda s: dict(true_cfg_scale=s, negative_prompt=" " if s > 1 else None),
             lambda model, x: x),  # packed tokens
    "flux2": (build_flux2_klein, Flux2KleinPipeline, lambda s: dict(guidance_scale=s),
              lambda model, x: model._vae_latents(x)),  # the VAE's latents: un-normalised, un-patchified
    "zimage": (build_zimage, ZImagePipeline, lambda s: dict(guidance_scale=s - 1),  # its w: c + w (c - u)
               lambda model, x: x),  # the VAE's latents
}  # fmt: skip


@pytest.fixture(scope="module")
def kind_dir(tmp_path_factory):
    """kind -> folder of its tiny pipeline (and a prompts file), each built once per module."""
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = tmp_path_factory.mktemp(kind)
            KINDS[kind][0](cache[kind])
            (cache[kind] / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def qwen_dir(kind_dir):
    return kind_dir("qwen")


@pytest.mark.parametrize("kind", KINDS)
def test_samples_what_the_stock_pipeline_samples(kind, kind_dir):
    """Euler along the pipeline scheduler's sigmas (its dynamic shift; Qwen-Image's ends at 0.02) on the model's
    velocity, then its decode, against the pipeline: the timestep (sigma), the packing, the position ids or RoPE grid,
    Qwen-Image's text mask, true CFG with " " and its per-token norm rescale, FLUX.2 [klein] base's CFG with "",
    Z-Image's 1 - sigma, negated output and list of captions, and each VAE's latent statistics (Qwen-Image: per
    channel; FLUX.2: its BatchNorm's running ones; Z-Image: scaling and shift)."""
    _, pipe_cls, guidance, as_stock_latents = KINDS[kind]
    model = load_model(str(kind_dir(kind)), resolution=RES)
    assert model.kind == kind
    assert model.latent_shape() == {"qwen": (4, 64), "flux2": (64, 16), "zimage": (4, 16, 16)}[kind]  # 8x / 2x VAEs
    pipe = pipe_cls.from_pretrained(kind_dir(kind))
    pipe.set_progress_bar_config(disable=True)
    noise = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(0))
    # the pipeline's own layout of the same noise: packed tokens (Qwen-Image), the patchified grid (FLUX.2)
    stock_noise = noise if kind != "flux2" else noise.transpose(1, 2).reshape(2, -1, *model.grid)
    prompts = list(PROMPTS)
    cond = model.encode_prompts(prompts)
    assert prompts == list(PROMPTS)  # the caller's list as it was (ZImagePipeline templates the list it is given)
    for scale in (1.0, 4.0):
        kw = dict(height=RES, width=RES, num_inference_steps=3, **guidance(scale))
        stock = pipe(prompt=list(PROMPTS), latents=stock_noise.clone(), output_type="pt", **kw).images
        sigmas = pipe.scheduler.sigmas  # set by the call: 3 shifted steps, then 0
        ours = sample_ode(model, model.transformer, cond, noise, sigmas, scale)
        assert ours.shape == stock.shape == (2, 3, RES, RES)
        torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)
        # and the latents themselves, tightly: a tiny random VAE barely moves its pixels when a latent moves
        latents = pipe(prompt=list(PROMPTS), latents=stock_noise.clone(), output_type="latent", **kw).images
        model.decode = lambda x: x
        ours_latents = as_stock_latents(model, sample_ode(model, model.transformer, cond, noise, sigmas, scale))
        del model.decode
        torch.testing.assert_close(ours_latents, latents, atol=1e-5, rtol=0)
    if kind == "qwen":  # Qwen-Image's dynamic schedule ends at 0.02; a prompt shorter than the batch's is padded
        assert sigmas[-2].item() == pytest.approx(0.02)
        assert cond["prompt_embeds_mask"].sum(1).tolist()[0] < cond["prompt_embeds"].shape[1]  # the short one padded


def test_flux2_dev_embeds_its_guidance_and_samples_what_the_stock_pipeline_samples(tmp_path):
    """FLUX.2 [dev] (Flux2Pipeline, a tiny Mistral3 behind a PixtralProcessor): the guidance scale is an input of the
    transformer, not CFG; our sampler's tokens equal the pipeline's latents exactly at guidance 1 and 4, and
    dancegrpo.py trains on it, its final/ read by Flux2Pipeline.load_lora_weights."""
    from diffusers import Flux2Pipeline

    from tests.tiny import build_flux2_dev

    build_flux2_dev(tmp_path / "dev")
    model = load_model(str(tmp_path / "dev"), resolution=RES)
    assert model.kind == "flux2" and model.transformer.config.guidance_embeds and model.pipeline is Flux2Pipeline
    pipe = Flux2Pipeline.from_pretrained(tmp_path / "dev")
    pipe.set_progress_bar_config(disable=True)
    noise = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(PROMPTS)
    assert not torch.equal(cond["prompt_embeds"][0], cond["prompt_embeds"][1])  # the prompts survive the template
    model.decode = lambda x: x
    for scale in (1.0, 4.0):
        stock = pipe(prompt=list(PROMPTS), height=RES, width=RES, num_inference_steps=3, guidance_scale=scale,
                     latents=noise.transpose(1, 2).reshape(2, -1, *model.grid), output_type="latent").images  # fmt: skip
        assert torch.equal(sample_ode(model, model.transformer, cond, noise, pipe.scheduler.sigmas, scale), stock)
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS) + "\n")
    flags = [*TINY["dancegrpo.py"], "--model-id", str(tmp_path / "dev"), "--resolution", str(RES), "--prompts",
             str(tmp_path / "p.txt"), "--eval-prompts", str(tmp_path / "p.txt"), "--reward", "jpeg", "--guidance-scale",
             "4", "--iterations", "2", "--eval-every", "0", "--sample-every", "0", "--lora-rank", "4",
             "--learning-rate", "1e-2", "--exp-name", "dev"]  # fmt: skip
    run_in_process("dancegrpo.py", flags, tmp_path)
    pipe.load_lora_weights(str(find_run(tmp_path / "dev") / "final"))
    assert pipe.transformer.peft_config


def forwards(module) -> list:
    """Every forward of `module` from now on, as (args, kwargs, output)."""
    calls = []
    module.register_forward_hook(lambda m, args, kwargs, out: calls.append((args, kwargs, out)), with_kwargs=True)
    return calls


# kind: builder, pipeline class, step count, the call's guidance (no CFG: one forward a step), our guidance scale, and
# the sigma of that step count's grid (found by a search over step counts) where rounding sigma itself (sigma.to(bf16);
# Z-Image: 1 - sigma in float32) is one step off the pipeline's timestep
TIMESTEP_CASES = {
    "qwen": (build_qwen, QwenImagePipeline, 3, dict(true_cfg_scale=1.0), 1.0, 0.5823),  # 0.58203125, not 0.5859375
    "flux2": (build_flux2_klein, Flux2KleinPipeline, 4, dict(guidance_scale=1.0), 1.0, 0.9547),  # 0.953125, 0.95703125
    "flux2-dev": (build_flux2_dev, Flux2Pipeline, 4, dict(guidance_scale=4.0), 4.0, 0.9547),  # the same
    "flux": (build_flux, FluxPipeline, 4, dict(guidance_scale=3.5), 3.5, 0.75),  # 0.75, not 0.75390625
    "zimage": (build_zimage, ZImagePipeline, 4, dict(guidance_scale=0.0), 1.0, 0.9),  # 0.10000002, not 0.1
}  # fmt: skip


@pytest.mark.parametrize("kind", TIMESTEP_CASES)
def test_the_transformer_gets_the_pipelines_timestep_bit_for_bit_in_bf16(kind, tmp_path):
    """FluxPipeline, QwenImagePipeline, Flux2Pipeline and Flux2KleinPipeline round the scheduler's float32 t = 1000 sigma
    to the latents' dtype and pass t / 1000; ZImagePipeline passes (1000 - t) / 1000 in float32. At every step of the
    pipeline's grid, on the pipeline's own latents, our velocity passes the same bits in the same dtype and the
    transformer returns the same bits; the grid holds a sigma where rounding sigma itself would be one step off
    (Qwen-Image's velocity was 5.7e-2 off there, FLUX.2's 6.1e-2, Z-Image's 1.2e-2)."""
    build, pipe_cls, steps, guidance, scale, off_sigma = TIMESTEP_CASES[kind]
    build(tmp_path)
    bf16 = torch.bfloat16
    model = load_model(str(tmp_path), dtype=bf16, resolution=RES)
    pipe = pipe_cls.from_pretrained(tmp_path, dtype=bf16)
    pipe.set_progress_bar_config(disable=True)
    theirs, ours = forwards(pipe.transformer), forwards(model.transformer)
    pipe(prompt=list(PROMPTS), height=RES, width=RES, num_inference_steps=steps, output_type="latent",
         generator=torch.Generator().manual_seed(0), **guidance)  # fmt: skip
    sigmas = pipe.scheduler.sigmas[:-1]
    assert len(theirs) == len(sigmas) == steps
    cond = model.encode_prompts(list(PROMPTS))
    with torch.no_grad():
        for sigma, (args, kwargs, _) in zip(sigmas, theirs):
            x = torch.stack(args[0]).squeeze(2) if kind == "zimage" else kwargs["hidden_states"]  # Z-Image: a list
            model.velocity(model.transformer, x, sigma.expand(len(x)), cond, scale)

    def timestep(args, kwargs):
        return args[1] if kind == "zimage" else kwargs["timestep"]  # ZImagePipeline passes it by position

    def output(out):
        return torch.stack(out[0]) if kind == "zimage" else out[0]

    for (args, kwargs, out), (our_args, our_kwargs, our_out) in zip(theirs, ours):
        t, our_t = timestep(args, kwargs), timestep(our_args, our_kwargs)
        assert our_t.dtype == t.dtype == (torch.float32 if kind == "zimage" else bf16)
        assert torch.equal(our_t, t), (our_t, t)
        assert torch.equal(output(our_out), output(out))
    i = min(range(steps), key=lambda i: abs(sigmas[i].item() - off_sigma))
    assert sigmas[i].item() == pytest.approx(off_sigma, abs=1e-4)
    rounded_alone = 1 - sigmas[i] if kind == "zimage" else sigmas[i].to(bf16)
    assert rounded_alone != timestep(*theirs[i][:2])[0]


def test_a_distilled_flux2_klein_samples_without_cfg_and_refuses_a_guidance_scale(tmp_path):
    """FLUX.2 [klein] 4B / 9B (is_distilled): no CFG in Flux2KleinPipeline; --guidance-scale other than 1 is an
    error naming the flag, not a silent CFG."""
    build_flux2_klein(tmp_path, distilled=True)
    model = load_model(str(tmp_path), resolution=RES)
    pipe = Flux2KleinPipeline.from_pretrained(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    noise = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(0))
    stock_noise = noise.transpose(1, 2).reshape(2, -1, *model.grid)
    stock = pipe(
        prompt=list(PROMPTS), height=RES, width=RES, num_inference_steps=2, latents=stock_noise, output_type="pt"
    )
    ours = sample_ode(model, model.transformer, model.encode_prompts(PROMPTS), noise, pipe.scheduler.sigmas, 1.0)
    torch.testing.assert_close(ours, stock.images, atol=1e-5, rtol=1e-5)
    with pytest.raises(InputError, match="--guidance-scale 1"):
        model.velocity(model.transformer, noise, torch.ones(2), model.encode_prompts(PROMPTS), 4.0)


def test_one_padded_masked_cfg_batch_equals_two_forwards_and_slices_agree(qwen_dir):
    """CFG's [uncond; cond] batch pads the shorter embeddings; with the mask it is the two-forward combination to float
    rounding. A slice of the batch's conditioning (padded to the batch's longest prompt) gives the velocity of the
    prompt encoded alone."""
    model = load_model(str(qwen_dir), resolution=RES)
    x = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.8, 0.4])
    cond, uncond = model.encode_prompts(PROMPTS), model.uncond()
    with torch.no_grad():
        v = model.velocity(model.transformer, x, sigma, cond, 4.0)
        c = model.velocity(model.transformer, x, sigma, cond)
        u = model.velocity(model.transformer, x, sigma, {k: t.expand(2, *t.shape[1:]) for k, t in uncond.items()})
        comb = u + 4.0 * (c - u)
        torch.testing.assert_close(v, comb * c.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))
        alone = model.velocity(model.transformer, x[:1], sigma[:1], model.encode_prompts(PROMPTS[:1]))
        torch.testing.assert_close(c[:1], alone, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_the_lora_adapter_lands_on_modules_that_exist(kind, kind_dir):
    """A target list that names no module trains nothing there, silently (two frameworks' lists do). Qwen-Image: every
    LORA_TARGETS name is a module, 8 Linears per double-stream block adapted. FLUX.2: the same 8 in each double block
    and the single blocks' two fused Linears (q, k, v + MLP in; attention + MLP out), which no LORA_TARGETS name
    reaches. Z-Image: q, k, v and out of every main and refiner block (single-stream: no add_* projections)."""
    from types import SimpleNamespace

    from common.models import trainable_denoiser

    model = load_model(str(kind_dir(kind)), resolution=RES)
    names = [n for n, _ in model.transformer.named_modules()]
    if kind == "qwen":
        for target in LORA_TARGETS:
            assert any(n == target or n.endswith("." + target) for n in names), target
    flags = SimpleNamespace(lora=True, lora_rank=4, lora_alpha=4.0, gradient_checkpointing=False)
    module = trainable_denoiser(model, flags)
    adapted = sorted({n.rsplit(".lora_A", 1)[0] for n, _ in module.named_parameters() if ".lora_A" in n})
    c = module.config
    expected = {
        "qwen": lambda: 8 * c.num_layers,
        "flux2": lambda: 8 * c.num_layers + 2 * c.num_single_layers,
        "zimage": lambda: 4 * (c.n_layers + 2 * c.n_refiner_layers),  # the noise and the context refiners
    }
    assert len(adapted) == expected[kind]()
    if kind == "flux2":
        assert adapted[:2] == [
            "single_transformer_blocks.0.attn.to_out",
            "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
        ]


TINY = {  # one prompt group per iteration, 3 or 4 steps
    "dancegrpo.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "2",
                     "--samples-per-update", "4", "--num-steps", "4"],
    "branchgrpo.py": ["--pruning", "depth", "--trees-per-device", "1", "--trees-per-update", "1", "--num-steps", "6",
                      "--num-splits", "2", "--rollout-batch-size", "4"],
    "vgrpo.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4", "--train-batch-size",
                 "2", "--samples-per-update", "4", "--num-steps", "4", "--n-mc", "2"],
    "diffusionnft.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4",
                        "--train-batch-size", "2", "--samples-per-update", "4", "--num-steps", "4",
                        "--timestep-fraction", "0.5"],
    "dgpo.py": ["--samples-per-device", "4", "--group-size", "4", "--rollout-batch-size", "4", "--train-batch-size", "4",
                "--samples-per-update", "4", "--num-steps", "4", "--train-timesteps", "2", "--trunc-steps", "2"],
}  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("script", TINY)
def test_script_trains_two_iterations_and_the_pipeline_loads_its_lora(script, kind, kind_dir, tmp_path):
    """2 iterations with CFG 4 (Qwen-Image's true CFG, FLUX.2 [klein] base's) and the JPEG reward, a held-out
    evaluation at 0 and 2; final/ is read by the pipeline's load_lora_weights and changes its latents."""
    folder, prompts = kind_dir(kind), str(kind_dir(kind) / "prompts.txt")
    flags = [*TINY[script], "--model-id", str(folder), "--resolution", str(RES), "--prompts", prompts,
             "--eval-prompts", prompts, "--reward", "jpeg", "--guidance-scale", "4", "--iterations", "2",
             "--eval-every", "2", "--eval-samples-per-prompt", "1", "--eval-steps", "3", "--sample-every", "0",
             "--lora-rank", "4", "--learning-rate", "1e-2", "--exp-name", kind]  # fmt: skip
    run_in_process(script, flags, tmp_path)
    run = find_run(tmp_path / kind)
    records = metrics(run)
    assert len([r for r in records if "rewards/jpeg" in r]) == 2
    assert [r["iteration"] for r in records if "eval/reward" in r] == [0, 2]
    pipe = KINDS[kind][1].from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    kw = dict(height=RES, width=RES, num_inference_steps=2, output_type="latent", **KINDS[kind][2](1.0))
    before = pipe(prompt=list(PROMPTS[:1]), generator=torch.Generator().manual_seed(0), **kw).images
    pipe.load_lora_weights(str(run / "final"))
    assert pipe.transformer.peft_config
    after = pipe(prompt=list(PROMPTS[:1]), generator=torch.Generator().manual_seed(0), **kw).images
    assert not torch.allclose(before, after, atol=1e-6)
    if script == "dancegrpo.py":  # and `python -m common.evaluate` scores the trained weights against the base
        import json

        from common import evaluate as E

        argv = ["--model-id", str(folder), "--resolution", str(RES), "--weights", str(run / "final"), "--prompts",
                prompts, "--reward", "jpeg", "--samples-per-prompt", "2", "--num-steps", "2", "--guidance-scale", "4",
                "--batch-size", "4", "--out", str(tmp_path / "eval")]  # fmt: skip
        E.main(tyro.cli(E.EvalArgs, args=argv))
        result = json.loads((tmp_path / "eval" / "results.json").read_text())
        trained = [m for m in result["figures"] if m != "base"]
        assert result["settings"]["n_prompts"] == 2 and len(trained) == 1
        assert result["figures"][trained[0]]["reward_jpeg"] != result["figures"]["base"]["reward_jpeg"]


@pytest.mark.parametrize("kind", KINDS)
def test_rlr_trains_through_the_decoder_and_a_differentiable_reward(kind, kind_dir, tmp_path, monkeypatch):
    """rlr.py's first-order term backpropagates through the kind's VAE decode (Qwen-Image's 3D VAE, FLUX.2's
    BatchNorm-normalised one) and the (tiny) HPSv2.1 reward, its zero-order term perturbs the adapter, with CFG 4;
    in-process (the tiny HPS config is registered here only)."""
    import rlr
    from tests.tiny import build_tiny_hps, use_tiny_hps

    ckpt = build_tiny_hps(tmp_path)
    use_tiny_hps(monkeypatch)
    folder, prompts = kind_dir(kind), str(kind_dir(kind) / "prompts.txt")
    argv = ["--output-dir", str(tmp_path), "--exp-name", kind, "--model-id", str(folder), "--resolution", str(RES),
            "--prompts", prompts, "--eval-prompts", prompts, "--reward", "hpsv2.1", "--reward-ckpt", f"hpsv2.1={ckpt}",
            "--guidance-scale", "4", "--iterations", "2", "--samples-per-device", "4", "--group-size", "2",
            "--rollout-batch-size", "2", "--num-steps", "4", "--eval-every", "0", "--sample-every", "0",
            "--terms", "fo+ho+zo", "--subchain-stage", "any", "--subchain-len", "1", "--lora-rank", "4"]  # fmt: skip
    rlr.main(tyro.cli(rlr.Args, args=argv))
    train = [r for r in metrics(find_run(tmp_path / kind)) if "grad/fo_norm" in r]
    assert len(train) == 2 and all(r["rlr/recompute_max_dev"] == 0 and r["grad/fo_norm"] > 0 for r in train)
    assert all(r["grad/zo_norm"] > 0 for r in train)
