"""bin/eval and evaluation under bin/train, kill -9 and torchrun (tests/unit/test_evaluation.py: in-process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, TINY
from process_helpers import PYTHON, TORCHRUN, bin_command, run_command, signal_when_ready
from support.evaluation import rows_of, write_run


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
            "OMP_NUM_THREADS": "1"}


def train_process(config: Path, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_command("train", str(config), *extra, env=env(), timeout=timeout)


def eval_process(*args: str, launcher=(PYTHON,), timeout: float = 600) -> subprocess.CompletedProcess:
    return run_command("eval", *args, launcher=launcher, env=env(), timeout=timeout)


UNEVEN_SCORE = """
import json, sys
import torch
import torch.nn.functional as F
from nanoflow.build import build_model
from nanoflow.config import load_config
from nanoflow.data.sources import IGNORE_INDEX
from nanoflow.evaluation import EvalSet, score
from nanoflow.parallel.mesh import init_topology

config = load_config(sys.argv[1], [f"parallelism.dp={sys.argv[2]}", "model.num_hidden_layers=1"])
topology = init_topology(config)
model = build_model(config, topology)
ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(3))
labels = torch.full_like(ids, IGNORE_INDEX)
labels[:2, 1:] = ids[:2, 1:]   # rank 0's rows (of dp = 2): 23 targets each
labels[2:, -1] = ids[2:, -1]   # rank 1's rows: one target each, like a short answer
result = score(model, EvalSet("uneven", "loss", ids, labels, micro_batch_size=2), topology)
if topology.dp == 1:   # what a mean of the per-batch (per-rank) means would say instead
    with torch.inference_mode():
        per_batch = [F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX).item()
                     for x, y in zip(ids.split(2), labels.split(2))]
    result["mean_of_batch_means"] = sum(per_batch) / len(per_batch)
if topology.is_main:
    print("RESULT", json.dumps(result))
# leave as nanoflow's commands do: a gloo worker left to the interpreter's teardown can abort (parallel.exit_process)
from nanoflow.parallel.mesh import exit_process, shutdown
shutdown()
exit_process(0)
"""

@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of 8 steps evaluated at every step; checkpoints at 3, 6 and 8."""
    folder = tmp_path_factory.mktemp("reference")
    config = write_run(folder, steps=8, sft_start=6, interval=1)
    result = train_process(config)
    assert result.returncode == 0, result.stderr
    return folder, config


def test_eval_rows_are_identical_across_a_kill_9_and_a_resume(reference, tmp_path):
    folder, _ = reference
    config = write_run(tmp_path, steps=8, sft_start=6, interval=1)
    log = tmp_path / "run" / "eval.jsonl"

    def rows_done() -> list[int]:
        return [json.loads(line)["step"] for line in log.read_text().splitlines()[:-1]] if log.exists() else []

    def past_step_4(_process):
        return any(step >= 5 for step in rows_done())

    def rows_past_the_commit(_process):   # checked while the process is frozen: no save can land in between
        latest = tmp_path / "run" / "latest.txt"
        return latest.exists() and max(rows_done()) > int(latest.read_text())

    code, _, _ = signal_when_ready(bin_command("train", str(config)), past_step_4, signal.SIGKILL, cwd=REPO,
                                   env=env(), timeout=600, confirm=rows_past_the_commit)
    assert code == -signal.SIGKILL
    committed = int((tmp_path / "run" / "latest.txt").read_text())
    assert max(json.loads(line)["step"] for line in log.read_text().splitlines()[:-1]) > committed  # rows to drop
    result = train_process(config)
    assert result.returncode == 0, result.stderr
    assert rows_of(log) == rows_of(folder / "run" / "eval.jsonl")   # the same floats, and no row twice


def test_bin_eval_on_a_run_folder_and_a_step_folder_prints_the_rows_training_wrote(reference):
    folder, config = reference
    written = rows_of(folder / "run" / "eval.jsonl")
    result = eval_process(str(folder / "run"))   # the latest checkpoint, on the config it recorded
    assert result.returncode == 0, result.stderr
    assert list(map(json.loads, result.stdout.splitlines())) == [r for r in written if r["step"] == 8]
    result = eval_process(str(folder / "run" / "3"), str(config))
    assert result.returncode == 0, result.stderr
    assert list(map(json.loads, result.stdout.splitlines())) == [r for r in written if r["step"] == 3]


def test_bin_eval_errors_are_clean_exit_2(reference, tmp_path):
    folder, config = reference
    (tmp_path / "empty").mkdir()
    result = eval_process(str(tmp_path / "empty"))
    assert result.returncode == 2 and "no intact committed checkpoint" in result.stderr
    assert "Traceback" not in result.stderr
    result = eval_process(str(folder / "run"), "--set", "evaluation.intervall=2")
    assert result.returncode == 2 and "intervall" in result.stderr and "Traceback" not in result.stderr
    result = eval_process(str(folder / "run"), str(config), "--set", "evaluation.datasets.sums.metric=bleu")
    assert result.returncode == 2 and "metric" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("2", "1"), ("1", "2")])
def test_bin_eval_under_torchrun_gives_the_single_process_rows(reference, layout):
    folder, _ = reference
    dp, tp = layout
    single = [r for r in rows_of(folder / "run" / "eval.jsonl") if r["step"] == 8]
    result = eval_process(str(folder / "run"), "--set", f"parallelism.dp={dp}", "--set", f"parallelism.tp={tp}",
                          launcher=(*TORCHRUN, "--nproc_per_node", "2"), timeout=600)
    assert result.returncode == 0, result.stderr
    rows = list(map(json.loads, result.stdout.splitlines()))
    assert [(r["dataset"], r["tokens"], r.get("correct")) for r in rows] == \
        [(r["dataset"], r["tokens"], r.get("correct")) for r in single]
    for row, expected in zip(rows, single, strict=True):
        assert row["loss"] == pytest.approx(expected["loss"], abs=1e-5)


@pytest.mark.slow
def test_evaluation_over_two_data_parallel_ranks_weighs_every_token_once(tmp_path):
    # torchtitan #4167: averaging the ranks' (or the batches') own means weighs a token of a short batch more.
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN_SCORE)

    def scored(dp: int, launcher) -> dict:
        result = subprocess.run([*launcher, str(script), str(TINY), str(dp)], cwd=tmp_path, env=env(),
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        return json.loads(result.stdout.split("RESULT ", 1)[1].splitlines()[0])

    one = scored(1, (PYTHON,))
    two = scored(2, (*TORCHRUN, "--nproc_per_node", "2"))
    assert one["tokens"] == two["tokens"] == 2 * 23 + 2
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-5)
    assert abs(one["mean_of_batch_means"] - one["loss"]) > 0.01, one   # the case tells the two averages apart
