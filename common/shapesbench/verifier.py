"""The ShapesBench verifier (its GenEval): background colour, foreground colour, shape and a clean background,
judged programmatically; plus the held-out metrics built on it (accuracies, confusion matrix, diversity)."""

from __future__ import annotations

import functools
import itertools

import torch

from common.shapesbench.world import (
    JITTER,
    PALETTE,
    RADII,
    SHAPES,
    SIZE,
    TEXTURE_MAX_PERIOD,
    parse_prompt,
    render,
    shape_masks,
)

# The verifier's template bank is wider than the data, so off-distribution samples still get a shape.
TEMPLATE_RADII = tuple(range(3, 14))
TEMPLATE_CENTRES = tuple(range(6, 27))
SHAPE_IOU_MIN = 0.6  # a shape counts as correct only if its best template of the right class fits this well
# "well formed": the best template of ANY class fits the requested-colour pixels this well. 0.6 cannot tell a
# blob from a shape (the blobs of an earlier, under-trained base model passed it 92% of the time); 0.85 does (those
# blobs 2%, renders 100%).
WELL_FORMED_IOU = 0.85
CLEAN_MAX_DEV = 0.08  # mean |pixel - palette background| over background pixels
CLEAN_MAX_STRAY = 0.03  # fraction of pixels that are neither the background nor the foreground colour
# Largest amplitude of one Fourier component of period <= TEXTURE_MAX_PERIOD px in the background's deviation
# from its palette colour. A periodic texture is what a learned reward can be fooled by and what CLEAN_MAX_DEV
# lets through at low amplitude (a V-GRPO run on the verifier reward grew one): 576 samples of the shipped base
# model stay below 0.0099; 95.8% of 1024 renders with a texture of amplitude 0.03 (about 8/255) are above 0.012.
CLEAN_MAX_PERIODIC = 0.012


@functools.lru_cache(maxsize=1)
def _templates() -> tuple[torch.Tensor, torch.Tensor]:
    """All template masks, flattened (T, 1024) float, and their shape class (T,). T = 3 * 11 * 21 * 21."""
    grid = torch.tensor(list(itertools.product(range(3), TEMPLATE_RADII, TEMPLATE_CENTRES, TEMPLATE_CENTRES)))
    masks = shape_masks(*grid.unbind(1)).flatten(1).float()
    return masks, grid[:, 0]


@torch.no_grad()
def verify(images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Judge images (B, 3, H, W) in [0, 1] against their prompts; returns bool tensors (B,) and scores.

    Every pixel gets its nearest palette colour. The most frequent label is the background, the next
    one the foreground. The shape is the class of the best-IoU template (a circle, square or triangle
    mask at any radius and position) against the pixels of the *requested* foreground colour; it is
    correct if that class is the requested one with IoU >= SHAPE_IOU_MIN. The background is clean if
    background pixels sit close to their palette colour, few pixels are neither colour, and no periodic
    texture stands out of the background's deviation (periodic_amplitude): the textures a learned reward
    can be fooled by.
    """
    images = images.detach().float().cpu().clamp(0, 1)
    if images.shape[-2:] != (SIZE, SIZE):  # real-model sizes: judge a downsampled copy
        images = torch.nn.functional.interpolate(images, size=(SIZE, SIZE), mode="area")
    target = torch.tensor([parse_prompt(p) for p in prompts])  # (B, 3): shape, fg, bg
    pix = images.flatten(2).transpose(1, 2)  # (B, 1024, 3)
    labels = torch.cdist(pix, PALETTE.expand(len(pix), -1, -1)).argmin(-1)  # (B, 1024)
    counts = torch.nn.functional.one_hot(labels, len(PALETTE)).sum(1)  # (B, 8)
    bg = counts.argmax(1)
    fg = counts.scatter(1, bg[:, None], -1).argmax(1)
    bg_ok, fg_ok = bg == target[:, 2], fg == target[:, 1]

    masks, classes = _templates()
    m = (labels == target[:, 1:2]).float()  # (B, 1024) pixels of the requested fg colour
    inter = m @ masks.T  # (B, T)
    iou = inter / (m.sum(1, keepdim=True) + masks.sum(1) - inter).clamp_min(1)
    best_per_class = torch.stack([iou[:, classes == c].amax(1) for c in range(len(SHAPES))], 1)  # (B, 3)
    shape_pred = best_per_class.argmax(1)
    shape_iou = best_per_class.gather(1, target[:, :1]).squeeze(1)
    best_iou = best_per_class.amax(1)  # best template of any class: how shape-like the drawing is at all
    shape_ok = (shape_pred == target[:, 0]) & (shape_iou >= SHAPE_IOU_MIN)

    is_bg = labels == target[:, 2:3]
    res = (pix - PALETTE[target[:, 2]][:, None]) * is_bg[..., None]  # (B, 1024, 3) background deviation, fg = 0
    n_bg = is_bg.sum(1).clamp_min(1)
    bg_dev = res.abs().mean(-1).sum(1) / n_bg
    stray = 1 - (is_bg | (labels == target[:, 1:2])).float().mean(1)
    periodic = periodic_amplitude(res.transpose(1, 2).reshape(-1, 3, SIZE, SIZE), n_bg)
    clean = (bg_dev <= CLEAN_MAX_DEV) & (stray <= CLEAN_MAX_STRAY) & (periodic <= CLEAN_MAX_PERIODIC)
    return {
        "bg": bg_ok,
        "fg": fg_ok,
        "shape": shape_ok,
        "clean": clean,
        "all": bg_ok & fg_ok & shape_ok & clean,
        "shape_pred": shape_pred,
        "shape_iou": shape_iou,
        "best_iou": best_iou,
        "well_formed": best_iou >= WELL_FORMED_IOU,
        "periodic": periodic,
    }


def periodic_amplitude(residual: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Largest amplitude of a Fourier component with period <= TEXTURE_MAX_PERIOD px, any channel; shape (B,).

    residual (B, 3, 32, 32) is zero outside the background; n (B,) is its background pixel count, so that a
    texture of amplitude a over the whole background scores about a (sine) to 4a/pi (square wave).
    """
    f = torch.fft.fftfreq(SIZE)
    fy, fx = torch.meshgrid(f, f, indexing="ij")
    high = (fx.abs() >= 1 / TEXTURE_MAX_PERIOD - 1e-6) | (fy.abs() >= 1 / TEXTURE_MAX_PERIOD - 1e-6)  # (32, 32)
    amp = torch.fft.fft2(residual).abs() / n.view(-1, 1, 1, 1) * 2  # one-sided amplitude
    return (amp * high).flatten(1).amax(1)


def verifier_reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Non-differentiable reward in [0, 1]: mean of the four verdicts (bg, fg, shape, clean), shape (B,)."""
    v = verify(images, prompts)
    score = (v["bg"].float() + v["fg"].float() + v["shape"].float() + v["clean"].float()) / 4
    return score.to(images.device)


def diversity(images: torch.Tensor, prompts: list[str]) -> float:
    """Mean pairwise RMS pixel distance between samples of the same prompt (0 = collapsed to one image)."""
    by_prompt: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_prompt.setdefault(p, []).append(i)
    dists = []
    for idx in by_prompt.values():
        if len(idx) > 1:
            x = images[idx].flatten(1).float()
            d = torch.cdist(x, x) / x.shape[1] ** 0.5
            dists.append(d[torch.triu_indices(len(idx), len(idx), 1).unbind()].mean())
    return float(torch.stack(dists).mean()) if dists else float("nan")


@functools.lru_cache(maxsize=16)
def renderer_diversity(prompts: tuple[str, ...]) -> float:
    """The diversity a perfect policy shows on these prompts: the expected value of diversity() for renders drawn as
    the world draws them (each radius and centre offset equally likely), exactly, from every pair of draws. Prompts
    given once count for nothing, as in diversity()."""
    draws = list(itertools.product(RADII, range(-JITTER, JITTER + 1), range(-JITTER, JITTER + 1)))
    radius, dx, dy = torch.tensor(draws).unbind(1)
    per_prompt = []
    for p in sorted({p for p in prompts if prompts.count(p) > 1}):
        shape, fg, bg = (torch.full((len(draws),), i) for i in parse_prompt(p))
        x = render(shape, fg, bg, radius, SIZE // 2 + dx, SIZE // 2 + dy).flatten(1)
        per_prompt.append((torch.cdist(x, x) / x.shape[1] ** 0.5).mean())  # over all ordered pairs, itself included
    return float(torch.stack(per_prompt).mean()) if per_prompt else float("nan")


def evaluate(images: torch.Tensor, prompts: list[str], reward=None) -> dict:
    """Held-out metrics for images (N, 3, H, W) in [0, 1]: verifier accuracies, learned reward (a ShapesReward,
    if given), diversity, and diversity kept: the diversity over the renderer's for the same prompts."""
    v = verify(images, prompts)
    out = {f"{k}_acc": v[k].float().mean().item() for k in ("bg", "fg", "shape", "clean", "all")}
    out["colour_acc"] = (v["bg"] & v["fg"]).float().mean().item()
    shape_idx = torch.tensor([parse_prompt(p)[0] for p in prompts])
    for s, name in enumerate(SHAPES):
        out[f"shape_acc_{name}"] = v["shape"][shape_idx == s].float().mean().item()
    out["well_formed_acc"] = v["well_formed"].float().mean().item()
    out["best_iou_median"] = v["best_iou"].median().item()
    # confusion matrix requested -> predicted class (the verifier's shape_pred), as flat scalar counts so that
    # trackers can log it; confusion_matrix() turns it back into rows
    for s, name in enumerate(SHAPES):
        for t, pred in enumerate(SHAPES):
            out[f"confusion_{name}_as_{pred}"] = int(((shape_idx == s) & (v["shape_pred"] == t)).sum())
    if reward is not None:
        out["reward_mean"] = (
            torch.cat([reward(images[i : i + 256], prompts[i : i + 256]) for i in range(0, len(prompts), 256)])
            .mean()
            .item()
        )
    out["diversity"] = diversity(images, prompts)
    out["diversity_kept"] = out["diversity"] / renderer_diversity(tuple(prompts))  # a perfect policy: 1.0
    return out


def confusion_matrix(metrics: dict) -> list[list[int]]:
    """Rows = requested shape, columns = predicted shape (SHAPES order), from evaluate()'s confusion_* counts."""
    key = next(k for k in metrics if k.endswith("confusion_circle_as_circle"))
    prefix = key[: -len("confusion_circle_as_circle")]
    return [[metrics[f"{prefix}confusion_{s}_as_{t}"] for t in SHAPES] for s in SHAPES]
