"""common/models/ on tiny random-weight FLUX, SD3, SD1.x, Wan2.1 and ShapesBench models built from configs (offline)."""

import json

import pytest
import torch
from diffusers import (
    FluxPipeline,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    WanPipeline,
)

from common import InputError, models
from common.models import DDIMModel, FlowModel, SD3Model, add_lora, load_model, save_trained_weights
from tests.tiny import BUILDERS, PROMPTS, RES


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


def inputs(model, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, *model.latent_shape(), generator=g)
    sigma = torch.rand(B, generator=g) * 0.8 + 0.1
    return x, sigma, model.encode_prompts(PROMPTS[:B])


def expand(cond, B):
    return {k: v.expand(B, *v.shape[1:]) for k, v in cond.items()}


def perturb_lora(transformer, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in transformer.named_parameters():
            if "lora_" in n:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


# ---------------------------------------------------------------- flow models
FLOW_KINDS = ["flux", "sd3", "shapes"]


@pytest.mark.parametrize("kind", FLOW_KINDS)
def test_flow_interface(kind, tiny_dir):
    model = load_model(str(tiny_dir(kind)), resolution=RES)
    assert isinstance(model, FlowModel) and model.kind == kind
    assert (model.height, model.width) == (RES, RES)
    x, sigma, cond = inputs(model)
    for v in cond.values():
        assert v.shape[0] == 2
    assert not any(p.requires_grad for m in [*model.text_encoders, model.vae] if m is not None for p in m.parameters())
    assert all(p.requires_grad for p in model.transformer.parameters())

    v = model.velocity(model.transformer, x, sigma, cond)
    assert v.shape == x.shape and torch.isfinite(v).all()
    # gradients reach the transformer through velocity and through a differentiable decode of x0_hat
    x0_hat = x - sigma.view(-1, *[1] * (x.ndim - 1)) * v
    img = model.decode(x0_hat)
    assert img.shape == (2, 3, RES, RES) and img.min() >= 0 and img.max() <= 1
    (v.sum() + img.sum()).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.transformer.parameters())

    # a plain 10-step Euler ODE sampler from noise (s=1) to data (s=0)
    with torch.no_grad():
        sigmas = torch.linspace(1, 0, 11)
        x = torch.randn(2, *model.latent_shape())
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            x = x + (s_next - s) * model.velocity(model.transformer, x, s.expand(2), cond, guidance_scale=3.0)
        img = model.decode(x)
    assert img.shape == (2, 3, RES, RES) and torch.isfinite(img).all()


@pytest.mark.parametrize("kind", ["sd3", "shapes"])
def test_cfg_is_one_batched_combination(kind, tiny_dir):
    model = load_model(str(tiny_dir(kind)), resolution=RES)
    x, sigma, cond = inputs(model)
    with torch.no_grad():
        v_c = model.velocity(model.transformer, x, sigma, cond)
        v_u = model.velocity(model.transformer, x, sigma, expand(model.encode_prompts([""]), 2))
        v_g = model.velocity(model.transformer, x, sigma, cond, guidance_scale=4.0)
        v_one = model.velocity(model.transformer, x[:1], sigma[:1], {k: c[:1] for k, c in cond.items()}, 4.0)
    assert not torch.allclose(v_g, v_c, atol=1e-4)
    torch.testing.assert_close(v_g, v_u + 4.0 * (v_c - v_u), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(v_one, v_g[:1], atol=1e-5, rtol=1e-4)  # sliced cond works


def test_flux_embedded_guidance(tiny_dir):
    model = load_model(str(tiny_dir("flux")), resolution=RES)
    assert model.transformer.config.guidance_embeds
    x, sigma, cond = inputs(model)
    with torch.no_grad():
        v1 = model.velocity(model.transformer, x, sigma, cond, guidance_scale=1.0)
        v35 = model.velocity(model.transformer, x, sigma, cond, guidance_scale=3.5)
    assert v35.shape == x.shape and not torch.allclose(v1, v35)


def test_to_dtype_keeps_io_dtype(tiny_dir):
    model = load_model(str(tiny_dir("shapes"))).to(dtype=torch.bfloat16)
    x, sigma, cond = inputs(model)
    assert cond["prompt_embeds"].dtype == torch.bfloat16
    v = model.velocity(model.transformer, x, sigma, cond, guidance_scale=2.0)
    assert v.dtype == torch.float32 and model.decode(x).dtype == torch.float32


# ---------------------------------------------------------------- SD1.x + DDIM
def test_ddim_model(tiny_dir):
    model = load_model(str(tiny_dir("sd1")), resolution=RES)
    assert isinstance(model, DDIMModel) and model.kind == "sd1" and model.latent_shape() == (4, 16, 16)
    cond = model.encode_prompts(PROMPTS)
    assert cond["prompt_embeds"].shape[0] == 2
    a = model.alphas_cumprod
    x = torch.randn(2, *model.latent_shape())
    with torch.no_grad():
        for t, t_prev in zip([999, 799, 599, 399, 199], [799, 599, 399, 199, -1]):  # deterministic DDIM (eta=0)
            eps = model.eps(model.unet, x, torch.full((2,), t), cond, guidance_scale=4.0)
            assert eps.shape == x.shape and torch.isfinite(eps).all()
            a_t, a_prev = a[t], (a[t_prev] if t_prev >= 0 else torch.tensor(1.0))
            x0 = (x - (1 - a_t).sqrt() * eps) / a_t.sqrt()
            x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
        img = model.decode(x)
    assert img.shape == (2, 3, RES, RES) and img.min() >= 0 and img.max() <= 1


def test_ddim_v_prediction_gives_eps(tiny_dir):
    # a "unet" that predicts the exact v of a known (x0, noise) pair must come back as exactly that noise
    model = load_model(str(tiny_dir("sd1")), resolution=RES)
    model.prediction_type = "v_prediction"
    t = torch.tensor([900, 50])
    a = model.alphas_cumprod[t].view(-1, 1, 1, 1)
    x0, noise = torch.randn(2, *model.latent_shape()), torch.randn(2, *model.latent_shape())
    x = a.sqrt() * x0 + (1 - a).sqrt() * noise

    def v_unet(x, t, encoder_hidden_states, return_dict):
        return (a.sqrt() * noise - (1 - a).sqrt() * x0,)

    torch.testing.assert_close(model.eps(v_unet, x, t, {"prompt_embeds": torch.zeros(2, 1, 1)}), noise)


# ---------------------------------------------------------------- LoRA and saving
@pytest.mark.parametrize("kind", ["flux", "sd3", "shapes", "sd1", "wan"])
def test_lora_save_and_reload(kind, tiny_dir, tmp_path):
    model = load_model(str(tiny_dir(kind)), resolution=RES)
    net = model.unet if kind == "sd1" else model.transformer

    def run(n):
        with torch.no_grad():
            if kind == "sd1":
                return model.eps(n, x, torch.tensor([500, 100]), cond)
            return model.velocity(n, x, sigma, cond)

    if kind == "sd1":
        x, cond = torch.randn(2, *model.latent_shape()), model.encode_prompts(PROMPTS)
    else:
        x, sigma, cond = inputs(model)
    base = run(net)
    add_lora(net, rank=4, alpha=8)
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    torch.testing.assert_close(run(net), base)  # lora_B starts at zero
    perturb_lora(net)
    tuned = run(net)
    assert not torch.allclose(tuned, base, atol=1e-4)

    save_trained_weights(model, net, tmp_path, lora=True)
    pipe_cls = {
        "flux": FluxPipeline,
        "sd3": StableDiffusion3Pipeline,
        "sd1": StableDiffusionPipeline,
        "wan": WanPipeline,
    }
    pipe = pipe_cls.get(kind, StableDiffusion3Pipeline).from_pretrained(tiny_dir(kind))
    pipe.load_lora_weights(str(tmp_path))
    fresh = pipe.unet if kind == "sd1" else pipe.transformer
    if kind == "shapes":  # the stock pipeline: 256 zero T5 tokens, diffusers' attention
        stock = SD3Model(pipe, RES)
        assert stock.encode_prompts(PROMPTS)["prompt_embeds"].shape[1] == cond["prompt_embeds"].shape[1] + 255
        got = stock.velocity(fresh, x, sigma, stock.encode_prompts(PROMPTS))
    else:
        got = run(fresh)
    torch.testing.assert_close(got, tuned, atol=1e-5, rtol=1e-4)


def test_shapesbench_computes_the_stock_pipeline(tiny_dir):
    """ShapesModel's one-token shortcut (with and without guidance) gives the velocities of the pipeline as
    diffusers runs it: 256 zero T5 tokens, stock joint attention."""
    model = load_model(str(tiny_dir("shapes")), resolution=RES)
    stock = SD3Model(StableDiffusion3Pipeline.from_pretrained(tiny_dir("shapes")), RES)
    x, sigma, cond = inputs(model)
    with torch.no_grad():
        for scale in (1.0, 3.0):
            v = model.velocity(model.transformer, x, sigma, cond, scale)
            ref = stock.velocity(stock.transformer, x, sigma, stock.encode_prompts(PROMPTS), scale)
            torch.testing.assert_close(v, ref, atol=1e-5, rtol=1e-4)


def test_full_save(tiny_dir, tmp_path):
    model = load_model(str(tiny_dir("shapes")))
    with torch.no_grad():
        next(model.transformer.parameters()).add_(1.0)
    wrapped = torch.nn.Module()
    wrapped.module = model.transformer  # what DDP / accelerate.prepare hands back
    save_trained_weights(model, wrapped, tmp_path, lora=False)
    reloaded = SD3Transformer2DModel.from_pretrained(tmp_path / "transformer")
    for a, b in zip(reloaded.parameters(), model.transformer.parameters()):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- errors
def test_missing_local_path_names_flag(tmp_path):
    with pytest.raises(InputError, match="--model-id"):
        load_model(str(tmp_path / "does-not-exist"))
    with pytest.raises(InputError, match="--model-id"):
        load_model(str(tmp_path))  # a folder without model_index.json


def test_shapesbench_alias(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(models, "SHAPESBENCH_DIR", tiny_dir("shapes"))
    assert load_model("shapesbench").kind == "shapes"
    monkeypatch.setattr(models, "SHAPESBENCH_DIR", tmp_path / "not-trained-yet")
    with pytest.raises(InputError, match="--model-id"):
        load_model()


def test_uncached_hub_id_names_flag():
    with pytest.raises(InputError, match="--model-id") as e:
        load_model("nobody-here/not-a-cached-model-0123")
    assert "hf download" in str(e.value)


def test_unknown_class_lists_supported(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    with pytest.raises(ValueError, match="FluxPipeline.*StableDiffusion3Pipeline") as e:
        load_model(str(tmp_path))
    assert "--model-id" in str(e.value)


def test_bad_resolution_names_flag(tiny_dir):
    with pytest.raises(ValueError, match="--resolution"):
        load_model(str(tiny_dir("flux")), resolution=34)


@pytest.mark.parametrize("kind", ["sd3", "qwen"])
def test_each_distinct_prompt_is_encoded_once(kind, tiny_dir, monkeypatch):
    """A group's prompt repeated in the batch reaches the text encoders once; its rows equal the prompt encoded alone
    (Qwen-Image pads to the batch's longest prompt and masks: the mask keeps the rows equal)."""
    model = load_model(str(tiny_dir(kind)), resolution=RES)
    seen = []
    encode = model._encode
    monkeypatch.setattr(model, "_encode", lambda prompts: seen.append(list(prompts)) or encode(prompts))
    batch = [PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[0]]
    cond = model.encode_prompts(batch)
    assert seen == [[PROMPTS[1], PROMPTS[0]]]
    for i, p in enumerate(batch):
        alone = encode([p])
        for k, v in cond.items():
            n = alone[k].shape[1] if v.dim() > 1 else None  # Qwen-Image: the rows past a prompt's length are padding
            torch.testing.assert_close(v[i : i + 1, :n], alone[k], atol=1e-6, rtol=0)
