"""bin/average: the mean of committed checkpoints' weights, written as a committed nanoflow checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from data_helpers import eot_tokenizer
from helpers import quiet, tiny
from safetensors.torch import load_file
from support.average import STAGES, assert_mean, mean_from_files

from nanoflow import io
from nanoflow.commands.cli import average_main
from nanoflow.interop.export import export_hf
from nanoflow.io.store import Store
from nanoflow.training.loop import train


def test_last_k_is_the_mean_of_the_files(run_dir, tmp_path):
    out = tmp_path / "avg"
    assert average_main([str(run_dir), str(out), "--last", "3"]) == 0
    assert_mean(out, mean_from_files([run_dir / s for s in ("4", "6", "8")]))
    meta = io.read_metadata(str(out))
    assert meta["step"] == 8 and meta["training"]["completed"] == 8 and "optimizer" not in meta["tensors"]
    assert [a["step"] for a in meta["averaged_from"]] == [4, 6, 8]
    # It differs from every source: a real average, not a copy of one of them.
    assert not torch.equal(io.read_model(str(out))["model.norm.weight"], io.read_model(str(run_dir / "8"))["model.norm.weight"])


def test_steps_and_weights(run_dir, tmp_path):
    out = tmp_path / "avg"
    assert average_main([str(run_dir), str(out), "--steps", "2,8", "--weights", "1,3"]) == 0
    assert_mean(out, mean_from_files([run_dir / "2", run_dir / "8"], [1.0, 3.0]))


def test_the_average_is_read_by_eval_export_init_from_and_resume(run_dir, tmp_path):
    out = tmp_path / "avg"
    assert average_main([str(run_dir), str(out), "--last", "2"]) == 0
    expected = io.read_model(str(out))
    hf = tmp_path / "hf"
    export_hf(str(out), str(hf))
    assert torch.equal(load_file(hf / "model.safetensors")["model.norm.weight"], expected["model.norm.weight"])
    # init_from: a new run starting from the averaged weights (step 1, fresh optimizer).
    started = train(tiny(tmp_path / "init", f'model.init_from="{out}"', "tokens.train_steps=1",
                         "data_stages.sft.start_training_step=100"), out=quiet(), fresh=True)
    assert started.step == 1
    # resume_checkpoint_path with fresh moments: continues from step 8 of the average.
    resumed = train(tiny(tmp_path / "resumed", *STAGES, "tokens.train_steps=10", f'checkpoints.resume_checkpoint_path="{out}"',
                         "checkpoints.load_optimizer=false"), out=quiet())
    assert resumed.step == 10


def test_an_interrupted_average_commits_nothing(run_dir, tmp_path, monkeypatch):
    out = tmp_path / "avg"
    real_write = Store.write

    def write(self, path, data):
        if path.endswith("checkpoint_metadata.json"):
            raise KeyboardInterrupt   # Ctrl-C at the last moment: every tensor file written, the commit not
        return real_write(self, path, data)

    monkeypatch.setattr(Store, "write", write)
    assert average_main([str(run_dir), str(out), "--last", "2"]) == 130
    assert any(out.rglob("*.safetensors")) and io.latest(str(out)) is None
    monkeypatch.setattr(Store, "write", real_write)
    assert average_main([str(run_dir), str(out), "--last", "2"]) == 0    # the same command again: done, and committed
    assert_mean(out, mean_from_files([run_dir / "6", run_dir / "8"]))


def mixed_run(folder: Path, *step_folders: Path) -> Path:
    """One run folder holding copies of step folders of different runs, each under its own step's name."""
    for source in step_folders:
        for path in source.rglob("*"):
            if path.is_file():
                (folder / source.name / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
                (folder / source.name / path.relative_to(source)).write_bytes(path.read_bytes())
    return folder


def test_checkpoints_of_different_models_are_refused_naming_them(run_dir, tmp_path, capsys):
    other = tmp_path / "other"
    train(tiny(other, *STAGES, "model.intermediate_size=48", "tokens.train_steps=2"), out=quiet(), fresh=True)
    mixed = mixed_run(tmp_path / "mixed", run_dir / "8", other / "2")    # a step of each model
    assert average_main([str(mixed), str(tmp_path / "avg"), "--steps", "2,8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "intermediate_size is 48" in err and "64" in err
    assert str(mixed / "2") in err and str(mixed / "8") in err
    assert not (tmp_path / "avg").exists()


def test_checkpoints_of_different_tokenizers_are_refused_naming_them(run_dir, tmp_path, capsys):
    # The same architecture (vocab_size 288 holds the BPE's 280 ids): only the tokenizer tells the weights apart.
    bpe = eot_tokenizer(tmp_path / "bpe" / "tokenizer.json")
    other = tmp_path / "other"
    train(tiny(other, *STAGES, f"tokenizer.tokenizer_name_or_path={json.dumps(str(bpe))}", 'tokenizer.eos_token="<EOT>"',
               "tokens.train_steps=2"), out=quiet(), fresh=True)
    mixed = mixed_run(tmp_path / "mixed", run_dir / "8", other / "2")
    assert average_main([str(mixed), str(tmp_path / "avg"), "--steps", "2,8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "the tokenizer is" in err, err
    assert str(bpe) in err and "'bytes'" in err and "model." not in err
    assert str(mixed / "2") in err and str(mixed / "8") in err
    assert not (tmp_path / "avg").exists()


@pytest.mark.parametrize("args, words", [
    (["--last", ""], "--last ''"),
    (["--last", "5"], "keeps only 4 committed checkpoints"),
    (["--steps", "3,4"], "no committed checkpoint of step 3"),
    (["--steps", "4,6", "--weights", "1"], "1 weights for 2 checkpoints"),
    ([], "one of --last K or --steps"),
    # Issue 30, item 1: weights that normalise to (nan, 0) or (0, 0) were averaged into a NaN or all-zero model.
    (["--last", "2", "--weights", "inf,1"], "finite"),
    (["--last", "2", "--weights", "1e308,1e308"], "finite"),
    (["--last", "2", "--weights", "nan,1"], "finite"),
])
def test_bad_selections_exit_2_with_one_line(run_dir, tmp_path, capsys, args, words):
    assert average_main([str(run_dir), str(tmp_path / "avg"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and words in err, err
    assert not (tmp_path / "avg").exists()


def test_an_existing_average_is_not_overwritten(run_dir, tmp_path, capsys):
    out = tmp_path / "avg"
    assert average_main([str(run_dir), str(out), "--last", "2"]) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert average_main([str(run_dir), str(out), "--last", "3"]) == 2
    assert "already holds a committed checkpoint" in capsys.readouterr().err
    assert before == {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}




# Issue 30, item 5: "the last K" are the run's own last K, in commit order, of one history.

def test_last_k_after_a_fresh_start_takes_only_the_new_history(tmp_path, capsys):
    run = tmp_path / "run"
    train(tiny(run, *STAGES, "tokens.train_steps=6"), out=quiet(), fresh=True)    # steps 2, 4, 6
    train(tiny(run, *STAGES, "tokens.train_steps=2"), out=quiet(), fresh=True)    # a new history: its own step 2
    assert average_main([str(run), str(tmp_path / "avg"), "--last", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--last 3" in err and "history" in err and "4, 6" in err, err
    assert not (tmp_path / "avg").exists()
    assert average_main([str(run), str(tmp_path / "avg"), "--last", "1"]) == 0
    assert [a["step"] for a in io.read_metadata(str(tmp_path / "avg"))["averaged_from"]] == [2]


def test_last_k_after_a_start_from_an_older_step_takes_its_ancestors_not_the_abandoned_steps(tmp_path):
    run = tmp_path / "run"
    train(tiny(run, *STAGES), out=quiet(), fresh=True)                             # steps 2, 4, 6, 8
    expected = mean_from_files([run / "2", run / "4"])
    train(tiny(run, *STAGES, f'checkpoints.resume_checkpoint_path="{run / "4"}"'), until_step=6,
          out=quiet())                                                             # 6 again, from 4; the old 8 stays
    six = mean_from_files([run / "6"])
    assert average_main([str(run), str(tmp_path / "avg"), "--last", "3"]) == 0
    assert [a["step"] for a in io.read_metadata(str(tmp_path / "avg"))["averaged_from"]] == [2, 4, 6]
    assert_mean(tmp_path / "avg", {name: (2 * expected[name] + six[name]) / 3 for name in expected})
