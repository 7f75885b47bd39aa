"""What a stage's data is: which sources exist (one definition for the check before the run and for the loader),
which split of a split list is trained on, how much a source holds out, and where its tokens are cached."""

from __future__ import annotations

import json

import numpy as np
import pytest
from data_helpers import BYTES, documents, load, stage, write_folder

from nanoflow.config import ConfigError
from nanoflow.data import open_stage
from nanoflow.data.tokens import StageDataError
from nanoflow.schedule import Schedule

# ---------------------------------------------------------------------------------------------
# held_out_samples at least the source's samples: nothing would be left to train on

def test_held_out_samples_of_the_whole_source_names_the_stage_the_source_and_both_numbers(tmp_path):
    (tmp_path / "corpus.txt").write_text("some words of prose " * 10)        # 200 bytes: 12 windows of 16
    config = load(tmp_path, [stage("pretrain", 1, {"hf_dataset_or_datasets": "text", "hf_data_files": "corpus.txt",
                                                   "held_out_samples": 12})])
    with pytest.raises(StageDataError, match=r'stage "pretrain" \(text files .*corpus.txt\): held_out_samples = 12 '
                                             r"leaves nothing to train on: the source has 12 samples"):
        open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=str(tmp_path / "cache"))
    write_folder(tmp_path / "tokens", documents(np.random.default_rng(0), 4, 0, 200, (20, 21)))   # 84 tokens: 5
    config = load(tmp_path, [stage("pretrain", 1, {"dataset_folder": str(tmp_path / "tokens"),
                                                   "held_out_samples": 9})])
    with pytest.raises(StageDataError, match=r'stage "pretrain" \(dataset_folder .*tokens\): held_out_samples = 9 '
                                             r"leaves nothing to train on: the source has 5 samples"):
        open_stage(config, 0, BYTES, Schedule.from_config(config))


# ---------------------------------------------------------------------------------------------
# One definition of "a data source that exists" : the check before the run and the loader

def _saved(folder, rows):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": rows})}).save_to_disk(str(folder))


@pytest.fixture
def every_kind(tmp_path):
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": f"jsonl row {i} " * 8}) + "\n" for i in range(8)))
    (tmp_path / "prose").mkdir()
    for i in range(3):
        (tmp_path / "prose" / f"{i}.txt").write_text(f"prose document {i} " * 12)
    _saved(tmp_path / "saved", [f"saved row {i} " * 8 for i in range(8)])
    write_folder(tmp_path / "tokens", documents(np.random.default_rng(0), 8, 0, 200, (30, 31)))
    return tmp_path


KINDS = {   # a stage's dataset naming each kind of source, and the path whose removal makes it missing
    "file": ({"hf_dataset_or_datasets": "json", "hf_data_files": "rows.jsonl"}, "rows.jsonl"),
    "file in a table": ({"hf_dataset_or_datasets": {"rows.jsonl": 1.0}}, "rows.jsonl"),
    "glob": ({"hf_dataset_or_datasets": "text", "hf_data_files": "prose/*.txt"}, "prose"),
    "glob in a table": ({"hf_dataset_or_datasets": {"prose/*.txt": 1.0}}, "prose"),
    "saved folder": ({"hf_dataset_or_datasets": "./saved"}, "saved"),   # "./": a local path even when gone
    "saved folder in a table": ({"hf_dataset_or_datasets": {"./saved": 0.5, "rows.jsonl": 0.5}}, "saved"),
    "token folder": ({"dataset_folder": "tokens"}, "tokens"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_of_source_the_check_accepts_trains_and_one_that_is_gone_is_refused_alike(every_kind, kind):
    import shutil

    dataset, path = KINDS[kind]
    if "dataset_folder" in dataset:
        dataset = {"dataset_folder": str(every_kind / dataset["dataset_folder"])}
    config = load(every_kind, [stage("pretrain", 1, dataset)])      # the check before the run accepts it ...
    with open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=str(every_kind / "cache")) as loader:   # ... and the loader reads it
        assert loader.samples(0, 8)["input_ids"].shape == (8, 16)
    target = every_kind / path
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(ConfigError) as refused:
        load(every_kind, [stage("pretrain", 1, dataset)])
    problem = str(refused.value).split(".data.dataset: ")[-1]
    with pytest.raises(StageDataError) as gone:                     # gone between the check and the load
        open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=str(every_kind / "no-cache"))
    assert problem.split(": ", 1)[-1].split(" (")[0] in str(gone.value)


def test_a_table_key_that_is_a_saved_folder_is_not_refused_as_matching_only_folders(every_kind):
    # nanotron's hf_dataset_or_datasets: {name: weight} with a local copy saved by save_to_disk (3835de9 refused it)
    config = load(every_kind, [stage("pretrain", 1, {"hf_dataset_or_datasets": {"saved": 0.5, "rows.jsonl": 0.5}})])
    with open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=str(every_kind / "cache")) as loader:
        text = "".join(BYTES.decode(row.tolist()) for row in loader.samples(0, 40)["input_ids"])
    assert "saved row" in text and "jsonl row" in text


def test_a_folder_that_save_to_disk_did_not_write_is_refused_before_the_run_saying_what_it_is(every_kind):
    with pytest.raises(ConfigError, match=r"prose is a folder, but not one written by save_to_disk .*name them with a "
                                          r"glob such as .*prose/\*\.txt"):
        load(every_kind, [stage("pretrain", 1, {"hf_dataset_or_datasets": {"prose": 1.0}})])
    with pytest.raises(ConfigError, match=r"tokens is a folder, but not one written by save_to_disk .*it holds token "
                                          r"files \(\*\.ds\): name it in dataset_folder"):
        load(every_kind, [stage("pretrain", 1, {"hf_dataset_or_datasets": "tokens"})])


def test_a_hub_id_is_located_on_the_hub_by_the_check_and_by_the_loader(every_kind):
    from nanoflow.config import locate_source
    from nanoflow.data.hf_datasets import hf_specs

    config = load(every_kind, [stage("pretrain", 1, {"hf_dataset_or_datasets": {"someone/corpus": 1.0}})])
    dataset = config.data_stages[0].data.dataset
    assert locate_source(dataset, "someone/corpus").kind == "hub"
    assert [spec.kind for spec in hf_specs(dataset)] == ["hub"]


# ---------------------------------------------------------------------------------------------
# A token cache that cannot be written: exit 2 naming the file, not a traceback


def test_a_file_in_the_way_of_the_token_cache_names_the_cache_and_what_to_do(tmp_path, rows):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "nanoflow-tokens").write_text("not a folder")
    with pytest.raises(StageDataError, match=r'stage "pretrain" \(json files .*rows.jsonl\): cannot write the token '
                                             r"cache .*cache/nanoflow-tokens/\w+\.npy: .*remove what is in the way"):
        open_stage(rows, 0, BYTES, Schedule.from_config(rows), cache_dir=str(tmp_path / "cache"))
    assert (tmp_path / "cache" / "nanoflow-tokens").read_text() == "not a folder"


def test_an_eval_set_reads_one_split_so_a_list_is_refused(every_kind):
    from data_helpers import write_config

    from nanoflow.config import load_config

    path = write_config(every_kind, [stage("pretrain", 1, {"hf_dataset_or_datasets": "./saved"})])
    path.write_text(path.read_text() + '\n[[evaluation.datasets]]\nname = "held"\n[evaluation.datasets.dataset]\n'
                    'hf_dataset_or_datasets = "./saved"\nhf_dataset_splits = ["train", "validation"]\n')
    with pytest.raises(ConfigError, match=r'evaluation.datasets\[0\] \("held"\).dataset.hf_dataset_splits: an eval set '
                                          r"reads one split"):
        load_config(path)
