"""ShapesBench-Edit: the edit task of the ShapesBench world and its verifier.

A source is a ShapesBench render ("a {fg} {shape} on a {bg} background", radius 8 or 10, centred); an instruction
changes one attribute of it, and the edit is right when the result is the render of the target caption with the rest
as in the source. Three templates:

    make the {shape} {colour}            recolour the shape        colour != its fg and != the bg
    make the background {colour}         recolour the background   colour != the bg and != the fg
    turn the {shape} into a {shape2}     change the shape          shape2 != shape

so every source has 6 + 6 + 2 = 14 valid instructions. Everything is judged from pixels and the instruction: the
source's caption and radius are read from the source image (read_scene, exact on every clean render), so the RL
scripts only need the EditPrompt's image.

    python -c "from common.shapesbench.edit import write_edit_data; write_edit_data('/tmp/edit')"   # the data alone

The split follows ShapesBench's: the held-out edits are those whose SOURCE caption is one of the 48 held-out prompts
(world.split_prompts("eval")), 48 x 14 x 2 radii = 1344; the other 120 sources give 3360 training edits.
`python -m common.shapesbench.train_edit` writes the data (write_edit_data) and pretrains the edit model.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from common.shapesbench import verifier
from common.shapesbench.world import (
    COLOUR_NAMES,
    PALETTE,
    RADII,
    SHAPES,
    SIZE,
    make_prompt,
    parse_prompt,
    render,
    shape_masks,
)

ATTRIBUTES = ("fg", "bg", "shape")  # what an instruction names: the shape's colour, the background's, the shape
INSTRUCTION_WORDS = ("make", "the", "turn", "into", "a")  # the templates' words besides shapes, colours, "background"
_RECOLOUR = re.compile(r"^make the (\w+) (\w+)$")  # also matches "make the background <colour>"
_RESHAPE = re.compile(r"^turn the (\w+) into a (\w+)$")
# The area of a clean render per squared radius, per shape, from the renderer's pixel counts averaged over RADII
# (circle 208 / 316 px at r 8 / 10, square 196 / 324, triangle 146 / 228): the equivalent radius
# sqrt(area / AREA_PER_R2[shape]) of a clean render is within 1.5% of its radius.
_COUNTS = [
    [int(shape_masks(*torch.tensor([[s], [r], [SIZE // 2], [SIZE // 2]])).sum()) for r in RADII]
    for s in range(len(SHAPES))
]
AREA_PER_R2 = torch.tensor([sum(c / r**2 for c, r in zip(counts, RADII)) / len(RADII) for counts in _COUNTS])  # (3,)
# "size kept": the edited shape's equivalent radius within a factor of sqrt(10 / 8) of the source's radius, i.e. its
# area within a factor 1.25 (0.8 to 1.25 times the area of the edited shape at the source's radius). That is halfway,
# in log scale, between the world's two radii: the other radius is a factor 1.25 in radius (1.5625 in area) away and
# fails, every clean render of the right radius (within 1.5%) passes, and a model drawing at neither radius fails
# when it is nearer to the other one or off the world's sizes altogether.
SIZE_LOG_TOL = math.log(max(RADII) / min(RADII)) / 2


# ---------------------------------------------------------------------------------------------------
# Instructions and targets
# ---------------------------------------------------------------------------------------------------
def _parse(text: str) -> tuple[str, int, int | None]:
    """Instruction -> (attribute, value index, index of the shape it names or None)."""
    t = " ".join(str.__str__(text).strip().lower().split())
    if m := _RECOLOUR.match(t):
        if m[2] in COLOUR_NAMES and m[1] == "background":
            return "bg", COLOUR_NAMES.index(m[2]), None
        if m[2] in COLOUR_NAMES and m[1] in SHAPES:
            return "fg", COLOUR_NAMES.index(m[2]), SHAPES.index(m[1])
    if (m := _RESHAPE.match(t)) and m[1] in SHAPES and m[2] in SHAPES:
        if m[1] == m[2]:
            raise ValueError(f"not a ShapesBench edit: {text!r} turns the {m[1]} into itself")
        return "shape", SHAPES.index(m[2]), SHAPES.index(m[1])
    raise ValueError(
        f"not a ShapesBench edit instruction: {text!r} (expected 'make the <shape> <colour>', 'make the background "
        f"<colour>' or 'turn the <shape> into a <shape>', with shapes {SHAPES} and colours {COLOUR_NAMES})"
    )


def parse_instruction(text: str) -> tuple[str, int]:
    """Instruction -> (attribute "fg" / "bg" / "shape", index of the requested value in COLOUR_NAMES or SHAPES);
    ValueError for any other text."""
    attr, value, _ = _parse(text)
    return attr, value


def make_instruction(attr: str, value: int, shape: int) -> str:
    """The instruction that sets `attr` to `value` on a source whose shape is `shape` (indices)."""
    if attr == "fg":
        return f"make the {SHAPES[shape]} {COLOUR_NAMES[value]}"
    if attr == "bg":
        return f"make the background {COLOUR_NAMES[value]}"
    if attr == "shape":
        return f"turn the {SHAPES[shape]} into a {SHAPES[value]}"
    raise ValueError(f"unknown attribute {attr!r}: use one of {ATTRIBUTES}")


def valid_values(attr: str, shape: int, fg: int, bg: int) -> list[int]:
    """The values an instruction may request for `attr` on the scene (shape, fg, bg): a colour that is neither of the
    scene's (a shape recoloured to the background would vanish), another shape."""
    if attr in ("fg", "bg"):
        return [c for c in range(len(COLOUR_NAMES)) if c not in (fg, bg)]
    if attr == "shape":
        return [s for s in range(len(SHAPES)) if s != shape]
    raise ValueError(f"unknown attribute {attr!r}: use one of {ATTRIBUTES}")


def apply_edit(scene: tuple[int, int, int], attr: str, value: int) -> tuple[int, int, int]:
    """(shape, fg, bg) with `attr` set to `value`."""
    shape, fg, bg = scene
    return {"fg": (shape, value, bg), "bg": (shape, fg, value), "shape": (value, fg, bg)}[attr]


def instructions_for(caption: str) -> list[str]:
    """The 14 valid instructions of a source caption, in the data's fixed order: recolour the shape (colours in
    COLOUR_NAMES order), recolour the background, change the shape (SHAPES order)."""
    shape, fg, bg = parse_prompt(caption)
    return [make_instruction(a, v, shape) for a in ATTRIBUTES for v in valid_values(a, shape, fg, bg)]


def edit_target(source_caption: str, instruction: str) -> str:
    """The caption of the edit's result, "a {fg} {shape} on a {bg} background"; ValueError when the instruction is not
    a ShapesBench edit or does not fit the source (names another shape, or asks for a colour the scene has)."""
    shape, fg, bg = parse_prompt(source_caption)
    attr, value, named = _parse(instruction)
    if named is not None and named != shape:
        raise ValueError(
            f"edit {instruction!r} names a {SHAPES[named]}, but the source is {source_caption!r}: an instruction names "
            "the source's shape"
        )
    if value not in valid_values(attr, shape, fg, bg):
        raise ValueError(
            f"edit {instruction!r} does not fit {source_caption!r}: a new colour must be neither the shape's nor the "
            "background's"
        )
    shape, fg, bg = apply_edit((shape, fg, bg), attr, value)
    return make_prompt(SHAPES[shape], COLOUR_NAMES[fg], COLOUR_NAMES[bg])


# ---------------------------------------------------------------------------------------------------
# Reading a scene from pixels
# ---------------------------------------------------------------------------------------------------
def _prepare(images: torch.Tensor) -> torch.Tensor:
    """(N, 3, 32, 32) float in [0, 1] on the CPU, as verify() judges them (other sizes area-downsampled)."""
    images = images.detach().float().cpu().clamp(0, 1)
    if images.shape[-2:] != (SIZE, SIZE):
        images = torch.nn.functional.interpolate(images, size=(SIZE, SIZE), mode="area")
    return images


@torch.no_grad()
def _read(images: torch.Tensor) -> dict[str, torch.Tensor]:
    """verify()'s reading without a prompt: nearest palette colour per pixel; background = the most frequent
    colour, foreground = the next; shape = the class of the best-IoU template (verifier._templates: every class,
    radius 3-13, centre 6-26) against the foreground-colour pixels; area = their count, and the equivalent radius
    sqrt(area / AREA_PER_R2[shape]). All (N,)."""
    pix = _prepare(images).flatten(2).transpose(1, 2)  # (N, 1024, 3)
    labels = torch.cdist(pix, PALETTE.expand(len(pix), -1, -1)).argmin(-1)  # (N, 1024)
    counts = torch.nn.functional.one_hot(labels, len(PALETTE)).sum(1)  # (N, 8)
    bg = counts.argmax(1)
    fg = counts.scatter(1, bg[:, None], -1).argmax(1)
    masks, classes = verifier._templates()  # (T, 1024), (T,)
    m = (labels == fg[:, None]).float()  # (N, 1024)
    inter = m @ masks.T  # (N, T)
    iou = inter / (m.sum(1, keepdim=True) + masks.sum(1) - inter).clamp_min(1)
    best = torch.stack([iou[:, classes == c].amax(1) for c in range(len(SHAPES))], 1)  # (N, 3)
    shape = best.argmax(1)
    area = m.sum(1)
    return {"shape": shape, "fg": fg, "bg": bg, "area": area, "radius": (area / AREA_PER_R2[shape]).sqrt()}


def read_scene(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(shape, fg, bg) index tensors (N,) of images (N, 3, 32, 32) in [0, 1], read from the pixels as the verifier
    reads them; exact on every clean render of the world."""
    r = _read(images)
    return r["shape"], r["fg"], r["bg"]


def read_radius(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(equivalent radius (N,) float, nearest of RADII in log scale (N,) long) of the foreground shape: the world's
    radius exactly on every clean render."""
    r = _read(images)["radius"]
    radii = torch.tensor(RADII, dtype=torch.float32)
    nearest = radii[(r.clamp_min(1e-6).log()[:, None] - radii.log()).abs().argmin(1)].long()
    return r, nearest


def scene_captions(shape: torch.Tensor, fg: torch.Tensor, bg: torch.Tensor) -> list[str]:
    return [
        make_prompt(SHAPES[s], COLOUR_NAMES[f], COLOUR_NAMES[b])
        for s, f, b in zip(*(t.tolist() for t in (shape, fg, bg)))
    ]


def source_images(prompts) -> torch.Tensor:
    """The source images (N, 3, 32, 32) in [0, 1] of EditPrompts (each with one image), as edit_metrics takes them."""
    import numpy as np  # heavy-ish: only when images are read

    from common.edits import EditPrompt

    out = []
    for p in prompts:
        if not isinstance(p, EditPrompt) or len(p.images) != 1:
            raise ValueError(f"{p!r}: a ShapesBench edit prompt has exactly one source image")
        out.append(torch.from_numpy(np.asarray(p.load_images()[0], dtype=np.float32) / 255.0).permute(2, 0, 1))
    return torch.stack(out)


# ---------------------------------------------------------------------------------------------------
# Metrics and rewards
# ---------------------------------------------------------------------------------------------------
def target_captions(sources: torch.Tensor, instructions: list[str]) -> list[str]:
    """The target caption of each (source image (3, 32, 32), instruction): edit_target of the caption read from the
    source; ValueError when an instruction is not a ShapesBench edit or does not fit its source."""
    if len(sources) != len(instructions):
        raise ValueError(f"{len(sources)} sources for {len(instructions)} instructions")
    return [edit_target(c, i) for c, i in zip(scene_captions(*read_scene(sources)), instructions)]


@torch.no_grad()
def edit_metrics(edited: torch.Tensor, sources: torch.Tensor, instructions: list[str]) -> dict:
    """Judge edited images (N, 3, H, W) in [0, 1] against their sources (N, 3, H, W) and instructions.

    Per image (bool (N,)):
        edit        the target caption passes the ShapesBench verifier (verify()["all"]): the requested value, the
                    other two attributes as in the source, a clean background. It implies changed and kept.
        changed     the named attribute, as read from the pixels (read_scene), has the requested value
        kept        the two attributes the instruction did not name are the source's
        size_kept   the edited shape's equivalent radius is within SIZE_LOG_TOL (log scale) of the source's radius
        clean       the verifier's clean check against the caption read from the edited image itself (a clean
                    two-colour image whatever its colours); well_formed likewise (a shape-like foreground)
    and their means as "<name>_acc" floats, "edit_acc_<attribute>" (edit accuracy per instruction kind, NaN where
    none) and "n". ValueError when an instruction is not a ShapesBench edit or does not fit its source.
    """
    targets = target_captions(sources, instructions)
    parsed = torch.tensor([ATTRIBUTES.index(parse_instruction(i)[0]) for i in instructions])  # (N,) attribute index
    values = torch.tensor([parse_instruction(i)[1] for i in instructions])
    src, out = _read(sources), _read(edited)
    src_read = torch.stack([src["shape"], src["fg"], src["bg"]], 1)[:, [1, 2, 0]]  # (N, 3) in ATTRIBUTES order
    out_read = torch.stack([out["shape"], out["fg"], out["bg"]], 1)[:, [1, 2, 0]]
    named = torch.nn.functional.one_hot(parsed, 3).bool()  # (N, 3)
    changed = out_read.gather(1, parsed[:, None]).squeeze(1) == values
    kept = ((out_read == src_read) | named).all(1)
    _, src_radius = read_radius(sources)
    size_kept = (out["radius"].clamp_min(1e-6) / src_radius).log().abs() <= SIZE_LOG_TOL
    v = verifier.verify(edited, targets)
    own = verifier.verify(edited, scene_captions(out["shape"], out["fg"], out["bg"]))
    res = {
        "edit": v["all"],
        "changed": changed,
        "kept": kept,
        "size_kept": size_kept,
        "clean": own["clean"],
        "well_formed": own["well_formed"],
    }
    means = {f"{k}_acc": x.float().mean().item() for k, x in res.items()}
    for a, name in enumerate(ATTRIBUTES):
        sel = parsed == a
        means[f"edit_acc_{name}"] = v["all"][sel].float().mean().item() if sel.any() else float("nan")
    return {**res, **means, "n": len(instructions)}


def edit_verifier_reward(edited: torch.Tensor, sources: torch.Tensor, instructions: list[str]) -> torch.Tensor:
    """Non-differentiable reward in [0, 1], shape (N,): the ShapesBench verifier_reward of the edited image against
    the TARGET caption, the mean of its four verdicts (bg, fg, shape, clean); 1.0 exactly when edit_metrics' "edit".

    The partial credit is the verifier's: an unchanged source scores 0.25 on a recolour of the shape (the background
    alone is right: no pixels of the new colour, so no shape of it, and the old colour is stray), 0.5 on a recolour
    of the background (the shape and its colour), 0.75 on a change of shape (all but the shape)."""
    return verifier.verifier_reward(edited, target_captions(sources, instructions))


def edit_learned_reward(reward_model, edited: torch.Tensor, sources: torch.Tensor, instructions: list[str]):
    """The learned ShapesBench reward (a reward.ShapesReward) of the edited images (N, 3, H, W) against the TARGET
    captions, shape (N,); differentiable in `edited` (the targets are read from the sources without gradient)."""
    return reward_model(edited, target_captions(sources, instructions))


# ---------------------------------------------------------------------------------------------------
# The data
# ---------------------------------------------------------------------------------------------------
def source_name(caption: str, radius: int) -> str:
    shape, fg, bg = parse_prompt(caption)
    return f"sources/{SHAPES[shape]}_{COLOUR_NAMES[fg]}_{COLOUR_NAMES[bg]}_r{radius}.png"


def render_caption(caption: str, radius: int) -> torch.Tensor:
    """The world's render (3, 32, 32) in [0, 1] of a caption at `radius`, centred."""
    shape, fg, bg = (torch.tensor([i]) for i in parse_prompt(caption))
    return render(shape, fg, bg, torch.tensor([radius]), torch.tensor([SIZE // 2]), torch.tensor([SIZE // 2]))[0]


def edit_rows(split: str) -> list[dict]:
    """The rows of a split's edit file, in its fixed order: sources in world.split_prompts order, then RADII, then
    instructions_for order. Each row: {"instruction": ..., "image": "sources/<shape>_<fg>_<bg>_r<radius>.png"}."""
    from common.shapesbench.world import split_prompts

    return [
        {"instruction": i, "image": source_name(c, r)}
        for c in split_prompts(split)
        for r in RADII
        for i in instructions_for(c)
    ]


EVAL_SUBSET_STRIDE = 7  # 1344 held-out edits -> 192


def eval_subset(rows: list, stride: int = EVAL_SUBSET_STRIDE) -> list:
    """Every `stride`-th row of a split's rows (edit_rows order), the phase moving on by one row per source, so that
    the subset covers each source's 2 x 14 (radius, instruction) slots about equally (a plain every-7th row would only
    ever pick 2 of the 14 instructions, as 7 divides 14). 1344 held-out rows -> 192 (4 per source)."""
    per_source = len(RADII) * 14
    if len(rows) % per_source or per_source % stride:
        raise ValueError(f"eval_subset: {len(rows)} rows are not whole sources of {per_source} rows")
    return [
        rows[k * per_source + (k + stride * j) % per_source]
        for k in range(len(rows) // per_source)
        for j in range(per_source // stride)
    ]


def write_edit_data(folder) -> dict:
    """Write the ShapesBench-Edit data into `folder`: every source once as a lossless PNG (sources/, 168 captions x
    RADII = 336 files), train.jsonl (3360 rows) and eval.jsonl (1344 rows), paths relative to the folder. The bytes are
    the same every run (the renders are exact palette colours, PNG has no timestamp). Returns {split: rows}."""
    from PIL import Image

    from common.shapesbench.world import all_prompts

    folder = Path(folder)
    (folder / "sources").mkdir(parents=True, exist_ok=True)
    for c in all_prompts():
        for r in RADII:
            pixels = (render_caption(c, r) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()  # (32, 32, 3)
            Image.fromarray(pixels, "RGB").save(folder / source_name(c, r), format="PNG", optimize=False)
    rows = {}
    for split in ("train", "eval"):
        rows[split] = edit_rows(split)
        text = "".join(json.dumps(row) + "\n" for row in rows[split])
        (folder / f"{split}.jsonl").write_text(text)
    return rows
