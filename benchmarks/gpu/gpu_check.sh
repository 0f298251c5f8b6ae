#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu/gpu_check.py has what it measures and how it differs from a user's run): every
# model kind's training step with random weights built on the GPU, in two calls of one lent GPU, no internet.
#   bash benchmarks/gpu/gpu_check.sh --prepare       # here, with the package index: the wheels in .whl/, the plan
#                                                # (benchmarks/gpu/gpu_plan.json), a rehearsal with the timing model's
#                                                # estimate of each call, and the two commands for the GPU node
#   bash benchmarks/gpu/gpu_check.sh --call 1 [--results DIR]   # 4 minutes at most: environment, attention probe, one
#                                                # iteration of each model kind's script
#   bash benchmarks/gpu/gpu_check.sh --call 2 [--results DIR]   # 6 minutes at most: the five scripts on FLUX.1-dev
#   bash benchmarks/gpu/gpu_check.sh --call 1 --cases qwen-image   # a rerun of some cases
#   bash benchmarks/gpu/gpu_check.sh --rehearse      # both calls on the CPU at tiny widths (the tests run it)
# docs/gpu.md, "The GPU check", has the commands, the plan and what was measured.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${PY:-}" ]; then PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python; fi
if [ "${1:-}" = "--prepare" ]; then
    # The packages of requirements.txt that a CUDA image with torch, transformers, accelerate, timm and requests
    # lacks, as wheels for CPython 3.12 on x86_64 Linux (all of them pure Python): benchmarks/gpu/gpu_wheels.txt
    rm -rf .whl && mkdir .whl
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl -r benchmarks/gpu/gpu_wheels.txt
    kib=$(du -sk .whl | cut -f1)
    [ "$kib" -le 16384 ] || { echo "error: the wheels take $((kib / 1024)) MiB, more than 16" >&2; exit 1; }
    echo "$(ls .whl/*.whl | wc -l) wheels, $((kib / 1024)).$(((kib % 1024) * 10 / 1024)) MiB in .whl/"
    # memory.py's plans and the FLOP counts of every case (entries still current are kept): CPU work kept off the
    # GPU's clock; then both calls rehearsed on the CPU, which prints the timing model's estimate of each
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PY" benchmarks/gpu/gpu_check.py --write-plan benchmarks/gpu/gpu_plan.json
    rehearsal=${TMPDIR:-/tmp}/gpu_check_rehearsal
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 "$PY" benchmarks/gpu/gpu_check.py --rehearse \
        --out "$rehearsal" >"$rehearsal.txt" 2>&1 || { echo "error: the rehearsal failed: $rehearsal.txt" >&2; exit 1; }
    grep -E '^(status|- call)' "$rehearsal.txt"
    echo "On the GPU node, from the repository's root with .whl/ copied along (RESULTS: where the figures go):"
    echo '  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl'
    echo '  PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PY=python3 bash benchmarks/gpu/gpu_check.sh --call 1 --results RESULTS/call1'
    echo '  PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PY=python3 bash benchmarks/gpu/gpu_check.sh --call 2 --results RESULTS/call2'
    exit 0
fi
# gpu_check.py keeps each call's own limit (--limit-s: 240 s for call 1, 360 s for call 2) and writes its results
# from the start; this outer limit only ends a hang of the harness itself (SIGTERM, which gpu_check.py records, then
# SIGKILL 30 s later): the call's limit and a minute for the start-up. With --results DIR, everything the check prints
# (stdout and stderr, each still to its own stream) also goes to DIR/console.txt, so that what gpu_check.py cannot
# record itself (an import that fails, a crash, a kill) is there too; if it ends without having written
# DIR/gpu_check.json, a gpu_check.json saying so is written.
results=""
call=""
prev=""
for arg in "$@"; do
    case "$arg" in --results=*) results=${arg#--results=} ;; --call=*) call=${arg#--call=} ;; esac
    [ "$prev" = "--results" ] && results=$arg
    [ "$prev" = "--call" ] && call=$arg
    prev=$arg
done
case "$call" in 1) outer=300 ;; 2) outer=420 ;; *) outer=900 ;; esac
limit=(timeout -k 30 "${GPU_CHECK_LIMIT_S:-$outer}")
if [ -z "$results" ]; then
    exec "${limit[@]}" "$PY" benchmarks/gpu/gpu_check.py "$@"
fi
mkdir -p "$results"
rm -f "$results/gpu_check.json"  # not an earlier check's
console="$results/console.txt"
: >"$console"
rc_file=$(mktemp)
# stdout and stderr each to its own stream and both to the console file; the pipelines wait for their tee's
{ { set +e; "${limit[@]}" "$PY" benchmarks/gpu/gpu_check.py "$@"; echo $? >"$rc_file"; } 2>&1 1>&3 3>&- |
    tee -a "$console" >&2; } 3>&1 | tee -a "$console"
rc=$(cat "$rc_file")
rm -f "$rc_file"
if [ "$rc" != 0 ] && [ ! -f "$results/gpu_check.json" ]; then
    printf '{"status": "gpu_check.py ended with exit status %s before it wrote any results: see console.txt"}\n' \
        "$rc" >"$results/gpu_check.json"
fi
exit "$rc"
