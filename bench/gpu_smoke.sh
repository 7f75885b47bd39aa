#!/usr/bin/env bash
# GPU smoke check (bench/gpu_smoke.py): nanoflow against a bare loop and transformers on a 1B Llama in bf16 at
# sequence 4096 and vocabulary 128,256, a world-of-1 FSDP2 step, save/resume equality with fused AdamW, a
# deterministic pair, and the async-save stall; one JSON file of results under $OUT. Under 8 minutes on one H200.
#
#   bash bench/gpu_wheels.sh          # here, once, with network: the wheels the lent machine's image lacks, into .whl/
#   bash bench/gpu_smoke.sh           # there: installs from .whl/ whatever does not import, then runs
#   bash bench/gpu_smoke.sh --tiny    # every section at tiny sizes on any machine (CI runs it on a CPU)
#
# Extra arguments go to bench/gpu_smoke.py (--steps, --warmup, --budget, --only, --peak-tflops).
# PYTHON picks the interpreter (default python3: the lent machine's own, with its torch). OUT (the device tool
# sets it) is where gpu_smoke.json goes; unset: runs/gpu-smoke here.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export OUT=${OUT:-$PWD/runs/gpu-smoke}
site=/tmp/nanoflow-site

install() {   # the carried wheels, beside the image's own packages (--target + PYTHONPATH), which stay as they are
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_smoke: $1 does not import and there are no wheels in .whl/ (run bench/gpu_wheels.sh first)" >&2
        exit 2
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
}

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    install torch   # only when gpu_wheels.sh fetched a torch wheel too (TORCH=1: about 900 MB with its CUDA libraries)
fi
imports="import attrs, cattrs, datasets, safetensors, xxhash, yaml, tqdm, numpy"
if ! "$PYTHON" -c "$imports" 2>/dev/null; then
    [ -d "$site" ] || install "nanoflow's dependencies ($imports)"
    "$PYTHON" -c "$imports"
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
exec "$PYTHON" bench/gpu_smoke.py "$@"
