#!/usr/bin/env bash
# GPU smoke benchmark: a ~1B-parameter Llama with bf16 and torch.compile for a few steps; prints
# tokens/s and MFU. For a machine with a CUDA GPU and the project installed (README Quickstart,
# with a CUDA build of torch). Extra arguments go to bench/gpu_smoke.py (--steps, --no-compile, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec python bench/gpu_smoke.py "$@"
