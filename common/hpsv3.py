"""HPSv3 (arXiv 2508.03789, section 4), the human-preference reward after HPSv2.1, as `--reward hpsv3`.

Qwen2-VL-7B-Instruct reads one user turn (the image, an instruction holding the prompt, and an added special token
`<|Reward|>`); an MLP head on the last hidden state at that token gives [mu, log sigma] (the paper's uncertainty-aware
ranking loss), and the reward is mu, as the official inference. The code here is ours, on transformers' Qwen2-VL
modules; what it computes follows the official code (the MizzenAI/HPSv3 repository, PyPI `hpsv3` 1.0.0):
- the head and the pooling: hpsv3/model/qwen2vl_trainer.py (Qwen2VLRewardModelBT, rm_head_type "ranknet": Linear(H,
  1024)-ReLU-Dropout(0.05)-Linear(1024,16)-ReLU-Linear(16,2) in fp32, the rest of the model in bf16);
- the added token and the resized embeddings: hpsv3/train.py (create_model_and_processor);
- the input: hpsv3/inference.py (prepare_batch: the image at exactly 256*28*28 pixels after Qwen2-VL's smart resize,
  the instruction of hpsv3/dataset/data_collator_qwen.py, the chat template with the generation prompt, right padding).
The official forward calls the decoder with no position ids, so every token, image tokens too, gets the plain 1-D
position on all three M-RoPE axes (not Qwen2-VL's 3-D image positions): the checkpoint was trained so, and we do the
same. The image preprocessing runs on tensors (differentiable); tests/test_hpsv3.py scores against the official code.
`--reward hpsv3` (common/rewards.py) builds it from a folder or the hub and scores with hpsv3_pixels, hpsv3_tokens
and HPSv3.

Weights: `HPSv3.safetensors` (MizzenAI/HPSv3) holds the whole model in the key layout of the transformers it was
trained with (`model.*` the decoder, `visual.*` the vision tower, `rm_head.*`, `lm_head.*`); match_weights maps it
onto ours (the LM head is not needed: the reward reads hidden states). The config and the processor (tokenizer, chat
template, image statistics) are Qwen/Qwen2-VL-7B-Instruct's; its weights are not needed.
"""

import math
from contextlib import contextmanager

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoConfig, AutoProcessor, Qwen2VLModel

from common import InputError

QWEN = "Qwen/Qwen2-VL-7B-Instruct"  # HPSv3's base model: its config and processor
REWARD_TOKEN = "<|Reward|>"
PIXELS = 256 * 28 * 28  # the official min_pixels = max_pixels: 200704 pixels, 256 merged image tokens
FACTOR = 28  # patch 14 x spatial merge 2: both sides of the resized image are multiples of it
MAX_RATIO = 200  # Qwen2-VL refuses images longer than 200 times their width

# The official instruction (hpsv3/dataset/data_collator_qwen.py, INSTRUCTION and prompt_with_special_token), verbatim:
# the model was trained on these exact tokens (trailing spaces included)
INSTRUCTION = (
    "\nYou are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall "
    "score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being "
    "the best. \n\n**Visual Quality:**  \nEvaluate the overall visual quality of the image. The following "
    "sub-dimensions should be considered:\n- **Reasonableness:** The image should not contain any significant "
    "biological or logical errors, such as abnormal body structures or nonsensical environmental setups.\n- "
    "**Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, "
    "with no blurring or indistinct areas.\n- **Detail Richness:** Consider the level of detail in textures, "
    "materials, lighting, and other visual elements (e.g., hair, clothing, shadows).\n- **Aesthetic and Creativity:** "
    "Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, "
    "and the overall creative appeal. The scene should convey a sense of harmony and balance.\n- **Safety:** The image "
    "should not contain harmful or inappropriate content, such as political, violent, or adult material. If such "
    "content is present, the image quality and satisfaction score should be the lowest possible. \n\n**Text "
    "Alignment:**  \nAssess how well the image matches the textual prompt across the following sub-dimensions:\n- "
    "**Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align "
    "with the textual description. The subject should match the description in terms of number, appearance, and "
    "behavior.\n- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how "
    "well the image adheres to this style.\n- **Contextual Consistency**: Assess whether the background, setting, and "
    "surrounding elements in the image logically fit the scenario described in the prompt. The environment should "
    "support and enhance the subject without contradictions.\n- **Attribute Fidelity**: Check if specific attributes "
    "mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in "
    "the image. Minor deviations may be acceptable, but critical attributes should be preserved.\n- **Semantic "
    "Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The "
    "generated content should not introduce elements that conflict with or distort the original description.\n"
    "Textual prompt - {text_prompt}\n\n\n"
)
ASK = f"\nPlease provide the overall ratings of this image: {REWARD_TOKEN}\n\nEND\n"


# ---------------------------------------------------------------- the input
def smart_resize(height: int, width: int, factor: int = FACTOR, pixels: int = PIXELS) -> tuple[int, int]:
    """Qwen2-VL's smart resize with min_pixels = max_pixels = `pixels` (the official setting): both sides multiples
    of `factor`, the area as close to `pixels` as that allows from the side that is too big or too small, the aspect
    kept. The same float arithmetic as Qwen2-VL's, so that sides on a multiple's edge round as theirs (720 x 1280 ->
    336 x 588: 720 / sqrt(720 * 1280 / 200704) is 336 up to a float rounding)."""
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"HPSv3: an image of {height}x{width} is longer than {MAX_RATIO} times its width")
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > pixels:
        beta = math.sqrt(height * width / pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < pixels:
        beta = math.sqrt(pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def hpsv3_pixels(images: torch.Tensor, image_processor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-VL's image preprocessing on tensors, as HPSv3 sets it, differentiable: (B,3,H,W) in [0,1] ->
    (pixel_values (B*gh*gw, 3*t*p*p), image_grid_thw (B,3) = (1, gh, gw)), with p the patch (14), t the temporal patch
    (2: an image is its own second frame), gh, gw = the resized sides / p. The resize is bicubic and antialiased on
    floats, clamped to [0,1] (the official resizes uint8 PIL images, which clips the overshoot); they agree to that
    rounding. The patches are in Qwen2-VL's order: 2x2 merge groups row-major, each group's four patches row-major,
    each patch's values channel, frame, row, column."""
    p, m, t = image_processor.patch_size, image_processor.merge_size, image_processor.temporal_patch_size
    B, _, H, W = images.shape
    h, w = smart_resize(H, W, factor=p * m)
    x = nn.functional.interpolate(images, size=(h, w), mode="bicubic", antialias=True, align_corners=False)
    mean = torch.tensor(image_processor.image_mean, device=x.device).view(3, 1, 1)
    std = torch.tensor(image_processor.image_std, device=x.device).view(3, 1, 1)
    x = (x.clamp(0, 1) - mean) / std  # (B,3,h,w)
    gh, gw = h // p, w // p
    x = x.unsqueeze(1).expand(B, t, 3, h, w)  # (B,t,3,h,w): the image repeated as a clip of t frames
    x = x.reshape(B, t, 3, gh // m, m, p, gw // m, m, p)
    # -> (B, gh/m, gw/m, m, m, 3, t, p, p): merge group, patch in the group, then channel, frame, pixel row, column
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(B * gh * gw, 3 * t * p * p)
    grid = torch.tensor([[1, gh, gw]] * B, device=x.device)
    return x, grid


def hpsv3_tokens(processor, prompts: list[str], image_tokens: int) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask (B,L), right-padded: the official user turn (the image, then the instruction
    with the prompt and the reward token) through the processor's chat template with the generation prompt, its one
    image placeholder expanded to the image's `image_tokens` merged tokens, as Qwen2VLProcessor does."""
    messages = [
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": INSTRUCTION.format(text_prompt=p) + ASK}],
            }
        ]
        for p in prompts
    ]
    texts = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pad = processor.image_token
    texts = [text.replace(pad, pad * image_tokens) for text in texts]
    return dict(processor.tokenizer(texts, padding=True, return_tensors="pt"))


# ---------------------------------------------------------------- the model
class HPSv3(nn.Module):
    """Qwen2-VL (vision tower and decoder, without the LM head) and HPSv3's head; forward gives [mu, log sigma]."""

    def __init__(self, config, reward_token_id: int, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # built in its dtype: no fp32 copy of 8B parameters on the way
        try:
            self.body = Qwen2VLModel(config)
        finally:
            torch.set_default_dtype(default)
        # the official casts the whole model (model.to(torch.bfloat16)), the rotary inverse frequencies (buffers) too,
        # and was trained so: the same rounded frequencies here
        self.body.to(dtype)
        width = config.text_config.hidden_size
        self.head = nn.Sequential(
            nn.Linear(width, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(), nn.Linear(16, 2)
        ).float()  # fp32, as the official keeps it
        self.image_token_id, self.reward_token_id = config.image_token_id, reward_token_id

    def forward(self, input_ids, attention_mask, pixel_values, image_grid_thw) -> torch.Tensor:
        """input_ids, attention_mask (B,L) (hpsv3_tokens), pixel_values (N,3*t*p*p) and image_grid_thw (B,3)
        (hpsv3_pixels) -> (B,2): [mu, log sigma] at the last `<|Reward|>` token of each row."""
        decoder, visual = self.body.language_model, self.body.visual
        B, L = input_ids.shape
        embeds = decoder.embed_tokens(input_ids)  # (B,L,H)
        image = visual(pixel_values.to(visual.get_dtype()), grid_thw=image_grid_thw).pooler_output  # (N/4, H)
        slots = input_ids == self.image_token_id  # (B,L): one per merged image token
        if int(slots.sum()) != len(image):  # a prompt holding <|image_pad|> itself
            raise ValueError(f"HPSv3: {int(slots.sum())} image tokens in the text for {len(image)} image features")
        embeds = embeds.masked_scatter(slots.unsqueeze(-1), image.to(embeds.dtype))
        # the official's positions: 0..L-1 on all three M-RoPE axes, (3,B,L)
        positions = torch.arange(L, device=input_ids.device).expand(3, B, L)
        hidden = decoder(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=positions).last_hidden_state
        # the last reward token of each row (the instruction's; right padding keeps it before the pads), (B,)
        at = L - 1 - (input_ids == self.reward_token_id).flip(1).int().argmax(1)
        return self.head(hidden[torch.arange(B, device=hidden.device), at].float())  # (B,2)


def _old_name(key: str) -> str:
    """Our state-dict key -> its name in HPSv3.safetensors (the transformers 4.4x layout)."""
    for ours, theirs in (("body.language_model.", "model."), ("body.visual.", "visual."), ("head.", "rm_head.")):
        if key.startswith(ours):
            return theirs + key.removeprefix(ours)
    return key


def _our_name(key: str) -> str | None:
    """A key of an HPSv3 checkpoint, in the old layout (`model.*`, `visual.*`) or in transformers 5's
    (`model.language_model.*`, `model.visual.*`) -> ours; None for a key of neither."""
    for theirs, ours in (
        ("model.language_model.", "body.language_model."),
        ("model.visual.", "body.visual."),
        ("model.", "body.language_model."),
        ("visual.", "body.visual."),
        ("rm_head.", "head."),
    ):
        if key.startswith(theirs):
            return ours + key.removeprefix(theirs)
    return None


def check_config(config, source: str, tensors: int) -> None:
    """InputError naming `source` (the folder's config.json) and the field, for a config that cannot describe an
    HPSv3 whose weights hold `tensors` tensors: a size the construction uses that is not a positive integer, a width
    its heads cannot share, a rotary section that does not fit the head, or more layers than the weights have
    tensors. Checked before any model is built: Qwen2-VL's construction divides by the head counts, allocates every
    size it is given, and builds one module per layer, so a wrong size is a traceback there or a large allocation,
    and the forward's checks come only when the first batch is scored."""
    text, vision = config.text_config, config.vision_config
    sizes = {name: getattr(text, name, None) for name in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    )}  # fmt: skip
    sizes |= {f"vision_config.{name}": getattr(vision, name, None) for name in (
        "embed_dim", "hidden_size", "depth", "num_heads", "mlp_ratio", "in_channels", "patch_size",
        "temporal_patch_size", "spatial_merge_size")}  # fmt: skip
    for name, value in sizes.items():
        if type(value) is not int or value <= 0:  # type(): True is an int to isinstance
            raise InputError(f"{source}: {name} is {value!r}, not a positive integer")
    width, heads, kv = text.hidden_size, text.num_attention_heads, text.num_key_value_heads
    shares = (
        (width, "hidden_size", heads, "num_attention_heads"),  # each head takes width / heads
        (heads, "num_attention_heads", kv, "num_key_value_heads"),  # each key-value head serves heads / kv
        (vision.embed_dim, "vision_config.embed_dim", vision.num_heads, "vision_config.num_heads"),
    )
    for total, name, parts, by in shares:
        if total % parts:
            raise InputError(f"{source}: {name} {total} is not divisible by {by} {parts}")
    # the vision rotary turns each head's width in four quarters (row and column positions, cosine and sine pairs)
    if vision.embed_dim // vision.num_heads % 4:
        raise InputError(
            f"{source}: vision_config.embed_dim / vision_config.num_heads = {vision.embed_dim // vision.num_heads} "
            "is not divisible by 4 (the vision rotary's quarters)"
        )
    # M-RoPE splits the head's rotary half in the sections of the three position axes
    section = (text.rope_parameters or {}).get("mrope_section", [16, 24, 24])  # transformers' default
    if not isinstance(section, list) or any(type(v) is not int or v < 0 for v in section) or (
        2 * sum(section) != width // heads
    ):  # fmt: skip
        raise InputError(f"{source}: mrope_section {section!r} does not sum to half the head width {width // heads}")
    if vision.hidden_size != width:  # the merged image tokens take the place of text embeddings
        raise InputError(f"{source}: vision_config.hidden_size {vision.hidden_size} is not hidden_size {width}")
    # each layer and block has tensors of its own: more than the weights hold cannot match them, and a build on the
    # meta device still makes one module per layer (minutes and gigabytes of Python objects for millions)
    if text.num_hidden_layers + vision.depth > tensors:
        raise InputError(
            f"{source}: num_hidden_layers {text.num_hidden_layers} and vision_config.depth {vision.depth} are more "
            f"layers than the {tensors} tensors of the weights"
        )


@contextmanager
def _safetensors(path: str):
    """safe_open on the CPU, a file that is not safetensors (or a truncated one) as InputError."""
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise InputError(f"{path}: not a safetensors file ({type(e).__name__}: {str(e)[:200]})") from None


def read_header(path: str) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor in the safetensors file at `path`, from its header (nothing is read)."""
    with _safetensors(path) as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def match_weights(header: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]], path: str, where: str):
    """Our key -> the name of its tensor in HPSv3.safetensors at `path` (`header`: read_header's), after checking
    every tensor's name and shape against `shapes` (our key -> shape, of the model built on the meta device from
    `where`, the config.json): InputError naming the first key missing, unknown or of another shape. The LM head
    (`lm_head.*`) is skipped: the reward reads hidden states, never next-token logits (1 GB less in bf16)."""
    names = {}  # our key -> the file's key
    for name in header:
        if name.startswith("lm_head."):
            continue
        key = _our_name(name)
        if key not in shapes:
            raise InputError(f"{path}: tensor {name!r} is not part of HPSv3 as {where} describes it")
        names[key] = name
    for key, shape in shapes.items():
        if key not in names:
            raise InputError(
                f"{path}: no tensor {_old_name(key)!r} (expected shape {shape} from {where}): not a whole HPSv3 "
                "checkpoint"
            )
        if header[names[key]] != shape:
            raise InputError(
                f"{path}: tensor {names[key]!r} has shape {header[names[key]]}, expected {shape} from {where} (HPSv3 "
                f"is Qwen2-VL-7B-Instruct with {REWARD_TOKEN} added)"
            )
    return names


def load_weights(model: HPSv3, path: str, names: dict[str, str]) -> None:
    """Copy the tensors of HPSv3.safetensors at `path` into `model`, `names` (match_weights') mapping our keys to
    the file's."""
    with _safetensors(path) as f, torch.no_grad():
        for key, tensor in model.state_dict().items():
            tensor.copy_(f.get_tensor(names[key]))  # cast to the model's dtype on the way


def load_hpsv3(weights: str, qwen: str, device, dtype: torch.dtype = torch.bfloat16, missing: str | None = None):
    """(model, processor): the processor and config of Qwen2-VL-7B-Instruct at `qwen` (a folder or a hub id) with
    the reward token added, the model built from them (the embeddings resized to the tokenizer, as the official) and
    HPSv3.safetensors at `weights` loaded into it; eval mode, no gradients to the weights. `missing`: the message
    when `qwen`'s files cannot be read (default: names the folder). The config is checked (check_config) and the
    model built on the meta device (no memory) and matched against the weights' header before the real one is
    built: a wrong config.json is one InputError, never a traceback or an allocation of the size it describes."""
    source = f"{qwen}/config.json"
    try:
        processor = AutoProcessor.from_pretrained(qwen, padding_side="right")
        config = AutoConfig.from_pretrained(qwen, attn_implementation="sdpa")
    except StrictDataclassError as e:  # transformers' own checks of the config's types and some of its sizes
        raise InputError(f"{source}: {' '.join(str(e).split())[:300]}") from None
    except (OSError, ValueError) as e:
        raise InputError(
            missing or f"{qwen}: not the config and processor files of {QWEN} ({type(e).__name__}: {str(e)[:200]})"
        ) from None
    if getattr(config, "model_type", None) != "qwen2_vl":
        raise InputError(f"{qwen}: its config.json is a {getattr(config, 'model_type', None)!r} model, not qwen2_vl")
    processor.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    reward_id = processor.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
    config.text_config.vocab_size = len(processor.tokenizer)  # the official resize_token_embeddings
    header = read_header(weights)
    check_config(config, source, len(header))
    try:
        with torch.device("meta"):  # shapes only: no memory, whatever sizes the config gives
            shapes = {key: tuple(t.shape) for key, t in HPSv3(config, reward_id, dtype).state_dict().items()}
    # whatever check_config lets through that Qwen2-VL still cannot build (e.g. a pad id past the vocabulary)
    except Exception as e:
        raise InputError(
            f"{source}: HPSv3 cannot be built from it ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        ) from None
    names = match_weights(header, shapes, weights, source)
    # built for real only now, as before: the same construction (initialised, non-persistent buffers such as the
    # rotary frequencies computed) then the checked tensors copied in
    with torch.device(device):
        model = HPSv3(config, reward_id, dtype)
    load_weights(model, weights, names)
    return model.eval().requires_grad_(False), processor
