#!/usr/bin/env bash
# Create .venv in the repository root (if missing) and install the pinned requirements into it.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
# Test-only: ImageReward's own code, which tests/test_imagereward.py scores against ours. Its requirements (timm
# 0.6.13 and fairscale 0.4.13 pinned, datasets) do not resolve next to the set above, and its model code, written for
# transformers 4, needs none of them (the test puts back the few transformers 4 helpers it imports).
.venv/bin/python -m pip install -q --no-deps image-reward==1.5
