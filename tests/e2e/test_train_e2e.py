"""bin/train end to end, as a real subprocess: stage switching, --plan, bad configs, unreached stages, Ctrl-C.

Every run writes into pytest's tmp_path (checkpoints.checkpoints_path is overridden), never into the repository.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, SMALL_MODEL_TOML
from helpers import TINY as TINY_FILE
from process_helpers import bin_command, run_command, signal_when_ready

from nanoflow import load_config
from nanoflow.schedule import Schedule, consumed_tokens, stage_steps

TINY = str(TINY_FILE.relative_to(REPO))   # as typed at the repository root, where bin/* run here

pytestmark = pytest.mark.slow


def run_arg(tmp_path: Path) -> list[str]:
    """--set checkpoints.checkpoints_path="<tmp_path>/run": the value is TOML, so it is quoted (json quoting is valid TOML)."""
    return ["--set", f"checkpoints.checkpoints_path={json.dumps(str(tmp_path / 'run'))}"]


def train(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_command("train", *args, timeout=timeout)


def read_metrics(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line]


def test_tiny_trains_both_stages_and_switches_sequence_length(tmp_path):
    config = load_config(REPO / TINY)
    schedule = Schedule.from_config(config)
    pretrain, sft = schedule.stages
    sft_start = config.data_stages[1].start_training_step
    assert (pretrain.name, sft.name) == ("pretrain", "sft")
    assert pretrain.sequence_length != sft.sequence_length  # the run must switch sequence length

    result = train(TINY, *run_arg(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert '"pretrain"' in result.stdout and '"sft"' in result.stdout

    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == list(range(1, schedule.train_steps + 1))
    for m in metrics:
        assert {"step", "stage", "loss", "lr", "grad_norm", "tokens", "elapsed"} <= m.keys()
        stage = pretrain if m["step"] < sft_start else sft
        assert m["stage"] == stage.name, m
        assert m["tokens"] == stage.global_batch_size * stage.sequence_length, m
    assert {m["stage"] for m in metrics} == {"pretrain", "sft"}
    assert [m["tokens"] for m in metrics[:2]] == [4 * 32] * 2 and metrics[-1]["tokens"] == 8 * 24


def test_plan_prints_the_table_and_trains_nothing(tmp_path):
    config = load_config(REPO / TINY)
    schedule = Schedule.from_config(config)
    total = sum(consumed_tokens(schedule, schedule.train_steps))

    result = train(TINY, "--plan", *run_arg(tmp_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for i, stage in enumerate(schedule.stages):
        steps = stage_steps(schedule, i)
        assert stage.name in out
        assert f"{steps[0]}–{steps[-1]}" in out
    assert "1–7" in out and "8–12" in out
    assert f"{total:,} tokens" in out
    assert not (tmp_path / "run").exists()


def _bad_data_config(tmp_path: Path, pattern: str = "no_such_dir/*.txt") -> Path:
    path = tmp_path / "bad.toml"
    path.write_text(f"""\
{SMALL_MODEL_TOML}
[tokens]
sequence_length = 16
train_steps = 2
micro_batch_size = 2

[optimizer.learning_rate_scheduler]
learning_rate = 1e-3

[checkpoints]
checkpoints_path = {json.dumps(str(tmp_path / "run"))}

[[data_stages]]
name = "pretrain"
start_training_step = 1
[data_stages.data.dataset]
hf_dataset_or_datasets = "text"
hf_data_files = "{pattern}"
""")
    return path


@pytest.mark.parametrize("case", ["misspelt-key", "seq-too-long", "missing-file", "no-data-files", "no-regular-files"])
def test_bad_config_exits_2_with_a_message_naming_the_culprit(tmp_path, case):
    if case == "misspelt-key":
        args, culprits = [TINY, "--set", "tokens.trian_steps=10"], ["trian_steps", "train_steps"]
    elif case == "seq-too-long":
        args, culprits = [TINY, "--set", "data_stages.sft.sequence_length=100"], ["sft", "sequence_length",
                                                                                  "max_position_embeddings"]
    elif case == "missing-file":
        args, culprits = ["schedules/no_such_config.toml"], ["no_such_config.toml"]
    elif case == "no-data-files":
        args, culprits = [str(_bad_data_config(tmp_path))], ["bad.toml", "pretrain", "hf_data_files",
                                                             "no_such_dir/*.txt", "matches no file"]
    else:  # what the glob matches is a folder and a named pipe: nothing a stage could read
        (tmp_path / "corpus" / "chapter.txt").mkdir(parents=True)
        os.mkfifo(tmp_path / "corpus" / "pipe.txt")
        args, culprits = [str(_bad_data_config(tmp_path, "corpus/*.txt"))], [
            "bad.toml", "pretrain", "hf_data_files", "corpus/*.txt", "matches no file, only folders"]
    result = train(*args, *run_arg(tmp_path))
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    assert "error:" in result.stderr
    for culprit in culprits:
        assert culprit in result.stderr, (culprit, result.stderr)
    assert not (tmp_path / "run").exists()


def test_stage_after_train_steps_is_not_reached(tmp_path):
    late = ["--set", "data_stages.sft.start_training_step=50"]
    train_steps = load_config(REPO / TINY).tokens.train_steps

    plan = train(TINY, "--plan", *late, *run_arg(tmp_path))
    assert plan.returncode == 0, plan.stderr
    sft_line = next(line for line in plan.stdout.splitlines() if line.startswith("sft"))
    assert "not reached" in sft_line

    result = train(TINY, *late, *run_arg(tmp_path))
    assert result.returncode == 0, result.stderr
    warning = next(line for line in result.stdout.splitlines() if "warning" in line)
    assert "sft" in warning and "not reached" in warning
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == list(range(1, train_steps + 1))
    assert {m["stage"] for m in metrics} == {"pretrain"}


def test_sigint_stops_cleanly_after_the_current_step(tmp_path):
    metrics_path = tmp_path / "run" / "metrics.jsonl"
    command = bin_command("train", TINY, "--set", "tokens.train_steps=400",
               "--set", "data_stages.sft.start_training_step=500", "--set", "logging.iteration_step_info_interval=1",
               *run_arg(tmp_path))
    returncode, stdout, stderr = signal_when_ready(
        command, lambda _: metrics_path.exists() and len(metrics_path.read_text().splitlines()) >= 3, signal.SIGINT,
        cwd=REPO)
    assert returncode == 75, stderr   # EXIT_STOPPED: saved, not finished; a finished run exits 0
    assert "Traceback" not in stderr
    assert "stopped" in stdout and "SIGINT" in stdout
    steps = [json.loads(line)["step"] for line in metrics_path.read_text().splitlines() if line]
    assert steps == list(range(1, len(steps) + 1))
    assert 3 <= len(steps) < 400


def test_a_second_ctrl_c_stops_at_once_with_a_message_not_a_traceback(tmp_path, monkeypatch, capsys):
    from nanoflow.commands import cli
    from nanoflow.training import loop
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # what StopRequest raises on a second SIGINT, wherever the loop is

    monkeypatch.setattr(loop, "open_training", interrupted)
    assert cli.train_main([str(TINY), *run_arg(tmp_path)]) == 130
    assert "interrupted: stopped at once" in capsys.readouterr().err
