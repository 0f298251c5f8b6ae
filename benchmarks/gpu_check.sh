#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py has what it measures): random weights at full size, bf16, LoRA r128,
# 2 iterations on one GPU, no internet. FLUX.1-dev at 512 px: dancegrpo.py, branchgrpo.py --pruning depth and
# vgrpo.py; Wan2.1-T2V-1.3B video at 480x832 x 9 frames: dancegrpo.py and branchgrpo.py --pruning depth.
#   bash benchmarks/gpu_check.sh [--out DIR]     # one H100 / H200-class GPU; stops itself after 8 minutes
#   bash benchmarks/gpu_check.sh --cases wan     # one case (flux or wan), e.g. to rerun within the time left
#   bash benchmarks/gpu_check.sh --tiny          # tiny models on the CPU: the harness only
# Needs the packages of requirements.txt; a GPU machine without diffusers, tyro or open_clip_torch gets them as
# wheels (docs/gpu.md, "The GPU check").
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python; fi
exec timeout "${GPU_CHECK_LIMIT_S:-480}" "$PY" benchmarks/gpu_check.py "$@"
