"""bin/compare on runs whose checkpoints are on S3 (issue 30, item 11), and on records the user cannot read (item 16),
in a real bin/compare process that really gets EACCES."""

from __future__ import annotations

import json

import pytest
from helpers import quiet, tiny
from process_helpers import run_command, without_reading_rights

from nanoflow.commands.cli import compare_main
from nanoflow.commands.compare import read_runs
from nanoflow.training.loop import train

PRETRAIN = ["data_stages.sft.start_training_step=100", "checkpoints.checkpoint_interval=2"]


def fake_eval(folder, losses: dict[int, float]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "eval.jsonl").write_text("".join(json.dumps({"step": s, "stage": "pretrain", "dataset": "held", "loss": v,
                                                           "tokens": 1}) + "\n" for s, v in losses.items()))


def table(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line[:1].isalpha() and not line.startswith("wrote ")}


def test_compare_reads_s3_runs_by_url_and_by_their_local_record_folder(s3_bucket, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)   # an S3 run keeps its records under ./runs/s3/<bucket>/<prefix>: here
    trunk, branch = f"{s3_bucket}/trunk", f"{s3_bucket}/branch"
    train(tiny(trunk, *PRETRAIN, "tokens.train_steps=4", 'optimizer.learning_rate_scheduler.lr_decay_style="constant"'),
          out=quiet(), fresh=True)
    train(tiny(branch, *PRETRAIN, "tokens.train_steps=6", f'checkpoints.resume_checkpoint_path="{trunk}/2"'),
          out=quiet())
    records = {url: tmp_path / "runs" / "s3" / url.removeprefix("s3://") for url in (trunk, branch)}
    fake_eval(records[trunk], {2: 3.0, 4: 2.5})
    fake_eval(records[branch], {4: 2.4, 6: 2.0})

    assert compare_main([trunk, branch, "--output", str(tmp_path / "by-url.png")]) == 0
    by_url = table(capsys.readouterr().out)
    assert compare_main([str(records[trunk]), str(records[branch]), "--output", str(tmp_path / "by-record.png")]) == 0
    by_record = table(capsys.readouterr().out)
    assert by_url == by_record and set(by_url) >= {"trunk", "branch"}
    url_trunk, url_branch = read_runs([trunk, branch])
    record_trunk, record_branch = read_runs([str(records[trunk]), str(records[branch])])
    assert (url_branch.flops, url_branch.own_flops) == (record_branch.flops, record_branch.own_flops)
    assert url_branch.origin == (trunk, 2) and record_branch.origin == (str(records[trunk]), 2)
    assert url_branch.own_flops == url_trunk.own_flops > 0            # 4 steps each, of the same tokens
    assert url_branch.flops == url_branch.own_flops + url_trunk.flops_at[2]   # + the trunk's steps 1–2


@pytest.mark.parametrize("command, name", [("compare", "eval.jsonl"), ("compare", "metrics.jsonl"),
                                           ("report", "metrics.jsonl"), ("report", "eval.jsonl")])
def test_a_record_the_user_cannot_read_is_one_line_not_a_traceback(tmp_path, command, name):
    run = tmp_path / "run"
    train(tiny(run, *PRETRAIN, "tokens.train_steps=2"), out=quiet(), fresh=True)
    fake_eval(run, {2: 3.0})
    (run / name).chmod(0)
    option = "--output" if command == "compare" else "--out"
    result = run_command(command, run, option, tmp_path / "c.png", cwd=tmp_path, launcher=without_reading_rights())
    assert result.returncode == 2, result.stdout + result.stderr
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and f"{run / name}: cannot read it: Permission denied" in err, err
    assert not (tmp_path / "c.png").exists()
