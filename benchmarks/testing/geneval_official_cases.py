"""GenEval's scoring rules, as the official code applies them, on a few hundred hand-made and random detector outputs:
writes tests/data/geneval_official_cases.json, which tests/test_geneval_rules.py checks common/geneval.py against.

    .venv/bin/python benchmarks/testing/geneval_official_cases.py

or, with no network, from the two files taken out of local clones:

    git -C geneval show af4902f24d3ca90ebbb446dd9891a59e0f82725f:evaluation/evaluate_images.py > /tmp/evaluate_images.py
    git -C reward-server show 92ac29fb322c028f8840db8f93c950422931710d:reward_server/gen_eval.py > /tmp/gen_eval.py
    .venv/bin/python benchmarks/testing/geneval_official_cases.py --evaluator /tmp/evaluate_images.py \\
        --reward-server /tmp/gen_eval.py

The two official files (GenEval's evaluator, djghosh13/geneval `evaluation/evaluate_images.py`, and Flow-GRPO's
reward server, yifan123/reward-server `reward_server/gen_eval.py`) are read at run time, from --evaluator and
--reward-server or else downloaded at their pinned commits, and refused unless their git blob ids are the pinned ones;
nothing of them is stored here. Each runs in its own namespace on stub modules: the detector (mmdet) returns the
case's boxes, the colour classifier (open_clip + clip_benchmark) the case's colour for each box it is shown, so the
official rules (thresholds, the 16 best, counts, exclusions, colours, relative positions, the partial score) see
exactly the case. Per case the file holds the inputs (the prompt's metadata, the detections per class, the colour of
each box a colour clause looks at) and the outputs: the evaluator's verdict and the boxes it kept per class, best
first; the reward server's partial score, its copy of the verdict and its strict flag.

The cases: each threshold's two sides (float32 0.3 and the next float32 up; 0.9 for counting and on another tag),
more than 16 detections of a class, counts below, at and above the asked one, exclude clauses tripped and not,
colours right and wrong among the boxes looked at and beyond them, positions on both sides of each relation's 0.5
ratio and of the 1e-3 least offset (found by bisection on the official `relative_position`), two relations at once,
boxes of different sizes, a missing position target, tied scores, and --random-cases random ones (--seed).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import sys
import tempfile
import types
import urllib.request
from collections import Counter
from pathlib import Path
from unittest import mock

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from common.geneval import CLASSES, COLORS, NUMBERS, RELATIONS, TAGS, geneval_metadata  # noqa: E402

OFFICIAL = {
    "evaluator": {
        "repo": "djghosh13/geneval",
        "commit": "af4902f24d3ca90ebbb446dd9891a59e0f82725f",
        "path": "evaluation/evaluate_images.py",
        "blob": "5be79705391718e51139172bb65892fa5b7b78fb",
    },
    "reward_server": {
        "repo": "yifan123/reward-server",
        "commit": "92ac29fb322c028f8840db8f93c950422931710d",
        "path": "reward_server/gen_eval.py",
        "blob": "a72796f4fadadad4bf99d2e730a2439ec539ad95",
    },
}
OUT = ROOT / "tests" / "data" / "geneval_official_cases.json"

F32 = np.float32
T03, T09 = F32(0.3), F32(0.9)
T03_UP, T03_DOWN = np.nextafter(T03, F32(1)), np.nextafter(T03, F32(0))
T09_UP = np.nextafter(T09, F32(1))


# ---------------------------------------------------------------- the official files
def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def official_source(which: str, path: str | None) -> str:
    """The pinned file's text, from `path` or downloaded; SystemExit unless its git blob id is the pinned one."""
    pin = OFFICIAL[which]
    if path:
        data, origin = Path(path).read_bytes(), path
    else:
        origin = f"https://raw.githubusercontent.com/{pin['repo']}/{pin['commit']}/{pin['path']}"
        with urllib.request.urlopen(origin, timeout=60) as response:
            data = response.read()
    if blob_id(data) != pin["blob"]:
        raise SystemExit(
            f"{origin}: git blob {blob_id(data)}, not {pin['blob']} ({pin['repo']} {pin['path']} at {pin['commit']})"
        )
    return data.decode()


class Stage:
    """What the stubbed detector and colour classifier answer for the case being run."""

    result: list[np.ndarray] = []  # per class of CLASSES, (n, 5) float32
    colours: dict[tuple, str] = {}  # box's 5 values -> colour


def inference_detector(model, images):
    return [Stage.result for _ in images] if isinstance(images, list) else Stage.result  # bboxes only: no masks


def run_classification(model, classifier, dataloader, device):
    import torch

    objects = dataloader.dataset._objects  # the official's ImageCrops: [(box, mask), ...]
    logits = torch.zeros(len(objects), len(COLORS))
    for i, (box, _) in enumerate(objects):
        key = tuple(np.asarray(box, dtype=F32).tolist())
        if key not in Stage.colours:
            raise KeyError(f"the case gives no colour for box {key}")
        logits[i, COLORS.index(Stage.colours[key])] = 1.0
    return logits, torch.zeros(len(objects), dtype=torch.long)


def stub_modules() -> dict[str, types.ModuleType]:
    """mmdet, open_clip and clip_benchmark as far as the two official files use them (and pandas, which only the
    evaluator's main() uses, where it is not installed)."""

    def module(name, **attributes):
        m = types.ModuleType(name)
        m.__dict__.update(attributes)
        return m

    apis = module("mmdet.apis", inference_detector=inference_detector, init_detector=lambda *a, **k: "detector")
    zsc = module(
        "clip_benchmark.metrics.zeroshot_classification",
        zero_shot_classifier=lambda *a, **k: "classifier",
        run_classification=run_classification,
    )
    metrics = module("clip_benchmark.metrics", __path__=[], zeroshot_classification=zsc)
    stubs = {
        "mmdet": module("mmdet", __file__="/nonexistent/mmdet/__init__.py", __path__=[], apis=apis),
        "mmdet.apis": apis,
        "open_clip": module(
            "open_clip",
            create_model_and_transforms=lambda *a, **k: ("clip", None, lambda image: image),
            get_tokenizer=lambda *a, **k: lambda texts: texts,
        ),
        "clip_benchmark": module("clip_benchmark", __path__=[], metrics=metrics),
        "clip_benchmark.metrics": metrics,
        "clip_benchmark.metrics.zeroshot_classification": zsc,
    }
    if importlib.util.find_spec("pandas") is None:
        stubs["pandas"] = module("pandas")
    return stubs


def load_official(evaluator_path: str | None, reward_server_path: str | None):
    """(the evaluator's namespace, the reward server's compute_geneval)."""
    import torch

    sources = {
        k: official_source(k, p) for k, p in (("evaluator", evaluator_path), ("reward_server", reward_server_path))
    }
    evaluator = {"__name__": "geneval_official_evaluator", "__file__": "/nonexistent/evaluation/evaluate_images.py"}
    server = {"__name__": "geneval_official_reward_server", "__file__": "/nonexistent/reward_server/gen_eval.py"}
    with mock.patch.dict(sys.modules, stub_modules()):
        with mock.patch.object(torch.cuda, "is_available", lambda: True):  # the evaluator asserts CUDA at import
            exec(compile(sources["evaluator"], OFFICIAL["evaluator"]["path"], "exec"), evaluator)
        exec(compile(sources["reward_server"], OFFICIAL["reward_server"]["path"], "exec"), server)
    # what the evaluator's __main__ sets, with its defaults
    evaluator.update(THRESHOLD=0.3, COUNTING_THRESHOLD=0.9, MAX_OBJECTS=16, NMS_THRESHOLD=1.0, POSITION_THRESHOLD=0.1)
    evaluator.update(args=types.SimpleNamespace(options={}), classnames=list(CLASSES))
    evaluator.update(object_detector="detector", clip_model="clip", transform=lambda image: image, tokenizer=None)
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as folder:  # its load_models reads reward_server/object_names.txt from the cwd
        (Path(folder) / "reward_server").mkdir()
        (Path(folder) / "reward_server" / "object_names.txt").write_text("\n".join(CLASSES) + "\n")
        try:
            os.chdir(folder)
            compute_geneval = server["load_geneval"]()
        finally:
            os.chdir(here)
    return evaluator, compute_geneval


# ---------------------------------------------------------------- the cases
def f32(value) -> float:
    """A float32 value as the shortest decimal that reads back to it (keeps the file small), exactly."""
    value = F32(value)
    short = float(str(value))
    if F32(short) != value:
        short = float(value)
    return short


def article(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def plural(name: str) -> str:
    return f"{name}es" if name.endswith("s") else f"{name}s"


def box(x: float, y: float, w: float, h: float, score) -> list[float]:
    return [f32(x), f32(y), f32(F32(x) + F32(w)), f32(F32(y) + F32(h)), f32(score)]


def row(scores, x: float = 10, y: float = 20, w: float = 60, h: float = 40) -> list[list[float]]:
    """One box per score, each at its own place."""
    return [box(x + 37 * i, y + 23 * i, w + i, h + 2 * i, s) for i, s in enumerate(scores)]


def spread(n: int, top: float = 0.99, low: float = 0.31) -> list[float]:
    """n distinct scores from `top` down to `low`, in a shuffled order."""
    if n == 0:
        return []
    scores = np.linspace(top, low, n) if n > 1 else np.array([top])
    return [float(s) for s in np.random.default_rng(n).permutation(np.round(scores, 3))]


def colour_clauses(metadata: dict) -> dict[str, str]:
    return {c["class"]: c["color"] for c in metadata["include"] if "color" in c}


def make_case(name: str, kind: str, prompt: str, detections: dict, colours: dict | None = None) -> dict:
    """A case: the prompt's metadata, the detections per class name, and a colour per box of every class a colour
    clause names (default: the colour it asks for)."""
    metadata = geneval_metadata(prompt)
    assert metadata is not None, prompt
    colours = dict(colours or {})
    for name_, colour in colour_clauses(metadata).items():
        colours.setdefault(name_, [colour] * len(detections.get(name_, [])))
    detections = {k: v for k, v in detections.items() if len(v)}
    colours = {k: v for k, v in colours.items() if k in detections}
    for k, v in colours.items():
        assert len(v) == len(detections[k]) and set(v) <= set(COLORS), (name, k)
    seen = [tuple(b) for boxes in detections.values() for b in boxes]
    assert len(seen) == len(set(seen)), f"{name}: two boxes with the same 5 values"
    return {"name": name, "kind": kind, "metadata": metadata, "detections": detections, "colours": colours}


def threshold_cases() -> list[dict]:
    cases = []
    sides = (("dropped", T03), ("kept", T03_UP), ("below", T03_DOWN))
    for side, s in sides:
        cases += [
            make_case(
                f"threshold-0.3/{side}/single_object", "threshold-0.3", "a photo of a bench", {"bench": row([s])}
            ),
            make_case(
                f"threshold-0.3/{side}/two_object",
                "threshold-0.3",
                "a photo of a cat and a clock",
                {"cat": row([0.95]), "clock": row([s], x=300)},
            ),
            make_case(f"threshold-0.3/{side}/colors", "threshold-0.3", "a photo of a red car", {"car": row([s])}),
            make_case(
                f"threshold-0.3/{side}/color_attr",
                "threshold-0.3",
                "a photo of a blue umbrella and a yellow kite",
                {"umbrella": row([s]), "kite": row([0.8], x=300)},
            ),
            make_case(
                f"threshold-0.3/{side}/position-target",
                "threshold-0.3",
                "a photo of a dog left of a horse",
                {"horse": [box(300, 100, 50, 50, s)], "dog": [box(50, 100, 50, 50, 0.9)]},
            ),
            make_case(
                f"threshold-0.3/{side}/position-object",
                "threshold-0.3",
                "a photo of a dog left of a horse",
                {"horse": [box(300, 100, 50, 50, 0.9)], "dog": [box(50, 100, 50, 50, s)]},
            ),
            make_case(  # a counting prompt ignores what clears 0.3 only
                f"threshold-0.3/{side}/counting",
                "threshold-0.3",
                "a photo of two pizzas",
                {"pizza": row([0.95, 0.97, s])},
            ),
        ]
    for side, s in (("at", T09), ("above", T09_UP)):
        for n, word in ((2, "two"), (3, "three")):
            cases.append(
                make_case(  # n-1 sure ones plus one at the edge: kept makes n, dropped n-1
                    f"threshold-0.9/{side}/counting-{n}-from-{n - 1}",
                    "threshold-0.9-counting",
                    f"a photo of {word} cups",
                    {"cup": row([*spread(n - 1, 0.99, 0.95), s])},
                )
            )
            cases.append(
                make_case(  # n sure ones plus one at the edge: kept trips the exclude clause
                    f"threshold-0.9/{side}/counting-{n}-from-{n}",
                    "threshold-0.9-counting",
                    f"a photo of {word} cups",
                    {"cup": row([*spread(n, 0.99, 0.95), s])},
                )
            )
        cases += [
            make_case(
                f"threshold-0.9/{side}/single_object", "threshold-0.9-other", "a photo of a vase", {"vase": row([s])}
            ),
            make_case(
                f"threshold-0.9/{side}/two_object-two-of-one",
                "threshold-0.9-other",
                "a photo of a vase and a bowl",
                {"vase": row([0.95, s]), "bowl": row([s], x=400)},
            ),
            make_case(
                f"threshold-0.9/{side}/colors", "threshold-0.9-other", "a photo of a green bus", {"bus": row([s])}
            ),
        ]
    return cases


def max_objects_cases() -> list[dict]:
    cases = []
    for n in (15, 16, 17, 20, 24):
        cases.append(
            make_case(
                f"max-objects/{n}/single_object",
                "max-objects",
                "a photo of a teddy bear",
                {"teddy bear": row(spread(n))},
            )
        )
    cases.append(
        make_case(  # 20 sure ones: 16 kept for a counting prompt
            "max-objects/20/counting-four", "max-objects", "a photo of four dogs", {"dog": row(spread(20, 0.999, 0.91))}
        )
    )
    cases.append(
        make_case(  # some of 20 below 0.9: 16 kept of the 17 above
            "max-objects/20-with-3-below-0.9/counting-four",
            "max-objects",
            "a photo of four dogs",
            {"dog": row([*spread(17, 0.999, 0.91), 0.89, 0.5, 0.2])},
        )
    )
    cases.append(
        make_case(
            "max-objects/18/two_object",
            "max-objects",
            "a photo of a bottle and a fork",
            {"bottle": row(spread(18)), "fork": row([0.7], x=700)},
        )
    )
    scores = spread(18)
    colours = ["pink" if s == max(scores) else "white" for s in scores]
    cases.append(
        make_case(  # the best is pink, the other 17 (two beyond the 16) white
            "max-objects/18/colors-best-right",
            "max-objects",
            "a photo of a pink donut",
            {"donut": row(scores)},
            {"donut": colours},
        )
    )
    colours = ["white" if s == max(scores) else "pink" for s in scores]
    cases.append(
        make_case(
            "max-objects/18/colors-best-wrong",
            "max-objects",
            "a photo of a pink donut",
            {"donut": row(scores)},
            {"donut": colours},
        )
    )
    return cases


def count_cases() -> list[dict]:
    cases = []
    for count in (2, 3, 4, 5, 10):
        word = NUMBERS[count]
        for n in sorted({0, 1, count - 1, count, count + 1, count + 2, 2 * count, 2 * count + 1, 3 * count}):
            if n <= 16 + 3:
                cases.append(
                    make_case(
                        f"count/{word}/{n}-found",
                        "count",
                        f"a photo of {word} {plural('sheep')}",
                        {"sheep": row(spread(n, 0.999, 0.91)) if n else []},
                    )
                )
    for n in (0, 1, 2, 3, 5):  # a one-object clause: 1 - |1 - n|
        cases.append(
            make_case(f"count/one-object/{n}-found", "count", "a photo of a banana", {"banana": row(spread(n))})
        )
        cases.append(
            make_case(
                f"count/two_object/{n}-and-1",
                "count",
                "a photo of a knife and a spoon",
                {"knife": row(spread(n)), "spoon": row([0.6], x=800)},
            )
        )
    cases.append(
        make_case("count/same-class-twice", "count", "a photo of a car and a car", {"car": row([0.8])})
    )  # the templates allow it: both clauses look at the same car
    cases.append(make_case("count/same-class-twice/2", "count", "a photo of a car and a car", {"car": row([0.8, 0.7])}))
    return cases


def exclude_cases() -> list[dict]:
    cases = []
    for count in (2, 3, 4):
        word = NUMBERS[count]
        cases += [
            make_case(  # count + 1 sure ones: tripped
                f"exclude/{word}/tripped",
                "exclude",
                f"a photo of {word} birds",
                {"bird": row(spread(count + 1, 0.99, 0.92))},
            ),
            make_case(  # count sure ones and one at 0.85: not tripped (below the counting threshold)
                f"exclude/{word}/not-tripped-0.85",
                "exclude",
                f"a photo of {word} birds",
                {"bird": row([*spread(count, 0.99, 0.92), 0.85])},
            ),
            make_case(  # count sure ones and other classes: not tripped
                f"exclude/{word}/not-tripped-others",
                "exclude",
                f"a photo of {word} birds",
                {"bird": row(spread(count, 0.99, 0.92)), "cat": row([0.99], x=600), "dog": row([0.95], x=900)},
            ),
        ]
    return cases


def colour_cases() -> list[dict]:
    cases = []
    for right in (True, False):
        side = "right" if right else "wrong"
        cases.append(
            make_case(
                f"colour/colors/one-{side}",
                "colour",
                "a photo of a purple train",
                {"train": row([0.7])},
                {"train": ["purple" if right else "brown"]},
            )
        )
    for best, other in (("purple", "brown"), ("brown", "purple"), ("purple", "purple")):
        cases.append(
            make_case(  # two trains: the best is looked at (count 1), the other beyond it
                f"colour/colors/two-best-{best}-other-{other}",
                "colour",
                "a photo of a purple train",
                {"train": row([0.6, 0.8])},
                {"train": [other, best]},
            )
        )
    cases.append(make_case("colour/colors/none", "colour", "a photo of a purple train", {"bus": row([0.9])}))
    for first in ("black", "orange"):
        for second in ("yellow", "white"):
            cases.append(
                make_case(
                    f"colour/color_attr/{first}-{second}",
                    "colour",
                    "a photo of a black suitcase and a yellow handbag",
                    {"suitcase": row([0.75]), "handbag": row([0.65], x=500)},
                    {"suitcase": [first], "handbag": [second]},
                )
            )
    cases.append(
        make_case(  # two suitcases, the best black: the evaluator passes it, the partial score's count does not
            "colour/color_attr/two-suitcases",
            "colour",
            "a photo of a black suitcase and a yellow handbag",
            {"suitcase": row([0.75, 0.5]), "handbag": row([0.65], x=500)},
            {"suitcase": ["black", "orange"], "handbag": ["yellow"]},
        )
    )
    cases.append(
        make_case(
            "colour/color_attr/handbag-missing",
            "colour",
            "a photo of a black suitcase and a yellow handbag",
            {"suitcase": row([0.75])},
        )
    )
    return cases


def relation_prompt(a: str, relation: str, b: str) -> str:
    return f"a photo of {article(a)} {relation} {article(b)}"


def shrunk_offset(a, b) -> np.ndarray:
    """The offset between the centres, less 0.1 x the two sizes, in float32 (only to label a boundary's kind)."""
    boxes = np.array([a[:4], b[:4]], dtype=F32).reshape(2, 2, 2)
    offset = boxes[0].mean(axis=0) - boxes[1].mean(axis=0)
    size = np.abs(boxes[:, 1] - boxes[:, 0]).sum(axis=0)
    return np.maximum(np.abs(offset) - 0.1 * size, 0)


def bisect(holds, t_false, t_true) -> tuple[np.float32, np.float32]:
    """Two adjacent float32 values, the first where holds() is false, the second where it is true, between t_false
    and t_true (both positive: their bits order them)."""
    a, b = F32(t_false), F32(t_true)
    assert a > 0 and b > 0 and not holds(a) and holds(b), (a, b)
    ia, ib = int(np.array(a).view(np.uint32)), int(np.array(b).view(np.uint32))
    while abs(ia - ib) > 1:
        mid = (ia + ib) // 2
        if holds(np.array(mid, dtype=np.uint32).view(F32)[()]):
            ib = mid
        else:
            ia = mid
    return np.array(ia, dtype=np.uint32).view(F32)[()], np.array(ib, dtype=np.uint32).view(F32)[()]


def position_cases(official_relation) -> list[dict]:
    """`official_relation(box_a, box_b)`: the official relative_position's set."""
    cases = []
    axis_of = {"left of": 0, "right of": 0, "above": 1, "below": 1}
    sign_of = {"left of": -1, "right of": 1, "above": -1, "below": 1}

    def boundary(tag, relation, size_a, size_b, other, base, span, a="cat", b="dog"):
        axis, sign = axis_of[relation], sign_of[relation]
        box_b = box(base, base, *size_b, 0.85)
        centre_b = [F32(base) + F32(size_b[0]) / 2, F32(base) + F32(size_b[1]) / 2]

        def box_a(t):
            low = [0.0, 0.0]
            low[axis] = t
            low[1 - axis] = centre_b[1 - axis] + F32(other) - F32(size_a[1 - axis]) / 2
            return box(low[0], low[1], *size_a, 0.8)

        aligned = centre_b[axis] - F32(size_a[axis]) / 2
        below, above = bisect(lambda t: relation in official_relation(box_a(t), box_b), aligned, aligned + sign * span)
        for side, t in (("not", below), ("holds", above)):
            boxes_a = box_a(t)
            cases.append(
                make_case(f"{tag}/{relation}/{side}", tag, relation_prompt(a, relation, b), {b: [box_b], a: [boxes_a]})
            )
        return box_a(below), box_a(above), box_b

    for relation in RELATIONS:
        boundary("position-ratio", relation, (100, 100), (100, 100), 100, 1500, 1000)
        boundary("position-ratio-sizes", relation, (30, 60), (240, 120), -70, 1500, 1000, a="bench", b="couch")
        a_not, a_holds, b = boundary("position-least-offset", relation, (0.004, 0.004), (0.004, 0.004), 0, 0.5, 0.01)
        low, high = shrunk_offset(a_not, b)[axis_of[relation]], shrunk_offset(a_holds, b)[axis_of[relation]]
        assert low < 1e-3 <= high, (relation, low, high)  # the flip is the least offset's, not the ratio's
    # the ratio exactly 0.5 and just over, by hand: 10 x 10 boxes (0.1 x 20 = 2 forgiven per axis); offset (12, 16):
    # (12 - 2) / 20 = 0.5, not over; (13, 16): 11 / sqrt(425) = 0.534
    target = box(100, 100, 10, 10, 0.9)
    for ox in (12, 13):
        for relation in ("right of", "below"):
            cases.append(
                make_case(
                    f"position-ratio-exact/offset-{ox}-16/{relation}",
                    "position-ratio-exact",
                    relation_prompt("frisbee", relation, "kite"),
                    {"kite": [target], "frisbee": [box(100 + ox, 116, 10, 10, 0.8)]},
                )
            )
    for relation in RELATIONS:  # diagonal: left of and above at once
        cases.append(
            make_case(
                f"position-two-relations/{relation}",
                "position-two-relations",
                relation_prompt("chair", relation, "bed"),
                {"bed": [box(300, 300, 120, 80, 0.9)], "chair": [box(100, 90, 40, 60, 0.7)]},
            )
        )
    places = {"left of": ((100, 230), (700, 230)), "below": ((430, 500), (430, 20))}  # (holds, does not), oven's
    for relation, (there, elsewhere) in places.items():  # centre at (450, 250): the toaster's best is looked at
        for best_ok in (True, False):
            good, bad = box(*there, 40, 40, 0.7), box(*elsewhere, 40, 40, 0.65)
            if not best_ok:
                good, bad = box(*there, 40, 40, 0.65), box(*elsewhere, 40, 40, 0.7)
            cases.append(
                make_case(
                    f"position-two-objects/{relation}/best-{'right' if best_ok else 'wrong'}",
                    "position-two-objects",
                    relation_prompt("toaster", relation, "oven"),
                    {"oven": [box(400, 200, 100, 100, 0.9)], "toaster": [good, bad]},
                )
            )
    prompt = relation_prompt("laptop", "above", "tv")
    laptop = [box(200, 10, 50, 30, 0.8)]
    for name, tvs in (
        ("none", []),
        ("below-threshold", [box(200, 300, 80, 60, T03)]),
        ("two", [box(200, 300, 80, 60, 0.8), box(600, 300, 80, 60, 0.7)]),
        ("one", [box(200, 300, 80, 60, 0.8)]),
    ):
        cases.append(make_case(f"position-target/{name}", "position-target", prompt, {"tv": tvs, "laptop": laptop}))
    cases.append(
        make_case("position-target/object-missing", "position-target", prompt, {"tv": [box(200, 300, 80, 60, 0.8)]})
    )
    cases.append(
        make_case(
            "position-target/same-place",
            "position-target",
            prompt,
            {"tv": [box(200, 10, 50, 30, 0.9)], "laptop": laptop},
        )
    )
    return cases


def tie_cases() -> list[dict]:
    """Tied scores: the order among them is the sort's (the official's argsort is numpy's default, not stable)."""
    cases = [
        make_case(
            "tie/colors/4-boxes",
            "tie",
            "a photo of a red car",
            {"car": row([0.7, 0.7, 0.5, 0.6])},
            {"car": ["red", "blue", "green", "yellow"]},
        ),
        make_case("tie/single_object/4-boxes", "tie", "a photo of a car", {"car": row([0.7, 0.7, 0.5, 0.6])}),
        make_case("tie/single_object/2-boxes", "tie", "a photo of a car", {"car": row([0.7, 0.7])}),
        make_case("tie/single_object/20-at-the-cut", "tie", "a photo of a car", {"car": row([0.5] * 10 + [0.6] * 10)}),
        make_case(
            "tie/position/3-tvs",
            "tie",
            "a photo of a laptop above a tv",
            {"tv": row([0.8, 0.8, 0.8], y=300), "laptop": row([0.9, 0.9], y=0)},
        ),
    ]
    return cases


def random_prompt(rng: np.random.Generator, tag: str) -> str:
    def cls():
        return CLASSES[rng.integers(len(CLASSES))]

    def colour():
        return COLORS[rng.integers(len(COLORS))]

    a, b = cls(), cls()
    while b == a:
        b = cls()
    if tag == "single_object":
        return f"a photo of {article(a)}"
    if tag == "two_object":
        return f"a photo of {article(a)} and {article(b)}"
    if tag == "counting":
        n = int(rng.choice([2, 3, 4])) if rng.random() < 0.85 else int(rng.integers(5, 11))
        return f"a photo of {NUMBERS[n]} {plural(a)}"
    if tag == "colors":
        return f"a photo of {article(colour())} {a}"
    if tag == "position":
        return relation_prompt(a, RELATIONS[rng.integers(4)], b)
    return f"a photo of {article(colour())} {a} and {article(colour())} {b}"


def random_case(rng: np.random.Generator, index: int) -> dict:
    tag = TAGS[index % len(TAGS)]
    while (metadata := geneval_metadata(prompt := random_prompt(rng, tag))) is None:
        pass
    edges = [T03, T03_UP, T03_DOWN, T09, T09_UP]
    detections, colours = {}, {}
    names = [c["class"] for c in metadata["include"]]
    others = [CLASSES[i] for i in rng.choice(len(CLASSES), int(rng.integers(0, 3)), replace=False)]
    for name in dict.fromkeys(names + others):
        count = max([c["count"] for c in metadata["include"] if c["class"] == name] or [1])
        n = int(rng.integers(0, count + 3)) if rng.random() < 0.9 else int(rng.integers(count + 3, 22))
        scores = set()
        while len(scores) < n:  # distinct within the class: ties are tie_cases' business
            pick = rng.random()
            if pick < 0.15:
                s = edges[rng.integers(len(edges))]
            elif pick < 0.3:
                s = rng.uniform(0, 0.3)
            elif pick < 0.55 or tag != "counting":
                s = rng.uniform(0.3, 1)
            else:
                s = rng.uniform(0.9, 1)
            scores.add(f32(s))
        quarter = rng.random() < 0.7  # most coordinates on a quarter grid (short), the rest any float32
        boxes = []
        for s in rng.permutation(sorted(scores)):
            x, y = rng.uniform(0, 448, 2)
            w, h = rng.uniform(2, 256, 2)
            if quarter:
                x, y, w, h = (round(v * 4) / 4 for v in (x, y, w, h))
            boxes.append(box(x, y, w, h, s))
        detections[name] = boxes
    for name, asked in colour_clauses(metadata).items():
        colours[name] = [asked if rng.random() < 0.6 else COLORS[rng.integers(len(COLORS))] for _ in detections[name]]
    return make_case(f"random/{index:03d}", "random", prompt, detections, colours)


def all_cases(official_relation, n_random: int, seed: int) -> list[dict]:
    cases = threshold_cases() + max_objects_cases() + count_cases() + exclude_cases() + colour_cases()
    cases += position_cases(official_relation) + tie_cases()
    rng = np.random.default_rng(seed)
    cases += [random_case(rng, i) for i in range(n_random)]
    names = [c["name"] for c in cases]
    assert len(names) == len(set(names)), [n for n, k in Counter(names).items() if k > 1]
    return cases


# ---------------------------------------------------------------- running them
def run_case(case: dict, evaluator: dict, compute_geneval, png: str, image) -> dict:
    Stage.result = [np.array(case["detections"].get(name, []), dtype=F32).reshape(-1, 5) for name in CLASSES]
    Stage.colours = {}
    for name, colours in case["colours"].items():
        for b, colour in zip(np.array(case["detections"][name], dtype=F32), colours, strict=True):
            Stage.colours[tuple(b.tolist())] = colour
    verdict = evaluator["evaluate_image"](png, case["metadata"])
    scores, rewards, strict, _, _ = compute_geneval([image], [case["metadata"]], only_strict=False)
    kept = {name: [[f32(v) for v in b] for b in boxes] for name, boxes in json.loads(verdict["details"]).items()}
    return {
        "correct": bool(verdict["correct"]),
        "score": float(scores[0]),
        "rewards": float(rewards[0]),
        "strict_rewards": float(strict[0]),
        "kept": kept,
    }


def simd_features() -> list[str]:
    """numpy's SIMD levels on this machine (its default argsort, the official's, orders tied scores by them)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:
        return []
    return [k for k, on in __cpu_features__.items() if on and k.startswith(("X86_V", "AVX512_", "ASIMD", "SVE", "VSX"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--evaluator", help="GenEval's evaluation/evaluate_images.py at the pinned commit (else downloaded)"
    )
    parser.add_argument(
        "--reward-server", help="reward-server's reward_server/gen_eval.py at the pinned commit (else downloaded)"
    )
    parser.add_argument("--random-cases", type=int, default=200, help="random cases beside the hand-made ones")
    parser.add_argument("--seed", type=int, default=0, help="the random cases' seed")
    parser.add_argument("--out", type=Path, default=OUT, help="where the cases go")
    args = parser.parse_args()
    from PIL import Image

    evaluator, compute_geneval = load_official(args.evaluator, args.reward_server)

    def official_relation(box_a, box_b):
        return evaluator["relative_position"]((np.array(box_a, dtype=F32), None), (np.array(box_b, dtype=F32), None))

    cases = all_cases(official_relation, args.random_cases, args.seed)
    image = Image.new("RGB", (64, 64), "#808080")
    with tempfile.TemporaryDirectory() as folder:
        png = os.path.join(folder, "00000.png")
        image.save(png)
        for case in cases:
            case["official"] = run_case(case, evaluator, compute_geneval, png, image)
    command = " ".join(["python", "benchmarks/testing/geneval_official_cases.py", *sys.argv[1:]])
    header = {
        "about": "GenEval's rules by the official code, made by benchmarks/testing/geneval_official_cases.py",
        "command": command,
        "official": OFFICIAL,
        "numpy": np.__version__,  # the order among tied scores is its default argsort's, which varies with the CPU
        "machine": platform.machine(),
        "simd": simd_features(),
        "n_cases": len(cases),
    }
    lines = [json.dumps(case, separators=(",", ":")) for case in cases]
    text = json.dumps(header, indent=1)[:-2] + ',\n "cases": [\n' + ",\n".join(lines) + "\n ]\n}\n"
    assert json.loads(text)["cases"] == cases
    args.out.write_text(text)
    by_tag = Counter(c["metadata"]["tag"] for c in cases)
    by_kind = Counter(c["kind"] for c in cases)
    correct = Counter(c["metadata"]["tag"] for c in cases if c["official"]["correct"])
    print(f"{len(cases)} cases -> {args.out} ({args.out.stat().st_size} bytes)")
    for tag in TAGS:
        print(f"  {tag:14} {by_tag[tag]:4} cases, {correct[tag]:4} correct")
    for kind, n in by_kind.items():
        print(f"  {kind:28} {n:4}")


if __name__ == "__main__":
    main()
