"""Every bench/ script runs as committed, in its smallest setting (`--smoke`), and prints the ratio lines it
promises.

Only that each number is printed and finite is asserted, never its value: these are timings on tiny
shapes, which mean nothing. bench/gpu_smoke.py's CPU path (--tiny) is run by tests/e2e/test_gpu_smoke.py;
here, that it refuses the 1B check without a GPU.
"""

import math
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO

BENCH = REPO / "bench"
N = r"(-?[0-9][0-9,]*(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?)"   # a printed number, captured

# script: (extra arguments beside --smoke, [the lines its output must hold, each number captured])
SMALLEST = {
    "async_save.py": ([], [rf"async / sync = {N} \(target"]),
    "checkpoint_io.py": ([], [rf"save ≤ 1\.5× torch\.save: {N} .*load ≤ 1\.2× torch\.load: {N}"]),
    "dataloader.py": ([], [rf"8 × 256: .*loader / bare = {N}", rf"32 × 2048: .*loader / bare = {N}",
                           rf"= {N}× what train_step consumes", rf"seek ratio worst {N}"]),
    "evaluation.py": ([], [rf"eval / train = {N}", rf"= {N} % of the wall time", rf"chunked / whole = {N} .* = {N}"]),
    "loop_overhead.py": ([], [rf"loop / train_step alone: {N}"]),
    "memory.py": ([], [rf"worst run: peak − baseline = {N} MB = {N} × state"]),
    "peers.py": (["--here", "--peers", "hf"], [rf"hf \(transformers [^)]+\): .*tokens/s ÷ nanoflow's = {N}; "
                                               rf"losses agree: max \|Δ\| {N} .*nanoflow's CPU s ÷ this = {N}", r"torchtitan: not run: .*CPU"]),
    "profile_step.py": ([], [rf"{N} ms per loop iteration under torch\.profiler", rf"the floor .*: {N} ms"]),
    "restore.py": ([], [rf"nanoflow / torch: {N}"]),
    "resume.py": ([], [rf"late / early {N} \(median of paired rounds {N}"]),
    "scaling.py": ([], [rf"\| 2 \| {N} \| {N} \| {N}% \|"]),
    "step_overhead.py": ([], [rf"\| eager \| torch [^|]+\| {N} \| {N} \| {N} \|"]),
    "loss.py": ([], [rf"\| 1 \| 2,048 \| {N} \| {N} \| {N} \| {N} \| {N} "]),
    "average.py": ([], [rf"peak {N} MB above it = {N} × one model"]),
    "sft_packing.py": ([], [rf"\| packed \| 256 \| 8 \| {N} \| {N}% \| {N} \| {N} \| {N} \|",
                            rf"best packed / one a row = {N}"]),
    "cpu_peak.py": ([], [rf"wall / cpu time = {N}"]),
    "document_masking.py": ([], [rf"\| 256 \| 64 \| 2 \| {N} \| {N} \| {N} \| {N} \|",
                                 rf"the worst cell: time {N}×, peak memory {N}×"]),
    "layouts.py": ([], [rf"resumed on dp1: weights {N}, moments {N}, loss {N} from one process's run; weights {N} "
                        rf"from dp1's own", rf"resumed on dp2: .* weights {N} from dp2's own"]),
    "threads.py": ([], [rf"busy \+0: .*; two / one = {N}, choice / one = {N}"]),
    "tp_head.py": ([], [rf"head \+ loss / step = {N} of the CPU time \(FLOPs say {N}\)",
                        rf"\| 2 \| {N} \| {N} \| {N} \| {N} \|"]),
}


def test_every_bench_script_is_covered():
    scripts = {p.name for p in BENCH.glob("*.py")} - {"benchlib.py", "peer_steps.py", "gpu_smoke.py"}
    assert scripts <= set(SMALLEST), f"bench/ scripts without a smoke run here: {sorted(scripts - set(SMALLEST))}"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMALLEST))
def test_bench_script_runs_in_its_smallest_setting(script, tmp_path):
    arguments, lines = SMALLEST[script]
    env = {**os.environ, "TMPDIR": str(tmp_path), "NANOFLOW_PEERS_CACHE": str(tmp_path / "peers")}
    if script in ("checkpoint_io.py", "restore.py"):   # they write under --dir, /tmp by default
        arguments = [*arguments, "--dir", str(tmp_path)]
    done = subprocess.run([sys.executable, str(BENCH / script), "--smoke", *arguments], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1500)  # seconds when idle; minutes on loaded cores
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for line in lines:
        found = re.search(line, done.stdout)
        assert found, f"no line matching {line!r} in:\n{done.stdout[-3000:]}"
        for number in found.groups():
            assert math.isfinite(float(number.replace(",", ""))), found.group(0)


@pytest.mark.slow
def test_gpu_smoke_without_a_gpu_says_so_and_exits_2(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "gpu_smoke.py")], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=600)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA device here" in done.stderr and "--tiny" in done.stderr
    assert "Traceback" not in done.stderr and "smoke: " not in done.stdout
