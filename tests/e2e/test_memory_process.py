"""Gradients under torchrun layouts equal the single-process plain path (tests/unit/test_memory.py holds the
in-process memory tests)."""

import subprocess
import sys

import pytest
import torch
from helpers import REPO
from memory_worker import batch, config_for, gradients
from safetensors.torch import load_file

from nanoflow.parallel.mesh import SINGLE


@pytest.mark.slow
@pytest.mark.parametrize("dp, tp, mode, variant, tied", [
    (2, 1, "ALL_REDUCE", "chunked", "tied"), (2, 1, "ALL_REDUCE", "recompute", "untied"),
    (1, 2, "ALL_REDUCE", "chunked", "untied"), (1, 2, "ALL_REDUCE", "recompute", "tied"),
    (1, 2, "REDUCE_SCATTER", "recompute", "tied"),
])
def test_gradients_under_torchrun_layouts_equal_the_single_process_plain_path(tmp_path, dp, tp, mode, variant, tied):
    out = tmp_path / "grads.safetensors"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(dp * tp),
         str(REPO / "tests" / "memory_worker.py"), str(out), str(dp), str(tp), mode, variant, tied],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    got = load_file(out)
    config = config_for(tied=tied == "tied")
    loss, reference = gradients(config, SINGLE, "plain", *batch(config))
    torch.testing.assert_close(got["loss"], loss, rtol=0, atol=1e-6)
    assert {k.removeprefix("grad.") for k in got if k != "loss"} == reference.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(got[f"grad.{name}"], grad, rtol=0, atol=1e-6, msg=name)
