"""W&B logging ([logging.wandb]) over whole runs, offline: every metrics field and eval row logged, a resume
continues the same W&B run, the plan figure (tests/unit/test_wandb.py: the rest)."""

from __future__ import annotations

import importlib.util
from io import BytesIO
from pathlib import Path

import pytest
from helpers import quiet
from support.evaluation import rows_of, write_run
from support.wandb_files import OFFLINE, config, history, offline_runs, run_record

from nanoflow.config import load_config
from nanoflow.observe.wandb_log import EVAL_KEYS, PLAN_KEY
from nanoflow.schedule import Schedule
from nanoflow.training.loop import train


def image_rows(path: Path) -> list[tuple[int, dict]]:
    """The step and the image record (W&B's fields of it: _type, path, width, …) of each history row of a .wandb file
    that holds the plan figure; W&B stores an image's fields as nested keys, `plan/path`."""
    found = []
    for row in history(path):
        image = {k.removeprefix(f"{PLAN_KEY}/"): v for k, v in row.items() if k.startswith(f"{PLAN_KEY}/")}
        if image or PLAN_KEY in row:
            found.append((row["_step"], image))
    return found


def test_every_metrics_field_and_eval_row_is_logged_and_a_resume_continues_the_same_w_and_b_run(tmp_path):
    path = write_run(tmp_path)   # 6 steps, sft from step 5, evaluated at 3, 4 and 6
    run = tmp_path / "run"
    train(load_config(path, OFFLINE), until_step=4, out=quiet())
    train(load_config(path, OFFLINE), out=quiet())
    first, second = offline_runs(run)
    run_id = (run / "wandb_run_id.txt").read_text().strip()
    assert run_record(first).run_id == run_record(second).run_id == run_id   # one W&B run, resumed
    assert run_record(first).project == "nanoflow-test" and run_record(first).display_name == "study"
    rows = history(first) + history(second)
    by_step = {}
    for row in rows:
        by_step.setdefault(row["_step"], {}).update(row)
    for line in rows_of(run / "metrics.jsonl"):   # every field of every step, the stage among them
        logged = by_step[line["step"]]
        assert {k: logged[k] for k in line if k != "step"} == {k: v for k, v in line.items() if k != "step"}
    assert [by_step[s]["stage"] for s in range(1, 7)] == ["pretrain"] * 4 + ["sft"] * 2
    for row in rows_of(run / "eval.jsonl"):
        logged = by_step[row["step"]]
        assert {k: logged[f"eval/{row['dataset']}/{k}"] for k in EVAL_KEYS if k in row} == \
            {k: row[k] for k in EVAL_KEYS if k in row}
        assert {"loss", "tokens"} <= set(row) and ("accuracy" in row) == (row["dataset"] == "sums")
    assert {s for s in by_step if any(k.startswith("eval/") for k in by_step[s])} == {3, 4, 6}
    stages = config(first)["stages"]
    assert [s["name"] for s in stages] == ["pretrain", "sft"] and stages[1]["start_step"] == 5
    assert config(first)["general"]["run"] == "run" and "learning_rate_scheduler" in config(first)["optimizer"]


def test_a_fresh_start_makes_a_new_w_and_b_run(tmp_path):
    path = write_run(tmp_path, evaluation=False)
    config_ = load_config(path, [*OFFLINE, "tokens.train_steps=2"])
    train(config_, out=quiet())
    old = (tmp_path / "run" / "wandb_run_id.txt").read_text()
    train(config_, fresh=True, out=quiet())
    assert (tmp_path / "run" / "wandb_run_id.txt").read_text() != old


def test_dir_is_where_w_and_b_writes_relative_to_the_toml(tmp_path):
    path = write_run(tmp_path, evaluation=False)
    train(load_config(path, [*OFFLINE, 'logging.wandb.dir="elsewhere/wb"', "tokens.train_steps=2"]), out=quiet())
    written = offline_runs(tmp_path / "elsewhere" / "wb")
    assert len(written) == 1 and not (tmp_path / "run" / "wandb").exists()
    assert run_record(written[0]).run_id == (tmp_path / "run" / "wandb_run_id.txt").read_text().strip()
    assert [row["_step"] for row in history(written[0])] == [1, 2]


def test_the_plan_figure_is_logged_at_each_start_as_the_image_plan_plots(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from nanoflow.observe.plan_figure import plan_png

    path = write_run(tmp_path, evaluation=False)
    config_ = load_config(path, [*OFFLINE, "tokens.train_steps=3"])
    train(config_, until_step=1, out=quiet())
    train(config_, out=quiet())   # a resume: the plan again, at the first step it trains
    expected = Image.open(BytesIO(plan_png(config_, Schedule.from_config(config_))))
    assert expected.size == (1200, 1100)
    for written, first_step in zip(offline_runs(tmp_path / "run"), (1, 2), strict=True):
        ((step, logged),) = image_rows(written)
        assert step == first_step and logged["_type"] == "image-file"
        assert [r["_step"] for r in history(written) if "loss" in r][0] == first_step   # the step's own row
        image = written.parent / "files" / logged["path"]
        assert image.parent.name == "images" and image.parent.parent.name == "media"
        with Image.open(image) as drawn:
            assert drawn.size == expected.size
            assert drawn.convert("RGBA").tobytes() == expected.convert("RGBA").tobytes()   # the plan, pixel for pixel


def test_without_matplotlib_no_figure_is_logged_and_the_log_says_so_once(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    out = quiet()
    train(load_config(write_run(tmp_path, evaluation=False), [*OFFLINE, "tokens.train_steps=2"]), out=out)
    (written,) = offline_runs(tmp_path / "run")
    assert image_rows(written) == [] and not (written.parent / "files" / "media").exists()
    assert [r["_step"] for r in history(written)] == [1, 2]   # the steps logged all the same
    assert out.getvalue().count("the plan figure is not logged: matplotlib is not installed") == 1

