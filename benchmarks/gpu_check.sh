#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py has what it measures): random weights at full size, bf16, LoRA r128,
# 2 iterations on one GPU, no internet. FLUX.1-dev at 512 px: dancegrpo.py, branchgrpo.py --pruning depth and
# vgrpo.py; Wan2.1-T2V-1.3B video at 480x832 x 9 frames: dancegrpo.py and branchgrpo.py --pruning depth.
#   bash benchmarks/gpu_check.sh --prepare       # here, with the package index: .whl/ (wheels + memory plans), and
#                                                # it prints the one command to run on an offline GPU node
#   bash benchmarks/gpu_check.sh [--out DIR] [--results DIR]   # one H100 / H200-class GPU; 8 minutes at most
#   bash benchmarks/gpu_check.sh --cases wan     # one case (flux or wan), e.g. to rerun within the time left
#   bash benchmarks/gpu_check.sh --cases none --models qwen-image   # new model kinds (qwen-image, flux2-klein,
#                                                # wan22-5b): dancegrpo.py each, after --cases (none: only these);
#                                                # Qwen-Image needs 58 GB free under --out
#   bash benchmarks/gpu_check.sh --tiny          # tiny models on the CPU: the harness only
# docs/gpu.md, "The GPU check", has the command, the wheels and the time budget.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python; fi
if [ "${1:-}" = "--prepare" ]; then
    # The packages of requirements.txt that a CUDA image with torch, transformers, accelerate, timm and requests
    # lacks, as wheels for CPython 3.12 on x86_64 Linux (all of them pure Python): benchmarks/gpu_wheels.txt
    rm -rf .whl && mkdir .whl
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl -r benchmarks/gpu_wheels.txt
    kib=$(du -sk .whl | cut -f1)
    [ "$kib" -le 16384 ] || { echo "error: the wheels take $((kib / 1024)) MiB, more than 16" >&2; exit 1; }
    "$PY" benchmarks/gpu_check.py --write-plan .whl/plan.json  # memory.py's plans: CPU work kept off the GPU's clock
    echo "$(ls .whl/*.whl | wc -l) wheels, $((kib / 1024)).$(((kib % 1024) * 10 / 1024)) MiB, and the memory plans in .whl/"
    echo "On the GPU node, from the repository's root with .whl/ copied along (RESULTS: where the figures go):"
    echo '  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PY=python3 bash benchmarks/gpu_check.sh --plan .whl/plan.json --results RESULTS'
    echo "(plan.json has every case: add --cases none --models qwen-image, or flux2-klein,wan22-5b, for the new kinds)"
    exit 0
fi
# gpu_check.py keeps its own limit (--limit-s, 480 s after the plans and the disk check), records a script that
# overruns and writes its results from the start; this outer limit only ends a hang of the harness itself (SIGTERM,
# which gpu_check.py records, then SIGKILL 30 s later). With --results DIR, everything the check prints (stdout and
# stderr, each still to its own stream) also goes to DIR/console.txt, so that what gpu_check.py cannot record itself
# (an import that fails, a crash, a kill) is there too; if it ends without having written DIR/gpu_check.json, a
# gpu_check.json saying so is written.
results=""
prev=""
for arg in "$@"; do
    case "$arg" in --results=*) results=${arg#--results=} ;; esac
    [ "$prev" = "--results" ] && results=$arg
    prev=$arg
done
limit=(timeout -k 30 "${GPU_CHECK_LIMIT_S:-900}")
if [ -z "$results" ]; then
    exec "${limit[@]}" "$PY" benchmarks/gpu_check.py "$@"
fi
mkdir -p "$results"
rm -f "$results/gpu_check.json"  # not an earlier check's
console="$results/console.txt"
: >"$console"
rc_file=$(mktemp)
# stdout and stderr each to its own stream and both to the console file; the pipelines wait for their tee's
{ { set +e; "${limit[@]}" "$PY" benchmarks/gpu_check.py "$@"; echo $? >"$rc_file"; } 2>&1 1>&3 3>&- |
    tee -a "$console" >&2; } 3>&1 | tee -a "$console"
rc=$(cat "$rc_file")
rm -f "$rc_file"
if [ "$rc" != 0 ] && [ ! -f "$results/gpu_check.json" ]; then
    printf '{"status": "gpu_check.py ended with exit status %s before it wrote any results: see console.txt"}\n' \
        "$rc" >"$results/gpu_check.json"
fi
exit "$rc"
