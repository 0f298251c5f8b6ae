"""Pretrain the ShapesBench text-to-image flow model on CPU and save it in diffusers format.

    python scripts/train_shapes_flow.py --out /tmp/my-shapes --steps 300    # a quick look
    # the ShapesBench v2 candidate in common/assets/shapes-flow-v2 (3235 s on 1 CPU thread; not yet the default):
    python scripts/train_shapes_flow.py --steps 3800 --heads 3 --caption-noise 0.35 --radii 8 10 --jitter 0 \
        --ema 0.999 --threads 1 --out common/assets/shapes-flow-v2

Stage 1, pretraining: rectified flow (x_s = (1 - s) x0 + s eps, target v = eps - x0) with logit-normal s, as
SD3 trains; the CLIP text encoder is trained jointly; 10% of captions are dropped to "" so that classifier-free
guidance works. Ground truth comes from the ShapesBench renderer over all 168 captions (sizes --radii, centres
16 +- --jitter). With --caption-noise p the shape word of a caption is replaced, with probability p, by one of
the two other shapes (uniformly), so that a perfect fit follows the shape word with accuracy 1 - p: the base
model is meant to draw crisp shapes that follow the prompt imperfectly, leaving room for RL. Colours stay clean.

Stage 2 (--sharpen-steps N > 0, --sharpen-rounds R), shape-agnostic sharpening: the stage-1 model (EMA weights) samples a pool of
(initial noise, image) pairs with the eval's sampler (Euler, 20 steps, shift 3) on random clean captions; every
image is snapped to the verifier's best template of *the class the model drew* (not the requested one), painted
in the requested colours; the model is then fine-tuned on these straightened (noise -> snapped image) pairs
(a "reflow" with crisp targets), mixed with a fraction of fresh renders with the same noisy captions. The model's
own shape choices, hence its prompt-following errors, are kept; only the edges are taught.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import shapes  # noqa: E402
from common.models import save_shapesbench  # noqa: E402


def noisy_captions(captions: list[str], p: float, g: torch.Generator) -> list[str]:
    """Replace the shape word with one of the other two shapes (uniformly) with probability p; colours untouched."""
    out = []
    flip = (torch.rand(len(captions), generator=g) < p).tolist()
    other = torch.randint(1, len(shapes.SHAPES), (len(captions),), generator=g).tolist()
    for c, f, o in zip(captions, flip, other):
        if f:
            s, fg, bg = shapes.parse_prompt(c)
            c = shapes.make_prompt(
                shapes.SHAPES[(s + o) % len(shapes.SHAPES)], shapes.COLOUR_NAMES[fg], shapes.COLOUR_NAMES[bg]
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


@torch.no_grad()
def sample_pairs(tokenizer, text_encoder, transformer, n, g, steps=20, batch=128):
    """n (noise, sample in [-1, 1], clean caption) triples from the eval's sampler (Euler, shifted schedule)."""
    prompts = shapes.all_prompts()
    captions = [prompts[i] for i in torch.randint(len(prompts), (n,), generator=g).tolist()]
    noise = torch.randn((n, 3, shapes.SIZE, shapes.SIZE), generator=g)
    sigmas = shapes.sigma_schedule(steps)
    out = []
    for i in range(0, n, batch):
        text = encode(tokenizer, text_encoder, captions[i : i + batch])
        x = noise[i : i + batch].clone()
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            v = transformer(
                hidden_states=x,
                timestep=s.expand(len(x)) * 1000,
                encoder_hidden_states=text.last_hidden_state,
                pooled_projections=text.pooler_output,
                return_dict=False,
            )[0]
            x = x + (s_next - s) * v
        out.append(x.clamp(-1, 1))
    return noise, torch.cat(out), captions


@torch.no_grad()
def snap(images01: torch.Tensor, captions: list[str]):
    """Each image -> the verifier's best template of the class it was drawn as (any class), in the requested
    colours. Returns (snapped images in [0, 1], best IoU (N,), predicted class (N,))."""
    v = shapes.verify(images01, captions)
    masks, classes = shapes._templates()
    target = torch.tensor([shapes.parse_prompt(c) for c in captions])
    pix = images01.flatten(2).transpose(1, 2)
    labels = torch.cdist(pix, shapes.PALETTE.expand(len(pix), -1, -1)).argmin(-1)
    m = (labels == target[:, 1:2]).float()
    inter = m @ masks.T
    iou = inter / (m.sum(1, keepdim=True) + masks.sum(1) - inter).clamp_min(1)
    iou = iou.masked_fill(classes[None] != v["shape_pred"][:, None], -1)  # keep the model's own class
    best = masks[iou.argmax(1)].view(-1, 1, shapes.SIZE, shapes.SIZE).bool()
    fg, bg = shapes.PALETTE[target[:, 1]].view(-1, 3, 1, 1), shapes.PALETTE[target[:, 2]].view(-1, 3, 1, 1)
    return torch.where(best, fg, bg), v["best_iou"], v["shape_pred"]


def lr_lambda(warmup, total):
    # linear warmup, then cosine decay to 0: a decayed model samples visibly cleaner than a constant-lr one
    return lambda i: min((i + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(i, total) / total)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--caption-dropout", type=float, default=0.1)
    p.add_argument(
        "--caption-noise", type=float, default=0.0, help="probability that the shape word is replaced by another shape"
    )
    p.add_argument(
        "--radii",
        type=int,
        nargs="+",
        default=list(shapes.RADII),
        help="shape radii drawn uniformly (default: the world's)",
    )
    p.add_argument(
        "--jitter", type=int, default=shapes.JITTER, help="centre = 16 +- jitter on each axis (default: the world's)"
    )
    p.add_argument("--heads", type=int, default=2, help="transformer width = 64 * heads")
    p.add_argument("--layers", type=int, default=4, help="joint transformer blocks")
    p.add_argument("--ema", type=float, default=0.0, help="EMA decay of the saved weights (0 = save the raw weights)")
    p.add_argument(
        "--sharpen-steps", type=int, default=0, help="stage 2 (shape-agnostic sharpening) steps per round; 0 = none"
    )
    p.add_argument(
        "--sharpen-rounds", type=int, default=1, help="stage 2 rounds: each samples a new pool from the current model"
    )
    p.add_argument(
        "--sharpen-pool",
        type=int,
        default=2048,
        help="stage 2: (noise, snapped sample) pairs sampled from the stage-1 model",
    )
    p.add_argument("--sharpen-lr", type=float, default=3e-4)
    p.add_argument(
        "--sharpen-mix",
        type=float,
        default=0.25,
        help="stage 2: fraction of each batch that is fresh renders (noisy captions)",
    )
    p.add_argument(
        "--sharpen-min-iou", type=float, default=0.5, help="stage 2: drop pool samples whose best template fits worse"
    )
    p.add_argument(
        "--init", default="", help="start from this saved ShapesBench folder (e.g. to run stage 2 only with --steps 0)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(shapes.FLOW_PATH))
    p.add_argument(
        "--snapshots",
        type=int,
        nargs="*",
        default=[],
        help="also save the (EMA) model after these steps to OUT_stepN (stage-2 steps count after --steps)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.init:
        from diffusers import SD3Transformer2DModel
        from transformers import AutoTokenizer, CLIPTextModel

        tokenizer = AutoTokenizer.from_pretrained(Path(args.init) / "tokenizer")
        text_encoder = CLIPTextModel.from_pretrained(Path(args.init) / "text_encoder")
        transformer = SD3Transformer2DModel.from_pretrained(Path(args.init) / "transformer")
        torch.manual_seed(args.seed)
    else:
        tokenizer, text_encoder, transformer = shapes.build_flow_components(args.seed, args.heads, args.layers)
    modules = [text_encoder, transformer]
    for m in modules:
        m.train()
    params = [q for m in modules for q in m.parameters()]
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    history = []

    def fresh_batch(n):
        x0, captions = shapes.sample_batch(n, g, radii=tuple(args.radii), jitter=args.jitter)
        captions = drop_captions(noisy_captions(captions, args.caption_noise, g), args.caption_dropout, g)
        return x0 * 2 - 1, torch.randn(x0.shape, generator=g), captions

    def run(stage, steps, lr, warmup, batch_fn, step_offset):
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup, steps))
        ema = EMA(modules, args.ema) if args.ema > 0 else None
        ema_loss = None
        for step in range(steps):
            x0, eps, captions = batch_fn()
            loss = flow_loss(tokenizer, text_encoder, transformer, x0, eps, captions, g)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            if ema:
                ema.update()
            ema_loss = loss.item() if ema_loss is None else 0.98 * ema_loss + 0.02 * loss.item()
            if (step + 1) % args.log_every == 0 or step + 1 == steps:
                rec = {
                    "stage": stage,
                    "step": step + 1,
                    "loss_ema": round(ema_loss, 5),
                    "lr": sched.get_last_lr()[0],
                    "seconds": round(time.perf_counter() - t0, 1),
                }
                history.append(rec)
                print(json.dumps(rec), flush=True)
            if step_offset + step + 1 in args.snapshots:
                save_shapesbench(f"{args.out}_step{step_offset + step + 1}", *current(ema)[::-1], tokenizer)
        return ema, ema_loss

    def current(ema):
        """(text_encoder, transformer) holding the weights to save / sample from."""
        return ema.copy_to(modules) if ema else modules

    final_loss, stage2 = None, []
    ema = None
    if args.steps > 0:
        ema, final_loss = run(1, args.steps, args.lr, args.warmup, lambda: fresh_batch(args.batch_size), 0)
    for rnd in range(args.sharpen_rounds if args.sharpen_steps > 0 else 0):
        te, tr = current(ema)
        with torch.no_grad():  # continue from the weights the previous stage / round would have saved
            for d, s in zip(params, [q for m in (te, tr) for q in m.parameters()]):
                d.copy_(s)
        te.eval(), tr.eval()
        t1 = time.perf_counter()
        noise, samples, caps = sample_pairs(tokenizer, te, tr, args.sharpen_pool, g)
        snapped, best_iou, pred = snap((samples + 1) / 2, caps)
        keep = best_iou >= args.sharpen_min_iou
        req = torch.tensor([shapes.parse_prompt(c)[0] for c in caps])
        conf = [[int(((req == a) & (pred == b)).sum()) for b in range(3)] for a in range(3)]
        pool = {
            "round": rnd + 1,
            "pool": args.sharpen_pool,
            "kept": int(keep.sum()),
            "pool_seconds": round(time.perf_counter() - t1, 1),
            "pool_well_formed": (best_iou >= shapes.WELL_FORMED_IOU).float().mean().item(),
            "pool_shape_match": (pred == req).float().mean().item(),
            "pool_confusion": conf,
        }
        stage2.append(pool)
        print(json.dumps({"stage2_pool": pool}), flush=True)
        noise, snapped = noise[keep], snapped[keep] * 2 - 1
        caps = [c for c, k in zip(caps, keep.tolist()) if k]
        n_fresh = round(args.batch_size * args.sharpen_mix)

        def sharpen_batch(caps=caps, n_fresh=n_fresh, snapped=snapped, noise=noise):
            idx = torch.randint(len(caps), (args.batch_size - n_fresh,), generator=g)
            x0, eps, captions = snapped[idx], noise[idx], [caps[i] for i in idx.tolist()]
            if n_fresh:
                fx, fe, fc = fresh_batch(n_fresh)
                x0, eps, captions = torch.cat([x0, fx]), torch.cat([eps, fe]), captions + fc
            return x0, eps, captions

        for m in modules:
            m.train()
        ema, final_loss = run(
            2 + rnd,
            args.sharpen_steps,
            args.sharpen_lr,
            min(args.warmup, args.sharpen_steps // 10 + 1),
            sharpen_batch,
            args.steps + rnd * args.sharpen_steps,
        )

    out = Path(args.out)
    te, tr = current(ema)
    save_shapesbench(out, tr, te, tokenizer)
    log = {
        "command": "python " + " ".join(sys.argv),
        **vars(args),
        "data_recipe": {
            "caption_noise": args.caption_noise,
            "caption_dropout": args.caption_dropout,
            "radii": args.radii,
            "jitter": args.jitter,
            "steps": args.steps,
            "batch_size": args.batch_size,
            "sharpen_steps": args.sharpen_steps,
            "sharpen_rounds": args.sharpen_rounds,
        },
        "params": sum(q.numel() for q in transformer.parameters()),
        "final_loss_ema": round(final_loss, 5) if final_loss is not None else None,
        "stage2_pool": stage2,
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "threads": torch.get_num_threads(),
        "history": history,
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps({k: v for k, v in log.items() if k != "history"}))


if __name__ == "__main__":
    main()
