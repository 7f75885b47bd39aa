"""Multiple-choice eval sets under torchrun (dp = 2, tp = 2: the single process's rows) and bin/eval --lm-eval as a
command: lm-eval's acc and acc_norm equal the in-loop rows; a missing package or task is one line and exit 2."""

from __future__ import annotations

import json
import os

import pytest
from helpers import REPO
from process_helpers import TORCHRUN, run_command
from support.choices import write_choice_run, write_task
from support.evaluation import rows_of


def env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
            "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4-step run scored on the multiple-choice rows at steps 2 and 4."""
    folder = tmp_path_factory.mktemp("choices")
    config = write_choice_run(folder)
    result = run_command("train", str(config), env=env(), timeout=600)
    assert result.returncode == 0, result.stderr
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("2", "1"), ("1", "2")])
def test_bin_eval_under_torchrun_gives_the_single_process_rows(trained, layout):
    dp, tp = layout
    single = rows_of(trained / "run" / "eval.jsonl")[-1]
    result = run_command("eval", str(trained / "run"), "--set", f"parallelism.dp={dp}", "--set",
                         f"parallelism.tp={tp}", launcher=(*TORCHRUN, "--nproc_per_node", "2"), env=env(),
                         timeout=600)
    assert result.returncode == 0, result.stderr
    (row,) = map(json.loads, result.stdout.splitlines())
    counts = ("dataset", "tokens", "correct", "correct_norm", "examples", "data_fingerprint")
    assert {k: row[k] for k in counts} == {k: single[k] for k in counts}
    assert row["loss"] == pytest.approx(single["loss"], abs=1e-5)


@pytest.mark.slow
def test_bin_eval_lm_eval_prints_the_in_loop_acc_and_acc_norm(trained):
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    single = rows_of(trained / "run" / "eval.jsonl")[-1]
    result = run_command("eval", str(trained / "run"), "--lm-eval", str(write_task(trained)), env=env(), timeout=600)
    assert result.returncode == 0, result.stderr
    (row,) = map(json.loads, result.stdout.splitlines())   # the rows alone on stdout
    assert (row["task"], row["step"], row["samples"]) == ("nanoflow_choices", 4, single["examples"])
    assert (row["acc"], row["acc_norm"]) == (single["accuracy"], single["accuracy_norm"])


@pytest.mark.slow
def test_bin_eval_lm_eval_without_the_package_is_one_line_and_exit_2_before_any_work(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "lm_eval.py").write_text('raise ImportError("lm_eval hidden for this test")\n')
    # A checkpoint that does not exist: the package is checked first, so the message is about the package
    result = run_command("eval", str(tmp_path / "no-run"), "--lm-eval", "hellaswag",
                         env=env(PYTHONPATH=os.pathsep.join((str(shim), str(REPO)))), timeout=600)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stdout == ""
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("error: bin/eval --lm-eval needs 'lm-eval[hf]', which is not installed: pip install "
                           "'.[lm-eval]'"), line


@pytest.mark.slow
def test_bin_eval_lm_eval_refuses_an_unknown_task_and_a_config(tmp_path, trained):
    pytest.importorskip("lm_eval")
    result = run_command("eval", str(tmp_path / "no-run"), "--lm-eval", "no_such_task_anywhere", env=env(),
                         timeout=600)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no_such_task_anywhere" in result.stderr and "Tasks not found" in result.stderr
    result = run_command("eval", str(trained / "run"), str(trained / "run.toml"), "--lm-eval", "x", env=env())
    assert result.returncode == 2 and "a CONFIG or --set has nothing to change" in result.stderr

