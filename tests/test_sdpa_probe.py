"""benchmarks/gpu/sdpa_probe.py on the CPU at tiny sizes: the kernels the CPU has run and agree with the float32
reference, the ones it lacks are 'unsupported', a case that poisons or kills its process is recorded and the next case
runs in a fresh one; the full-size shapes are the token counts the models train with."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu import memory, sdpa_probe  # noqa: E402


def test_tiny_probe_runs_every_kernel_and_agrees_with_the_reference():
    lines = []
    rows = sdpa_probe.probe(
        "cpu", ["flux", "qwen"], tiny=True, say=lines.append, backends=["flash", "efficient", "math"], reps=1
    )
    assert [(r["case"], r["backend"]) for r in rows] == [
        (c, b) for b in ("flash", "efficient", "math") for c in ("flux", "flux:contiguous", "qwen")
    ]
    assert len(lines) == len(rows)
    for r in rows:
        if r["backend"] == "efficient":  # no memory-efficient kernel on a CPU
            assert r["status"] == "unsupported" and r["ms"] is None
        else:
            assert r["status"] == "ok" and r["ms"] > 0
            assert r["max_diff_out"] < 1e-5 and r["max_diff_grad"] < 1e-5
    qwen = next(r for r in rows if r["case"] == "qwen")
    assert qwen["shape"] == {
        "batch": 2,
        "heads": 2,
        "q_len": 10,
        "kv_len": 10,
        "head_dim": 128,
        "masked": 3,
        "contiguous": False,
    }
    assert "| qwen | 2x2x10x10x128 mask |" in sdpa_probe.table(rows)


@pytest.mark.parametrize("how", ["poison", "crash"])
def test_a_case_that_poisons_or_kills_its_process_is_recorded_and_the_rest_run(how):
    rows = sdpa_probe.probe(
        "cpu",
        ["flux", "sd1"],
        tiny=True,
        say=lambda s: None,
        backends=["flash"],
        reps=1,
        fault=f"flux:contiguous:flash:{how}",
    )
    assert [r["case"] for r in rows] == ["flux", "flux:contiguous", "sd1", "sd1:cross"]
    assert [r["status"] for r in rows] == ["ok", "error", "ok", "ok"]
    expected = "illegal memory access" if how == "poison" else "process ended in this case"
    assert expected in rows[1]["error"]


def test_the_mask_pads_every_other_row_and_the_reference_uses_it():
    case = sdpa_probe.Case(4, 2, 6, 6, 8, masked=2)
    q, k, v, mask, grad = sdpa_probe.inputs(case, "cpu")
    assert mask[:, 0, 0].tolist() == [[True] * 6, [True] * 4 + [False] * 2] * 2
    assert q.shape == (4, 2, 6, 8) and not q.is_contiguous()  # diffusers' permuted (B, L, H, D) layout
    # a value changed in a padded key moves nothing in row 1; in row 0, where that key counts, it moves the output
    (ref, *_), heads = sdpa_probe.reference(q, k, v, mask, grad)
    assert heads == [0, 1]  # the first and the last head of row 0
    v2 = v.detach().clone()
    v2[:, :, -1] += 10
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out2 = torch.nn.functional.scaled_dot_product_attention(q, k, v2, attn_mask=mask)
    assert torch.equal(out[1], out2[1]) and not torch.allclose(out[0], out2[0])
    torch.testing.assert_close(ref[0], out[0, heads].detach(), atol=1e-6, rtol=1e-6)


def tokens(kind: str, resolution, frames=None) -> int:
    """Image or video tokens of one sample, from benchmarks/gpu/memory.py's shapes of the same model."""
    shapes = memory.Shapes.of(kind, memory.MODELS[kind], resolution, frames)
    if kind in memory.VIDEO_KINDS:
        _, f, h, w = shapes.latent
        return f * (h // 2) * (w // 2)  # Wan's (1, 2, 2) patches
    if kind == "sd3":
        return (shapes.latent[1] // 2) * (shapes.latent[2] // 2)  # 2 x 2 patches
    return shapes.latent[0]  # FLUX.1, FLUX.2, Qwen-Image: packed tokens


def test_full_size_cases_are_the_token_counts_the_models_train_with():
    C = sdpa_probe.CASES
    assert C["flux"].q_len == tokens("flux", 720) + 512 == 2025 + 512  # T5's 512 tokens joined
    assert C["flux2"].q_len == tokens("flux2", 384) + 512 == 576 + 512
    assert C["flux2_dev"].q_len == tokens("flux2_dev", 1024) + 512
    assert C["sd3"].q_len == tokens("sd3", 512) + 77 + 256 and C["sd3:attn2"].q_len == tokens("sd3", 512)
    assert C["qwen"].q_len == tokens("qwen", 512) + 256
    assert C["wan"].q_len == tokens("wan", (480, 832), 33) == 9 * 30 * 52
    assert C["wan:cross"].kv_len == 512
    assert C["wan22"].q_len == tokens("wan22", (704, 1280), 9) == 3 * 22 * 40
    assert C["wan22_a14b"].q_len == tokens("wan22_a14b", (480, 832), 81) == 21 * 30 * 52
    heads = {"flux": 24, "flux2": 24, "flux2_dev": 48, "sd3": 24, "qwen": 24, "wan": 12, "wan22": 24, "wan22_a14b": 40}
    for kind, n in heads.items():
        den = memory.MODELS[kind]["denoiser"]
        assert C[kind].heads == n == den["num_attention_heads"], kind
        assert C[kind].head_dim == den["attention_head_dim"], kind
    assert C["zimage"].heads == memory.Z_IMAGE["n_heads"] and C["zimage"].head_dim == memory.Z_IMAGE["dim"] // 30
    ltx = memory.Shapes.of("ltx2", memory.MODELS["ltx2"], 320, 81)  # 1x1x1 patches: the latent grid is the tokens
    assert C["ltx2"].q_len == math.prod(ltx.grid) == 11 * 10 * 10 and C["ltx2:audio"].q_len == ltx.audio == 84
    assert C["ltx2:cross"].kv_len == memory.MODELS["ltx2"]["text"][0][2] == 1024
    ltx_den = memory.LTX23
    assert (C["ltx2"].heads, C["ltx2"].head_dim) == (ltx_den["num_attention_heads"], ltx_den["attention_head_dim"])
    assert C["ltx2:audio"].head_dim == ltx_den["audio_attention_head_dim"] == 64
    hy = memory.Shapes.of("hunyuan15", memory.MODELS["hunyuan15"], 480, 5)
    assert C["hunyuan15"].q_len == math.prod(hy.latent[1:]) + 1000 + 256 + 729 == 1800 + 1985
    assert sdpa_probe.KINDS == (
        "flux",
        "flux2",
        "flux2_dev",
        "sd3",
        "sd1",
        "qwen",
        "zimage",
        "wan",
        "wan22",
        "wan22_a14b",
        "ltx2",
        "hunyuan15",
    )
