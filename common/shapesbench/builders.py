"""Builders of the tiny ShapesBench model components (tokenizer, CLIP text encoder, SD3 transformer, CLIP reward
model), randomly initialised here, trained by `python -m common.shapesbench.train_flow` / `.train_reward`; the VAE
(at VAE_PATH) is built and trained by `python -m common.shapesbench.train_vae`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.shapesbench.world import COLOUR_NAMES, SHAPES, SIZE

FLOW_PATH = Path(__file__).resolve().parent / "assets" / "flow"
VAE_PATH = Path(__file__).resolve().parent / "assets" / "vae"

BOS, EOS, UNK = "<|startoftext|>", "<|endoftext|>", "<unk>"
MAX_TOKENS = 12  # bos + 7 words + eos fits; longer prompts are truncated


def build_tokenizer():
    """A word-level tokenizer over the ShapesBench vocabulary, built offline in memory (no merges to clash)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["a", "an", "on", "background", *SHAPES, *COLOUR_NAMES]
    vocab = {t: i for i, t in enumerate([BOS, EOS, UNK, *words])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single=f"{BOS} $A {EOS}", special_tokens=[(BOS, 0), (EOS, 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=BOS, eos_token=EOS, pad_token=EOS, unk_token=UNK, model_max_length=MAX_TOKENS
    )


def _text_config(vocab_size: int, hidden: int):
    from transformers import CLIPTextConfig

    # eos_token_id != 2 makes CLIP pool at the first EOS (pad == EOS, so that is the real end of the prompt)
    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=MAX_TOKENS,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        projection_dim=hidden,
    )


def build_flow_components(seed: int = 0, heads: int = 2, layers: int = 4):
    """Randomly initialised (tokenizer, CLIPTextModel, SD3Transformer2DModel) for the ShapesBench flow model.

    The transformer is the class SD3 uses, in pixel space: 3 channels, patch 4 -> 8x8 = 64 tokens,
    width 64 * heads, `layers` joint blocks (defaults: width 128, 4 blocks, about 2.3M parameters; the ShapesBench
    v2 candidate: 3 heads, 5.1M).
    """
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextModel

    torch.manual_seed(seed)
    tok = build_tokenizer()
    text_encoder = CLIPTextModel(_text_config(len(tok), 64))
    transformer = SD3Transformer2DModel(
        sample_size=SIZE,
        patch_size=4,
        in_channels=3,
        out_channels=3,
        num_layers=layers,
        attention_head_dim=64,
        num_attention_heads=heads,
        joint_attention_dim=64,
        caption_projection_dim=64 * heads,
        pooled_projection_dim=64,
        pos_embed_max_size=SIZE // 4,
    )
    return tok, text_encoder, transformer


def build_reward_components(seed: int = 0):
    """Randomly initialised (tokenizer, CLIPModel) for the learned reward: ViT patch 4 on 32x32, width 64."""
    from transformers import CLIPConfig, CLIPModel, CLIPVisionConfig

    torch.manual_seed(seed)
    tok = build_tokenizer()
    text = _text_config(len(tok), 64)
    vision = CLIPVisionConfig(
        image_size=SIZE,
        patch_size=4,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        projection_dim=64,
    )
    config = CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=64)
    return tok, CLIPModel(config)


def save_flow_model(out_dir, transformer, text_encoder, tokenizer) -> None:
    """Write a ShapesBench model folder that `common.models.load_model(out_dir)` reads."""
    out_dir = Path(out_dir)
    transformer.save_pretrained(out_dir / "transformer")
    text_encoder.save_pretrained(out_dir / "text_encoder")
    tokenizer.save_pretrained(out_dir / "tokenizer")
    (out_dir / "model_index.json").write_text(json.dumps({"_class_name": "ShapesBench"}, indent=2))
