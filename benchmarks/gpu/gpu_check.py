"""The prepared GPU check: every model kind's training step on one lent GPU, in two calls, with random weights built
on the GPU from the published configs (benchmarks/gpu/memory.py's; nothing is downloaded or written to disk).

    call 1  (4 minutes at most) the environment, benchmarks/gpu/sdpa_probe.py (every attention kernel at every kind's
            training shapes), then one iteration of each model kind's script: FLUX.1-dev, FLUX.2 [klein] base 4B and
            [dev], SD3.5-Medium, SD1.5 (rlr.py), Qwen-Image, Z-Image, Wan2.1-T2V-1.3B, Wan2.2-TI2V-5B, Wan2.2-T2V-A14B
            (both experts); the large ones (FLUX.1-dev, FLUX.2 [dev], Qwen-Image, A14B) at their real width with 2
            blocks of each type (text encoders: 2 layers, or as many as the pipeline reads hidden states from), so
            every kernel, dtype and shape of the real model runs forward and backward; the others at full size
    call 2  (6 minutes at most) one iteration of dancegrpo.py, branchgrpo.py, vgrpo.py, rlr.py and diffusionnft.py on full-depth FLUX.1-dev at a recipe's
            settings: 720 px, bf16, LoRA r128, gradient checkpointing, --offload-frozen; then the video kinds call 1
            has no time left for, LTX-2.3 and HunyuanVideo-1.5, at their real width with 2 blocks of each type

    bash benchmarks/gpu/gpu_check.sh --prepare          # wheels for an offline GPU node in .whl/, the plan, the commands
    bash benchmarks/gpu/gpu_check.sh --call 1           # one H100 / H200-class GPU
    bash benchmarks/gpu/gpu_check.sh --call 2
    bash benchmarks/gpu/gpu_check.sh --call 1 --cases qwen-image,wan22-a14b   # a rerun of some cases
    bash benchmarks/gpu/gpu_check.sh --rehearse         # both calls end to end on the CPU at tiny widths (tests run it)

How the kit differs from a user's run: the scripts run in the kit's own process (their `main(args)` on flags parsed
by their own `Args`, one case after the other), and only two things are replaced, inside `kit_weights` and only while
a case runs: the script's `load_model` builds the pipeline with random weights directly on the GPU (`build_model`:
each part made on the meta device, then its parameters on the GPU in the dtype `from_pretrained(dtype=...)` would
give them, modules the libraries keep in float32 included, and initialised there) instead of reading --model-id's
weights, and the hpsv2.1 reward builds ViT-H-14 with random weights on the GPU instead of reading its checkpoint.
--model-id is a folder holding only a model_index.json (a few bytes), so the scripts' own checks of the flags, the
model kind and its experts run unchanged. Reading weights from disk is not measured here (a user's run reads them
once, at start-up); tokenizers are built in memory (letters or bytes as tokens: prompts are more tokens than with
the real ones, padded to the pipelines' lengths as the real ones are).

Each case is contained: its failure (an exception, an out-of-memory, a time-out: SIGALRM at the time left) is
recorded with its type, message and traceback, and the call goes on; after each case the accelerate state is reset
and the GPU memory released (gc, empty_cache), and whether the case's model was freed is recorded. The results are
written from the start and after every step (gpu_check.json, gpu_check.md, gpu_check.log in --out and --results),
each case's line as it finishes; the call ends with one table: case, status, seconds of the rollout (the sampling
phase) and of the training step (the rest of the iteration), peak GPU memory (torch.cuda.max_memory_allocated, as
the scripts log it) against benchmarks/gpu/memory.py's plan for the same flags and sizes, and the TFLOP/s and MFU of the
denoiser's forwards without gradients (the rollout) and of the training step (forwards with gradients + backward),
each timed alone by benchmarks/gpu/gpu_timing.py's CUDA events: rows x the FLOPs of one row, counted by
torch.utils.flop_counter on the denoiser as the scripts train it (common.models.trainable_denoiser: LoRA adapter,
frozen bf16 base) on the meta device at the case's shapes, backward counted, not assumed; gradient checkpointing's
recomputed forwards are the hardware's work, not the model's, and are not counted.

Beside the table the timing model (`estimate_case`, `estimate_call`) gives each case's and each call's GPU time
from the FLOPs the case does at an assumed MFU of the GPU's datasheet peak, plus fixed costs (TIMING: start-up,
the probe, building weights at an assumed initialisation rate, a first iteration's kernel set-up, offload trips over
PCIe); the printed plan of both calls must fit 4 + 6 minutes by it (the tests check it). --rehearse runs both calls
end to end on the CPU at tiny widths (the same code: the builders, kit_weights, the scripts' main, the timing, the
table), so what runs on a lent GPU has run before; its seconds are the CPU's, its peak memory the process's resident
set, and its MFU none: it checks the kit, not the figures.

The plan (benchmarks/gpu/gpu_plan.json, written by --write-plan, which --prepare runs) holds, per case, memory.py's
peak and the FLOP and parameter counts at the GPU's shapes, each under a key of what it depends on: an entry made
for other configs or flags is not used (FLOPs are then counted at start-up; the memory plan is shown as missing).
The key does not cover memory.py's own modelling: after a change there, write the plan into a new file.

The kit's parts: benchmarks/gpu/gpu_build.py (the model kinds, `build_model`, `kit_weights`), benchmarks/gpu/gpu_cases.py
(the cases, the FLOP counts, the plan entries and the timing model: `estimate_case`, `estimate_call`, TIMING) and this
file (running a case, the results, the calls).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu import gpu_timing  # noqa: E402
from benchmarks.gpu.gpu_build import TINY_HPS, kit_weights, parts_of, register_tiny_hps  # noqa: E402
from benchmarks.gpu.gpu_cases import (  # noqa: E402
    CALL_LIMIT_S,
    CASES,
    Case,
    case_flags,
    describe,
    estimate_call,
    estimate_case,
    plan_case,
    plan_for,
    read_plan,
    script_flags,
    write_model_folder,
)

PLAN = ROOT / "benchmarks" / "gpu" / "gpu_plan.json"
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "B200": 2250.0}  # dense bf16 peaks (NVIDIA datasheets, SXM)
PROMPTS = [
    "a photo of an astronaut riding a horse on the moon",
    "a watercolor painting of a lighthouse at dawn",
    "an anime girl with silver hair in a rainy city",
    "concept art of a floating castle above the clouds",
]


# ---------------------------------------------------------------------------------------------------
# Running a case in this process
# ---------------------------------------------------------------------------------------------------
def release() -> None:
    """After a case: accelerate's process-wide state reset (the next case's Accelerator starts afresh), garbage
    collected, the CUDA cache emptied, so that the next case has the GPU's memory."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_case(case: Case, tiny: bool, out: Path, attention: str | None) -> dict:
    """One iteration of the case's script in this process under kit_weights and gpu_timing; its metrics (iteration,
    sampling, peak memory, rewards) from the run folder, and the clock's rows and GPU seconds."""
    from common.flags import parse_flags
    from common.logs import read_metrics

    write_model_folder(case, out)
    flags = case_flags(case, tiny, out) + ["--output-dir", str(out / "runs"), "--exp-name", f"{case.call}_{case.name}"]
    if attention:
        flags += ["--attention-backend", attention]
    module = importlib.import_module(case.script[:-3])
    args = parse_flags(module.Args, flags)
    parts, clock, built = parts_of(case.kind, "tiny" if tiny else case.scale), gpu_timing.Clock(), []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        with kit_weights(module, case.kind, parts, TINY_HPS if tiny else "ViT-H-14", built), gpu_timing.timing(clock):
            module.main(args)
        timings = clock.table()
    finally:
        del module, args, clock
        release()
    r = {"status": "ok", "wall_s": time.perf_counter() - t0, "released": all(ref() is None for ref in built)}
    if torch.cuda.is_available():  # what the case left allocated on the GPU (0: everything released)
        r["left_gb"] = torch.cuda.memory_allocated() / 1e9
    runs = sorted((out / "runs").glob(f"{case.call}_{case.name}__*"))
    metrics = [m for m in read_metrics(runs[-1]) if "perf/iteration_s" in m] if runs else []
    if not metrics:
        return r | {"status": "failed (no iteration logged)"}
    last = metrics[-1]
    r |= {
        "iteration_s": last["perf/iteration_s"], "rollout_s": last["perf/sampling_s"],
        "train_s": last["perf/iteration_s"] - last["perf/sampling_s"], "peak_gb": last["perf/peak_mem_gb"],
        "rewards": {k: v for k, v in last.items() if k.startswith("rewards/")},
    }  # fmt: skip
    if timings:
        t = timings[-1]
        r |= {k: t[k] for k in ("nograd_rows", "nograd_s", "grad_rows", "grad_s", "backward_s")}
    for run_dir in runs:
        shutil.rmtree(run_dir, ignore_errors=True)
    return r


def rows_of(r: dict, case: Case) -> dict:
    """The counts the timing model takes, from a case's result: denoiser rows, forwards, decoded samples, prompts."""
    flags = script_flags(case)
    spd = int(flags[flags.index("--samples-per-device") + 1]) if "--samples-per-device" in flags else 4
    return {"nograd_rows": r.get("nograd_rows", 0), "grad_rows": r.get("grad_rows", 0),
            "forwards": (r.get("nograd_rows", 0) + r.get("grad_rows", 0)) // 2 or 1,
            "samples": spd, "prompts": spd + 1}  # fmt: skip


def add_rates(r: dict, flops: dict | None, peak: float | None) -> None:
    """TFLOP/s and MFU (against the measured matmul peak) of the rollout's forwards and of the training step, and
    the FLOPs done."""
    if "nograd_s" not in r or not flops:
        return
    r["rollout_pflop"] = r["nograd_rows"] * flops["forward"] / 1e15
    r["train_pflop"] = r["grad_rows"] * flops["train"] / 1e15
    r["rollout_tflops"] = r["rollout_pflop"] * 1e3 / max(r["nograd_s"], 1e-9)
    r["train_tflops"] = r["train_pflop"] * 1e3 / max(r["grad_s"] + r["backward_s"], 1e-9)
    for what in ("rollout", "train"):
        r[f"{what}_mfu"] = r[f"{what}_tflops"] / peak if peak else None


def matmul_peak_tflops(n: int = 8192, reps: int = 20) -> float:
    """The GPU's measured dense bf16 peak: an n^3 matmul, `reps` times after a warm-up, timed by CUDA events."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def environment() -> dict:
    """Versions and the device: what a result depends on."""
    import accelerate
    import diffusers
    import peft
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "diffusers": diffusers.__version__, "transformers": transformers.__version__,
           "accelerate": accelerate.__version__, "peft": peft.__version__}  # fmt: skip
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        env |= {"gpu": torch.cuda.get_device_name(), "cudnn": torch.backends.cudnn.version(),
                "gpu_memory_gb": total / 1e9, "gpu_free_gb": free / 1e9,
                "capability": ".".join(map(str, torch.cuda.get_device_capability()))}  # fmt: skip
    return env


# ---------------------------------------------------------------------------------------------------
# The results: every step caught and recorded, written from the start
# ---------------------------------------------------------------------------------------------------
class Stopped(BaseException):
    """A SIGTERM (gpu_check.sh's outer limit) or SIGINT: recorded, then the call ends (not caught as a failure)."""


class OutOfTime(Exception):
    """A step still running when the call's time was up (SIGALRM)."""


def on_signal(signum, frame):
    raise Stopped(f"stopped by {signal.Signals(signum).name}")


def on_alarm(signum, frame):
    raise OutOfTime("the call's time limit (--limit-s) was reached during this step")


def first_lines(text: str, n: int = 6, width: int = 300) -> str:
    return "\n".join([line[:width] for line in str(text).strip().splitlines() if line.strip()][:n])


class Check:
    """The results (gpu_check.json, gpu_check.md, gpu_check.log: every line printed), written to --out and --results,
    each on its own (one that cannot be written does not stop the other)."""

    def __init__(self, out: Path, results_dir: Path | None, device: str, calls: list[int]):
        self.out = out
        same = results_dir is not None and results_dir.resolve() == out.resolve()
        self.dests = [out] + ([results_dir] if results_dir and not same else [])
        self.results = {"device": device, "calls": calls, "status": "running", "steps_s": {}, "failures": [],
                        "cases": {}, "estimates": {}}  # fmt: skip
        self.deadline = float("inf")
        for dest in self.dests:
            self._write(dest, "gpu_check.log", "", "w")
        self.save()

    def _write(self, dest: Path, name: str, text: str, mode: str = "w") -> None:
        try:
            dest.mkdir(parents=True, exist_ok=True)
            with open(dest / name, mode) as f:
                f.write(text)
        except OSError as e:
            print(f"warning: cannot write {dest / name}: {e}", file=sys.stderr, flush=True)

    def say(self, line: str, err: bool = False) -> None:
        print(line, file=sys.stderr if err else sys.stdout, flush=True)
        for dest in self.dests:
            self._write(dest, "gpu_check.log", line + "\n", "a")

    def save(self) -> None:
        text, md = json.dumps(self.results, indent=1, default=str), table(self.results) + "\n"
        for dest in self.dests:
            self._write(dest, "gpu_check.json", text)
            self._write(dest, "gpu_check.md", md)

    def fail(self, step: str, kind: str, message: str, tail: str = "") -> dict:
        record = {"step": step, "type": kind, "message": first_lines(message)}
        if tail:
            record["tail"] = tail
        self.results["failures"].append(record)
        self.say(f"FAILED {step}: {kind}" + (f": {record['message']}" if record["message"] else ""), err=True)
        self.save()
        return record

    def attempt(self, step: str, fn, *args, limit_s: float | None = None):
        """(fn(*args), None), or (None, the failure's record) when it raises (SystemExit too: a script's flags that do
        not parse); `limit_s`: SIGALRM ends it (OutOfTime) after that long."""
        t = time.perf_counter()
        if limit_s is not None:
            previous = signal.signal(signal.SIGALRM, on_alarm)
            signal.setitimer(signal.ITIMER_REAL, max(limit_s, 0.01))
        try:
            return fn(*args), None
        except (Exception, SystemExit) as e:  # Stopped (a signal) is neither and ends the call
            tail = "".join(traceback.format_exception(e)[-8:])[-2000:]
            return None, self.fail(step, type(e).__name__, str(e) or repr(e), tail)
        finally:
            if limit_s is not None:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            self.results["steps_s"][step] = time.perf_counter() - t
            release()

    def left_s(self) -> float:
        return self.deadline - time.perf_counter()


def fmt(x, spec=".3g", none="n/a") -> str:
    return none if x is None else format(x, spec)


def pct(x) -> str:
    return f"{x:.0%}" if x is not None else "n/a"


def table(results: dict) -> str:
    """Markdown: one row per case (status, seconds, peak memory against the plan, rates and MFU, FLOPs done, the
    timing model's estimate), each call's estimate and measured time, and what failed."""
    measured, datasheet = results.get("peak_tflops_measured"), results.get("peak_tflops_datasheet")
    rows = [
        "| call | case | setting | status | rollout s | training s | peak GB | plan GB | rollout TFLOP/s, MFU | "
        "training TFLOP/s, MFU | PFLOP done (rollout, training) | estimate on the GPU, s | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.get("cases", {}).values():
        rates = [f"{r[f'{w}_tflops']:.3g}, {pct(r.get(f'{w}_mfu'))}" if f"{w}_tflops" in r else "" for w in
                 ("rollout", "train")]  # fmt: skip
        done = f"{r['rollout_pflop']:.3g}, {r['train_pflop']:.3g}" if "rollout_pflop" in r else ""
        rows.append(
            f"| {r['call']} | {r['case']} | {r['setting']} | {r['status']} | {fmt(r.get('rollout_s'), '.2f', '')} | "
            f"{fmt(r.get('train_s'), '.2f', '')} | {fmt(r.get('peak_gb'), '.3g', '')} | {fmt(r.get('plan_gb'))} | "
            f"{rates[0]} | {rates[1]} | {done} | {fmt(r.get('estimate_s'), '.0f', '')} | "
            f"{fmt(r.get('wall_s'), '.0f', '')} |"
        )
    peaks = (
        f"MFU against the measured bf16 matmul peak {measured:.0f} TFLOP/s"
        + (f" (datasheet {datasheet:.0f})" if datasheet else "")
        if measured
        else "no GPU: no MFU (the seconds are the CPU's, the peak memory the process's resident set)"
    )
    calls = [
        f"- call {e['call']}: estimated {e['total_s']:.0f} s on an H100 / H200 (fixed {e['fixed_s']:.0f} s + cases "
        f"{e['cases_s']:.0f} s; limit {e['limit_s']} s)"
        + (
            f"; measured {results['calls_s'][str(e['call'])]:.0f} s"
            if str(e["call"]) in results.get("calls_s", {})
            else ""
        )  # fmt: skip
        for e in results.get("estimates", {}).values()
    ]
    failures = [
        f"- {f['step']}: {f['type']}" + (": " + f["message"].replace("\n", " / ") if f.get("message") else "")
        for f in results.get("failures", [])
    ]
    return (
        f"{results['device']}; {peaks}\nstatus: {results['status']}\n"
        + ("timing model (benchmarks/gpu/gpu_cases.py TIMING):\n" + "\n".join(calls) + "\n" if calls else "")
        + "\n"
        + "\n".join(rows)
        + ("\n\nfailures:\n" + "\n".join(failures) if failures else "")
    )


# ---------------------------------------------------------------------------------------------------
# The calls
# ---------------------------------------------------------------------------------------------------
def chosen(calls: str, cases: str) -> tuple[list[int], list[Case]]:
    """--call (1, 2 or 1,2) and --cases (names of those calls' cases; '' = all): ValueError naming the flag."""
    try:
        numbers = [int(c) for c in calls.split(",")]
    except ValueError:
        numbers = []
    if not numbers or any(n not in CASES for n in numbers) or len(set(numbers)) != len(numbers):
        raise ValueError(f"--call {calls!r}: give 1, 2 or 1,2")
    every = [c for n in numbers for c in CASES[n]]
    names = cases.split(",") if cases else [c.name for c in every]
    unknown = [n for n in names if n not in {c.name for c in every}]
    if unknown:
        raise ValueError(f"--cases {cases!r}: {unknown[0]} is not a case of --call {calls} (of: "
                         f"{', '.join(c.name for c in every)}; comma-separated, each once)")  # fmt: skip
    twice = [n for i, n in enumerate(names) if n in names[:i]]
    if twice:
        raise ValueError(f"--cases {cases!r}: {twice[0]} is given twice")
    return numbers, [c for c in every if c.name in names]


def run_call(check: Check, a, call: int, cases: list[Case], tiny: bool, plan: dict, t_call: float) -> None:
    """One call within its limit: (call 1) the environment and the attention probe, then each case, contained, with
    its line as it finishes, its rates from the plan's FLOP counts and the timing model's estimate; then the call's.
    Its limit counts from `t_call` (the first call's: the check's start, its matmul peak included)."""
    out, results, say = check.out, check.results, check.say
    device = "cpu" if tiny else "cuda"
    check.deadline = t_call + (a.limit_s or CALL_LIMIT_S[call] + (10_000 if tiny else 0))
    if call == 1:
        env, _ = check.attempt("environment", environment)
        results["environment"] = env
        say(f"environment: {json.dumps(env)}")
        from benchmarks.gpu import sdpa_probe

        # rehearsed with the math kernel alone (one process: the others are the probe's own tests' concern)
        backends = ["math"] if tiny else None
        limit = min(120.0, check.left_s())  # each of its processes, and the whole probe
        rows, _ = check.attempt("sdpa probe", sdpa_probe.probe, device, None, tiny, say, backends, 3, limit,
                                limit_s=check.left_s())  # fmt: skip
        results["sdpa_probe"] = rows
        bad = [r for r in rows or [] if r["status"] in ("error", "non-finite")]
        say(f"sdpa probe: {len(rows or [])} rows, {len(bad)} error or non-finite")
        check.save()
    estimates, kinds_seen = {}, set()
    for case in cases:
        key = f"{call}/{case.name}"
        setting = describe(case, tiny)
        entry = plan_for(plan, case, tiny)
        if entry is None:  # counted now (seconds on the meta device); no memory plan (minutes: --write-plan)
            entry, _ = check.attempt(f"{key}: FLOP count", plan_case, case, tiny, False)
        r = {"call": call, "case": case.name, "setting": setting, "status": "running"}
        results["cases"][key] = r
        if entry:
            r["plan_gb"] = entry.get("memory_gb")
            counted, expected = entry["flops"], entry.get("expected_forward")
            say(f"{key} {setting}: one row's forward {counted['forward'] / 1e12:.4g} TFLOP counted"
                + (f" ({expected / 1e12:.4g} expected)" if expected else "")
                + f", forward + backward {counted['train'] / 1e12:.4g} TFLOP")  # fmt: skip
        if check.left_s() < 1:
            r["status"] = "skipped: no time left"
            check.fail(key, "skipped", f"{max(check.left_s(), 0):.1f} s left of the call's --limit-s")
            continue
        out_r, failure = check.attempt(key, run_case, case, tiny, out, a.attention_backend, limit_s=check.left_s())
        if failure is not None:
            r["status"] = f"failed: {failure['type']}"
        else:
            r |= out_r
            if r["status"] != "ok":
                check.fail(key, r["status"], "")
        if entry:
            add_rates(r, entry["flops"], results.get("peak_tflops_measured"))
            gpu_entry = entry if not tiny else plan_for(plan, case, False) or gpu_counts(check, case)
            if gpu_entry is not None and "nograd_rows" in r:
                est = estimate_case(case, gpu_entry, rows_of(r, case), new_shapes=case.kind not in kinds_seen)
                kinds_seen.add(case.kind)
                r["estimate_s"] = est["total_s"]
                estimates[case.name] = est
        say(line(r))
        check.save()
    results.setdefault("calls_s", {})[str(call)] = time.perf_counter() - t_call
    if estimates:
        results["estimates"][str(call)] = estimate_call(call, estimates) | {"of_cases": sorted(estimates)}
    check.save()


def gpu_counts(check: Check, case: Case) -> dict | None:
    """A rehearsed case's counts at the GPU's shapes when the plan has none current: counted now (seconds)."""
    entry, _ = check.attempt(f"{case.call}/{case.name}: FLOP count at the GPU's shapes", plan_case, case, False, False)
    return entry


def line(r: dict) -> str:
    if "iteration_s" not in r:
        return f"{r['call']}/{r['case']}: {r['status']}"
    rates = "".join(
        f", {w} {r[f'{w}_tflops']:.3g} TFLOP/s ({pct(r.get(f'{w}_mfu'))})" for w in ("rollout", "train")
        if f"{w}_tflops" in r
    )  # fmt: skip
    return (f"{r['call']}/{r['case']}: ok, rollout {r['rollout_s']:.2f} s, training {r['train_s']:.2f} s, peak "
            f"{r['peak_gb']:.3g} GB (plan {fmt(r.get('plan_gb'))}){rates}, {r['wall_s']:.0f} s in all, model "
            f"{'released' if r['released'] else 'NOT released'}"
            + (f", estimated {r['estimate_s']:.0f} s on an H100" if "estimate_s" in r else ""))  # fmt: skip


def plan_text(plan: dict, depth: int = 4, indent: str = "") -> str:
    """The plan as JSON, indented down to each case's figures and the parts of its key (each model part's config, the
    size, the flags) and each of these on one line: about 500 lines where an indent of every level gives thousands;
    json.loads reads back the same plan."""
    if not isinstance(plan, dict) or not plan or depth == 0:
        return json.dumps(plan)
    inner = indent + " "
    items = ",\n".join(f"{inner}{json.dumps(k)}: {plan_text(v, depth - 1, inner)}" for k, v in plan.items())
    return "{\n" + items + "\n" + indent + "}" + ("\n" if not indent else "")


def write_plan(path: Path, tiny: bool, say=print) -> dict:
    """Every case of both calls planned (memory.py) and counted, at the GPU's shapes (tiny: the rehearsal's); an
    entry of `path` made for the same parts, size and flags is kept. Written after each case."""
    old = read_plan(path)
    plan = {"made": old.get("made")}
    for cases in CASES.values():
        for case in cases:
            entry = plan_for(old, case, tiny)  # made for the same parts, size and flags: kept
            if entry is None:
                entry, plan["made"] = plan_case(case, tiny, say=say), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            plan[f"{case.call}/{case.name}" + ("/tiny" if tiny else "")] = entry
            path.write_text(plan_text(plan))
    say(f"{path}: every case planned (made {plan['made']})")
    return plan


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--call", help="1, 2 or 1,2 (default: 1,2 with --rehearse, else required)")
    p.add_argument("--cases", default="", help="comma-separated cases of the call(s) (default: all): a rerun")
    p.add_argument("--rehearse", action="store_true", help="tiny widths on the CPU: the kit end to end")
    p.add_argument("--out", default="/tmp/gpu_check", help="folder of the runs and the results")
    p.add_argument("--results", help="also write the results here, from the start")
    p.add_argument("--limit-s", type=float, help="each call's time limit (default: 240 for call 1, 360 for call 2)")
    p.add_argument("--plan", default=str(PLAN), help="the plan (--write-plan); an entry made for other flags is unused")
    p.add_argument("--write-plan", help="only plan every case (memory.py, FLOP counts) into this file, then end")
    p.add_argument("--attention-backend", choices=("auto", "flash", "efficient", "math", "cudnn"),
                   help="passed to every script (default: the scripts' own)")  # fmt: skip
    a = p.parse_args(argv)
    for flag, path in (("--plan", a.plan), ("--write-plan", a.write_plan)):
        try:
            read_plan(Path(path) if path else None)
        except (OSError, ValueError) as e:
            p.error(f"{flag} {path}: not a plan ({type(e).__name__}: {e})")
    if not Path(a.plan).is_file() and Path(a.plan) != PLAN:
        p.error(f"--plan {a.plan}: no such file (benchmarks/gpu/gpu_check.py --write-plan makes one)")
    if a.write_plan and not Path(a.write_plan).resolve().parent.is_dir():
        p.error(f"--write-plan {a.write_plan}: no such folder")
    if a.write_plan:
        write_plan(Path(a.write_plan), a.rehearse)
        return
    if a.call is None and not a.rehearse:
        p.error("--call: give 1 or 2 (the two calls of a lent GPU; --rehearse runs both by default)")
    try:
        calls, cases = chosen(a.call or "1,2", a.cases)
    except ValueError as e:
        p.error(str(e))
    if a.limit_s is not None and a.limit_s <= 0:
        p.error(f"--limit-s {a.limit_s}: must be > 0")
    tiny, out = a.rehearse, Path(a.out)
    if not tiny and not torch.cuda.is_available():
        p.error("--call: no CUDA GPU here; --rehearse runs the kit on the CPU")
    plan = read_plan(Path(a.plan))
    t_call = time.perf_counter()  # the first call's clock: from here, the matmul peak included
    check = Check(out, Path(a.results) if a.results else None, "CPU (rehearsal)" if tiny else "", calls)
    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        check.results["device"] = "CPU (rehearsal)" if tiny else torch.cuda.get_device_name()
        out.mkdir(parents=True, exist_ok=True)
        (out / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
        shutil.rmtree(out / "runs", ignore_errors=True)
        if tiny:
            register_tiny_hps(out / "open_clip")
        else:
            check.results["peak_tflops_measured"], _ = check.attempt("matmul peak", matmul_peak_tflops)
            name = check.results["device"]
            check.results["peak_tflops_datasheet"] = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        for call in calls:
            run_call(check, a, call, [c for c in cases if c.call == call], tiny, plan, t_call)
            t_call = time.perf_counter()
    except Stopped as e:
        check.fail("the check", "Stopped", str(e))
        check.results["status"] = str(e)
        check.save()
        raise SystemExit(f"error: {e}") from None
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    bad = [f["step"] for f in check.results["failures"]]
    check.results["status"] = "done" if not bad else f"done, not everything ran: {', '.join(bad)}"
    check.save()
    check.say(table(check.results))
    if bad:
        raise SystemExit(f"error: not every step ran: {', '.join(bad)} (results in {out}/gpu_check.md)")


if __name__ == "__main__":
    main()
