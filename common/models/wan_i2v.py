"""Wan image-to-video: Wan2.1-I2V-14B (480P, 720P: a CLIP image encoder) and Wan2.2-I2V-A14B (two experts, no image
encoder), as WanImageToVideoPipeline samples them. The prompt is an EditPrompt whose one image is the first frame
(common/edits.py); the noisy latents are WanModel's, and the transformer reads them channel-concatenated with the
first frame's condition."""

import torch
from diffusers import WanImageToVideoPipeline

from common import InputError
from common.edits import EditPrompt, cut_to_frame
from common.models.base import _cfg
from common.models.wan import WanModel
from common.offload import Offloaded


class WanI2VModel(WanModel):
    """Wan image-to-video through WanImageToVideoPipeline. Latents (16, F', H/8, W/8) as WanModel's; the transformer's
    input is those and the condition, (16 + 4 + 16 = in_channels 36, F', h, w): a mask (4 channels, one per frame of
    the VAE's 4-frame packing: 1 on the first latent frame, the given one, 0 after it) and the VAE's normalised latents
    of the video [first frame, F - 1 zero frames]. Wan2.1 also reads the first frame's CLIP tokens (the penultimate
    hidden state of its CLIPVisionModel, 257 x 1280 for ViT-H/14 at 224 px) through the cross-attention's extra
    key/value projections (encoder_hidden_states_image). Text, the timestep (1000 sigma), CFG (negative prompt "";
    the same image condition in both halves, as the pipeline passes it to both forwards) and Wan2.2-I2V-A14B's two
    experts (`transformer` for t >= boundary_ratio x 1000 = 900, `transformer_2` below, each at its CFG scale) are
    WanModel's, as is the decode.

    The first frame is the prompt's image cut to the video's frame: common.edits.cut_to_frame, the largest centred
    crop of the frame's aspect resized bicubic (the square of --resolution; without it the native 480 x 832), the
    project's rule for a source image, where the pipeline would resize the whole image to height x width. Then the pipeline's own preprocessing (its VideoProcessor, its CLIPImageProcessor). Not
    supported: a last frame (the pipeline's `last_image`, Wan2.1-FLF2V's first-last-frame model) and Wan2.2-TI2V-5B's
    image-to-video (expand_timesteps: the first frame's tokens replaced in the latents, timestep 0 there)."""

    kind = "wan-i2v"
    pipeline = WanImageToVideoPipeline  # loads the folder; saves and loads a LoRA adapter (save_lora_weights)
    native_size = (480, 832)  # WanImageToVideoPipeline's default height and width (Wan2.1-I2V-14B-480P's size)
    native_frames = 81  # its default num_frames

    def __init__(self, pipe: WanImageToVideoPipeline, resolution: int | None, num_frames: int | None):
        if pipe.config.expand_timesteps:
            raise InputError(
                "--model-id: Wan2.2-TI2V-5B's image-to-video (expand_timesteps) is not supported by wan-i2v"
            )
        if pipe.transformer is None:
            raise InputError("--model-id: a WanImageToVideoPipeline folder without its `transformer`")
        config = pipe.transformer.config
        # the pipeline encodes the image with CLIP iff the (high-noise) transformer has image projections
        self.clip = config.image_dim is not None
        if self.clip and (pipe.image_encoder is None or pipe.image_processor is None):
            raise InputError("--model-id: the transformer reads CLIP image tokens but the folder has no image_encoder")
        if self.clip and config.pos_embed_seq_len is not None:  # the image embedder reshapes to 2 images' tokens
            raise InputError("--model-id: Wan2.1-FLF2V (a first and a last frame) is not supported by wan-i2v")
        if self.clip and pipe.transformer_2 is not None:  # WanExperts passes no image tokens; no such model is known
            raise InputError("--model-id: two experts that read CLIP image tokens are not supported by wan-i2v")
        if config.in_channels != 2 * pipe.vae.config.z_dim + pipe.vae_scale_factor_temporal:
            raise InputError(
                f"--model-id: an image-to-video transformer takes latents, mask and condition channels ("
                f"{2 * pipe.vae.config.z_dim + pipe.vae_scale_factor_temporal}), this one {config.in_channels}"
            )
        super().__init__(pipe, resolution, num_frames)
        if self.clip:  # frozen, and with the text encoders on `device` while prompts are encoded (encode_prompts)
            self.text_encoders.append(pipe.image_encoder.requires_grad_(False).eval())
            self._text = Offloaded(self.text_encoders, self.device, self.offload)  # as _Parts made it, with CLIP

    def _first_frame(self, image):
        """The video's first frame (a PIL image, width x height) from the prompt's image (class docstring)."""
        return cut_to_frame(image, self.width, self.height)

    def _encode(self, prompts):
        """Text for every prompt; for EditPrompts also the first frame's condition (B, 20, F', h, w) and, Wan2.1,
        its CLIP tokens (B, 257, 1280). Plain text prompts (the "" of CFG's unconditional half) give the text alone:
        the image condition is the conditional row's in both halves (base._cfg)."""
        edits = [isinstance(p, EditPrompt) for p in prompts]
        if any(edits) and not all(edits):
            raise ValueError('wan-i2v encodes prompts with a first frame, or text alone (CFG\'s ""), not a mix')
        cond = super()._encode([p.text if e else p for p, e in zip(prompts, edits)])
        if not any(edits):
            return cond
        for p in prompts:
            if len(p.images) != 1:
                raise InputError(
                    f"prompt {p.text!r} brings {len(p.images)} images; Wan image-to-video takes one, the first frame "
                    "(a last frame, WanImageToVideoPipeline's last_image, is not supported)"
                )
        frames = [self._first_frame(p.load_images()[0]) for p in prompts]
        cond["image_condition"] = self._condition(frames)
        if self.clip:  # WanImageToVideoPipeline.encode_image: the CLIP processor, then hidden_states[-2]
            cond["image_embeds"] = self.pipe.encode_image(frames, self.device)
        return cond

    def _condition(self, frames) -> torch.Tensor:
        """WanImageToVideoPipeline.prepare_latents (no last_image): mask and normalised condition latents (B, 4 + 16,
        F', h, w), float32 as the pipeline makes them."""
        F, (C, Fl, h, w) = self.num_frames, self.latent_shape()
        # the pipeline's VideoProcessor.preprocess: (B, 3, H, W) in [-1, 1], float32 as the pipeline casts it
        images = self.pipe.video_processor.preprocess(frames, height=self.height, width=self.width)  # cpu: from PIL
        images = images.to(self.device, torch.float32)
        view = (1, C, 1, 1, 1)
        mean = torch.tensor(self.vae.config.latents_mean, device=self.device).view(view)
        inv_std = 1.0 / torch.tensor(self.vae.config.latents_std, device=self.device).view(view)  # as the pipeline
        latents = []
        with self._vae.visit():
            for image in images:  # one video at a time, as the pipeline encodes its one image (and as decode)
                video = torch.cat([image[None, :, None], image.new_zeros(1, 3, F - 1, self.height, self.width)], 2)
                z = self.vae.encode(video.to(self.vae.dtype)).latent_dist.mode()  # retrieve_latents "argmax"
                latents.append((z.float() - mean) * inv_std)  # (1, 16, F', h, w)
        # the first frame is repeated 4x in time before the 4-to-1 packing, so all 4 mask channels of latent frame 0
        # are 1, every later one 0
        mask = torch.zeros(len(frames), self.vae_scale_t, Fl, h, w, device=self.device)
        mask[:, :, 0] = 1.0
        return torch.cat([mask, torch.cat(latents)], 1)

    def velocity(self, transformer, x, sigma, cond, guidance_scale=1.0):
        # WanImageToVideoPipeline: input cat([latents, condition], channels) in the transformer's dtype, timestep
        # 1000 sigma, CFG with "" (two forwards there, one batch here) and the same condition and image tokens in both
        if "image_condition" not in cond:
            raise InputError("wan-i2v animates a first frame: its prompts come from an edit file (docs/editing.md)")
        dt = self._io_dtype()

        def forward(x, sigma, cond):
            image = {"encoder_hidden_states_image": cond["image_embeds"].to(dt)} if self.clip else {}
            return transformer(
                hidden_states=torch.cat([x.to(dt), cond["image_condition"].to(dt)], 1),  # (rows, 36, F', h, w)
                timestep=sigma * 1000,
                encoder_hidden_states=cond["prompt_embeds"].to(dt),
                return_dict=False,
                **image,
            )[0]

        scale = guidance_scale
        if self.guidance_scale_2 is not None and guidance_scale > 1.0:  # A14B: each row at its expert's scale
            high = sigma * 1000 >= self.boundary  # (B,) the pipeline's (and WanExperts') rule for `transformer`
            scale = torch.where(high, guidance_scale, self.guidance_scale_2).view(-1, *[1] * (x.dim() - 1))
        return _cfg(forward, x, sigma, cond, self.uncond, scale).to(x.dtype)
