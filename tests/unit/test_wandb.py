"""W&B logging ([logging.wandb]) tested offline: the files W&B writes are read back; no network."""

import importlib.util

import pytest
from helpers import quiet
from support.evaluation import rows_of, write_run
from support.wandb_files import config, history, offline_runs, run_record

from nanoflow.commands.cli import train_main
from nanoflow.config import load_config
from nanoflow.training.loop import train

pytest.importorskip("wandb")

OFFLINE = ['logging.wandb.project="nanoflow-test"', 'logging.wandb.mode="offline"', 'logging.wandb.name="study"']


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
        assert logged[f"eval/{row['dataset']}/loss"] == row["loss"]
        assert logged[f"eval/{row['dataset']}/tokens"] == row["tokens"]
        if "accuracy" in row:
            assert logged[f"eval/{row['dataset']}/accuracy"] == row["accuracy"]
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


def test_rank_0_alone_logs(tmp_path):
    from nanoflow.observe.wandb_log import WandbLog

    config_ = load_config(write_run(tmp_path), OFFLINE)
    from nanoflow.schedule import Schedule
    with WandbLog(config_, Schedule.from_config(config_), tmp_path / "r1", 0, enabled=False) as log:
        log.write({"step": 1, "stage": "pretrain", "loss": 1.0})
    assert not (tmp_path / "r1").exists()


def test_without_the_package_plan_and_start_up_say_so_in_one_line(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    path = write_run(tmp_path)
    for extra in (["--plan"], []):
        status = train_main([str(path), *[f"--set={o}" for o in OFFLINE], *extra])
        err = capsys.readouterr().err
        assert status == 2, err
        assert "[logging.wandb] needs wandb, which is not installed: pip install '.[wandb]'" in err
        assert "Traceback" not in err
    assert not (tmp_path / "run").exists()   # nothing ran


def test_dir_is_where_w_and_b_writes_relative_to_the_toml(tmp_path):
    path = write_run(tmp_path, evaluation=False)
    train(load_config(path, [*OFFLINE, 'logging.wandb.dir="elsewhere/wb"', "tokens.train_steps=2"]), out=quiet())
    written = offline_runs(tmp_path / "elsewhere" / "wb")
    assert len(written) == 1 and not (tmp_path / "run" / "wandb").exists()
    assert run_record(written[0]).run_id == (tmp_path / "run" / "wandb_run_id.txt").read_text().strip()
    assert [row["_step"] for row in history(written[0])] == [1, 2]
