"""Wan image-to-video (common/models/wan_i2v.py) on tiny random-weight WanImageToVideoPipelines (tests/tiny.py):
build_wan_i2v (Wan2.1-I2V's layout: CLIP image tokens) and build_wan22_i2v_a14b (Wan2.2-I2V-A14B's: two experts, no
image encoder). Our Euler sampler on our velocity, then our decode, equals the stock pipeline given the
centre-cropped square first frame (at height = width = RES the pipeline's own resize leaves it as it is, so nothing
is patched), per prompt (the pipeline takes one image per call), CFG on and off; the first frame is part of the
condition, through the latents and (Wan2.1) the CLIP tokens; the unconditional encoding is text alone and CFG keeps
the image in both halves; the LoRA targets exist (on both experts) and the saved adapter loads into the pipeline;
the folders load as the kind."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline
from PIL import Image

from common import InputError
from common.edits import EditPrompt, centre_square
from common.models import check_model_id, is_video, load_model, trainable_denoiser
from common.sampling import sample_ode
from tests.tiny import RES, build_wan22_i2v_a14b, build_wan_i2v

INSTRUCTIONS = ("the cat walks to the left", "a red car drives away")
SIZES = ((48, 40), (40, 56))  # (width, height): neither square nor RES, different from each other
FRAMES = 5  # (5 - 1) / 4 + 1 = 2 latent frames
BUILDERS = {"wan21": build_wan_i2v, "wan22": build_wan22_i2v_a14b}


def write_images(folder, seed=0):
    """Two random RGB PNGs of SIZES in `folder`; their paths."""
    rng = np.random.default_rng(seed)
    paths = []
    for i, (w, h) in enumerate(SIZES):
        paths.append(folder / f"frame_{seed}_{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    return [str(p) for p in paths]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> folder of its tiny pipeline, each built once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = tmp_path_factory.mktemp(name)
            BUILDERS[name](cache[name])
        return cache[name]

    return get


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("frames")
    return write_images(folder, 0), write_images(folder, 1)  # the prompts' first frames, and other ones


@pytest.fixture
def prompts(images):
    return [EditPrompt(text, [path]) for text, path in zip(INSTRUCTIONS, images[0])]


def no_decode(model):
    """The model with decode() returning the latents themselves (the sampler's last state)."""
    model.decode = lambda x: x
    return model


def stock(pipe, prompts, noise, output_type, **kw):
    """WanImageToVideoPipeline once per prompt (it takes one image a call): its first frame cut to the RES square (our
    size rule; the pipeline's resize to height x width then leaves it as it is), its row of the noise."""
    return torch.cat([
        pipe(image=centre_square(p.load_images()[0], RES), prompt=p.text, latents=noise[i : i + 1].clone(),
             output_type=output_type, **kw).frames
        for i, p in enumerate(prompts)
    ])  # fmt: skip


@pytest.mark.parametrize("name", BUILDERS)
def test_samples_what_the_stock_pipeline_samples(name, folders, prompts):
    """Euler along the pipeline's sigmas (shift 3, 3 steps) on our velocity, then our decode, against
    WanImageToVideoPipeline called once per prompt with that prompt's cropped first frame and its row of the noise:
    the preprocessing, the VAE-encoded [frame, zeros] video normalised per channel, the first-frame mask, the CLIP
    tokens (Wan2.1), 1000 sigma, CFG with "" and the same image condition, and (Wan2.2) each step's expert and its own
    CFG scale (guidance_scale_2 2 beside 4). Latents within 1e-5 (measured 8e-7 without CFG, 4e-6 with, on latents
    of size ~5), videos within 1e-5 (measured 2e-7; the tiny VAE barely moves its pixels, hence the latents too)."""
    model = load_model(str(folders(name)), resolution=RES, num_frames=FRAMES)
    assert model.kind == "wan-i2v" and model.latent_shape() == (16, 2, 4, 4)
    pipe = WanImageToVideoPipeline.from_pretrained(folders(name))
    pipe.set_progress_bar_config(disable=True)
    noise = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(prompts)
    assert cond["image_condition"].shape == (2, 20, 2, 4, 4)
    assert ("image_embeds" in cond) == (name == "wan21")  # Wan2.2-I2V has no image encoder
    for scale in (1.0, 4.0):
        extra = {}
        if name == "wan22":  # the low-noise expert's own scale, on the model as trainable_denoiser puts it
            model.guidance_scale_2 = 2.0 if scale > 1 else None
            extra = dict(guidance_scale_2=model.guidance_scale_2)
        kw = dict(height=RES, width=RES, num_frames=FRAMES, num_inference_steps=3, guidance_scale=scale, **extra)

        latents = stock(pipe, prompts, noise, "latent", **kw)
        sigmas = pipe.scheduler.sigmas  # set by the call: 3 shifted steps, then 0
        torch.testing.assert_close(model.sigmas(3), sigmas, atol=1e-6, rtol=0)
        if name == "wan22":  # both experts take steps: the first at the high-noise one, the others at the low
            assert (sigmas[:-1] * 1000 >= model.boundary).tolist() == [True, False, False]
        ours = sample_ode(no_decode(model), model.transformer, cond, noise, sigmas, scale)
        del model.decode
        torch.testing.assert_close(ours, latents, atol=1e-5, rtol=0)
        videos = stock(pipe, prompts, noise, "pt", **kw)
        ours = sample_ode(model, model.transformer, cond, noise, sigmas, scale)
        assert ours.shape == videos.shape == (2, FRAMES, 3, RES, RES)
        torch.testing.assert_close(ours, videos, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", BUILDERS)
def test_the_first_frame_is_part_of_the_condition(name, folders, images, monkeypatch):
    """The same instruction with another first frame is another condition: encode_prompts encodes it apart (distinct
    by (text, images), rows of a repeated prompt the same), its text rows are the same and its image condition is
    not, and the velocity moves with it at a high-noise and a low-noise sigma (Wan2.2: through each expert). Wan2.1:
    the CLIP tokens alone move it too (a log-prob of a rollout reads both)."""
    model = load_model(str(folders(name)), resolution=RES, num_frames=FRAMES)
    right, wrong = EditPrompt(INSTRUCTIONS[0], [images[0][0]]), EditPrompt(INSTRUCTIONS[0], [images[1][0]])
    seen = []
    encode = model._encode
    monkeypatch.setattr(model, "_encode", lambda ps: seen.append(list(ps)) or encode(ps))
    cond = model.encode_prompts([right, wrong, right])
    assert seen == [[right, wrong]]  # two distinct conditions, each encoded once
    for v in cond.values():
        torch.testing.assert_close(v[0], v[2], atol=0, rtol=0)
    torch.testing.assert_close(cond["prompt_embeds"][0], cond["prompt_embeds"][1], atol=0, rtol=0)
    assert (cond["image_condition"][0] - cond["image_condition"][1]).abs().max() > 0.1
    x = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.95, 0.5])  # Wan2.2: the high-noise expert, then the low-noise one
    rows = lambda i: {k: v[[i, i]] for k, v in cond.items()}  # noqa: E731
    v_right = model.velocity(model.transformer, x, sigma, rows(0), 4.0)
    v_wrong = model.velocity(model.transformer, x, sigma, rows(1), 4.0)
    assert all((v_right - v_wrong).flatten(1).abs().amax(1) > 1e-2)
    if name == "wan21":
        clip_only = {**rows(0), "image_embeds": rows(1)["image_embeds"]}
        v_clip = model.velocity(model.transformer, x, sigma, clip_only, 4.0)
        assert all((v_right - v_clip).flatten(1).abs().amax(1) > 1e-3)


@pytest.mark.parametrize("name", BUILDERS)
def test_cfg_keeps_the_first_frame_in_both_halves(name, folders, prompts):
    """The unconditional encoding (`_encode([""])`) is text alone; CFG's batched velocity equals u + w (c - u), u the
    velocity of the "" text WITH the prompt's image condition (so the unconditional half keeps it, as the pipeline's
    second forward does), within 1e-5 (measured 4e-6); Wan2.2 with guidance_scale_2 2: the low-noise row at 2."""
    model = load_model(str(folders(name)), resolution=RES, num_frames=FRAMES)
    assert set(model._encode([""])) == {"prompt_embeds"} and set(model.uncond()) == {"prompt_embeds"}
    cond = model.encode_prompts(prompts)
    x = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.95, 0.5])
    scales = torch.tensor([4.0, 4.0])
    if name == "wan22":
        model.guidance_scale_2, scales = 2.0, torch.tensor([4.0, 2.0])
    guided = model.velocity(model.transformer, x, sigma, cond, 4.0)
    c = model.velocity(model.transformer, x, sigma, cond, 1.0)
    u_cond = {**cond, "prompt_embeds": model.uncond()["prompt_embeds"].expand_as(cond["prompt_embeds"])}
    u = model.velocity(model.transformer, x, sigma, u_cond, 1.0)
    torch.testing.assert_close(guided, u + scales.view(-1, 1, 1, 1, 1) * (c - u), atol=1e-5, rtol=0)
    with pytest.raises(InputError, match="first frame"):  # text alone is no image-to-video condition
        model.velocity(model.transformer, x, sigma, model.encode_prompts(["a cat", "a car"]), 1.0)


@pytest.mark.parametrize("name", BUILDERS)
def test_the_lora_adapter_lands_on_modules_that_exist(name, folders, prompts, tmp_path):
    """Wan2.1-I2V: q, k, v and out of the self- and the text cross-attention and the cross-attention's image key and
    value (add_k_proj, add_v_proj: LORA_TARGETS names them), 10 Linears per block. Wan2.2-I2V-A14B: the 8 of each
    block on both experts, the same modules on each. The adapter (random B, so it acts), saved as the scripts save
    final/ (save_trained_weights), is read by WanImageToVideoPipeline.load_lora_weights (Wan2.2: the low-noise expert's
    file with load_into_transformer_2), and the pipeline then samples what our sampler samples with the adapter,
    within 1e-5 (measured 0: one prompt, no CFG); without the adapter the latents move (by ~0.5)."""
    from common.models import LOW_NOISE_LORA, save_trained_weights

    model = load_model(str(folders(name)), resolution=RES, num_frames=FRAMES)
    flags = SimpleNamespace(lora=True, lora_rank=4, lora_alpha=4.0, gradient_checkpointing=False, experts="both",
                            guidance_scale_2=None)  # fmt: skip
    module = trainable_denoiser(model, flags)
    adapted = sorted({n.rsplit(".lora_A", 1)[0] for n, _ in module.named_parameters() if ".lora_A" in n})
    if name == "wan21":
        assert len(adapted) == 10 * module.config.num_layers
        assert {"blocks.0.attn2.add_k_proj", "blocks.0.attn2.add_v_proj"} <= set(adapted)
    else:
        high = [n.removeprefix("high.") for n in adapted if n.startswith("high.")]
        low = [n.removeprefix("low.") for n in adapted if n.startswith("low.")]
        assert high == low and len(high) == 8 * module.high.config.num_layers and len(adapted) == 2 * len(high)
    assert all(p.requires_grad == (".lora_" in n) for n, p in module.named_parameters())
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if ".lora_B" in n:
                p.normal_(0, 0.5)
    save_trained_weights(model, module, tmp_path, lora=True)
    pipe = WanImageToVideoPipeline.from_pretrained(folders(name))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(tmp_path))
    if name == "wan22":
        pipe.load_lora_weights(str(tmp_path), weight_name=LOW_NOISE_LORA, load_into_transformer_2=True)
    noise = torch.randn(1, *model.latent_shape(), generator=torch.Generator().manual_seed(0))
    kw = dict(height=RES, width=RES, num_frames=FRAMES, num_inference_steps=3, guidance_scale=1.0)
    stock_latents = stock(pipe, prompts[:1], noise, "latent", **kw)
    module.eval()
    ours = sample_ode(no_decode(model), module, model.encode_prompts(prompts[:1]), noise, pipe.scheduler.sigmas, 1.0)
    torch.testing.assert_close(ours, stock_latents, atol=1e-5, rtol=0)
    module.disable_adapters()  # and the adapter acts: without it the latents are others
    assert (sample_ode(model, module, model.encode_prompts(prompts[:1]), noise, pipe.scheduler.sigmas, 1.0)
            - ours).abs().max() > 1e-2  # fmt: skip


@pytest.mark.parametrize("name", BUILDERS)
def test_the_folders_load_as_the_kind_and_refuse_what_is_not_supported(name, folders, images):
    """load_model gives the kind (a video kind, WanImageToVideoPipeline) at the native 480 x 832 x 81 without
    --resolution / --num-frames, and encodes a first frame there (its image's centred crop of the frame's aspect;
    1 frame here: one latent frame of 60 x 104); a prompt with a second image (the pipeline's last_image) and a
    per-token-timestep folder (Wan2.2-TI2V-5B's expand_timesteps) are refused."""
    from common.models.wan_i2v import WanI2VModel

    where = str(folders(name))
    assert check_model_id(where) == "wan-i2v" and is_video("wan-i2v")
    native = load_model(where)
    assert isinstance(native, WanI2VModel) and (native.height, native.width, native.num_frames) == (480, 832, 81)
    one = load_model(where, num_frames=1)
    cond = one.encode_prompts([EditPrompt(INSTRUCTIONS[0], [images[0][1]])])
    assert cond["image_condition"].shape == (1, 20, 1, 60, 104)
    with pytest.raises(InputError, match="--num-frames 6"):
        load_model(where, resolution=RES, num_frames=6)
    model = load_model(where, resolution=RES, num_frames=FRAMES)
    with pytest.raises(InputError, match="last_image"):
        model.encode_prompts([EditPrompt(INSTRUCTIONS[0], list(images[0]))])
    pipe = WanImageToVideoPipeline.from_pretrained(where)
    pipe.register_to_config(expand_timesteps=True)
    with pytest.raises(InputError, match="expand_timesteps"):
        WanI2VModel(pipe, RES, FRAMES)
