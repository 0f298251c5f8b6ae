"""Which kernels compute `scaled_dot_product_attention`: one choice per process, made here and nowhere else.

Every entry point that can put a model on a GPU calls `set_attention_backend` once at start-up, with its
`--attention-backend` flag: the six training scripts (through `common.runs.Run`), `python -m common.evaluate`,
`python -m common.rewards serve` and the benchmarks that take `--device cuda`. diffusers' attention processors call
torch's `scaled_dot_product_attention`, which picks, per call, the first kernel in torch's order (cuDNN, flash,
memory-efficient, math on a Hopper GPU with torch 2.11) that is enabled and supports the inputs; the choice here
decides which of them are enabled, for the whole process.

    auto        flash, memory-efficient and math (torch's order without cuDNN); the default
    flash       FlashAttention-2 only (no float32, no arbitrary mask: a model that needs another kernel fails)
    efficient   memory-efficient attention only (CUDA only)
    math        the reference implementation in plain matmuls (slow, large memory; every device)
    cudnn       cuDNN's fused attention first, then flash, memory-efficient and math (torch's own default)

Why cuDNN is off by default: the one run of this code on a GPU (torch 2.11, cuDNN 9.19, an H200) failed at the first
backward of every FLUX.1-dev script with an illegal memory access inside cuDNN's attention backward
(docs/gpu.md, "First run on an H200"); `benchmarks/gpu/sdpa_probe.py` runs each backend alone at each model kind's
training shapes and is the measurement that decides the default (docs/gpu.md, "Attention backends").

The choice also changes results in the last bits: two kernels sum in another order, so a run and an evaluation that
are to agree exactly must use the same backend (common/evaluate.py takes the same flag with the same default).
"""

from __future__ import annotations

import torch

from common import InputError

ATTENTION_BACKENDS = ("auto", "flash", "efficient", "math", "cudnn")
# the torch switches each choice turns on (the others are turned off)
ENABLED = {
    "auto": ("flash", "mem_efficient", "math"),
    "flash": ("flash",),
    "efficient": ("mem_efficient",),
    "math": ("math",),
    "cudnn": ("cudnn", "flash", "mem_efficient", "math"),
}
SWITCHES = ("flash", "mem_efficient", "math", "cudnn")


def enabled_backends() -> list[str]:
    """The torch attention kernels enabled now in this process, in torch's names."""
    return [s for s in SWITCHES if getattr(torch.backends.cuda, f"{s}_sdp_enabled")()]


def set_attention_backend(name: str, device: str | torch.device = "cpu", flag: str = "--attention-backend") -> str:
    """Enable exactly the kernels of `name` (ATTENTION_BACKENDS) for the whole process, then run one small attention
    forward and backward on `device` so that a choice the device cannot run stops here, naming `flag`, and not at the
    first step of a run. Returns the line the run's banner and settings log ("attention: auto (flash, mem_efficient,
    math)")."""
    if name not in ATTENTION_BACKENDS:
        raise InputError(f"{flag} {name}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    for switch in SWITCHES:
        getattr(torch.backends.cuda, f"enable_{switch}_sdp")(switch in ENABLED[name])
    device = torch.device(device)
    # (batch 1, 2 heads, 8 tokens, head dim 64), bf16 on a GPU as the recipes train (flash has no fp32 kernel)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(1, 2, 8, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    try:
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise InputError(
            f"{flag} {name} cannot run attention on {device.type} ({first}); "
            f"choose another of {', '.join(ATTENTION_BACKENDS)} (auto works on every device)"
        ) from None
    return f"attention: {name} ({', '.join(ENABLED[name])})"
