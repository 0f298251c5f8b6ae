"""Which part of the training step breaks a denoiser's backward pass on a GPU: one forward + backward of a shortened
full-width denoiser (FLUX.1-dev's or Wan2.1-T2V-1.3B's blocks at their real sizes, fewer of them; random weights,
LoRA r128 in fp32 on a bf16 base, autocast bf16, gradient checkpointing: the scripts' training step), once per
variant, each variant in its own process (a CUDA error ends its process's context).

    python benchmarks/gpu/gpu_backward_check.py [--out DIR]     # every variant; a table and DIR/backward_check.json
    python benchmarks/gpu/gpu_backward_check.py --tiny          # the same on tiny configs, on the CPU (the harness)

Variants (each changes one thing from `flux`):
  flux             the scripts' setting: FLUX.1-dev at 512 px, 2 double + 2 single blocks, batch 1
  flux-full        all 19 + 38 blocks (FLUX.1-dev's 12B parameters)
  flux-blocking    the same with CUDA_LAUNCH_BLOCKING=1: the error is raised by the kernel that makes it
  no-ckpt          without gradient checkpointing
  ckpt-no-rng      checkpointing without saving and restoring the RNG state (preserve_rng_state=False)
  no-cudnn-sdpa    scaled_dot_product_attention without its cuDNN backend
  math-sdpa        scaled_dot_product_attention by its math path only
  no-lora          no adapter: the input latents require grad instead
  bf16-lora        the adapter in bf16 and no autocast
  no-cublaslt      linear layers without cuBLASLt's fused bias epilogue (the bias added separately)
  wan              Wan2.1-T2V-1.3B, 480 x 832 x 9 frames, 2 blocks, batch 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = ["flux", "flux-full", "flux-blocking", "no-ckpt", "ckpt-no-rng", "no-cudnn-sdpa", "math-sdpa", "no-lora", "bf16-lora",
            "no-cublaslt", "wan"]  # fmt: skip


def build(kind: str, tiny: bool, device, full: bool = False):
    """Built on `device` in bf16 (FLUX.1-dev's 12B parameters in seconds on a GPU)."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return _build(kind, tiny, full)
    finally:
        torch.set_default_dtype(torch.float32)


def _build(kind: str, tiny: bool, full: bool):
    from benchmarks.gpu import memory

    if kind == "flux":
        from diffusers import FluxTransformer2DModel

        cfg = {**memory.FLUX_DEV, **({} if full else {"num_layers": 2, "num_single_layers": 2})}
        if tiny:
            cfg.update(num_attention_heads=2, attention_head_dim=16, joint_attention_dim=32, pooled_projection_dim=16,
                       axes_dims_rope=(4, 6, 6))  # fmt: skip
        return FluxTransformer2DModel(**cfg)
    from diffusers import WanTransformer3DModel

    cfg = {**memory.WAN_T2V_1_3B, "num_layers": 2}
    if tiny:
        cfg.update(num_attention_heads=2, attention_head_dim=16, text_dim=32, ffn_dim=64, freq_dim=32)
    return WanTransformer3DModel(**cfg)


def inputs(kind: str, model, tiny: bool, device) -> dict:
    """The tensors the scripts' velocity() hands the transformer, in the dtypes it gives them."""
    bf = dict(device=device, dtype=torch.bfloat16)
    if kind == "flux":
        side, text = (8, 16) if tiny else (32, 512)  # 512 px: 32 x 32 packed tokens; T5's 512 tokens
        c = model.config
        ids = torch.stack(torch.meshgrid(torch.zeros(1), *[torch.arange(float(side))] * 2, indexing="ij"), -1)
        return dict(
            hidden_states=torch.randn(1, side * side, c.in_channels, **bf),
            timestep=torch.full((1,), 0.7, **bf),
            guidance=torch.full((1,), 3.5, device=device),
            pooled_projections=torch.randn(1, c.pooled_projection_dim, **bf),
            encoder_hidden_states=torch.randn(1, text, c.joint_attention_dim, **bf),
            txt_ids=torch.zeros(text, 3, **bf),
            img_ids=ids.reshape(-1, 3).to(**bf),
            return_dict=False,
        )
    shape = (1, 16, 3, 8, 8) if tiny else (1, 16, 3, 60, 104)  # 480 x 832 x 9 frames
    return dict(
        hidden_states=torch.randn(*shape, **bf),
        timestep=torch.full((1,), 700.0, **bf),
        encoder_hidden_states=torch.randn(1, 16 if tiny else 512, model.config.text_dim, **bf),
        return_dict=False,
    )


def one(variant: str, tiny: bool) -> dict:
    """Forward + backward once in this process; what happened."""
    from common.attention import set_attention_backend
    from common.models import add_lora

    device = torch.device("cpu" if tiny else "cuda")
    kind = "wan" if variant == "wan" else "flux"
    # torch's own order (cuDNN first: the failure under study) unless the variant takes cuDNN or all fused kernels out
    set_attention_backend({"no-cudnn-sdpa": "auto", "math-sdpa": "math"}.get(variant, "cudnn"), device)
    if variant == "no-cublaslt":
        linear = torch.nn.functional.linear
        torch.nn.functional.linear = lambda x, w, b=None: linear(x, w) + b if b is not None else linear(x, w)
    model = build(kind, tiny, device, full=variant == "flux-full")
    kw = inputs(kind, model, tiny, device)
    if variant == "no-lora":
        model.requires_grad_(False)
        kw["hidden_states"].requires_grad_(True)
    else:
        add_lora(model, 128 if not tiny else 4, 256 if not tiny else 8)
        for p in model.parameters():
            if p.requires_grad and variant != "bf16-lora":
                p.data = p.data.float()
    if variant != "no-ckpt":
        fn = None
        if variant == "ckpt-no-rng":
            from torch.utils.checkpoint import checkpoint

            fn = lambda m, *a: checkpoint(m.__call__, *a, use_reentrant=False, preserve_rng_state=False)  # noqa: E731
        model.enable_gradient_checkpointing(fn)
    model.train()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=variant != "bf16-lora"):
        out = model(**kw)[0]
    sync()
    forward_s = time.perf_counter() - start
    out.float().pow(2).mean().backward()
    sync()
    grads = [p.grad for p in model.parameters() if p.grad is not None] or [kw["hidden_states"].grad]
    return {"status": "ok", "forward_s": round(forward_s, 3), "total_s": round(time.perf_counter() - start, 3),
            "grad_norm": float(torch.stack([g.float().norm() for g in grads]).norm()),
            "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if device.type == "cuda" else None}  # fmt: skip


def child(variant: str, tiny: bool) -> None:
    try:
        r = one(variant, tiny)
    except Exception as e:  # noqa: BLE001 - what failed is the result
        tb = traceback.format_exc().strip().splitlines()
        r = {"status": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", "where": tb[-12:]}
    print("RESULT " + json.dumps(r), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default="/tmp/backward_check")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--limit-s", type=float, default=60, help="one variant's time limit")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child, a.tiny)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}  # fmt: skip
    results = {"info": info, "variants": {}}
    print(json.dumps(info), flush=True)
    for v in a.variants.split(","):
        env = {**os.environ, **({"CUDA_LAUNCH_BLOCKING": "1"} if v == "flux-blocking" else {})}
        cmd = [sys.executable, __file__, "--child", v, *(["--tiny"] if a.tiny else [])]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.limit_s)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            r = json.loads(lines[-1][7:]) if lines else {"status": f"exit {proc.returncode}",
                                                         "where": proc.stderr.strip().splitlines()[-12:]}  # fmt: skip
            (out / f"{v}.log").write_text(proc.stdout + proc.stderr)
        except subprocess.TimeoutExpired:
            r = {"status": f"timed out after {a.limit_s:.0f} s"}
        r["wall_s"] = round(time.perf_counter() - start, 1)
        results["variants"][v] = r
        print(f"{v:14s} {r['status'][:150]}  ({r['wall_s']} s){'' if r['status'] == 'ok' else ''}", flush=True)
        if r["status"] != "ok" and "where" in r:
            print("    " + "\n    ".join(r["where"][-6:]), flush=True)
        (out / "backward_check.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
