"""ImageReward against its own code: the `image-reward` 1.5 package (installed by scripts/setup.sh without its pins,
which do not resolve next to transformers 5) builds a tiny random-weight model with its BLIP ViT, its BERT with
cross-attention and its MLP; our `imagereward` loads that state dict into transformers' BLIP classes, and both score
the same images and prompts."""

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.test_rewards import PROMPTS, assert_finite_grad, to_pil, uint8_images

WORDS = "a red green blue circle square triangle on white background of the".split()


def invert_attention_mask(self, mask):
    """transformers 4's ModuleUtilsMixin.invert_attention_mask (removed in 5): (B, T) 1 = attend -> additive bias."""
    mask = mask[:, None, None, :].to(self.dtype)
    return (1.0 - mask) * torch.finfo(self.dtype).min


@pytest.fixture(scope="module")
def upstream():
    """The package's ImageReward module, imported under today's libraries: its package __init__s are skipped (they import
    OpenAI's `clip` for other scorers), fairscale is a stub (used only for gradient checkpointing, which is off), and
    three transformers helpers that transformers 5 removed from transformers.modeling_utils are put back (chunked
    feed-forward with chunk size 0 is a plain call; head pruning is never used), and three methods its BERT inherited from transformers 4 are
    given back: the tied-weights record (none; transformers 5 makes it in post_init(), which a 4.x-era model never
    calls), invert_attention_mask and get_head_mask (no head mask)."""
    import transformers.modeling_utils as modeling_utils

    spec = importlib.util.find_spec("ImageReward")
    assert spec is not None, "the image-reward package is missing: run scripts/setup.sh"
    saved = {k: v for k, v in sys.modules.items() if k == "ImageReward" or k.startswith(("ImageReward.", "fairscale"))}
    root = Path(spec.submodule_search_locations[0])
    fairscale = types.ModuleType("fairscale.nn.checkpoint.checkpoint_activations")
    fairscale.checkpoint_wrapper = lambda module, **_: pytest.fail("gradient checkpointing is off in ImageReward")
    chunked = lambda fn, chunk_size, dim, *inputs: fn(*inputs) if chunk_size == 0 else pytest.fail("chunked")  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        for name, path in (("ImageReward", root), ("ImageReward.models", root / "models")):
            package = types.ModuleType(name)  # the package without its __init__
            package.__path__ = [str(path)]
            mp.setitem(sys.modules, name, package)
        mp.setitem(sys.modules, "fairscale.nn.checkpoint.checkpoint_activations", fairscale)
        for name in ("apply_chunking_to_forward", "find_pruneable_heads_and_indices", "prune_linear_layer"):
            mp.setattr(modeling_utils, name, getattr(modeling_utils, name, chunked), raising=False)
        import ImageReward.ImageReward as module
        from ImageReward.models.BLIP.med import BertConfig, BertModel
        from ImageReward.models.BLIP.vit import VisionTransformer
    BertModel.all_tied_weights_keys = {}  # what post_init() records in transformers 5; this 4.x-era model ties none
    BertModel.invert_attention_mask = invert_attention_mask
    BertModel.get_head_mask = lambda self, head_mask, layers: [None] * layers if head_mask is None else pytest.fail()
    for key in [k for k in sys.modules if k == "ImageReward" or k.startswith("ImageReward.")]:
        sys.modules.pop(key)
    sys.modules.update(saved)
    return module, BertConfig, BertModel, VisionTransformer


@pytest.fixture(scope="module")
def tiny_imagereward(upstream, tmp_path_factory):
    """(upstream model, folder with ImageReward.pt + med_config.json + tokenizer): a ViT of width 128 (two 64-wide heads
    as BLIP's), 32 px patches at 224 px, a 2-layer BERT of width 64, ImageReward's own MLP class; random weights of
    unit gain, biases and LayerNorms away from 0 and 1."""
    from transformers import BertTokenizer

    module, BertConfig, BertModel, VisionTransformer = upstream
    folder = tmp_path_factory.mktemp("imagereward")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tokenizer = BertTokenizer(str(folder / "vocab.txt"))
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})  # as BLIP's
    med = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    med |= dict(num_attention_heads=2, max_position_embeddings=64, layer_norm_eps=1e-12, hidden_act="gelu")
    med |= dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, pad_token_id=0, add_cross_attention=True)
    med |= dict(type_vocab_size=2, initializer_range=0.02, encoder_width=128)
    (folder / "med_config.json").write_text(json.dumps(med))
    tokenizer.save_pretrained(folder)

    torch.manual_seed(0)
    blip = torch.nn.Module()
    blip.visual_encoder = VisionTransformer(img_size=224, patch_size=32, embed_dim=128, depth=2, num_heads=2)
    config = BertConfig.from_json_file(str(folder / "med_config.json"))
    config.encoder_width = 128
    blip.text_encoder = BertModel(config=config, add_pooling_layer=False)
    blip.tokenizer = tokenizer
    with pytest.MonkeyPatch.context() as mp:  # ImageReward() builds BLIP ViT-L: hand it the tiny one
        mp.setattr(module, "BLIP_Pretrain", lambda **_: blip)
        model = module.ImageReward(med_config=str(folder / "med_config.json"), device="cpu")
    model.mlp = module.MLP(64)
    with torch.no_grad():  # unit-gain weights, so that the image, the text and every layer move the score
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0, p[0].numel() ** -0.5)
            else:
                p.normal_(1.0 if "norm" in name.lower() and name.endswith("weight") else 0.0, 0.1)
    torch.save(model.state_dict(), folder / "ImageReward.pt")
    return model.eval(), folder


@pytest.mark.parametrize("size", [(224, 224), (240, 300)])
def test_imagereward_matches_the_package(tiny_imagereward, size):
    """Same pixels (224 px squares, where resize and crop are the identity): to 1e-5
    (a LayerNorm eps of 1e-5 for BLIP's 1e-6 moves them 6e-5). Other sizes: the package
    resizes uint8 PIL images, we resize float tensors (differentiable), so they agree to the rounding of that."""
    from common.rewards import imagereward

    model, folder = tiny_imagereward
    reward = imagereward("cpu", str(folder))
    images = uint8_images(2, *size)
    scores = assert_finite_grad(reward, images, PROMPTS)
    with torch.no_grad():
        expected = torch.tensor([model.score(p, to_pil(x)) for p, x in zip(PROMPTS, images)])
    assert (expected[0] - expected[1]).abs() > 0.1  # the images score apart: the comparison can see an error
    tolerance = 1e-5 if size == (224, 224) else 2e-2 * expected.abs().max().item()
    torch.testing.assert_close(scores, expected, atol=tolerance, rtol=0)


def test_imagereward_refuses_other_checkpoints(tiny_imagereward, tmp_path):
    from common.rewards import imagereward

    with pytest.raises(ValueError, match="not a folder"):
        imagereward("cpu", str(tmp_path / "nothing"))
    (tmp_path / "ImageReward.pt").write_bytes(b"not a torch file")
    (tmp_path / "med_config.json").write_text((Path(tiny_imagereward[1]) / "med_config.json").read_text())
    with pytest.raises(ValueError, match="not an ImageReward checkpoint"):
        imagereward("cpu", str(tmp_path))


def test_imagereward_offline_without_checkpoint(tmp_path, monkeypatch):
    import huggingface_hub

    from common.rewards import build_reward

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="--reward-ckpt imagereward=/path/to/folder"):
        build_reward("imagereward", "cpu")
