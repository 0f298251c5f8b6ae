"""The shipped ShapesBench VAE: loads as a diffusers AutoencoderKL, 32x32x3 <-> 8x8x4, near-perfect reconstructions."""

import json

import torch

from common.shapesbench import builders, verifier, world
from common.shapesbench.train_vae import decode01, encode_mode


def load_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(builders.VAE_PATH).eval()


def test_shipped_vae_config_and_shapes():
    vae = load_vae()
    cfg = vae.config
    assert (cfg.in_channels, cfg.out_channels, cfg.latent_channels, cfg.sample_size) == (3, 3, 4, 32)
    assert cfg.scaling_factor > 0 and cfg.shift_factor is not None
    x = world.sample_batch(8, torch.Generator().manual_seed(0))[0] * 2 - 1
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
        assert z.shape == (8, 4, 8, 8)
        # the stored normalisation makes the latents about zero-mean, unit-std, as the SD3 / FLUX convention wants
        zn = (z - cfg.shift_factor) * cfg.scaling_factor
        assert zn.mean().abs() < 0.5 and 0.5 < zn.std() < 2
        assert vae.decode(z).sample.shape == (8, 3, 32, 32)
    log = json.loads((builders.VAE_PATH / "train_log.json").read_text())
    assert log["reconstruction_check"]["pass_rate"] >= 0.995 and log["reconstruction_check"]["n"] >= 2000


def test_shipped_vae_reconstructs_held_out_renders():
    vae = load_vae()
    images, prompts = world.sample_batch(64, torch.Generator().manual_seed(2024))  # not the training stream
    rec = decode01(vae, encode_mode(vae, images))
    v = verifier.verify(rec, prompts)
    assert int((v["all"] & v["well_formed"]).sum()) >= 63
