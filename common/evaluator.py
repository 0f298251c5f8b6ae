"""Held-out evaluation during training (--eval-every) and the fixed-seed sample grid (--sample-every).

`Evaluator(args, model, module, reward_fn, eval_prompts, run, batch_size)` is called with the iteration after each
checkpoint; it samples the held-out prompts with fixed noise through a deterministic sampler, scores them with the
training reward (and on ShapesBench the verifier, the learned reward and diversity) and logs them through run.logs.
`python -m common.evaluate` scores trained weights afterwards on the same noise and sampler.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from tqdm import tqdm

from common import shapesbench
from common.edits import EditPrompt
from common.prompts import evenly_spaced
from common.rewards import source_pixels
from common.sampling import fixed_noise, ode_sampler, sample_prompts, schedule
from common.shapesbench.edit import edit_learned_reward, edit_metrics, source_images


@contextmanager
def eval_mode(module):
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


class Evaluator:
    """Held-out evaluation (--eval-every) and the fixed-seed sample grid (--sample-every).

    `sampler(cond, noise) -> images (B, 3, H, W)` (videos (B, F, 3, H, W)) is the script's deterministic sampler. Every process computes the
    same images with the prepared module (FSDP needs all ranks in each forward; under DDP the others would only
    wait); the main process logs them. On ShapesBench the verifier's accuracies, the learned reward and diversity
    are added to the reward (common.shapesbench.evaluate).
    """

    def __init__(self, args, model, module, reward_fn, eval_prompts, run, batch_size: int, sampler=None):
        """`sampler`: None for the Euler ODE of a flow model on the --shift grid of --eval-steps steps."""
        if sampler is None:
            sigmas = schedule(model, args.eval_steps, args.shift)
            sampler = ode_sampler(model, module, sigmas, args.guidance_scale, run.accelerator.autocast)
        self.args, self.model, self.module, self.sampler, self.reward_fn, self.run = (
            args,
            model,
            module,
            sampler,
            reward_fn,
            run,
        )
        self.batch_size = batch_size
        held_out, eval_prompts = eval_prompts, evenly_spaced(eval_prompts, args.eval_max_prompts)
        subset = f" of {len(held_out)}, evenly spaced" if len(eval_prompts) < len(held_out) else ""
        run.eval_line = (
            f"evaluation every {args.eval_every} iterations: {len(eval_prompts)}{subset} prompts of "
            f"{args.eval_prompts} x {args.eval_samples_per_prompt} samples, {args.eval_steps}-step ODE"
            if args.eval_every
            else run.eval_line
        )
        self.prompts = [p for p in eval_prompts for _ in range(args.eval_samples_per_prompt)]
        # 8 held-out prompts spread over the list (on ShapesBench all three shapes) x 2 seeds
        self.grid_prompts = [p for p in eval_prompts[:: max(1, len(eval_prompts) // 8)][:8] for _ in range(2)]
        self.shapes_reward = None
        if model.kind in ("shapes", "shapes-edit"):
            self.shapes_reward = shapesbench.load_reward_model(
                reward_fn.spec.path("shapes") if reward_fn.spec else None, device=run.accelerator.device
            )

    def _sample(self, prompts: list[str], tag: str, desc: str) -> torch.Tensor:
        """ODE samples (N, 3, H, W) of `prompts` from noise keyed on (seed, tag, index), a batch at a time."""
        noise = fixed_noise(self.args.seed, tag, self.model.latent_shape(), 0, len(prompts))
        bar = partial(tqdm, desc=desc, leave=False, disable=not self.run.accelerator.is_local_main_process)
        return sample_prompts(self.sampler, self.model, prompts, noise, self.batch_size, bar)

    @torch.no_grad()
    def evaluate(self, step: int) -> dict:
        """ODE samples of the held-out prompts with fixed seeds -> metrics (also logged)."""
        images = self._sample(self.prompts, "eval", f"eval @ {step}")
        total, parts = self.reward_fn(images, self.prompts)
        metrics = {
            "eval/reward": total.mean().item(),
            **{f"eval/reward_{k}": v.mean().item() for k, v in parts.items()},
        }
        if self.model.kind == "shapes":
            metrics.update(
                {
                    f"eval/{k}": v
                    for k, v in shapesbench.evaluate(images.cpu(), self.prompts, self.shapes_reward).items()
                }
            )
        elif self.model.kind == "shapes-edit":  # the edit verifier's accuracies and the learned reward of the targets
            sources, texts = source_images(self.prompts), [p.text for p in self.prompts]
            found = edit_metrics(images.cpu(), sources, texts)
            metrics.update({f"eval/{k}": v for k, v in found.items() if isinstance(v, float)})
            learned = edit_learned_reward(self.shapes_reward, images, sources.to(images.device), texts)
            metrics["eval/reward_mean"] = learned.mean().item()
        self.run.logs.log(metrics, step, echo=True)
        return metrics

    @torch.no_grad()
    def grid(self, step: int) -> None:
        prompts = self.grid_prompts
        images = self._sample(prompts, "grid", f"grid @ {step}")
        r, _ = self.reward_fn(images, prompts)
        ok, title = None, f"{self.run.title}, iteration {step}"
        if self.model.kind == "shapes":
            ok = shapesbench.verify(images, prompts)["all"].tolist()
            title += ": badge = verifier verdict (right colours, shape, clean background)"
        elif self.model.kind == "shapes-edit":
            ok = edit_metrics(images.cpu(), source_images(prompts), [p.text for p in prompts])["edit"].tolist()
            title += ": badge = the edit verifier's verdict (the change asked, the rest kept)"
        captions = [f"{p}\nreward {x:.3f}" for p, x in zip(prompts, r.tolist())]
        if isinstance(prompts[0], EditPrompt) and images.ndim == 4:  # an edit beside its source, source first
            sources = source_pixels(prompts, *images.shape[-2:], images.device).to(images.dtype)
            images = torch.stack([sources, images], 1).flatten(0, 1)  # (2N, 3, H, W): source, edit, source, ...
            captions = [c for p, e in zip(prompts, captions) for c in ("source", e)]
            ok = None if ok is None else [b for v in ok for b in (v, v)]  # the edit's verdict under both
            title += ": each edit right of its source"
        self.run.logs.grid(images, captions, ok, step, title)

    def __call__(self, step: int, final: bool = False) -> None:
        """Evaluate and/or draw the grid if step is due (every N iterations, at the start and at the end), unless
        the interrupted run that this one resumes at `step` had done it already."""
        due = lambda every, key: every > 0 and (step % every == 0 or final) and not self.run.logs.on_record(step, key)  # noqa: E731
        with eval_mode(self.module):
            if due(self.args.sample_every, "samples"):
                self.grid(step)
            if due(self.args.eval_every, "eval/reward"):
                self.evaluate(step)
        self.model.park()  # --offload-frozen: the VAE and the reward models leave the GPU until they are needed
        self.reward_fn.park()
        self.run.accelerator.wait_for_everyone()
