#!/usr/bin/env bash
# The GPU check's install, proved without a GPU: a Python 3.12 virtual environment with the versions of an offline
# CUDA image (torch 2.11.0, torchvision 0.26.0, transformers 5.17.0, huggingface_hub 1.33.0, accelerate 1.15.0, and
# the others such an image has; no diffusers, tyro, open_clip_torch or ftfy), plus the prepared wheels installed as
# the printed command installs them (--no-index --no-deps --target), then the check's rehearsal and the real-model and
# video tests in it. A benchmark, not part of CI (it downloads several GB once).
#   bash benchmarks/gpu/gpu_env_check.sh [VENV]      # default VENV: /tmp/gpu_image_env; needs python3.12 on PATH
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-/tmp/gpu_image_env}
PY312=${PY312:-$(command -v python3.12)}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY312" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # the image's versions where they are known, the others as pip resolves them; pytest to run the tests
    "$VENV/bin/python" -m pip install -q torch==2.11.0 torchvision==0.26.0 transformers==5.17.0 \
        huggingface_hub==1.33.0 accelerate==1.15.0 safetensors==0.8.0 tokenizers==0.23.2 peft timm tensorboard \
        matplotlib requests pyyaml psutil sentencepiece pytest pytest-xdist
fi
[ -f .whl/plan.json ] || bash benchmarks/gpu/gpu_check.sh --prepare
SITE=$(mktemp -d)
"$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
export PYTHONPATH=$SITE HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
print("versions:", ", ".join(f"{p} {m.version(p)}" for p in ("torch", "torchvision", "transformers", "huggingface_hub",
      "accelerate", "peft", "diffusers", "tyro", "open_clip_torch")))
PY
# the rehearsal runs both calls at tiny widths, scoring with HPSv2.1 (open_clip from the wheels), and writes its
# results and console to --results
PY="$VENV/bin/python" bash benchmarks/gpu/gpu_check.sh --rehearse --out "$SITE/check" --results "$SITE/results"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_real_models.py tests/test_video.py
echo "gpu_env_check: passed"
