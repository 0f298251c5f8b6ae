"""Train the learned ShapesBench reward (a tiny CLIP, "the HPS of ShapesBench") and save it.

    python scripts/train_shapes_reward.py                    # 2500 steps, about 10 min on 1 CPU core

Contrastive, CLIP-style, on clean ground-truth renders only: each image is classified against the
embeddings of all 168 captions (cross-entropy over cosine similarities times CLIP's learned scale),
so the caption set itself supplies the hard negatives (same colours, other shape; swapped colours).
Clean images only: a texture painted over the background is then out of distribution for the reward,
not a learned shortcut. The reward is the cosine similarity.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import shapes  # noqa: E402


@torch.no_grad()
def ranking_accuracy(reward, n: int, seed: int) -> dict:
    """On fresh ground truth: how often the true caption beats a random other caption, and top-1 over all 168."""
    g = torch.Generator().manual_seed(seed)
    images, captions = shapes.sample_batch(n, g)
    prompts = shapes.all_prompts()
    sims = reward.image_features(images) @ reward.text_features(prompts).T  # (n, 168)
    true = torch.tensor([prompts.index(c) for c in captions])
    other = (true + torch.randint(1, len(prompts), (n,), generator=g)) % len(prompts)
    return {
        "pairwise_rank_acc": (sims[torch.arange(n), true] > sims[torch.arange(n), other]).float().mean().item(),
        "top1_acc": (sims.argmax(1) == true).float().mean().item(),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(shapes.REWARD_PATH))
    args = p.parse_args()

    tokenizer, model = shapes.build_reward_components(args.seed)
    prompts = shapes.all_prompts()
    ids = tokenizer(prompts, padding="max_length", truncation=True, return_tensors="pt").input_ids  # (168, L)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    g = torch.Generator().manual_seed(args.seed)
    t0, bar = time.perf_counter(), tqdm(range(args.steps), desc="train reward", mininterval=2)
    for _ in bar:
        images, captions = shapes.sample_batch(args.batch_size, g)
        target = torch.tensor([prompts.index(c) for c in captions])
        img = torch.nn.functional.normalize(model.get_image_features(pixel_values=images * 2 - 1).pooler_output, dim=-1)
        txt = torch.nn.functional.normalize(model.get_text_features(input_ids=ids).pooler_output, dim=-1)
        loss = torch.nn.functional.cross_entropy(model.logit_scale.exp() * img @ txt.T, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.4f}")

    out = Path(args.out)
    tokenizer.save_pretrained(out / "tokenizer")
    model.save_pretrained(out / "model")
    reward = shapes.ShapesReward(tokenizer, model.eval())
    log = {
        "command": "python " + " ".join(sys.argv),
        **vars(args),
        "final_loss": round(loss.item(), 5),
        "wall_seconds": round(time.perf_counter() - t0, 1),
        **ranking_accuracy(reward, 2048, args.seed + 1),
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps(log))


if __name__ == "__main__":
    main()
