"""FLUX.1-Kontext (dev): FLUX.1 that edits. The source image is VAE-encoded, packed into 2x2 tokens like the noisy
latents and appended after them along the sequence; its position ids are the latent grid's with the first axis 1
(the noisy tokens' is 0), and the transformer's output on the source tokens is dropped (FluxKontextPipeline).

A prompt is an EditPrompt (common/edits.py) with one source image. Project decision, a deviation from
FluxKontextPipeline's auto-resize (it picks the PREFERRED_KONTEXT_RESOLUTIONS entry nearest the source's aspect
ratio, about 1 megapixel): each source is `centre_square(image, --resolution)`, then the pipeline's own image
processor and VAE encoding at that size, as the pipeline does with `_auto_resize=False`. Every row of a batch then has
as many condition tokens as noise tokens, on the one grid of position ids held by the model.
"""

import torch
from diffusers import FluxKontextPipeline

from common import InputError
from common.edits import EditPrompt, centre_square
from common.models.flux import FluxModel
from common.shapesbench.world import SIZE


class FluxKontextModel(FluxModel):
    """FluxModel (packed tokens (seq, 4 * 16), CLIP pooled + T5 text, embedded guidance) with the source image's
    tokens appended to the noisy ones. Guidance is the embedded scale alone, as FluxModel's: FluxKontextPipeline's
    true CFG (`true_cfg_scale` with a negative prompt, off by default) has no counterpart in FluxModel."""

    kind = "kontext"
    pipeline = FluxKontextPipeline  # loads the folder; saves and loads a LoRA adapter (save_lora_weights)

    def __init__(self, pipe: FluxKontextPipeline, resolution: int | None):
        super().__init__(pipe, resolution)
        # the source tokens' ids: the noisy tokens' grid (the source is cropped to --resolution too) with the first
        # coordinate 1, as FluxKontextPipeline.prepare_latents sets `image_ids[..., 0] = 1`
        self.image_ids = self.img_ids.clone()  # cpu: (seq, 3), as img_ids; moved to x's device in velocity
        self.image_ids[:, 0] = 1

    def _encode(self, prompts):
        """Text as FluxModel, plus "image_latents" (B, seq, 64): each prompt's source, centre-cropped to the model's
        square, preprocessed by the pipeline's VaeImageProcessor ([-1, 1]), encoded to its VAE mode, shifted and
        scaled, packed. Plain prompts (the unconditional "") get the text keys alone; a batch mixing the two is an
        error, since the rows of one cond must carry the same keys."""
        cond = super()._encode([p.text if isinstance(p, EditPrompt) else p for p in prompts])
        edits = [isinstance(p, EditPrompt) for p in prompts]
        if not any(edits):
            return cond
        if not all(edits):
            raise ValueError(
                "FluxKontextModel._encode: a batch mixes edit prompts (with a source image) and plain ones"
            )
        images = []
        for p in prompts:
            if len(p.images) != 1:
                raise InputError(f"prompt {p.text!r} brings {len(p.images)} images; FLUX.1-Kontext edits exactly one")
            images.append(centre_square(p.load_images()[0], self.height))
        processor = self.pipe.image_processor
        # resize (a no-op on the square) and preprocess as FluxKontextPipeline.__call__ does: (B, 3, H, W) in [-1, 1]
        images = [processor.resize(image, self.height, self.width) for image in images]
        pixels = processor.preprocess(images, self.height, self.width)  # cpu: from PIL; to the VAE's device below
        with self._vae.visit():  # --offload-frozen: the VAE comes to the device for the encode only
            # FluxKontextPipeline._encode_vae_image: the posterior's mode ("argmax"), then (z - shift) * scale
            z = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist.mode()  # (B, 16, H/8, W/8)
            z = (z - self.vae.config.shift_factor) * self.vae.config.scaling_factor
        cond["image_latents"] = self.pipe._pack_latents(z, len(z), z.shape[1], z.shape[2], z.shape[3])  # (B, seq, 64)
        return cond

    def _tokens(self, x, cond, dt):
        """FluxModel's velocity on the sequence [noisy tokens; source tokens] (B, 2 seq, 64) with the ids [img_ids;
        image_ids]; it keeps the noisy tokens' output, as the pipeline's `noise_pred[:, : latents.size(1)]`. Without a
        source (a plain prompt) the pipeline makes an image from text alone."""
        tokens, ids = super()._tokens(x, cond, dt)
        if "image_latents" not in cond:
            return tokens, ids
        return torch.cat([tokens, cond["image_latents"].to(dt)], 1), torch.cat([ids, self.image_ids.to(x.device, dt)])


class ShapesEditModel(FluxKontextModel):
    """ShapesBench-Edit (common/shapesbench/edit.py): a tiny FluxKontextPipeline that edits ShapesBench's 32 px images
    (`--model-id shapesbench-edit`), run exactly as FLUX.1-Kontext. Its T5 slot is a tiny T5 trained with its
    tokenizer's model_max_length tokens (12), the length every encode here uses (FLUX's pipelines pad to 512). kind
    "shapes-edit" lets ShapesBench's edit prompts and rewards through the scripts' start-up checks."""

    kind = "shapes-edit"

    def __init__(self, pipe: FluxKontextPipeline, resolution: int | None):
        super().__init__(pipe, resolution or SIZE)  # the world's 32 px, not FLUX's default sample size
        self.text_tokens = pipe.tokenizer_2.model_max_length
