"""The learned ShapesBench reward (the HPS of ShapesBench): cosine similarity of a tiny CLIP's image and text
embeddings, trained on renders and their corrupted versions (`python -m common.shapesbench.train_reward`)."""

from __future__ import annotations

from pathlib import Path

import torch

from common import InputError
from common.shapesbench import world
from common.shapesbench.world import SIZE

REWARD_PATH = Path(__file__).resolve().parent / "assets" / "reward"


class ShapesReward:
    """The learned ShapesBench reward: cosine similarity of CLIP image and text embeddings, as HPS scores.

    Differentiable in the images. Images of another size are resized to 32x32 (area) first.
    """

    differentiable = True

    def __init__(self, tokenizer, model, device="cpu"):
        self.tokenizer, self.model = tokenizer, model.to(device).eval().requires_grad_(False)

    def text_features(self, prompts: list[str]) -> torch.Tensor:
        ids = self.tokenizer(prompts, padding="max_length", truncation=True, return_tensors="pt").input_ids
        f = self.model.get_text_features(input_ids=ids.to(self.model.device)).pooler_output  # (B, 64)
        return torch.nn.functional.normalize(f, dim=-1)

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[-2:] != (SIZE, SIZE):
            images = torch.nn.functional.interpolate(images, size=(SIZE, SIZE), mode="area")
        x = images.to(self.model.device, torch.float32) * 2 - 1  # same [-1, 1] range as the flow model
        f = self.model.get_image_features(pixel_values=x).pooler_output  # (B, 64)
        return torch.nn.functional.normalize(f, dim=-1)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return (self.image_features(images) * self.text_features(prompts)).sum(-1).to(images.device)


def load_reward_model(path: str | Path | None = None, device="cpu") -> ShapesReward:
    path = Path(path or REWARD_PATH)
    if not (path / "model" / "config.json").exists():
        raise InputError(
            f"--reward-ckpt shapes={path}: no ShapesBench reward model there (expected model/ and tokenizer/); "
            "retrain it with `python -m common.shapesbench.train_reward`"
        )
    from transformers import AutoTokenizer, CLIPModel  # heavy: imported when the reward model is loaded

    try:
        return ShapesReward(
            AutoTokenizer.from_pretrained(path / "tokenizer"), CLIPModel.from_pretrained(path / "model"), device
        )
    except Exception as e:  # damaged or foreign files in a folder shaped like a checkpoint
        raise InputError(
            f"--reward-ckpt shapes={path}: not a ShapesBench reward model ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''})"
        ) from None


@torch.no_grad()
def shape_agreement(reward: ShapesReward, images: torch.Tensor, prompts: list[str], shape_pred: torch.Tensor) -> float:
    """How often the reward's best of the three shape prompts (same colours) is the verifier's shape class
    `shape_pred` (N,) for model samples `images` (N, 3, 32, 32); pass well-formed samples, whose class is clear."""
    if not prompts:
        return float("nan")
    parsed = [world.parse_prompt(p) for p in prompts]
    scores = []  # per shape class: (N,) reward of each image under its colours with that shape
    for shape in world.SHAPES:
        alt = [world.make_prompt(shape, world.COLOUR_NAMES[f], world.COLOUR_NAMES[b]) for _, f, b in parsed]
        scores.append(torch.cat([reward(images[i : i + 256], alt[i : i + 256]) for i in range(0, len(alt), 256)]))
    return (torch.stack(scores, 1).argmax(1).cpu() == shape_pred.cpu()).float().mean().item()


@torch.no_grad()
def ranking_checks(reward: ShapesReward, g: torch.Generator, n: int = 512) -> dict[str, float]:
    """On n fresh ground-truth renders: how often the clean render scores above the same render with a periodic
    texture, blurred, or with a blob in the shape's place (what RL must not be able to gain reward from)."""
    renders, captions = world.sample_batch(n, g)
    clean = reward(renders, captions)
    return {
        "texture": (clean > reward(world.periodic_texture(renders, g), captions)).float().mean().item(),
        "blur": (clean > reward(world.blur(renders, g), captions)).float().mean().item(),
        "blob": (clean > reward(world.blob(captions, g), captions)).float().mean().item(),
    }
