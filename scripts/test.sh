#!/usr/bin/env bash
# Set up the environment (scripts/setup.sh) and run the CPU test suite, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# offline (a stray hub download fails fast), two workers with one thread each on a 2-core machine
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest tests -q -n 2 "$@"
