"""scaled_dot_product_attention alone, forward + backward, per kernel, at the shapes each model kind trains with:
which kernel fails, at which shapes, how far each is from the reference, and what each costs.

    python benchmarks/gpu/sdpa_probe.py                          # one CUDA GPU, every kind and kernel (about a minute)
    python benchmarks/gpu/sdpa_probe.py --kinds flux,qwen --json probe.json
    python benchmarks/gpu/sdpa_probe.py --tiny --device cpu      # the same harness at tiny sizes on the CPU (tests run it)

Each row is one (case, kernel): `ok`, `error` (the exception's first line), `non-finite` (a NaN or inf in the output
or a gradient), `unsupported` (torch has no such kernel for these inputs: flash with a mask, anything but flash and
math on a CPU; torch's reason is given), or `skipped` (the math kernel where its score matrix alone would exceed
MATH_MAX_GB: the video kinds). For the kernels that ran: the largest absolute difference of the output and
of the three input gradients from the reference (float32 math attention on the first row and two heads: the full
math kernel at the video kinds' lengths would need hundreds of GB), and milliseconds per forward + backward of the
whole batch (the median of --reps timed runs after one warm-up run). Inputs are bf16 in the layout diffusers hands
to torch: (batch, tokens, heads, head dim) made contiguous and permuted to (batch, heads, tokens, head dim), as
diffusers' attention dispatch does (FLUX.1 is also run contiguous, to tell a stride problem from a shape problem).

Each kernel runs in its own process: an illegal memory access leaves the CUDA context unusable, so after one the
process ends, the failing case is recorded, and a fresh process goes on with the next case. `probe()` is the
function the GPU check calls first (benchmarks/gpu/gpu_check.py).

The shapes (tokens of a training forward; batch = the recipe's micro-batch, doubled where the recipe uses CFG):
  flux        FLUX.1-dev, 720 px: (720/16)^2 = 2025 image + 512 T5 tokens, 24 heads of 128, batch 1 (guidance
              embedded)
  flux2       FLUX.2 [klein] base 4B, 384 px: (384/16)^2 = 576 image + 512 Qwen3 tokens, 24 heads, batch 4 x 2 (CFG)
  flux2_dev   FLUX.2 [dev], 1024 px: 4096 image + 512 Mistral tokens, 48 heads, batch 1 (guidance embedded)
  sd3         SD3.5-Medium, 512 px: 1024 image + 77 CLIP + 256 T5 tokens, 24 heads of 64, batch 8 x 2 (CFG);
              sd3:attn2 its second, image-only attention in blocks 0-12
  sd1         SD1.5, 512 px: 64 x 64 = 4096 tokens, 8 heads of 40 (the largest self-attention), batch 2 x 2 (CFG);
              sd1:cross the 77 CLIP tokens
  qwen        Qwen-Image, 512 px: 1024 image + 256 text tokens padded to the batch's longest with a key mask,
              24 heads of 128, batch 4 x 2 (CFG)
  zimage      Z-Image, 1024 px: 4096 image + 256 caption tokens with a key mask, 30 heads of 128, batch 1 x 2 (CFG)
  wan         Wan2.1-T2V-1.3B, 480 x 832 x 33 frames: 9 x 30 x 52 = 14040 tokens, 12 heads of 128, batch 4 x 2 (CFG);
              wan:cross the 512 UMT5 tokens
  wan22       Wan2.2-TI2V-5B, 704 x 1280 x 9 frames: 3 x 22 x 40 = 2640 tokens, 24 heads of 128, batch 4 x 2 (CFG)
  wan22_a14b  Wan2.2-T2V-A14B, 480 x 832 x 81 frames: 21 x 30 x 52 = 32760 tokens, 40 heads of 128, batch 1 x 2
  ltx2        LTX-2.3, 320 x 320 x 81 frames: 11 x 10 x 10 = 1100 video tokens, 32 heads of 128, batch 2 x 2 (CFG);
              ltx2:audio its 84 audio tokens, 32 heads of 64; ltx2:cross video to the 1024 connector tokens
  hunyuan15   HunyuanVideo-1.5, 480 x 480 x 5 frames: 2 x 30 x 30 = 1800 video tokens joined by 1000 Qwen2.5-VL, 256
              ByT5 and 729 image tokens (the valid ones first: text-to-video masks the image tokens and the text's
              padding, about 1500 keys), 16 heads of 128, batch 4 (no CFG)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    masked: int = 0  # padded key tokens at the end of every other row (a text mask), 0 = no mask
    contiguous: bool = False  # (batch, heads, tokens, dim) contiguous instead of diffusers' permuted layout


CASES = {
    "flux": Case(1, 24, 2537, 2537, 128),
    "flux:contiguous": Case(1, 24, 2537, 2537, 128, contiguous=True),
    "flux2": Case(8, 24, 1088, 1088, 128),
    "flux2_dev": Case(1, 48, 4608, 4608, 128),
    "sd3": Case(16, 24, 1357, 1357, 64),
    "sd3:attn2": Case(16, 24, 1024, 1024, 64),
    "sd1": Case(4, 8, 4096, 4096, 40),
    "sd1:cross": Case(4, 8, 4096, 77, 40),
    "qwen": Case(8, 24, 1280, 1280, 128, masked=200),
    "zimage": Case(2, 30, 4352, 4352, 128, masked=200),
    "wan": Case(8, 12, 14040, 14040, 128),
    "wan:cross": Case(8, 12, 14040, 512, 128),
    "wan22": Case(8, 24, 2640, 2640, 128),
    "wan22_a14b": Case(2, 40, 32760, 32760, 128),
    "ltx2": Case(4, 32, 1100, 1100, 128),
    "ltx2:audio": Case(4, 32, 84, 84, 64),
    "ltx2:cross": Case(4, 32, 1100, 1024, 128),
    "hunyuan15": Case(4, 16, 3785, 3785, 128, masked=1500),
}
KINDS = tuple(dict.fromkeys(name.split(":")[0] for name in CASES))  # the model kinds, each with its cases
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
MATH_MAX_GB = 4.0  # the math kernel is timed only where its (B, H, Lq, Lk) score matrix is at most this in bf16
# a CUDA error after which the context cannot be used again: the process must end
STICKY = ("illegal memory access", "device-side assert", "CUDA error", "unspecified launch failure")


def tiny(case: Case) -> Case:
    """The CPU rehearsal's size: the same kernels' arguments (head dim, mask, layout) at a few dozen tokens."""
    return Case(
        min(case.batch, 2), 2, max(8, case.q_len // 128), max(8, case.kv_len // 128), case.head_dim,
        masked=3 if case.masked else 0, contiguous=case.contiguous,
    )  # fmt: skip


def inputs(case: Case, device: str, seed: int = 0):
    """q, k, v (bf16 on a GPU, float32 on a CPU, which has no bf16 flash backward), the boolean key mask or None
    (batch, 1, 1, kv_len: True = attend; every other row has its last `masked` keys padded), the output gradient."""
    g = torch.Generator(device).manual_seed(seed)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    B, H, D = case.batch, case.heads, case.head_dim

    def tensor(length):
        if case.contiguous:
            x = torch.randn(B, H, length, D, generator=g, device=device, dtype=dtype)
        else:  # (B, L, H, D) as the attention processors build it, permuted as diffusers' dispatch hands it over
            x = torch.randn(B, length, H, D, generator=g, device=device, dtype=dtype).permute(0, 2, 1, 3)
        return x.requires_grad_()

    q, k, v = tensor(case.q_len), tensor(case.kv_len), tensor(case.kv_len)
    mask = None
    if case.masked:
        mask = torch.ones(B, 1, 1, case.kv_len, dtype=torch.bool, device=device)
        mask[1::2, ..., case.kv_len - case.masked :] = False
    grad = torch.randn(B, H, case.q_len, D, generator=g, device=device, dtype=dtype)
    return q, k, v, mask, grad


def attention(q, k, v, mask, grad):
    """Output and (dq, dk, dv) of one forward + backward."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def reference(q, k, v, mask, grad):
    """Float32 math attention on row 0 and the first and last heads (each (row, head) is independent of the rest)."""
    heads = [0, q.shape[1] - 1]
    pick = [x[:1, heads].detach().float().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        return attention(*pick, None if mask is None else mask[:1], grad[:1, heads].float()), heads


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_case(name: str, backend: str, device: str, small: bool, reps: int) -> dict:
    """One (case, kernel): status, error, difference from the reference, milliseconds per forward + backward."""
    case = tiny_case(name, small)
    row = {"case": name, "kind": name.split(":")[0], "backend": backend, "shape": asdict(case), "status": "ok",
           "error": "", "max_diff_out": None, "max_diff_grad": None, "ms": None}  # fmt: skip
    scores_gb = case.batch * case.heads * case.q_len * case.kv_len * 2 / 1e9  # bf16 (B, H, Lq, Lk)
    if backend == "math" and scores_gb > MATH_MAX_GB:  # it would hold the matrix, its softmax and their gradients
        return {**row, "status": "skipped", "error": f"the math kernel's score matrix alone is {scores_gb:.0f} GB"}
    q, k, v, mask, grad = inputs(case, device)
    (ref, heads) = reference(q, k, v, mask, grad)
    try:
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel(BACKENDS[backend]):
            warnings.simplefilter("always")
            got = attention(q, k, v, mask, grad)  # the warm-up run, also the one compared
            synchronize(device)
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                attention(q, k, v, mask, grad)
                synchronize(device)
                times.append((time.perf_counter() - start) * 1e3)
    except RuntimeError as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "No available kernel" in text or "No viable backend" in text:  # torch's reasons come as warnings
            reasons = [str(w.message).splitlines()[0] for w in caught if "kernel" in str(w.message).lower()]
            return {
                **row,
                "status": "unsupported",
                "error": "; ".join(reasons[:2])[:300] or "no kernel for these inputs",
            }
        return {**row, "status": "error", "error": text[:300]}
    picked = [x[:1, heads].float() for x in got]
    if not all(torch.isfinite(x).all() for x in got):
        row["status"] = "non-finite"
    row["max_diff_out"] = (picked[0] - ref[0]).abs().max().item()
    row["max_diff_grad"] = max((a - b).abs().max().item() for a, b in zip(picked[1:], ref[1:]))
    row["ms"] = round(sorted(times)[len(times) // 2], 3)
    return row


def child(backend: str, names: list[str], device: str, small: bool, reps: int, fault: str | None = None) -> None:
    """Each case with one kernel, a ROW line per case; ends at the first CUDA error that poisons the context.
    fault 'CASE:BACKEND:poison' or ':crash' rehearses, on any device, what that case would do on a failing GPU: the
    error an illegal memory access raises, or the process killed inside the case."""
    for name in names:
        if fault and fault.rsplit(":", 1)[0] == f"{name}:{backend}":
            if fault.endswith(":crash"):
                os.abort()
            row = {"case": name, "kind": name.split(":")[0], "backend": backend, "shape": asdict(tiny_case(name, small)),
                   "status": "error", "error": "CUDA error: an illegal memory access was encountered (rehearsed)",
                   "max_diff_out": None, "max_diff_grad": None, "ms": None}  # fmt: skip
        else:
            row = run_case(name, backend, device, small, reps)
        print("ROW " + json.dumps(row), flush=True)
        if row["status"] == "error" and any(s in row["error"] for s in STICKY):
            sys.exit(3)  # the parent goes on with the next case in a fresh process
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


def probe(
    device: str = "cuda",
    kinds: list[str] | None = None,
    tiny: bool = False,
    say=print,
    backends: list[str] | None = None,
    reps: int = 3,
    limit_s: float = 120,
    fault: str | None = None,
) -> list[dict]:
    """Every case of `kinds` (default KINDS) with every kernel of `backends` (default all four), one process per
    kernel (a fresh one after a process ends early); `say` gets each row's line as it finishes. limit_s bounds each
    process; `fault` rehearses a failing case (child())."""
    names = [n for n in CASES if n.split(":")[0] in (kinds or KINDS)]
    rows = []
    for backend in backends or list(BACKENDS):
        left = list(names)
        while left:
            cmd = [sys.executable, __file__, "--child", backend, "--device", device, "--reps", str(reps),
                   "--cases", ",".join(left), *(["--tiny"] if tiny else []), *(["--fault", fault] if fault else [])]  # fmt: skip
            try:
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit_s)
                out, tail = proc.stdout, f"exit {proc.returncode}: " + " | ".join(proc.stderr.strip().splitlines()[-3:])
            except subprocess.TimeoutExpired as e:
                out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                tail = f"timed out after {limit_s:.0f} s"
            done = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
            for row in done:
                rows.append(row)
                say(line(row))
            left = left[len(done) :]
            if left and (not done or done[-1]["status"] != "error"):  # the process died inside a case: record it
                case = tiny_case(left[0], tiny)
                row = {"case": left[0], "kind": left[0].split(":")[0], "backend": backend, "shape": asdict(case),
                       "status": "error", "error": f"process ended in this case ({tail[:300]})",
                       "max_diff_out": None, "max_diff_grad": None, "ms": None}  # fmt: skip
                rows.append(row)
                say(line(row))
                left = left[1:]
    return rows


def tiny_case(name: str, small: bool) -> Case:
    return tiny(CASES[name]) if small else CASES[name]


def line(row: dict) -> str:
    s = row["shape"]
    shape = f"{s['batch']}x{s['heads']}x{s['q_len']}x{s['kv_len']}x{s['head_dim']}" + (" mask" if s["masked"] else "")
    head = f"{row['case']:16s} {row['backend']:9s} {shape:28s} {row['status']:11s}"
    if row["ms"] is None:
        return f"{head} {row['error'][:160]}"
    return f"{head} {row['ms']:9.2f} ms  out {row['max_diff_out']:.1e}  grad {row['max_diff_grad']:.1e}"


def table(rows: list[dict]) -> str:
    """Markdown: a row per case, a column per kernel (ms per forward + backward, or what went wrong)."""
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    cell = {(r["case"], r["backend"]): r for r in rows}
    out = [
        "| case | shape (B x H x Lq x Lk x D) | " + " | ".join(backends) + " |",
        "|---|---|" + "---|" * len(backends),
    ]
    for name in dict.fromkeys(r["case"] for r in rows):
        s = next(r["shape"] for r in rows if r["case"] == name)
        cells = []
        for b in backends:
            r = cell.get((name, b))
            if r is None:
                cells.append("")
            elif r["status"] == "ok":
                cells.append(f"{r['ms']:.1f} ms (out {r['max_diff_out']:.0e}, grad {r['max_diff_grad']:.0e})")
            else:
                cells.append(f"**{r['status']}**" + (f": {r['error'][:60]}" if r["status"] == "error" else ""))
        shape = f"{s['batch']}x{s['heads']}x{s['q_len']}x{s['kv_len']}x{s['head_dim']}" + (
            " mask" if s["masked"] else ""
        )
        out.append(f"| {name} | {shape} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def environment(device: str) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device}
    if torch.device(device).type == "cuda":
        info |= {"gpu": torch.cuda.get_device_name(), "cudnn": torch.backends.cudnn.version()}
    return info


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, of {', '.join(BACKENDS)}")
    p.add_argument("--tiny", action="store_true", help="a few dozen tokens per case: the harness, on any device")
    p.add_argument("--reps", type=int, default=3, help="timed forward + backward runs after the warm-up")
    p.add_argument("--limit-s", type=float, default=120, help="time limit of each kernel's process")
    p.add_argument("--json", help="write the environment and every row here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--cases", help=argparse.SUPPRESS)
    p.add_argument("--fault", help=argparse.SUPPRESS)  # CASE:BACKEND:poison|crash, for the tests (child())
    a = p.parse_args(argv)
    if a.child:
        return child(a.child, a.cases.split(","), a.device, a.tiny, a.reps, a.fault)
    kinds, backends = a.kinds.split(","), a.backends.split(",")
    for flag, values, known in (("--kinds", kinds, KINDS), ("--backends", backends, BACKENDS)):
        if bad := [x for x in values if x not in known]:
            p.error(f"{flag} {','.join(bad)}: not one of {', '.join(known)}")
    if torch.device(a.device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (--device cpu --tiny runs the harness)")
    info = environment(a.device)
    print(json.dumps(info), flush=True)
    rows = probe(a.device, kinds, a.tiny, backends=backends, reps=a.reps, limit_s=a.limit_s, fault=a.fault)
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
