"""Qwen-Image-Edit-Plus (Qwen/Qwen-Image-Edit-2509, Qwen/Qwen-Image-Edit-2511; diffusers QwenImageEditPlusPipeline):
Qwen-Image (common/models/qwenimage.py: packed 2x2 latent tokens (seq, 64), Qwen2.5-VL text with a mask, true CFG with
the per-token norm rescale) that edits one to three images.

A prompt is an EditPrompt (common/edits.py). Each of its images conditions the model twice, as the pipeline does:
- the Qwen2.5-VL encoder sees it inside the chat template, "Picture 1: <|vision_start|><|image_pad|><|vision_end|>
  Picture 2: ...<instruction>", so the prompt embeddings hold the images' vision tokens too;
- the VAE encodes it (the posterior's mode, normalised per channel) into packed tokens that follow the noisy tokens in
  one sequence; `img_shapes` lists the noisy grid, then each image's grid (RoPE: the i-th grid is frame i), and the
  transformer's output is cut to the noisy tokens. Qwen-Image-Edit-2511's transformer (zero_cond_t) modulates the
  image tokens at timestep 0, from the same img_shapes.

Project decision, a deviation from the pipeline's auto-resize (it VAE-encodes each image at VAE_IMAGE_SIZE, about
1024 x 1024 at the image's aspect ratio, and makes the output at the last image's aspect ratio): each image is
`centre_square(image, --resolution)`, and
- the VAE path encodes that square as the pipeline's VaeImageProcessor.preprocess does at its size, so every image's
  tokens lie on the noisy tokens' grid (at --resolution 1024 this is the pipeline on the square);
- the VL path is the pipeline's own: the square resized by the pipeline's `image_processor.resize` (lanczos) to
  calculate_dimensions(CONDITION_IMAGE_SIZE, 1) (384 x 384 at the pipeline's 384 * 384; read at each encode), which
  the Qwen2-VL processor then patches as it does (392 x 392: 196 vision tokens per image after its 2x2 merge).

The true-CFG negative prompt " " is encoded WITH the prompt's images, as QwenImageEditPlusPipeline encodes
`negative_prompt` with `image=condition_images`: the unconditional branch depends on the images, so it travels in each
row of cond ("negative_prompt_embeds"), and velocity uses it, not `uncond()`. A plain str prompt (`_encode([""])`,
the inherited `uncond()`) gets the text keys alone, the template with no picture; no velocity here uses it (velocity
refuses a cond without images), and the editing pipeline has no text-to-image path to match.
"""

import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

from common import InputError
from common.edits import EditPrompt, centre_square
from common.models.qwenimage import QwenImageModel, _pad

MAX_IMAGES = 3  # images per prompt: the REGISTRY entry's (1, 3), Qwen-Image-Edit-2509's model card's 1 to 3


class QwenImageEditModel(QwenImageModel):
    """QwenImageModel's transformer, timestep, text mask, true CFG and decode, on the sequence [noisy tokens; each
    image's tokens]. cond holds, per row: the prompt's and the negative's embeddings with their masks (both from the
    VL encoder with the images), "image_latents" (B, n_max * seq, 64), the images' tokens padded with zeros to the
    batch's most images, and "image_count" (B,). Rows with different numbers of images (an edit file may mix them)
    go through the transformer in one forward per count: the transformer takes one img_shapes (RoPE grid) for a whole
    batch and has no mask for image tokens, so padding them would change the attention."""

    kind = "qwen-edit"
    pipeline = QwenImageEditPlusPipeline  # loads the folder; saves and loads a LoRA adapter (save_lora_weights)

    def _encode(self, prompts):
        """Plain prompts: {"prompt_embeds", "prompt_embeds_mask"} of the Plus template without pictures. EditPrompts:
        those of the instruction and of the negative prompt, each with the prompt's images, padded to the batch's
        longest (the masks mark the tokens), and the images' VAE tokens. Each prompt is encoded alone, as
        QwenImageEditPlusPipeline encodes (it takes one prompt per call: its template numbers one prompt's pictures)."""
        edits = [isinstance(p, EditPrompt) for p in prompts]
        if not any(edits):
            embeds, mask = self.pipe.encode_prompt(list(prompts), image=None, device=self.device)
            return {"prompt_embeds": embeds, "prompt_embeds_mask": _ones_if_none(mask, embeds)}
        if not all(edits):
            raise ValueError("QwenImageEditModel._encode: a batch mixes edit prompts (with images) and plain ones")
        for p in prompts:
            if len(p.images) > MAX_IMAGES:
                raise InputError(
                    f"prompt {p.text!r} brings {len(p.images)} images; Qwen-Image-Edit takes at most {MAX_IMAGES}"
                )
        squares = [[centre_square(img, self.height) for img in p.load_images()] for p in prompts]
        processor = self.pipe.image_processor
        # the VL path: QwenImageEditPlusPipeline.__call__'s `image_processor.resize(img, condition_height,
        # condition_width)`, its calculate_dimensions of the square (ratio 1) at the module's CONDITION_IMAGE_SIZE
        side, _ = plus.calculate_dimensions(plus.CONDITION_IMAGE_SIZE, 1.0)
        pos, neg = [], []
        for p, images in zip(prompts, squares):
            seen = [processor.resize(img, side, side) for img in images]
            pos.append(self.pipe.encode_prompt([p.text], image=seen, device=self.device))  # (1, L, D), mask or None
            neg.append(self.pipe.encode_prompt([self.negative_prompt], image=seen, device=self.device))
        with self._vae.visit():  # --offload-frozen: the VAE comes to the device for the encode only
            tokens = [torch.cat([self._image_tokens(img) for img in images], 1) for images in squares]  # (1, n seq, 64)
        longest = max(t.shape[1] for t in tokens)
        cond = {}
        for key, encoded in (("prompt_embeds", pos), ("negative_prompt_embeds", neg)):
            length = max(e.shape[1] for e, _ in encoded)
            rows = [_pad({"prompt_embeds": e, "prompt_embeds_mask": _ones_if_none(m, e)}, length) for e, m in encoded]
            cond[key] = torch.cat([e for e, _ in rows])  # (B, L, D) zero-padded
            cond[key + "_mask"] = torch.cat([m for _, m in rows])  # (B, L) 1 = a token
        padding = [t.new_zeros(1, longest - t.shape[1], t.shape[2]) for t in tokens]  # to the batch's most images
        cond["image_latents"] = torch.cat([torch.cat(pair, 1) for pair in zip(tokens, padding)])  # (B, n_max seq, 64)
        cond["image_count"] = torch.tensor([len(images) for images in squares], device=self.device)  # (B,)
        return cond

    def _image_tokens(self, square):
        """One image (the PIL square at --resolution) -> its packed tokens (1, seq, 64) on `device`: the pipeline's
        VaeImageProcessor.preprocess at the square's size ([-1, 1]), one frame, _encode_vae_image (the posterior's
        mode, (z - latents_mean) / latents_std), _pack_latents."""
        pixels = self.pipe.image_processor.preprocess(square, self.height, self.width).unsqueeze(2)  # cpu: from PIL
        z = self.pipe._encode_vae_image(pixels.to(self.device, self.vae.dtype), generator=None)  # (1, 16, 1, h, w)
        return self.pipe._pack_latents(z, 1, z.shape[1], z.shape[3], z.shape[4])

    def velocity(self, transformer, x, sigma, cond, guidance_scale=1.0):
        """v on the noisy tokens (B, seq, 64). True CFG (scale > 1) as QwenImageEditPlusPipeline's, with the negative
        embeddings of each row (its images seen by the VL encoder) and the row's image tokens in both halves, in one
        batch [negative; prompt] padded to one text length under the masks."""
        if "image_latents" not in cond:
            raise ValueError(
                "QwenImageEditModel.velocity needs an edit prompt's encoding (images); a plain prompt's (`_encode`"
                ' of [""] or `uncond()`) has the text keys alone'
            )
        images, counts = cond["image_latents"], cond["image_count"]
        if guidance_scale <= 1.0:
            out = self._forward(
                transformer, x, sigma, cond["prompt_embeds"], cond["prompt_embeds_mask"], images, counts
            )
            return out.to(x.dtype)
        negative = {
            "prompt_embeds": cond["negative_prompt_embeds"],
            "prompt_embeds_mask": cond["negative_prompt_embeds_mask"],
        }
        length = max(negative["prompt_embeds"].shape[1], cond["prompt_embeds"].shape[1])
        (e_n, m_n), (e_c, m_c) = _pad(negative, length), _pad(cond, length)
        out_neg, out_cond = self._forward(
            transformer, torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([e_n, e_c]), torch.cat([m_n, m_c]),
            torch.cat([images, images]), torch.cat([counts, counts]),
        ).chunk(2)  # fmt: skip
        # QwenImageEditPlusPipeline: neg + s (cond - neg), rescaled per token to the conditional prediction's norm
        comb = out_neg + guidance_scale * (out_cond - out_neg)
        return (comb * (out_cond.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))).to(x.dtype)

    def _forward(self, transformer, x, sigma, embeds, mask, images, counts):
        """The transformer's output on the noisy tokens, in its dtype: one forward per number of images among the
        rows (one forward when all rows bring as many), put back in the rows' order."""
        ns = counts.tolist()  # a sync: the grouping is on the host
        if len(set(ns)) == 1:
            return self._forward_rows(transformer, x, sigma, embeds, mask, images, ns[0])
        outs, rows = [], []
        for n in sorted(set(ns)):
            g = torch.tensor([i for i, m in enumerate(ns) if m == n], device=x.device)  # the rows with n images
            outs.append(self._forward_rows(transformer, x[g], sigma[g], embeds[g], mask[g], images[g], n))
            rows.append(g)
        return torch.cat(outs)[torch.argsort(torch.cat(rows))]  # (B, seq, 64) in the rows' order

    def _forward_rows(self, transformer, x, sigma, embeds, mask, images, n):
        """Rows that each bring `n` images: QwenImageEditPlusPipeline's forward on [latents; image_latents]."""
        dt, seq = self._io_dtype(), x.shape[1]  # an image has as many tokens as the noise: the same square
        out = transformer(
            hidden_states=torch.cat([x, images[:, : n * seq]], 1).to(dt),  # (B, (1 + n) seq, 64)
            # `t.expand(B).to(latents.dtype) / 1000` as QwenImageModel (t the scheduler's float32 1000 sigma)
            timestep=(sigma.float() * 1000).to(dt) / 1000,
            encoder_hidden_states=embeds.to(dt),
            encoder_hidden_states_mask=mask,
            img_shapes=[[self.img_shape] * (1 + n)] * len(x),  # the noisy grid, then each image's (the same square)
            return_dict=False,
        )[0]
        return out[:, :seq]  # `noise_pred[:, : latents.size(1)]`


def _ones_if_none(mask, embeds):
    """QwenImageEditPlusPipeline.encode_prompt drops an all-ones mask; it is kept here, so the dict can be sliced."""
    return torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device) if mask is None else mask
