"""bench/gpu_smoke.sh end to end on the CPU (--tiny): the script a lent GPU runs, every section of it at tiny sizes,
so that its first run there is not its first run. Its one JSON file holds every section's results."""

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO


@pytest.mark.slow   # the three sides, a world-of-1 FSDP2 step, six training processes, three saves: ≈ 70 s of CPU
def test_gpu_smoke_tiny_runs_every_section_and_writes_one_json_file(tmp_path):
    result = subprocess.run(["bash", "bench/gpu_smoke.sh", "--tiny", "--steps", "2", "--warmup", "1"],
                            cwd=REPO, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
                                 "OUT": str(tmp_path), "SMOKE_SCRATCH": str(tmp_path)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["gpu_smoke.json"]   # scratch folders removed
    results = json.loads((tmp_path / "gpu_smoke.json").read_text())
    assert results["tiny"] and results["machine"]["device"] == "cpu"
    assert results["machine"]["attention"].startswith("flash_attention (bfloat16")
    sections = results["sections"]
    assert list(sections) == ["compare", "fsdp", "resume", "async_save"]
    assert not any("error" in s or "skipped" in s for s in sections.values()), sections

    compare = sections["compare"]
    assert list(compare["sides"]) == ["nanoflow", "bare", "transformers"]
    for side in compare["sides"].values():
        assert side["tokens_per_s"] > 0 and side["host_syncs"] is None   # syncs are counted on CUDA only
    # the same initial weights and batch: the first step's loss agrees across the three (bf16 autocast)
    losses = [side["first_loss"] for side in compare["sides"].values()]
    assert max(losses) - min(losses) < 1e-2, losses
    assert compare["nanoflow_over_bare"] > 0 and compare["nanoflow_over_transformers"] > 0

    fsdp = sections["fsdp"]
    assert fsdp["ok"] and fsdp["grad_scale_dtype"] == "float32" and fsdp["adamw_step"] == "cpu float32"

    resume = sections["resume"]
    assert resume["resume_equal"] and resume["deterministic_equal"] and resume["tensors"] > 0
    assert resume["fused_adamw"] and resume["deterministic"]

    saves = sections["async_save"]
    assert set(saves["lost_s"]) == {"sync", "async_first", "async"} and saves["bytes"] > 0
    lines = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("smoke: ")]
    assert lines[0] == "device" and lines[-1] == "done"
