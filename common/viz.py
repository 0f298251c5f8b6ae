"""Picture helpers: a captioned PNG grid of samples, with an optional pass / fail badge under each image, and the
same grid of videos as an animated GIF."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from common import write_atomically


def save_grid(
    path: str | Path,
    images: torch.Tensor,
    captions: list[str],
    ok: list[bool] | None = None,
    ncol: int = 8,
    cell: int = 128,
    title: str = "",
    flag: str = "--output-dir",
    within: Path | None = None,
) -> Path:
    """Write images (N, 3, H, W) in [0, 1] as a grid PNG, each cell `cell` px wide with its caption below.

    `ok` draws a badge between each image and its caption, "pass" on green or "fail" on red (e.g. the verifier's
    verdict), apart from the image so that it stays visible on any background colour; say what it means in `title`.
    Captions may hold several lines (prompt, reward); long lines are wrapped to the cell width. Written whole or not
    at all (write_atomically: what is in the way names `flag`; no link below `within` is written through).
    """
    image = grid_image(images, captions, ok, ncol, cell, title)
    return write_atomically(Path(path), lambda tmp: image.save(tmp, format="PNG"), flag, "the sample grid", within)


def save_video_grid(
    path: str | Path,
    videos: torch.Tensor,
    captions: list[str],
    fps: int = 16,
    ncol: int = 8,
    cell: int = 128,
    title="",
    flag: str = "--output-dir",
    within: Path | None = None,
) -> Path:
    """Write videos (N, F, 3, H, W) in [0, 1] as one animated GIF of the save_grid layout, `fps` frames a second
    (Wan2.1 makes 16), looping."""
    frames = [grid_image(videos[:, f], captions, None, ncol, cell, title) for f in range(videos.shape[1])]

    def save(tmp: Path) -> None:
        frames[0].save(tmp, format="GIF", save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0)

    return write_atomically(Path(path), save, flag, "the sample grid", within)


def grid_image(images, captions, ok=None, ncol=8, cell=128, title="") -> Image.Image:
    """The save_grid picture: cells `cell` px wide, as high as the images' aspect ratio makes them."""
    n = len(images)
    ncol = max(1, min(ncol, n))
    nrow = (n + ncol - 1) // ncol
    font = ImageFont.load_default(size=11)
    chars = max(8, cell // 6)
    wrapped = ["\n".join(textwrap.fill(line, chars) for line in c.split("\n")) for c in captions]
    badge = 14 if ok is not None else 0
    text_h = 13 * max(c.count("\n") + 1 for c in wrapped) + 4 + badge
    pad, top = 4, (18 if title else 0)
    cell_h = round(cell * images.shape[-2] / images.shape[-1])  # Wan2.1's 480 x 832 videos are wider than high
    grid = Image.new("RGB", (ncol * (cell + pad) + pad, top + nrow * (cell_h + text_h + pad) + pad), "white")
    draw = ImageDraw.Draw(grid)
    if title:
        draw.text((pad, 3), title, fill="black", font=font)
    pixels = (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
    for i in range(n):
        r, c = divmod(i, ncol)
        x0, y0 = pad + c * (cell + pad), top + pad + r * (cell_h + text_h + pad)
        grid.paste(Image.fromarray(pixels[i]).resize((cell, cell_h), Image.NEAREST), (x0, y0))
        if ok is not None:
            draw.rectangle(
                [x0, y0 + cell_h + 1, x0 + cell - 1, y0 + cell_h + badge - 1],
                fill=(30, 150, 60) if ok[i] else (200, 30, 30),
            )
            draw.text((x0 + 3, y0 + cell_h + 1), "pass" if ok[i] else "fail", fill="white", font=font)
        draw.multiline_text((x0, y0 + cell_h + 2 + badge), wrapped[i], fill="black", font=font, spacing=1)
    return grid
