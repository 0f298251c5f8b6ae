"""Qwen-Image (common/models/qwenimage.py) on a tiny random-weight QwenImagePipeline built from configs (tests/tiny.py):
our velocity, Euler sampler and decode give the pipeline's own images with true CFG on and off; the padded, masked
CFG batch equals two separate forwards; the LoRA targets exist in the transformer; and every script trains on it."""

import pytest
import torch
from diffusers import QwenImagePipeline

from common.models import LORA_TARGETS, add_lora, load_model
from common.sampling import sample_ode
from tests.helpers import find_run, metrics, run_script
from tests.tiny import RES, build_qwen

PROMPTS = ["a red circle", "a green square on a white background"]  # of different lengths: the mask matters


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen")
    build_qwen(path)
    (path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return path


def test_qwen_image_samples_what_the_stock_pipeline_samples(qwen_dir):
    """Euler along the pipeline scheduler's sigmas (dynamic shift, terminal 0.02) on QwenImageModel's velocity, then
    its decode, against QwenImagePipeline: the timestep (sigma), the packing, RoPE's image grid, the text mask, true CFG
    with the negative prompt " " and its per-token norm rescale, and the VAE's latent statistics."""
    model = load_model(str(qwen_dir), resolution=RES)
    assert model.kind == "qwen" and model.latent_shape() == (4, 64)  # 32 px / 8 = 4 x 4 latents, 2 x 2 packed
    pipe = QwenImagePipeline.from_pretrained(qwen_dir)
    pipe.set_progress_bar_config(disable=True)
    noise = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(PROMPTS)
    assert cond["prompt_embeds_mask"].sum(1).tolist()[0] < cond["prompt_embeds"].shape[1]  # the short one is padded
    for scale, negative in ((1.0, None), (4.0, " ")):
        kw = dict(height=RES, width=RES, num_inference_steps=3, true_cfg_scale=scale, negative_prompt=negative)
        stock = pipe(PROMPTS, latents=noise.clone(), output_type="pt", **kw).images
        sigmas = pipe.scheduler.sigmas  # set by the call: 3 shifted steps, the last 0.02, then 0
        assert sigmas[-2].item() == pytest.approx(0.02)
        ours = sample_ode(model, model.transformer, cond, noise, sigmas, scale)
        assert ours.shape == stock.shape == (2, 3, RES, RES)
        torch.testing.assert_close(ours, stock, atol=1e-5, rtol=1e-5)
        latents = pipe(PROMPTS, latents=noise.clone(), output_type="latent", **kw).images
        model.decode = lambda x: x
        ours_latents = sample_ode(model, model.transformer, cond, noise, sigmas, scale)
        del model.decode
        torch.testing.assert_close(ours_latents, latents, atol=1e-5, rtol=0)


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


def test_every_lora_target_is_a_module_of_the_transformer(qwen_dir):
    """The adapter lands on every attention projection of Qwen-Image's double-stream blocks: each target name matches
    a module (a framework's list that names no module trains nothing there, silently)."""
    model = load_model(str(qwen_dir), resolution=RES)
    names = [n for n, _ in model.transformer.named_modules()]
    for target in LORA_TARGETS:
        assert any(n == target or n.endswith("." + target) for n in names), target
    add_lora(model.transformer, 4, 4.0)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.transformer.named_parameters() if ".lora_A" in n}
    assert len(adapted) == len(LORA_TARGETS) * model.transformer.config.num_layers


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
}  # fmt: skip


@pytest.mark.parametrize("script", TINY)
def test_script_trains_two_iterations_and_the_pipeline_loads_its_lora(script, qwen_dir, tmp_path):
    """2 iterations with true CFG 4 and the JPEG reward, a held-out evaluation at 0 and 2; final/ is read by
    QwenImagePipeline.load_lora_weights and changes the pipeline's images."""
    prompts = str(qwen_dir / "prompts.txt")
    flags = [*TINY[script], "--model-id", str(qwen_dir), "--resolution", str(RES), "--prompts", prompts,
             "--eval-prompts", prompts, "--reward", "jpeg", "--guidance-scale", "4", "--iterations", "2",
             "--eval-every", "2", "--eval-samples-per-prompt", "1", "--eval-steps", "3", "--sample-every", "0",
             "--lora-rank", "4", "--learning-rate", "1e-2", "--exp-name", "qwen"]  # fmt: skip
    run_script(script, flags, tmp_path, env={"HF_HUB_OFFLINE": "1"})
    run = find_run(tmp_path / "qwen")
    records = metrics(run)
    assert len([r for r in records if "rewards/jpeg" in r]) == 2
    assert [r["iteration"] for r in records if "eval/reward" in r] == [0, 2]
    pipe = QwenImagePipeline.from_pretrained(qwen_dir)
    pipe.set_progress_bar_config(disable=True)
    kw = dict(height=RES, width=RES, num_inference_steps=2, true_cfg_scale=1.0, output_type="latent")
    before = pipe(PROMPTS[:1], generator=torch.Generator().manual_seed(0), **kw).images
    pipe.load_lora_weights(str(run / "final"))
    assert pipe.transformer.peft_config
    after = pipe(PROMPTS[:1], generator=torch.Generator().manual_seed(0), **kw).images
    assert not torch.allclose(before, after, atol=1e-6)
    if script == "dancegrpo.py":  # and `python -m common.evaluate` scores the trained weights against the base
        import json

        import tyro

        from common import evaluate as E

        argv = ["--model-id", str(qwen_dir), "--resolution", str(RES), "--weights", str(run / "final"), "--prompts",
                prompts, "--reward", "jpeg", "--samples-per-prompt", "2", "--num-steps", "2", "--guidance-scale", "4",
                "--batch-size", "4", "--out", str(tmp_path / "eval")]  # fmt: skip
        E.main(tyro.cli(E.EvalArgs, args=argv))
        result = json.loads((tmp_path / "eval" / "results.json").read_text())
        trained = [m for m in result["figures"] if m != "base"]
        assert result["settings"]["n_prompts"] == 2 and len(trained) == 1
        assert result["figures"][trained[0]]["reward_jpeg"] != result["figures"]["base"]["reward_jpeg"]


def test_rlr_trains_through_the_decoder_and_a_differentiable_reward(qwen_dir, tmp_path, monkeypatch):
    """rlr.py's first-order term backpropagates through Qwen-Image's 3D VAE decode and the (tiny) HPSv2.1 reward, its
    zero-order term perturbs the adapter, with true CFG 4; in-process (the tiny HPS config is registered here only)."""
    import tyro

    import rlr
    from tests.tiny import build_tiny_hps, use_tiny_hps

    ckpt = build_tiny_hps(tmp_path)
    use_tiny_hps(monkeypatch)
    prompts = str(qwen_dir / "prompts.txt")
    argv = ["--output-dir", str(tmp_path), "--exp-name", "qwen", "--model-id", str(qwen_dir), "--resolution", str(RES),
            "--prompts", prompts, "--eval-prompts", prompts, "--reward", "hpsv2.1", "--reward-ckpt", f"hpsv2.1={ckpt}",
            "--guidance-scale", "4", "--iterations", "2", "--samples-per-device", "4", "--group-size", "2",
            "--rollout-batch-size", "2", "--num-steps", "4", "--eval-every", "0", "--sample-every", "0",
            "--terms", "fo+ho+zo", "--subchain-stage", "any", "--subchain-len", "1", "--lora-rank", "4"]  # fmt: skip
    rlr.main(tyro.cli(rlr.Args, args=argv))
    train = [r for r in metrics(find_run(tmp_path / "qwen")) if "grad/fo_norm" in r]
    assert len(train) == 2 and all(r["rlr/recompute_max_dev"] == 0 and r["grad/fo_norm"] > 0 for r in train)
    assert all(r["grad/zo_norm"] > 0 for r in train)
