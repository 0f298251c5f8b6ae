"""ShapesBench: an offline text-to-image world small enough to train, sample and RL-tune on a laptop CPU.

Prompts are "a {fg} {shape} on a {bg} background" (3 shapes x 8 colours x 7 background colours = 168).
Images are 32x32 RGB, hard-edged (every pixel is exactly a palette colour), with the shape's size and
position drawn at random, so samples of one prompt can and should differ.

This file holds the world itself:
  * the palette, prompts, the fixed train / held-out eval split and the procedural renderer;
  * the programmatic verifier (the GenEval of ShapesBench): background colour, foreground colour,
    shape (best-IoU template), and background cleanliness, used as the held-out metric;
  * the builders of the tiny model components (tokenizer, CLIP text encoder, SD3 transformer,
    CLIP reward model) that `scripts/train_shapes_flow.py` and `scripts/train_shapes_reward.py` train
    and that are shipped in `common/assets/`;
  * the learned reward (the HPS of ShapesBench): cosine similarity of a tiny CLIP trained
    contrastively on clean images only, so that a texture painted over the background is out of its
    distribution rather than a shortcut (a reward trained otherwise scored a periodic texture highly);
  * `python -m common.shapes eval`: samples the shipped model on the held-out prompts and prints JSON.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import time
from pathlib import Path

import torch

from common import InputError

ASSETS = Path(__file__).resolve().parent / "assets"
FLOW_PATH = ASSETS / "shapes-flow"
REWARD_PATH = ASSETS / "shapes-reward"

SIZE = 32
SHAPES = ("circle", "square", "triangle")
COLOURS = {  # RGB in [0, 255]; far apart so that nearest-palette labelling is unambiguous
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 215, 40),
    "purple": (140, 60, 190),
    "orange": (245, 140, 30),
    "white": (245, 245, 245),
    "black": (25, 25, 25),
}
COLOUR_NAMES = tuple(COLOURS)
PALETTE = torch.tensor(list(COLOURS.values()), dtype=torch.float32) / 255.0  # (8, 3) in [0, 1]
RADII = (6, 7, 8, 9, 10)  # shape "radius" in pixels, drawn uniformly per image
JITTER = 3  # centre = 16 +- JITTER pixels on each axis
# The verifier's template bank is wider than the data, so off-distribution samples still get a shape.
TEMPLATE_RADII = tuple(range(3, 14))
TEMPLATE_CENTRES = tuple(range(6, 27))
SHAPE_IOU_MIN = 0.6  # a shape counts as correct only if its best template of the right class fits this well
# "well formed": the best template of ANY class fits the requested-colour pixels this well. 0.6 cannot tell a
# blob from a shape (the shipped base model's blobs pass it 92% of the time); 0.85 does (blobs 2%, renders 100%).
WELL_FORMED_IOU = 0.85
CLEAN_MAX_DEV = 0.08  # mean |pixel - palette background| over background pixels
CLEAN_MAX_STRAY = 0.03  # fraction of pixels that are neither the background nor the foreground colour

PROMPT_RE = re.compile(r"^a (\w+) (\w+) on a (\w+) background$")


def make_prompt(shape: str, fg: str, bg: str) -> str:
    return f"a {fg} {shape} on a {bg} background"


def parse_prompt(prompt: str) -> tuple[int, int, int]:
    """Prompt -> (shape index, fg colour index, bg colour index); ValueError for a non-ShapesBench prompt."""
    m = PROMPT_RE.match(prompt.strip().lower())
    if not m or m[2] not in SHAPES or m[1] not in COLOURS or m[3] not in COLOURS:
        raise ValueError(
            f"not a ShapesBench prompt: {prompt!r} (expected 'a <colour> <shape> on a <colour> background' "
            f"with shapes {SHAPES} and colours {COLOUR_NAMES}); the verifier and the learned ShapesBench "
            "reward only score ShapesBench prompts: choose another --reward or --prompts"
        )
    return SHAPES.index(m[2]), COLOUR_NAMES.index(m[1]), COLOUR_NAMES.index(m[3])


def all_prompts() -> list[str]:
    return [make_prompt(s, fg, bg) for s in SHAPES for fg in COLOUR_NAMES for bg in COLOUR_NAMES if fg != bg]


def split_prompts(split: str) -> list[str]:
    """Fixed split: per shape, 16 of the 56 colour pairs are held out for evaluation (48 eval, 120 train).

    The rule is arithmetic (no RNG) so it can never change between library versions. The base model is
    pretrained on all 168 captions (it is "the pretrained model"); RL trains on `train` only.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"unknown ShapesBench split {split!r}: use 'train' or 'eval'")
    out = []
    for s, shape in enumerate(SHAPES):
        pairs = [(fg, bg) for fg in COLOUR_NAMES for bg in COLOUR_NAMES if fg != bg]
        for k, (fg, bg) in enumerate(pairs):
            held_out = (3 * k + s) % 7 < 2
            if held_out == (split == "eval"):
                out.append(make_prompt(shape, fg, bg))
    return out


# ---------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------
def shape_masks(shape: torch.Tensor, radius: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor) -> torch.Tensor:
    """Binary masks (N, 32, 32) for N shapes given as index / radius / centre tensors of shape (N,)."""
    coords = torch.arange(SIZE, dtype=torch.float32) + 0.5  # pixel centres
    y, x = coords.view(1, SIZE, 1), coords.view(1, 1, SIZE)
    r, cx, cy = radius.float().view(-1, 1, 1), cx.float().view(-1, 1, 1), cy.float().view(-1, 1, 1)
    circle = (x - cx) ** 2 + (y - cy) ** 2 <= r**2
    square = torch.maximum((x - cx).abs(), (y - cy).abs()) <= 0.85 * r
    # upward triangle: apex at cy - r, base at cy + r, half-width growing linearly to 1.15 r at the base
    top = cy - r
    triangle = (y >= top) & (y <= cy + r) & ((x - cx).abs() <= 1.15 * r * (y - top) / (2 * r))
    s = shape.view(-1, 1, 1)
    return torch.where(s == 0, circle, torch.where(s == 1, square, triangle))


def render(shape, fg, bg, radius, cx, cy) -> torch.Tensor:
    """Ground-truth images (N, 3, 32, 32) in [0, 1]; all arguments are index / pixel tensors of shape (N,)."""
    mask = shape_masks(shape, radius, cx, cy).unsqueeze(1)  # (N, 1, H, W)
    return torch.where(mask, PALETTE[fg].view(-1, 3, 1, 1), PALETTE[bg].view(-1, 3, 1, 1))


def sample_batch(
    n: int,
    generator: torch.Generator,
    prompts: list[str] | None = None,
    radii: tuple[int, ...] | None = None,
    jitter: int | None = None,
):
    """n random ground-truth (images (n,3,32,32), prompts); captions drawn from `prompts` (default all 168).
    `radii` / `jitter` override the world's RADII / JITTER (sizes and centre offsets drawn uniformly)."""
    prompts = prompts or all_prompts()
    radii = tuple(RADII if radii is None else radii)
    jitter = JITTER if jitter is None else jitter
    idx = torch.randint(len(prompts), (n,), generator=generator)
    chosen = [prompts[i] for i in idx.tolist()]
    shape, fg, bg = torch.tensor([parse_prompt(p) for p in chosen]).unbind(1)
    radius = torch.tensor(radii)[torch.randint(len(radii), (n,), generator=generator)]
    cx, cy = (SIZE // 2 + torch.randint(-jitter, jitter + 1, (2, n), generator=generator)).unbind(0)
    return render(shape, fg, bg, radius, cx, cy), chosen


# ---------------------------------------------------------------------------------------------------
# Programmatic verifier
# ---------------------------------------------------------------------------------------------------
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
    background pixels sit close to their palette colour and few pixels are neither colour, which is
    what catches the high-frequency textures a learned reward can be fooled by.
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
    dev = (pix - PALETTE[target[:, 2]][:, None]).abs().mean(-1)  # (B, 1024)
    bg_dev = (dev * is_bg).sum(1) / is_bg.sum(1).clamp_min(1)
    stray = 1 - (is_bg | (labels == target[:, 1:2])).float().mean(1)
    clean = (bg_dev <= CLEAN_MAX_DEV) & (stray <= CLEAN_MAX_STRAY)
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
    }


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


# ---------------------------------------------------------------------------------------------------
# Tiny model components (built here, trained by scripts/, shipped in common/assets/)
# ---------------------------------------------------------------------------------------------------
BOS, EOS, UNK = "<|startoftext|>", "<|endoftext|>", "<unk>"
MAX_TOKENS = 12  # bos + 7 words + eos fits; longer prompts are truncated


def build_tokenizer():
    """A word-level tokenizer over the ShapesBench vocabulary, built offline in memory (no merges to clash)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["a", "an", "on", "background", *SHAPES, *COLOUR_NAMES]
    vocab = {t: i for i, t in enumerate([BOS, EOS, UNK, *words])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single=f"{BOS} $A {EOS}", special_tokens=[(BOS, 0), (EOS, 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=BOS, eos_token=EOS, pad_token=EOS, unk_token=UNK, model_max_length=MAX_TOKENS
    )


def _text_config(vocab_size: int, hidden: int):
    from transformers import CLIPTextConfig

    # eos_token_id != 2 makes CLIP pool at the first EOS (pad == EOS, so that is the real end of the prompt)
    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=MAX_TOKENS,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        projection_dim=hidden,
    )


def build_flow_components(seed: int = 0, heads: int = 2, layers: int = 4):
    """Randomly initialised (tokenizer, CLIPTextModel, SD3Transformer2DModel) for the ShapesBench flow model.

    The transformer is the class SD3 uses, in pixel space: 3 channels, patch 4 -> 8x8 = 64 tokens,
    width 64 * heads, `layers` joint blocks (defaults: width 128, 4 blocks, about 2.3M parameters; the ShapesBench
    v2 candidate: 3 heads, 5.1M).
    """
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextModel

    torch.manual_seed(seed)
    tok = build_tokenizer()
    text_encoder = CLIPTextModel(_text_config(len(tok), 64))
    transformer = SD3Transformer2DModel(
        sample_size=SIZE,
        patch_size=4,
        in_channels=3,
        out_channels=3,
        num_layers=layers,
        attention_head_dim=64,
        num_attention_heads=heads,
        joint_attention_dim=64,
        caption_projection_dim=64 * heads,
        pooled_projection_dim=64,
        pos_embed_max_size=SIZE // 4,
    )
    return tok, text_encoder, transformer


def build_reward_components(seed: int = 0):
    """Randomly initialised (tokenizer, CLIPModel) for the learned reward: ViT patch 4 on 32x32, width 64."""
    from transformers import CLIPConfig, CLIPModel, CLIPVisionConfig

    torch.manual_seed(seed)
    tok = build_tokenizer()
    text = _text_config(len(tok), 64)
    vision = CLIPVisionConfig(
        image_size=SIZE,
        patch_size=4,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        projection_dim=64,
    )
    config = CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=64)
    return tok, CLIPModel(config)


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
    from transformers import AutoTokenizer, CLIPModel

    path = Path(path or REWARD_PATH)
    if not (path / "model" / "config.json").exists():
        raise InputError(
            f"--reward-ckpt shapes={path}: no ShapesBench reward model there (expected model/ and tokenizer/); "
            "retrain it with `python scripts/train_shapes_reward.py`"
        )
    try:
        return ShapesReward(
            AutoTokenizer.from_pretrained(path / "tokenizer"), CLIPModel.from_pretrained(path / "model"), device
        )
    except Exception as e:  # damaged or foreign files in a folder shaped like a checkpoint
        raise InputError(
            f"--reward-ckpt shapes={path}: not a ShapesBench reward model ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''})"
        ) from None


# ---------------------------------------------------------------------------------------------------
# `python -m common.shapes eval`
# ---------------------------------------------------------------------------------------------------
def sigma_schedule(steps: int, shift: float = 3.0) -> torch.Tensor:
    """linspace(1, 0, steps + 1) shifted by s' = k s / (1 + (k - 1) s) (docs/math.md); shape (steps + 1,)."""
    s = torch.linspace(1, 0, steps + 1)
    return shift * s / (1 + (shift - 1) * s)


@torch.no_grad()
def sample_ode(
    model,
    prompts: list[str],
    seed: int,
    steps: int = 20,
    guidance_scale: float = 1.0,
    batch_size: int = 64,
    transformer=None,
) -> torch.Tensor:
    """Euler ODE samples of `model` (a common.models.FlowModel), one initial noise per prompt from `seed`."""
    transformer = transformer or model.transformer
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((len(prompts), *model.latent_shape()), generator=g)
    sigmas = sigma_schedule(steps)
    out = []
    for i in range(0, len(prompts), batch_size):
        cond = model.encode_prompts(prompts[i : i + batch_size])
        x = noise[i : i + batch_size].to(model.transformer.device)
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            v = model.velocity(transformer, x, s.expand(len(x)).to(x.device), cond, guidance_scale)
            x = x + (s_next - s) * v
        out.append(model.decode(x).float().cpu())
    return torch.cat(out)


def evaluate(images: torch.Tensor, prompts: list[str], reward: ShapesReward | None = None) -> dict:
    """Held-out metrics for images (N, 3, H, W) in [0, 1]: verifier accuracies, learned reward, diversity."""
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
    return out


def confusion_matrix(metrics: dict) -> list[list[int]]:
    """Rows = requested shape, columns = predicted shape (SHAPES order), from evaluate()'s confusion_* counts."""
    key = next(k for k in metrics if k.endswith("confusion_circle_as_circle"))
    prefix = key[: -len("confusion_circle_as_circle")]
    return [[metrics[f"{prefix}confusion_{s}_as_{t}"] for t in SHAPES] for s in SHAPES]


def _eval_cli(args) -> None:
    from common.models import load_model

    torch.set_num_threads(args.threads or torch.get_num_threads())
    model = load_model(args.model_id)
    name = str(args.model_id)
    if args.trained:  # a run's final/: transformer/ (full fine-tuning) or SD3-format LoRA weights
        trained = Path(args.trained)
        if (trained / "transformer").is_dir():
            from diffusers import SD3Transformer2DModel

            model.transformer = SD3Transformer2DModel.from_pretrained(trained / "transformer")
        elif (trained / "pytorch_lora_weights.safetensors").is_file():
            model.transformer.load_lora_adapter(str(trained), prefix="transformer", use_safetensors=True)
        else:
            raise SystemExit(
                f"--trained {trained}: expected a run's final/ folder with transformer/ or "
                "pytorch_lora_weights.safetensors"
            )
        name = f"{name} + {trained}"
    prompts = [p for p in split_prompts(args.split) for _ in range(args.samples_per_prompt)]
    t0 = time.perf_counter()
    images = sample_ode(model, prompts, args.seed, args.steps, args.guidance_scale)
    seconds = time.perf_counter() - t0
    result = {
        "model_id": name,
        "split": args.split,
        "n": len(prompts),
        "steps": args.steps,
        "guidance_scale": args.guidance_scale,
        "seed": args.seed,
        **(metrics := evaluate(images, prompts, load_reward_model())),
        "confusion": {"rows_requested_cols_predicted": list(SHAPES), "matrix": confusion_matrix(metrics)},
        "sampling_seconds": round(seconds, 2),
    }
    print(json.dumps(result, indent=1))
    if args.grid:  # the first sample of every prompt, so that all three shapes appear
        from common.viz import save_grid

        pick = list(range(0, len(prompts), args.samples_per_prompt))[: args.grid_n]
        ok = verify(images[pick], [prompts[i] for i in pick])["all"].tolist()
        save_grid(
            args.grid,
            images[pick],
            [prompts[i].removeprefix("a ").removesuffix(" background") for i in pick],
            ok=ok,
            ncol=8,
            title=f"{name}: held-out prompts, Euler {args.steps} steps, badge = verifier verdict (right colours, shape, clean background)",
        )
        print(f"grid written to {args.grid}")


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog="python -m common.shapes", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser(
        "eval", help="sample the model on held-out prompts; print verifier accuracies and the learned reward as JSON"
    )
    e.add_argument(
        "--model-id", default="shapesbench", help="flow model: 'shapesbench' (the shipped one) or a local folder"
    )
    e.add_argument(
        "--trained", default="", help="a run's final/ folder (full or LoRA weights) to load on top of --model-id"
    )
    e.add_argument("--split", default="eval", choices=["eval", "train"])
    e.add_argument("--samples-per-prompt", type=int, default=4)
    e.add_argument("--steps", type=int, default=20, help="Euler ODE steps (shifted schedule, shift 3)")
    e.add_argument("--guidance-scale", type=float, default=1.0, help="classifier-free guidance (1 = off)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    e.add_argument(
        "--grid", default="", help="also write a PNG grid (first sample of each prompt) with the verifier's verdicts"
    )
    e.add_argument("--grid-n", type=int, default=48)
    args = p.parse_args()
    _eval_cli(args)
