"""W&B logging ([logging.wandb]) tested offline: the files W&B writes are read back; no network. The login check
runs in a temporary HOME and environment."""

import importlib.util
from io import BytesIO
from pathlib import Path

import pytest
from helpers import quiet
from support.evaluation import rows_of, write_run
from support.wandb_files import config, history, offline_runs, run_record

from nanoflow.commands.cli import train_main
from nanoflow.config import load_config
from nanoflow.observe.wandb_log import EVAL_KEYS, PLAN_KEY, WandbLog
from nanoflow.schedule import Schedule
from nanoflow.training.loop import train

pytest.importorskip("wandb")

OFFLINE = ['logging.wandb.project="nanoflow-test"', 'logging.wandb.mode="offline"', 'logging.wandb.name="study"']
ONLINE = ['logging.wandb.project="nanoflow-test"']   # mode unset: "online", nanoflow's default as W&B's
HOST = "wandb.example.test"                          # W&B's server for the login tests (WANDB_BASE_URL): never reached
KEY = "local-" + "k3y" * 14                          # a key of the form W&B accepts; fake


@pytest.fixture
def no_login(tmp_path, monkeypatch) -> Path:
    """A HOME without a netrc or W&B settings, an environment without W&B's credentials: W&B's settings, read once a
    process, are read again from it (and from the real one after)."""
    import wandb

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_CONFIG_DIR", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", f"https://{HOST}")
    wandb.teardown()
    yield home
    monkeypatch.undo()
    wandb.teardown()


def plan_command(path: Path, overrides: list[str], *extra: str) -> list[str]:
    return [str(path), *[f"--set={o}" for o in overrides], *extra]


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


def test_rank_0_alone_logs(tmp_path):
    config_ = load_config(write_run(tmp_path), OFFLINE)
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


def test_a_multiple_choice_row_is_logged_with_its_normalised_accuracy_and_counts(tmp_path):
    config_ = load_config(write_run(tmp_path, evaluation=False), OFFLINE)
    row = {"step": 1, "stage": "pretrain", "dataset": "arc", "loss": 1.5, "tokens": 40, "accuracy": 0.5, "correct": 2,
           "accuracy_norm": 0.75, "correct_norm": 3, "examples": 4}
    with WandbLog(config_, Schedule.from_config(config_), tmp_path / "r", 0) as log:
        log.write_eval(row)
    (written,) = offline_runs(tmp_path / "r")
    (logged,) = [r for r in history(written) if any(k.startswith("eval/") for k in r)]
    assert {k: v for k, v in logged.items() if k.startswith("eval/")} == \
        {f"eval/arc/{k}": row[k] for k in ("loss", "tokens", "accuracy", "correct", "accuracy_norm", "correct_norm",
                                            "examples")}


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


def test_online_without_a_login_plan_and_start_up_stop_in_one_line(tmp_path, no_login, capsys):
    path = write_run(tmp_path)
    for extra in (["--plan"], []):
        status = train_main(plan_command(path, ONLINE, *extra))
        err = capsys.readouterr().err
        assert status == 2, err
        assert err.count("\n") == 1 and err.startswith(f"error: {path}: [logging.wandb] ")
        assert f'mode = "online" needs a W&B login and none is set up for https://{HOST}' in err
        assert "`wandb login`, set WANDB_API_KEY, or set mode = \"offline\"" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()   # nothing ran, nothing written


def test_a_login_in_the_environment_or_the_netrc_is_found_and_never_shown(tmp_path, no_login, monkeypatch, capsys):
    import wandb

    path = write_run(tmp_path)
    (no_login / ".netrc").write_text(f"machine {HOST}\n  login user\n  password {KEY}\n")
    assert train_main(plan_command(path, ONLINE, "--plan")) == 0
    said = capsys.readouterr()
    assert KEY not in said.out + said.err and "[logging.wandb]" not in said.err
    (no_login / ".netrc").write_text(f"machine elsewhere.example.test\n  login user\n  password {KEY}\n")
    assert train_main(plan_command(path, ONLINE, "--plan")) == 2   # a key for another server is no login for this one
    capsys.readouterr()
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    wandb.teardown()
    assert train_main(plan_command(path, ONLINE, "--plan")) == 0
    said = capsys.readouterr()
    assert KEY not in said.out + said.err


def test_a_key_of_the_wrong_form_is_refused_without_showing_it(tmp_path, no_login, monkeypatch, capsys):
    import wandb

    monkeypatch.setenv("WANDB_API_KEY", "local-s3cr3t")
    wandb.teardown()
    assert train_main(plan_command(write_run(tmp_path), ONLINE, "--plan")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the W&B login found is not usable" in err and "WANDB_API_KEY" in err
    assert "s3cr3t" not in err


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_offline_and_disabled_need_no_login(tmp_path, no_login, capsys, mode):
    assert train_main(plan_command(write_run(tmp_path), [*ONLINE, f'logging.wandb.mode="{mode}"'], "--plan")) == 0
    assert "W&B login" not in capsys.readouterr().err


@pytest.mark.parametrize(("env", "mode"), [("offline", "offline"), ("dryrun", "offline"), ("disabled", "disabled")])
def test_an_unset_mode_follows_wandb_mode(tmp_path, no_login, monkeypatch, capsys, env, mode):
    monkeypatch.setenv("WANDB_MODE", env)
    path = write_run(tmp_path)
    assert train_main(plan_command(path, ONLINE, "--plan")) == 0   # no login asked: not online
    assert "W&B login" not in capsys.readouterr().err
    config_ = load_config(path, ONLINE)
    assert WandbLog(config_, Schedule.from_config(config_), tmp_path / "run", 0).mode == mode


def test_a_mode_in_the_config_wins_over_wandb_mode(tmp_path, no_login, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert train_main(plan_command(write_run(tmp_path), [*ONLINE, 'logging.wandb.mode="online"'], "--plan")) == 2
    assert 'mode = "online" needs a W&B login' in capsys.readouterr().err


def test_a_wandb_mode_nanoflow_does_not_run_in_is_refused_by_name(tmp_path, no_login, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "shared")
    assert train_main(plan_command(write_run(tmp_path), ONLINE, "--plan")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "WANDB_MODE='shared'" in err and "[logging.wandb]" in err
