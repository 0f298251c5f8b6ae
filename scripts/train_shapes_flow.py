"""Pretrain the ShapesBench text-to-image flow model on CPU and save it in diffusers format.

    python scripts/train_shapes_flow.py                      # 2500 steps: 35 min on 1 busy CPU core (train_log.json)
    python scripts/train_shapes_flow.py --out /tmp/my-shapes --steps 300

Rectified flow (x_s = (1 - s) x0 + s eps, target v = eps - x0) with logit-normal s, as SD3 trains;
the CLIP text encoder is trained jointly; 10% of captions are dropped to "" so that classifier-free
guidance works. Ground truth comes from the ShapesBench renderer over all 168 captions. The model is
deliberately under-trained: colours right, shapes often wrong, leaving room for RL (colour accuracy
>= 0.9 and shape accuracy between 0.3 and 0.75 on the held-out prompts, `python -m common.shapes eval`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import shapes  # noqa: E402
from common.models import save_shapesbench  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--caption-dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(shapes.FLOW_PATH))
    p.add_argument(
        "--snapshots", type=int, nargs="*", default=[], help="also save the model after these steps to OUT_stepN"
    )
    args = p.parse_args()

    tokenizer, text_encoder, transformer = shapes.build_flow_components(args.seed)
    params = [*text_encoder.parameters(), *transformer.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    # linear warmup, then cosine decay to 0: a decayed model samples visibly cleaner than a constant-lr one
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min((i + 1) / args.warmup, 0.5 * (1 + math.cos(math.pi * i / args.steps)))
    )
    g = torch.Generator().manual_seed(args.seed)
    t0, ema_loss = time.perf_counter(), None
    bar = tqdm(range(args.steps), desc="pretrain flow", mininterval=2)
    for step in bar:
        x0, captions = shapes.sample_batch(args.batch_size, g)
        x0 = x0 * 2 - 1  # pixels in [-1, 1] are the "latents"
        drop = torch.rand(len(captions), generator=g) < args.caption_dropout
        captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
        s = torch.sigmoid(torch.randn(len(x0), generator=g))  # logit-normal(0, 1) noise level, (B,)
        eps = torch.randn(x0.shape, generator=g)
        xs = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * eps
        ids = tokenizer(captions, padding="max_length", truncation=True, return_tensors="pt").input_ids
        text = text_encoder(ids)
        v = transformer(
            hidden_states=xs,
            timestep=s * 1000,
            encoder_hidden_states=text.last_hidden_state,
            pooled_projections=text.pooler_output,
            return_dict=False,
        )[0]
        loss = torch.nn.functional.mse_loss(v, eps - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema_loss = loss.item() if ema_loss is None else 0.98 * ema_loss + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema_loss:.4f}")
        if step + 1 in args.snapshots:
            save_shapesbench(f"{args.out}_step{step + 1}", transformer, text_encoder, tokenizer)

    out = Path(args.out)
    save_shapesbench(out, transformer, text_encoder, tokenizer)
    log = {
        "command": "python " + " ".join(sys.argv),
        **vars(args),
        "final_loss_ema": round(ema_loss, 5),
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "threads": torch.get_num_threads(),
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps(log))


if __name__ == "__main__":
    main()
