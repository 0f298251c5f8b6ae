"""Shared plumbing for the algorithm scripts: model loaders, rewards, prompts, run plumbing, ShapesBench.

Algorithm logic (samplers with log-probs, advantages, losses) deliberately lives in the scripts. The modules form
layers, each importing only from those above it in this list (tests/test_layout.py checks it):

    common (this file)          the errors the scripts print as one line; whether the Hugging Face hub is reachable
    common.offload, .viz, .remote, .signals   parking frozen parts on the CPU; sample grids; rewards over HTTP;
                                SIGTERM and Ctrl-C during training
    common.logs                 metrics.jsonl, TensorBoard, W&B and sample grids of a run; the logged reductions
    common.sampling             the sigma schedule, keyed noise, the deterministic sampler of evaluation
    common.shapesbench          the offline world: renderer, verifier, learned reward, tiny model builders
    common.models, .rewards, .prompts   model loaders, reward wrappers, prompt sources
    common.flags, .checkpoints, .evaluator   the shared flags and their checks; checkpoints, resume and the final
                                weights; held-out evaluation and sample grids during training
    common.runs                 the run around the algorithm: its folder, loop, log line and checkpoints

The command-line tools sit on top: the evaluation of trained weights (`python -m common.evaluate`) and ShapesBench's
(`python -m common.shapesbench eval`, its trainers). They may use every layer, and no library module imports them. Nothing in common/ imports a top-level script.
"""

import os
import socket


class InputError(ValueError):
    """An error caused by the user's input (a flag, a file, a folder). The scripts print its message, which names
    the flag and the value, as one line and exit with status 2, without a traceback (common.flags.cli)."""


class RunError(RuntimeError):
    """A failure of the run's surroundings, not of its code: a full disk, an unwritable folder. The scripts print its
    message, which names the folder and what is still intact, as one line and exit with status 1 (common.flags.cli)."""


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub can be reached: False at once under HF_HUB_OFFLINE=1, else one TCP connect."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False
