"""The memory plan's fake-tensor world (shapes, dtypes and sizes without data), CUDA's autocast policy on the CPU,
the memory tracker and the builders of the frozen parts (text encoders, reward models). Part of
benchmarks/gpu/memory.py, whose docstring describes the plan.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only


# ---------------------------------------------------------------------------------------------------
# The fake-tensor world and the memory tracker
# ---------------------------------------------------------------------------------------------------
def _fake_apply(self, fn, recurse=True):
    """nn.Module._apply for fake tensors: `module.to(...)` swaps parameter tensors, which fake tensors refuse
    ("Couldn't swap"); assigning `.data` works and frees the old storage just the same."""
    if recurse:
        for child in self.children():
            child._apply(fn)
    with torch.no_grad():
        for p in self._parameters.values():
            if p is not None:
                p.data = fn(p)
    for key, b in self._buffers.items():
        if b is not None:
            self._buffers[key] = fn(b)
    return self


_WORLD: list = []  # the FakeTensorMode of the fake_world being run


@contextlib.contextmanager
def fake_world():
    """Build and run modules with fake tensors on the CPU: shapes, dtypes and sizes without data or compute."""
    import diffusers
    from torch._subclasses.fake_tensor import FakeTensorMode

    diffusers.utils.logging.set_verbosity_error()  # "modules that should be kept in float32: []" on every .to(dtype)
    original = torch.nn.Module._apply
    torch.nn.Module._apply = _fake_apply
    try:
        with FakeTensorMode() as mode, torch.device("cpu"):
            _WORLD.append(mode)
            yield
    finally:
        torch.nn.Module._apply = original
        _WORLD.clear()


# CUDA autocast computes these in fp32 (and returns fp32) where CPU autocast keeps the input dtype
_FP32_OPS = {
    F.layer_norm, F.group_norm, F.softmax, F.log_softmax, torch.layer_norm, torch.group_norm, torch.softmax,
    torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax, torch.pow, torch.Tensor.pow,
    torch.Tensor.__pow__, torch.exp, torch.Tensor.exp, torch.log, torch.Tensor.log, torch.rsqrt, torch.Tensor.rsqrt,
}  # fmt: skip


class _CudaAutocastPolicy(TorchFunctionMode):
    """Inside CPU autocast, run CUDA autocast's fp32 ops in fp32, so activations get the dtypes they have on a GPU
    (e.g. a LayerNorm output is fp32 there, and so is the modulation that follows it in FLUX / SD3 blocks)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FP32_OPS and torch.is_autocast_enabled("cpu"):
            up = lambda t: t.float() if t.dtype in (torch.bfloat16, torch.float16) else t
            args, kwargs = tree_map_only(torch.Tensor, up, (args, kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def autocast(mixed_precision: str):
    """The scripts' `accelerator.autocast()`: bf16 autocast with CUDA's op policy under --mixed-precision bf16."""
    if mixed_precision != "bf16":
        yield
        return
    with torch.autocast("cpu", dtype=torch.bfloat16), _CudaAutocastPolicy():
        yield


def checkpoint_under_policy(module, *args):
    """diffusers' default gradient checkpointing (non-reentrant torch.utils.checkpoint), whose recomputation in the
    backward also runs under _CudaAutocastPolicy: torch.utils.checkpoint restores the autocast state there, but a
    function mode is not active inside the backward call."""
    from torch.utils.checkpoint import checkpoint

    policy = lambda: (contextlib.nullcontext(), _CudaAutocastPolicy())
    return checkpoint(module.__call__, *args, use_reentrant=False, context_fn=policy)


class _NoHook:
    def remove(self):
        pass


class Tracker(MemTracker):
    """MemTracker, for the device-wide peak only. The stock tracker also keeps every module's own peak, walking every
    tracked module at every op (minutes per forward for FLUX's 3000 modules), installs gradient hooks on frozen
    parameters too, which fails ("cannot register a hook on a tensor that doesn't require gradient"), and refuses a
    second top-level call of a module (a KL reference forward, RLR's sub-chain), taking it for a second iteration."""

    def _pre_fw_hook(self, module, inputs) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                del self.memory_tracking[module]  # its per-module stats start again; the device peak is unaffected
        super()._pre_fw_hook(module, inputs)

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        for p in module.parameters():
            if not p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if snap["Total"] > self._peak_mem.get(dev, 0):
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)


def _total(snapshot: dict) -> int:
    return sum(s["Total"] for s in snapshot.values())


def measure(run, *resident, tracker: MemTracker | None = None) -> int:
    """Peak bytes that `run()` allocates on top of `resident` (every module, optimizer and tensor it uses that exists
    before it: the tracker must know them, or their first use would count as new memory). `tracker`: one to use
    (and read in hooks), instead of a new one."""
    tracker = tracker or Tracker()
    with warnings.catch_warnings():  # AdamW's state holds a None per parameter, which the tracker reports and skips
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
        tracker.track_external(*resident)
        with tracker:
            start = _total(tracker.get_tracker_snapshot())
            run()
    return _total(tracker.get_tracker_snapshot("peak")) - start


def nbytes(*tensors_or_modules) -> int:
    """Bytes of tensors, or of the parameters and buffers of modules."""
    n = 0
    for x in tensors_or_modules:
        if isinstance(x, torch.nn.Module):
            n += sum(t.numel() * t.element_size() for t in [*x.parameters(), *x.buffers()])
        elif x is not None:
            n += x.numel() * x.element_size()
    return n


# ---------------------------------------------------------------------------------------------------
# Building the parts (inside fake_world)
# ---------------------------------------------------------------------------------------------------
def build_text_encoder(family: str, config: dict, dtype, with_projection: bool):
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
        UMT5Config,
        UMT5EncoderModel,
    )

    if family == "t5":
        return T5EncoderModel(T5Config(**config)).to(dtype).eval()
    if family == "umt5":
        return UMT5EncoderModel(UMT5Config(**config)).to(dtype).eval()
    if family == "mistral3":  # FLUX.2 [dev]'s: the whole Mistral3 model (language model, vision tower, LM head)
        from transformers import Mistral3Config, Mistral3ForConditionalGeneration

        return Mistral3ForConditionalGeneration(Mistral3Config(**config)).to(dtype).eval()
    if family == "qwen3":  # FLUX.2 [klein]'s: the causal LM as the pipeline loads it
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(**config)).to(dtype).eval()
    if family == "qwen25vl":  # the whole VL model, as QwenImagePipeline loads it (its vision tower unused)
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config)).to(dtype).eval()
    if family == "clip_vision":  # an image encoder travelling with the text encoders (Wan2.1-I2V's CLIP ViT-H/14)
        from transformers import CLIPVisionConfig, CLIPVisionModel

        return CLIPVisionModel(CLIPVisionConfig(**config)).to(dtype).eval()
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel  # SD3's CLIPs have a projection
    return cls(CLIPTextConfig(**config)).to(dtype).eval()


def build_reward(name: str, config: dict | None):
    """A reward network as common/rewards.py loads it: HPSv2.1's CLIP in fp32 (hpsv2_1 never casts it), HPSv3's
    Qwen2-VL in bf16 with its fp32 head and the added reward token (one more embedding row), GenEval's Mask2Former
    and CLIP ViT-L/14 in fp32 (`config`: their two configs), image_similarity's CLIP ViT-L/14 in fp32 (both towers, as
    _load_clip loads CLIPModel)."""
    import logging

    import open_clip

    if name == "image_similarity":
        from transformers import CLIPConfig, CLIPModel

        return CLIPModel(CLIPConfig(**config)).eval()
    if name in ("geneval", "geneval_accuracy"):  # the detector and the colour classifier, fp32 (load_geneval)
        from transformers import CLIPConfig, CLIPModel, Mask2FormerConfig, Mask2FormerForUniversalSegmentation

        detector, clip = config
        detector = {**detector, "backbone_config": dict(detector["backbone_config"])}  # the config pops model_type
        parts = {"detector": Mask2FormerForUniversalSegmentation(Mask2FormerConfig(**detector))}
        return torch.nn.ModuleDict({**parts, "clip": CLIPModel(CLIPConfig(**clip))}).eval()
    if name == "hpsv3":
        from transformers import Qwen2VLConfig

        from common.hpsv3 import HPSv3

        config = Qwen2VLConfig(**{**config, "vocab_size": config["vocab_size"] + 1})  # + <|Reward|>
        config._attn_implementation = "sdpa"  # transformers' default on a GPU
        return HPSv3(config, reward_token_id=config.text_config.vocab_size - 1).eval()
    if config is not None:
        return open_clip.CLIP(**config).eval()
    root, level = logging.getLogger(), logging.getLogger().level
    root.setLevel(logging.ERROR)  # not "No pretrained weights loaded for model 'ViT-H-14'": none are wanted
    try:
        return open_clip.create_model("ViT-H-14", pretrained=None).eval()
    finally:
        root.setLevel(level)


def encode_text(encoders, batch: int):
    """The pipelines' prompt encoding: every text encoder on `batch` prompts padded to its token count (an image
    encoder among them, family clip_vision, is left to the kind's Plan.encode)."""
    with torch.no_grad():
        for family, module, tokens in encoders:
            if family == "clip_vision":
                continue
            ids = torch.zeros(batch, tokens, dtype=torch.long)
            if family == "umt5":  # WanPipeline passes the attention mask, then zeroes the embeddings past each prompt
                out = module(ids, torch.ones_like(ids)).last_hidden_state
                torch.stack([torch.cat([u[:1], u.new_zeros(tokens - 1, u.shape[1])]) for u in out])
                continue
            if family in ("qwen3", "mistral3"):  # every hidden state (the pipeline stacks three), with the mask
                module(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, use_cache=False)
                continue
            if family == "qwen25vl":  # the last hidden layer of the language model, with the mask
                module(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
                continue
            module(ids, output_hidden_states=family == "clip")  # SD3 reads CLIP's penultimate hidden states
