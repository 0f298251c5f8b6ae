"""Shared plumbing for the four algorithm scripts: model loaders, rewards, prompts, run plumbing, ShapesBench.

Algorithm logic (samplers with log-probs, advantages, losses) deliberately lives in the scripts.
"""


class InputError(ValueError):
    """An error caused by the user's input (a flag, a file, a folder). The scripts print its message, which names
    the flag and the value, as one line and exit with status 2, without a traceback (common.runs.cli)."""


class RunError(RuntimeError):
    """A failure of the run's surroundings, not of its code: a full disk, an unwritable folder. The scripts print its
    message, which names the folder and what is still intact, as one line and exit with status 1 (common.runs.cli)."""
