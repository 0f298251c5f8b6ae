"""The latent-space ShapesBench base model: a StableDiffusion3Pipeline folder over the ShapesBench VAE, trained with
the pipeline's own prompt conditioning (train_latent.py)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from common.shapesbench import builders
from common.shapesbench.builders import T5_TOKENS, RepeatedLastTokenJointAttention, make_pipeline
from common.shapesbench.train_latent import encode_captions
from common.shapesbench.train_vae import build_vae

ROOT = Path(__file__).resolve().parents[1]


def test_training_conditioning_equals_the_pipelines():
    """One zero T5 token with the log(256) attention bias gives the transformer output of the pipeline's default
    conditioning (256 zero tokens, stock attention), and the captions go through the pipeline's encode_prompt."""
    parts = builders.build_latent_components(4, seed=0, heads=2, layers=2)
    pipe = make_pipeline(build_vae(seed=0), parts)
    tr = parts["transformer"]
    captions = ["a red circle on a blue background", ""]
    embeds, pooled = encode_captions(pipe, captions)
    full, _, full_pooled, _ = pipe.encode_prompt(captions, None, None, do_classifier_free_guidance=False)
    assert embeds.shape == (2, builders.MAX_TOKENS + 1, 128) and full.shape == (2, builders.MAX_TOKENS + T5_TOKENS, 128)
    assert torch.equal(embeds, full[:, : builders.MAX_TOKENS + 1]) and torch.equal(pooled, full_pooled)
    assert full[:, builders.MAX_TOKENS :].abs().max() == 0  # the null T5 outputs zeros
    x, t = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([300.0, 800.0])
    with torch.no_grad():
        ref = tr(hidden_states=x, timestep=t, encoder_hidden_states=full, pooled_projections=pooled)[0]
        stock = tr.attn_processors
        tr.set_attn_processor(RepeatedLastTokenJointAttention(T5_TOKENS))
        got = tr(hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled)[0]
        tr.set_attn_processor(stock)
    assert torch.allclose(ref, got, atol=1e-5)


def test_train_latent_smoke_and_resume(tmp_path):
    """Four steps on the shipped VAE write a folder that StableDiffusion3Pipeline.from_pretrained loads as is; the
    same training killed (SIGKILL) once its state of step 2 is saved, then run again, ends with the same weights."""
    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def train(out, kill_when=None):
        cmd = [sys.executable, "-m", "common.shapesbench.train_latent", "--steps", "4", "--save-every", "2"]
        cmd += ["--log-every", "1", "--eval-steps", "2", "--eval-samples-per-prompt", "1", "--threads", "1"]
        cmd += ["--batch-size", "8", "--heads", "1", "--layers", "1"]  # a small model: the plumbing is what counts
        proc = subprocess.Popen([*cmd, "--out", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        while kill_when is not None and proc.poll() is None and not kill_when():
            time.sleep(0.001)
        if kill_when is not None and proc.poll() is None:
            proc.kill()
        return proc.wait(timeout=300), proc.stdout.read()

    out, killed = tmp_path / "latent", tmp_path / "killed"
    status, _ = train(out)
    log = json.loads((out / "train_log.json").read_text())
    assert status == 0 and log["steps"] == 4 and log["eval"]["n"] == 48 and set(log["target"]) >= {"all"}
    assert not (out / "train_state.pt").exists()  # deleted once the pipeline is saved
    state = killed / "train_state.pt"
    assert train(killed, kill_when=state.exists)[0] == -9 and state.exists()
    status, printed = train(killed)
    assert status == 0 and "resumed from" in printed
    weights = Path("transformer") / "diffusion_pytorch_model.safetensors"
    a, b = load_file(out / weights), load_file(killed / weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline" and builders.SHAPESBENCH_KEY in index
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(out)
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a red circle on a blue background", num_inference_steps=2).images[0]
    assert image.size == (32, 32)
