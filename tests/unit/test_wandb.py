"""W&B logging ([logging.wandb]) tested offline: the files W&B writes are read back; no network. The login check
runs in a temporary HOME and environment."""

import importlib.util
from pathlib import Path

import pytest
from support.evaluation import write_run
from support.wandb_files import OFFLINE, history, offline_runs

from nanoflow.commands.cli import train_main
from nanoflow.config import load_config
from nanoflow.observe.wandb_log import WandbLog
from nanoflow.schedule import Schedule

pytest.importorskip("wandb")

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
