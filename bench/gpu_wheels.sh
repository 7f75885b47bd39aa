#!/usr/bin/env bash
# Fetches into .whl/ the wheels bench/gpu_smoke.sh installs on a lent GPU machine whose image lacks them
# (its own torch 2.11, CUDA 13, transformers 5.17, Python 3.12; no cattrs, datasets or smart_open). Pure-Python
# wheels only, the versions this project is tested with; the image has their other needs (numpy, pyarrow,
# pandas, fsspec, huggingface-hub, xxhash, wrapt, …). .whl/ is git-ignored; the device tool carries it with
# carry=[".whl"] (64 MiB at most: these are ~3 MB). TORCH=1 also fetches torch and its CUDA libraries, for an
# image without torch: about 900 MB more, far beyond what the device tool carries, so only for a machine that
# can be given a folder that size by other means.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=(attrs==26.1.0 cattrs==26.2.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 smart_open==9.0.2)
mkdir -p .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
if [ "${TORCH:-0}" = 1 ]; then
    "$PYTHON" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "torch==2.11.*"
fi
ls -l .whl
