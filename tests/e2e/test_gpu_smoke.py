"""bench/gpu_smoke.sh end to end on the CPU (--tiny): the script a lent GPU runs, so that its first run there
is not its first run."""

import os
import subprocess
import sys

import pytest
from helpers import REPO


@pytest.mark.slow   # five processes (two measurements, three loop runs): ≈ 25 s of CPU
def test_gpu_smoke_tiny_runs_end_to_end_and_prints_every_result_line():
    result = subprocess.run(["bash", "bench/gpu_smoke.sh", "--tiny", "--no-compile", "--steps", "2", "--warmup", "1"],
                            cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = {line.split()[1]: line for line in result.stdout.splitlines() if line.startswith("smoke: ")}
    assert list(lines) == ["device", "step", "recompute_layer", "async-save", "resume", "done"], result.stdout
    assert "tokens/s" in lines["step"] and "peak memory" in lines["step"] and "MFU" in lines["step"]
    assert "step time ×" in lines["recompute_layer"] and "peak memory ×" in lines["recompute_layer"]
    assert lines["async-save"].startswith("smoke: async-save stall ") and " s vs sync " in lines["async-save"]
    assert lines["resume"].startswith("smoke: resume equal:"), lines["resume"]
    total = lines["resume"].split(" tensors torch.equal")[0].split()[-1]   # "20/20"
    assert total.split("/")[0] == total.split("/")[1] != "0"
