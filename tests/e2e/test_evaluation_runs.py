"""Evaluation over whole runs trained in this process: eval rows a step and a set, training left unchanged, the
fingerprints of eval sets across a resume, bin/eval's first words, the curves in TensorBoard and bin/report
(tests/unit/test_evaluation.py: the rest)."""

from __future__ import annotations

import io as text_io
import json

import attrs
import pytest
import torch
from support.evaluation import rows_of, write_run

from nanoflow.config import load_config
from nanoflow.observe.metrics import MEASURED


def test_evaluation_never_changes_training_and_writes_a_row_per_step_and_set(tmp_path):
    from nanoflow.training.loop import train

    config = load_config(write_run(tmp_path))
    with_eval = train(config, fresh=True, out=text_io.StringIO())
    without = train(attrs.evolve(config, evaluation=None, checkpoints=attrs.evolve(
        config.checkpoints, checkpoints_path=str(tmp_path / "plain"))), fresh=True, out=text_io.StringIO())
    a, b = dict(with_eval.model.named_parameters()), dict(without.model.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert rows_of(tmp_path / "run" / "metrics.jsonl") == [
        {**m, **{k: n[k] for k in MEASURED}} for m, n in zip(rows_of(tmp_path / "plain" / "metrics.jsonl"),
                                                        rows_of(tmp_path / "run" / "metrics.jsonl"), strict=True)]
    rows = rows_of(tmp_path / "run" / "eval.jsonl")
    # interval 3, and each stage's last step (4: pretrain's, 6: sft's and the run's)
    assert [(r["step"], r["stage"], r["dataset"]) for r in rows] == [
        (3, "pretrain", "text"), (3, "pretrain", "sums"), (4, "pretrain", "text"), (4, "pretrain", "sums"),
        (6, "sft", "text"), (6, "sft", "sums")]
    assert all(r["tokens"] == 10 * 32 for r in rows if r["dataset"] == "text")   # the 10 held-out windows
    assert all(set(r) == {"step", "stage", "dataset", "loss", "tokens", "accuracy", "correct", "data_fingerprint"}
               for r in rows if r["dataset"] == "sums")
    assert not (tmp_path / "plain" / "eval.jsonl").exists()


def test_a_progress_line_per_evaluation(tmp_path):
    from nanoflow.training.loop import train

    config = load_config(write_run(tmp_path), ["tokens.train_steps=4", "data_stages.sft.start_training_step=10"])
    out = text_io.StringIO()   # train(out=) sends every message of the run there (nanoflow/console.py)
    train(config, fresh=True, out=out)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("eval step")]
    assert len(lines) == 2 and lines[0].startswith("eval step 3 (pretrain): text loss ")
    assert " sums loss " in lines[1] and " exact " in lines[1]


def test_bin_eval_says_what_it_evaluates_before_its_silence(tmp_path, capsys):
    """bin/eval read, built and scored for minutes on the curriculum without a word (issue 30, item 25): it says the
    checkpoint, its step and the eval sets first, then how much it scores; the rows stay alone on stdout."""
    from process_helpers import run_in_process

    from nanoflow.training.loop import train

    config = write_run(tmp_path)
    train(load_config(config, ["tokens.train_steps=4", "data_stages.sft.start_training_step=10"]), fresh=True,
          out=text_io.StringIO())
    result = run_in_process("eval", tmp_path / "run", config, capsys=capsys)
    assert result.returncode == 0, result.stderr
    said = result.stderr.splitlines()
    first = next(i for i, line in enumerate(said) if line.startswith("evaluating "))
    assert said[first] == f"evaluating {tmp_path / 'run' / '4'} (step 4) on 2 eval sets: text, sums; reading the data " \
                          "and the weights"
    assert said[first + 1].startswith("scoring ") and "sums: greedy answers to " in said[first + 1], said
    assert [json.loads(line)["dataset"] for line in result.stdout.splitlines()] == ["text", "sums"]


def test_tensorboard_gets_the_eval_curves(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nanoflow.training.loop import train

    train(load_config(write_run(tmp_path)), fresh=True, out=text_io.StringIO())
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/sums/accuracy")] == [3, 4, 6]
    assert [e.step for e in events.Scalars("eval/text/loss")] == [3, 4, 6]


def test_report_draws_the_eval_curves(tmp_path):
    pytest.importorskip("matplotlib")
    from nanoflow.commands.report import write_report
    from nanoflow.observe.metrics import read_eval
    from nanoflow.training.loop import train

    train(load_config(write_run(tmp_path)), fresh=True, out=text_io.StringIO())
    run = tmp_path / "run"
    with open(run / "eval.jsonl", "a") as f:
        f.write('{"step": 7, "sta')   # a line cut by a kill is skipped
    assert [r["step"] for r in read_eval(run)] == [3, 3, 4, 4, 6, 6]
    path, _ = write_report(run)
    assert path.stat().st_size > 0


def test_the_eval_panel_shows_its_axes_whole_and_hides_no_curve_under_its_legend(tmp_path):
    pytest.importorskip("matplotlib")
    from nanoflow.commands.report import draw, stage_spans
    from nanoflow.observe.metrics import read_eval, read_metrics
    from nanoflow.training.loop import train

    train(load_config(write_run(tmp_path)), fresh=True, out=text_io.StringIO())
    run = tmp_path / "run"
    metrics = read_metrics(run)
    figure = draw(metrics, stage_spans(metrics), title="t", eval_rows=read_eval(run))
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    inside = figure.bbox
    eval_ax = figure.axes[3]
    accuracy_ax = next(ax for ax in figure.axes[4:] if ax.get_ylabel() == "exact match %")
    label = accuracy_ax.yaxis.label.get_window_extent(renderer)
    assert inside.x0 <= label.x0 and label.x1 <= inside.x1, (label, inside)   # the label is in the picture
    ticks = [t for t in accuracy_ax.get_yticklabels() if t.get_text() and 0 <= t.get_position()[1] <= 100]
    assert "100" in [t.get_text().replace("−", "-") for t in ticks]
    for tick in ticks:   # every tick label (100 among them) whole inside the picture
        box = tick.get_window_extent(renderer)
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, tick
    legend = eval_ax.get_legend().get_window_extent(renderer)
    assert not legend.overlaps(eval_ax.get_window_extent(renderer)) and legend.x1 <= inside.x1, legend
    assert not legend.overlaps(label)


def test_an_eval_set_whose_file_changed_under_a_checkpoint_is_refused_by_name(tmp_path):
    from nanoflow.data.fingerprint import DataChangedError
    from nanoflow.io import read_metadata
    from nanoflow.training.loop import train

    path = write_run(tmp_path, steps=6, sft_start=5)
    train(load_config(path), until_step=3, out=text_io.StringIO())   # "sums" evaluated at step 3; sft not begun
    assert set(read_metadata(str(tmp_path / "run"))["eval_fingerprint"]) == {"text", "sums"}
    with open(tmp_path / "sums.jsonl", "a") as f:   # lines appended to the held-out file
        f.write('{"prompt": "9+9=", "completion": "18"}\n')
    before = (tmp_path / "run" / "eval.jsonl").read_bytes()
    with pytest.raises(DataChangedError) as caught:
        train(load_config(path), out=text_io.StringIO())
    message = str(caught.value)
    assert 'eval set "sums"' in message and str(tmp_path / "sums.jsonl") in message, message
    assert 'eval set "text"' not in message and "ignore_fingerprint_mismatch" in message
    assert (tmp_path / "run" / "eval.jsonl").read_bytes() == before   # nothing scored on the new file


def test_an_eval_set_changed_anyway_is_said_and_its_rows_carry_the_new_fingerprint(tmp_path):
    from nanoflow.io import read_metadata
    from nanoflow.training.loop import train

    path = write_run(tmp_path, steps=6, sft_start=5)
    train(load_config(path), until_step=3, out=text_io.StringIO())
    with open(tmp_path / "sums.jsonl", "a") as f:
        f.write('{"prompt": "9+9=", "completion": "18"}\n')
    out = text_io.StringIO()
    train(load_config(path, ["checkpoints.ignore_fingerprint_mismatch=true"]), out=out)
    assert 'eval set "sums"' in out.getvalue() and "WARNING" in out.getvalue().upper()
    rows = rows_of(tmp_path / "run" / "eval.jsonl")
    sums = {r["step"]: r["data_fingerprint"] for r in rows if r["dataset"] == "sums"}
    text = {r["step"]: r["data_fingerprint"] for r in rows if r["dataset"] == "text"}
    assert sums[3] != sums[4] == sums[6]           # two held-out sets under one name: told apart, row by row
    assert text[3] == text[4] == text[6]
    recorded = read_metadata(str(tmp_path / "run"))["eval_fingerprint"]["sums"]
    assert str(tmp_path / "sums.jsonl") in recorded["sources"]["json"]["files"]
    train(load_config(path), out=text_io.StringIO())   # the new fingerprint recorded: a rerun is not refused


def test_a_checkpoint_from_before_eval_fingerprints_is_not_checked(tmp_path):
    import json

    from nanoflow.io.marker import sealed
    from nanoflow.training.loop import train

    path = write_run(tmp_path, steps=6, sft_start=5)
    train(load_config(path), until_step=3, out=text_io.StringIO())
    marker = tmp_path / "run" / "3" / "checkpoint_metadata.json"
    meta = json.loads(marker.read_text())
    meta.pop("metadata_xxh3_128"), meta.pop("eval_fingerprint")   # as nanoflow wrote it before recording them
    marker.write_bytes(sealed(meta))
    with open(tmp_path / "sums.jsonl", "a") as f:
        f.write('{"prompt": "9+9=", "completion": "18"}\n')
    assert train(load_config(path), out=text_io.StringIO()).step == 6

