"""LTX-2 and LTX-2.3 (Lightricks) text-to-video, video only: Gemma 3 text through the text connectors, one joint
audio-video transformer; the state the scripts integrate carries the audio latents beside the video's, and only the
video is ever decoded."""

import numpy as np
import torch
from diffusers import LTX2Pipeline
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

from common import InputError
from common.models.base import FlowModel, _cfg


class LTX2Model(FlowModel):
    """LTX-2 / LTX-2.3 through LTX2Pipeline. The transformer is one audio-video model: its video velocity reads the
    audio latents through audio-to-video attention at every step, so the pipeline's video is a function of the joint
    (video, audio) state. To sample what the pipeline samples, our latents are that joint state, as tokens:

        x = cat([video tokens (S_v, C), audio tokens (S_a, C)], dim=0),  C = 128 channels on both (LTX-2, LTX-2.3)
        S_v = F' h' w', F' = (F - 1) / 8 + 1, h' = H / 32, w' = W / 32 (the VAE's 32x space, 8x time; 1x1x1 patches)
        S_a = round(F / fps * 16000 / 160 / 4) audio latent frames (8 channels x 16 mel bins packed to 128)

    Both halves start as noise, are denoised by the same steps and guided by the same CFG; decode() reads the video
    half only. Nothing decodes audio: the audio VAE and vocoder are dropped after loading, and no reward sees sound.

    Conditioning: Gemma's hidden states of every layer (1024 left-padded tokens) through LTX2TextConnectors, one
    stream for the video and one for the audio. Timestep: the transformer takes t = 1000 sigma as `timestep` and, on
    LTX-2.3, as `sigma` too (its prompt AdaLN), as the pipeline passes both. CFG: LTX2Pipeline's with the negative
    prompt "", no spatio-temporal or modality guidance and no rescale on either stream (stg_scale = audio_stg_scale
    = 0, modality_scale = audio_modality_scale = 1, guidance_rescale = audio_guidance_rescale = 0: its defaults add
    both guidances, two more forwards a step, and a rescale) and the same scale on both (audio_guidance_scale =
    guidance_scale); its x0-space delta form equals v_u + w (v_c - v_u) up to float rounding."""

    kind = "ltx2"
    pipeline = LTX2Pipeline  # loads the folder; saves and loads a LoRA adapter (save_lora_weights)
    text_tokens = 1024  # LTX2Pipeline's default max_sequence_length
    native_size = (512, 768)  # LTX2Pipeline's default height and width
    native_frames = 121  # its default num_frames for LTX-2 / LTX-2.3 (5 s at 24 fps)
    frame_rate = 24.0  # its default frame_rate: the video RoPE's time axis and the audio length follow it

    @classmethod
    def from_folder(cls, where, index, dtype, resolution, num_frames=None):
        return cls(cls.pipeline.from_pretrained(where, dtype=dtype), resolution, num_frames)

    def __init__(self, pipe: LTX2Pipeline, resolution, num_frames: int | None):
        """`resolution`: a square side in pixels, an (height, width) pair, or None (the native 512 x 768)."""
        self.pipe = pipe
        t = pipe.transformer.config
        self.vae_scale, self.vae_scale_t = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio
        self.patch, self.patch_t = t.patch_size, t.patch_size_t
        height, width = (resolution, resolution) if isinstance(resolution, int) else resolution or self.native_size
        multiple = max(32, self.vae_scale * self.patch)  # LTX2Pipeline.check_inputs: divisible by 32
        for side in (height, width):
            if side % multiple:
                raise InputError(f"--resolution {side} must be a multiple of {multiple} for ltx2 models")
        self.num_frames = num_frames or self.native_frames
        if self.num_frames < 1 or (self.num_frames - 1) % self.vae_scale_t:
            raise InputError(
                f"--num-frames {self.num_frames}: must be {self.vae_scale_t}k + 1 for ltx2 (its VAE keeps the first "
                f"frame and compresses the rest {self.vae_scale_t}x in time), e.g. 81 or 121"
            )
        # the audio half of the state, as LTX2Pipeline sizes it (its audio VAE's config; its defaults without one)
        self.audio_frames = round(
            self.num_frames / self.frame_rate * pipe.audio_sampling_rate / pipe.audio_hop_length
            / pipe.audio_vae_temporal_compression_ratio
        )  # fmt: skip
        mel_bins = pipe.audio_vae.config.mel_bins if pipe.audio_vae is not None else 64
        audio_channels = (pipe.audio_vae.config.latent_channels if pipe.audio_vae is not None else 8) * (
            mel_bins // pipe.audio_vae_mel_compression_ratio
        )
        if not t.in_channels == t.audio_in_channels == audio_channels:
            raise InputError(
                f"--model-id: ltx2 needs as many video as audio latent channels per token (video {t.in_channels}, "
                f"audio {t.audio_in_channels}, audio VAE {audio_channels}): LTX-2 and LTX-2.3 have 128 on both"
            )
        pipe.audio_vae, pipe.vocoder = None, None  # video only: nothing decodes audio (drops their weights)
        super().__init__(pipe.transformer, [pipe.text_encoder, pipe.connectors], pipe.vae, height, width)

    def video_grid(self) -> tuple[int, int, int]:
        """(F', h', w'): the video tokens' latent frames, rows and columns."""
        frames = (self.num_frames - 1) // self.vae_scale_t + 1
        return (
            frames // self.patch_t,
            self.height // self.vae_scale // self.patch,
            self.width // self.vae_scale // self.patch,
        )

    def video_tokens(self) -> int:
        f, h, w = self.video_grid()
        return f * h * w

    def latent_shape(self):
        return (self.video_tokens() + self.audio_frames, self.transformer.config.in_channels)

    def _encode(self, prompts):
        # LTX2Pipeline: Gemma's hidden states of all layers stacked (B, 1024, D x (layers + 1)), left padding, then the
        # connectors, which the pipeline runs on the [negative; positive] batch (row by row: the same per prompt)
        embeds, mask, _, _ = self.pipe.encode_prompt(
            prompts, do_classifier_free_guidance=False, max_sequence_length=self.text_tokens, device=self.device
        )
        video, audio, mask = self.pipe.connectors(embeds, mask, padding_side=self.pipe.tokenizer.padding_side)
        # (B, 1024, video width), (B, 1024, audio width), (B, 1024) binary
        return {"prompt_embeds": video, "audio_prompt_embeds": audio, "attention_mask": mask}

    def velocity(self, transformer, x, sigma, cond, guidance_scale=1.0):
        dt, n_video = self._io_dtype(), self.video_tokens()
        frames, rows, cols = self.video_grid()

        def forward(x, sigma, cond):
            # (rows,) the scheduler's float32 timesteps 1000 sigma, uncast: LTX2Pipeline casts its latents to the
            # prompt embeddings' dtype but passes t as it is (a bf16 cast would round 788.4 to 788)
            t = sigma.float() * 1000
            video, audio = transformer(
                hidden_states=x[:, :n_video].to(dt),  # (rows, S_v, C)
                audio_hidden_states=x[:, n_video:].to(dt),  # (rows, S_a, C)
                encoder_hidden_states=cond["prompt_embeds"].to(dt),
                audio_encoder_hidden_states=cond["audio_prompt_embeds"].to(dt),
                timestep=t,
                sigma=t,  # LTX-2.3's prompt AdaLN (LTX-2 ignores it), as LTX2Pipeline passes it
                encoder_attention_mask=cond["attention_mask"],
                audio_encoder_attention_mask=cond["attention_mask"],
                num_frames=frames,
                height=rows,
                width=cols,
                fps=self.frame_rate,
                audio_num_frames=self.audio_frames,
                use_cross_timestep=True,  # LTX2Pipeline's default
                return_dict=False,
            )
            return torch.cat([video, audio], dim=1)  # (rows, S_v + S_a, C)

        return _cfg(forward, x, sigma, cond, self.uncond, guidance_scale).to(x.dtype)

    def _pipeline_timesteps(self, num_steps):
        """LTX2Pipeline: sigmas linspace(1, 1/T, T), mu from the video token count (0.95 at 1024 tokens to 2.05 at
        4096, the scheduler config's keys where it has them), exponential dynamic shift."""
        c = self.scheduler_config
        mu = calculate_shift(
            self.video_tokens(), c.get("base_image_seq_len", 1024), c.get("max_image_seq_len", 4096),
            c.get("base_shift", 0.95), c.get("max_shift", 2.05),
        )  # fmt: skip
        return dict(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)

    def decode(self, x) -> torch.Tensor:
        """(B, S_v + S_a, C) -> video (B, F, 3, H, W) in [0, 1], differentiable; the audio tokens are left out.
        LTX2Pipeline un-normalises per channel (x * latents_std / scaling_factor + latents_mean) and, with a VAE
        that takes a decode timestep, decodes at its default timestep 0 with noise scale 0 (the latents unchanged)."""
        self._vae.fetch()
        frames, rows, cols = self.video_grid()
        z = self.pipe._unpack_latents(x[:, : self.video_tokens()], frames, rows, cols, self.patch, self.patch_t)
        z = self.pipe._denormalize_latents(
            z, self.vae.latents_mean, self.vae.latents_std, self.vae.config.scaling_factor
        )
        z = z.to(self.vae.dtype)  # (B, C, F', h, w)
        temb = z.new_zeros(1) if self.vae.config.timestep_conditioning else None
        # one video at a time: the VAE's activations grow with the frames, a batch of videos multiplies them
        video = torch.cat([self.vae.decode(z[i : i + 1], temb, return_dict=False)[0] for i in range(len(z))])
        return ((video + 1) / 2).clamp(0, 1).to(x.dtype).transpose(1, 2)  # (B, 3, F, H, W) -> (B, F, 3, H, W)
