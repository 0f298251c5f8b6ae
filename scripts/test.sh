#!/usr/bin/env bash
# Set up the environment (scripts/setup.sh) and run the CPU test suite, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest tests -q "$@"
