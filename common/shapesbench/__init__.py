"""ShapesBench: an offline text-to-image world small enough to train, sample and RL-tune on a laptop CPU.

Prompts are "a {fg} {shape} on a {bg} background" (3 shapes x 8 colours x 7 background colours = 168), split
into 120 training and 48 held-out prompts. Images are 32x32 RGB, hard-edged (every pixel a palette colour).

    world.py         palette, prompts, split, renderer; the corruptions a reward must rank low (texture, blur, blob)
    verifier.py      the programmatic verifier (colours, shape by template IoU, clean background) and the
                     held-out metrics (accuracies, well-formed rate, confusion matrix, diversity)
    reward.py        the learned reward (a tiny CLIP's cosine, "the HPS of ShapesBench") and its checks
    builders.py      the tiny model components (tokenizers, CLIP text encoders, null T5, SD3 transformer, CLIP reward
                     model) and the attention processor that computes the pipeline's 256 zero T5 tokens as one
    train_vae.py     `python -m common.shapesbench.train_vae`: the tiny AutoencoderKL (32x32x3 <-> 8x8x4), as SD3 /
                     FLUX have one
    train_latent.py  `python -m common.shapesbench.train_latent`: pretrain the base model in that latent (caption
                     noise, EMA), saved as a StableDiffusion3Pipeline folder
    train_reward.py  `python -m common.shapesbench.train_reward`: train the learned reward
    __main__.py      `python -m common.shapesbench eval`: sample a model on the held-out prompts, print JSON
    assets/          the shipped base model (latent/: a whole pipeline folder), the reward (reward/) and the VAE
                     (vae/, also inside latent/), each with its train_log.json

The base model is loaded like any diffusers model (`common.models.load_model("shapesbench")`), so the scripts
run the same code path on ShapesBench as on FLUX or SD3. The names below are the package's public interface.
"""

from common.shapesbench.reward import REWARD_PATH, ShapesReward, load_reward_model, ranking_checks, shape_agreement
from common.shapesbench.verifier import (
    SHAPE_IOU_MIN,
    WELL_FORMED_IOU,
    confusion_matrix,
    diversity,
    evaluate,
    verifier_reward,
    verify,
)
from common.shapesbench.world import (
    COLOUR_NAMES,
    JITTER,
    PALETTE,
    RADII,
    SHAPES,
    SIZE,
    all_prompts,
    blob,
    blur,
    make_prompt,
    parse_prompt,
    periodic_texture,
    render,
    sample_batch,
    split_prompts,
)

__all__ = [
    "COLOUR_NAMES",
    "JITTER",
    "PALETTE",
    "RADII",
    "REWARD_PATH",
    "SHAPES",
    "SHAPE_IOU_MIN",
    "SIZE",
    "WELL_FORMED_IOU",
    "ShapesReward",
    "all_prompts",
    "blob",
    "blur",
    "confusion_matrix",
    "diversity",
    "evaluate",
    "load_reward_model",
    "make_prompt",
    "parse_prompt",
    "periodic_texture",
    "render",
    "ranking_checks",
    "sample_batch",
    "shape_agreement",
    "split_prompts",
    "verifier_reward",
    "verify",
]
