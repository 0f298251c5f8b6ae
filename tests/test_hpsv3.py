"""HPSv3 (common/hpsv3.py) against its official code, the `hpsv3` 1.0.0 package (installed by scripts/setup.sh without
its requirements), on a tiny random Qwen2-VL (tests/tiny.py build_tiny_qwen2vl) in fp32.

The package cannot be imported whole under transformers 5: its __init__ imports its trainer module, which imports
transformers 4's trainer helpers (DistributedTensorGatherer, ...) and trl. So the test runs the official definitions
themselves, read from the package's files and executed here: Qwen2VLRewardModelBT (the model), create_model_and_processor
(the added token, the resized embeddings, the fp32 head), HPSv3RewardInferencer.prepare_batch and .reward (the input,
the score), the instruction constants, and the package's own dataset/utils.py (smart resize, the PIL resize). Three
bridges to transformers 5, each named where it is made: from_pretrained gets the config's decoder width at the top
(transformers 4's Qwen2VLConfig had it there) and no use_cache; the official forward, written for transformers 4's
Qwen2VLForConditionalGeneration (`self.model` the decoder, `self.visual` the vision tower returning merged features),
runs on a view of transformers 5's modules with those names; the processor's mm_token_type_ids, a transformers 5 output
the official forward does not take, is left out of its call."""

import ast
import importlib.util
import inspect
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional  # noqa: UP035 (the official code's annotations)

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from torch import nn

from common import InputError
from common.hpsv3 import PIXELS, REWARD_TOKEN, hpsv3_pixels, hpsv3_tokens, load_hpsv3, smart_resize
from tests.tiny import build_tiny_qwen2vl

HPSV3_PACKAGE = importlib.util.find_spec("hpsv3")  # found without importing it
PROMPTS = ["a red circle on a blue background", "a cat"]  # different lengths: the right padding is exercised


def official_definitions(root: Path, relpath: str, names: list[str], namespace: dict) -> dict:
    """Execute the top-level definitions `names` of the package's file `relpath` (unchanged, compiled under their own
    file name) in `namespace`, which supplies what they use."""
    tree = ast.parse((root / relpath).read_text())
    nodes = [
        n
        for n in tree.body
        if getattr(n, "name", None) in names or (isinstance(n, ast.Assign) and n.targets[0].id in names)
    ]
    assert len(nodes) == len(names), f"{relpath}: not all of {names} found"
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(root / relpath), "exec"), namespace)
    return namespace


def randomize(model: nn.Module, seed: int) -> None:
    """Weights of unit gain (N(0, 1/fan_in)), norms near 1, biases near 0 but not 0: the default 0.02 init makes
    every image score alike, and an error would not show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            elif "norm" in name or "ln_q" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    """The official model and inferencer on a tiny Qwen2-VL folder, and that folder with the official model's weights
    saved as HPSv3.safetensors in the old key layout (transformers 4's `model.*` decoder, `visual.*` tower), as
    MizzenAI/HPSv3's file has them."""
    assert HPSV3_PACKAGE is not None, "the hpsv3 package is missing: run scripts/setup.sh"
    from transformers import AutoConfig, AutoProcessor, Qwen2VLForConditionalGeneration

    root = Path(HPSV3_PACKAGE.submodule_search_locations[0])
    spec = importlib.util.spec_from_file_location("hpsv3_dataset_utils", root / "dataset" / "utils.py")
    vision = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vision)  # the official smart_resize, fetch_image, process_vision_info
    ns = dict(torch=torch, nn=nn, Optional=Optional, List=List, Mapping=Mapping, AutoProcessor=AutoProcessor)
    ns.update(Qwen2VLForConditionalGeneration=Qwen2VLForConditionalGeneration, flash_attn=None)
    ns.update(process_vision_info=vision.process_vision_info)
    ns.update(get_quantization_config=lambda config: None, get_kbit_device_map=lambda: None)  # trl's; no quantization
    official_definitions(root, "model/qwen2vl_trainer.py", ["Qwen2VLRewardModelBT"], ns)
    constants = ["INSTRUCTION", "prompt_with_special_token", "prompt_without_special_token"]
    official_definitions(root, "dataset/data_collator_qwen.py", constants, ns)
    official_definitions(root, "inference.py", ["HPSv3RewardInferencer"], ns)
    BT = ns["Qwen2VLRewardModelBT"]

    def from_pretrained(path, *args, use_cache, **kwargs):  # bridge 1 (use_cache: no cache when scoring anyway)
        config = AutoConfig.from_pretrained(path)
        config.hidden_size = config.text_config.hidden_size  # transformers 4's Qwen2VLConfig had it at the top
        return BT.from_pretrained(path, *args, config=config, **kwargs)

    train_ns = {**ns, "Qwen2VLRewardModelBT": SimpleNamespace(from_pretrained=from_pretrained)}
    official_definitions(root, "train.py", ["create_model_and_processor"], train_ns)
    folder = build_tiny_qwen2vl(tmp_path_factory.mktemp("hpsv3") / "hpsv3")
    # HPSv3_7B.yaml's model settings; fp32 instead of its bf16 (CPU: the official head's CUDA autocast is off here)
    model_config = SimpleNamespace(
        torch_dtype="float32", model_revision=None, model_name_or_path=str(folder), use_special_tokens=True,
        output_dim=2, reward_token="special", rm_head_type="ranknet", rm_head_kwargs=None,
    )  # fmt: skip
    args = SimpleNamespace(disable_flash_attn2=True, bf16=False, fp16=False)
    model, processor, _ = train_ns["create_model_and_processor"](model_config, SimpleNamespace(lora_enable=False), args)
    randomize(model, 1)
    model.eval()

    class Decoder:  # bridge 2: transformers 4's `self.model`, the decoder
        def __init__(self, decoder):
            self.decoder, self.embed_tokens = decoder, decoder.embed_tokens

        def __call__(self, **kwargs):
            return self.decoder(**kwargs)

    class Visual:  # bridge 2: transformers 4's `self.visual`, which returned the merged features
        def __init__(self, visual):
            self.visual, self.get_dtype = visual, visual.get_dtype

        def __call__(self, pixel_values, grid_thw):
            return self.visual(pixel_values, grid_thw=grid_thw).pooler_output

    view = SimpleNamespace(config=model.config, rm_head=model.rm_head, reward_token=model.reward_token)
    view.special_token_ids = model.special_token_ids
    view.model, view.visual = Decoder(model.model.language_model), Visual(model.model.visual)
    takes = inspect.signature(BT.forward).parameters

    def forward(**batch):  # bridge 3: only what the official forward takes
        return BT.forward(view, **{k: v for k, v in batch.items() if k in takes})

    inferencer = object.__new__(ns["HPSv3RewardInferencer"])  # its __init__ reads a yaml and downloads the 7B
    inferencer.model, inferencer.processor, inferencer.device, inferencer.use_special_tokens = (
        forward,
        processor,
        "cpu",
        True,
    )
    old = {}
    for key, value in model.state_dict().items():  # transformers 5's names -> transformers 4's, as HPSv3.safetensors
        for new, before in (("model.language_model.", "model."), ("model.visual.", "visual.")):
            if key.startswith(new):
                key = before + key.removeprefix(new)
        old[key] = value.contiguous()
    save_file(old, folder / "HPSv3.safetensors")

    def create(dtype: str, bf16: bool):  # the official model as create_model_and_processor makes it
        config = SimpleNamespace(**{**vars(model_config), "torch_dtype": dtype})
        return train_ns["create_model_and_processor"](config, SimpleNamespace(lora_enable=False), SimpleNamespace(
            disable_flash_attn2=True, bf16=bf16, fp16=False))[0]  # fmt: skip

    return SimpleNamespace(folder=folder, inferencer=inferencer, vision=vision, state=model.state_dict(), create=create)


@pytest.fixture(scope="module")
def ours(official):
    """Our model and processor from the folder (the old-layout HPSv3.safetensors), in fp32."""
    return load_hpsv3(str(official.folder / "HPSv3.safetensors"), str(official.folder), "cpu", torch.float32)


def uint8_images(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


def as_tensor(arrays) -> torch.Tensor:
    return (
        torch.stack([torch.from_numpy(np.array(a)).permute(2, 0, 1) for a in arrays]).float() / 255
    )  # (B,3,H,W) in [0,1]


def test_the_old_key_layout_is_transformers_4s(official):
    names = load_file(official.folder / "HPSv3.safetensors")
    assert {k.split(".")[0] for k in names} == {"model", "visual", "rm_head", "lm_head"}
    assert "model.embed_tokens.weight" in names and "visual.merger.mlp.0.weight" in names
    assert not any(k.startswith(("model.language_model.", "model.visual.")) for k in names)


def test_smart_resize_by_hand_and_as_the_official():
    """At exactly 256*28*28 pixels: 1024x1024 -> 448x448 (beta = 1024/448); 720x1280 -> 336x588, not 308x588 (720 /
    (15/7) = 336 up to a float rounding below it, floored to a multiple of 28 as the official does with the same
    arithmetic); 512x768 -> 364x532 (beta = sqrt(393216/200704) = 1.3997: 365.8 -> 364, 548.7 -> 532); 32x32 -> 448x448
    (too small: ceil(32*14/28)*28)."""
    assert PIXELS == 200704
    by_hand = {(1024, 1024): (448, 448), (720, 1280): (336, 588), (512, 768): (364, 532), (32, 32): (448, 448)}
    for (h, w), size in by_hand.items():
        assert smart_resize(h, w) == size, (h, w)
    spec = importlib.util.spec_from_file_location(
        "hpsv3_utils", Path(HPSV3_PACKAGE.submodule_search_locations[0]) / "dataset" / "utils.py"
    )
    vision = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vision)
    for h in range(16, 2100, 37):
        for w in (h, 2 * h + 3, 512, 1280, 720):
            assert smart_resize(h, w) == vision.smart_resize(h, w, min_pixels=PIXELS, max_pixels=PIXELS), (h, w)


@pytest.mark.parametrize("size", [(1024, 1024), (720, 1280)])
@pytest.mark.parametrize("kind", ["noise", "smooth"])
def test_the_input_matches_the_official(official, ours, size, kind):
    """Token ids, mask and grid equal; pixel values to the rounding of the official uint8 PIL resize (we resize floats,
    differentiably; one uint8 level is 1/255/0.26 = 0.015 after normalisation). Measured: smooth images (bilinear
    upsamplings of 1/16-size noise) max |diff| 0.0155, mean 0.0042; pixel noise, the worst case, mean 0.0041, 99.9th
    percentile 0.013, max 0.079 (1024x1024) and 0.095 (720x1280): PIL rounds and clips to uint8 between its horizontal
    and vertical passes, which cuts the overshoot of a bicubic on noise."""
    _, processor = ours
    arrays = uint8_images([size, size])
    if kind == "smooth":
        small = uint8_images([(size[0] // 16, size[1] // 16)] * 2)
        arrays = [np.asarray(Image.fromarray(a).resize(size[::-1], Image.BILINEAR)) for a in small]
    theirs = official.inferencer.prepare_batch([Image.fromarray(a) for a in arrays], PROMPTS)
    pixels, grid = hpsv3_pixels(as_tensor(arrays), processor.image_processor)
    tokens = hpsv3_tokens(processor, PROMPTS, int(grid[0].prod()) // 4)
    gh, gw = smart_resize(*size)[0] // 14, smart_resize(*size)[1] // 14
    assert grid.tolist() == theirs["image_grid_thw"].tolist() == [[1, gh, gw]] * 2
    assert (theirs["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum(1).tolist() == [
        gh * gw // 4
    ] * 2  # 256 and 252 merged image tokens
    assert torch.equal(tokens["input_ids"], theirs["input_ids"])
    assert torch.equal(tokens["attention_mask"], theirs["attention_mask"])
    assert tokens["attention_mask"][1].sum() < tokens["attention_mask"][0].sum()  # the shorter prompt is right-padded
    reward_id = processor.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
    assert (tokens["input_ids"] == reward_id).sum(1).tolist() == [1, 1]
    assert pixels.shape == theirs["pixel_values"].shape == (2 * gh * gw, 3 * 2 * 14 * 14)
    diff = (pixels - theirs["pixel_values"]).abs()
    assert diff.mean() < 0.005 and diff.max() < (0.016 if kind == "smooth" else 0.1), (diff.mean(), diff.max())
    assert diff.flatten().kthvalue(int(0.999 * diff.numel())).values < 0.014


def test_the_patches_are_in_the_official_order(official, ours):
    """At 448x448 there is no resize, and our pixel values equal theirs to float rounding: the patch order, the
    repeated frame and the normalisation are the same."""
    _, processor = ours
    arrays = uint8_images([(448, 448)], seed=1)
    theirs = official.inferencer.prepare_batch([Image.fromarray(a) for a in arrays], PROMPTS[:1])
    pixels, _ = hpsv3_pixels(as_tensor(arrays), processor.image_processor)
    torch.testing.assert_close(pixels, theirs["pixel_values"], atol=1e-5, rtol=0)


def test_the_score_matches_the_official(official, ours):
    """The same batch (the official prepare_batch's) through both models: [mu, log sigma] to 1e-5 (measured 1.2e-7
    on scores of size ~0.3). End to end at 448x448 (no resize), images as PIL for theirs and as tensors for ours: 1e-5
    (measured 1.5e-7)."""
    model, processor = ours
    arrays = uint8_images([(448, 448)] * 2, seed=2)
    batch = official.inferencer.prepare_batch([Image.fromarray(a) for a in arrays], PROMPTS)
    with torch.no_grad():
        theirs = official.inferencer.model(return_dict=True, **batch)["logits"]  # (2,2)
        mine = model(batch["input_ids"], batch["attention_mask"], batch["pixel_values"], batch["image_grid_thw"])
        reward = official.inferencer.reward([Image.fromarray(a) for a in arrays], PROMPTS)[:, 0]
    assert (theirs[0, 0] - theirs[1, 0]).abs() > 5e-3  # the two score apart, 500 tolerances: an error would show
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    from common.rewards import hpsv3

    scores = hpsv3("cpu", str(official.folder), dtype=torch.float32)(as_tensor(arrays), PROMPTS)
    torch.testing.assert_close(scores, reward, atol=1e-5, rtol=0)


def test_bf16_as_the_official(official):
    """HPSv3_7B.yaml's bf16: the official casts the whole model (model.to(torch.bfloat16)), the rotary inverse
    frequencies included, then the head back to fp32; ours holds the same dtypes, tensor by tensor."""
    theirs = official.create("bfloat16", True)
    ours, _ = load_hpsv3(str(official.folder / "HPSv3.safetensors"), str(official.folder), "cpu")
    rename = {"model.": "body.", "rm_head.": "head."}

    def dtypes(module, prefixes):
        tensors = [*module.named_parameters(), *module.named_buffers()]
        out = {}
        for name, tensor in tensors:
            for old, new in prefixes.items():
                if name.startswith(old):
                    out[new + name.removeprefix(old)] = tensor.dtype
        return out

    mine = dtypes(ours, {"body.": "body.", "head.": "head."})
    assert mine == dtypes(theirs, rename)  # lm_head (which we skip) aside, the same tensors in the same dtypes
    assert mine["body.language_model.rotary_emb.inv_freq"] == torch.bfloat16 and mine["head.0.weight"] == torch.float32


def test_transformers_5s_key_layout_loads_too(official, ours, tmp_path):
    """A checkpoint re-saved by transformers 5 (model.language_model.*, model.visual.*) gives the same model."""
    (tmp_path / "w").mkdir()
    save_file({k: v.contiguous() for k, v in official.state.items()}, tmp_path / "w" / "HPSv3.safetensors")
    model, _ = load_hpsv3(str(tmp_path / "w" / "HPSv3.safetensors"), str(official.folder), "cpu", torch.float32)
    for (key, a), b in zip(model.state_dict().items(), ours[0].state_dict().values()):
        assert torch.equal(a, b), key


def test_a_missing_key_or_a_wrong_shape_is_one_error_line_naming_it(official, tmp_path):
    state = load_file(official.folder / "HPSv3.safetensors")
    cases = {
        "missing": ({k: v for k, v in state.items() if k != "visual.merger.mlp.2.bias"}, "'visual.merger.mlp.2.bias'"),
        "shape": (
            {**state, "model.norm.weight": torch.ones(48)},
            "'model.norm.weight' has shape (48,), expected (32,)",
        ),
        "unknown": ({**state, "score.weight": torch.ones(2)}, "'score.weight' is not part of HPSv3"),
    }
    for name, (broken, words) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(broken, path)
        with pytest.raises(InputError) as e:
            load_hpsv3(str(path), str(official.folder), "cpu", torch.float32)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(InputError, match=r"expected shape \(32,\)"):
        load_hpsv3(str(tmp_path / "missing.safetensors"), str(official.folder), "cpu")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InputError, match="not a safetensors file"):
        load_hpsv3(str(tmp_path / "bad.safetensors"), str(official.folder), "cpu")


def folder_with_config(official, path: Path, text: dict, vision: dict | None = None) -> Path:
    """A copy of the tiny Qwen2-VL folder's config and processor files at `path`, its config.json's top-level (text)
    fields updated with `text` and its vision_config's with `vision`."""
    import json
    import shutil

    shutil.copytree(official.folder, path, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config.update(text)
    config["vision_config"].update(vision or {})
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "text, vision, words",
    [
        ({"num_attention_heads": 0}, {}, "num_attention_heads is 0, not a positive integer"),
        ({"hidden_size": -32}, {}, "hidden_size is -32, not a positive integer"),
        ({"hidden_size": 33}, {}, "hidden_size 33 is not divisible by num_attention_heads 2"),
        ({"num_key_value_heads": 0}, {}, "num_key_value_heads is 0, not a positive integer"),
        ({}, {"num_heads": 0}, "vision_config.num_heads is 0, not a positive integer"),
        ({}, {"num_heads": 3}, "vision_config.embed_dim 16 is not divisible by vision_config.num_heads 3"),
        ({}, {"embed_dim": 24, "num_heads": 4}, "vision_config.embed_dim / vision_config.num_heads = 6"),
        ({}, {"hidden_size": 48}, "vision_config.hidden_size 48 is not hidden_size 32"),
        ({"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 4]}}, {}, "mrope_section [2, 3, 4]"),
        ({"hidden_size": 32.5}, {}, "'hidden_size'"),  # transformers' own type check
        ({"pad_token_id": 10**6}, {}, "HPSv3 cannot be built from it"),  # the embedding's padding row
    ],
    ids=["no heads", "negative width", "width not divisible by heads", "no key-value heads", "no vision heads",
         "vision width not divisible by heads", "vision head not in quarters", "vision width not the text width",
         "mrope sections not half the head", "fractional width", "pad id past the vocabulary"],
)  # fmt: skip
def test_a_config_json_hpsv3_cannot_be_built_from_is_one_error_line_naming_it(official, tmp_path, text, vision, words):
    """A config.json whose sizes Qwen2-VL divides by zero, allocates negative, splits unevenly or cannot pair with
    the weights (a traceback while building the model, or while scoring the first batch) is one InputError naming
    that file and the field, before a model is built."""
    folder = folder_with_config(official, tmp_path / "qwen", text, vision)
    with pytest.raises(InputError) as e:
        load_hpsv3(str(official.folder / "HPSv3.safetensors"), str(folder), "cpu", torch.float32)
    message = str(e.value)
    assert message.startswith(f"{folder}/config.json: ") and words in message and "\n" not in message, message


WIDER = {"hidden_size": 3200, "intermediate_size": 6400, "num_attention_heads": 200, "num_key_value_heads": 100}
VISION_WIDER = {"embed_dim": 1600, "num_heads": 200, "hidden_size": 3200}


@pytest.mark.parametrize(
    "text, vision, words",
    [
        (WIDER, VISION_WIDER, "'visual.patch_embed.proj.weight' has shape (16, 3, 2, 14, 14), expected (1600, 3,"),
        ({**WIDER, "num_hidden_layers": 200}, {**VISION_WIDER, "depth": 100}, "num_hidden_layers 200"),
    ],
    ids=["100x wider", "100x deeper and wider"],
)
def test_a_config_json_of_a_large_model_is_refused_before_it_is_built(official, tmp_path, monkeypatch, text, vision,
                                                                      words):  # fmt: skip
    """The tiny weights (0.46 MB) with a config.json that describes a model 100x as wide (272M parameters, 1.1 GB in
    fp32: every width and head count x100, the head widths kept) or also 100x as deep (20.6B, 82 GB): one InputError
    naming that config.json, and Qwen2-VL is never built on a real device. A build outside the meta device would
    allocate the model the config describes: the wrapper refuses it (so such a loader fails here at once, instead of
    exhausting the memory) and records it."""
    import common.hpsv3

    builds, build = [], common.hpsv3.Qwen2VLModel

    def on_meta_only(config):
        builds.append(torch.get_default_device())
        if builds[-1].type != "meta":
            raise AssertionError(f"Qwen2-VL built on {builds[-1]} from a config.json the weights do not fit")
        return build(config)

    monkeypatch.setattr(common.hpsv3, "Qwen2VLModel", on_meta_only)
    folder = folder_with_config(official, tmp_path / "qwen", text, vision)
    with pytest.raises(InputError) as e:
        load_hpsv3(str(official.folder / "HPSv3.safetensors"), str(folder), "cpu", torch.float32)
    message = str(e.value)
    assert f"{folder}/config.json" in message and words in message and "\n" not in message, message
    assert all(device.type == "meta" for device in builds), builds


def test_reward_hpsv3_scores_images_and_frames_in_a_composite(official):
    """`--reward jpeg:1,hpsv3:0.5 --reward-ckpt hpsv3=FOLDER` (bf16 as a run): a batch of images, then videos, whose
    hpsv3 score is the mean over --reward-frames 2 frames (the first and the last); gradients reach the pixels."""
    from common.rewards import build_reward, check_rewards, parse_rewards

    spec = parse_rewards("jpeg:1,hpsv3:0.5", [f"hpsv3={official.folder}"])
    check_rewards(spec, real_model="flux")
    reward = build_reward(spec, "cpu", frames=2)
    images = as_tensor(uint8_images([(64, 96)] * 2, seed=3)).requires_grad_(True)
    total, parts = reward(images, PROMPTS)
    torch.testing.assert_close(total, parts["jpeg"] + 0.5 * parts["hpsv3"])
    assert parts["hpsv3"].dtype == torch.float32 and torch.isfinite(parts["hpsv3"]).all()
    total.sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0
    videos = as_tensor(uint8_images([(64, 96)] * 6, seed=4)).view(2, 3, 3, 64, 96)  # (B,F,3,H,W)
    with torch.no_grad():
        _, parts = reward(videos, PROMPTS)
        hpsv3 = reward.components[1][2]
        frames = torch.stack([hpsv3(videos[:, f], PROMPTS) for f in (0, 2)], 1).mean(1)
    torch.testing.assert_close(parts["hpsv3"], frames)


def test_missing_weights_fail_at_start_up_with_one_error_line(tmp_path, monkeypatch):
    """The reward server and the scripts print an InputError as one `error:` line: no folder, a folder without
    HPSv3.safetensors, and (offline, nothing cached) no --reward-ckpt at all."""
    import huggingface_hub

    from common.rewards import build_reward, check_rewards, parse_rewards, serve_main

    (tmp_path / "empty").mkdir()
    for value, words in ((tmp_path / "none", "not a folder"), (tmp_path / "empty", "no HPSv3.safetensors in it")):
        with pytest.raises(SystemExit) as e:
            serve_main(["serve", "--reward", "hpsv3", "--reward-ckpt", f"hpsv3={value}", "--device", "cpu"])
        message = str(e.value.code)
        assert message.startswith("error: --reward-ckpt hpsv3=") and words in message and "\n" not in message, message
        assert "hf download MizzenAI/HPSv3 HPSv3.safetensors" in message
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    for start in (lambda: check_rewards(parse_rewards("jpeg:1,hpsv3:0.5"), real_model="flux"), lambda: build_reward(
        parse_rewards("hpsv3"), "cpu")):  # fmt: skip
        with pytest.raises(InputError, match="hpsv3.*--reward-ckpt hpsv3=/path/to/folder.*hf download MizzenAI/HPSv3"):
            start()


def test_dancegrpo_trains_and_the_evaluator_scores_with_reward_hpsv3(official, tmp_path):
    """dancegrpo.py on a tiny FLUX.1 with `--reward hpsv3` (the tiny HPSv3, bf16): one iteration trains, its reward
    logged and finite; then `python -m common.evaluate --reward jpeg:1,hpsv3:0.5` scores its weights and the base."""
    import json
    import math

    import tyro

    from common import evaluate as E
    from tests.helpers import find_run, metrics, run_in_process
    from tests.tiny import build_flux

    build_flux(tmp_path / "flux")
    (tmp_path / "p.txt").write_text("a cat\na dog\n")
    flags = ["--model-id", str(tmp_path / "flux"), "--resolution", "32", "--prompts", str(tmp_path / "p.txt"),
             "--eval-prompts", str(tmp_path / "p.txt"), "--reward", "hpsv3", "--reward-ckpt", f"hpsv3={official.folder}",
             "--guidance-scale", "3.5", "--iterations", "1", "--samples-per-device", "4", "--group-size", "4",
             "--rollout-batch-size", "4", "--samples-per-update", "4", "--num-steps", "3", "--eval-every", "0",
             "--sample-every", "0", "--lora", "--lora-rank", "4", "--exp-name", "flux"]  # fmt: skip
    run_in_process("dancegrpo.py", flags, tmp_path)
    train = [r for r in metrics(find_run(tmp_path / "flux")) if "losses/policy" in r]
    assert len(train) == 1 and math.isfinite(train[0]["rewards/hpsv3"]), train
    assert train[0]["rewards/hpsv3"] != 0
    argv = ["--model-id", str(tmp_path / "flux"), "--resolution", "32", "--weights", str(find_run(tmp_path / "flux") /
            "final"), "--prompts", str(tmp_path / "p.txt"), "--reward", "jpeg:1,hpsv3:0.5", "--reward-ckpt",
            f"hpsv3={official.folder}", "--samples-per-prompt", "2", "--num-steps", "2", "--guidance-scale", "3.5",
            "--batch-size", "4", "--out", str(tmp_path / "eval")]  # fmt: skip
    E.main(tyro.cli(E.EvalArgs, args=argv))  # `python -m common.evaluate`: the trained weights against the base
    figures = json.loads((tmp_path / "eval" / "results.json").read_text())["figures"]
    assert len(figures) == 2 and all(math.isfinite(f["reward_hpsv3"]) for f in figures.values()), figures


def test_a_prompt_hpsv3_cannot_read_is_refused_at_start_up(tmp_path, monkeypatch):
    """A prompt holding a special token of HPSv3's chat template broke its image slots mid-run (a traceback in
    training and evaluation); one of 200k characters ran for minutes. Both are one line before anything loads."""
    from common import InputError
    from common.rewards import check_reward_prompts, parse_rewards

    spec = parse_rewards("hpsv3", [], [])
    check_reward_prompts(spec, ["a red circle", "x" * 2000], "--prompts")  # fine: at the cap
    with pytest.raises(InputError) as e:
        check_reward_prompts(spec, ["a red circle", "a cat <|image_pad|> on a mat"], "--prompts")
    assert str(e.value) == "--prompts: prompt 2 holds <|image_pad|>, a special token of hpsv3's chat template"
    with pytest.raises(InputError) as e:
        check_reward_prompts(spec, ["y" * 2001], "--eval-prompts")
    assert str(e.value) == "--eval-prompts: prompt 1 has 2,001 characters; hpsv3 reads at most 2,000"
    check_reward_prompts(parse_rewards("jpeg", [], []), ["<|image_pad|>" * 300], "--prompts")  # no HPSv3: any text
    # through a script's start-up: the prompt file is read and checked before a model or the reward loads
    import common.flags
    import dancegrpo

    monkeypatch.setattr(common.flags, "check_rewards", lambda *a, **k: None)  # no hub here: the weights' check
    monkeypatch.setattr(common.flags, "check_not_shapesbench", lambda args: None)
    (tmp_path / "p.txt").write_text("a dog\n<|vision_start|> a cat\n")
    args = dancegrpo.Args(reward="hpsv3", prompts=str(tmp_path / "p.txt"), eval_prompts=str(tmp_path / "p.txt"))
    with pytest.raises(InputError, match=r"^--prompts: prompt 2 holds <\|vision_start\|>"):
        dancegrpo.resolve_and_check(args)
