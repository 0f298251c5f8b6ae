"""FLUX.1-Kontext (common/models/kontext.py) on a tiny random-weight FluxKontextPipeline (tests/tiny.py build_kontext):
the source image's packed VAE tokens appended after the noisy ones, their position ids on the first axis 1, the output
cut to the noisy tokens, guidance embedded. Our Euler sampler equals the stock pipeline given the centre-cropped
square source (`_auto_resize=False`, `max_area` = the square's area: the project's size rule, common/edits.py);
the source is part of the condition; the unconditional encoding is text alone (the pipeline without an image); the
LoRA targets exist; dancegrpo.py trains on an edit file."""

import json

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline
from PIL import Image

from common.edits import EditPrompt, centre_square
from common.models import LORA_TARGETS, load_model
from common.sampling import sample_ode
from tests.helpers import find_run, metrics, run_in_process
from tests.test_model_kinds import TINY
from tests.tiny import RES, build_kontext

INSTRUCTIONS = ("make the circle red", "put a green square on a white background")
SIZES = ((48, 40), (40, 56))  # (width, height): neither square nor RES, different from each other


def write_sources(folder, seed=0):
    """Two random RGB PNGs of SIZES in `folder`; their paths."""
    rng = np.random.default_rng(seed)
    paths = []
    for i, (w, h) in enumerate(SIZES):
        paths.append(folder / f"source_{seed}_{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    return [str(p) for p in paths]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("kontext")
    build_kontext(path)
    return path


@pytest.fixture(scope="module")
def model(folder):
    return load_model(str(folder), resolution=RES)


@pytest.fixture
def prompts(tmp_path):
    return [EditPrompt(text, [path]) for text, path in zip(INSTRUCTIONS, write_sources(tmp_path))]


def stock(pipe, prompts, noise, scale, output_type, steps=3):
    """FluxKontextPipeline on the batch: each prompt's source cut to the RES square (our size rule), no auto-resize,
    the output size RES x RES (max_area: the pipeline resizes its output to that area at the requested aspect)."""
    sources = [centre_square(p.load_images()[0], RES) for p in prompts] if isinstance(prompts[0], EditPrompt) else None
    return pipe(
        image=sources, prompt=[p.text if isinstance(p, EditPrompt) else p for p in prompts], height=RES, width=RES, max_area=RES * RES,
        _auto_resize=False, num_inference_steps=steps, guidance_scale=scale, latents=noise.clone(),
        output_type=output_type,
    ).images  # fmt: skip


def test_samples_what_the_stock_pipeline_samples(folder, model, prompts, monkeypatch):
    """Euler along the pipeline's sigmas (FLUX's dynamic shift on the noisy tokens' count) on our velocity, then our
    decode, equals FluxKontextPipeline's latents and images for two instructions with differently sized sources, at
    embedded guidance 1 and 4; no CFG forward (the unconditional encoding is never asked for)."""
    assert model.kind == "kontext" and model.pipeline is FluxKontextPipeline
    assert model.latent_shape() == (64, 64)  # 2x VAE: 16 x 16 latents, 8 x 8 tokens of 2 x 2 x 16
    pipe = FluxKontextPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    calls = []
    pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append(kw), with_kwargs=True)
    noise = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(prompts)
    assert cond["image_latents"].shape == (2, 64, 64)
    monkeypatch.setattr(model, "uncond", lambda: pytest.fail("FLUX.1-Kontext's guidance is embedded: no CFG"))
    latents = {}
    for scale in (1.0, 4.0):
        images = stock(pipe, prompts, noise, scale, "pt")
        sigmas = pipe.scheduler.sigmas
        ours = sample_ode(model, model.transformer, cond, noise, sigmas, scale)
        assert ours.shape == images.shape == (2, 3, RES, RES)
        torch.testing.assert_close(ours, images, atol=1e-5, rtol=1e-5)
        # and the latents themselves, tightly: a tiny random VAE barely moves its pixels when a latent moves
        latents[scale] = stock(pipe, prompts, noise, scale, "latent")
        with monkeypatch.context() as patch:
            patch.setattr(model, "decode", lambda x: x)
            ours = sample_ode(model, model.transformer, cond, noise, sigmas, scale)
        torch.testing.assert_close(ours, latents[scale], atol=1e-5, rtol=0)
    assert not torch.allclose(latents[1.0], latents[4.0], atol=1e-3)  # the scale is an input that matters
    # the pipeline did run on [noisy; source] tokens, the source's ids on axis 0 = 1
    assert calls[0]["hidden_states"].shape == (2, 128, 64)
    assert calls[0]["img_ids"][:64, 0].eq(0).all() and calls[0]["img_ids"][64:, 0].eq(1).all()


def test_the_source_image_is_part_of_the_condition(model, prompts, tmp_path, monkeypatch):
    """The same instruction with another source is another condition: encode_prompts encodes it separately (dedup by
    text and images), its tokens differ, and the velocity (so a log-prob) changes; a repeated prompt is encoded once
    and its rows are the same; a row of the batch's condition gives the velocity of the prompt encoded alone."""
    other = EditPrompt(prompts[0].text, [write_sources(tmp_path, seed=1)[0]])
    assert other != prompts[0] and other.text == prompts[0].text
    seen = []
    encode = model._encode
    monkeypatch.setattr(model, "_encode", lambda ps: seen.append(list(ps)) or encode(ps))
    cond = model.encode_prompts([prompts[0], other, prompts[0], prompts[1]])
    assert seen == [[prompts[0], other, prompts[1]]]  # three distinct conditions, each encoded once
    assert torch.equal(cond["prompt_embeds"][0], cond["prompt_embeds"][1])  # the same text...
    assert not torch.allclose(cond["image_latents"][0], cond["image_latents"][1], atol=1e-3)  # ...another source
    assert all(torch.equal(v[0], v[2]) for v in cond.values())
    x = torch.randn(4, *model.latent_shape(), generator=torch.Generator().manual_seed(1))
    x[2] = x[1] = x[0]
    sigma = torch.full((4,), 0.7)
    with torch.no_grad():
        v = model.velocity(model.transformer, x, sigma, cond, 3.5)
        assert v.shape == x.shape
        assert (v[0] - v[1]).abs().max() > 1e-3  # the wrong source moves the velocity
        torch.testing.assert_close(v[0], v[2], atol=1e-6, rtol=1e-5)
        alone = model.velocity(model.transformer, x[3:], sigma[3:], model.encode_prompts(prompts[1:]), 3.5)
    torch.testing.assert_close(v[3:], alone, atol=1e-6, rtol=1e-5)


def test_the_unconditional_encoding_is_text_alone(folder, model, prompts):
    """`_encode([""])` (the unconditional prompt) gives the text keys alone, and on it our sampler is
    FluxKontextPipeline without an image (text to image); a batch mixing edit and plain prompts is refused."""
    uncond = model._encode([""])
    assert set(uncond) == {"prompt_embeds", "pooled_prompt_embeds"}
    pipe = FluxKontextPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    noise = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(2))
    latents = stock(pipe, ["", ""], noise, 3.5, "latent", steps=2)
    cond = model.encode_prompts(["", ""])
    model.decode = lambda x: x
    try:
        ours = sample_ode(model, model.transformer, cond, noise, pipe.scheduler.sigmas, 3.5)
    finally:
        del model.decode
    torch.testing.assert_close(ours, latents, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="mixes"):
        model._encode([prompts[0], "a plain prompt"])


def test_the_lora_adapter_lands_on_modules_that_exist(model, folder):
    """Every LORA_TARGETS name is a module of the transformer: 8 Linears of each double block, q, k, v of each single
    block (FLUX's single blocks fuse the output projection with the MLP's: `proj_out`, not adapted, as for FLUX.1)."""
    from types import SimpleNamespace

    from common.models import trainable_denoiser

    model = load_model(str(folder), resolution=RES)  # its own copy: the adapter goes into it
    names = [n for n, _ in model.transformer.named_modules()]
    for target in LORA_TARGETS:
        assert any(n == target or n.endswith("." + target) for n in names), target
    flags = SimpleNamespace(lora=True, lora_rank=4, lora_alpha=4.0, gradient_checkpointing=False)
    module = trainable_denoiser(model, flags)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in module.named_parameters() if ".lora_A" in n}
    c = module.config
    assert len(adapted) == 8 * c.num_layers + 3 * c.num_single_layers


def test_dancegrpo_trains_an_iteration_on_an_edit_file_and_the_pipeline_loads_its_lora(folder, tmp_path):
    """One dancegrpo.py iteration on an edit file (two instructions, sources of two sizes), embedded guidance 4, the
    JPEG reward, a held-out evaluation at 0 and 1 and sample grids: final/ is read by FluxKontextPipeline's
    load_lora_weights and changes its latents for a source."""
    sources = write_sources(tmp_path)
    rows = [{"instruction": text, "image": path.rsplit("/", 1)[1]} for text, path in zip(INSTRUCTIONS, sources)]
    edits = tmp_path / "edits.jsonl"
    edits.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = [*TINY["dancegrpo.py"], "--model-id", str(folder), "--resolution", str(RES), "--prompts", str(edits),
             "--eval-prompts", str(edits), "--reward", "jpeg", "--guidance-scale", "4", "--iterations", "1",
             "--eval-every", "1", "--eval-samples-per-prompt", "1", "--eval-steps", "3", "--sample-every", "1",
             "--lora-rank", "4", "--learning-rate", "1e-2", "--exp-name", "kontext"]  # fmt: skip
    run_in_process("dancegrpo.py", flags, tmp_path)
    run = find_run(tmp_path / "kontext")
    records = metrics(run)
    assert len([r for r in records if "rewards/jpeg" in r]) == 1
    assert [r["iteration"] for r in records if "eval/reward" in r] == [0, 1]
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["samples_000000.png", "samples_000001.png"]
    pipe = FluxKontextPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    prompt = [EditPrompt(INSTRUCTIONS[0], sources[:1])]
    noise = torch.randn(1, 64, 64, generator=torch.Generator().manual_seed(0))
    before = stock(pipe, prompt, noise, 4.0, "latent", steps=2)
    pipe.load_lora_weights(str(run / "final"))
    assert pipe.transformer.peft_config
    assert not torch.allclose(before, stock(pipe, prompt, noise, 4.0, "latent", steps=2), atol=1e-6)


def test_common_evaluate_scores_the_base_on_an_edit_file(folder, prompts, tmp_path):
    """`python -m common.evaluate` on an edit file: the base model's JPEG reward per prompt, two samples each."""
    import tyro

    from common import evaluate as E

    edits = tmp_path / "edits.jsonl"
    edits.write_text("".join(json.dumps({"instruction": p.text, "image": p.images[0]}) + "\n" for p in prompts))
    argv = ["--model-id", str(folder), "--resolution", str(RES), "--prompts", str(edits), "--reward", "jpeg",
            "--samples-per-prompt", "2", "--num-steps", "2", "--guidance-scale", "4", "--batch-size", "4",
            "--out", str(tmp_path / "eval")]  # fmt: skip
    E.main(tyro.cli(E.EvalArgs, args=argv))
    result = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert result["settings"]["n_prompts"] == 2 and "reward_jpeg" in result["figures"]["base"]
