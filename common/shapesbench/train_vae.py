"""Train the tiny ShapesBench VAE on CPU and save it in diffusers format (an AutoencoderKL).

    python -m common.shapesbench.train_vae --threads 1                     # the shipped VAE (see its train_log.json)
    python -m common.shapesbench.train_vae --steps 200 --out /tmp/my-vae   # a quick look

32x32x3 images in [-1, 1] (the diffusers convention) <-> 8x8x4 latents: three encoder blocks, two of which halve
the resolution (a factor-4 VAE with 4 latent channels, the SD / SD3 layout at toy size). Every step draws fresh
renders over all 168 captions at the world's radii (world.sample_batch). Loss: L1 + MSE reconstruction of a
posterior sample, plus --kl-weight times the KL to N(0, I) per latent dimension; the KL keeps the latent smooth and
the posterior noise teaches the decoder to decode a neighbourhood of each latent (a generator's latents are never
exact). The saved weights are an EMA (--ema).

At the end the script measures the latent's mean and std over many renders and stores them in the config as
`shift_factor` and `scaling_factor = 1 / std` (the SD3 / FLUX convention: latents_model = (z - shift) * scale,
z = latents_model / scale + shift before decoding), then checks reconstructions (decode of the posterior mode,
clamped) of held-out fresh renders against the verifier: every prompt at every radius plus --eval-n random renders
from a separate seed. The pass rates, the pixel MSE and the failures per check go into train_log.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from diffusers import AutoencoderKL

from common.shapesbench import builders, verifier, world
from common.shapesbench.train_latent import EMA, lr_lambda, update


def build_vae(widths=(32, 64, 64), latent_channels: int = 4, groups: int = 16, seed: int = 0):
    """A randomly initialised AutoencoderKL for 32x32x3 images: len(widths) blocks, all but the last downsample."""
    torch.manual_seed(seed)
    n = len(widths)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(widths),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=groups,
        sample_size=world.SIZE,
    )


def eval_renders(n_random: int, seed: int):
    """Held-out renders in [0, 1] and their prompts: all 168 prompts at every radius, then n_random fresh ones."""
    prompts = [p for p in world.all_prompts() for _ in world.RADII]
    shape, fg, bg = torch.tensor([world.parse_prompt(p) for p in prompts]).unbind(1)
    radius = torch.tensor(list(world.RADII) * len(world.all_prompts()))
    centre = torch.full_like(radius, world.SIZE // 2)
    images = world.render(shape, fg, bg, radius, centre, centre)
    extra, extra_prompts = world.sample_batch(n_random, torch.Generator().manual_seed(seed))
    return torch.cat([images, extra]), prompts + extra_prompts


@torch.no_grad()
def encode_mode(vae, images01: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """Raw latents z (the posterior mode, before shift / scale) of images (N, 3, 32, 32) in [0, 1]."""
    return torch.cat(
        [
            vae.encode(images01[i : i + batch_size] * 2 - 1).latent_dist.mode()
            for i in range(0, len(images01), batch_size)
        ]
    )


@torch.no_grad()
def decode01(vae, z: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """Images in [0, 1] of raw latents z (N, 4, 8, 8), clamped as the diffusers image processor does."""
    return torch.cat(
        [((vae.decode(z[i : i + batch_size]).sample + 1) / 2).clamp(0, 1) for i in range(0, len(z), batch_size)]
    )


@torch.no_grad()
def check_reconstructions(vae, images01: torch.Tensor, prompts: list[str]) -> dict:
    """Verifier verdicts on decode(mode(encode(x))): pass rates, failures per check, pixel MSE."""
    rec = decode01(vae, encode_mode(vae, images01))
    v = verifier.verify(rec, prompts)
    ok = v["all"] & v["well_formed"]
    checks = ("bg", "fg", "shape", "clean", "well_formed")
    return {
        "n": len(prompts),
        "prompts": len(set(prompts)),
        "pass_rate": round(ok.float().mean().item(), 5),
        "failures": {k: int((~v[k]).sum()) for k in checks},
        "pixel_mse": float(((rec - images01) ** 2).mean()),
        "pixel_max_abs_err": float((rec - images01).abs().amax()),
        "periodic_max": float(v["periodic"].max()),
    }


@torch.no_grad()
def latent_stats(vae, n: int, seed: int) -> dict:
    """Mean and std (over all latent elements) of the posterior mode on n fresh renders, and the posterior's own
    mean std relative to the spread (how noisy the latent a decoder sees is)."""
    images, _ = world.sample_batch(n, torch.Generator().manual_seed(seed))
    dists = [vae.encode(images[i : i + 256] * 2 - 1).latent_dist for i in range(0, n, 256)]
    z = torch.cat([d.mode() for d in dists])
    post_std = torch.cat([d.std for d in dists])
    return {
        "mean": z.mean().item(),
        "std": z.std().item(),
        "channel_mean": z.mean((0, 2, 3)).tolist(),
        "channel_std": z.std((0, 2, 3)).tolist(),
        "posterior_std_over_std": (post_std.mean() / z.std()).item(),
    }


def main():
    p = argparse.ArgumentParser(prog="python -m common.shapesbench.train_vae", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--kl-weight", type=float, default=1e-4, help="weight of the mean KL per latent dimension")
    p.add_argument("--widths", type=int, nargs="+", default=[32, 64, 64], help="block widths; len - 1 downsamples")
    p.add_argument("--groups", type=int, default=16, help="GroupNorm groups (must divide every width)")
    p.add_argument("--ema", type=float, default=0.999, help="EMA decay of the saved weights (0 = the raw weights)")
    p.add_argument("--eval-n", type=int, default=2000, help="random held-out renders checked at the end")
    p.add_argument("--eval-seed", type=int, default=12345)
    p.add_argument("--stats-n", type=int, default=4096, help="renders over which the latent mean / std are taken")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(builders.VAE_PATH))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    vae = build_vae(tuple(args.widths), 4, args.groups, args.seed)
    vae.train()
    params = list(vae.parameters())
    g = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup, args.steps))
    ema = EMA([vae], args.ema) if args.ema > 0 else None
    t0, c0, history, avg = time.perf_counter(), time.process_time(), [], None
    for step in range(args.steps):
        x, _ = world.sample_batch(args.batch_size, g)
        x = x * 2 - 1
        post = vae.encode(x).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=g)
        rec = vae.decode(z).sample
        l1 = (rec - x).abs().mean()
        mse = ((rec - x) ** 2).mean()
        kl = 0.5 * (post.mean**2 + post.var - 1 - post.logvar).mean()
        loss = l1 + mse + args.kl_weight * kl
        update(loss, params, opt, sched, ema)
        now = {"loss": loss.item(), "l1": l1.item(), "mse": mse.item(), "kl": kl.item()}
        avg = now if avg is None else {k: 0.98 * avg[k] + 0.02 * now[k] for k in now}
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            rec = {"step": step + 1, **{f"{k}_ema": round(v, 6) for k, v in avg.items()}}
            rec |= {"lr": sched.get_last_lr()[0], "seconds": round(time.perf_counter() - t0, 1)}
            rec["cpu_seconds"] = round(time.process_time() - c0, 1)
            history.append(rec)
            print(json.dumps(rec), flush=True)
    train_seconds = time.perf_counter() - t0

    vae = ema.copy_to([vae])[0] if ema else vae
    vae.eval()
    stats = latent_stats(vae, args.stats_n, args.eval_seed + 1)
    vae.register_to_config(scaling_factor=1.0 / stats["std"], shift_factor=stats["mean"])
    images, prompts = eval_renders(args.eval_n, args.eval_seed)
    checks = check_reconstructions(vae, images, prompts)
    out = Path(args.out)
    vae.save_pretrained(out)
    log = {
        "command": "python -m common.shapesbench.train_vae " + " ".join(sys.argv[1:]),
        **vars(args),
        "params": sum(q.numel() for q in vae.parameters()),
        "scaling_factor": vae.config.scaling_factor,
        "shift_factor": vae.config.shift_factor,
        "latent_stats": stats,
        "reconstruction_check": checks,
        "passes_bar": checks["pass_rate"] >= 0.995,
        "train_seconds": round(train_seconds, 1),
        "cpu_seconds": round(time.process_time() - c0, 1),  # wall time counts a shared machine's other load
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "threads": torch.get_num_threads(),
        "history": history,
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps({k: v for k, v in log.items() if k != "history"}))


if __name__ == "__main__":
    main()
