"""Score base and trained weights side by side, paired by noise, as the papers' tables do.

    python -m common.evaluate --weights runs/dancegrpo__0__<time>                  # ShapesBench: base vs a run
    bash run.sh evaluate-flux --weights runs/<run>      # FLUX.1-dev on HPDv2's test prompts (run.sh --print shows it)
    accelerate launch -m common.evaluate ...            # batches sharded over processes

Every model (the base, then each --weights) draws the same initial noise for the same (prompt, sample), keyed on
(--seed, 'eval', index) as the training scripts' held-out evaluation, through the same Euler ODE sampler
(common/sampling.py): with the run's evaluation settings (--num-steps = its --eval-steps, --batch-size = its rollout
batch) this command reproduces a run's last held-out evaluation of its final/ weights exactly. Each reward's mean per
model; each trained model's difference from the base with its paired standard error over prompts (and per HPDv2
style); on ShapesBench the verifier's accuracies and diversity too. Models are loaded one at a time; every batch's
scores are cached under --out, so an interrupted evaluation resumes where it stopped. Outputs in --out:
results.md (the table), results.json (every figure), scores.jsonl (per prompt and model), grid.png (the first
sample of --grid-prompts prompts, a row per model). docs/evaluate.md has the papers' settings.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Optional

import torch
import tyro
from tqdm import tqdm

from common import InputError
from common.flags import RunArgs, need
from common.prompts import evenly_spaced
from common.sampling import fixed_noise, ode_sampler, sample_prompts, sigma_schedule


@dataclass
class EvalArgs:
    model_id: str = "shapesbench"
    """the base model (hub id or local diffusers folder), as --model-id of the training scripts"""
    weights: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """trained weights to compare with the base (repeat the flag): a run folder (its final/), a final/ folder, a
    checkpoint (checkpoints/iter_N), a LoRA folder or a full transformer folder; NAME=PATH names its row"""
    prompts: str = "shapes-eval"
    """shapes-eval, shapes-train, hpdv2 (HPDv2's 3200 test prompts with their styles, from the hub cache), hpdv2=FOLDER
    (its benchmark/*.json), or a text file with one prompt per line"""
    max_prompts: int = 0
    """at most this many prompts, evenly spaced through the list (0 = all): the training scripts' --eval-max-prompts"""
    reward: str = "shapes,verifier"
    """rewards to report (name:weight,...; the weights only form the total): any registered reward, local or served"""
    reward_ckpt: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """NAME=PATH per reward model, as the training scripts'"""
    reward_url: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """NAME=URL per reward scored by another process, as the training scripts'"""
    samples_per_prompt: int = 4
    num_steps: int = 20
    """Euler ODE steps on the shifted schedule"""
    shift: float = 3.0
    guidance_scale: float = 1.0
    resolution: Optional[int] = None
    num_frames: Optional[int] = None
    """video models only"""
    seed: int = 0
    batch_size: int = 16
    """images per sampler call (a batch is also the unit of the cache)"""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    grid_prompts: int = 8
    out: str = "eval_out"
    """folder for the table, the figures, the per-prompt scores, the grid and the cache"""

    reward_checkpoints = RunArgs.reward_checkpoints  # {NAME: PATH or URL} of --reward-ckpt and --reward-url


# ---------------------------------------------------------------------------------------------------
# Inputs: prompts (with their HPDv2 style) and the weights to load
# ---------------------------------------------------------------------------------------------------
def load_prompt_set(source: str, max_prompts: int) -> tuple[list[str], list[str]]:
    """(prompts, style of each: HPDv2's or '' elsewhere), the evenly spaced subset of max_prompts when > 0."""
    from common.prompts import HPDV2_STYLES, hpdv2_prompts, load_prompts

    if source == "hpdv2" or source.startswith("hpdv2="):
        try:
            prompts = hpdv2_prompts(source.partition("=")[2] or None)
        except Exception as e:  # offline without the files, or a folder without benchmark/*.json
            raise InputError(f"--prompts {source}: {type(e).__name__}: {str(e)[:200]}; give hpdv2=FOLDER") from None
        per = len(prompts) // len(HPDV2_STYLES)
        styles = [HPDV2_STYLES[min(i // per, len(HPDV2_STYLES) - 1)] for i in range(len(prompts))]
    else:
        prompts = load_prompts(source)
        styles = [""] * len(prompts)
    if max_prompts > 0:
        keep = evenly_spaced(list(range(len(prompts))), max_prompts)
        prompts, styles = [prompts[i] for i in keep], [styles[i] for i in keep]
    return prompts, styles


def weights_folder(spec: str) -> tuple[str, Path]:
    """--weights [NAME=]PATH -> (row name, the folder that holds the weights): a run folder gives its final/."""
    name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
    folder = Path(path).expanduser()
    if (folder / "final").is_dir():
        folder = folder / "final"
    if (folder / "model.safetensors").is_file():  # a checkpoint, checkpoints/iter_N
        return name or f"{folder.parent.parent.name}/{folder.name}", folder
    if not ((folder / "pytorch_lora_weights.safetensors").is_file() or (folder / "transformer").is_dir()):
        if (folder / "config.json").is_file():  # a transformer folder itself
            return name or folder.name, folder
        raise InputError(
            f"--weights {spec}: expected a run folder with final/, a final/ folder (transformer/ or "
            "pytorch_lora_weights.safetensors), a checkpoint (checkpoints/iter_N) or a transformer folder"
        )
    return name or (folder.parent.name if folder.name == "final" else folder.name), folder


def load_weights(model, folder: Path) -> None:
    """Put the weights of `folder` (weights_folder's) into model.transformer: a LoRA adapter as diffusers' loader
    reads it, a checkpoint's trained tensors (LoRA: with its adapter_config.json; full fine-tuning: every weight), or a
    full transformer's state dict (into the loaded module, which keeps the model's processors)."""
    if (folder / "model.safetensors").is_file():
        from peft import LoraConfig
        from safetensors.torch import load_file

        state = {k.removeprefix("module."): v for k, v in load_file(folder / "model.safetensors").items()}  # DDP's
        lora = any(".lora_" in k for k in state)
        need(
            not lora or (folder / "adapter_config.json").is_file(),
            f"--weights {folder}: a LoRA checkpoint without adapter_config.json (written since 2026-12); give final/",
        )
        if lora:
            model.transformer.add_adapter(LoraConfig(**json.loads((folder / "adapter_config.json").read_text())))
        own = model.transformer.state_dict()
        need(
            set(state) <= set(own) and (not lora or {k for k in own if ".lora_" in k} <= set(state)),
            f"--weights {folder}: the checkpoint's tensors are not {model.kind}'s transformer's (another --model-id?)",
        )
        model.transformer.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=False)
        return
    if (folder / "pytorch_lora_weights.safetensors").is_file():
        model.transformer.load_lora_adapter(str(folder), prefix="transformer", use_safetensors=True)
        return
    source = folder / "transformer" if (folder / "transformer").is_dir() else folder
    full = type(model.transformer).from_pretrained(source, torch_dtype=model.transformer.dtype)
    model.transformer.load_state_dict(full.state_dict())


# ---------------------------------------------------------------------------------------------------
# Scoring: batches sharded over processes, each cached
# ---------------------------------------------------------------------------------------------------
def score_model(args, model, reward_fn, prompts, accelerator, cache: Path, grid: list[int], keep_images: bool) -> list:
    """Per batch of this process (batch b of [b B, (b + 1) B), process b mod world): {start, scores: name -> (n,),
    images of the grid's samples, all images on ShapesBench}. A batch found in `cache` is not computed again."""
    n, B = len(prompts), args.batch_size
    noise = fixed_noise(args.seed, "eval", model.latent_shape(), 0, n)  # sample j's noise, as the Evaluator's
    sampler = ode_sampler(
        model, model.transformer, sigma_schedule(args.num_steps, args.shift), args.guidance_scale, accelerator.autocast
    )
    mine = list(range(0, n, B))[accelerator.process_index :: accelerator.num_processes]
    out = []
    for start in tqdm(mine, desc=cache.name, disable=not accelerator.is_local_main_process):
        path = cache / f"{start:06d}.pt"
        if path.is_file():
            out.append(torch.load(path, weights_only=True))
            continue
        sl = slice(start, min(start + B, n))
        with torch.no_grad():
            images = sample_prompts(sampler, model, prompts[sl], noise[sl], B).float()
            total, parts = reward_fn(images, prompts[sl])
        record = {
            "start": start,
            "scores": {"total": total.cpu(), **{k: v.float().cpu() for k, v in parts.items()}},
            "grid": images[[j - start for j in range(sl.start, sl.stop) if j in grid]].cpu(),
            "images": images.cpu() if keep_images else torch.zeros(0),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(record, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)  # a killed evaluation leaves no partial batch
        out.append(record)
    return out


def paired(diff: torch.Tensor) -> tuple[float, float]:
    """Mean and standard error of per-prompt differences (P,)."""
    se = diff.std().item() / math.sqrt(len(diff)) if len(diff) > 1 else float("nan")
    return diff.mean().item(), se


def main(args: EvalArgs) -> None:
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    from common.models import check_model_id, load_model
    from common.rewards import SHAPESBENCH_REWARDS, build_reward, check_reward_weights, parse_reward_spec

    # ---------------------------------------------------------------- inputs, checked before anything loads
    need(
        min(args.samples_per_prompt, args.num_steps, args.batch_size) >= 1,
        "--samples-per-prompt, --num-steps, --batch-size >= 1",
    )
    kind = check_model_id(args.model_id)
    need(kind != "sd1", f"--model-id {args.model_id}: SD1.x (DDIM) is not evaluated here; flow models only")
    shapes_only = [n for n, _ in parse_reward_spec(args.reward) if n in SHAPESBENCH_REWARDS]
    shapes_only += ["--prompts " + args.prompts] if args.prompts.startswith("shapes-") else []
    need(
        kind == "shapes" or not shapes_only,
        f"--model-id {args.model_id}: {', '.join(shapes_only)} belong to ShapesBench; give --reward (e.g. "
        "hpsv2.1,pickscore,imagereward) and --prompts (hpdv2 or a file)",
    )
    prompt_list, styles = load_prompt_set(args.prompts, args.max_prompts)
    models = [("base", None)] + [weights_folder(w) for w in args.weights]
    need(len({m for m, _ in models}) == len(models), "--weights: two rows with one name; give NAME=PATH")
    check_reward_weights(args.reward, args.reward_checkpoints(), video=kind == "wan")
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    device, out = accelerator.device, Path(args.out)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
        args.mixed_precision, torch.float32
    )  # as training's base
    S = args.samples_per_prompt
    prompts = [p for p in prompt_list for _ in range(S)]  # sample j: prompt j // S, noise keyed on j
    grid = [i * S for i in evenly_spaced(list(range(len(prompt_list))), args.grid_prompts)]  # their first samples
    reward_fn = build_reward(args.reward, device, args.reward_checkpoints())
    setting = dict(model_id=args.model_id, prompts=args.prompts, n_prompts=len(prompt_list), samples_per_prompt=S,
                   num_steps=args.num_steps, shift=args.shift, guidance_scale=args.guidance_scale,
                   resolution=args.resolution, num_frames=args.num_frames, mixed_precision=args.mixed_precision,
                   seed=args.seed, batch_size=args.batch_size, reward=args.reward,
                   reward_checkpoints=args.reward_checkpoints(), grid_prompts=args.grid_prompts)  # fmt: skip
    # the cache holds the batches of one setting, each model's under its row name: a name may not change its weights
    sources = {name: str(folder) for name, folder in models}
    saved = out / "cache" / "settings.json"
    cached = json.loads(saved.read_text()) if saved.is_file() else {"settings": setting, "weights": sources}
    moved = [m for m, src in sources.items() if cached["weights"].get(m, src) != src]
    need(
        cached["settings"] == setting and not moved,
        f"--out {out}: its cache holds another evaluation's batches"
        + (f" (another {', '.join(moved)})" if moved else "")
        + "; give another --out",
    )
    accelerator.wait_for_everyone()  # every process has read it before the main one writes it
    if accelerator.is_main_process:
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps({"settings": setting, "weights": cached["weights"] | sources}, indent=1))

    # ---------------------------------------------------------------- each model in turn, sharded over processes
    records = {}
    for name, folder in models:
        model = load_model(args.model_id, device, dtype, args.resolution, args.num_frames)
        if folder is not None:
            load_weights(model, folder)
        model.transformer.eval()
        mine = score_model(args, model, reward_fn, prompts, accelerator, out / "cache" / name, grid,
                           model.kind == "shapes")  # fmt: skip
        records[name] = sorted(gather_object(mine), key=lambda r: r["start"])  # every process's batches
        del model
    if accelerator.is_main_process:
        report(args, setting, records, prompt_list, styles, prompts, grid, out)
    accelerator.wait_for_everyone()


def report(args, setting, records, prompt_list, styles, prompts, grid, out: Path) -> None:
    """results.md, results.json, scores.jsonl and grid.png from every model's batch records."""
    S, names = args.samples_per_prompt, list(records)
    scores = {m: {k: torch.cat([r["scores"][k] for r in rs]) for k in rs[0]["scores"]} for m, rs in records.items()}
    rewards = [k for k in scores["base"] if not k.endswith("_unparsed")]
    rewards = rewards[1:] if len(rewards) == 2 else rewards  # one reward: its total is itself
    per_prompt = {m: {k: v.view(-1, S).mean(1) for k, v in s.items()} for m, s in scores.items()}  # (P,) each
    # the training scripts' evaluation names, without eval/: reward (the weighted total), reward_<name>, ...
    figures = {
        m: {("reward" if k == "total" else f"reward_{k}"): v.mean().item() for k, v in s.items()}
        for m, s in scores.items()
    }
    if records["base"][0]["images"].numel():  # ShapesBench: the verifier's accuracies and diversity, as at training
        from common import shapesbench

        shapes_reward = shapesbench.load_reward_model(args.reward_checkpoints().get("shapes"))
        for m, rs in records.items():
            images = torch.cat([r["images"] for r in rs])
            figures[m].update(shapesbench.evaluate(images, prompts, shapes_reward))
    deltas = {}
    for m in names[1:]:
        deltas[m] = {k: paired(per_prompt[m][k] - per_prompt["base"][k]) for k in rewards}
        for style in sorted(set(styles) - {""}):
            rows = torch.tensor([s == style for s in styles])
            deltas[m].update(
                {f"{k}/{style}": paired((per_prompt[m][k] - per_prompt["base"][k])[rows]) for k in rewards}
            )
    (out / "results.json").write_text(json.dumps({"settings": setting, "models": {m: str(f) for m, f in zip(names, [None, *args.weights])},
                                                   "figures": figures, "deltas": deltas}, indent=1))  # fmt: skip
    with open(out / "scores.jsonl", "w") as f:
        for i, p in enumerate(prompt_list):
            row = {"prompt": p, "style": styles[i]}
            row |= {m: {k: round(v[i].item(), 6) for k, v in per_prompt[m].items()} for m in names}
            f.write(json.dumps(row) + "\n")
    lines = [f"{len(prompt_list)} prompts x {S} samples, {args.num_steps}-step Euler ODE (shift {args.shift}), "
             f"guidance {args.guidance_scale}, seed {args.seed}; mean per model, trained - base +- paired standard "
             "error over prompts", "", "| model | " + " | ".join(rewards) + " |", "|---" * (len(rewards) + 1) + "|"]  # fmt: skip
    for m in names:
        cells = [f"{figures[m]['reward' if k == 'total' else f'reward_{k}']:.4f}" + ("" if m == "base" else f" ({deltas[m][k][0]:+.4f} +- {deltas[m][k][1]:.4f})")
                 for k in rewards]  # fmt: skip
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    shapes_keys = [
        k for k in ("shape_acc", "all_acc", "clean_acc", "diversity", "diversity_kept") if k in figures["base"]
    ]
    if shapes_keys:
        lines += ["", "| model | " + " | ".join(shapes_keys) + " |", "|---" * (len(shapes_keys) + 1) + "|"]
        lines += [f"| {m} | " + " | ".join(f"{figures[m][k]:.3f}" for k in shapes_keys) + " |" for m in names]
    styled = sorted(set(styles) - {""})
    if styled and len(names) > 1:
        lines += ["", "per style, trained - base +- paired standard error:", "",
                  "| model | reward | " + " | ".join(styled) + " |", "|---" * (len(styled) + 2) + "|"]  # fmt: skip
        lines += [f"| {m} | {k} | " + " | ".join(f"{deltas[m][f'{k}/{s}'][0]:+.4f} +- {deltas[m][f'{k}/{s}'][1]:.4f}" for s in styled) + " |"
                  for m in names[1:] for k in rewards]  # fmt: skip
    (out / "results.md").write_text("\n".join(lines) + "\n")
    from common.viz import save_grid

    images = torch.cat([torch.cat([r["grid"] for r in records[m]]) for m in names])  # a row per model
    images = images[:, images.shape[1] // 2] if images.ndim == 5 else images  # videos: the middle frame
    captions = [f"{m}\n{prompts[j]}" for m in names for j in grid]
    title = "first sample of evenly spaced prompts, the same noise in a column; a row per model"
    ok = None
    if records["base"][0]["images"].numel():  # ShapesBench: the verifier's verdict under each image
        from common import shapesbench

        ok = shapesbench.verify(images, [prompts[j] for _ in names for j in grid])["all"].tolist()
        title += "; badge: the verifier's verdict"
    save_grid(out / "grid.png", images, captions, ok, ncol=len(grid), title=title)
    print("\n".join(lines))
    print(f"written: {out / 'results.md'}, results.json, scores.jsonl, grid.png")


if __name__ == "__main__":
    from common.flags import cli

    cli(main, EvalArgs)
