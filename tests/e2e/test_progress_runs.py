"""A whole run's start-up header and the progress keys metrics.jsonl gets, as bin/report reads them
(tests/unit/test_progress.py: the rate, ETA, MFU and memory figures)."""

from __future__ import annotations

import io

from helpers import tiny

from nanoflow.commands.report import format_summary, stage_summary
from nanoflow.observe.metrics import read_metrics
from nanoflow.training.loop import train


def test_train_logs_the_header_and_writes_the_new_keys_that_report_reads(tmp_path):
    out = io.StringIO()
    run = tmp_path / "run"
    train(tiny(run), out=out, until_step=8, progress=False)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("model: 27,808 parameters (2 layers × 32 hidden, vocabulary 288), float32"), lines
    assert "0.19 M at sequence length 32, 0.184 M at sequence length 24" in lines[0]
    assert lines[1].startswith("device: cpu; peak ") and "GFLOP/s" in lines[1]
    assert lines[1].endswith("; torch's fastest algorithms"), lines[1]
    assert lines[2] == "layout: dp 1 × tp 1 (tp_mode ALL_REDUCE), recompute_layer off, compile off"
    assert lines[3] == "start: fresh start at step 1 of 12"
    assert lines[4].startswith("loss: fused linear cross-entropy, chunks of 116,508 positions on a CPU"), lines[4]
    # tiny.toml: 4 heads over 2 kv heads of 8 dimensions; torch's dispatcher picks its CPU flash kernel for them
    assert lines[5] == ("attention: scaled_dot_product_attention → flash_attention (float32, head_dim 8, "
                        "grouped-query 4/2 heads)"), lines[5]
    rows = read_metrics(run)
    assert [m["step"] for m in rows] == list(range(1, 9))
    for m in rows:
        assert {"step", "stage", "loss", "lr", "grad_norm", "tokens", "target_tokens", "elapsed"} <= m.keys()
        assert m["tokens_per_s"] > 0 and 0 < m["mfu"] < 1 and m["peak_memory_bytes"] > 10 * 2**20
    assert [r.name for r in stage_summary(rows)] == ["pretrain", "sft"]
    assert "pretrain" in format_summary(stage_summary(rows))
    progress_lines = [line for line in lines if line.startswith("step ")]
    assert progress_lines and all(" tok/s  eta " in line and "  mfu " in line and "  mem " in line
                                  for line in progress_lines)

    out = io.StringIO()
    train(tiny(run), out=out, progress=False)   # resumes from step 8
    assert "start: resumed after step 8 of 12" in out.getvalue().splitlines()
    assert [m["step"] for m in read_metrics(run)] == list(range(1, 13))

