"""Pretrain the ShapesBench text-to-image flow model on CPU and save it in diffusers format.

    python -m common.shapesbench.train_flow --threads 1     # the shipped model: 3800 steps, 3235 s on 1 thread
    python -m common.shapesbench.train_flow --steps 300 --out /tmp/my-shapes   # a quick look

Rectified flow (x_s = (1 - s) x0 + s eps, target v = eps - x0) with logit-normal s, as SD3 trains; the CLIP
text encoder is trained jointly; 10% of captions are dropped to "" so that classifier-free guidance works.
Ground truth comes from the ShapesBench renderer over all 168 captions (sizes --radii, centres 16 +- --jitter,
by default the world's). Caption noise, the way web captions mislabel images: with probability --caption-noise
the shape word of a caption is replaced by one of the two other shapes (uniformly), so that a perfect fit
follows the shape word with accuracy 1 - p; colours stay right. The model draws crisp shapes that follow the
prompt imperfectly, which is the room RL has. The saved weights are an EMA (--ema), which samples cleaner
edges than the raw weights.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

from common.shapesbench import builders, world


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


def encode(tokenizer, text_encoder, captions):
    ids = tokenizer(captions, padding="max_length", truncation=True, return_tensors="pt").input_ids
    return text_encoder(ids)


def flow_loss(tokenizer, text_encoder, transformer, x0, eps, captions, g):
    """Rectified-flow loss on pairs (x0 in [-1, 1], eps) with logit-normal(0, 1) noise levels."""
    s = torch.sigmoid(torch.randn(len(x0), generator=g)).view(-1, 1, 1, 1)
    xs = (1 - s) * x0 + s * eps
    text = encode(tokenizer, text_encoder, captions)
    v = transformer(
        hidden_states=xs,
        timestep=s.flatten() * 1000,
        encoder_hidden_states=text.last_hidden_state,
        pooled_projections=text.pooler_output,
        return_dict=False,
    )[0]
    return torch.nn.functional.mse_loss(v, eps - x0)


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


def add_recipe_args(p) -> None:
    """The base model's recipe flags, shared by this trainer (pixel space) and train_latent.py (VAE latent): data and
    captions, model size, optimisation, EMA."""
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


def update(loss, params, opt, sched, ema) -> None:
    """One optimisation step of the ShapesBench trainers: gradient clipped to norm 1, AdamW, the schedule, the EMA."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    if ema:
        ema.update()


def main():
    p = argparse.ArgumentParser(prog="python -m common.shapesbench.train_flow", description=__doc__.split("\n")[0])
    add_recipe_args(p)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(builders.FLOW_PATH))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tokenizer, text_encoder, transformer = builders.build_flow_components(args.seed, args.heads, args.layers)
    modules = [text_encoder, transformer]
    for m in modules:
        m.train()
    params = [q for m in modules for q in m.parameters()]
    g = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup, args.steps))
    ema = EMA(modules, args.ema) if args.ema > 0 else None
    t0, history, loss_ema = time.perf_counter(), [], None
    for step in range(args.steps):
        x0, captions = world.sample_batch(args.batch_size, g, radii=tuple(args.radii), jitter=args.jitter)
        captions = drop_captions(noisy_captions(captions, args.caption_noise, g), args.caption_dropout, g)
        x0, eps = x0 * 2 - 1, torch.randn(x0.shape, generator=g)
        loss = flow_loss(tokenizer, text_encoder, transformer, x0, eps, captions, g)
        update(loss, params, opt, sched, ema)
        loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            rec = {
                "step": step + 1,
                "loss_ema": round(loss_ema, 5),
                "lr": sched.get_last_lr()[0],
                "seconds": round(time.perf_counter() - t0, 1),
            }
            history.append(rec)
            print(json.dumps(rec), flush=True)

    out = Path(args.out)
    te, tr = ema.copy_to(modules) if ema else modules
    builders.save_flow_model(out, tr, te, tokenizer)
    log = {
        "command": "python -m common.shapesbench.train_flow " + " ".join(sys.argv[1:]),
        **vars(args),
        "params": sum(q.numel() for q in transformer.parameters()),
        "final_loss_ema": round(loss_ema, 5) if loss_ema is not None else None,
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "threads": torch.get_num_threads(),
        "history": history,
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps({k: v for k, v in log.items() if k != "history"}))


if __name__ == "__main__":
    main()
