#!/usr/bin/env bash
# GPU smoke check (bench/gpu_smoke.py): a ~1B Llama in bf16 with torch.compile — tokens/s, MFU, peak
# memory, host syncs, recompute_layer, async-save stall, resume equality; then, unless --tiny, the full
# restore into device memory (bench/restore.py at 49.8 M and 154.5 M parameters) and the fused loss
# against the plain one (bench/loss.py). Under 10 minutes on one H200.
#
#   bash bench/gpu_wheels.sh          # here, once, with network: the missing pure-Python wheels into .whl/
#   bash bench/gpu_smoke.sh           # there: installs .whl/ if nanoflow's imports fail, then runs
#   bash bench/gpu_smoke.sh --tiny    # a tiny model on any machine (the suite runs this on CPU)
#
# Extra arguments go to bench/gpu_smoke.py (--steps, --warmup, --no-compile, --peak-tflops).
# PYTHON picks the interpreter (default python3: the lent machine's own, with its torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
imports="import attrs, cattrs, datasets, safetensors, xxhash, yaml, tqdm, numpy"
if ! "$PYTHON" -c "$imports" 2>/dev/null; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_smoke: missing packages ($imports failed) and no wheels in .whl/ (run bench/gpu_wheels.sh first)" >&2
        exit 2
    fi
    # --target + PYTHONPATH: beside the image's own packages, which stay as they are
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/nanoflow-site .whl/*.whl
    export PYTHONPATH=/tmp/nanoflow-site${PYTHONPATH:+:$PYTHONPATH}
    "$PYTHON" -c "$imports"
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$PYTHON" bench/gpu_smoke.py "$@"
case " $* " in *" --tiny "*) exit 0 ;; esac   # the CPU run of the suite checks gpu_smoke.py's code path only
echo "restore: weights + AdamW moments into device memory, nanoflow / torch.load + load_state_dict"
"$PYTHON" bench/restore.py --rounds 3
"$PYTHON" bench/restore.py --rounds 3 --hidden 1024 --intermediate 2816 --layers 12
if [ -f bench/loss.py ]; then
    echo "loss: fused linear cross-entropy against the plain and chunked losses (on the host CPU: bench/loss.py measures the resident set)"
    "$PYTHON" bench/loss.py --vocab 50304,128256 --threads 1 --rounds 3
fi
