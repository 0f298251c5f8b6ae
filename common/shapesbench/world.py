"""The ShapesBench world: palette, prompts, the fixed train / held-out split, the renderer, and the corruptions
(periodic texture, blur, blob) that a learned reward must rank below a clean render."""

from __future__ import annotations

import math
import re

import torch

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
# The world drawn by the renderer and learned by the base model: two sizes, centred. A simple world keeps the tiny
# base model's shapes crisp (with radii 6-10 and +-3 px offsets it drew blobs); the room for RL comes from its
# imperfect prompt following instead (pretraining captions name the wrong shape 35% of the time).
RADII = (8, 10)  # shape "radius" in pixels, drawn uniformly per image
JITTER = 0  # centre = 16 +- JITTER pixels on each axis
TEXTURE_MAX_PERIOD = 8  # periodic textures of period 2..8 px: what the clean check catches and the reward ranks low

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
# Corruptions: what a learned reward must rank below the clean image (training negatives and tests)
# ---------------------------------------------------------------------------------------------------
def periodic_texture(images: torch.Tensor, g: torch.Generator, amp=(0.03, 0.1), period=(2, TEXTURE_MAX_PERIOD)):
    """images (N, 3, H, W) plus a square-wave texture over the whole image: vertical, horizontal or diagonal
    stripes or a checkerboard, period drawn from `period` px, peak amplitude from `amp`, a random colour
    direction and phase per image; clamped to [0, 1]."""
    n, _, h, w = images.shape
    y, x = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
    a = amp[0] + (amp[1] - amp[0]) * torch.rand(n, generator=g)
    k = 2 * math.pi / torch.randint(period[0], period[1] + 1, (n,), generator=g).float().view(-1, 1, 1)
    kind = torch.randint(0, 4, (n,), generator=g)
    phase = 2 * math.pi * torch.rand(n, generator=g).view(-1, 1, 1)
    direction = torch.stack([x, y, x + y])[kind.clamp(max=2)]  # (N, H, W)
    stripes = torch.sin(k * direction + phase)
    checker = torch.sin(k * x + phase) * torch.sin(k * y + phase)
    pattern = torch.where((kind == 3).view(-1, 1, 1), checker, stripes).sign()  # (N, H, W) in {-1, 0, 1}
    colour = torch.rand(n, 3, 1, 1, generator=g) * 2 - 1
    colour = colour / colour.abs().amax(1, keepdim=True)  # the largest channel moves by the full amplitude
    return (images + a.view(-1, 1, 1, 1) * colour * pattern.unsqueeze(1)).clamp(0, 1)


def blur(images: torch.Tensor, g: torch.Generator, sigma=(0.7, 1.5)) -> torch.Tensor:
    """Gaussian blur of images (N, 3, H, W), standard deviation drawn per image from `sigma` px."""
    s = sigma[0] + (sigma[1] - sigma[0]) * torch.rand(len(images), generator=g)
    r = torch.arange(-3, 4).float()
    k = torch.exp(-(r**2) / (2 * s.view(-1, 1) ** 2))
    k = (k / k.sum(1, keepdim=True)).repeat_interleave(3, 0)  # (3N, 7): one kernel per image and channel
    x = torch.nn.functional.pad(images.reshape(1, -1, *images.shape[-2:]), (3, 3, 3, 3), mode="replicate")
    x = torch.nn.functional.conv2d(x, k.view(-1, 1, 1, 7), groups=len(k))
    x = torch.nn.functional.conv2d(x, k.view(-1, 1, 7, 1), groups=len(k))
    return x.view_as(images)


def blob(prompts: list[str], g: torch.Generator, radii: tuple[int, ...] | None = None) -> torch.Tensor:
    """Renders of each prompt's colours with a blob instead of the shape: a centred star-shaped region whose
    radius wobbles with the angle, r(theta) = r0 (1 + sum_k a_k cos(k theta + phi_k)), k = 2..4, a_k in
    [0.08, 0.2], the look of an under-trained base model. Shape (N, 3, 32, 32)."""
    n = len(prompts)
    _, fg, bg = torch.tensor([parse_prompt(p) for p in prompts]).unbind(1)
    coords = torch.arange(SIZE, dtype=torch.float32) + 0.5 - SIZE / 2
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    theta, rho = torch.atan2(y, x), (x**2 + y**2).sqrt()
    radii = RADII if radii is None else radii
    r0 = torch.tensor(radii, dtype=torch.float32)[torch.randint(len(radii), (n,), generator=g)].view(-1, 1, 1)
    wobble = torch.zeros(n, SIZE, SIZE)
    for k in (2, 3, 4):
        a = 0.08 + 0.12 * torch.rand(n, 1, 1, generator=g)
        wobble = wobble + a * torch.cos(k * theta + 2 * math.pi * torch.rand(n, 1, 1, generator=g))
    mask = (rho <= r0 * (1 + wobble)).unsqueeze(1)
    return torch.where(mask, PALETTE[fg].view(-1, 3, 1, 1), PALETTE[bg].view(-1, 3, 1, 1))
