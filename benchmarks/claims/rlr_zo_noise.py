"""RLR's zero-order term against its first- and half-order terms on ShapesBench: signal and noise per reward evaluation.

    python benchmarks/claims/rlr_zo_noise.py                       # 12 draws of 32 samples (~3 min on one CPU thread)
    python benchmarks/claims/rlr_zo_noise.py --draws 24 -- --zo-scale 1e-2   # flags after -- go to rlr.py

Runs rlr.py's own main() with the full estimator (--terms fo+ho+zo --subchain-stage any, the other flags at their
defaults) at a learning rate too small to move a weight (1e-30), so that every iteration is an independent draw of
the estimate at the same parameters (a fresh LoRA adapter), and records each iteration's gradient twice: after the
first- and half-order terms, and after the zero-order term is added (the difference is the ZO term). With g_k the
k-th draw (the mean over its n samples), per term:

    E|g|^2                   mean over the draws of the squared norm
    |E g|^2                  mean over pairs k != l of <g_k, g_l>: unbiased for the squared norm of the expectation
    noise per evaluation     n (E|g|^2 - |E g|^2), the trace of the covariance of one sample's contribution
    samples for SNR 1        noise per evaluation / |E g|^2: how many samples one estimate needs before its
                             expectation is as large as its noise (ill-defined where |E g|^2 is not resolved)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def measure(draws: int, samples: int, extra: list[str], out_dir: Path) -> dict:
    """Per term ('fo+ho', 'zo'): the figures of the module docstring, from `draws` iterations of rlr.main()."""
    import tyro
    from accelerate import Accelerator

    import rlr

    fo_ho, full, calls = [], [], [0]
    grad_norm, clip = rlr.grad_norm, Accelerator.clip_grad_norm_

    def flat(params):
        return torch.cat([p.grad.detach().double().flatten() for p in params])

    def grad_norm_and_keep(params):  # main() calls it after FO, then after FO + HO: keep the second
        calls[0] += 1
        if calls[0] % 2 == 0:
            fo_ho.append(flat(params))
        return grad_norm(params)

    def clip_and_keep(self, params, *a, **k):  # FO + HO + ZO, before clipping
        params = list(params)
        full.append(flat(params))
        return clip(self, params, *a, **k)

    argv = ["--terms", "fo+ho+zo", "--subchain-stage", "any", "--learning-rate", "1e-30", "--lr-warmup", "0"]
    argv += ["--iterations", str(draws), "--samples-per-device", str(samples), "--eval-every", "0"]
    argv += ["--sample-every", "0", "--save-every", "0", "--no-save", "--output-dir", str(out_dir), *extra]
    rlr.grad_norm, Accelerator.clip_grad_norm_ = grad_norm_and_keep, clip_and_keep
    try:
        rlr.main(tyro.cli(rlr.Args, args=argv))
    finally:
        rlr.grad_norm, Accelerator.clip_grad_norm_ = grad_norm, clip
    terms = {"fo+ho": torch.stack(fo_ho), "zo": torch.stack(full) - torch.stack(fo_ho)}  # (draws, d) each
    table = {"draws": draws, "samples": samples, "parameters": terms["zo"].shape[1], "extra": extra}
    for name, g in terms.items():
        sq = g.square().sum(1)
        dots = g @ g.T
        signal = float((dots.sum() - dots.diagonal().sum()) / (draws * (draws - 1)))
        noise = samples * (float(sq.mean()) - signal)
        table[name] = {
            "mean_sq_norm": float(sq.mean()),
            "expectation_sq_norm": signal,
            "noise_per_evaluation": noise,
            "samples_for_snr_1": noise / signal if signal > 0 else float("inf"),
        }
    table["noise_ratio_zo_over_fo_ho"] = table["zo"]["noise_per_evaluation"] / table["fo+ho"]["noise_per_evaluation"]
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=12, help="independent estimates at the same parameters")
    parser.add_argument("--samples", type=int, default=32, help="samples per estimate (rlr.py --samples-per-device)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "claims" / "rlr_zo_noise_out")
    parser.add_argument("extra", nargs="*", help="more rlr.py flags, after --")
    a = parser.parse_args()
    if a.draws < 2:
        parser.error("--draws must be >= 2 (the expectation is estimated from pairs of draws)")
    t = measure(a.draws, a.samples, a.extra, a.out)
    print(f"{t['parameters']} trained parameters, {a.draws} draws of {a.samples} samples")
    print("| term | E abs(g)^2 | abs(E g)^2 | noise per evaluation | samples for SNR 1 |\n|---|---|---|---|---|")
    for name in ("fo+ho", "zo"):
        r = t[name]
        print(
            f"| {name} | {r['mean_sq_norm']:.3g} | {r['expectation_sq_norm']:.3g} | {r['noise_per_evaluation']:.3g} "
            f"| {r['samples_for_snr_1']:.3g} |"
        )
    print(f"ZO noise / FO + HO noise: {t['noise_ratio_zo_over_fo_ho']:.3g}")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "rlr_zo_noise.json").write_text(json.dumps(t, indent=1))


if __name__ == "__main__":
    main()
