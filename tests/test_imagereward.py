"""ImageReward against its own code: the `image-reward` 1.5 package (installed by scripts/setup.sh without its pinned
requirements, and written for transformers 4) builds a tiny random-weight model (tests/conftest.py) with its BLIP ViT, its BERT with
cross-attention and its MLP; our `imagereward` loads that state dict into transformers' BLIP classes, and both score
the same images and prompts."""

from pathlib import Path

import pytest
import torch

from tests.test_rewards import PROMPTS, assert_finite_grad, to_pil, uint8_images


@pytest.mark.parametrize("size", [(224, 224), (240, 300)])
def test_imagereward_matches_the_package(tiny_imagereward, size):
    """Same pixels (224 px squares, where resize and crop are the identity): to 1e-5
    (a LayerNorm eps of 1e-5 for BLIP's 1e-6 moves them 6e-5). Other sizes: the package
    resizes uint8 PIL images, we resize float tensors (differentiable), so they agree to the rounding of that."""
    from common.rewards import imagereward

    model, folder = tiny_imagereward
    reward = imagereward("cpu", str(folder))
    images = uint8_images(2, *size)
    scores = assert_finite_grad(reward, images, PROMPTS)
    with torch.no_grad():
        expected = torch.tensor([model.score(p, to_pil(x)) for p, x in zip(PROMPTS, images)])
    assert (expected[0] - expected[1]).abs() > 0.1  # the images score apart: the comparison can see an error
    tolerance = 1e-5 if size == (224, 224) else 2e-2 * expected.abs().max().item()
    torch.testing.assert_close(scores, expected, atol=tolerance, rtol=0)


def test_imagereward_refuses_other_checkpoints(tiny_imagereward, tmp_path):
    from common.rewards import imagereward

    with pytest.raises(ValueError, match="not a folder"):
        imagereward("cpu", str(tmp_path / "nothing"))
    (tmp_path / "ImageReward.pt").write_bytes(b"not a torch file")
    (tmp_path / "med_config.json").write_text((Path(tiny_imagereward[1]) / "med_config.json").read_text())
    with pytest.raises(ValueError, match="not an ImageReward checkpoint"):
        imagereward("cpu", str(tmp_path))


def test_imagereward_offline_without_checkpoint(tmp_path, monkeypatch):
    import huggingface_hub

    from common.rewards import build_reward, parse_rewards

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="--reward-ckpt imagereward=/path/to/folder"):
        build_reward(parse_rewards("imagereward"), "cpu")
