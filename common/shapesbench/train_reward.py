"""Train the learned ShapesBench reward (a tiny CLIP, "the HPS of ShapesBench") and save it.

    python -m common.shapesbench.train_reward --threads 2      # the shipped reward: 2500 steps

Two losses, like a preference model trained on pairs:
  * contrastive, CLIP-style, on ground-truth renders: each image is classified against the embeddings of
    all 168 captions (cross-entropy over cosine similarities times CLIP's learned scale), so the caption
    set itself supplies the hard negatives (same colours, other shape; swapped colours);
  * ranking: the same render scores above its corrupted versions under its own caption (logistic loss on
    the cosine difference with a margin): a periodic texture (amplitude down to 0.01, below what the eye sees, so
    that a policy gains nothing from a faint one), a blur, a blob in the shape's place. Without
    these the reward ranks a textured background above a clean one a quarter of the time, and a policy
    trained on it learns the texture.
The renders are drawn from a slightly wider world than the base model's (radii 7-11, centre +-1 px) with
faint pixel noise, so that the reward judges shapes, not one size or exact palette values. Like a preference
model trained on generated images, a quarter of each batch's clean images are the shipped base model's own
samples (--model-samples, Euler 20 steps, other noise than any evaluation), labelled with the shape the verifier
sees in them and the requested colours, well-formed ones only: the reward then judges imperfect drawings the way
the verifier does (agreement on held-out base samples 0.89 without them).
The reward is the cosine similarity.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from common.models import load_model
from common.sampling import ode_sampler, sample_prompts, sigma_schedule
from common.shapesbench import builders, world
from common.shapesbench.reward import REWARD_PATH, ShapesReward
from common.shapesbench.verifier import verify


@torch.no_grad()
def ranking_accuracy(reward, n: int, seed: int) -> dict:
    """On fresh ground truth: how often the true caption beats a random other caption, and top-1 over all 168."""
    g = torch.Generator().manual_seed(seed)
    images, captions = world.sample_batch(n, g)
    prompts = world.all_prompts()
    sims = reward.image_features(images) @ reward.text_features(prompts).T  # (n, 168)
    true = torch.tensor([prompts.index(c) for c in captions])
    other = (true + torch.randint(1, len(prompts), (n,), generator=g)) % len(prompts)
    return {
        "pairwise_rank_acc": (sims[torch.arange(n), true] > sims[torch.arange(n), other]).float().mean().item(),
        "top1_acc": (sims.argmax(1) == true).float().mean().item(),
    }


def labelled_model_samples(n: int, seed: int) -> tuple[torch.Tensor, list[str]]:
    """n samples of the shipped base model on random prompts (all 168), relabelled with the shape the verifier sees
    (requested colours); the well-formed ones only. Returns (images (m, 3, 32, 32) in [0, 1], captions)."""
    if n == 0:
        return torch.zeros(0, 3, world.SIZE, world.SIZE), []
    g = torch.Generator().manual_seed(seed)
    prompts = [world.all_prompts()[i] for i in torch.randint(168, (n,), generator=g).tolist()]
    model = load_model("shapesbench")
    noise = torch.randn((n, *model.latent_shape()), generator=torch.Generator().manual_seed(seed))
    sampler = ode_sampler(model, model.transformer, sigma_schedule(20, 3.0), 1.0, contextlib.nullcontext)
    images = sample_prompts(sampler, model, prompts, noise, batch_size=64).cpu()
    v = verify(images, prompts)
    keep = v["well_formed"].tolist()
    captions = []
    for p, shape, k in zip(prompts, v["shape_pred"].tolist(), keep):
        if k:
            _, fg, bg = world.parse_prompt(p)
            captions.append(world.make_prompt(world.SHAPES[shape], world.COLOUR_NAMES[fg], world.COLOUR_NAMES[bg]))
    return images[v["well_formed"]], captions


def main():
    p = argparse.ArgumentParser(prog="python -m common.shapesbench.train_reward", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--negatives", type=int, default=64, help="renders per step that get their 3 corrupted versions")
    p.add_argument("--margin", type=float, default=0.05, help="cosine margin of the ranking loss")
    p.add_argument(
        "--texture-amp",
        type=float,
        nargs=2,
        default=[0.01, 0.1],
        help="amplitude range of the periodic-texture negatives",
    )
    p.add_argument("--radii", type=int, nargs="+", default=[7, 8, 9, 10, 11])
    p.add_argument("--jitter", type=int, default=1)
    p.add_argument("--pixel-noise", type=float, default=0.01, help="max std of the Gaussian noise on clean renders")
    p.add_argument("--model-samples", type=int, default=2048, help="base-model samples labelled by the verifier")
    p.add_argument("--model-fraction", type=float, default=0.25, help="fraction of each batch's clean images from them")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REWARD_PATH))
    args = p.parse_args()
    torch.set_num_threads(args.threads or torch.get_num_threads())

    pool, pool_captions = labelled_model_samples(args.model_samples, seed=10_000 + args.seed)
    n_pool = round(args.model_fraction * args.batch_size) if len(pool_captions) else 0
    tokenizer, model = builders.build_reward_components(args.seed)
    prompts = world.all_prompts()
    ids = tokenizer(prompts, padding="max_length", truncation=True, return_tensors="pt").input_ids  # (168, L)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    g = torch.Generator().manual_seed(args.seed)
    t0, bar = time.perf_counter(), tqdm(range(args.steps), desc="train reward", mininterval=2)
    for _ in bar:
        images, captions = world.sample_batch(args.batch_size, g, radii=tuple(args.radii), jitter=args.jitter)
        if n_pool:  # the last n_pool clean images: base-model samples (the negatives come from the first renders)
            idx = torch.randint(len(pool_captions), (n_pool,), generator=g)
            images = torch.cat([images[:-n_pool], pool[idx]])
            captions = captions[:-n_pool] + [pool_captions[i] for i in idx.tolist()]
        target = torch.tensor([prompts.index(c) for c in captions])  # (B,)
        k = args.negatives
        negatives = torch.cat(
            [
                world.periodic_texture(images[:k], g, amp=tuple(args.texture_amp)),
                world.blur(images[:k], g),
                world.blob(captions[:k], g, radii=tuple(args.radii)),
            ]
        )  # (3k, 3, 32, 32): for the first k renders
        noise = args.pixel_noise * torch.rand(len(images), 1, 1, 1, generator=g)
        images = (images + noise * torch.randn(images.shape, generator=g)).clamp(0, 1)
        x = torch.cat([images, negatives]) * 2 - 1
        feats = torch.nn.functional.normalize(model.get_image_features(pixel_values=x).pooler_output, dim=-1)
        img, neg = feats[: len(images)], feats[len(images) :]  # (B, 64), (3k, 64)
        txt = torch.nn.functional.normalize(model.get_text_features(input_ids=ids).pooler_output, dim=-1)  # (168, 64)
        scale = model.logit_scale.exp()
        loss_clip = torch.nn.functional.cross_entropy(scale * img @ txt.T, target)
        pos = (img[:k] * txt[target[:k]]).sum(-1).repeat(3)  # (3k,) clean render, own caption
        neg_sim = (neg * txt[target[:k]].repeat(3, 1)).sum(-1)  # (3k,) corrupted render, same caption
        loss_rank = torch.nn.functional.softplus(scale.detach() * (neg_sim - pos + args.margin)).mean()
        loss = loss_clip + loss_rank
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(clip=f"{loss_clip.item():.4f}", rank=f"{loss_rank.item():.4f}")

    out = Path(args.out)
    tokenizer.save_pretrained(out / "tokenizer")
    model.save_pretrained(out / "model")
    reward = ShapesReward(tokenizer, model.eval())
    log = {
        "command": "python -m common.shapesbench.train_reward " + " ".join(sys.argv[1:]),
        **vars(args),
        "final_loss": round(loss.item(), 5),
        "wall_seconds": round(time.perf_counter() - t0, 1),
        **ranking_accuracy(reward, 2048, args.seed + 1),
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps(log))


if __name__ == "__main__":
    main()
