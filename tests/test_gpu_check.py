"""benchmarks/gpu/gpu_check.sh, the prepared GPU check, rehearsed on the CPU: both calls end to end at tiny widths (every
model kind built on the device in this process, each script's main run on it, timed, released), the timing model's
estimate of each call within its limit, a failing or overrunning case contained, bad flags refused at start-up; the
weights built as from_pretrained leaves them (dtypes, fp32 modules); the FLOPs counted on the LoRA-wrapped
denoiser, forward and backward; the committed plan current and within one GPU's memory."""

import json
import os
import subprocess
import time

import pytest
import torch

from tests.helpers import ROOT

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def gpu_check(*flags, env=None):
    return subprocess.run(
        ["bash", "benchmarks/gpu/gpu_check.sh", *flags], cwd=ROOT, capture_output=True, text=True, env=env or ENV,
        timeout=900,
    )  # fmt: skip


def test_the_rehearsal_runs_both_calls_end_to_end_and_the_plan_fits_its_limits(tmp_path):
    from benchmarks.gpu import gpu_build
    from benchmarks.gpu import gpu_check as G

    t = time.perf_counter()
    out = gpu_check("--rehearse", "--out", str(tmp_path / "work"), "--results", str(tmp_path / "results"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads((tmp_path / "results" / "gpu_check.json").read_text())
    assert results["status"] == "done" and results["failures"] == [] and results["calls"] == [1, 2]
    cases = results["cases"]
    assert list(cases) == [f"{c.call}/{c.name}" for c in G.CASES[1] + G.CASES[2]]
    every = set(gpu_build.KINDS) | {s[:-3] for s in gpu_build.SCRIPTS}
    assert {c.name for c in G.CASES[1] + G.CASES[2]} >= every  # every kind
    for key, r in cases.items():
        assert r["status"] == "ok" and r["released"], key  # ran, and its model was freed before the next case
        assert r["nograd_rows"] > 0 and r["grad_rows"] > 0 and r["backward_s"] > 0, key
        assert r["rollout_s"] > 0 and r["train_s"] > 0 and r["train_tflops"] > 0 and r["train_mfu"] is None, key
        assert "rewards/hpsv2.1" in r["rewards"], key  # the random-weight reward scored every sample
        assert r["estimate_s"] > 0, key
    # the probe ran first (rehearsed with the math kernel), and the environment was recorded
    assert results["sdpa_probe"] and {r["status"] for r in results["sdpa_probe"]} <= {"ok", "unsupported", "skipped"}
    assert results["environment"]["torch"] == torch.__version__
    # rows: 4 images x 4 steps with CFG on SD3.5 (2 rows each), embedded guidance on FLUX.1; 2 videos x 4 steps, CFG
    assert cases["1/sd35"]["nograd_rows"] == 32 and cases["1/flux"]["nograd_rows"] == 16
    assert cases["1/wan22-a14b"]["nograd_rows"] == 16  # both experts' rows (each step's batch on one of them)
    # the video kinds of call 2: LTX-2.3 with CFG (2 x 4 x 2), HunyuanVideo-1.5 at its recipe's guidance 1 (2 x 4)
    assert (cases["2/ltx2"]["nograd_rows"], cases["2/hunyuan15"]["nograd_rows"]) == (16, 8)
    # the timing model: each call within its limit on an H100 / H200 by its own estimate, beside the table
    estimates = results["estimates"]
    assert estimates["1"]["total_s"] <= 240 and estimates["2"]["total_s"] <= 360, estimates
    assert [sorted(estimates[c]["of_cases"]) for c in "12"] == [sorted(c.name for c in G.CASES[k]) for k in (1, 2)]
    table = (tmp_path / "results" / "gpu_check.md").read_text()
    assert "- call 1: estimated " in table and "- call 2: estimated " in table and "failures:" not in table
    assert "| 1 | wan22-a14b | Wan2.2-T2V-A14B (tiny), 32x32 x 5 frames | ok |" in table
    assert "1/flux: ok, rollout " in (tmp_path / "results" / "gpu_check.log").read_text()
    assert "- call 2: estimated" in (tmp_path / "results" / "console.txt").read_text()
    # no weights were written: the model folders hold a model_index.json each, and no run kept a checkpoint
    work = tmp_path / "work"
    assert {p.name for p in (work / "models").rglob("*") if p.is_file()} == {"model_index.json"}
    assert not [p for p in work.rglob("*") if p.suffix in (".safetensors", ".pt", ".bin", ".pth")]
    print(f"rehearsal: {time.perf_counter() - t:.0f} s; estimates: " + ", ".join(
        f"call {k} {v['total_s']:.0f} s" for k, v in estimates.items()))  # fmt: skip


@pytest.fixture
def quick(monkeypatch):
    """benchmarks.gpu.gpu_check with the attention probe faked (its own tests run it)."""
    from benchmarks.gpu import gpu_check as G
    from benchmarks.gpu import sdpa_probe

    monkeypatch.setattr(sdpa_probe, "probe", lambda *a, **k: [{"status": "ok"}])
    return G


def test_a_failing_case_is_recorded_and_the_next_case_runs(tmp_path, quick, monkeypatch):
    from benchmarks.gpu import gpu_build

    G = quick
    build = gpu_build.build_model

    def broken(kind, *a, **k):
        if kind == "sd35":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nsecond line")
        return build(kind, *a, **k)

    monkeypatch.setattr(gpu_build, "build_model", broken)  # what kit_weights builds with
    with pytest.raises(SystemExit, match="not every step ran: 1/sd35"):
        G.main(["--rehearse", "--call", "1", "--cases", "sd35,wan21", "--out", str(tmp_path / "w"), "--results",
                str(tmp_path / "r")])  # fmt: skip
    results = json.loads((tmp_path / "r" / "gpu_check.json").read_text())
    [failure] = results["failures"]
    assert failure["step"] == "1/sd35" and failure["type"] == "OutOfMemoryError"
    assert failure["message"].startswith("CUDA out of memory") and "broken" in failure["tail"]
    assert results["cases"]["1/sd35"]["status"] == "failed: OutOfMemoryError"
    assert results["cases"]["1/wan21"]["status"] == "ok" and results["cases"]["1/wan21"]["released"]
    assert "- 1/sd35: OutOfMemoryError: CUDA out of memory" in (tmp_path / "r" / "gpu_check.md").read_text()
    from common import rewards

    assert rewards.REWARDS["hpsv2.1"].factory is rewards.hpsv2_1  # the kit's replacements are gone
    import dancegrpo
    from common.models import load_model

    assert dancegrpo.load_model is load_model


def test_a_case_that_overruns_the_call_is_ended_and_the_rest_skipped(tmp_path, quick, monkeypatch):
    G = quick
    monkeypatch.setattr(G, "run_case", lambda *a: time.sleep(60))
    monkeypatch.setattr(G, "plan_case", lambda *a: None)  # no FLOP counts: the clock is the case's
    t = time.perf_counter()
    with pytest.raises(SystemExit):
        # 10 s: what comes before the first case must fit on a loaded 2-core machine (at 2 s it did not, once)
        G.main(["--rehearse", "--call", "2", "--cases", "dancegrpo,vgrpo", "--limit-s", "10", "--out", str(tmp_path)])
    assert time.perf_counter() - t < 40
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    first, second = results["failures"][-2:]
    assert first["step"] == "2/dancegrpo" and first["type"] == "OutOfTime"
    assert second["step"] == "2/vgrpo" and second["type"] == "skipped" and "s left" in second["message"]
    assert results["cases"]["2/vgrpo"]["status"] == "skipped: no time left"


@pytest.mark.parametrize(
    "flags, error",
    [
        ([], "--call: give 1 or 2"),
        (["--call", "3"], "--call '3': give 1, 2 or 1,2"),
        (["--rehearse", "--call", "1", "--cases", "flux,sd3"], "--cases 'flux,sd3': sd3 is not a case of --call 1"),
        (["--rehearse", "--call", "2", "--cases", "flux"], "flux is not a case of --call 2 (of: dancegrpo,"),
        (["--rehearse", "--call", "1", "--cases", "flux,flux"], "--cases 'flux,flux': flux is given twice"),
        (["--rehearse", "--limit-s", "0"], "--limit-s 0.0: must be > 0"),
        (["--call", "1"], "--call: no CUDA GPU here"),
        (["--rehearse", "--plan", "/nonexistent.json"], "--plan /nonexistent.json: no such file"),
        (["--rehearse", "--plan", __file__], f"--plan {__file__}: not a plan (JSONDecodeError"),
        (["--write-plan", "/nonexistent/plan.json"], "--write-plan /nonexistent/plan.json: no such folder"),
        (["--rehearse", "--attention-backend", "fast"], "--attention-backend: invalid choice: 'fast'"),
    ],
)
def test_bad_flags_fail_at_start_up(tmp_path, capsys, flags, error, monkeypatch):
    from benchmarks.gpu import gpu_check as G

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        G.main([*flags, "--out", str(tmp_path / "work")])
    assert e.value.code == 2 and error in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_a_gpu_check_that_dies_before_its_results_leaves_a_record(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'Traceback: ImportError: no torch' >&2\nexit 3\n")
    python.chmod(0o755)
    out = gpu_check("--call", "1", "--results", str(tmp_path / "results"), env={**ENV, "PY": str(python)})
    assert out.returncode == 3 and "ImportError" in out.stderr
    assert "exit status 3" in json.loads((tmp_path / "results" / "gpu_check.json").read_text())["status"]
    assert "ImportError: no torch" in (tmp_path / "results" / "console.txt").read_text()


# ---------------------------------------------------------------------------------------------------
# Weights built as from_pretrained leaves them; FLOPs counted; the committed plan
# ---------------------------------------------------------------------------------------------------
def dtypes(module) -> dict:
    return {n: t.dtype for n, t in [*module.named_parameters(), *module.named_buffers()]}


def test_weights_are_made_in_the_dtypes_from_pretrained_gives(tmp_path):
    """A tiny Wan2.1 saved and loaded in bf16 (diffusers keeps its norms, time embedder and modulation in fp32; UMT5's
    'wo' stays bf16 in bf16) has every parameter and buffer in the dtype the kit's `made` gives it."""
    from diffusers import WanTransformer3DModel
    from transformers import UMT5EncoderModel

    from benchmarks.gpu import gpu_build
    from tests.tiny import build_wan

    build_wan(tmp_path)
    for cls, sub in ((WanTransformer3DModel, "transformer"), (UMT5EncoderModel, "text_encoder")):
        loaded = cls.from_pretrained(tmp_path / sub, dtype=torch.bfloat16)
        factory = cls.from_config if cls is WanTransformer3DModel else cls
        built = gpu_build.made("cpu", torch.bfloat16, factory, loaded.config)
        assert dtypes(built) == dtypes(loaded)
        assert torch.float32 in dtypes(built).values() or cls is UMT5EncoderModel
        assert all(torch.isfinite(p).all() for p in built.parameters())


def test_the_flops_are_counted_on_the_lora_wrapped_denoiser_forward_and_backward():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.gpu import gpu_cases, memory
    from benchmarks.gpu import gpu_check as G
    from common.models import add_lora

    case = G.CASES[1][0]  # FLUX.1-dev
    counted = gpu_cases.count_flops(case, "tiny")  # on the meta device
    parts, shapes = G.parts_of("flux", "tiny"), gpu_cases.shapes_of(case, "tiny")
    torch.manual_seed(0)
    module = memory.build_denoiser("flux", parts["denoiser"], torch.bfloat16).requires_grad_(False)
    x = torch.randn(1, *shapes.latent)

    def flops(backward: bool) -> int:
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            with torch.set_grad_enabled(backward):
                y = memory.denoise(shapes, module, x)
            if backward:
                y.sum().backward()
        return counter.get_total_flops()

    base = flops(False)
    add_lora(module, 128, 256)
    assert (counted["forward_base"], counted["forward"], counted["train"]) == (base, flops(False), flops(True))
    assert counted["forward"] == pytest.approx(gpu_cases.expected_flops(case, "tiny"), rel=0.01)
    assert counted["train"] > 2 * counted["forward"]


def test_the_committed_plan_is_current_and_every_case_fits_one_gpu():
    """benchmarks/gpu/gpu_plan.json: an entry per case, made for its current parts, size and flags (else: `python
    benchmarks/gpu/gpu_check.py --write-plan benchmarks/gpu/gpu_plan.json`), each planned within an 80 GB GPU; FLUX.1-dev at
    720 px counted as by hand."""
    from benchmarks.gpu import gpu_check as G

    plan = G.read_plan(G.PLAN)
    for call, cases in G.CASES.items():
        for case in cases:
            entry = G.plan_for(plan, case, False)
            assert entry is not None, f"{call}/{case.name}: rerun --write-plan"
            assert 0 < entry["memory_gb"] < 75, (case, entry["memory_gb"])
            assert (
                entry["flops"]["train"] > 1.5 * entry["flops"]["forward"] > 0
            )  # a backward of about a forward or more
            if entry["expected_forward"] is not None:
                assert entry["flops"]["forward"] == pytest.approx(entry["expected_forward"], rel=1e-3)
    flux = G.plan_for(plan, G.CASES[2][0], False)["flops"]
    assert flux["forward_base"] / 1e12 == pytest.approx(37.28, abs=0.01)  # 2025 image + 512 text tokens
    assert flux["train"] / 1e12 == pytest.approx(81.18, abs=0.01)
    assert flux["params"] / 1e9 == pytest.approx(11.9, abs=0.05)


def test_the_timing_model_adds_up():
    """estimate_case: the FLOPs of the rows at the assumed MFU, plus building and the fixed costs; more rows, more
    time; estimate_call adds the start-up (and call 1's probe)."""
    from benchmarks.gpu import gpu_cases
    from benchmarks.gpu import gpu_check as G

    case = G.CASES[2][0]
    entry = G.plan_for(G.read_plan(G.PLAN), case, False)
    rows = {"nograd_rows": 32, "grad_rows": 8, "forwards": 20, "samples": 4, "prompts": 5}
    e = G.estimate_case(case, entry, rows)
    peak = gpu_cases.TIMING["peak_tflops"] * 1e12
    assert e["rollout_s"] == pytest.approx(32 * entry["flops"]["forward"] / (gpu_cases.TIMING["mfu_rollout"] * peak))
    assert e["total_s"] == pytest.approx(sum(v for k, v in e.items() if k.endswith("_s") and k != "total_s"))
    more = G.estimate_case(case, entry, rows | {"grad_rows": 16})
    assert more["train_s"] > e["train_s"] and more["total_s"] > e["total_s"]
    call = G.estimate_call(1, {"a": e})
    assert (
        call["total_s"] == pytest.approx(e["total_s"] + call["fixed_s"])
        and call["fixed_s"] > gpu_cases.TIMING["probe_s"]
    )


def test_every_gpu_case_builds_from_its_real_configs():
    """Every case of both calls built as on the GPU (the real widths, call 1's depths, the real text encoders, VAEs and
    pipelines), on the meta device: the configs, the pipeline and the model class fit together, and the denoiser has
    the parameters the plan counted (A14B: two experts)."""
    from benchmarks.gpu import gpu_build, gpu_cases
    from benchmarks.gpu import gpu_check as G

    plan = G.read_plan(G.PLAN)
    for case in G.CASES[1] + G.CASES[2][:1] + [c for c in G.CASES[2] if c.name in gpu_build.KINDS]:
        size = gpu_cases.size_of(case, False)
        side = size.get("resolution") or (size["height"] if size["height"] == size["width"] else None)
        parts = G.parts_of(case.kind, case.scale)
        model = gpu_build.build_model(case.kind, parts, "meta", torch.bfloat16, side, size.get("frames"), False)
        denoiser = model.unet if model.kind == "sd1" else model.transformer
        experts = 2 if case.kind == "wan22-a14b" else 1
        counted = G.plan_for(plan, case, False)["flops"]["params"]
        assert sum(p.numel() for p in denoiser.parameters()) == experts * counted, case.name
        assert max(denoiser.parameters(), key=torch.Tensor.numel).dtype == torch.bfloat16  # Wan keeps its norms fp32


def test_the_kits_reward_scores_as_hpsv2_1_with_the_same_weights(tmp_path):
    """random_hps is common.rewards.hpsv2_1 without reading a checkpoint: with the weights the tiny checkpoint holds
    (the same seed), the same scores."""
    from benchmarks.gpu import gpu_build
    from benchmarks.gpu import gpu_check as G
    from common.rewards import hpsv2_1
    from tests.tiny import build_tiny_hps

    checkpoint = build_tiny_hps(tmp_path)  # seed 0, open_clip config 'tiny-hps' registered
    images, prompts = torch.rand(3, 3, 40, 48), ["a red circle", "a green square", "a cat"]
    torch.manual_seed(0)
    kit = gpu_build.random_hps("cpu", arch=G.TINY_HPS)
    assert torch.equal(kit(images, prompts), hpsv2_1("cpu", checkpoint, arch=G.TINY_HPS)(images, prompts))
