"""Rewards for RL post-training of text-to-image models, behind one spec string.

    --reward shapes:1.0,verifier:0.5      weighted sum of registered rewards (bare "shapes" = weight 1)
    --reward-ckpt hpsv2.1=/path/HPS_v2.1_compressed.pt   (repeatable) local file/folder or hub id per reward

Every reward maps images (B,3,H,W) float in [0,1] and one prompt per image to (B,) float32 scores on
images.device. `differentiable` says whether gradients reach the images (RLR's first-order term needs it;
GRPO-style methods do not). Heavy imports live inside the factories, so importing this module is cheap.

Remote rewards (common/remote.py): `--reward-url NAME=URL` scores a component in another process: the VLM judges
'unifiedreward', 'ocr_judge' and 'edit_judge' (an edit and its source) through an OpenAI-compatible server (`vllm
serve`, SGLang), any registered reward through `python -m common.rewards serve`; the bearer token, if the server wants
one, comes from $REWARD_API_KEY.

Videos (B,F,3,H,W) (a video model's decode, frames first): CompositeReward scores an image reward on `frames`
evenly spaced frames of each video (the first and the last among them) and takes the mean over them; a video
reward (`video = True`, e.g. 'temporal') sees the whole video. docs/video.md says why and what each one rewards.
"""

import ctypes
import errno
import io
import json
import math
import os
import re
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Callable, Literal, Optional, Protocol

import huggingface_hub
import torch
import torch.nn.functional as F
import tyro
from annotated_types import Ge, Gt, Le  # ServeArgs' ranges, declared beside each flag (common.cli.check_ranges)
from PIL import Image

from common import InputError, RunError, hub_reachable
from common.attention import set_attention_backend
from common.cli import check_numbers, parse_flags
from common.offload import Offloaded
from common.remote import STOPS, EditJudge, Judge, Served, request_json


class Reward(Protocol):
    differentiable: bool
    video: bool  # scores videos (B,F,3,H,W), not images
    parts: Offloaded  # its networks, for --offload-frozen

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor: ...


class ScoreFn:
    """Adapts a plain fn(images, prompts) -> (B,) to the Reward protocol: shape check, float32, output device.
    `parts` (common.offload.Offloaded) holds the reward's networks: with --offload-frozen they wait on the CPU and
    come to the GPU when scoring, until park()."""

    def __init__(self, fn: Callable, differentiable: bool, parts: Offloaded | None = None, video: bool = False):
        self.fn, self.differentiable, self.parts = fn, differentiable, parts or Offloaded([], "cpu", False)
        self.video = video

    def __call__(self, images, prompts):
        assert images.ndim == (5 if self.video else 4) and len(prompts) == len(images), (images.shape, len(prompts))
        self.parts.fetch()
        # a non-differentiable reward never needs the autograd graph of the images
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.differentiable):
            scores = self.fn(images, prompts)
        return scores.to(images.device, torch.float32).reshape(len(images))


def _missing_ckpt(name: str, path: str, how: str) -> str:
    return (
        f"reward '{name}': weights not found locally and the hub is unreachable (offline or HF_HUB_OFFLINE=1). "
        f"Pass --reward-ckpt {name}={path}. To get it on a connected machine: {how} "
        "(or run once online so the Hugging Face cache holds it, then copy the cache over)."
    )


# rewards whose weights come from the hub unless --reward-ckpt is given: (hub repo, a file of it, example --reward-ckpt
# path, how to fetch it on a connected machine)
HUB_WEIGHTS = {
    "hpsv2.1": (
        "xswu/HPSv2",
        "HPS_v2.1_compressed.pt",
        "/path/to/HPS_v2.1_compressed.pt",
        "`hf download xswu/HPSv2 HPS_v2.1_compressed.pt`",
    ),
    "pickscore": (
        "yuvalkirstain/PickScore_v1",
        "config.json",
        "/path/to/folder",
        'python -c "from transformers import CLIPModel, CLIPProcessor; '
        "CLIPModel.from_pretrained('yuvalkirstain/PickScore_v1').save_pretrained('pickscore'); "
        "CLIPProcessor.from_pretrained('laion/CLIP-ViT-H-14-laion2B-s32B-b79K').save_pretrained('pickscore')\"",
    ),
    "clip": (
        "openai/clip-vit-large-patch14",
        "config.json",
        "/path/to/folder",
        "`hf download openai/clip-vit-large-patch14 --local-dir clip-vit-large-patch14`",
    ),
    "image_similarity": (
        "openai/clip-vit-large-patch14",
        "config.json",
        "/path/to/folder",
        "`hf download openai/clip-vit-large-patch14 --local-dir clip-vit-large-patch14`",
    ),
    "aesthetic": (  # the hub copy of improved-aesthetic-predictor's sac+logos+ava1-l14-linearMSE.pth (DDPO's, trl's)
        "trl-lib/ddpo-aesthetic-predictor",
        "aesthetic-model.pth",
        "/path/to/folder",
        "`hf download openai/clip-vit-large-patch14 --local-dir aesthetic && hf download "
        "trl-lib/ddpo-aesthetic-predictor aesthetic-model.pth --local-dir aesthetic`",
    ),
    "imagereward": (  # also med_config.json from the same repository, and the bert-base-uncased tokenizer
        "THUDM/ImageReward",
        "ImageReward.pt",
        "/path/to/folder",
        "`hf download THUDM/ImageReward ImageReward.pt med_config.json --local-dir imagereward && python -c "
        "\"from transformers import AutoTokenizer; AutoTokenizer.from_pretrained('bert-base-uncased')"
        ".save_pretrained('imagereward')\"`",
    ),
    "geneval": (  # and openai/clip-vit-large-patch14 for the colours (common/geneval.py's FETCH)
        "facebook/mask2former-swin-small-coco-instance",
        "config.json",
        "/path/to/folder",
        "`hf download facebook/mask2former-swin-small-coco-instance --local-dir FOLDER/mask2former && hf download "
        "openai/clip-vit-large-patch14 --local-dir FOLDER/clip`",
    ),
    "hpsv3": (  # the whole model; the config and processor come from Qwen/Qwen2-VL-7B-Instruct (common/hpsv3.py)
        "MizzenAI/HPSv3",
        "HPSv3.safetensors",
        "/path/to/folder",
        "`hf download MizzenAI/HPSv3 HPSv3.safetensors --local-dir hpsv3 && hf download Qwen/Qwen2-VL-7B-Instruct "
        "config.json tokenizer.json tokenizer_config.json vocab.json merges.txt preprocessor_config.json "
        "chat_template.json --local-dir hpsv3`",
    ),
}


def _hub_file(name: str, download: bool = True) -> str | None:
    """Path of reward `name`'s hub file: from the local cache, else downloaded if the hub is reachable (download=False:
    None instead); InputError when neither works."""
    repo, filename, example, how = HUB_WEIGHTS[name]
    try:
        return huggingface_hub.hf_hub_download(repo, filename, local_files_only=True)
    except Exception:
        pass
    if not hub_reachable():
        raise InputError(_missing_ckpt(name, example, how))
    return huggingface_hub.hf_hub_download(repo, filename) if download else None


def _no_ckpt(name: str, checkpoint: str | None):
    if checkpoint is not None:  # a silently ignored flag would hide a typo
        raise InputError(f"reward '{name}' takes no checkpoint, but --reward-ckpt {name}={checkpoint} was given")


# ---------------------------------------------------------------- ShapesBench (the offline world)
def _edit_aware(score, edit_score):
    """score(images, prompts) on ShapesBench's prompts; on its edit prompts (ShapesBench-Edit, instructions with a
    source image) edit_score(images, sources, instructions), which scores each image against the caption the edit
    should give (common/shapesbench/edit.py)."""
    from common.edits import EditPrompt
    from common.shapesbench.edit import source_images

    def fn(images, prompts):
        if prompts and isinstance(prompts[0], EditPrompt):
            return edit_score(images, source_images(prompts), [p.text for p in prompts])
        return score(images, prompts)

    return fn


def shapes_reward(device, checkpoint=None) -> Reward:
    """Learned, differentiable image-text reward of ShapesBench (`checkpoint` None = the one shipped in the repo); on
    ShapesBench-Edit's prompts, of the caption the edit should give."""
    from common.shapesbench import load_reward_model  # here, not at the top: tests substitute common.shapesbench
    from common.shapesbench.edit import edit_learned_reward

    model = load_reward_model(path=checkpoint, device=device)
    return ScoreFn(_edit_aware(model, partial(edit_learned_reward, model)), differentiable=True)


def verifier(device, checkpoint=None) -> Reward:
    """Programmatic ShapesBench verifier (colours, shape, clean background); the held-out metric. On ShapesBench-Edit's
    prompts, against the caption the edit should give."""
    _no_ckpt("verifier", checkpoint)
    from common.shapesbench import verifier_reward  # here, not at the top: tests substitute common.shapesbench
    from common.shapesbench.edit import edit_verifier_reward

    return ScoreFn(_edit_aware(verifier_reward, edit_verifier_reward), differentiable=False)


# ---------------------------------------------------------------- JPEG compressibility (DDPO)
def jpeg(device, checkpoint=None) -> Reward:
    """Negative JPEG size in kB at quality 95, per image, as DDPO: smoother images score higher."""
    _no_ckpt("jpeg", checkpoint)

    def score(images, prompts):
        pixels = (images.detach() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        sizes = []
        for array in pixels:  # (H,W,3) uint8
            buffer = io.BytesIO()
            Image.fromarray(array).save(buffer, format="JPEG", quality=95)
            sizes.append(buffer.tell() / 1000)
        return -torch.tensor(sizes)  # cpu: PIL's sizes; ScoreFn moves the scores to the images' device

    return ScoreFn(score, differentiable=False)


# ---------------------------------------------------------------- OCR (Flow-GRPO's rule on PP-OCR, common/ocr.py)
def ocr(device, checkpoint=None) -> Reward:
    """Flow-GRPO's OCR reward: 1 - the capped, normalised edit distance between the text PP-OCRv4 reads in the image
    and the prompt's first quoted span (common/ocr.py), in [0, 1]; on the CPU, whatever `device`; not
    differentiable. The models ship inside the rapidocr-onnxruntime wheel: no checkpoint."""
    _no_ckpt("ocr", checkpoint)
    from common.ocr import load_ocr  # here: loads onnxruntime and OpenCV, and --help stays fast

    return ScoreFn(load_ocr(), differentiable=False)


# ---------------------------------------------------------------- GenEval (Mask2Former + CLIP, common/geneval.py)
_GENEVAL = {}  # (checkpoint, device) -> the judge: geneval and geneval_accuracy in one spec share one copy


def _geneval(name: str, device, checkpoint):
    from common.geneval import load_geneval  # here: transformers' Mask2Former loads only when the reward is built

    if checkpoint is None:
        _hub_file("geneval", download=False)  # fails at once, with how to get the weights, when offline and not cached
    key = (checkpoint, str(device))
    if key not in _GENEVAL:
        _GENEVAL[key] = load_geneval(checkpoint, device, f"--reward-ckpt {name}")
    return _GENEVAL[key]


def geneval(device, checkpoint=None) -> Reward:
    """Flow-GRPO's GenEval training reward: the partial credit of its reward server (per-clause count, colour and
    position terms, in [-14, 1]; common/geneval.py), from GenEval's detector and colour classifier; the prompt must
    be one of GenEval's templates. Not differentiable. `checkpoint`: a folder with mask2former/ and clip/."""
    judge = _geneval("geneval", device, checkpoint)
    return ScoreFn(
        lambda im, p: torch.tensor([s for _, _, s in judge.judge(im, p)]),  # cpu: ScoreFn moves them to the images
        differentiable=False,
        parts=Offloaded(judge.parts, device, False),
    )


def geneval_accuracy(device, checkpoint=None) -> Reward:
    """GenEval's verdict per image, 1 or 0, as its official evaluator gives it (the number the papers' GenEval tables
    average, per task and overall; common.evaluate prints them)."""
    judge = _geneval("geneval_accuracy", device, checkpoint)
    return ScoreFn(
        lambda im, p: torch.tensor([float(c) for c, _, _ in judge.judge(im, p)]),  # cpu: ScoreFn moves them
        differentiable=False,
        parts=Offloaded(judge.parts, device, False),
    )


# ---------------------------------------------------------------- HPSv2.1 (open_clip)
def hps_pixels(images: torch.Tensor, size: int = 224) -> torch.Tensor:
    """HPS's eval transform on tensors: resize the longest side to `size`, pad to square with black, normalise.

    HPS applies ToTensor before its resize, so it resizes float tensors (bicubic, antialiased, unclamped)
    exactly as here; pad offsets are (size - side) // 2 on the left/top. (B,3,H,W) -> (B,3,size,size).
    """
    from open_clip import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD  # deferred: slow, only the HPSv2.1 reward uses it

    h, w = images.shape[-2:]
    scale = size / max(h, w)
    nh, nw = round(h * scale), round(w * scale)
    x = F.interpolate(images, size=(nh, nw), mode="bicubic", antialias=True, align_corners=False)
    ph, pw = size - nh, size - nw
    x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))  # zeros = black, before normalisation as HPS
    mean = torch.tensor(OPENAI_DATASET_MEAN, device=x.device).view(3, 1, 1)
    std = torch.tensor(OPENAI_DATASET_STD, device=x.device).view(3, 1, 1)
    return (x - mean) / std


def hpsv2_1(device, checkpoint=None, arch="ViT-H-14") -> Reward:
    """HPSv2.1: cosine between the open_clip image and text embeddings of each image-prompt pair.

    The HPS checkpoint holds the whole CLIP model, so the LAION ViT-H base weights are never needed.
    Runs in fp32 (HPS's own scorer uses CUDA autocast); wrap calls in torch.autocast to save memory.
    `arch` exists for tests (a tiny registered open_clip config).
    """
    import open_clip  # deferred: slow, only the HPSv2.1 reward uses it

    if checkpoint is None:
        checkpoint = _hub_file("hpsv2.1")
    elif not os.path.isfile(checkpoint):
        raise InputError(f"--reward-ckpt hpsv2.1={checkpoint}: no such file (expected HPS_v2.1_compressed.pt)")
    with torch.device(device):  # the random init that the checkpoint overwrites: 12 s for ViT-H-14 on a CPU core
        model = open_clip.create_model(arch, pretrained=None)
    # the state-dict keys of HPS's vendored open_clip and of open_clip_torch 3.x match one to one (strict load);
    # mmap: the 3.9 GB file is read once, straight into the model's tensors
    try:
        model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)["state_dict"])
    except Exception as e:  # not a torch file, no "state_dict", other keys or shapes: not an HPSv2.1 checkpoint
        raise InputError(
            f"--reward-ckpt hpsv2.1={checkpoint}: not an HPS_v2.1 checkpoint ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''})"
        ) from None
    model.to(device).eval().requires_grad_(False)
    tokenizer = open_clip.get_tokenizer(arch)
    size = model.visual.image_size[0]  # (224, 224) for ViT-H-14

    def score(images, prompts):
        image_features = model.encode_image(hps_pixels(images.to(device, torch.float32), size), normalize=True)  # (B,D)
        text_features = model.encode_text(tokenizer(prompts).to(device), normalize=True)  # (B,D)
        return (image_features * text_features).sum(-1)  # diag of image @ text.T, as HPS

    return ScoreFn(score, differentiable=True, parts=Offloaded([model], device, False))


# ---------------------------------------------------------------- transformers CLIP: PickScore, CLIP score
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)  # OpenAI CLIP's


def crop_pixels(images, short, crop, mean, std, rounded=False) -> torch.Tensor:
    """Resize-then-centre-crop preprocessing on tensors, (B,3,H,W) in [0,1] -> (B,3,*crop) normalised: shortest side
    to `short` (long side truncated to int, as transformers and torchvision), bicubic antialiased, clamped to [0,1]
    (the originals resize uint8 images, which clips the bicubic overshoot), centre crop with the offset floored
    (transformers) or rounded (`rounded`, torchvision), then (x - mean) / std."""
    (ch, cw), (h, w) = crop, images.shape[-2:]
    nh, nw = (short, int(short * w / h)) if h < w else (int(short * h / w), short)
    x = F.interpolate(images, size=(nh, nw), mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
    top, left = (round((nh - ch) / 2), round((nw - cw) / 2)) if rounded else ((nh - ch) // 2, (nw - cw) // 2)
    x = x[..., top : top + ch, left : left + cw]
    mean = torch.tensor(mean, device=x.device).view(3, 1, 1)
    std = torch.tensor(std, device=x.device).view(3, 1, 1)
    return (x - mean) / std


def clip_pixels(images: torch.Tensor, processor) -> torch.Tensor:
    """CLIPImageProcessor on tensors (crop_pixels with the processor's sizes and statistics)."""
    ip = processor.image_processor
    crop = (ip.crop_size["height"], ip.crop_size["width"])
    return crop_pixels(images, ip.size["shortest_edge"], crop, ip.image_mean, ip.image_std)


def _load_clip(name, device, checkpoint, model_id, processor_id):
    from transformers import CLIPModel, CLIPProcessor  # heavy: imported when a CLIP reward is built

    if checkpoint is None:
        _hub_file(name, download=False)  # fails at once, with how to get the weights, when offline and not cached
    try:  # a --reward-ckpt folder holds model, tokenizer and preprocessor config together
        processor = CLIPProcessor.from_pretrained(checkpoint or processor_id)
        model = CLIPModel.from_pretrained(checkpoint or model_id)
    except OSError as e:
        raise InputError(
            f"--reward-ckpt {name}={checkpoint}: not a CLIP model folder ({e})"
            if checkpoint
            else _missing_ckpt(name, *HUB_WEIGHTS[name][2:])
        ) from None
    return model.to(device).eval().requires_grad_(False), processor


def _clip_cosine(model, processor, device, images, prompts):
    """Cosine similarity of each image-prompt pair, (B,)."""
    text = processor.tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt").to(device)
    out = model(**text, pixel_values=clip_pixels(images.to(device, torch.float32), processor))
    return (out.image_embeds * out.text_embeds).sum(-1)  # both L2-normalised by CLIPModel.forward


def pickscore(device, checkpoint=None) -> Reward:
    """PickScore: logit_scale.exp() * cosine, CLIP-H fine-tuned on Pick-a-Pic (scores around 20)."""
    model, processor = _load_clip(
        "pickscore", device, checkpoint, "yuvalkirstain/PickScore_v1", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
    )
    return ScoreFn(
        lambda im, p: model.logit_scale.exp() * _clip_cosine(model, processor, device, im, p),
        differentiable=True,
        parts=Offloaded([model], device, False),
    )


def clip_score(device, checkpoint=None) -> Reward:
    """CLIP score 100 * cosine with CLIP ViT-L/14. Unlike torchmetrics we do NOT clamp at 0: the clamp would
    zero both the reward differences between bad images and their gradient, which RL needs."""
    model, processor = _load_clip(
        "clip", device, checkpoint, "openai/clip-vit-large-patch14", "openai/clip-vit-large-patch14"
    )
    return ScoreFn(
        lambda im, p: 100 * _clip_cosine(model, processor, device, im, p),
        differentiable=True,
        parts=Offloaded([model], device, False),
    )


def source_pixels(prompts, height: int, width: int, device) -> torch.Tensor:
    """(B, 3, height, width) in [0, 1]: each edit prompt's first image (its source; an image-to-video model's first
    frame), cut to the edit's frame as the model kinds cut it (common.edits.cut_to_frame)."""
    from common.edits import EditPrompt, cut_to_frame

    out = []
    for p in prompts:
        if not isinstance(p, EditPrompt):
            raise InputError(f"prompt {p!r} brings no source image, which an edit reward compares the edit with")
        image = cut_to_frame(p.load_images()[0], width, height)
        out.append(torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(height, width, 3))
    return (torch.stack(out).permute(0, 3, 1, 2).float() / 255).to(device)  # cpu: PIL's bytes, then moved


def image_similarity(device, checkpoint=None) -> Reward:
    """Consistency with the source for editing, as Flow-GRPO scores it (its CLIP scorer's image_similarity): the
    cosine of CLIP ViT-L/14's projected image features of the edited image and of its source (the prompt's first
    image, source_pixels), both through CLIP's preprocessing; 1 = the same picture to CLIP. It rewards changing
    nothing, so it is a term beside an instruction-following reward, never alone (docs/editing.md)."""
    model, processor = _load_clip(
        "image_similarity", device, checkpoint, "openai/clip-vit-large-patch14", "openai/clip-vit-large-patch14"
    )

    def features(images):
        out = model.get_image_features(pixel_values=clip_pixels(images.to(device, torch.float32), processor))
        return F.normalize(out.pooler_output, dim=-1)  # (B, D)

    def fn(images, prompts):
        sources = source_pixels(prompts, *images.shape[-2:], device)
        return (features(images) * features(sources)).sum(-1)

    return ScoreFn(fn, differentiable=True, parts=Offloaded([model], device, False))


# ---------------------------------------------------------------- aesthetic score and ImageReward: CLIP / BLIP + MLP
def linear_head(state: dict[str, torch.Tensor], prefix: str = "layers.") -> torch.nn.Sequential:
    """The MLP head of the aesthetic predictor and of ImageReward from its state dict: Linear layers at indices 0, 2,
    4, 6, 7 of an 8-entry nn.Sequential (dropouts between them, off in eval) and no activations, as the originals."""
    layers = [
        torch.nn.Linear(*state[f"{prefix}{i}.weight"].shape[::-1]) if i in (0, 2, 4, 6, 7) else torch.nn.Identity()
        for i in range(8)
    ]
    head = torch.nn.Sequential(*layers)
    head.load_state_dict({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})
    return head


def aesthetic(device, checkpoint=None) -> Reward:
    """LAION aesthetic predictor v2 (improved-aesthetic-predictor, sac+logos+ava1-l14-linearMSE; RLR's "AES"): CLIP
    ViT-L/14's projected image embedding, L2-normalised, through a 5-layer linear MLP (no activations; its dropouts
    are off in eval). Scores about 1-10 (most photos 4-7); the prompt is not used. `checkpoint`: a folder with a CLIP
    ViT-L/14 saved by save_pretrained and the MLP's .pth; None = the hub (openai/clip-vit-large-patch14 and
    trl-lib/ddpo-aesthetic-predictor's aesthetic-model.pth, the same MLP)."""
    if checkpoint is not None and not os.path.isdir(checkpoint):
        raise InputError(
            f"--reward-ckpt aesthetic={checkpoint}: not a folder (expected a CLIP model folder + the .pth)"
        )
    heads = sorted(Path(checkpoint).glob("*.pth")) if checkpoint else [Path(_hub_file("aesthetic"))]
    if len(heads) != 1:
        raise InputError(f"--reward-ckpt aesthetic={checkpoint}: expected one .pth (the MLP) in it, found {len(heads)}")
    clip, processor = _load_clip("aesthetic", device, checkpoint, *[HUB_WEIGHTS["clip"][0]] * 2)
    try:
        head = linear_head(torch.load(heads[0], map_location="cpu", weights_only=True))
    except Exception as e:
        raise InputError(
            f"{heads[0]}: not the aesthetic predictor's MLP ({type(e).__name__}: {str(e)[:200]})"
        ) from None
    head.to(device).eval().requires_grad_(False)

    def score(images, prompts):
        pooled = clip.vision_model(pixel_values=clip_pixels(images.to(device, torch.float32), processor)).pooler_output
        embed = F.normalize(clip.visual_projection(pooled), dim=-1)  # (B, 768)
        return head(embed).squeeze(-1)

    return ScoreFn(score, differentiable=True, parts=Offloaded([clip, head], device, False))


IMAGEREWARD_MEAN, IMAGEREWARD_STD = 0.16717362830052426, 1.0333394966054072  # ImageReward's own score normalisation


def blip_vision_state(state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """BLIP's timm-style ViT state dict -> (transformers BlipVisionConfig kwargs, BlipVisionModel state dict). The
    sizes come from the shapes; the heads from the width, as BLIP's ViT-B and ViT-L both have 64-wide heads."""
    width, depth = state["cls_token"].shape[-1], 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
    patch = state["patch_embed.proj.weight"].shape[-1]
    config = dict(
        hidden_size=width,
        intermediate_size=state["blocks.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=depth,
        num_attention_heads=max(1, width // 64),
        image_size=round(math.sqrt(state["pos_embed"].shape[1] - 1)) * patch,
        patch_size=patch,
        layer_norm_eps=1e-6,  # BLIP's ViT (timm's default is 1e-5)
        hidden_act="gelu",
    )
    renames = (
        ("cls_token", "embeddings.class_embedding"),
        ("pos_embed", "embeddings.position_embedding"),
        ("patch_embed.proj.", "embeddings.patch_embedding."),
        ("norm.", "post_layernorm."),  # the final LayerNorm (only at the start of a key)
        ("blocks.", "encoder.layers."),
    )
    block = (("norm1", "layer_norm1"), ("norm2", "layer_norm2"), ("attn.qkv", "self_attn.qkv"))
    block += (("attn.proj", "self_attn.projection"),)
    out = {}
    for key, value in state.items():
        for old, new in renames:
            if key.startswith(old):
                key = new + key.removeprefix(old)
                break
        for old, new in block:
            key = key.replace(f".{old}.", f".{new}.")
        out[key] = value
    return config, out


def imagereward(device, checkpoint=None) -> Reward:
    """ImageReward (arXiv 2304.05977): BLIP's text encoder reads the prompt while cross-attending to the image
    tokens of BLIP's ViT-L/16 (224 px); its [CLS] output goes through a 5-layer linear MLP, and the score is
    normalised by ImageReward's (mean, std) over its training pairs: 0 is an average image, most fall in [-2, 2].
    Built on transformers' BLIP classes (BlipVisionModel, BlipTextModel) from the upstream state dict; the upstream
    preprocessing (shortest side to 224, bicubic, centre crop, CLIP normalisation) on tensors, so it is
    differentiable. `checkpoint`: a folder with ImageReward.pt and med_config.json (and optionally the BERT
    tokenizer's files); None = the hub (THUDM/ImageReward, tokenizer bert-base-uncased)."""
    # heavy: imported when the reward is built
    from transformers import AutoTokenizer, BlipTextConfig, BlipVisionConfig, BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    if checkpoint is not None and not os.path.isdir(checkpoint):
        raise InputError(
            f"--reward-ckpt imagereward={checkpoint}: not a folder (expected ImageReward.pt, med_config.json)"
        )
    if checkpoint is None:
        weights = Path(_hub_file("imagereward"))
        config_file = huggingface_hub.hf_hub_download(HUB_WEIGHTS["imagereward"][0], "med_config.json")
    else:
        weights, config_file = Path(checkpoint) / "ImageReward.pt", Path(checkpoint) / "med_config.json"
    tokenizer_from = checkpoint if checkpoint and (Path(checkpoint) / "tokenizer_config.json").is_file() else None
    try:
        state = torch.load(weights, map_location="cpu", weights_only=True, mmap=True)
        med = json.loads(Path(config_file).read_text())
        vision_config, vision_state = blip_vision_state(
            {
                k.removeprefix("blip.visual_encoder."): v
                for k, v in state.items()
                if k.startswith("blip.visual_encoder.")
            }
        )
        text_config = BlipTextConfig(
            **{k: med[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")},
            **{k: med[k] for k in ("num_attention_heads", "max_position_embeddings", "layer_norm_eps", "hidden_act")},
            encoder_hidden_size=vision_config["hidden_size"],  # BLIP sets encoder_width to the ViT's width
            pad_token_id=med.get("pad_token_id", 0),
        )
        with torch.device(device):
            vision = BlipVisionModel(BlipVisionConfig(**vision_config))
            text = BlipTextModel(text_config, add_pooling_layer=False)
        vision.load_state_dict(vision_state)
        prefix = "blip.text_encoder."
        text.load_state_dict(
            {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}, strict=False
        )
        missing = set(text.state_dict()) - {k.removeprefix(prefix) for k in state if k.startswith(prefix)}
        if missing:
            raise KeyError(f"text encoder weights missing: {sorted(missing)[:3]}")
        head = linear_head(state, "mlp.layers.")
    except InputError:
        raise
    except Exception as e:  # not a torch file, other keys or shapes: not ImageReward's checkpoint
        raise InputError(
            f"{weights}: not an ImageReward checkpoint with its med_config.json ({type(e).__name__}: {str(e)[:200]})"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_from or "bert-base-uncased")
    except OSError:
        raise InputError(_missing_ckpt("imagereward", "/path/to/folder", HUB_WEIGHTS["imagereward"][3])) from None
    for module in (vision, text, head):
        module.to(device).eval().requires_grad_(False)
    size = vision_config["image_size"]

    def score(images, prompts):
        pixels = crop_pixels(images.to(device, torch.float32), size, (size, size), CLIP_MEAN, CLIP_STD, rounded=True)
        image_tokens = vision(pixel_values=pixels).last_hidden_state  # (B, 1 + patches, D_vision)
        ids = tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt").to(device)
        out = text(
            input_ids=ids.input_ids,
            attention_mask=ids.attention_mask,
            encoder_hidden_states=image_tokens,
            encoder_attention_mask=torch.ones(image_tokens.shape[:2], dtype=torch.long, device=device),
        )
        features = out.last_hidden_state[:, 0]  # (B, D_text): the [CLS] token after cross-attention to the image
        return (head(features).squeeze(-1) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD

    return ScoreFn(score, differentiable=True, parts=Offloaded([vision, text, head], device, False))


# ---------------------------------------------------------------- HPSv3: Qwen2-VL-7B + a head (common/hpsv3.py)
def hpsv3(device, checkpoint=None, dtype=torch.bfloat16) -> Reward:
    """HPSv3 (arXiv 2508.03789): Qwen2-VL-7B-Instruct reads the image and the prompt, an MLP at its added reward token
    gives [mu, log sigma]; the score is mu (higher = preferred). The model, its input and its weights' loading are
    common/hpsv3.py (our code, imported here: it loads Qwen2-VL's modules). `checkpoint`: a folder with
    HPSv3.safetensors and Qwen2-VL-7B-Instruct's config and processor files; None = the hub (MizzenAI/HPSv3,
    Qwen/Qwen2-VL-7B-Instruct). `dtype`: the Qwen2-VL body's (bf16, as the official; the head is fp32; tests use
    fp32)."""
    from common.hpsv3 import QWEN, hpsv3_pixels, hpsv3_tokens, load_hpsv3

    how = HUB_WEIGHTS["hpsv3"][3]
    if checkpoint is None:
        weights, qwen, missing = _hub_file("hpsv3"), QWEN, _missing_ckpt("hpsv3", *HUB_WEIGHTS["hpsv3"][2:])
    else:
        weights, qwen, missing = Path(checkpoint) / "HPSv3.safetensors", checkpoint, None
        if not os.path.isdir(checkpoint):
            raise InputError(
                f"--reward-ckpt hpsv3={checkpoint}: not a folder (expected HPSv3.safetensors and {QWEN}'s config and "
                f"processor files; to get them: {how})"
            )
        if not weights.is_file():
            raise InputError(f"--reward-ckpt hpsv3={checkpoint}: no HPSv3.safetensors in it; to get it: {how}")
    model, processor = load_hpsv3(str(weights), qwen, device, dtype, missing)
    merge = processor.image_processor.merge_size

    def score(images, prompts):
        pixels, grid = hpsv3_pixels(images.to(device, torch.float32), processor.image_processor)  # (N,1176), (B,3)
        tokens = hpsv3_tokens(processor, prompts, int(grid[0].prod()) // merge**2)  # (B,L), right-padded
        out = model(tokens["input_ids"].to(device), tokens["attention_mask"].to(device), pixels, grid)  # (B,2)
        return out[:, 0]  # mu; out[:, 1] is log sigma, the model's uncertainty

    return ScoreFn(score, differentiable=True, parts=Offloaded([model], device, False))


# ---------------------------------------------------------------- video: motion without flicker
def temporal(device, checkpoint=None) -> Reward:
    """Smooth motion of a video, differentiable: mean |x_{f+1} - x_f| - mean |x_{f+1} - 2 x_f + x_{f-1}| over
    frames (B,F,3,H,W) average-pooled to at most 64 px (the pixel noise of one frame averages out). A still video
    scores 0, steady motion about its speed (its second differences vanish), flicker and noise below 0 (frames that
    alternate A, B, A: first differences d, second 2d). Alone it rewards any smooth motion, fast or slow: weight
    it next to an image reward (docs/video.md)."""
    _no_ckpt("temporal", checkpoint)

    def score(videos, prompts):
        B, n = videos.shape[:2]
        assert n >= 3, "a second difference needs 3 frames"  # checked at start-up (common.runs.check_run_args)
        x = videos.flatten(0, 1)  # (B F, 3, H, W)
        side = min(64, *x.shape[-2:])
        x = F.adaptive_avg_pool2d(x, (side, side * x.shape[-1] // x.shape[-2])).view(B, n, -1)
        d1, d2 = x.diff(dim=1), x.diff(n=2, dim=1)
        return d1.abs().mean((1, 2)) - d2.abs().mean((1, 2))

    return ScoreFn(score, differentiable=True, video=True)


def frame_subset(num_frames: int, k: int) -> list[int]:
    """k evenly spaced frame indices of num_frames, the first and the last among them (all when k >= num_frames)."""
    if k >= num_frames:
        return list(range(num_frames))
    return [round(i * (num_frames - 1) / (k - 1)) for i in range(k)] if k > 1 else [num_frames // 2]


# ---------------------------------------------------------------- the registry and the parsed --reward
@dataclass(frozen=True)
class RewardKind:
    """What `--reward NAME` builds, and what the start-up checks know of it before anything is built."""

    factory: Callable[..., Reward]  # factory(device, checkpoint=None) -> Reward
    differentiable: bool  # gradients reach the images (RLR's first-order term needs them)
    video: bool = False  # scores videos (B,F,3,H,W), so needs a video model
    judge: bool = False  # a VLM judge: scored only by an OpenAI-compatible server (--reward-url NAME=URL)
    shapesbench: bool = False  # scores ShapesBench's 32 px images against its prompts: --model-id shapesbench only
    edit: bool = False  # compares an edit with its source: needs prompts with images (common/edits.py)


REWARDS: dict[str, RewardKind] = {}
ALIASES = {"hps": "hpsv2.1"}


def register_reward(
    name: str,
    factory: Callable[..., Reward],
    differentiable: bool,
    video: bool = False,
    judge: bool = False,
    shapesbench: bool = False,
    edit: bool = False,
) -> None:
    """Let `--reward name` build factory(device, checkpoint=None) -> Reward (e.g. a ScoreFn), from any file: a fork
    calls this at import time, before cli() reads the flags, and nothing in common/ changes. The other arguments are
    RewardKind's."""
    if name in REWARDS or name in ALIASES:
        raise ValueError(f"reward {name!r} is registered already")
    REWARDS[name] = RewardKind(factory, differentiable, video, judge, shapesbench, edit)


def unregister_reward(name: str) -> RewardKind:
    """Take `name` out of the registry and return its entry (a test that registered a reward ends with this; a fork
    replacing a reward of common/ unregisters it, then registers its own under the same name)."""
    if name not in REWARDS:
        raise ValueError(f"reward {name!r} is not registered")
    return REWARDS.pop(name)


def _judge(name: str) -> Callable[..., Reward]:
    def factory(device, checkpoint=None):  # checkpoint: the server's URL (--reward-url), which build_reward routes here
        if checkpoint is None:
            raise InputError(_needs_url(name))
        if REWARDS[name].edit:  # the judge sees each edit's source too
            sources = lambda prompts, h, w: source_pixels(prompts, h, w, "cpu")  # noqa: E731
            return EditJudge(name, checkpoint, sources, os.environ.get("REWARD_API_KEY"))
        return Judge(name, checkpoint, os.environ.get("REWARD_API_KEY"))

    return factory


def _needs_url(name: str) -> str:
    return (
        f"--reward {name} is a VLM judge served over HTTP: give --reward-url {name}=http://HOST:PORT/v1, an "
        f"OpenAI-compatible server (e.g. `vllm serve CodeGoat24/UnifiedReward-qwen-7b`; docs/models.md)"
    )


for _name, _factory, _differentiable, _flags in (
    ("shapes", shapes_reward, True, {"shapesbench": True}),
    ("verifier", verifier, False, {"shapesbench": True}),
    ("jpeg", jpeg, False, {}),
    ("hpsv2.1", hpsv2_1, True, {}),
    ("pickscore", pickscore, True, {}),
    ("clip", clip_score, True, {}),
    ("image_similarity", image_similarity, True, {"edit": True}),
    ("aesthetic", aesthetic, True, {}),
    ("imagereward", imagereward, True, {}),
    ("hpsv3", hpsv3, True, {}),
    ("temporal", temporal, True, {"video": True}),
    ("unifiedreward", _judge("unifiedreward"), False, {"judge": True}),
    ("ocr", ocr, False, {}),
    ("ocr_judge", _judge("ocr_judge"), False, {"judge": True}),
    ("edit_judge", _judge("edit_judge"), False, {"judge": True, "edit": True}),
    ("geneval", geneval, False, {}),
    ("geneval_accuracy", geneval_accuracy, False, {}),
):
    register_reward(_name, _factory, _differentiable, **_flags)


def _canonical(name: str, flag: str = "--reward") -> str:
    name = ALIASES.get(name, name)
    if name not in REWARDS:
        valid = ", ".join(sorted(REWARDS)) + "".join(f" ({a} = {n})" for a, n in ALIASES.items())
        raise InputError(f"{flag}: unknown reward '{name}'; valid names: {valid}")
    return name


@dataclass(frozen=True)
class Component:
    """One term of --reward: the registered name, its weight, and where its weights are (`path`, --reward-ckpt) or
    which server scores it (`url`, --reward-url), if given."""

    name: str
    weight: float
    path: str | None = None
    url: str | None = None

    @property
    def kind(self) -> RewardKind:
        return REWARDS[self.name]

    @property
    def differentiable(self) -> bool:  # a reward scored by another process passes no gradient back
        return self.kind.differentiable and self.url is None


@dataclass(frozen=True)
class RewardSpec:
    """--reward, --reward-ckpt and --reward-url parsed once (parse_rewards), read by every later step: the checks
    (check_rewards), build_reward, the scripts and the evaluation."""

    text: str  # --reward as given, for messages
    components: tuple[Component, ...]

    @property
    def weights(self) -> dict[str, float]:
        return {c.name: c.weight for c in self.components}

    def path(self, name: str) -> str | None:
        """--reward-ckpt's path for `name` (None: the default weights)."""
        return next((c.path for c in self.components if c.name == name), None)


def parse_rewards(spec: str, ckpts=(), urls=()) -> RewardSpec:
    """--reward 'shapes:1.0,verifier:0.5' (a bare name has weight 1.0) with the --reward-ckpt NAME=PATH and
    --reward-url NAME=URL items -> a RewardSpec; InputError naming the flag for a malformed item, an unknown or
    repeated name, a path or URL for a reward the spec does not use, or both for one reward."""
    fmt = f"expected --reward name:weight,name:weight (e.g. shapes:1.0,verifier:0.5), got {spec!r}"
    weights = {}
    for item in spec.split(","):
        name, _, weight = item.rpartition(":") if ":" in item else (item, "", "1")
        name, weight = name.strip(), weight.strip()
        try:
            w = float(weight)
        except ValueError:
            raise InputError(f"bad weight {weight!r} for '{name}': {fmt}") from None
        if not name or not math.isfinite(w):
            raise InputError(f"bad entry {item!r}: {fmt}")
        name = _canonical(name)
        if name in weights:
            raise InputError(f"reward '{name}' given twice: {fmt}")
        weights[name] = w
    where: dict[str, tuple[str, str]] = {}  # name -> (flag, path or URL)
    for flag, items, what in (("--reward-ckpt", ckpts, "PATH"), ("--reward-url", urls, "URL")):
        for item in items:
            if "=" not in item:
                raise InputError(f"{flag} {item!r}: expected NAME={what}")
            name, value = item.split("=", 1)
            if flag == "--reward-url" and not value.startswith(("http://", "https://")):
                raise InputError(f"--reward-url {name}={value}: expected an http(s):// URL")
            name = _canonical(name, "--reward-ckpt")
            if name in where:
                raise InputError(f"{name}: give one --reward-ckpt or --reward-url, not two")
            where[name] = (flag, value)
    unused = sorted(set(where) - set(weights))
    if unused:
        raise InputError(f"--reward-ckpt or --reward-url given for {unused}, which --reward {spec!r} does not use")
    components = []
    for name, w in weights.items():
        flag, value = where.get(name, (None, None))
        path, url = (value, None) if flag == "--reward-ckpt" else (None, value)
        components.append(Component(name, w, path, url))
    return RewardSpec(spec, tuple(components))


# HPSv3 reads the prompt inside Qwen2-VL's chat template: a special token written in a prompt (<|image_pad|>, ...)
# shifts the image's slots, and the decoder's time grows with the prompt's length (200k characters: minutes a batch)
CHAT_TOKEN = re.compile(r"<\|[^<>|\s]*\|>")
PROMPT_CHARS = {"hpsv3": 2000}


def check_reward_prompts(spec: RewardSpec, prompts: list[str], flag: str) -> None:
    """Prompts every reward of `spec` can read, before anything loads: ShapesBench's (weight 0 too: they are logged)
    only ShapesBench prompts; for a weighted HPSv3, none holding a special token of its chat template and none over
    2,000 characters; for OCR (weight 0 too), each with text between straight double quotes, as OCR's score divides
    by its length; one `error:` line naming the flag and the prompt."""
    if any(c.kind.shapesbench for c in spec.components):
        check_shapesbench_prompts(prompts, flag)
    from common.edits import EditPrompt  # cheap; here as the other prompt rules

    for c in spec.components:
        if c.kind.edit and (i := next((i for i, p in enumerate(prompts, 1) if not isinstance(p, EditPrompt)), 0)):
            raise InputError(
                f"{flag}: prompt {i} brings no source image, and --reward {c.name} compares an edit with its source: "
                "give an edit file (docs/editing.md) and a model that edits"
            )
    if "ocr" in spec.weights:
        from common.ocr import ocr_target  # here: --help does not import the OCR rule

        for i, prompt in enumerate(prompts, 1):
            if ocr_target(prompt) is None:
                raise InputError(
                    f"{flag}: prompt {i} quotes no text for ocr to read: it reads the first span between straight "
                    f'double quotes, e.g. a sign that says "OPEN"'
                )
    if {"geneval", "geneval_accuracy"} & set(spec.weights):
        from common.geneval import geneval_metadata  # here: --help does not import GenEval's rules

        for i, prompt in enumerate(prompts, 1):
            if geneval_metadata(prompt) is None:
                raise InputError(
                    f"{flag}: prompt {i} is not one of GenEval's templates, so geneval cannot tell what to look for "
                    f"({prompt[:80]!r}; e.g. 'a photo of two cats', 'a photo of a red car and a blue bench'; "
                    "python -m common.prompts geneval writes its 553 prompts)"
                )
    for name, cap in PROMPT_CHARS.items():
        if not spec.weights.get(name):
            continue
        for i, prompt in enumerate(prompts, 1):
            if token := CHAT_TOKEN.search(prompt):
                raise InputError(f"{flag}: prompt {i} holds {token.group()}, a special token of {name}'s chat template")
            if len(prompt) > cap:
                raise InputError(f"{flag}: prompt {i} has {len(prompt):,} characters; {name} reads at most {cap:,}")


def check_shapesbench_prompts(prompts: list[str], flag: str) -> None:
    """Prompts ShapesBench's verifier and learned reward can read ('a <colour> <shape> on a <colour> background'; on
    ShapesBench-Edit an instruction of its templates that fits its source image), checked before anything is
    sampled: one `error:` line naming the flag and the first prompt that is not one."""
    from common.edits import EditPrompt
    from common.shapesbench.edit import source_images, target_captions
    from common.shapesbench.world import parse_prompt  # here: --help does not import the world

    for i, prompt in enumerate(prompts, 1):
        try:
            if isinstance(prompt, EditPrompt):
                target_captions(source_images([prompt]), [prompt.text])
            else:
                parse_prompt(prompt)
        except ValueError as e:
            raise InputError(f"{flag}: prompt {i}: {e}") from None


def check_rewards(
    spec: RewardSpec,
    video: bool = False,
    real_model: str | None = None,
    frames: int | None = None,
    differentiable: bool = False,
) -> None:
    """Every check of the rewards, before anything loads: not every weight 0; a gradient through every weighted
    reward where the script needs one (`differentiable`, RLR); a video reward only with a video model (`video`;
    `frames` the video's frame count, a frame-to-frame reward needs 2); ShapesBench's rewards only on ShapesBench
    (`real_model`: the --model-id of any other model); a judge only through --reward-url, whose server answers now
    (one try); a --reward-ckpt path that exists; hub-hosted weights cached or downloadable (one quick check, no
    retries)."""
    if all(c.weight == 0 for c in spec.components):
        raise InputError(f"--reward {spec.text}: every weight is 0, so no reward trains the model (weight 0 logs only)")
    bad = [c.name for c in spec.components if differentiable and c.weight != 0 and not c.differentiable]
    if bad:
        good = ", ".join(n for n, k in REWARDS.items() if k.differentiable and not k.video)
        raise InputError(
            f"--reward {spec.text}: {', '.join(bad)} is not differentiable, and this script backpropagates through "
            f"the reward (RLR's first-order term); use a differentiable one ({good}, not served over --reward-url) "
            "or give it weight 0 to log it"
        )
    shapes = [c.name for c in spec.components if c.kind.shapesbench]
    if real_model is not None and shapes:
        raise InputError(
            f"--reward {spec.text}: {' and '.join(shapes)} {'is' if len(shapes) == 1 else 'are'} ShapesBench's, for "
            f"--model-id shapesbench only; with --model-id {real_model} pass a reward of real images, e.g. --reward "
            "hpsv2.1 (or pickscore, clip, aesthetic, jpeg)"
        )
    moving = [c.name for c in spec.components if c.kind.video]
    if moving and frames == 1:
        raise InputError(
            f"--reward {spec.text}: {' and '.join(moving)} compares neighbouring frames, and --num-frames 1 gives one"
        )
    for c in spec.components:
        if c.kind.video and not video:
            raise InputError(f"--reward {spec.text}: '{c.name}' scores videos, and --model-id gives images")
        if c.kind.judge and c.url is None:
            raise InputError(_needs_url(c.name))
        if c.kind.edit and not c.kind.judge and c.url is not None:
            raise InputError(
                f"--reward-url {c.name}: an edit reward reads each prompt's source image, which a served request does "
                "not carry; score it in this process (drop --reward-url)"
            )
        if c.url is not None:  # the server answers now (one try), or the run does not start
            where = f"{c.url.rstrip('/')}/{'models' if c.kind.judge else 'health'}"
            request_json(where, token=os.environ.get("REWARD_API_KEY"), timeout=10, tries=1)
        elif c.path is not None and not os.path.exists(c.path):
            raise InputError(f"--reward-ckpt {c.name}={c.path}: no such file or folder")
        elif c.path is not None and c.name in ("geneval", "geneval_accuracy"):
            from common.geneval import check_geneval_folder  # here: its configs and headers, nothing loaded

            check_geneval_folder(c.path, f"--reward-ckpt {c.name}")
        elif c.path is None and c.name in HUB_WEIGHTS:
            _hub_file(c.name, download=False)


class CompositeReward:
    """Weighted sum of rewards; also returns each component's raw scores (detached, for logging/advantages).

    A component with weight 0 is computed for logging only, without autograd. Videos (B,F,3,H,W): an image reward
    scores `frames` evenly spaced frames of each (frame_subset) and gives their mean.
    """

    def __init__(
        self, components: list[tuple[str, float, Reward]], frames: int = 4, spec: RewardSpec | None = None, check=True
    ):
        """`spec`: the parsed --reward, if any; `check`: refuse a non-finite score (off only for the memory plan's
        tensors, which have shapes and no values)."""
        self.components, self.frames, self.spec, self.check = components, frames, spec, check
        self._workers, self.wait_s = {}, 0.0  # request(): one thread per served component; collect()'s wait
        self.weights = {name: w for name, w, _ in components}
        self.differentiable = all(r.differentiable for _, w, r in components if w != 0)

    def _score(self, reward, images, prompts):
        if images.ndim == 4 or reward.video:
            return reward(images, prompts)
        idx = frame_subset(images.shape[1], self.frames)
        frames = images[:, idx].flatten(0, 1)  # (B k, 3, H, W): video-major, so prompts repeat k times each
        return reward(frames, [p for p in prompts for _ in idx]).view(len(images), len(idx)).mean(1)

    def __call__(self, images, prompts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(total (B,), parts): the weighted sum, and each component's raw scores (detached) by name."""
        return self._combine(images, prompts, {})

    def request(self, images, prompts) -> tuple:
        """Start scoring one rollout chunk (no gradients): the components served over HTTP are asked now, each on its
        own background thread, so that their answers arrive while the next chunk is sampled; the local ones score all
        chunks at once in collect(). Returns the handle that collect() takes."""
        served = {
            name: self._workers.setdefault(name, ThreadPoolExecutor(1)).submit(self._served, reward, images, prompts)
            for name, _, reward in self.components
            if isinstance(reward, (Judge, Served))
        }
        return images, list(prompts), served

    @torch.no_grad()
    def collect(self, handles: list) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """What __call__ gives, without gradients, on the concatenation of the chunks of `handles` (request()'s), in
        order; a served component's failure raises here. self.wait_s: the seconds spent waiting for served scores."""
        images, prompts = torch.cat([h[0] for h in handles]), [p for h in handles for p in h[1]]
        start = time.perf_counter()
        try:
            served = {name: [h[2][name].result() for h in handles] for name in handles[0][2]}
        except Exception:  # the run stops: the requests still queued are not sent
            for future in (f for h in handles for f in h[2].values()):
                future.cancel()
            raise
        self.wait_s = time.perf_counter() - start
        served = {name: tuple(torch.cat(x) for x in zip(*chunks)) for name, chunks in served.items()}
        return self._combine(images, prompts, served)

    def _served(self, reward, images, prompts):  # on a worker thread: one chunk's (scores, unparsed flags)
        scores = self._score(reward, images, prompts)
        return scores, self._unparsed(reward, len(images))

    @staticmethod
    def _unparsed(reward, n: int) -> torch.Tensor:
        """(n,) the fraction of each image's judge answers (one per scored frame) that gave no score; 0 for a reward
        that is not a judge. Read right after the reward's call, which sets it."""
        if isinstance(reward, Judge):
            return reward.unparsed.view(n, -1).mean(1)
        return torch.zeros(n)  # cpu: a placeholder: _combine keeps the flags of a judge only

    def _combine(self, images, prompts, served: dict):
        total = torch.zeros(len(images), device=images.device)  # (B,)
        scores = {}
        for name, w, reward in self.components:
            if name in served:
                r, unparsed = (x.to(images.device) for x in served[name])
            else:
                with torch.set_grad_enabled(torch.is_grad_enabled() and w != 0):
                    r = self._score(reward, images, prompts)  # (B,)
                unparsed = self._unparsed(reward, len(images))
            bad = ~torch.isfinite(r.detach()) if self.check else None
            if (
                bad is not None and bad.any()
            ):  # a score that is not a number never trains (nor is averaged into an evaluation)
                k = int(bad.nonzero()[0])
                raise RunError(
                    f"reward '{name}' gave {r[k].item()} for image {k} (prompt {prompts[k]!r}), not a finite number; "
                    f"{STOPS}"
                )
            if w != 0:
                total = total + w * r
            scores[name] = r.detach()
            if isinstance(reward, Judge):  # 1 where the judge's answer gave no score (logged as a fraction)
                scores[f"{name}_unparsed"] = unparsed
        if self.check:
            self._check_total(total.detach(), prompts)
        return total, scores

    def _check_total(self, total: torch.Tensor, prompts) -> None:
        """RunError unless the weighted sum is finite and small enough that any group's mean and standard deviation
        of it are too (four times the sum of its squares finite in its dtype: no deviation's square, no sum of a
        subset overflows), since that is what trains: finite scores times their weights can still overflow."""
        bad = ~torch.isfinite(total)
        if bad.any():
            k = int(bad.nonzero()[0])
            what = f"is {total[k].item()} for image {k} (prompt {prompts[k]!r})"
        elif not torch.isfinite(4 * total.square().sum()):
            k = int(total.abs().argmax())
            what = f"reaches {total[k].item():.3g} (image {k}), too large for its batch's mean and spread to be finite"
        else:
            return
        spec = self.spec.text if self.spec is not None else ",".join(f"{n}:{w:g}" for n, w, _ in self.components)
        raise RunError(
            f"the rewards' weighted sum (--reward {spec}) {what}, though each score was finite; check the weights "
            f"and the scores; {STOPS}"
        )

    def park(self) -> None:
        """With --offload-frozen, the reward networks back to the CPU (they come back when scoring)."""
        for _, _, reward in self.components:
            reward.parts.park()


def build_reward(spec: RewardSpec, device, offload: bool = False, frames: int = 4) -> CompositeReward:
    """Build the composite of a parsed --reward. With `offload` (--offload-frozen) the reward networks wait on the CPU
    between scorings (common/offload.py). `frames` (--reward-frames): frames of each video an image reward scores."""
    token, components = os.environ.get("REWARD_API_KEY"), []
    for c in spec.components:
        if c.url is not None and not c.kind.judge:  # a registered reward hosted by `python -m common.rewards serve`
            reward = Served(c.name, c.url, token)
        else:
            reward = c.kind.factory(device, c.url if c.kind.judge else c.path)
        if reward.differentiable != c.differentiable:  # a registration that says otherwise misleads the checks
            raise ValueError(f"reward {c.name!r} was registered with differentiable={c.kind.differentiable}")
        components.append((c.name, c.weight, reward))
    composite = CompositeReward(components, frames, spec)
    for _, _, reward in composite.components:
        reward.parts.enabled = offload
    composite.park()
    return composite


def _give_back_freed_buffers() -> None:
    """glibc only (elsewhere nothing): every buffer over 1 MB (a request's body, a decoded image) is mapped on its
    own and given back to the system when freed. By default glibc raises that threshold after the first such free
    and each connection's thread keeps its own arena's peak: 8 connections at the caps then hold 332 MB where the
    same requests need 167 MB (tests/test_server.py measures the bound of docs/models.md)."""
    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed at 1 MB
    except (OSError, AttributeError):  # not glibc
        pass


@dataclass
class ServeArgs:
    """`python -m common.rewards serve --reward hpsv2.1,aesthetic --port 8100`: host registered rewards for training
    runs elsewhere (`--reward-url hpsv2.1=http://HOST:8100`); docs/models.md gives the schema."""

    reward: str
    """comma-separated registered rewards, e.g. hpsv2.1,aesthetic"""
    reward_ckpt: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """NAME=PATH, as the training scripts take"""
    host: str = "127.0.0.1"
    """address to bind (127.0.0.1: this machine only)"""
    port: Annotated[int, Ge(0), Le(65535)] = 8100
    """TCP port (0: any free one)"""
    device: Annotated[Optional[str], tyro.conf.arg(help_behavior_hint="(default: cuda on a GPU machine, else cpu)")] = (
        None
    )
    """where the reward models score"""
    attention_backend: Literal["auto", "flash", "efficient", "math", "cudnn"] = "auto"
    """attention kernels of the reward models (common/attention.py; auto: no cuDNN)"""
    max_batch: Annotated[int, Ge(1), Le(65536)] = 64
    """images per request, at most"""
    max_mb: Annotated[float, Gt(0), Le(65536)] = 64.0
    """request body size in MB, at most"""
    max_pixels: Annotated[int, Ge(1), Le(2**36)] = 2**25
    """decoded pixels per request, all its images together (and so per image), at most; read from each PNG's header
    before it is decoded (default 2**25: 64 images of 720x720, 32 of 1024x1024)"""
    max_prompt_chars: Annotated[int, Ge(1), Le(10**7)] = 2000
    """characters per prompt, at most"""
    max_connections: Annotated[int, Ge(1), Le(10000)] = 8
    """connections at once, at most (one more is answered 429)"""
    request_deadline: Annotated[float, Gt(0), Le(86400)] = 60.0
    """seconds a request may take to arrive whole, headers and body, from its connection (else 408)"""


SERVE = "python -m common.rewards serve"


def serve_main(argv: list[str] | None = None) -> None:
    """`python -m common.rewards serve [flags]` (ServeArgs): every flag checked against the range declared beside
    it, the device and the address before any reward loads; a bad one is one `error:` line, exit status 2."""

    def refuse(message: str, status: int = 2):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(status)

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv.pop(0)
    elif not {"-h", "--help"} & set(argv):
        refuse(f"the command is `{SERVE}`, not `{' '.join(['python -m common.rewards', *argv])}`")
    a = parse_flags(ServeArgs, argv, command=SERVE)
    try:
        check_numbers(a)  # every number finite and within the range declared beside it
    except InputError as e:
        refuse(str(e))
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(a.device)
    except (RuntimeError, ValueError) as e:
        refuse(f"--device {a.device!r} is not a device ({str(e).splitlines()[0][:200]})")
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu...: whether this machine has it
    if backend is not None and hasattr(backend, "is_available") and not backend.is_available():
        refuse(f"--device {a.device}: this machine has no {device.type} device")
    if device.index is not None and hasattr(backend, "device_count") and device.index >= backend.device_count():
        refuse(f"--device {a.device}: this machine has {backend.device_count()} {device.type} devices")
    from common.remote import serve  # here, not at the top: tests patch common.remote.serve

    try:
        print(set_attention_backend(a.attention_backend, a.device))
        spec = parse_rewards(a.reward, a.reward_ckpt)
        names = [c.name for c in spec.components]
        bad = [c.name for c in spec.components if c.kind.judge or c.kind.video]
        if bad:
            raise InputError(f"--reward {a.reward}: {', '.join(bad)} cannot be served here (judges and video rewards)")
    except InputError as e:
        raise SystemExit(f"error: {e}") from None
    token = os.environ.get("REWARD_API_KEY")
    rewards = {}  # loaded below, once the address is bound: a port in use is told before minutes of loading
    try:
        server = serve(
            lambda n, im, p: rewards[n](im.to(a.device), p),
            names,
            a.host,
            a.port,
            token,
            a.max_batch,
            a.max_mb,
            a.max_pixels,
            max_prompt_chars=a.max_prompt_chars,
            max_connections=a.max_connections,
            request_deadline=a.request_deadline,
        )
    except socket.gaierror as e:
        refuse(f"--host {a.host}: no such address ({e.strerror})")
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EACCES):  # a right flag; the port is taken, or needs privileges
            hint = "another server there? --port 0 takes a free one" if e.errno == errno.EADDRINUSE else "under 1024?"
            refuse(f"--port {a.port}: {e.strerror} ({hint})", 1)
        refuse(f"--host {a.host} --port {a.port}: cannot listen there ({e.strerror or e})")
    try:
        rewards.update({c.name: c.kind.factory(a.device, c.path) for c in spec.components})
    except InputError as e:
        raise SystemExit(f"error: {e}") from None
    _give_back_freed_buffers()
    print(
        f"serving {names} at http://{a.host}:{server.server_port} (GET /health, POST /score); token: {token is not None}",
        flush=True,  # a log or a pipe reads it now, not when the buffer fills
    )
    server.serve_forever()


if __name__ == "__main__":
    serve_main()
