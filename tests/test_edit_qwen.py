"""Qwen-Image-Edit-Plus (common/models/qwenimage_edit.py) on tiny random-weight QwenImageEditPlusPipelines (tests/tiny.py
build_qwen_edit_plus: the -2509 layout, and the -2511 one whose transformer modulates the image tokens at timestep 0):
the Qwen2.5-VL encoder sees the images in its chat template, the VAE tokens of each image follow the noisy ones, the
output is cut to the noisy tokens, and true CFG's negative " " is encoded with the images. Our Euler sampler equals the
stock pipeline (one prompt per call: it takes no batch) given the centre-cropped squares, with true CFG at 4 and off.

The pipeline reads two module constants of diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus at each call;
this module's autouse fixture shrinks them (monkeypatch): VAE_IMAGE_SIZE = RES * RES, so the pipeline VAE-encodes the
RES square as it is (the project's size rule: common/edits.py), and CONDITION_IMAGE_SIZE = 96 * 96, which the model
reads too (its VL path is the pipeline's resize of the square to that area), so the VL encoder sees 84 x 84 pixels (6 x
6 patches, 9 vision tokens) per image instead of 392 x 392."""

import json

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
from PIL import Image

from common import InputError
from common.edits import EditPrompt, centre_square
from common.models import LORA_TARGETS, load_model
from common.sampling import sample_ode
from tests.helpers import find_run, metrics, run_in_process
from tests.test_model_kinds import TINY
from tests.tiny import RES, build_qwen_edit_plus

CONDITION_SIZE = 96  # the VL path's square side here (the pipeline's is 384)
INSTRUCTIONS = ("make the circle blue", "put a hat on the cat", "put the cat of picture 2 on the sofa of picture 1")
SIZES = ((48, 40), (40, 56))  # (width, height): neither square nor RES, different from each other
SCALES = (1.0, 4.0)  # true_cfg_scale: off, and on with the negative prompt " " (QwenImageModel's)


@pytest.fixture(autouse=True)
def tiny_sizes(monkeypatch):
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", RES * RES)
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", CONDITION_SIZE * CONDITION_SIZE)


def write_sources(folder, seed=0):
    """Two random RGB PNGs of SIZES in `folder`; their paths."""
    rng = np.random.default_rng(seed)
    paths = []
    for i, (w, h) in enumerate(SIZES):
        paths.append(folder / f"source_{seed}_{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    return [str(p) for p in paths]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """variant -> its tiny pipeline folder, each built once per module."""
    cache = {}

    def get(variant):
        if variant not in cache:
            cache[variant] = tmp_path_factory.mktemp(variant)
            build_qwen_edit_plus(cache[variant], zero_cond_t=variant == "2511")
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def model(folders):
    return load_model(str(folders("2509")), resolution=RES)


@pytest.fixture
def prompts(tmp_path):
    """Two instructions with one image each (48 x 40, 40 x 56), and one with both images as two references."""
    a, b = write_sources(tmp_path)
    return [EditPrompt(INSTRUCTIONS[0], [a]), EditPrompt(INSTRUCTIONS[1], [b]), EditPrompt(INSTRUCTIONS[2], [a, b])]


def stock(pipe, prompt, noise, scale, output_type, steps=3):
    """QwenImageEditPlusPipeline on one prompt (it takes one per call): its images cut to the RES square (our size rule),
    the output RES x RES, true CFG with " " when scale > 1 (QwenImageModel's negative prompt)."""
    return pipe(
        image=[centre_square(img, RES) for img in prompt.load_images()], prompt=prompt.text, height=RES, width=RES,
        negative_prompt=" " if scale > 1 else None, true_cfg_scale=scale, num_inference_steps=steps,
        latents=noise.clone(), output_type=output_type,
    ).images  # fmt: skip


BATCHES = {"two instructions": [0, 1], "two references": [2], "mixed counts": [2, 0, 1]}  # rows of `prompts`


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("variant", ["2509", "2511"])
def test_samples_what_the_stock_pipeline_samples(variant, batch, folders, prompts, monkeypatch):
    """Euler along the pipeline's sigmas (Qwen-Image's dynamic shift on the noisy tokens' count, ending at 0.02) on our
    velocity, then our decode, equals QwenImageEditPlusPipeline's latents and images, row by row against one call per
    prompt, at true_cfg_scale 1 and 4: for two instructions with an image each, one instruction with two references of
    different sizes, and a batch mixing one and two images per row (one transformer forward per image count)."""
    model = load_model(str(folders(variant)), resolution=RES)
    assert type(model).__name__ == "QwenImageEditModel" and model.kind == "qwen-edit"
    assert model.pipeline is QwenImageEditPlusPipeline and model.transformer.config.zero_cond_t == (variant == "2511")
    assert model.latent_shape() == (4, 64)  # 8x VAE: 4 x 4 latents, 2 x 2 tokens of 2 x 2 x 16
    pipe = QwenImageEditPlusPipeline.from_pretrained(folders(variant))
    pipe.set_progress_bar_config(disable=True)
    calls = []
    pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append(kw), with_kwargs=True)
    rows = [prompts[i] for i in BATCHES[batch]]
    noise = torch.randn(len(rows), *model.latent_shape(), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(rows)
    assert cond["image_latents"].shape == (len(rows), 4 * max(len(p.images) for p in rows), 64)
    monkeypatch.setattr(model, "uncond", lambda: pytest.fail("the negative travels in cond, with the images"))
    latents = {}
    for scale in SCALES:
        images = torch.cat([stock(pipe, p, noise[i : i + 1], scale, "pt") for i, p in enumerate(rows)])
        sigmas = pipe.scheduler.sigmas
        assert sigmas[-2].item() == pytest.approx(0.02)
        torch.testing.assert_close(model.sigmas(3), sigmas, atol=1e-6, rtol=0)  # --shift pipeline: the same grid
        ours = sample_ode(model, model.transformer, cond, noise, sigmas, scale)
        assert ours.shape == images.shape == (len(rows), 3, RES, RES)
        torch.testing.assert_close(ours, images, atol=1e-5, rtol=1e-5)
        # and the latents themselves, tightly: a tiny random VAE barely moves its pixels when a latent moves
        latents[scale] = torch.cat([stock(pipe, p, noise[i : i + 1], scale, "latent") for i, p in enumerate(rows)])
        with monkeypatch.context() as patch:
            patch.setattr(model, "decode", lambda x: x)
            ours = sample_ode(model, model.transformer, cond, noise, sigmas, scale)
        torch.testing.assert_close(ours, latents[scale], atol=1e-5, rtol=0)
    assert not torch.allclose(latents[1.0], latents[4.0], atol=1e-3)  # true CFG matters
    # the pipeline did run on [noisy; image] tokens with the noisy grid and each image's in img_shapes
    n = len(rows[0].images)
    assert calls[0]["hidden_states"].shape == (1, 4 * (1 + n), 64)
    assert calls[0]["img_shapes"] == [[(1, 2, 2)] * (1 + n)]


def test_the_vl_encoder_sees_each_square_at_the_pipelines_condition_size(model, folders, prompts):
    """The VL path follows the pipeline's CONDITION_IMAGE_SIZE resize of the RES square (96 x 96 here; the Qwen2-VL
    processor rounds it to 84 x 84: a 6 x 6 patch grid per image), for the instruction and for the negative prompt,
    and the text encoder gets the very pixels and token ids the pipeline's gets."""
    ours, theirs = [], []
    hook = lambda calls: lambda m, a, kw, out: calls.append(kw)  # noqa: E731
    handle = model.text_encoders[0].register_forward_hook(hook(ours), with_kwargs=True)
    try:
        model._encode([prompts[2]])
    finally:
        handle.remove()
    assert [kw["image_grid_thw"].tolist() for kw in ours] == [[[1, 6, 6], [1, 6, 6]]] * 2  # instruction, negative
    pipe = QwenImageEditPlusPipeline.from_pretrained(folders("2509"))
    pipe.set_progress_bar_config(disable=True)
    pipe.text_encoder.register_forward_hook(hook(theirs), with_kwargs=True)
    stock(pipe, prompts[2], torch.zeros(1, 4, 64), 4.0, "latent", steps=2)
    for a, b in zip(ours, theirs, strict=True):
        for key in ("input_ids", "pixel_values", "image_grid_thw"):
            assert torch.equal(a[key], b[key]), key


def test_the_images_are_part_of_the_condition(model, prompts, tmp_path, monkeypatch):
    """The same instruction with another image (or its references in the other order) is another condition:
    encode_prompts encodes it separately (dedup by text and images), the VL embeddings and the image tokens differ,
    and the velocity (so a log-prob) changes; a repeated prompt is encoded once and its rows are the same; a row of a
    batch mixing one and two images gives the velocity of its prompt encoded alone, and the gradient reaches the
    transformer through the per-count forwards."""
    other = EditPrompt(prompts[0].text, [write_sources(tmp_path, seed=1)[0]])
    swapped = EditPrompt(prompts[2].text, prompts[2].images[::-1])
    assert other != prompts[0] and other.text == prompts[0].text and swapped != prompts[2]
    seen = []
    encode = model._encode
    monkeypatch.setattr(model, "_encode", lambda ps: seen.append(list(ps)) or encode(ps))
    batch = [prompts[0], other, prompts[0], prompts[2], swapped]
    cond = model.encode_prompts(batch)
    assert seen == [[prompts[0], other, prompts[2], swapped]]  # four distinct conditions, each encoded once
    assert cond["image_count"].tolist() == [1, 1, 1, 2, 2]
    assert cond["image_latents"].shape == (5, 8, 64)
    assert cond["image_latents"][:3, 4:].eq(0).all()  # one image: its row padded to the batch's two
    assert not torch.allclose(cond["image_latents"][0], cond["image_latents"][1], atol=1e-3)
    mask = cond["prompt_embeds_mask"]
    assert not torch.allclose(cond["prompt_embeds"][0][mask[0].bool()], cond["prompt_embeds"][1][mask[1].bool()])
    assert all(torch.equal(v[0], v[2]) for v in cond.values())
    x = torch.randn(5, *model.latent_shape(), generator=torch.Generator().manual_seed(1))
    x[1:3] = x[0]
    x[4] = x[3]
    sigma = torch.full((5,), 0.7)
    with torch.no_grad():
        for scale in SCALES:
            v = model.velocity(model.transformer, x, sigma, cond, scale)
            assert v.shape == x.shape
            assert (v[0] - v[1]).abs().max() > 1e-3  # the wrong image moves the velocity
            assert (v[3] - v[4]).abs().max() > 1e-3  # and so does the references' order (Picture 1, Picture 2)
            torch.testing.assert_close(v[0], v[2], atol=1e-6, rtol=1e-5)
            for i in (0, 3):
                alone = model.velocity(model.transformer, x[i : i + 1], sigma[:1], encode([batch[i]]), scale)
                torch.testing.assert_close(v[i : i + 1], alone, atol=1e-6, rtol=1e-5)
    model.transformer.zero_grad()
    model.velocity(model.transformer, x, sigma, cond, 4.0).square().sum().backward()
    grad = model.transformer.img_in.weight.grad
    model.transformer.zero_grad()
    assert grad is not None and grad.abs().sum() > 0


def test_the_negative_prompt_is_encoded_with_the_images(model, prompts, monkeypatch):
    """Each row carries the negative " " as the VL encoder sees it with the row's images (QwenImageEditPlusPipeline
    encodes negative_prompt with image=condition_images): the same images give the same negative whatever the
    instruction, other images another one, and it is not the text-alone " " of `uncond()`. True CFG is the
    per-token-rescaled combination of two forwards, both on the row's image tokens: the prompt's, and the negative's."""
    same_image = EditPrompt("turn it upside down", prompts[0].images)
    cond = model.encode_prompts([prompts[0], prompts[1], same_image])
    neg, neg_mask = cond["negative_prompt_embeds"], cond["negative_prompt_embeds_mask"]
    assert torch.equal(neg[0], neg[2]) and torch.equal(neg_mask[0], neg_mask[2])
    assert not torch.allclose(neg[0][neg_mask[0].bool()], neg[1][neg_mask[1].bool()])
    text_alone = model.uncond()["prompt_embeds"]  # " " without pictures: fewer tokens, other values
    assert text_alone.shape[1] < neg_mask[0].sum() and set(model.uncond()) == {"prompt_embeds", "prompt_embeds_mask"}
    x = torch.randn(3, *model.latent_shape(), generator=torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.9, 0.5, 0.2])
    monkeypatch.setattr(model, "uncond", lambda: pytest.fail("the negative travels in cond"))
    with torch.no_grad():
        v = model.velocity(model.transformer, x, sigma, cond, 4.0)
        c = model.velocity(model.transformer, x, sigma, cond)
        u = model.velocity(model.transformer, x, sigma, {**cond, "prompt_embeds": neg, "prompt_embeds_mask": neg_mask})
    comb = u + 4.0 * (c - u)
    torch.testing.assert_close(v, comb * c.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))


def test_the_plain_text_encoding_is_text_alone_and_unused(model, prompts, tmp_path):
    """`_encode([""])` (the interface's unconditional prompt) gives the text keys alone, the pipeline's encode_prompt
    without images; velocity refuses such a cond (it needs the images; the pipeline has no text-to-image path), a batch
    mixing edit and plain prompts is refused, and so is a prompt with more than three images."""
    plain = model._encode([""])
    assert set(plain) == {"prompt_embeds", "prompt_embeds_mask"}
    embeds, _ = model.pipe.encode_prompt([""], image=None)
    assert torch.equal(plain["prompt_embeds"], embeds) and plain["prompt_embeds_mask"].eq(1).all()
    with pytest.raises(ValueError, match="needs an edit prompt"):
        model.velocity(model.transformer, torch.zeros(1, 4, 64), torch.ones(1), plain, 4.0)
    with pytest.raises(ValueError, match="mixes"):
        model._encode([prompts[0], "a plain prompt"])
    with pytest.raises(InputError, match="at most 3"):
        model._encode([EditPrompt("four", [*prompts[2].images, *prompts[2].images])])


def test_the_lora_adapter_lands_on_modules_that_exist(folders):
    """Every LORA_TARGETS name is a module of the transformer (Qwen-Image's): 8 Linears per double-stream block."""
    from types import SimpleNamespace

    from common.models import trainable_denoiser

    model = load_model(str(folders("2511")), resolution=RES)  # its own copy: the adapter goes into it
    names = [n for n, _ in model.transformer.named_modules()]
    for target in LORA_TARGETS:
        assert any(n == target or n.endswith("." + target) for n in names), target
    flags = SimpleNamespace(lora=True, lora_rank=4, lora_alpha=4.0, gradient_checkpointing=False)
    module = trainable_denoiser(model, flags)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in module.named_parameters() if ".lora_A" in n}
    assert len(adapted) == 8 * module.config.num_layers


def test_dancegrpo_trains_an_iteration_on_an_edit_file_and_the_pipeline_loads_its_lora(folders, tmp_path):
    """One dancegrpo.py iteration on an edit file (two instructions with an image each, one with both images), true
    CFG 4, the JPEG reward, a held-out evaluation at 0 and 1 over rows with one and two images, and sample grids:
    final/ is read by QwenImageEditPlusPipeline's load_lora_weights and changes its latents for an edit."""
    folder = folders("2511")
    sources = write_sources(tmp_path)
    names = [p.rsplit("/", 1)[1] for p in sources]
    rows = [{"instruction": INSTRUCTIONS[0], "image": names[0]}, {"instruction": INSTRUCTIONS[1], "image": names[1]},
            {"instruction": INSTRUCTIONS[2], "images": names}]  # fmt: skip
    edits = tmp_path / "edits.jsonl"
    edits.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = [*TINY["dancegrpo.py"], "--model-id", str(folder), "--resolution", str(RES), "--prompts", str(edits),
             "--eval-prompts", str(edits), "--reward", "jpeg", "--guidance-scale", "4", "--iterations", "1",
             "--eval-every", "1", "--eval-samples-per-prompt", "1", "--eval-steps", "3", "--sample-every", "1",
             "--lora-rank", "4", "--learning-rate", "1e-2", "--exp-name", "qwen-edit"]  # fmt: skip
    run_in_process("dancegrpo.py", flags, tmp_path)
    run = find_run(tmp_path / "qwen-edit")
    records = metrics(run)
    assert len([r for r in records if "rewards/jpeg" in r]) == 1
    assert [r["iteration"] for r in records if "eval/reward" in r] == [0, 1]
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["samples_000000.png", "samples_000001.png"]
    pipe = QwenImageEditPlusPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    prompt = EditPrompt(INSTRUCTIONS[2], sources)
    noise = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0))
    before = stock(pipe, prompt, noise, 4.0, "latent", steps=2)
    pipe.load_lora_weights(str(run / "final"))
    assert pipe.transformer.peft_config
    assert not torch.allclose(before, stock(pipe, prompt, noise, 4.0, "latent", steps=2), atol=1e-6)
