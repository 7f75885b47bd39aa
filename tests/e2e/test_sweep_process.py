"""bin/sweep end to end (issue 30): a study on S3 (item 11), an [[averages]] entry edited between two runs of the
study (item 3), an eval.tmp planted in an average's folder (item 7), and a stop signal while one of its runs starts
up (item 12), in a real bin/sweep process."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
from data_helpers import stage, write_config
from helpers import REPO
from process_helpers import bin_command, signal_when_ready
from run_helpers import folder_digest
from s3_helpers import keys
from support.study import write_study

from nanoflow import io
from nanoflow.commands.cli import sweep_main, train_main
from nanoflow.commands.sweep import run_study
from nanoflow.errors import EXIT_DONE, EXIT_STOPPED

TRUNK = ("trunk", {"set": ["tokens.train_steps=4"]})


@pytest.fixture(scope="module")
def trunk(tmp_path_factory):
    """A study's trunk, trained once (4 steps, checkpoints 2 and 4, evaluated at 4): the local tests copy it."""
    root = tmp_path_factory.mktemp("sweep")
    assert run_study(str(write_study(root / "study.toml", [TRUNK])), train_main=train_main) == EXIT_DONE
    return root / "runs" / "trunk"


def study_with_trunk(tmp_path, trunk, averages) -> str:
    shutil.copytree(trunk, tmp_path / "runs" / "trunk")   # the study passes over the run it finds done
    return str(write_study(tmp_path / "study.toml", [TRUNK], averages))


def test_a_study_on_s3_runs_averages_compares_and_reruns(s3_endpoint, s3_bucket, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)   # the runs' records go to ./runs/s3/<bucket>/<prefix>: here
    study = write_study(tmp_path / "study.toml", [TRUNK], [{"name": "trunk-avg", "run": "trunk", "last": 2}],
                        runs_dir=s3_bucket)
    assert run_study(str(study), train_main=train_main) == EXIT_DONE
    records = tmp_path / "runs" / "s3" / s3_bucket.removeprefix("s3://")
    assert [a["step"] for a in io.read_metadata(f"{s3_bucket}/trunk-avg")["averaged_from"]] == [2, 4]
    assert (records / "trunk-avg" / "eval.jsonl").read_text().count("\n") == 2      # its two eval sets, at step 4
    assert (records / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert "trunk-avg" in capsys.readouterr().out
    assert not any(p.name.startswith("s3:") for p in tmp_path.rglob("*"))   # no local path spelt like a URL
    before, listed = folder_digest(records), keys(s3_endpoint, s3_bucket)
    assert run_study(str(study), train_main=train_main) == EXIT_DONE        # a rerun does nothing new
    after = folder_digest(records)
    assert {f for f in set(before) | set(after) if before.get(f) != after.get(f)} <= {"compare.png"}
    assert keys(s3_endpoint, s3_bucket).keys() == listed.keys()


def test_an_edited_average_is_not_passed_off_as_the_old_one(trunk, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    study = study_with_trunk(tmp_path, trunk, [{"name": "avg", "run": "trunk", "steps": [2, 4]}])
    assert run_study(study, train_main=train_main) == EXIT_DONE
    made = folder_digest(tmp_path / "runs" / "avg")
    write_study(tmp_path / "study.toml", [TRUNK], [{"name": "avg", "run": "trunk", "last": 1}])   # edited
    capsys.readouterr()
    assert sweep_main([study]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "averages[0] (avg)" in err and "trunk steps 4 (1)" in err, err
    assert "trunk steps 2 (0.5), 4 (0.5)" in err, err
    assert folder_digest(tmp_path / "runs" / "avg") == made


def test_the_eval_of_an_average_never_writes_through_a_planted_link(trunk, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    study = study_with_trunk(tmp_path, trunk, [{"name": "avg", "run": "trunk", "last": 2}])
    target = tmp_path / "elsewhere.txt"
    target.write_text("the user's\n")
    folder = tmp_path / "runs" / "avg"
    folder.mkdir()
    planted = folder / f"eval.jsonl.tmp-{os.getpid()}"     # the very temporary this process writes first
    for link in (folder / "eval.tmp", planted):             # (and the one bin/sweep wrote before)
        link.symlink_to(target)
    assert sweep_main([study]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{planted} is a symlink" in err, err
    assert target.read_text() == "the user's\n" and not (folder / "eval.jsonl").exists()
    planted.unlink()
    assert sweep_main([study]) == 0                          # the link of another name is left as it is
    assert target.read_text() == "the user's\n" and (folder / "eval.tmp").is_symlink()
    assert (folder / "eval.jsonl").read_text().count("\n") == 2


def big_start_up_base(tmp_path):
    """A config whose start-up (tokenizing a 40 MB text file) takes seconds; a small file for runs that finish."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "big.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 1_000_000)
    (corpus / "small.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    return write_config(tmp_path, [stage("pretrain", 1, {"hf_dataset_or_datasets": "text",
                                                         "hf_data_files": str(corpus / "big.txt")})])


@pytest.mark.slow
@pytest.mark.parametrize("runs", [1, 2])
def test_a_stop_signal_while_a_run_of_the_study_starts_up_ends_it_with_75(tmp_path, runs):
    base = big_start_up_base(tmp_path)
    small = f'data_stages.pretrain.data.dataset.hf_data_files="{tmp_path / "corpus" / "small.txt"}"'
    # With two runs, the first finishes (after which a finished run's process ignores every stop signal) and the
    # signal comes while the second starts up.
    plan = [("small", {"set": [small]})] * (runs - 1) + [("big", {})]
    study = write_study(tmp_path / "study.toml", plan, base=base, common=["tokens.train_steps=2"])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    seen = []

    def starting(process) -> bool:
        line = process.stdout.readline()
        seen.append(line)
        assert line, seen
        return f"study run {runs}/{runs}: big" in line

    code, stdout, stderr = signal_when_ready(bin_command("sweep", study), starting, signal.SIGTERM, cwd=REPO,
                                             env=env, timeout=600)
    assert code == EXIT_STOPPED, "".join(seen) + stdout + "\n--- stderr:\n" + stderr
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1].startswith(
        "stopped by SIGTERM during start-up, before any step was trained"), stderr
    assert not (tmp_path / "runs" / "big" / "latest.txt").exists()
