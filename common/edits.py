"""Edit data: prompts that carry images. An image-editing model (FLUX.1-Kontext, Qwen-Image-Edit, FLUX.2 with
reference images) edits source images as an instruction says; an image-to-video model (Wan I2V) animates a first
frame. Both read an `EditPrompt`: a `str` whose text is the instruction, with the paths of its images beside it.

Being a `str`, an EditPrompt goes wherever a prompt goes (the prompt draw, GRPO's groups, the rewards that read the
text, the logs) unchanged; it equals another only when the text and the images do, so a model encodes each distinct
(instruction, images) pair once. The model kind reads the images when it encodes the prompt
(`FlowModel.encode_prompts`): the condition is part of the prompt's encoding, and every algorithm's rollout, ratio
and loss stay as they are.

An edit file (`--prompts edits.jsonl`) holds one JSON object per line:
    {"instruction": "make the circle blue", "image": "sources/0001.png"}
    {"instruction": "put the cat from the second image on the sofa", "images": ["a.png", "b.png"]}
Relative paths are relative to the file's folder. Every row is checked when the file is read, before any model loads:
the fields, that each image exists, is a readable image (its header) and is at most MAX_IMAGE_PIXELS pixels.
"""

from __future__ import annotations

import json
from pathlib import Path

from common import InputError

MAX_IMAGE_PIXELS = 4096 * 4096  # a larger source image is refused when read (a decompression bomb is refused unread)
FIELDS = ("instruction", "image", "images")


class EditPrompt(str):
    """An instruction (the str's text) with its images (`images`: a tuple of paths; a source image or several
    references for an edit, the first frame for image-to-video)."""

    images: tuple[str, ...]

    def __new__(cls, instruction: str, images):
        self = super().__new__(cls, instruction)
        self.images = tuple(str(p) for p in images)
        if not self.images:
            raise ValueError("an EditPrompt needs at least one image")
        return self

    @property
    def text(self) -> str:
        return str.__str__(self)

    def __eq__(self, other):
        if isinstance(other, EditPrompt):
            return self.text == other.text and self.images == other.images
        return False  # a plain prompt has no images: never the same condition

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash((self.text, self.images))

    def __repr__(self):
        return f"EditPrompt({self.text!r}, images={list(self.images)!r})"

    def __reduce__(self):  # pickling (spawned workers, deepcopy) keeps the images
        return (EditPrompt, (self.text, self.images))

    def load_images(self) -> list:
        """The images as RGB PIL images, each checked again (the file may have changed since start-up)."""
        return [load_image(p, f"prompt {self.text!r}") for p in self.images]


def check_image(path: str | Path, where: str) -> tuple[int, int]:
    """(width, height) of the image at `path`, read from its header: an InputError starting with `where` when the
    file is missing, not an image PIL reads, or over MAX_IMAGE_PIXELS pixels."""
    from PIL import Image, UnidentifiedImageError  # pillow comes with torchvision; here, as --help needs none of it

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{where}: image {path} does not exist")
    try:
        with Image.open(path) as img:
            size = img.size
            if size[0] * size[1] > MAX_IMAGE_PIXELS:
                raise InputError(
                    f"{where}: image {path} is {size[0]}x{size[1]}, over the {MAX_IMAGE_PIXELS} pixels an edit source "
                    "may have; resize it"
                )
            img.verify()
    except InputError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        msg = (str(e).splitlines() or [""])[0][:120]
        raise InputError(f"{where}: {path} is not a readable image ({type(e).__name__}: {msg})") from None
    if min(size) < 1:
        raise InputError(f"{where}: image {path} is empty ({size[0]}x{size[1]})")
    return size


def load_image(path: str | Path, where: str):
    """The image at `path` as an RGB PIL image, checked as check_image checks it."""
    from PIL import Image

    check_image(path, where)
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except OSError as e:  # a truncated body behind a good header
        raise InputError(f"{where}: {path} is not a readable image ({type(e).__name__}: {e})") from None


def centre_square(image, size: int):
    """The largest centred square of a PIL image, resized to size x size (bicubic). The scripts generate squares at
    --resolution, so a source is cut to the frame of its edit: every image of a GRPO group, and every row of a batch,
    then has the same shape (docs/editing.md)."""
    from PIL import Image

    w, h = image.size
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    square = image.crop((left, top, left + side, top + side))
    return square if side == size else square.resize((size, size), Image.BICUBIC)


def cut_to_frame(image, width: int, height: int):
    """The largest centred crop of a PIL image with the frame's aspect, resized to width x height (bicubic):
    centre_square for a square frame, and a video's first frame at its native, wider size (Wan I2V's 832 x 480)."""
    if width == height:
        return centre_square(image, width)
    from PIL import Image

    w, h = image.size
    scale = min(w / width, h / height)  # the largest crop of the frame's aspect inside the image
    cw, ch = max(1, round(width * scale)), max(1, round(height * scale))
    left, top = (w - cw) // 2, (h - ch) // 2
    return image.crop((left, top, left + cw, top + ch)).resize((width, height), Image.BICUBIC)


def is_edit_file(text: str) -> bool:
    """Whether a .jsonl prompt file is an edit file: its first row has an "instruction" field (a GenEval metadata
    file's rows have "prompt")."""
    for line in text.split("\n"):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                return False
            return isinstance(row, dict) and "instruction" in row
    return False


def edit_prompts(text: str, folder: Path, where: str) -> list[EditPrompt]:
    """An edit file's prompts, in order, each row checked (module docstring); `where` (the flag and the file) starts
    every error message, which names the line."""
    prompts = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        at = f"{where}, line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(
                f"{at}: not JSON ({e.msg}, column {e.colno}); an edit file holds one object per line"
            ) from None
        if not isinstance(row, dict):
            raise InputError(f"{at}: a JSON object expected, got {type(row).__name__}")
        if unknown := sorted(set(row) - set(FIELDS)):
            raise InputError(f"{at}: unknown field(s) {unknown}; an edit row has {list(FIELDS)} (image or images)")
        instruction = row.get("instruction")
        if not isinstance(instruction, str) or not instruction.strip():
            raise InputError(f'{at}: "instruction" is missing or not a non-empty string')
        if ("image" in row) == ("images" in row):
            raise InputError(f'{at}: give "image" (one path) or "images" (a list of paths), exactly one of them')
        images = [row["image"]] if "image" in row else row["images"]
        if not isinstance(images, list) or not images or not all(isinstance(p, str) and p for p in images):
            raise InputError(f'{at}: "image" must be a path, "images" a non-empty list of paths')
        paths = [str(Path(p) if Path(p).is_absolute() else folder / p) for p in images]
        for p in paths:
            check_image(p, at)
        prompts.append(EditPrompt(" ".join(instruction.split()), paths))
    return prompts


def check_edit_prompts(prompts: list, images: tuple[int, int], flag: str, model: str) -> None:
    """Each prompt brings between images[0] and images[1] images (the model kind's range: common.models.Kind): a
    text-to-image model (0, 0) gets no edit prompts, an editing model its sources. `flag` and `model` name the prompt
    flag and the model in the one-line error."""
    least, most = images
    for i, p in enumerate(prompts, 1):
        n = len(p.images) if isinstance(p, EditPrompt) else 0
        if most == 0 and n:
            raise InputError(
                f"{flag}: an edit file (prompts with source images), but --model-id {model} makes images from text "
                "alone; give a text prompt file, or a model that edits (FLUX.1-Kontext, Qwen-Image-Edit, FLUX.2, "
                "Wan I2V: docs/editing.md)"
            )
        if n < least:
            raise InputError(
                f"{flag}: prompt {i} brings no image, but --model-id {model} edits (or animates) images: give an edit "
                'file (.jsonl rows {"instruction": ..., "image": PATH}: docs/editing.md)'
            )
        if n > most:
            raise InputError(f"{flag}: prompt {i} brings {n} images; --model-id {model} takes at most {most}")
    counts = {len(p.images) if isinstance(p, EditPrompt) else 0 for p in prompts}
    if least == 0 and len(counts) > 1:  # optional references (FLUX.2): one batch is one token sequence, unpadded
        raise InputError(
            f"{flag}: prompts bring {sorted(counts)} images; --model-id {model} takes references in batches of one "
            "count (its transformer has no mask to pad them with): give every prompt of the file as many images"
        )
