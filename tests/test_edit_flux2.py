"""FLUX.2 with reference images (common/models/flux2.py; an EditPrompt, common/edits.py) on the tiny [klein] base and
[dev] pipelines (tests/tiny.py). Our Euler sampler on our velocity, and our decode, give Flux2KleinPipeline's (CFG
off and on) and Flux2Pipeline's (embedded guidance) latents and images for a batch of two instructions, each with
one reference or with two of different sizes, every source neither square nor at the resolution: the pipeline,
called once per prompt (it gives one set of references to a whole call), gets the centre-cropped squares. A wrong or
reordered reference changes the velocity, an (instruction, references) pair is its own condition, CFG keeps the
references in both halves, a plain prompt's velocity is the text-to-image forward bit for bit, rows with different
reference counts are refused, and above 1024 px a reference is shrunk to 1024 x 1024 as the pipelines shrink it.

The edits run at 64 px, not tests.tiny.RES: the pipelines refuse a reference under 64 px
(Flux2ImageProcessor.check_image_input), and a reference here is a square at the resolution."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from PIL import Image

from common import InputError
from common.edits import EditPrompt, centre_square
from common.models import load_model, trainable_denoiser
from common.sampling import sample_ode
from tests.tiny import RES, build_flux2_dev, build_flux2_klein

EDIT_RES = 64  # 16 x 16 tokens with the tiny VAE (scale factor 2), and as many per reference
STEPS = 3
VARIANTS = {  # name: pipeline class, guidance scale (CFG for [klein] base, embedded for [dev])
    "klein-cfg-off": (Flux2KleinPipeline, 1.0),
    "klein-cfg-on": (Flux2KleinPipeline, 4.0),
    "dev": (Flux2Pipeline, 4.0),
}
SOURCES = {"a": (48, 40), "b": (40, 56), "c": (56, 48), "d": (72, 64)}  # width, height: none square, none 64 px


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """'klein' or 'dev' -> the folder of its tiny pipeline, built once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = tmp_path_factory.mktemp(name)
            (build_flux2_dev if name == "dev" else build_flux2_klein)(cache[name])
        return cache[name]

    return get


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """name -> path of a random RGB source image of SOURCES' size."""
    d = tmp_path_factory.mktemp("sources")
    rng = np.random.default_rng(0)
    for name, (w, h) in SOURCES.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(d / f"{name}.png")
    return {name: str(d / f"{name}.png") for name in SOURCES}


def edit_batch(src, refs: int) -> list[EditPrompt]:
    """Two different instructions; with refs=2 each has two references of different sizes."""
    images = ([src["a"]], [src["b"]]) if refs == 1 else ([src["a"], src["b"]], [src["c"], src["a"]])
    return [EditPrompt("make the circle blue", images[0]), EditPrompt("put a hat on the square", images[1])]


@pytest.mark.parametrize("refs", [1, 2])
@pytest.mark.parametrize("variant", VARIANTS)
def test_samples_what_the_stock_pipeline_samples_from_reference_images(variant, refs, folder, src):
    """sample_ode on our velocity, then decode, against the pipeline given `image=[the centre-cropped squares]`: the
    references' VAE encoding and BatchNorm normalisation, their tokens after the noisy ones, their position ids (t =
    10, 20), the output cut to the noisy tokens, and [klein] base's CFG with "" (references in both halves). The
    latents: Flux2KleinPipeline's output_type="latent" gives the VAE's (un-normalised, un-patchified), Flux2Pipeline's
    the packed tokens themselves."""
    pipe_cls, scale = VARIANTS[variant]
    where = folder("dev" if variant == "dev" else "klein")
    model = load_model(str(where), resolution=EDIT_RES)
    assert model.kind == "flux2" and model.pipeline is pipe_cls
    pipe = pipe_cls.from_pretrained(where)
    pipe.set_progress_bar_config(disable=True)
    prompts = edit_batch(src, refs)
    cond = model.encode_prompts(prompts)
    seq, channels = model.latent_shape()
    assert cond["image_latents"].shape == (2, refs * seq, channels)  # a reference is as many tokens as the image
    noise = torch.randn(2, seq, channels, generator=torch.Generator().manual_seed(0))
    stock_noise = noise.transpose(1, 2).reshape(2, -1, *model.grid)  # the pipeline's patchified grid

    def stock(output_type):  # one call per prompt: the pipeline gives its references to every row of a call
        rows = []
        for i, p in enumerate(prompts):
            squares = [centre_square(img, EDIT_RES) for img in p.load_images()]
            rows.append(
                pipe(prompt=p.text, image=squares, height=EDIT_RES, width=EDIT_RES, num_inference_steps=STEPS,
                     guidance_scale=scale, latents=stock_noise[i : i + 1].clone(), output_type=output_type).images
            )  # fmt: skip
        return torch.cat(rows)

    images = stock("pt")
    sigmas = pipe.scheduler.sigmas  # the call's: STEPS shifted sigmas, then 0
    ours = sample_ode(model, model.transformer, cond, noise, sigmas, scale)
    assert ours.shape == images.shape == (2, 3, EDIT_RES, EDIT_RES)
    torch.testing.assert_close(ours, images, atol=1e-5, rtol=0)
    latents = stock("latent")
    as_stock = (lambda x: x) if variant == "dev" else model._vae_latents
    model.decode = lambda x: x
    ours_latents = as_stock(sample_ode(model, model.transformer, cond, noise, sigmas, scale))
    torch.testing.assert_close(ours_latents, latents, atol=1e-5, rtol=0)
    # the references matter: without them (the same instructions as plain text) the samples are others
    text_only = model.encode_prompts([p.text for p in prompts])
    plain = as_stock(sample_ode(model, model.transformer, text_only, noise, sigmas, scale))
    del model.decode
    assert (plain - latents).abs().max() > 1e-2


@pytest.fixture(scope="module")
def klein(folder):
    return load_model(str(folder("klein")), resolution=EDIT_RES)


def test_a_wrong_or_reordered_reference_is_another_condition_and_changes_the_velocity(klein, src):
    """The same instruction with another reference, or its two references swapped (their t = 10, 20 ids), is a
    distinct condition: encoded once per (instruction, references) pair, rows repeated, the text's rows equal, and the
    velocity (so the log-probability of a step) moves. The tiny random transformer attends almost evenly over its 768
    tokens, so a reference moves v (|v| ~ 0.5) by 1e-4 to 4e-4: 10x the pipeline tests' tolerance, and 100x the
    float32 rounding of a forward (the repeated row is equal bit for bit)."""
    right, wrong = EditPrompt("make it blue", [src["a"]]), EditPrompt("make it blue", [src["c"]])
    cond = klein.encode_prompts([right, right, wrong])
    assert torch.equal(cond["prompt_embeds"][0], cond["prompt_embeds"][2])  # the instruction alone is encoded
    assert torch.equal(cond["image_latents"][0], cond["image_latents"][1])
    assert not torch.allclose(cond["image_latents"][0], cond["image_latents"][2])
    x = torch.randn(1, *klein.latent_shape(), generator=torch.Generator().manual_seed(1)).expand(3, -1, -1)
    v = klein.velocity(klein.transformer, x, torch.full((3,), 0.7), cond, 4.0)
    assert torch.equal(v[0], v[1])
    assert (v[0] - v[2]).abs().max() > 5e-5
    ab, ba = EditPrompt("combine them", [src["a"], src["b"]]), EditPrompt("combine them", [src["b"], src["a"]])
    cond = klein.encode_prompts([ab, ba])
    assert cond["image_latents"].shape[0] == 2
    v = klein.velocity(klein.transformer, x[:2], torch.full((2,), 0.7), cond, 1.0)
    assert (v[0] - v[1]).abs().max() > 5e-5


def test_cfg_keeps_the_references_in_both_halves(klein, src):
    """_encode([""]) is the text alone (the uncond of CFG); the batched CFG forward carries each row's reference
    tokens in its unconditional half too, after the noisy tokens, with the ids t = 10 for them (Flux2KleinPipeline's
    negative forward takes the same latent_model_input and img_ids)."""
    assert set(klein._encode([""])) == {"prompt_embeds"}
    cond = klein.encode_prompts(edit_batch(src, 1))
    calls = []
    hook = klein.transformer.register_forward_hook(lambda m, a, kw, out: calls.append(kw), with_kwargs=True)
    x = torch.randn(2, *klein.latent_shape(), generator=torch.Generator().manual_seed(2))
    try:
        v = klein.velocity(klein.transformer, x, torch.full((2,), 0.5), cond, 4.0)
    finally:
        hook.remove()
    assert v.shape == x.shape and len(calls) == 1
    hidden, ids, seq = calls[0]["hidden_states"], calls[0]["img_ids"], x.shape[1]
    assert hidden.shape == (4, 2 * seq, x.shape[2])  # [uncond; cond] rows, noisy then reference tokens
    for half in (hidden[:2], hidden[2:]):
        assert torch.equal(half[:, :seq], x) and torch.equal(half[:, seq:], cond["image_latents"])
    assert ids[:seq, 0].eq(0).all() and ids[seq:, 0].eq(10).all()
    assert torch.equal(ids[seq:, 1:], ids[:seq, 1:])  # the same square grid of rows and columns


def test_a_plain_prompt_takes_the_text_to_image_forward_bit_for_bit(folder, klein, src):
    """A plain str prompt: no reference key in its condition, and its velocity is the transformer's forward on the
    text-to-image inputs of Flux2KleinPipeline (its prompt_embeds, text ids, latent ids) bit for bit; an EditPrompt's
    text is encoded as the same plain text; mixing the two in one batch is refused."""
    pipe = Flux2KleinPipeline.from_pretrained(folder("klein"))
    prompts = ["a red circle", "a green square on a white background"]
    cond = klein.encode_prompts(prompts)
    assert set(cond) == {"prompt_embeds"}
    embeds, text_ids = pipe.encode_prompt(prompts)
    assert torch.equal(cond["prompt_embeds"], embeds)
    x = torch.randn(2, *klein.latent_shape(), generator=torch.Generator().manual_seed(3))
    sigma = torch.full((2,), 0.6)
    latent_ids = pipe._prepare_latent_ids(x.transpose(1, 2).reshape(2, -1, *klein.grid))
    stock = klein.transformer(hidden_states=x, timestep=(sigma * 1000) / 1000, guidance=None,
                              encoder_hidden_states=embeds, txt_ids=text_ids, img_ids=latent_ids,
                              return_dict=False)[0]  # fmt: skip
    assert torch.equal(klein.velocity(klein.transformer, x, sigma, cond, 1.0), stock)
    edit = klein.encode_prompts([EditPrompt(prompts[0], [src["a"]])])
    assert torch.equal(edit["prompt_embeds"][0], cond["prompt_embeds"][0])
    with pytest.raises(InputError, match="'a red circle' brings 0 reference image"):
        klein.encode_prompts([EditPrompt("make it blue", [src["a"]]), "a red circle"])


def test_rows_with_different_reference_counts_or_too_many_are_refused(klein, src):
    """A batch is one token sequence: its rows bring the same number of references (InputError naming the prompt);
    [klein] takes at most 4 (Black Forest Labs' limit)."""
    one, two = EditPrompt("make it blue", [src["a"]]), EditPrompt("swap them", [src["a"], src["b"]])
    with pytest.raises(InputError, match=r"prompt EditPrompt\('swap them'.* brings 2 reference image\(s\) where"):
        klein.encode_prompts([one, two])
    with pytest.raises(InputError, match=r"brings 5 reference images; FLUX.2 \[klein\] takes at most 4"):
        klein.encode_prompts([EditPrompt("all of them", [src["a"]] * 5)])
    assert klein.encode_prompts([EditPrompt("all of them", [src["a"]] * 4)])["image_latents"].shape[1] == 4 * 256


def test_above_1024_px_a_reference_is_shrunk_as_the_pipeline_shrinks_it(folder, src, tmp_path):
    """At --resolution 1040 the pipelines resize a 1040 x 1040 reference to 1024 x 1024 pixels of area (LANCZOS: its
    float arithmetic gives 1023) and floor it to a multiple of 2 x the VAE's scale factor (1020 here): the pixels that reach the VAE encoding (_encode_vae_image)
    and the references' ids equal Flux2KleinPipeline's (the call stopped after its prepare_image_latents). The VAE
    encoding itself is stood in for here (the tiny VAE's mid-block attends over 512 x 512 latents: minutes on a CPU);
    the tests at 64 px cover it."""
    model = load_model(str(folder("klein")), resolution=1040)
    pipe = Flux2KleinPipeline.from_pretrained(folder("klein"))
    big = tmp_path / "big.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (1060, 1100, 3), dtype=np.uint8)).save(big)
    prompt = EditPrompt("make it blue", [str(big)])
    pixels = {}

    def encoder(name):  # records the pixels; latents of the VAE's shape (1, 4 x 4 channels, H / 4, W / 4)
        def encode(image, generator):
            pixels[name] = image
            return torch.zeros(1, 16, image.shape[2] // 4, image.shape[3] // 4)

        return encode

    ids = {}

    def stop(**kw):
        ids["stock"] = Flux2KleinPipeline.prepare_image_latents(pipe, **kw)[1][0]
        raise StopIteration

    pipe._encode_vae_image, pipe.prepare_image_latents = encoder("stock"), stop
    with pytest.raises(StopIteration):
        pipe(prompt=prompt.text, image=[centre_square(prompt.load_images()[0], 1040)], height=RES, width=RES)
    model.pipe._encode_vae_image = encoder("ours")
    cond = model.encode_prompts([prompt])
    side = model.reference_side
    assert side == 1020 and pixels["stock"].shape == (1, 3, side, side)
    assert torch.equal(pixels["ours"], pixels["stock"])
    assert cond["image_latents"].shape == (1, (side // 4) ** 2, 16)
    assert torch.equal(model.reference_ids(1), ids["stock"])


def test_the_lora_adapter_lands_on_modules_that_exist_and_trains_through_the_references(folder, src):
    """load_model gives the flux2 kind at tests.tiny.RES too (a reference is then a 32 px square); --lora's
    targets adapt every block of the tiny transformer, and a loss through a velocity with references reaches them."""
    model = load_model(str(folder("klein")), resolution=RES)
    assert model.kind == "flux2" and model.reference_side == RES
    flags = SimpleNamespace(lora=True, lora_rank=4, lora_alpha=4.0, gradient_checkpointing=False)
    module = trainable_denoiser(model, flags)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in module.named_parameters() if ".lora_A" in n}
    c = module.config
    assert len(adapted) == 8 * c.num_layers + 2 * c.num_single_layers
    for p in module.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.1)  # B = 0 at init would hide A's gradient
    cond = model.encode_prompts(edit_batch(src, 2))
    x = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(4))
    model.velocity(module, x, torch.full((2,), 0.5), cond, 4.0).square().mean().backward()
    grads = [p.grad for p in module.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
