"""Flow-GRPO's OCR reward (`--reward ocr`): how much of the text a prompt quotes can be read back from the image.

The rule is the official one (flow_grpo `flow_grpo/ocr.py` at ac4c86e; DiffusionNFT uses the same file):

- the target is the first span between straight double quotes in the prompt (`prompt.split('"')[1]`);
- the recognised lines with a confidence above 0 are joined with no separator; the recognised text and the target
  both lose their spaces (' ' only) and are lower-cased;
- the distance is 0 if the target occurs anywhere inside the recognised text, else the Levenshtein distance between
  them, capped at the target's length; the reward is 1 - distance / len(target), in [0, 1];
- an image where nothing is recognised, or where the OCR fails, scores 0.

The official divides by the target's length, so a prompt without a non-empty quoted span would divide by zero:
`ocr_target` gives None for it and the start-up check (common.rewards.check_reward_prompts) refuses it.

The engine: PaddleOCR's PP-OCRv4 detection and recognition networks run by `rapidocr-onnxruntime` 1.4.4, not by
`paddleocr` itself. paddleocr 3.x downloads its models at run time (no download: no reward), needs paddlepaddle and
paddlex beside it, and has renamed the options of the 2.x `ocr()` the official calls; the rapidocr wheel ships the
PP-OCRv4 ONNX models inside it (offline from the first run) and runs them on onnxruntime, on the CPU or, with
onnxruntime-gpu and its *_use_cuda options, on a GPU. Here they run on the CPU, the official's default too
(`OcrScorer(use_gpu=False)`): a few small networks, beside a GPU busy with the policy. The engine is set as the
official's PaddleOCR(use_angle_cls=False) call would be: no direction classifier, and PaddleOCR 2.x's detector
defaults (longest side limited to 960, box threshold 0.6, unclip ratio 1.5, no dilation) where rapidocr's own
differ; recognised lines under 0.5 confidence are dropped by the engine as by PaddleOCR's drop_score. Not the
official's: the wheel's recogniser is PP-OCRv4's Chinese-and-English model (the official asks PaddleOCR for
lang="en", an English-only dictionary), so it may read a glyph as a Chinese character or full-width punctuation
where the English model would not; and images over 960 px are detected at 1500 or 2000 px where PaddleOCR resizes to
960. The images go to the engine as the official gives them to PaddleOCR: uint8 RGB arrays, which both engines read
as BGR.

Not differentiable. Load time and speed: docs/models.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from rapidfuzz.distance import Levenshtein  # unit-cost edit distance, as the official python-Levenshtein's


def ocr_target(prompt: str) -> str | None:
    """The text `prompt` asks to render: its first span between straight double quotes, as written (the official
    `prompt.split('"')[1]`); None when there is no closed span, or only spaces in it (the official would divide by
    its length, 0, after removing the spaces). An unclosed quote (`a sign "OPEN`) is None too: the official would
    read on to the end of the prompt, which is more likely a typo than the text meant."""
    parts = prompt.split('"')
    if len(parts) < 3 or not parts[1].replace(" ", ""):
        return None
    return parts[1]


def ocr_score(recognised: str, target: str) -> float:
    """The official rule (flow_grpo `flow_grpo/ocr.py`, OcrScorer.__call__): spaces removed and lower-cased on both
    sides, 0 distance when the target is inside the recognised text, else the Levenshtein distance capped at the
    target's length; 1 - distance / len(target). `recognised`: the recognised lines already joined."""
    text, target = recognised.replace(" ", "").lower(), target.replace(" ", "").lower()
    if not target:
        raise ValueError("ocr: an empty target (the start-up check refuses such prompts)")
    dist = 0 if target in text else min(Levenshtein.distance(text, target), len(target))
    return 1 - dist / len(target)


def load_ocr(threads: int | None = None) -> Callable[[torch.Tensor, list[str]], torch.Tensor]:
    """The scorer: the engine loaded once (about 0.4 s), then fn(images (B,3,H,W) in [0,1], prompts) -> (B,) float32
    on the images' device. `threads`: onnxruntime's threads per network (None: torch.get_num_threads(), so that
    OMP_NUM_THREADS and torch.set_num_threads bound it as they bound the rest of the process)."""
    from rapidocr_onnxruntime import RapidOCR  # here: onnxruntime and OpenCV load only when the reward is built

    threads = threads or torch.get_num_threads()
    engine = RapidOCR(
        use_cls=False,  # the official: PaddleOCR(use_angle_cls=False), ocr(img, cls=False)
        det_limit_side_len=960,  # PaddleOCR 2.x's detector defaults (rapidocr's: min side 736, 0.5, 1.6, dilation)
        det_limit_type="max",
        det_box_thresh=0.6,
        det_unclip_ratio=1.5,
        det_use_dilation=False,
        intra_op_num_threads=threads,
        inter_op_num_threads=1,
    )

    def read(pixels) -> str:
        """The recognised lines of one (H,W,3) uint8 image, joined as the official joins them ('' for none)."""
        lines, _ = engine(pixels)  # (None, None) when nothing is detected, else [[box, text, confidence], ...]
        return "".join(text for _, text, confidence in lines or () if confidence > 0)

    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        targets = [ocr_target(p) for p in prompts]
        for k, target in enumerate(targets):
            if target is None:  # the start-up check refuses these; a caller that skipped it learns it here
                raise ValueError(f"ocr: prompt {prompts[k]!r} quotes no text between straight double quotes")
        # the official's conversion (flow_grpo's rewards.py, ocr_score): round, clamp, uint8, NCHW -> NHWC
        pixels = (images.detach() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        scores = []
        for k, (array, target) in enumerate(zip(pixels, targets)):
            try:
                recognised = read(array)
            except Exception as e:  # the official: an OCR failure gets the maximum distance (0), printed
                print(f"warning: ocr failed on image {k} ({type(e).__name__}: {e}); it scores 0", file=sys.stderr)
                scores.append(0.0)
                continue
            scores.append(ocr_score(recognised, target))
        return torch.tensor(scores, dtype=torch.float32, device=images.device)

    return score
