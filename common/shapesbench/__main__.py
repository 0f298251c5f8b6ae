"""`python -m common.shapesbench eval`: sample a ShapesBench model on the held-out prompts and print JSON.

    python -m common.shapesbench eval                                  # the shipped base model
    python -m common.shapesbench eval --grid docs/base_samples.png     # also a grid with the verifier's verdicts
    python -m common.shapesbench eval --trained runs/<run>/final       # a run's full or LoRA weights on top

The sampler and the noise are the scripts' Evaluator's (common/sampling.py): Euler ODE on the shifted schedule
(shift 3), sample j from noise keyed on (--seed, 'eval', j), so a run's evaluation at iteration 0 and this command
give the base model the same figures. The JSON holds the verifier's accuracies, the
well-formed rate, the requested -> predicted shape confusion matrix, the learned reward, diversity, and the
learned reward's checks (agreement with the verifier's shape class on the well-formed samples; how often a clean
render beats its textured / blurred / blob version).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
from diffusers import SD3Transformer2DModel

from common.models import load_model
from common.sampling import fixed_noise, ode_sampler, sample_prompts, sigma_schedule
from common.shapesbench import reward as shapes_reward
from common.shapesbench import verifier, world
from common.viz import save_grid


def load_trained(model, trained: str) -> None:
    """Put a run's final/ weights (transformer/ for full fine-tuning, or SD3-format LoRA weights) into `model`."""
    path = Path(trained)
    if (path / "transformer").is_dir():  # into the loaded transformer, which keeps ShapesModel's attention processor
        model.transformer.load_state_dict(SD3Transformer2DModel.from_pretrained(path / "transformer").state_dict())
    elif (path / "pytorch_lora_weights.safetensors").is_file():
        model.transformer.load_lora_adapter(str(path), prefix="transformer", use_safetensors=True)
    else:
        raise SystemExit(
            f"--trained {path}: expected a run's final/ folder with transformer/ or pytorch_lora_weights.safetensors"
        )


@torch.no_grad()
def sample(model, prompts: list[str], seed: int, steps: int, guidance_scale: float, batch_size: int = 64):
    """Euler ODE samples (N, 3, 32, 32) in [0, 1] of `prompts`: sample j starts from the noise the scripts' Evaluator
    draws for its sample j, keyed on (seed, 'eval', j), on the scripts' default schedule (shift 3), so a model gets
    the same held-out figures here as at a run's evaluation."""
    noise = fixed_noise(seed, "eval", model.latent_shape(), 0, len(prompts))
    sampler = ode_sampler(model, model.transformer, sigma_schedule(steps, 3.0), guidance_scale, contextlib.nullcontext)
    return sample_prompts(sampler, model, prompts, noise, batch_size).cpu()


def main(args) -> None:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    model = load_model(args.model_id)
    name = str(args.model_id)
    if args.trained:
        load_trained(model, args.trained)
        name = f"{name} + {args.trained}"
    prompts = [p for p in world.split_prompts(args.split) for _ in range(args.samples_per_prompt)]
    t0 = time.perf_counter()
    images = sample(model, prompts, args.seed, args.steps, args.guidance_scale)
    seconds = time.perf_counter() - t0
    reward = shapes_reward.load_reward_model(args.reward or None)
    metrics = verifier.evaluate(images, prompts, reward)
    v = verifier.verify(images, prompts)
    wf = v["well_formed"]
    checks = {
        "well_formed_samples": int(wf.sum()),
        "agreement": shapes_reward.shape_agreement(
            reward, images[wf], [p for p, k in zip(prompts, wf.tolist()) if k], v["shape_pred"][wf]
        ),
        **shapes_reward.ranking_checks(reward, torch.Generator().manual_seed(args.seed)),
    }
    result = {
        "model_id": name,
        "split": args.split,
        "n": len(prompts),
        "steps": args.steps,
        "guidance_scale": args.guidance_scale,
        "seed": args.seed,
        **metrics,
        "confusion": {
            "rows_requested_cols_predicted": list(world.SHAPES),
            "matrix": verifier.confusion_matrix(metrics),
        },
        "reward_checks": checks,
        "sampling_seconds": round(seconds, 2),
    }
    print(json.dumps(result, indent=1))
    if args.grid:  # the first sample of every prompt, so that all three shapes appear
        pick = list(range(0, len(prompts), args.samples_per_prompt))[: args.grid_n]
        save_grid(
            args.grid,
            images[pick],
            [prompts[i].removeprefix("a ").removesuffix(" background") for i in pick],
            ok=v["all"][pick].tolist(),
            ncol=8,
            title=f"{name}: held-out prompts, Euler {args.steps} steps, badge = verifier verdict (right colours, shape, clean background)",
        )
        print(f"grid written to {args.grid}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m common.shapesbench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser(
        "eval",
        help="sample a model on held-out prompts; print the verifier's accuracies and the learned reward as JSON",
    )
    e.add_argument(
        "--model-id", default="shapesbench", help="flow model: 'shapesbench' (the shipped one) or a local folder"
    )
    e.add_argument(
        "--trained", default="", help="a run's final/ folder (full or LoRA weights) to load on top of --model-id"
    )
    e.add_argument("--reward", default="", help="learned reward folder (default: the shipped one)")
    e.add_argument("--split", default="eval", choices=["eval", "train"])
    e.add_argument("--samples-per-prompt", type=int, default=4)
    e.add_argument("--steps", type=int, default=20, help="Euler ODE steps (shifted schedule, shift 3)")
    e.add_argument("--guidance-scale", type=float, default=1.0, help="classifier-free guidance (1 = off)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    e.add_argument(
        "--grid", default="", help="also write a PNG grid (first sample of each prompt) with the verifier's verdicts"
    )
    e.add_argument("--grid-n", type=int, default=48)
    main(p.parse_args())
