"""bin/report: report.png is a PNG of the stated size and the per-stage table is metrics.jsonl's; TensorBoard
event files are written per stage when tensorboard is installed, and nothing happens without it."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import pytest
from helpers import tiny
from process_helpers import run_in_process

from nanoflow.commands.report import (
    HEIGHT,
    WIDTH,
    draw,
    format_summary,
    read_run_metadata,
    stage_spans,
    stage_summary,
    write_report,
)
from nanoflow.observe import tensorboard as nanoflow_tensorboard
from nanoflow.observe.metrics import MetricsError, read_metrics, step_seconds, tokens_per_second
from nanoflow.training.loop import train


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """schedules/tiny.toml trained to step 10 of 12 (pretrain 1–7, sft 8–12): the last stage is cut short."""
    run = tmp_path_factory.mktemp("report") / "run"
    train(tiny(run), until_step=10, out=io.StringIO())
    return run


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


def test_report_png_and_table_match_metrics(run):
    pytest.importorskip("matplotlib")
    path, rows = write_report(run)
    assert path == run / "report.png"
    assert png_size(path) == (WIDTH, HEIGHT)

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 11))
    assert [(r.name, r.first_step, r.last_step, r.steps) for r in rows] == [("pretrain", 1, 7, 7), ("sft", 8, 10, 3)]
    for row in rows:
        mine = [m for m in metrics if m["stage"] == row.name]
        assert row.tokens == sum(m["tokens"] for m in mine)
        assert (row.first_loss, row.last_loss) == (mine[0]["loss"], mine[-1]["loss"])
    assert rows[0].seconds == pytest.approx(metrics[6]["elapsed"])
    assert rows[1].seconds == pytest.approx(metrics[9]["elapsed"] - metrics[6]["elapsed"])

    table = format_summary(rows)
    assert table.splitlines()[0].split() == ["stage", "steps", "n", "steps", "tokens", "first", "loss", "last", "loss",
                                             "time", "tok/s"]
    assert f"{rows[0].tokens:,}" in table and f"{rows[1].last_loss:.4f}" in table and "1–7" in table
    assert f"total: 10 steps, {sum(m['tokens'] for m in metrics):,} tokens" in table


def test_stage_bands_come_from_the_checkpoint_when_there_is_one(run):
    metrics = read_metrics(run)
    spans = stage_spans(metrics, read_run_metadata(run))
    assert [(s.name, s.start, s.end, s.trained) for s in spans] == [("pretrain", 1, 7, True), ("sft", 8, 12, True)]
    assert [(s.name, s.start, s.end) for s in stage_spans(metrics, None)] == [("pretrain", 1, 7), ("sft", 8, 10)]
    metadata = {"config": {"tokens": {"train_steps": 20}, "data_stages": [
        {"name": "a", "start_training_step": 1}, {"name": "b", "start_training_step": 15}]}}
    assert [(s.name, s.end, s.trained) for s in stage_spans(metrics, metadata)] == [("a", 14, True), ("b", 20, False)]


def test_resumed_run_times_restart_the_clock(tmp_path):
    lines = [{"step": 1, "stage": "a", "loss": 3.0, "lr": 1.0, "tokens": 10, "elapsed": 2.0},
             {"step": 2, "stage": "a", "loss": 2.0, "lr": 1.0, "tokens": 10, "elapsed": 3.0},
             {"step": 3, "stage": "a", "loss": 1.5, "lr": 1.0, "tokens": 10, "elapsed": 0.5},   # a new process
             {"step": 4, "stage": "b", "loss": 1.0, "lr": 1.0, "tokens": 20, "elapsed": 1.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines) + '{"step": 5, "sta')
    rows = stage_summary(read_metrics(tmp_path))   # the line cut by a kill is skipped
    assert [(r.name, r.steps, r.tokens, r.seconds) for r in rows] == [("a", 3, 30, 3.5), ("b", 1, 20, 1.0)]


def test_missing_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(MetricsError, match="metrics.jsonl: no such file"):
        read_metrics(tmp_path)


def test_tensorboard_events_are_tagged_per_stage(run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert list(run.glob("events.out.tfevents.*"))   # in the run folder, beside metrics.jsonl
    events = EventAccumulator(str(run))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"pretrain/loss", "pretrain/lr", "sft/loss", "sft/grad_norm", "all/loss", "all/tokens_per_s",
            "all/mfu", "all/peak_memory_bytes"} <= tags
    assert [e.step for e in events.Scalars("pretrain/loss")] == list(range(1, 8))
    assert [e.step for e in events.Scalars("sft/loss")] == [8, 9, 10]
    metrics = read_metrics(run)
    assert [e.value for e in events.Scalars("all/loss")] == pytest.approx([m["loss"] for m in metrics])
    # tokens/s, MFU and peak memory: the values metrics.jsonl records (the progress line's), not computed again
    for key in ("tokens_per_s", "mfu", "peak_memory_bytes"):
        recorded = [m[key] for m in metrics if m.get(key) is not None]
        assert recorded and [e.value for e in events.Scalars(f"all/{key}")] == pytest.approx(recorded, rel=1e-6), key


def test_tensorboard_on_its_own_shows_each_step_s_own_tokens_per_second(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = [{"step": 1, "stage": "a", "loss": 2.0, "lr": 0.1, "grad_norm": 1.0, "tokens": 100, "elapsed": 0.5},
               {"step": 2, "stage": "a", "loss": 1.5, "lr": 0.1, "grad_norm": 1.0, "tokens": 100, "elapsed": 0.75}]
    with nanoflow_tensorboard.TensorBoardLog(tmp_path, 0) as log:
        for record in records:
            log.write(record)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    rates = [tokens_per_second(m["tokens"], seconds) for m, seconds in zip(records, step_seconds(records), strict=True)]
    assert [e.value for e in events.Scalars("a/tokens_per_s")] == pytest.approx(rates) == [200.0, 400.0]
    assert "a/mfu" not in events.Tags()["scalars"]


def test_tensorboard_is_a_no_op_without_the_package(tmp_path, monkeypatch):
    monkeypatch.setattr(nanoflow_tensorboard, "available", lambda: False)
    with nanoflow_tensorboard.TensorBoardLog(tmp_path, 0) as log:
        log.write({"step": 1, "stage": "a", "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "tokens": 8, "elapsed": 0.1})
    assert not list(tmp_path.iterdir())
    train(tiny(tmp_path / "run", "tokens.train_steps=1"), out=io.StringIO())
    assert (tmp_path / "run" / "metrics.jsonl").exists() and not list((tmp_path / "run").glob("events.*"))


@pytest.mark.slow
def test_the_accuracy_axis_says_exact_match_or_accuracy_as_the_eval_sets_are(run):
    pytest.importorskip("matplotlib")
    metrics = read_metrics(run)
    exact = [{"step": s, "dataset": "sums", "loss": 1.0, "accuracy": 0.5, "correct": 2} for s in (4, 8)]
    choice = [{"step": s, "dataset": "arc", "loss": 2.0, "accuracy": 0.25, "correct": 1, "accuracy_norm": 0.5,
               "correct_norm": 2, "examples": 4} for s in (4, 8)]   # a multiple_choice set's rows

    def labels(rows: list[dict]) -> tuple[str, list[str]]:
        figure = draw(metrics, stage_spans(metrics), eval_rows=rows)
        (accuracy_ax,) = figure.axes[4:]   # the eval panel's twin
        return accuracy_ax.get_ylabel(), [t.get_text() for t in figure.axes[3].get_legend().get_texts()]

    assert labels(exact) == ("exact match %", ["sums loss", "sums exact match"])
    assert labels(choice) == ("accuracy %", ["arc loss", "arc accuracy"])
    assert labels(exact + choice) == ("accuracy %", ["sums loss", "arc loss", "sums exact match", "arc accuracy"])


def test_cli_report(run, tmp_path, capsys):
    result = run_in_process("report", str(run), "--out", str(tmp_path / "r.png"), capsys=capsys)
    assert result.returncode == 0, result.stderr
    assert png_size(tmp_path / "r.png") == (WIDTH, HEIGHT)
    assert "pretrain" in result.stdout and "total: 10 steps" in result.stdout
    result = run_in_process("report", str(tmp_path / "none"), capsys=capsys)
    assert result.returncode == 2 and "no such file" in result.stderr
