"""GenEval (arXiv 2310.11513): whether an image shows the objects, counts, colours and positions its prompt asks for,
as a per-image yes or no (the evaluation) and as Flow-GRPO's partial credit (`--reward geneval`, the training reward).

The rules are the official evaluator's (djghosh13/geneval `evaluation/evaluate_images.py` at af4902f) and the
partial score is Flow-GRPO's reward server's (yifan123/reward-server `reward_server/gen_eval.py` at 92ac29f,
`evaluate_reward`, L201-264; DiffusionNFT's `flow_grpo/gen_eval.py` is the same). docs/evaluate.md sets them side by
side; in short:

- a detection is kept when its score is strictly above 0.3 (0.9 for a counting prompt), compared in float32 as the
  detector's scores are; then the 16 best of each class (the official's `max_overlap` 1.0 removes no overlapping box);
- the evaluation: an include clause needs at least `count` kept objects of its class; its colour, the `count` best
  of them all of that colour (CLIP on each crop); its position, each of them in the relation to each object of the
  clause it refers to; an exclude clause fails on `count` or more kept objects of its class; the image is correct
  when every clause holds;
- the partial score: the mean of per-clause terms `1 - |count - n| / count` over *all* kept objects, exact counts
  for the strict flag, exclude clauses ignored, and a wrong position still adding 0.0 and 1.0 (so a position prompt
  with the objects right and the relation wrong scores 0.75). Unclipped: 16 kept objects for a one-object clause
  give -14, as the official.

The prompt carries its metadata: GenEval's prompts come from six fixed templates over COCO's 80 classes, 10 colours
and 4 relations (its `prompts/create_prompts.py`), so `geneval_metadata(prompt)` rebuilds the row the generator wrote
for it, and a metadata file is checked row by row against it when read (common.prompts). A served reward or a plain
prompt file needs no side channel.

The detector and the colour classifier (`load_geneval`) are below the rules.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import numpy as np

from common import InputError

# GenEval's `evaluation/object_names.txt`: COCO's 80 thing classes in the detector's label order
CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow", "elephant",
    "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard",
    "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange", "broccoli",
    "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant", "bed", "dining table", "toilet",
    "tv", "laptop", "computer mouse", "tv remote", "computer keyboard", "cell phone", "microwave", "oven", "toaster",
    "sink", "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)  # fmt: skip
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
THRESHOLD, COUNTING_THRESHOLD = 0.3, 0.9  # the official's defaults (its --options threshold=, counting_threshold=)
MAX_OBJECTS = 16  # kept per class, best first
POSITION_MARGIN = 0.1  # the official's position_threshold: each box's size times this is forgiven on each axis

Colours = Callable[[str, list], list[str]]  # (class, kept objects) -> one of COLORS per object


# ---------------------------------------------------------------- prompts <-> metadata
def _article(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"  # the generator's rule: a vowel letter takes "an"


def _plural(name: str) -> str:
    return f"{name}es" if name.endswith("s") else f"{name}s"  # the generator's rule ("skises", "wine glasses")


_OBJECT = {_article(c): c for c in CLASSES}  # "an apple" -> apple
_COLOURED = {f"{_article(k)} {c}": (k, c) for k in COLORS for c in CLASSES}  # "an orange car" -> (orange, car)
_COUNTED = {f"{NUMBERS[n]} {_plural(c)}": (n, c) for n in range(2, len(NUMBERS)) for c in CLASSES}
PREFIX = "a photo of "


def _parses(rest: str) -> list[dict]:
    """Every reading of a prompt (less "a photo of ") under the generator's six templates."""
    out = []
    if rest in _OBJECT:
        out.append({"tag": "single_object", "include": [{"class": _OBJECT[rest], "count": 1}]})
    if rest in _COUNTED:
        n, c = _COUNTED[rest]
        out.append(
            {"tag": "counting", "include": [{"class": c, "count": n}], "exclude": [{"class": c, "count": n + 1}]}
        )
    if rest in _COLOURED:
        k, c = _COLOURED[rest]
        out.append({"tag": "colors", "include": [{"class": c, "count": 1, "color": k}]})
    for cut in _cuts(rest, " and "):
        a, b = rest[:cut], rest[cut + 5 :]
        if a in _OBJECT and b in _OBJECT:
            out.append({"tag": "two_object", "include": [{"class": _OBJECT[x], "count": 1} for x in (a, b)]})
        if a in _COLOURED and b in _COLOURED:
            clauses = [{"class": _COLOURED[x][1], "count": 1, "color": _COLOURED[x][0]} for x in (a, b)]
            out.append({"tag": "color_attr", "include": clauses})
    for relation in RELATIONS:
        word = f" {relation} "
        for cut in _cuts(rest, word):
            a, b = rest[:cut], rest[cut + len(word) :]
            if a in _OBJECT and b in _OBJECT:  # the generator lists the reference object (b) first
                include = [
                    {"class": _OBJECT[b], "count": 1},
                    {"class": _OBJECT[a], "count": 1, "position": [relation, 0]},
                ]
                out.append({"tag": "position", "include": include})
    return out


def _cuts(text: str, word: str) -> list[int]:
    cuts, at = [], text.find(word)
    while at >= 0:
        cuts.append(at)
        at = text.find(word, at + 1)
    return cuts


def geneval_metadata(prompt: str) -> dict | None:
    """The metadata row GenEval's generator writes for `prompt` (tag, include, exclude for counting, prompt), as
    plain JSON types; None when the prompt is not one of its templates, or reads two ways."""
    if not prompt.startswith(PREFIX):
        return None
    readings = _parses(prompt[len(PREFIX) :])
    if len(readings) != 1:
        return None
    return {**readings[0], "prompt": prompt}


def check_metadata(row, where: str) -> dict:
    """A metadata row read from a file (`where`: the flag, the file and the line): a JSON object with the fields
    GenEval's evaluator reads ('tag', 'include', 'prompt'; 'exclude' when counting) equal to what the prompt's
    template says; InputError otherwise, naming what differs."""
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
        raise InputError(f"{where}: expected a JSON object with a 'prompt' string, got {json.dumps(row)[:120]}")
    missing = [k for k in ("tag", "include") if k not in row]
    if missing:
        raise InputError(f"{where}: the row has no {' or '.join(repr(k) for k in missing)} field")
    expected = geneval_metadata(row["prompt"])
    if expected is None:
        raise InputError(
            f"{where}: prompt {row['prompt']!r} is not one of GenEval's templates (e.g. 'a photo of two cats', "
            "'a photo of a red car and a blue bench'), so its objects cannot be checked"
        )
    got = {k: row[k] for k in ("tag", "include", "exclude") if k in row}
    want = {k: v for k, v in expected.items() if k != "prompt"}
    if json.loads(json.dumps(got)) != want:  # tuples -> lists, as JSON holds them
        raise InputError(f"{where}: the row says {json.dumps(got)}, but its prompt asks for {json.dumps(want)}")
    return expected


# ---------------------------------------------------------------- which detections count
def keep_detections(boxes: Sequence[np.ndarray], tag: str, masks: Sequence | None = None) -> dict[str, list]:
    """The detector's output -> the objects GenEval looks at: per class name, [(box (5,) float32 x1,y1,x2,y2,score,
    mask or None), ...] best first. `boxes[i]`: (n_i, 5) float32 for class CLASSES[i], as mmdet returns them;
    `masks[i]`: the matching (n_i, H, W) bool masks, or None. Kept: scores strictly above the threshold (0.9 for a
    counting prompt), compared in float32; then the 16 best. Classes with nothing kept are absent.
    (*) numpy's default sort is not stable, and which of two equal scores comes first depends on the CPU's vector
    instructions (AVX-512 or not): so it does for the official evaluator, which this matches on the same machine."""
    threshold = np.float32(COUNTING_THRESHOLD if tag == "counting" else THRESHOLD)
    kept = {}
    for index, name in enumerate(CLASSES):
        scores = np.asarray(boxes[index], dtype=np.float32).reshape(-1, 5)[:, 4]
        order = np.argsort(scores)[::-1]  # best first; ties in numpy's default sort's order, as the official's (*)
        order = order[scores[order] > threshold][:MAX_OBJECTS]
        if len(order):
            kept[name] = [(boxes[index][i], None if masks is None else masks[index][i]) for i in order]
    return kept


# ---------------------------------------------------------------- the rules
def relative_position(box_a: np.ndarray, box_b: np.ndarray) -> set[str]:
    """Where box A is relative to box B, in float32 as the official computes it: the offset between the centres,
    shrunk toward zero on each axis by POSITION_MARGIN x the sum of the two sizes; both shrunk offsets under 1e-3:
    no relation; else each axis of the shrunk offset over the original offset's length beyond +-0.5 gives one
    relation (y grows downward, so 'below' is +y). Two can hold at once ('left of' and 'above')."""
    boxes = np.array([box_a[:4], box_b[:4]], dtype=np.float32).reshape(2, 2, 2)  # (box, corner, xy)
    centre_a, centre_b = boxes.mean(axis=1)
    size_a, size_b = np.abs(boxes[:, 1] - boxes[:, 0])
    offset = centre_a - centre_b
    shrunk = np.maximum(np.abs(offset) - POSITION_MARGIN * (size_a + size_b), 0) * np.sign(offset)
    if np.all(np.abs(shrunk) < 1e-3):
        return set()
    dx, dy = shrunk / np.linalg.norm(offset)
    return {r for r, holds in zip(RELATIONS, (dx < -0.5, dx > 0.5, dy < -0.5, dy > 0.5)) if holds}


def evaluate(metadata: dict, kept: dict[str, list], colours: Colours) -> tuple[bool, str]:
    """GenEval's verdict on one image: (correct, the reasons it is not, one per line). `kept`: keep_detections';
    `colours(class, objects)`: each object's colour, asked only for a clause with a colour."""
    correct, reasons, groups = True, [], []  # groups[i]: clause i's objects when it held, else None
    for clause in metadata.get("include", []):
        name, count = clause["class"], clause["count"]
        found = kept.get(name, [])[:count]  # only the `count` best are looked at
        ok = len(found) >= count
        if not ok:
            reasons.append(f"expected {name}>={count}, found {len(found)}")
        elif "color" in clause and (n := colours(name, found).count(clause["color"])) < count:
            ok = False
            reasons.append(f"expected {clause['color']} {name}>={count}, found {n}")
        elif "position" in clause:
            relation, target = clause["position"]
            if groups[target] is None:
                ok = False
                reasons.append(f"no target for {name} to be {relation}")
            elif not all(relation in relative_position(a[0], b[0]) for a in found for b in groups[target]):
                ok = False
                reasons.append(f"expected {name} {relation} target")
        correct &= ok
        groups.append(found if ok else None)
    for clause in metadata.get("exclude", []):
        n = len(kept.get(clause["class"], []))
        if n >= clause["count"]:
            correct = False
            reasons.append(f"expected {clause['class']}<{clause['count']}, found {n}")
    return correct, "\n".join(reasons)


def partial_score(metadata: dict, kept: dict[str, list], colours: Colours) -> tuple[bool, float]:
    """Flow-GRPO's training reward for one image: (strict_correct, score). Per include clause, over all kept objects
    of its class (not the `count` best): 1 - |count - n| / count; when n != count, a 0 more if the clause has a
    colour or a position; when n == count, its colour term 1 - |count - n_colour| / count, and for a position a 0
    (no target) or, once the relations are checked, a 0 for a wrong one and then a 1 in every case. The score is
    the terms' mean; strict_correct asks exact counts and colours and every relation, and ignores exclude clauses."""
    correct, terms, groups = True, [], []
    for clause in metadata.get("include", []):
        name, count = clause["class"], clause["count"]
        found = kept.get(name, [])
        terms.append(1 - abs(count - len(found)) / count)
        ok = len(found) == count
        if not ok:
            if "color" in clause or "position" in clause:
                terms.append(0.0)
        else:
            if "color" in clause:
                n = colours(name, found).count(clause["color"])
                terms.append(1 - abs(count - n) / count)
                ok = n == count
            if "position" in clause and ok:
                relation, target = clause["position"]
                if groups[target] is None:
                    ok = False
                    terms.append(0.0)
                else:
                    if not all(relation in relative_position(a[0], b[0]) for a in found for b in groups[target]):
                        ok = False
                        terms.append(0.0)
                    terms.append(1.0)  # the official appends it after the check, wrong relation or not
        correct &= ok
        groups.append(found if ok else None)
    return correct, sum(terms) / len(terms) if terms else 0.0


# ---------------------------------------------------------------- the detector and the colour classifier
# The official detector is mmdetection 2.x's Mask2Former Swin-S (COCO instance segmentation,
# mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco); mmdetection 2.x needs mmcv-full built against the CUDA and torch
# versions in use, which no current torch has. Here the same architecture runs through transformers, with the
# Mask2Former authors' own Swin-S COCO instance weights (facebook/mask2former-swin-small-coco-instance), and
# mmdetection's test-time pre- and post-processing is written below; the weights are another training run of the
# same model, so single detections can differ (docs/evaluate.md). The colour classifier is the official one: CLIP
# ViT-L/14 (OpenAI's weights) zero-shot over COLORS with the official three templates.
DETECTOR_ID, CLIP_ID = "facebook/mask2former-swin-small-coco-instance", "openai/clip-vit-large-patch14"
MMDET_SCALE = (1333, 800)  # the test pipeline's keep-ratio resize: long side <= 1333, short side <= 800
MMDET_MEAN, MMDET_STD = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)  # ImageNet's, on 0-255 RGB
MAX_PER_IMAGE = 100  # (query, class) pairs kept per image, best class-score first (mmdetection's max_per_image)
TEMPLATES = ("a photo of a {c} {name}", "a photo of a {c}-colored {name}", "a photo of a {c} object")
FETCH = (
    f"`hf download {DETECTOR_ID} --local-dir FOLDER/mask2former && hf download {CLIP_ID} config.json "
    "model.safetensors tokenizer.json tokenizer_config.json vocab.json merges.txt special_tokens_map.json "
    "preprocessor_config.json --local-dir FOLDER/clip`"
)


def detector_inputs(pixels):
    """mmdetection's test pipeline on a batch: (B,3,H,W) uint8-valued floats (0-255, RGB) -> ((B,3,H',W') normalised
    and zero-padded to multiples of 32, (h, w) the resized size before padding). Resize: bilinear, the scale
    min(1333 / long side, 800 / short side), each side int(side * scale + 0.5), rounded to 0-255 as OpenCV's uint8
    resize returns it."""
    import torch
    import torch.nn.functional as F

    h, w = pixels.shape[-2:]
    scale = min(max(MMDET_SCALE) / max(h, w), min(MMDET_SCALE) / min(h, w))
    size = (int(h * scale + 0.5), int(w * scale + 0.5))
    x = F.interpolate(pixels, size=size, mode="bilinear", align_corners=False).round().clamp(0, 255)
    mean = torch.tensor(MMDET_MEAN, device=x.device).view(3, 1, 1)
    std = torch.tensor(MMDET_STD, device=x.device).view(3, 1, 1)
    x = (x - mean) / std
    pad = (0, -size[1] % 32, 0, -size[0] % 32)  # right and bottom, with 0 after normalisation, as mmdetection's Pad
    return F.pad(x, pad), size


def instance_detections(class_logits, mask_logits, padded: tuple, resized: tuple, original: tuple):
    """mmdetection's Mask2Former instance post-processing for one image -> (boxes, masks): per class of CLASSES a
    float32 (n, 5) array [x1, y1, x2, y2, score] and the (n, H, W) bool masks. `class_logits` (Q, 81), `mask_logits`
    (Q, h/4, w/4). The masks are upsampled to the padded input, cropped to the resized image, upsampled to the
    original; the 100 best (query, class) pairs by softmax class probability are kept, each scored by that
    probability times the mean sigmoid of its mask inside the mask (mask logit > 0); its box spans the mask
    (x_max + 1, y_max + 1; zeros for an empty mask)."""
    import torch
    import torch.nn.functional as F

    masks = F.interpolate(mask_logits[None].float(), size=padded, mode="bilinear", align_corners=False)
    masks = masks[..., : resized[0], : resized[1]]
    masks = F.interpolate(masks, size=original, mode="bilinear", align_corners=False)[0]  # (Q, H, W)
    probs = class_logits.float().softmax(-1)[:, :-1]  # (Q, 80): the last column is "no object"
    n = len(CLASSES)
    top, index = probs.flatten().topk(min(MAX_PER_IMAGE, probs.numel()))
    labels, masks = index % n, masks[index // n]
    binary = masks > 0
    inside = binary.flatten(1).sum(1)
    scores = top * (masks.sigmoid() * binary).flatten(1).sum(1) / (inside + 1e-6)
    xs, ys = binary.any(1), binary.any(2)  # (K, W), (K, H)
    boxes = torch.zeros(len(labels), 4, device=masks.device)
    for k in range(len(labels)):
        if inside[k]:
            x, y = xs[k].nonzero()[:, 0], ys[k].nonzero()[:, 0]
            boxes[k] = torch.stack([x[0], y[0], x[-1] + 1, y[-1] + 1]).float()
    rows = torch.cat([boxes, scores[:, None]], 1).cpu().numpy().astype(np.float32)
    labels, binary = labels.cpu().numpy(), binary.cpu().numpy()
    return [rows[labels == c] for c in range(n)], [binary[labels == c] for c in range(n)]


def _config(folder, flag: str, model_type: str, what: str) -> dict:
    from pathlib import Path

    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(
            f"{flag}: {path}: no readable config.json of {what} ({type(e).__name__}); fetch it: {FETCH}"
        ) from None
    if not isinstance(config, dict) or config.get("model_type") != model_type:
        got = config.get("model_type") if isinstance(config, dict) else type(config).__name__
        raise InputError(f"{flag}: {path} is a {got!r} model, expected {what} (model_type {model_type!r})")
    return config


class GenEvalJudge:
    """The detector and the colour classifier, loaded once (`load_geneval`); `judge(images, prompts)` scores a
    batch: per image (correct, strict_correct, partial score). `parts`: the networks, for offloading."""

    def __init__(self, detector, clip, processor, device):
        self.detector, self.clip, self.processor, self.device = detector, clip, processor, device
        self.parts = [detector, clip]
        self._text = {}  # class -> (D, 10) colour classifier

    def detect(self, images) -> list[dict[str, list]]:
        """(B,3,H,W) in [0,1] -> per image, its detections as keep_detections' input: (boxes, masks)."""
        import torch

        pixels = (images.detach().float() * 255).round().clamp(0, 255)  # the saved image's uint8 values
        x, resized = detector_inputs(pixels.to(self.device))
        out = []
        with torch.no_grad():
            for k in range(len(x)):  # one at a time: 100 masks at full size each
                result = self.detector(pixel_values=x[k : k + 1])
                out.append(
                    instance_detections(
                        result.class_queries_logits[0], result.masks_queries_logits[0], x.shape[-2:], resized,
                        tuple(images.shape[-2:]),
                    )
                )  # fmt: skip
        return out

    def classifier(self, name: str):
        """The zero-shot colour classifier of one class: per colour the mean of its three templates' normalised text
        embeddings, normalised (clip_benchmark's zero_shot_classifier, as the official)."""
        import torch

        if name not in self._text:
            tokenizer = self.processor.tokenizer
            columns = []
            with torch.no_grad():
                for c in COLORS:
                    texts = [t.format(c=c, name=name) for t in TEMPLATES]
                    tokens = tokenizer(texts, padding=True, return_tensors="pt").to(self.device)
                    e = self.clip.get_text_features(**tokens)
                    e = getattr(e, "pooler_output", e)
                    e = torch.nn.functional.normalize(e.float(), dim=-1).mean(0)
                    columns.append(e / e.norm())
            self._text[name] = torch.stack(columns, 1)  # (D, 10)
        return self._text[name]

    def colours(self, image):
        """colours(class, objects) for one PIL image: each object's crop (outside its mask grey #999, then its box,
        PIL rounding the box's corners) classified by CLIP among COLORS."""
        import torch
        from PIL import Image

        blank = Image.new("RGB", image.size, color="#999")

        def classify(name: str, objects: list) -> list[str]:
            crops = []
            for box, mask in objects:
                crop = image if mask is None else Image.composite(image, blank, Image.fromarray(mask))
                crops.append(crop.crop(tuple(float(v) for v in box[:4])))
            pixels = self.processor(images=crops, return_tensors="pt")["pixel_values"].to(self.device)
            with torch.no_grad():
                e = self.clip.get_image_features(pixel_values=pixels)
                e = torch.nn.functional.normalize(getattr(e, "pooler_output", e).float(), dim=-1)
            return [COLORS[i] for i in (e @ self.classifier(name)).argmax(1).tolist()]

        return classify

    def judge(self, images, prompts: list[str]) -> list[tuple[bool, bool, float]]:
        """Per image: (the evaluator's verdict, the reward server's strict verdict, its partial score)."""
        import torch
        from PIL import Image

        metadata = [geneval_metadata(p) for p in prompts]
        for p, m in zip(prompts, metadata):
            if m is None:  # the start-up check refuses these; a caller that skipped it learns it here
                raise ValueError(f"geneval: prompt {p!r} is not one of GenEval's templates")
        pixels = (images.detach().float() * 255).round().clamp(0, 255).to("cpu", torch.uint8)
        out = []
        for (boxes, masks), m, array in zip(self.detect(images), metadata, pixels.permute(0, 2, 3, 1).numpy()):
            kept = keep_detections(boxes, m["tag"], masks)
            colours = self.colours(Image.fromarray(array))
            correct, _ = evaluate(m, kept, colours)
            strict, score = partial_score(m, kept, colours)
            out.append((correct, strict, score))
        return out


def check_geneval_folder(folder: str, flag: str = "--reward-ckpt geneval") -> tuple[str, str]:
    """A --reward-ckpt folder checked before anything loads (its JSON configs and its safetensors headers, never its
    tensors): mask2former/ a Mask2Former with COCO's 80 classes, clip/ a CLIP model, and each safetensors file's
    tensors of the shapes the config gives them (the models built on the meta device). -> (detector, clip) paths;
    InputError naming `flag` otherwise."""
    from pathlib import Path

    import torch
    from safetensors import safe_open
    from transformers import CLIPConfig, CLIPModel, Mask2FormerConfig, Mask2FormerForUniversalSegmentation

    where = f"{flag}={folder}"
    if not Path(folder).is_dir():
        raise InputError(f"{where}: no such folder; it holds mask2former/ and clip/: {FETCH}")
    sources = (str(Path(folder) / "mask2former"), str(Path(folder) / "clip"))
    config = _config(sources[0], where, "mask2former", "a Mask2Former detector")
    labels = config.get("num_labels", len(config.get("id2label") or ()))
    if labels != len(CLASSES):
        raise InputError(
            f"{where}: the detector has {labels} classes; GenEval reads COCO's {len(CLASSES)} ({DETECTOR_ID})"
        )
    _config(sources[1], where, "clip", "a CLIP model")
    for source, config_cls, model_cls in (
        (sources[0], Mask2FormerConfig, Mask2FormerForUniversalSegmentation),
        (sources[1], CLIPConfig, CLIPModel),
    ):
        weights = Path(source) / "model.safetensors"
        if not weights.is_file():  # other layouts (shards, .bin) are checked when transformers loads them
            continue
        try:
            with torch.device("meta"):
                own = {k: tuple(v.shape) for k, v in model_cls(config_cls.from_pretrained(source)).state_dict().items()}
            with safe_open(str(weights), framework="pt") as f:
                theirs = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as e:  # a config transformers refuses, a truncated or foreign file
            raise InputError(
                f"{where}: {source} unreadable ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
            ) from None
        shared = set(own) & set(theirs)  # names only in one: renamed across transformers versions, left to the loader
        wrong = sorted(k for k in shared if own[k] != theirs[k])
        if not shared or wrong:
            why = f"{wrong[0]} is {theirs[wrong[0]]}, its config says {own[wrong[0]]}" if wrong else "no tensor of it"
            raise InputError(f"{where}: {weights} does not fit its config.json ({why}); {FETCH}")
    return sources


def load_geneval(folder: str | None, device, flag: str = "--reward-ckpt geneval") -> GenEvalJudge:
    """The judge from `folder` (mask2former/ and clip/ under it, as FETCH writes them; check_geneval_folder first) or,
    with None, from the hub (the cache, or a download when reachable); InputError naming `flag` otherwise."""
    from transformers import CLIPModel, CLIPProcessor, Mask2FormerForUniversalSegmentation

    sources = (DETECTOR_ID, CLIP_ID) if folder is None else check_geneval_folder(folder, flag)
    try:
        detector = Mask2FormerForUniversalSegmentation.from_pretrained(sources[0])
        clip = CLIPModel.from_pretrained(sources[1])
        processor = CLIPProcessor.from_pretrained(sources[1])
    except (OSError, ValueError, RuntimeError) as e:
        where = f"{flag}={folder}" if folder else f"--reward geneval without {flag}"
        raise InputError(
            f"{where}: {type(e).__name__}: {str(e).splitlines()[0][:200]}; fetch the models: {FETCH}"
        ) from None
    if detector.config.num_labels != len(CLASSES):
        raise InputError(f"{flag}: the detector has {detector.config.num_labels} classes; GenEval reads COCO's 80")
    for model in (detector, clip):
        model.to(device).eval().requires_grad_(False)
    return GenEvalJudge(detector, clip, processor, device)
