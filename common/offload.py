"""--offload-frozen: frozen parts (text encoders, VAE, reward models) live on the CPU and visit the GPU only for
their work, so the training phase has the GPU to the denoiser, its gradients, optimizer state and activations.

    parts = Offloaded([vae], device, enabled)
    parts.fetch()        # onto `device` (a no-op when already there, or when disabled)
    parts.park()         # back to the CPU, where no autograd graph through the parts is alive
    with parts.visit():  # fetch, then park after the block (for no-grad work such as prompt encoding)

The text encoders move twice per iteration and the VAE and reward models twice per iteration and evaluation: with
FLUX.1's T5-XXL that is ~9.5 GB of bf16 weights over PCIe each way (docs/gpu.md: what it saves per recipe).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class Offloaded:
    """A list of frozen modules (None entries are skipped) that come to `device` on fetch() and go to the CPU on
    park(), when `enabled`; when not, both are no-ops and the modules stay where they are."""

    def __init__(self, modules, device, enabled: bool):
        self.modules = [m for m in modules if m is not None]
        self.device, self.enabled = torch.device(device), enabled

    def _to(self, device) -> None:
        if self.enabled:
            for m in self.modules:
                m.to(device)

    def fetch(self) -> None:
        self._to(self.device)

    def park(self) -> None:
        self._to("cpu")

    @contextmanager
    def visit(self):
        self.fetch()
        try:
            yield
        finally:
            self.park()
