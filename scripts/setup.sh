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
# Test-only: HPSv3's own code, which tests/test_hpsv3.py scores against ours. Its requirements (deepspeed, trl, fire,
# omegaconf, pandas, datasets, qwen-vl-utils, ...) are for training; the test reads just its model, input and constant
# definitions from its files and runs them, so nothing else it lists is needed (and its trainer module, written for
# transformers 4, does not import under transformers 5).
.venv/bin/python -m pip install -q --no-deps hpsv3==1.0.0
