"""Builders of the tiny ShapesBench model components, randomly initialised here: the StableDiffusion3Pipeline's parts
(tokenizers, CLIP text encoders, the null T5, the SD3 transformer; the VAE is train_vae.build_vae) and the CLIP
reward model, trained by `python -m common.shapesbench.train_latent` / `.train_vae` / `.train_reward`; and the
attention processor with which ShapesBench computes the pipeline's 256 zero T5 tokens as one. Importing it is cheap, as
the scripts read its constants at start-up: diffusers and transformers are imported inside the builders."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from common.shapesbench.world import COLOUR_NAMES, SHAPES, SIZE

LATENT_PATH = Path(__file__).resolve().parent / "assets" / "latent"  # the base model: a StableDiffusion3Pipeline folder
EDIT_PATH = LATENT_PATH.parent / "edit"  # ShapesBench-Edit: its data (sources/, train.jsonl, eval.jsonl) and model/
VAE_PATH = LATENT_PATH / "vae"  # its VAE, trained first (train_vae.py), frozen while the rest trains (train_latent.py)
# The key in a pipeline folder's model_index.json that says "a ShapesBench model": the scripts then accept ShapesBench's
# prompts and rewards and compute its null T5 tokens as one (common.models.ShapesModel). Diffusers ignores keys that
# start with "_", so the folder still loads with StableDiffusion3Pipeline.from_pretrained.
SHAPESBENCH_KEY = "_shapesbench"

T5_TOKENS = 256  # StableDiffusion3Pipeline's default max_sequence_length: the zero tokens it appends without a T5
SHIFT = 3.0  # the scheduler's shift (SD3's), the schedule of the scripts' sampler and evaluation
BOS, EOS, UNK = "<|startoftext|>", "<|endoftext|>", "<unk>"
MAX_TOKENS = 12  # bos + 7 words + eos fits; longer prompts are truncated


class RepeatedLastTokenJointAttention:
    """Joint (image + text) attention in which the last text token stands for `repeats` identical copies of itself.

    Attention over n identical keys / values is attention over one of them whose logit is raised by log(n), and
    the n identical queries give n identical outputs (text tokens carry no position); so this processor with one
    zero T5 token is exact for the pipeline's `repeats` of them, with a text sequence of 13 tokens instead of 268.
    train_latent.py and common.models.ShapesModel (the scripts) use it; a pipeline loaded from the folder runs
    diffusers' stock joint attention over all the tokens and computes the same outputs.
    """

    def __init__(self, repeats: int):
        self.log_repeats = math.log(repeats)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        if encoder_hidden_states is None:
            raise ValueError("RepeatedLastTokenJointAttention needs the text stream")
        b, n_img = hidden_states.shape[:2]

        def heads(x):
            return x.view(b, -1, attn.heads, x.shape[-1] // attn.heads).transpose(1, 2)

        q, k, v = (heads(f(hidden_states)) for f in (attn.to_q, attn.to_k, attn.to_v))
        cq, ck, cv = (heads(f(encoder_hidden_states)) for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_q is not None:
            q, k = attn.norm_q(q), attn.norm_k(k)
        if attn.norm_added_q is not None:
            cq, ck = attn.norm_added_q(cq), attn.norm_added_k(ck)
        q, k, v = torch.cat([q, cq], 2), torch.cat([k, ck], 2), torch.cat([v, cv], 2)
        bias = torch.zeros(k.shape[2], dtype=q.dtype, device=q.device)
        bias[-1] = self.log_repeats
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.view(1, 1, 1, -1))
        out = out.transpose(1, 2).reshape(b, -1, q.shape[1] * q.shape[3]).to(q.dtype)
        img, txt = out[:, :n_img], out[:, n_img:]
        img = attn.to_out[1](attn.to_out[0](img))
        if not attn.context_pre_only:
            txt = attn.to_add_out(txt)
        return img, txt


def make_pipeline(vae, parts: dict):
    """A StableDiffusion3Pipeline of the VAE, build_latent_components' parts and SD3's scheduler (shift 3)."""
    # heavy: imported when a part is built
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SHIFT)
    return StableDiffusion3Pipeline(vae=vae, scheduler=scheduler, **parts)


def build_tokenizer():
    """A word-level tokenizer over the ShapesBench vocabulary, built offline in memory (no merges to clash)."""
    # heavy: imported when a part is built
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
    # heavy: imported when a part is built
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


def build_reward_components(seed: int = 0):
    """Randomly initialised (tokenizer, CLIPModel) for the learned reward: ViT patch 4 on 32x32, width 64."""
    # heavy: imported when a part is built
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


def build_latent_components(vae_channels: int = 4, seed: int = 0, heads: int = 3, layers: int = 4) -> dict:
    """Randomly initialised parts of the latent-space ShapesBench StableDiffusion3Pipeline (all but the VAE and the
    scheduler), as a dict of its component names: tokenizer, text_encoder, tokenizer_2, text_encoder_2,
    tokenizer_3, text_encoder_3, transformer.

    The two tiny CLIP encoders (CLIPTextModelWithProjection) have builders' text config (width 64); the pipeline
    concatenates their penultimate hidden states to 128 dims (= joint_attention_dim, so no padding) and their
    projected pooled outputs to 128 dims (= pooled_projection_dim). The third encoder is build_null_t5(): SD3's T5
    slot, holding a model whose output is exactly zero, with build_null_tokenizer() (no tokens for any text). The transformer works on the 8x8 VAE latent with patch 1: 64 image tokens, as
    many as the pixel model's patch-4 tokens; sample_size 8 is in latent pixels (the pipeline multiplies by the
    VAE's factor 4 for its default 32x32 output).
    """
    # heavy: imported when a part is built
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection

    torch.manual_seed(seed)
    parts = {"tokenizer": build_tokenizer(), "tokenizer_2": build_tokenizer(), "tokenizer_3": build_null_tokenizer()}
    parts["text_encoder"] = CLIPTextModelWithProjection(_text_config(len(parts["tokenizer"]), 64))
    parts["text_encoder_2"] = CLIPTextModelWithProjection(_text_config(len(parts["tokenizer_2"]), 64))
    parts["text_encoder_3"] = build_null_t5(len(parts["tokenizer"]), 128)  # (its vocab: the others')
    latent = SIZE // 4
    parts["transformer"] = SD3Transformer2DModel(
        sample_size=latent,
        patch_size=1,
        in_channels=vae_channels,
        out_channels=vae_channels,
        num_layers=layers,
        attention_head_dim=64,
        num_attention_heads=heads,
        joint_attention_dim=128,
        caption_projection_dim=64 * heads,
        pooled_projection_dim=128,
        pos_embed_max_size=latent,
    )
    return parts


def build_null_tokenizer():
    """The T5 slot's tokenizer: every text becomes no tokens, so the pipeline's T5 input is max_sequence_length
    paddings whatever the prompt (the null T5 ignores it anyway), and encode_prompt never warns that it truncated."""
    # heavy: imported when a part is built
    from tokenizers import Regex, Tokenizer, models, normalizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({UNK: 0, "<pad>": 1}, unk_token=UNK))
    tk.normalizer = normalizers.Replace(Regex(r"[\s\S]+"), "")
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token=UNK, model_max_length=T5_TOKENS)


def build_null_t5(vocab_size: int, width: int):
    """A T5EncoderModel whose output is exactly zero (no blocks, final RMS-norm weight 0), width `width`.

    It fills SD3's T5 slot: without a T5, StableDiffusion3Pipeline conditions on max_sequence_length zero tokens,
    but a folder whose model_index.json has text_encoder_3 = null only loads with `text_encoder_3=None,
    tokenizer_3=None` passed explicitly; with this one `StableDiffusion3Pipeline.from_pretrained(dir)` loads as is
    and conditions exactly as without a T5. Its parameters must stay frozen (an optimizer would move the norm).
    """
    # heavy: imported when a part is built
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size,
        d_model=width,
        num_layers=0,
        num_heads=1,
        d_kv=8,
        d_ff=8,
        pad_token_id=1,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    model = T5EncoderModel(config)
    with torch.no_grad():
        model.encoder.final_layer_norm.weight.zero_()
    return model.eval().requires_grad_(False)


def mark_shapesbench(folder) -> None:
    """Add SHAPESBENCH_KEY to the model_index.json of a pipeline folder that save_pretrained wrote."""
    index_path = Path(folder) / "model_index.json"
    index = json.loads(index_path.read_text())
    index[SHAPESBENCH_KEY] = (
        "32x32 shapes; prompts 'a {colour} {shape} on a {colour} background'; rewards shapes, verifier"
    )
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
