"""A cluster's preemption (SIGTERM) and Ctrl-C (SIGINT) during training: noted, not obeyed at once, so that the
iteration finishes and the run stops at its next checkpoint with a checkpoint; a second signal acts at once."""

from __future__ import annotations

import signal

import torch
from tqdm import tqdm


class StopSignals:
    """`with StopSignals(accelerator) as stop:` catches SIGTERM and SIGINT inside the block; `stop.pending()` is the
    signal to stop on (0: none), the same on every process, so that one process's SIGTERM stops them all at the same
    iteration."""

    def __init__(self, accelerator):
        self.accelerator, self.received, self._handlers = accelerator, 0, {}

    def __enter__(self):
        self._handlers = {s: signal.signal(s, self._note) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for s, handler in self._handlers.items():
            signal.signal(s, handler)

    def _note(self, signum, frame) -> None:
        self.received = signum
        signal.signal(signum, self._handlers[signum])  # the next one is not caught
        if self.accelerator.is_local_main_process:
            tqdm.write(
                f"{signal.Signals(signum).name}: the run stops after this iteration, with a checkpoint "
                "(the same signal again stops it now, losing the iteration)"
            )

    def pending(self) -> int:
        """The signal received by any process (0: none); every process must call it."""
        flag = torch.tensor([self.received], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.gather(flag)
        return int(flag.max())
