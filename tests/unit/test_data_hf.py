"""HF sources beyond one local builder: {name = weight} blends, split lists, the token cache, hub names offline."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from data_helpers import BYTES, load, stage, zstd_frame

import nanoflow.data.hf_datasets as hf_datasets
from nanoflow.config import ConfigError, untrained_splits
from nanoflow.data import open_stage
from nanoflow.data.hf_datasets import hf_specs, load_rows
from nanoflow.data.sources import PackedText
from nanoflow.schedule import Schedule


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "prose").mkdir()
    for i in range(4):
        (tmp_path / "prose" / f"{i}.txt").write_text(f"prose document {i}: " + "lorem ipsum dolor " * (10 + i))
    with open(tmp_path / "rows.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"ROW {i} " + "XYZ " * (i % 7 + 3), "other": i}) + "\n")
    return tmp_path


def table_stage(corpus, **data):
    # Keys are paths relative to the TOML file (written into corpus/): a glob of text files, a jsonl file. The
    # column (text_column_name, "text" by default) is the same for every entry; the text builder's is "text".
    return stage("pretrain", 1, {"hf_dataset_or_datasets": {"prose/*.txt": 0.25, "rows.jsonl": 0.75}}, data=data)


def is_jsonl_row(row: torch.Tensor) -> bool:
    text = BYTES.decode(row.tolist())
    return "XYZ" in text or "ROW" in text


def test_a_table_of_datasets_blends_local_globs_and_files(corpus):
    config = load(corpus, [table_stage(corpus)], micro_batch_size=4)           # global batch 8
    names = config.data_stages[0].data.dataset.hf_dataset_or_datasets
    assert list(names) == [str(corpus / "prose/*.txt"), str(corpus / "rows.jsonl")]   # resolved next to the TOML
    specs = hf_specs(config.data_stages[0].data.dataset)
    assert [s.builder for s in specs] == ["text", "json"] and len(specs[0].files) == 4
    with open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=str(corpus / "cache")) as loader:
        assert [type(p.source) for p in loader.parts] == [PackedText, PackedText]
        rows = loader.samples(0, 400)["input_ids"]
        share = sum(is_jsonl_row(r) for r in rows) / len(rows)
        assert abs(share - 0.75) < 0.05
        fresh = open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=str(corpus / "cache"))
        assert torch.equal(fresh.samples(123, 50)["input_ids"], rows[123:173])      # seek, HF blend
        for step in (1, 2, 7):
            whole = loader.batch_at(step)["input_ids"]
            assert torch.equal(torch.cat([fresh.batch_at(step, r, 2)["input_ids"] for r in range(2)]), whole)
        fresh.close()


def test_a_missing_column_in_a_table_names_the_stage_and_files(corpus):
    stages = [stage("pretrain", 1, {"hf_dataset_or_datasets": {"rows.jsonl": 1.0}, "text_column_name": "nope"})]
    config = load(corpus, stages)
    with pytest.raises(ValueError, match=r'stage "pretrain" \(json files .*rows.jsonl\): no column "nope"; '
                                         r"the columns are text, other"):
        open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=str(corpus / "cache"))


def test_a_table_rejects_hf_data_files_and_builder_keys(corpus):
    with pytest.raises(ConfigError, match="hf_data_files: a table of datasets names its files in its keys"):
        load(corpus, [stage("p", 1, {"hf_dataset_or_datasets": {"rows.jsonl": 1.0}, "hf_data_files": "x"})])
    with pytest.raises(ConfigError, match='hf_dataset_or_datasets: "json" needs files'):
        load(corpus, [stage("p", 1, {"hf_dataset_or_datasets": {"json": 1.0}})])


def test_a_list_of_splits_trains_on_train_only_and_every_listed_split_must_exist(tmp_path):
    # nanotron's run_train.py loads the listed splits and trains on get_datasets(...)["train"]
    import datasets

    parts = {"train": [f"train {i} " * 20 for i in range(5)], "validation": [f"valid {i} " * 20 for i in range(3)]}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in parts.items()}).save_to_disk(
        str(tmp_path / "saved"))
    config = load(tmp_path, [stage("p", 1, {"hf_dataset_or_datasets": "saved",
                                            "hf_dataset_splits": ["validation", "train"]})])
    assert load_rows(config.data_stages[0].data.dataset, "p")["text"] == parts["train"]
    with open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=str(tmp_path / "cache")) as loader:
        text = "".join(BYTES.decode(row.tolist()) for row in loader.samples(0, 40)["input_ids"])
    assert "train" in text and "valid" not in text
    assert untrained_splits(config) == [
        "stage \"p\": hf_dataset_splits = ['validation', 'train'] trains on \"train\" only, as nanotron does; "
        'not trained on: "validation" (not evaluated either)']
    with pytest.raises(ConfigError, match=r"hf_dataset_splits: no split 'dev' in .*saved: its splits are train, "
                                          r"validation"):
        load(tmp_path, [stage("p", 1, {"hf_dataset_or_datasets": "saved", "hf_dataset_splits": ["train", "dev"]})])
    with pytest.raises(ConfigError, match=r'a list of splits trains on "train", as in nanotron, and '
                                          r"\['validation'\] does not list it"):
        load(tmp_path, [stage("p", 1, {"hf_dataset_or_datasets": "saved", "hf_dataset_splits": ["validation"]})])
    (tmp_path / "rows.jsonl").write_text('{"text": "a row"}\n')
    with pytest.raises(ConfigError, match=r"no split 'validation' in json files .*rows.jsonl: local files make one split, \"train\""):
        load(tmp_path, [stage("p", 1, {"hf_dataset_or_datasets": "json", "hf_data_files": "rows.jsonl",
                                       "hf_dataset_splits": ["train", "validation"]})])


def test_tokenized_sources_are_cached_so_a_resume_does_not_tokenize_again(corpus, monkeypatch):
    cache = str(corpus / "cache")
    config = load(corpus, [table_stage(corpus)])
    with open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=cache) as loader:
        reference = loader.samples(0, 64)["input_ids"]
    cached = sorted(os.listdir(os.path.join(cache, "nanoflow-tokens")))
    assert len(cached) == 2 and all(name.endswith(".npy") for name in cached)

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized again")

    with monkeypatch.context() as m:              # a hit neither tokenizes nor even loads the rows
        m.setattr(hf_datasets, "tokenize_rows", refuse)
        m.setattr(hf_datasets, "load_rows", refuse)
        with open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=cache) as loader:
            assert torch.equal(loader.samples(0, 64)["input_ids"], reference)
            assert isinstance(loader.parts[0].source.tokens, np.memmap)

    calls = []
    real = hf_datasets.tokenize_rows
    monkeypatch.setattr(hf_datasets, "tokenize_rows", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    (corpus / "rows.jsonl").write_text((corpus / "rows.jsonl").read_text() + json.dumps({"text": "new", "other": 0}) + "\n")
    open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=cache).close()          # an edited file is tokenized again
    assert calls == [("text",)]
    overwrite = load(corpus, [table_stage(corpus)],
                     ["data_stages.pretrain.data.dataset.dataset_overwrite_cache=true"])
    open_stage(overwrite, 0, BYTES, Schedule.from_config(overwrite), cache_dir=cache).close()
    assert len(calls) == 3                                           # dataset_overwrite_cache: both again

    # A damaged cache file (not a .npy) is replaced, and stray temporaries of a killed writer are ignored.
    for name in os.listdir(os.path.join(cache, "nanoflow-tokens")):
        (Path(cache) / "nanoflow-tokens" / name).write_bytes(b"garbage")
    (Path(cache) / "nanoflow-tokens" / ".x.npy.tmp-1-abc").write_bytes(b"half")
    with open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=cache) as loader:
        assert loader.samples(0, 64)["input_ids"].shape == (64, 16)


@pytest.mark.slow
def test_tokenizing_in_several_processes_gives_the_same_tokens(corpus):
    one = load(corpus, [table_stage(corpus)])
    two = load(corpus, [table_stage(corpus)],
               ["data_stages.pretrain.data.dataset.dataset_processing_num_proc_per_process=2"])
    with open_stage(one, 0, BYTES, Schedule.from_config(one), cache_dir=str(corpus / "c1")) as a, \
            open_stage(two, 0, BYTES, Schedule.from_config(two), cache_dir=str(corpus / "c2")) as b:
        for pa, pb in zip(a.parts, b.parts, strict=True):
            assert np.array_equal(np.asarray(pa.source.tokens), np.asarray(pb.source.tokens))


# ---------------------------------------------------------------------------------------------
# Compressed files: read row by row as `datasets` reads them, never as one raw document


def write_gz(path: Path, data: bytes) -> Path:
    import gzip

    path.write_bytes(gzip.compress(data))
    return path


def test_the_builder_of_a_compressed_file_is_its_inner_extension_s():
    from nanoflow.config.locations import builder_for

    assert [builder_for(f"/d/x.{ext}") for ext in ("jsonl.gz", "json.bz2", "csv.xz", "jsonl.zst", "txt.gz", "gz")] \
        == ["json", "json", "csv", "json", "text", "text"]


def test_a_compressed_jsonl_blend_key_is_read_row_by_row(corpus):
    rows = (corpus / "rows.jsonl").read_bytes()
    write_gz(corpus / "docs.jsonl.gz", rows)
    stages = [stage("pretrain", 1, {"hf_dataset_or_datasets": {"docs.jsonl.gz": 1.0}})]
    config = load(corpus, stages)
    assert [s.builder for s in hf_specs(config.data_stages[0].data.dataset)] == ["json"]
    with open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=str(corpus / "cache")) as loader:
        text = "".join(BYTES.decode(row.tolist()) for row in loader.samples(0, 40)["input_ids"])
    assert "ROW" in text and '"text"' not in text and "{" not in text     # the rows' text, not JSON syntax


def test_a_bad_row_inside_a_gz_file_is_named_by_line_not_as_a_binary_file(corpus):
    rows = (corpus / "rows.jsonl").read_bytes().replace(b'"ROW 7 ', b'"ROW 7 \\x', 1)
    write_gz(corpus / "docs.jsonl.gz", rows)
    config = load(corpus, [stage("pretrain", 1, {"hf_dataset_or_datasets": {"docs.jsonl.gz": 1.0}})])
    with pytest.raises(ConfigError) as caught:
        open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=str(corpus / "cache"))
    message = str(caught.value)
    assert f"{corpus / 'docs.jsonl.gz'}, line 8" in message and "not valid JSON" in message, message
    assert "binary" not in message and "UTF-8" not in message


def test_a_damaged_gz_file_names_the_compression(corpus):
    (corpus / "docs.jsonl.gz").write_bytes(write_gz(corpus / "x.gz", b'{"text": "a"}\n').read_bytes()[:15])
    config = load(corpus, [stage("pretrain", 1, {"hf_dataset_or_datasets": {"docs.jsonl.gz": 1.0}})])
    with pytest.raises(ConfigError, match=r"docs\.jsonl\.gz: .*gzip") as caught:
        open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=str(corpus / "cache"))
    assert "binary" not in str(caught.value)


def test_a_zst_file_without_zstandard_names_the_package(corpus):
    (corpus / "docs.jsonl.zst").write_bytes(zstd_frame((corpus / "rows.jsonl").read_bytes()[:300].rpartition(b"\n")[0]
                                                       + b"\n"))
    config = load(corpus, [stage("pretrain", 1, {"hf_dataset_or_datasets": {"docs.jsonl.zst": 1.0}})], micro_batch_size=1,
                  accumulation=1)
    try:
        import zstandard  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"docs\.jsonl\.zst: .*zstandard.* pip install zstandard") as caught:
            open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=str(corpus / "cache"))
        assert "binary" not in str(caught.value)
    else:   # with the package, the frame reads as the rows it holds
        with open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=str(corpus / "cache")) as loader:
            assert "ROW 0" in BYTES.decode(loader.samples(0, 1)["input_ids"][0].tolist())


@pytest.mark.parametrize("name", ["docs.zip", "docs.tar.gz", "docs.tgz"])
def test_an_archive_is_refused_by_name(corpus, name):
    (corpus / name).write_bytes(b"PK\x03\x04 not read")
    with pytest.raises(ConfigError, match=rf"{name}.*an archive"):
        load(corpus, [stage("pretrain", 1, {"hf_dataset_or_datasets": {name: 1.0}})])
