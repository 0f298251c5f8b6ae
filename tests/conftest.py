import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest

# Tests never touch a model hub: a stray download must fail fast instead of hanging on retries.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Property tests draw the same examples on every run (CI's verdict does not depend on luck); a new property or a
# larger max_examples still explores, and `--hypothesis-seed` or HYPOTHESIS_PROFILE=explore draws afresh.
from hypothesis import settings  # noqa: E402

settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


# ---------------------------------------------------------------- ImageReward's own code, for test_imagereward.py and
# the end-to-end run with every kind of reward (test_remote.py)
WORDS = "a red green blue circle square triangle on white background of the".split()


def invert_attention_mask(self, mask):
    """transformers 4's ModuleUtilsMixin.invert_attention_mask (removed in 5): (B, T) 1 = attend -> additive bias."""
    import torch

    mask = mask[:, None, None, :].to(self.dtype)
    return (1.0 - mask) * torch.finfo(self.dtype).min


@pytest.fixture(scope="module")
def upstream():
    """The package's ImageReward module, imported under today's libraries: its package __init__s are skipped (they import
    OpenAI's `clip` for other scorers), fairscale is a stub (used only for gradient checkpointing, which is off), and
    three transformers helpers that transformers 5 removed from transformers.modeling_utils are put back (chunked
    feed-forward with chunk size 0 is a plain call; head pruning is never used); three methods its BERT inherited
    from transformers 4 are given back: the tied-weights record (none; transformers 5 makes it in post_init(), which a 4.x-era model never
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
    import torch
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
