"""Data fingerprints: a begun stage never resumes on other data, another tokenizer or other seeds without being told."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from data_helpers import stage, write_config, write_folder, write_word_level_tokenizer
from helpers import quiet
from process_helpers import run_in_process

from nanoflow import io, load_config
from nanoflow.checkpoint.checkpointer import Checkpointer
from nanoflow.data import ByteTokenizer
from nanoflow.data import fingerprint as fp
from nanoflow.data.fingerprint import DataChangedError, fingerprint_changes, stage_fingerprint
from nanoflow.schedule import Schedule
from nanoflow.training.loop import train


@pytest.fixture
def run(tmp_path):
    """A run stopped after step 4 of 10: stage "pretrain" (text files) has begun, stage "sft" (step 7 on) has not."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in "ab":
        (corpus / f"{name}.txt").write_text(f"document {name} " * 200)
    rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(40)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = write_config(tmp_path, [
        stage("pretrain", 1, {"hf_dataset_or_datasets": "text", "hf_data_files": "corpus/*.txt"}),
        stage("sft", 7, {"hf_dataset_or_datasets": "json", "hf_data_files": "sft.jsonl",
                         "prompt_column_name": "prompt", "completion_column_name": "completion"}),
    ], train_steps=10)
    train(load_config(config, ["checkpoints.checkpoint_interval=2"]), until_step=4, out=quiet())
    return config


def resume(config: Path, *overrides: str, out=None):
    return Checkpointer(load_config(config, list(overrides)), out=out or quiet()).restore()


def test_the_checkpoint_records_the_begun_stages_only(run):
    saved = io.read_metadata(str(run.parent / "checkpoints"))["data_fingerprint"]
    assert list(saved) == ["pretrain"]
    entry = saved["pretrain"]
    assert (entry["tokenizer"], entry["general.seed"], entry["data.seed"]) == ("bytes", 5, 5)
    files = entry["sources"]["text"]["files"]
    assert sorted(files) == [str(run.parent / "corpus" / "a.txt"), str(run.parent / "corpus" / "b.txt")]
    assert files[str(run.parent / "corpus" / "a.txt")]["bytes"] == len("document a " * 200)
    assert resume(run).step == 4   # unchanged data resumes


@pytest.mark.parametrize("change, expected", [
    (["data_stages.pretrain.data.seed=99"], 'stage "pretrain": data.seed: was 5, now 99'),
    (["general.seed=6"], 'stage "pretrain": general.seed: was 5, now 6'),
    (['data_stages.pretrain.data.dataset.text_column_name="body"'], "columns: was ['text'], now ['body']"),
    (["tokens.document_masking=true"], 'stage "pretrain": document_masking: was False, now True'),
    (["data_stages.pretrain.document_masking=true"], 'stage "pretrain": document_masking: was False, now True'),
    (['data_stages.pretrain.data.dataset.sample_by="line"'], "source text sample_by: new (now line)"),
])
def test_another_seed_or_column_of_a_begun_stage_is_refused(run, change, expected):
    with pytest.raises(DataChangedError, match="ignore_fingerprint_mismatch") as error:
        resume(run, *change)
    assert expected in str(error.value)


def test_another_tokenizer_is_refused(run):
    tokenizer = write_word_level_tokenizer(run.parent / "tokenizer.json", ["<|endoftext|>"])
    with pytest.raises(DataChangedError, match=r'stage "pretrain": tokenizer: was bytes, now sha256:[0-9a-f]{12}…'):
        resume(run, f'tokenizer.tokenizer_name_or_path="{tokenizer}"')


def test_another_data_file_is_refused(run):
    (run.parent / "corpus" / "c.txt").write_text("a third document")
    with pytest.raises(DataChangedError, match=r'stage "pretrain": source text file .*c\.txt: new \(now 16 bytes'):
        resume(run)
    (run.parent / "corpus" / "c.txt").unlink()
    (run.parent / "other.txt").write_text("document a " * 200)
    with pytest.raises(DataChangedError) as error:
        resume(run, f'data_stages.pretrain.data.dataset.hf_data_files="{run.parent / "other.txt"}"')
    assert "a.txt: no longer read" in str(error.value) and "other.txt: new" in str(error.value)


def test_the_same_file_with_new_content_is_refused_even_at_the_same_size(run):
    path = run.parent / "corpus" / "a.txt"
    stat = path.stat()
    path.write_text("document A " * 200)                         # same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))      # and the same modification time
    with pytest.raises(DataChangedError, match=r"a\.txt: was 2200 bytes, sha256 \w+…, now 2200 bytes, sha256"):
        resume(run)


def test_bin_train_exits_2_naming_the_change_without_a_traceback(run, capsys):
    (run.parent / "corpus" / "b.txt").write_text("changed")
    result = run_in_process("train", run, capsys=capsys)
    assert result.returncode == 2, result.stderr
    assert "b.txt: was 2200 bytes" in result.stderr and "Traceback" not in result.stderr
    assert io.read_metadata(str(run.parent / "checkpoints"))["step"] == 4   # nothing trained, nothing saved


def test_masking_a_begun_stage_is_refused_both_ways_and_a_later_stage_may_take_it(run, tmp_path):
    assert resume(run, "data_stages.sft.document_masking=true").step == 4     # not begun: free
    fingerprints = {"pretrain": {"tokenizer": "bytes", "sources": {}}}
    masked = {"pretrain": {"tokenizer": "bytes", "sources": {}, "document_masking": True}}
    assert fingerprint_changes(fingerprints, fingerprints) == []
    assert fingerprint_changes(masked, fingerprints) == ['stage "pretrain": document_masking: was True, now False']


def test_a_stage_not_begun_may_change_freely(run):
    (run.parent / "sft.jsonl").write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    assert resume(run, "data_stages.sft.data.seed=123").step == 4


def test_the_accept_key_resumes_with_a_loud_warning_and_records_the_new_data(run):
    (run.parent / "corpus" / "b.txt").write_text("changed")
    out = quiet()
    config = load_config(run, ["checkpoints.ignore_fingerprint_mismatch=true", "checkpoints.checkpoint_interval=2"])
    before = Checkpointer(config, out=quiet()).restore()
    state = train(config, until_step=6, out=out)
    assert state.step == 6 and before.step == 4
    # one warning (the channel's "warning: " prefix, where the text said "WARNING: " itself before logging)
    assert "warning: " + str(run.parent / "checkpoints" / "4") + ": the data of stages" in out.getvalue()
    assert "b.txt: was 2200 bytes" in out.getvalue()
    assert "ignore_fingerprint_mismatch" in out.getvalue()
    files = io.read_metadata(str(run.parent / "checkpoints"))["data_fingerprint"]["pretrain"]["sources"]["text"]["files"]
    assert files[str(run.parent / "corpus" / "b.txt")]["bytes"] == len("changed")
    assert resume(run).step == 6   # accepted once: the new checkpoint holds the new fingerprint


def test_large_sources_are_identified_by_size_and_modification_time(run, monkeypatch):
    monkeypatch.setattr(fp, "HASH_LIMIT", 4000)   # the two corpus files total 4400 bytes
    config = load_config(run)
    before = stage_fingerprint(config, 0, ByteTokenizer(), Schedule.from_config(config))
    assert all(set(identity) == {"bytes", "mtime_ns"} for identity in before["sources"]["text"]["files"].values())
    path = run.parent / "corpus" / "a.txt"
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))   # touched, same content: counts as changed
    changes = fingerprint_changes({"pretrain": before}, {"pretrain": stage_fingerprint(config, 0, ByteTokenizer(), Schedule.from_config(config))})
    assert len(changes) == 1 and "a.txt: was 2200 bytes, modified at" in changes[0]


def test_token_folder_fingerprint_covers_tokens_index_and_metadata(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "tokens"
    docs = [np.append(rng.integers(0, 250, 20), 256) for _ in range(10)]
    write_folder(folder, docs, files=2)
    config = load_config(write_config(tmp_path, [stage("pretrain", 1, {"dataset_folder": str(folder)})]))
    before = stage_fingerprint(config, 0, ByteTokenizer(), Schedule.from_config(config))
    files = before["sources"][str(folder)]["files"]
    assert {Path(p).name for p in files} == {f"0000{k}_unshuffled.ds{s}" for k in (0, 1) for s in ("", ".index", ".metadata")}
    index = folder / "00001_unshuffled.ds.index"
    ends = np.fromfile(index, dtype="<u8")
    ends[0] += 1
    ends.tofile(index)   # same size, another document boundary
    changes = fingerprint_changes({"pretrain": before}, {"pretrain": stage_fingerprint(config, 0, ByteTokenizer(), Schedule.from_config(config))})
    assert len(changes) == 1 and "00001_unshuffled.ds.index: was" in changes[0]



def test_a_saved_dataset_folder_is_fingerprinted_by_its_files(tmp_path):
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["one document", "another"]}).save_to_disk(str(folder))
    config = load_config(write_config(tmp_path, [stage("pretrain", 1, {"hf_dataset_or_datasets": str(folder)})]))
    before = stage_fingerprint(config, 0, ByteTokenizer(), Schedule.from_config(config))
    assert any(p.endswith(".arrow") for p in before["sources"][str(folder)]["files"])
    assert fingerprint_changes({"pretrain": before}, {"pretrain": stage_fingerprint(config, 0, ByteTokenizer(), Schedule.from_config(config))}) == []
    datasets.Dataset.from_dict({"text": ["one document", "changed"]}).save_to_disk(str(folder))
    changes = fingerprint_changes({"pretrain": before}, {"pretrain": stage_fingerprint(config, 0, ByteTokenizer(), Schedule.from_config(config))})
    assert changes and all(c.startswith(f'stage "pretrain": source {folder} file {folder}/') for c in changes)


# ---------------------------------------------------------------------------------------------
# A source is what it holds, not where it lies: moved or copied bytes resume, changed bytes do not

def test_a_cooldown_branch_in_another_folder_with_a_copy_of_the_data_resumes_exactly(run, tmp_path):
    from nanoflow.io import read_model

    branch = tmp_path / "elsewhere"
    shutil.copytree(run.parent / "corpus", branch / "corpus", copy_function=shutil.copyfile)  # new mtimes too
    settings = [f'checkpoints.checkpoints_path="{branch / "checkpoints"}"',
                f'checkpoints.resume_checkpoint_path="{run.parent / "checkpoints"}"',
                f'data_stages.pretrain.data.dataset.hf_data_files="{branch / "corpus"}/*.txt"',
                "checkpoints.checkpoint_interval=2"]
    out = quiet()
    assert train(load_config(run, settings), until_step=6, out=out).step == 6
    moved = [line for line in out.getvalue().splitlines() if "the same bytes" in line]
    assert moved == [f'data moved: stage "pretrain": source text: its 2 files are now read from {branch / "corpus"} '
                     f'(were in {run.parent / "corpus"}), the same bytes'], out.getvalue()
    train(load_config(run, ["checkpoints.checkpoint_interval=2"]), until_step=6, out=quiet())   # the trunk, on
    ours, trunk = read_model(str(branch / "checkpoints")), read_model(str(run.parent / "checkpoints"))
    assert ours.keys() == trunk.keys() and all(torch.equal(ours[k], trunk[k]) for k in ours)


def test_a_moved_file_is_said_and_a_changed_copy_is_still_refused(run, tmp_path):
    (tmp_path / "disk2").mkdir()
    for name in "ab":
        shutil.move(run.parent / "corpus" / f"{name}.txt", tmp_path / "disk2" / f"{name}.txt")
    moved = f'data_stages.pretrain.data.dataset.hf_data_files="{tmp_path / "disk2"}/*.txt"'
    out = quiet()
    assert resume(run, moved, out=out).step == 4
    assert "source text: its 2 files are now read from" in out.getvalue()
    (tmp_path / "disk2" / "b.txt").write_text("document b " * 199 + "document c ")   # same size, other bytes
    with pytest.raises(DataChangedError) as error:
        resume(run, moved)
    assert "b.txt: new (now 2200 bytes, sha256" in str(error.value)


def test_a_moved_source_of_a_blend_is_refused_saying_why(tmp_path):
    rng = np.random.default_rng(0)
    for name in ("one", "two"):
        write_folder(tmp_path / name, [np.append(rng.integers(0, 250, 20), 256) for _ in range(20)])
    config = write_config(tmp_path, [stage("pretrain", 1, {"dataset_folder": [str(tmp_path / "one"),
                                                                              str(tmp_path / "two")],
                                                           "dataset_weights": [0.5, 0.5]})], train_steps=6)
    train(load_config(config), until_step=2, out=quiet())
    shutil.move(tmp_path / "two", tmp_path / "moved")
    with pytest.raises(DataChangedError) as error:
        resume(config, f'data_stages.pretrain.data.dataset.dataset_folder=["{tmp_path / "one"}", '
                       f'"{tmp_path / "moved"}"]')
    assert (f'stage "pretrain": source {tmp_path / "two"} is now read from {tmp_path / "moved"}, the same bytes, but '
            "in a stage of several sources each one's sample order is drawn from its location") in str(error.value)


def test_a_large_source_moved_with_its_times_is_the_same_and_one_copied_without_them_is_told_why(run, tmp_path,
                                                                                                monkeypatch):
    monkeypatch.setattr(fp, "HASH_LIMIT", 4000)   # the two corpus files (4400 bytes) are identified by mtime

    def fingerprint(folder: Path) -> dict:
        config = load_config(run, [f'data_stages.pretrain.data.dataset.hf_data_files="{folder}/*.txt"'])
        return {"pretrain": stage_fingerprint(config, 0, ByteTokenizer(), Schedule.from_config(config))}

    before = fingerprint(run.parent / "corpus")
    shutil.move(run.parent / "corpus", tmp_path / "disk2")                     # a move keeps the times
    assert fp.compare_fingerprints(before, fingerprint(tmp_path / "disk2")) == ([], [
        f'stage "pretrain": source text: its 2 files are now read from {tmp_path / "disk2"} (were in '
        f'{run.parent / "corpus"}), the same bytes'])
    shutil.copytree(tmp_path / "disk2", tmp_path / "disk3", copy_function=shutil.copyfile)   # new times
    changes, moves = fp.compare_fingerprints(before, fingerprint(tmp_path / "disk3"))
    assert moves == [] and changes[-1].startswith('stage "pretrain": source text: the same file sizes, but a source '
                                                  "over 0 MiB is identified by size and modification time")
    assert "cp -p" in changes[-1] and len(changes) == 5   # 2 files no longer read, 2 new, the hint
