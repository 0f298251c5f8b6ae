"""Fingerprint every default command: run each for a few iterations on ShapesBench and record what it computes (a
hash of its final trained tensors and every logged number but timings and memory), so that a restructuring of the
code can be shown to change nothing, bitwise.

    python benchmarks/testing/fingerprint.py --out /tmp/before.json            # at the old commit
    python benchmarks/testing/fingerprint.py --out /tmp/after.json             # at the new one
    python benchmarks/testing/fingerprint.py --compare /tmp/before.json /tmp/after.json

Each command runs --iterations iterations (default 4) with an evaluation every 2 (and at the start), on one thread;
all else is the command's default. About a minute a command on one thread (benchmarks/claims/compare.py's METHODS: one per
method and mode). A figure renamed on purpose is compared under its new name:
`--compare BEFORE AFTER --renamed losses/old_name=losses/new_name`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from benchmarks.claims.compare import METHODS  # noqa: E402  (the default commands: one per method and mode)
from common.logs import read_metrics  # noqa: E402


def fingerprint(key: str, argv: list[str], iterations: int, tmp: Path) -> dict:
    cmd = [sys.executable, *argv, "--output-dir", str(tmp), "--exp-name", key, "--iterations", str(iterations)]
    cmd += ["--eval-every", "2", "--sample-every", "0", "--save-every", "0"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{out.stderr[-3000:]}")
    run = next(tmp.glob(f"{key}__*"))
    digest = hashlib.sha256()  # of the tensors, not the files (a LoRA file's metadata differs between runs)
    for path in sorted((run / "final").rglob("*.safetensors")):
        tensors = load_file(path)
        for name in sorted(tensors):
            digest.update(name.encode() + tensors[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    records = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_metrics(run)]  # no timings
    return {
        "command": " ".join(["python", *argv]),
        "weights_sha256": digest.hexdigest(),
        "records": records,
    }


def compare(a: dict, b: dict, renamed: dict | None = None) -> bool:
    """Same: the same trained weights and every figure BEFORE logged, equal in AFTER (a figure AFTER adds, say a new
    one that the objective returns, is listed but moves nothing); `renamed`: {old name: new name} of figures whose
    name changed, compared under the new one."""
    same, renamed = True, renamed or {}
    for key in a:
        old = [{renamed.get(k, k): v for k, v in r.items()} for r in a[key]["records"]]
        new = b.get(key, {}).get("records", [])
        added = sorted({k for r in new for k in r} - {k for r in old for k in r})
        kept = [{k: v for k, v in r.items() if k not in added} for r in new]
        ok = key in b and a[key]["weights_sha256"] == b[key]["weights_sha256"] and old == kept
        last = [r for r in old if "eval/reward" in r][-1]
        shown = {k: round(v, 4) for k, v in last.items() if k in ("eval/shape_acc", "eval/all_acc", "eval/reward")}
        extra = f" (new figures: {', '.join(added)})" if added else ""
        print(f"{'same' if ok else 'DIFFERENT':9s} {a[key]['command']}: last evaluation {shown}{extra}")
        same &= ok
    return same


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="write the fingerprints here (JSON)")
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--only", nargs="*", default=list(METHODS), help=f"a subset of {list(METHODS)}")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    p.add_argument("--renamed", nargs="*", default=[], metavar="OLD=NEW", help="figures renamed between the two")
    a = p.parse_args()
    if a.compare:
        before, after = (json.loads(f.read_text()) for f in a.compare)
        sys.exit(0 if compare(before, after, dict(r.split("=", 1) for r in a.renamed)) else 1)
    if a.out is None:
        p.error("pass --out FILE or --compare BEFORE AFTER")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key in a.only:
            t0 = time.perf_counter()
            results[key] = fingerprint(key, METHODS[key][1], a.iterations, Path(tmp))
            print(f"{key}: {time.perf_counter() - t0:.0f} s, weights {results[key]['weights_sha256'][:12]}", flush=True)
    a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
