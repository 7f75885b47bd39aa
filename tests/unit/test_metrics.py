"""metrics.jsonl is written and read in one module (nanoflow/observe/metrics.py), and tokens/s is one definition that the
progress line, TensorBoard and bin/report all show."""

from __future__ import annotations

import json
import logging
import math

import pytest

from nanoflow.commands.report import format_summary, stage_summary
from nanoflow.observe.metrics import (
    FILE,
    MetricsError,
    MetricsLog,
    Throughput,
    read_metrics,
    step_seconds,
    tokens_per_second,
)
from nanoflow.observe.progress import Progress

# Two processes: steps 1–3, then a resume whose clock starts again (step 4's elapsed is below step 3's).
RECORDS = [{"step": 1, "stage": "a", "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 100, "elapsed": 2.0},
           {"step": 2, "stage": "a", "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "tokens": 100, "elapsed": 2.5},
           {"step": 3, "stage": "b", "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 300, "elapsed": 3.5},
           {"step": 4, "stage": "b", "loss": 1.5, "lr": 1e-3, "grad_norm": 1.0, "tokens": 300, "elapsed": 0.75}]


def test_what_metrics_log_writes_read_metrics_reads_back(tmp_path):
    path = tmp_path / FILE
    with MetricsLog(path, 0) as log:
        for m in RECORDS:
            log.write(m)
    assert read_metrics(tmp_path) == RECORDS
    with open(path, "a") as f:
        f.write('{"step": 5, "sta')                 # cut by a kill: skipped by the reader …
    assert read_metrics(tmp_path) == RECORDS
    with MetricsLog(path, 2) as log:                 # … and a resume after step 2 drops it and steps 3–4
        log.write({**RECORDS[2], "loss": 9.0})
    assert read_metrics(tmp_path) == [*RECORDS[:2], {**RECORDS[2], "loss": 9.0}]


def test_a_damaged_line_inside_the_file_is_an_error_naming_it(tmp_path):
    (tmp_path / FILE).write_text(json.dumps(RECORDS[0]) + "\nnot json\n" + json.dumps(RECORDS[1]) + "\n")
    with pytest.raises(MetricsError, match=rf"{FILE}:2: not a JSON line"):
        read_metrics(tmp_path)
    (tmp_path / FILE).write_text("")
    with pytest.raises(MetricsError, match="holds no steps yet"):
        read_metrics(tmp_path)


def test_tokens_per_second_counts_a_resumed_process_from_zero():
    assert step_seconds(RECORDS) == [2.0, 0.5, 1.0, 0.75]
    throughput = Throughput()
    for m in RECORDS:
        throughput.add(m)
    assert (throughput.tokens, throughput.seconds) == (800, 4.25)
    assert throughput.rate == 800 / 4.25
    assert math.isnan(tokens_per_second(10, 0.0))   # a step faster than elapsed's millisecond has no rate


def test_report_and_progress_show_the_same_tokens_per_second(caplog):
    rows = stage_summary(RECORDS)
    assert [(r.name, r.tokens, r.seconds) for r in rows] == [("a", 200, 2.5), ("b", 600, 1.75)]
    table = format_summary(rows)
    assert f"{tokens_per_second(200, 2.5):,.0f}" in table.splitlines()[2]   # "80"
    assert f"{tokens_per_second(600, 1.75):,.0f}" in table.splitlines()[3]  # "343"

    caplog.set_level(logging.INFO, logger="nanoflow")
    progress = Progress(train_steps=4, start_step=0, live=False, interval=1)
    for m in RECORDS:
        progress.step_done(m)
    lines = [r.getMessage() for r in caplog.records if r.name == "nanoflow.observe.progress"]
    assert len(lines) == 4
    expected = [f"{tokens_per_second(sum(m['tokens'] for m in RECORDS[:k]), sum(step_seconds(RECORDS)[:k])):,.0f} tok/s"
                for k in range(1, 5)]
    assert [line.split("  ")[-2] for line in lines] == expected, lines   # "… grad 1.000  188 tok/s  eta 0s"
