"""Pretrain the latent-space ShapesBench base model on CPU and save it as a diffusers StableDiffusion3Pipeline.

    python -m common.shapesbench.train_latent --threads 1                 # the shipped pipeline: 3800 steps
    python -m common.shapesbench.train_latent --steps 300 --out /tmp/my-latent   # a quick look
    python -m common.shapesbench.train_latent --eval-only DIR             # re-evaluate a pipeline folder

An interrupted training goes on where it stopped: every --save-every steps the whole training state (weights, EMA,
optimizer, schedule, random generator, loss history) is written to OUT/train_state.pt (through a temporary file and
a rename), and the same command picks it up; the same steps follow, bitwise. The file is deleted once the pipeline
is saved.

The recipe is SD3's and FLUX's, small: ground truth from the ShapesBench renderer over all 168 captions (sizes
--radii, centres 16 +- --jitter, by default the world's), encoded by the frozen ShapesBench VAE (--vae) to the
posterior mode and normalised as the pipeline un-normalises it, x0 = (z - shift_factor) * scaling_factor; rectified
flow (x_s = (1 - s) x0 + s eps, target v = eps - x0) with logit-normal s; the text encoders trained jointly; 10% of
captions dropped to "" (the pipeline's negative prompt, so classifier-free guidance works). Caption noise, the way
web captions mislabel images: with probability --caption-noise the shape word of a caption is replaced by one of
the two other shapes (uniformly), so that a perfect fit follows the shape word with accuracy 1 - p; colours stay
right. The model draws crisp shapes that follow the prompt imperfectly, which is the room RL has. The saved weights
are an EMA (--ema), which samples cleaner edges than the raw weights.

The text conditioning is the pipeline's own: the captions go through StableDiffusion3Pipeline.encode_prompt with
the two tiny CLIP encoders (penultimate hidden states concatenated, projected pooled outputs concatenated) and, in
T5's slot, a model that outputs zeros (builders.build_null_t5), so the pipeline appends max_sequence_length
(default 256) all-zero tokens, as SD3 does without a T5. Those 256 tokens are
identical all the way through the transformer (text tokens carry no position), so attention to them equals
attention to one of them with its logit raised by log(256); training runs on one zero token with that bias
(builders.RepeatedLastTokenJointAttention, as the RL scripts do), which is exact and keeps a step 4x shorter. The
saved pipeline uses the stock processors, so `pipe(prompt)` with its default max_sequence_length sees what training
saw. Its model_index.json carries a "_shapesbench" key (which diffusers ignores) that tells common.models the
folder is a ShapesBench model.

The eval samples the saved folder with StableDiffusion3Pipeline itself (its FlowMatchEulerDiscreteScheduler, shift
3: the schedule of `python -m common.shapesbench eval`) on the held-out prompts, guidance 1 (off) as that eval's
default, and judges the images with the verifier; the results go into train_log.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, StableDiffusion3Pipeline

from common.shapesbench import builders, verifier, world
from common.shapesbench.builders import T5_TOKENS, RepeatedLastTokenJointAttention, make_pipeline

ROOT = Path(__file__).resolve().parents[2]  # the repository: paths in train_log.json are relative to it


def noisy_captions(captions: list[str], p: float, g: torch.Generator) -> list[str]:
    """Replace the shape word with one of the other two shapes (uniformly) with probability p; colours untouched."""
    out = []
    flip = (torch.rand(len(captions), generator=g) < p).tolist()
    other = torch.randint(1, len(world.SHAPES), (len(captions),), generator=g).tolist()
    for c, f, o in zip(captions, flip, other):
        if f:
            s, fg, bg = world.parse_prompt(c)
            c = world.make_prompt(
                world.SHAPES[(s + o) % len(world.SHAPES)], world.COLOUR_NAMES[fg], world.COLOUR_NAMES[bg]
            )
        out.append(c)
    return out


def drop_captions(captions: list[str], p: float, g: torch.Generator) -> list[str]:
    drop = (torch.rand(len(captions), generator=g) < p).tolist()
    return ["" if d else c for c, d in zip(captions, drop)]


class EMA:
    """Exponential moving average of parameters, with the usual warm-up (decay min(d, (1 + n) / (10 + n)))."""

    def __init__(self, modules, decay: float):
        self.decay, self.n = decay, 0
        self.params = [p for m in modules for p in m.parameters()]
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self):
        self.n += 1
        d = min(self.decay, (1 + self.n) / (10 + self.n))
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach(), 1 - d)

    def copy_to(self, modules):
        """Copies of `modules` holding the EMA weights (the training modules are untouched)."""
        copies = [copy.deepcopy(m) for m in modules]
        dst = [p for m in copies for p in m.parameters()]
        with torch.no_grad():
            for d, s in zip(dst, self.shadow):
                d.copy_(s)
        return copies


def lr_lambda(warmup, total):
    # linear warmup, then cosine decay to 0: a decayed model samples visibly cleaner than a constant-lr one
    return lambda i: min((i + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(i, total) / total)))


def update(loss, params, opt, sched, ema) -> None:
    """One optimisation step of the ShapesBench trainers: gradient clipped to norm 1, AdamW, the schedule, the EMA."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    if ema:
        ema.update()


def encode_captions(pipe, captions: list[str]):
    """The pipeline's own conditioning of `captions` with one zero T5 token (see RepeatedLastTokenJointAttention):
    prompt_embeds (B, 12 + 1, 128), pooled (B, 128); differentiable in the text encoders."""
    embeds, _, pooled, _ = pipe.encode_prompt(
        captions, None, None, do_classifier_free_guidance=False, max_sequence_length=1
    )
    return embeds, pooled


class LatentCache:
    """Normalised VAE latents (posterior mode) of renders, computed once per distinct image (the world has few)."""

    def __init__(self, vae):
        self.vae, self.store = vae, {}
        self.shift, self.scale = vae.config.shift_factor or 0.0, vae.config.scaling_factor

    @torch.no_grad()
    def __call__(self, images01: torch.Tensor) -> torch.Tensor:
        keys = [x.numpy().tobytes() for x in images01]
        new = [i for i, k in enumerate(keys) if k not in self.store]
        if new:  # one image at a time: a latent does not depend on its batch, so a resumed run repeats it bitwise
            z = torch.cat([self.vae.encode(images01[i : i + 1] * 2 - 1).latent_dist.mode() for i in new])
            for i, zi in zip(new, (z - self.shift) * self.scale):
                self.store[keys[i]] = zi
        return torch.stack([self.store[k] for k in keys])


@torch.no_grad()
def evaluate_pipeline(
    path, split="eval", samples_per_prompt=4, steps=20, guidance_scale=1.0, seed=0, batch_size=64
) -> dict:
    """Sample the pipeline folder at `path` with StableDiffusion3Pipeline on a split's prompts (default settings:
    256 zero T5 tokens, its scheduler) and return the verifier's metrics plus the sampling time."""
    pipe = StableDiffusion3Pipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    prompts = [p for p in world.split_prompts(split) for _ in range(samples_per_prompt)]
    g = torch.Generator().manual_seed(seed)
    t0, images = time.perf_counter(), []
    for i in range(0, len(prompts), batch_size):
        out = pipe(
            prompts[i : i + batch_size],
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            generator=g,
            output_type="pt",
        )
        images.append(out.images.float().cpu())
    images = torch.cat(images)
    metrics = verifier.evaluate(images, prompts)
    return {
        "split": split,
        "n": len(prompts),
        "steps": steps,
        "guidance_scale": guidance_scale,
        "seed": seed,
        **{k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()},
        "confusion": {
            "rows_requested_cols_predicted": list(world.SHAPES),
            "matrix": verifier.confusion_matrix(metrics),
        },
        "sampling_seconds": round(time.perf_counter() - t0, 1),
    }


def meets_target(m: dict) -> dict:
    """The base model's intended operating point: colours and cleanliness near-perfect, crisp shapes, and shape
    following imperfect (the room RL has) but above chance for every class."""
    checks = {
        "colour_acc>=0.95": m["colour_acc"] >= 0.95,
        "clean_acc>=0.95": m["clean_acc"] >= 0.95,
        "well_formed_acc>=0.90": m["well_formed_acc"] >= 0.90,
        "0.40<=shape_acc<=0.65": 0.40 <= m["shape_acc"] <= 0.65,
        "shape_acc_<each>>=0.30": all(m[f"shape_acc_{s}"] >= 0.30 for s in world.SHAPES),
    }
    return {**checks, "all": all(checks.values())}


def main():
    p = argparse.ArgumentParser(prog="python -m common.shapesbench.train_latent", description=__doc__.split("\n")[0])
    p.add_argument("--vae", default=str(builders.VAE_PATH), help="the frozen ShapesBench VAE (AutoencoderKL folder)")
    p.add_argument("--steps", type=int, default=3800)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--caption-dropout", type=float, default=0.1)
    p.add_argument(
        "--caption-noise", type=float, default=0.35, help="probability that the shape word is replaced by another shape"
    )
    p.add_argument("--radii", type=int, nargs="+", default=list(world.RADII), help="shape radii (default: the world's)")
    p.add_argument("--jitter", type=int, default=world.JITTER, help="centre = 16 +- jitter px (default: the world's)")
    p.add_argument("--heads", type=int, default=3, help="transformer width = 64 * heads")
    p.add_argument("--layers", type=int, default=4, help="joint transformer blocks")
    p.add_argument("--ema", type=float, default=0.999, help="EMA decay of the saved weights (0 = the raw weights)")
    p.add_argument("--eval-steps", type=int, default=20, help="sampler steps of the final eval")
    p.add_argument("--eval-samples-per-prompt", type=int, default=4)
    p.add_argument("--eval-only", default="", help="only evaluate this pipeline folder and print JSON")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--save-every", type=int, default=200, help="training state to OUT/train_state.pt (0 = never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(builders.LATENT_PATH))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.eval_only:
        m = evaluate_pipeline(args.eval_only, steps=args.eval_steps, samples_per_prompt=args.eval_samples_per_prompt)
        print(json.dumps({**m, "target": meets_target(m)}, indent=1))
        return

    vae = AutoencoderKL.from_pretrained(args.vae).eval().requires_grad_(False)
    parts = builders.build_latent_components(vae.config.latent_channels, args.seed, args.heads, args.layers)
    te, te_2, transformer = parts["text_encoder"], parts["text_encoder_2"], parts["transformer"]
    pipe = make_pipeline(vae, parts)
    stock_processors = transformer.attn_processors
    transformer.set_attn_processor(RepeatedLastTokenJointAttention(T5_TOKENS))
    latents = LatentCache(vae)
    modules = [te, te_2, transformer]
    for m in modules:
        m.train()
    params = [q for m in modules for q in m.parameters()]
    g = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup, args.steps))
    ema = EMA(modules, args.ema) if args.ema > 0 else None
    t0, c0, history, loss_ema, first = time.perf_counter(), time.process_time(), [], None, 0
    out = Path(args.out)
    state_path = out / "train_state.pt"
    if state_path.is_file():  # an interrupted run of this command: go on from its last saved step
        state = torch.load(state_path, weights_only=False)
        for m, sd in zip(modules, state["modules"]):
            m.load_state_dict(sd)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        g.set_state(state["generator"])
        if ema:
            ema.n, ema.shadow = state["ema_n"], state["ema_shadow"]
        first, history, loss_ema = state["step"], state["history"], state["loss_ema"]
        t0, c0 = t0 - state["seconds"], c0 - state["cpu_seconds"]
        print(f"resumed from {state_path} at step {first}", flush=True)
    for step in range(first, args.steps):
        images, captions = world.sample_batch(args.batch_size, g, radii=tuple(args.radii), jitter=args.jitter)
        captions = drop_captions(noisy_captions(captions, args.caption_noise, g), args.caption_dropout, g)
        x0 = latents(images)
        eps = torch.randn(x0.shape, generator=g)
        s = torch.sigmoid(torch.randn(len(x0), generator=g)).view(-1, 1, 1, 1)
        embeds, pooled = encode_captions(pipe, captions)
        v = transformer(
            hidden_states=(1 - s) * x0 + s * eps,
            timestep=s.flatten() * 1000,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        loss = F.mse_loss(v, eps - x0)
        update(loss, params, opt, sched, ema)
        loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            rec = {
                "step": step + 1,
                "loss_ema": round(loss_ema, 5),
                "lr": sched.get_last_lr()[0],
                "seconds": round(time.perf_counter() - t0, 1),
                "cpu_seconds": round(time.process_time() - c0, 1),
            }
            history.append(rec)
            print(json.dumps(rec), flush=True)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            out.mkdir(parents=True, exist_ok=True)
            state = {
                "step": step + 1,
                "modules": [m.state_dict() for m in modules],
                "opt": opt.state_dict(),
                "sched": sched.state_dict(),
                "generator": g.get_state(),
                "ema_n": ema.n if ema else 0,
                "ema_shadow": ema.shadow if ema else [],
                "history": history,
                "loss_ema": loss_ema,
                "seconds": time.perf_counter() - t0,
                "cpu_seconds": time.process_time() - c0,
            }
            torch.save(state, out / "train_state.pt.partial")
            os.replace(out / "train_state.pt.partial", state_path)  # a kill while saving leaves the previous state
    train_seconds = time.perf_counter() - t0

    te, te_2, transformer = ema.copy_to(modules) if ema else modules
    transformer.set_attn_processor(stock_processors)
    parts |= {"text_encoder": te, "text_encoder_2": te_2, "transformer": transformer}
    make_pipeline(vae, parts).save_pretrained(out)
    builders.mark_shapesbench(out)
    vae_config = out / "vae" / "config.json"  # loaded from --vae, it names that folder: keep machine paths out
    vae_config.write_text(
        json.dumps({k: v for k, v in json.loads(vae_config.read_text()).items() if k != "_name_or_path"})
    )
    state_path.unlink(missing_ok=True)
    log = {
        "command": "python -m common.shapesbench.train_latent " + " ".join(sys.argv[1:]),
        **vars(args),
        **{
            k: os.path.relpath(getattr(args, k), ROOT)
            for k in ("vae", "out")
            if Path(getattr(args, k)).resolve().is_relative_to(ROOT)
        },
        "params": sum(q.numel() for q in transformer.parameters()),
        "final_loss_ema": round(loss_ema, 5) if loss_ema is not None else None,
        "train_seconds": round(train_seconds, 1),
        "train_cpu_seconds": round(time.process_time() - c0, 1),  # wall time counts a shared machine's other load
        "threads": torch.get_num_threads(),
    }
    (out / "train_log.json").write_text(json.dumps({**log, "history": history}, indent=2) + "\n")
    m = evaluate_pipeline(out, steps=args.eval_steps, samples_per_prompt=args.eval_samples_per_prompt)
    log |= {"eval": m, "target": meets_target(m), "wall_seconds": round(time.perf_counter() - t0, 1)}
    (out / "train_log.json").write_text(json.dumps({**log, "history": history}, indent=2) + "\n")
    print(json.dumps(log))


if __name__ == "__main__":
    main()
