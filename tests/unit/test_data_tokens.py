"""Token folders: the datatrove / Nanoset layout, read and written; and every bad input, caught before step 1."""

import os
import struct
from pathlib import Path

import numpy as np
import pytest
from data_helpers import BYTES, EOS, documents, load, stage, write_folder

from nanoflow.config import ConfigError
from nanoflow.data import SampleReadError, TokenFolder, TokenFolderError, open_stage, write_token_file
from nanoflow.data.sources import PackedText
from nanoflow.schedule import Schedule


def test_writer_follows_the_documented_layout(tmp_path):
    docs = [np.array([1, 2, 3, EOS]), np.array([EOS]), np.array([70, 71, EOS])]
    stats = write_token_file(tmp_path, "part", docs, tokenizer_name="bytes", token_size=2)
    assert stats["tokens"] == 8 and stats["documents"] == 3
    stream = np.concatenate(docs)
    assert (tmp_path / "part.ds").read_bytes() == stream.astype("<u2").tobytes()
    assert (tmp_path / "part.ds.index").read_bytes() == struct.pack("<3Q", 4, 5, 8)
    lines = (tmp_path / "part.ds.metadata").read_text().splitlines()
    assert lines[:2] == ["bytes|2", "8"]
    assert sorted(os.listdir(tmp_path)) == ["part.ds", "part.ds.index", "part.ds.metadata"]   # no temporaries left
    with pytest.raises(ValueError, match="does not fit in 2 bytes"):
        write_token_file(tmp_path, "big", [np.array([70_000])], tokenizer_name="x", token_size=2)
    assert not (tmp_path / "big.ds").exists()
    assert sorted(os.listdir(tmp_path)) == ["part.ds", "part.ds.index", "part.ds.metadata"]   # nor of a failed one


def _datatrove_file(folder: Path, name: str, docs: list[list[int]], first_line: str, fmt: str) -> None:
    """A token file written from the format's description alone (struct, not nanoflow's writer)."""
    folder.mkdir(parents=True, exist_ok=True)
    flat = [t for d in docs for t in d]
    (folder / f"{name}.ds").write_bytes(struct.pack(f"<{len(flat)}{fmt}", *flat))
    ends = np.cumsum([len(d) for d in docs]).tolist()
    (folder / f"{name}.ds.index").write_bytes(struct.pack(f"<{len(ends)}Q", *ends))
    (folder / f"{name}.ds.metadata").write_text(f"{first_line}\n{len(flat)}\n{len(flat)} T")


@pytest.mark.parametrize("first_line, fmt, size", [("gpt2|4", "I", 4), ("gpt2|2", "H", 2), ("gpt2", "H", 2)])
def test_reads_a_datatrove_folder_written_from_the_format(tmp_path, first_line, fmt, size):
    big = 70_000 if size == 4 else 60_000
    a = [[5, 6, 7, 50256], [big, 50256]]
    b = [[1, 2, 3, 4, 5, 50256]]
    _datatrove_file(tmp_path, "00001_unshuffled", b, first_line, fmt)   # sorted by name: 00000 comes first
    _datatrove_file(tmp_path, "00000_unshuffled", a, first_line, fmt)
    (tmp_path / "notes.txt").write_text("not a token file")
    folder = TokenFolder(tmp_path)
    stream = [t for d in a + b for t in d]
    assert (folder.tokenizer_name, folder.token_size, len(folder)) == ("gpt2", size, len(stream))
    assert folder[0:len(stream)].tolist() == stream
    assert folder[4:9].tolist() == stream[4:9] and folder[4:9].dtype == np.int64       # across the file boundary
    assert [f.documents for f in folder.files] == [2, 1]
    windows = PackedText(folder, 4)
    assert len(windows) == (len(stream) - 1) // 4
    assert [windows.sample(i)[0].tolist() for i in range(len(windows))] == [stream[i * 4:i * 4 + 4]
                                                                              for i in range(len(windows))]
    assert windows.sample(1)[1].tolist() == stream[5:9]
    assert "00001_unshuffled.ds at token 0" in windows.locate(1) or "00000_unshuffled.ds" in windows.locate(1)


# ---------------------------------------------------------------------------------------------
# Checks against the run, at load time

def folder_stage(folder, **kwargs):
    return stage("pretrain", 1, {"dataset_folder": str(folder)}, **kwargs)


@pytest.fixture
def folder(tmp_path):
    write_folder(tmp_path / "tokens", documents(np.random.default_rng(0), 60, 0, 200), files=2)
    return tmp_path / "tokens"


def test_a_folder_of_another_tokenizer_is_refused_before_step_1(tmp_path):
    write_folder(tmp_path / "gpt2", documents(np.random.default_rng(0), 20, 0, 200), tokenizer_name="gpt2")
    config = load(tmp_path, [folder_stage(tmp_path / "gpt2")])
    with pytest.raises(TokenFolderError, match=r'stage "pretrain" \(dataset_folder .*gpt2\): tokenized with "gpt2", '
                                               r'.*this run\'s tokenizer \(?bytes'):
        open_stage(config, 0, BYTES, Schedule.from_config(config))


def test_a_folder_of_another_token_size_is_refused(tmp_path):
    write_folder(tmp_path / "wide", documents(np.random.default_rng(0), 20, 0, 200), token_size=4)
    config = load(tmp_path, [folder_stage(tmp_path / "wide")])
    with pytest.raises(TokenFolderError, match="stores 4-byte tokens, but the tokenizer's vocabulary of 257 ids is "
                                               "stored in 2-byte tokens"):
        open_stage(config, 0, BYTES, Schedule.from_config(config))


def test_token_ids_beyond_the_model_vocabulary(tmp_path):
    # Early in a file: refused when the loader opens. Deep in a file: the batch that reads it fails, naming
    # the file and the sample, and the error crosses from the background worker into the caller.
    rng = np.random.default_rng(1)
    early = [np.array([5, 300, EOS])] + documents(rng, 20, 0, 200)
    write_folder(tmp_path / "early", early)
    with pytest.raises(TokenFolderError, match=r"early.*00000_unshuffled\.ds holds token id 300, outside "
                                               r"model.vocab_size = 288"):
        open_stage(config := load(tmp_path, [folder_stage(tmp_path / "early")]), 0, BYTES, Schedule.from_config(config))

    late = [np.full(70_000, 7)] + [np.array([9, 290, EOS])] + [np.full(100, 8)]
    write_folder(tmp_path / "late", late)
    config = load(tmp_path, [folder_stage(tmp_path / "late", data={"num_loading_workers": 2})],
                  sequence_length=64, micro_batch_size=8, accumulation=16)    # 128 samples a step: ~all of them
    with open_stage(config, 0, BYTES, Schedule.from_config(config)) as loader:
        with pytest.raises(SampleReadError, match=r'stage "pretrain": sample \d+ \(dataset_folder .*late, window \d+: '
                                            r'.*00000_unshuffled\.ds at token 6\d{4}\): token id 290 is outside '
                                            r'model.vocab_size = 288'):
            for step in loader.steps:
                loader.batch_at(step)


def test_truncated_and_inconsistent_files_are_refused(tmp_path, folder):
    config = load(tmp_path, [folder_stage(folder)])
    open_stage(config, 0, BYTES, Schedule.from_config(config)).close()
    ds = folder / "00001_unshuffled.ds"
    good = ds.read_bytes()

    ds.write_bytes(good + b"\x01")                  # half a token
    with pytest.raises(TokenFolderError, match=r'stage "pretrain" \(dataset_folder .*tokens\): .*00001_unshuffled.ds: '
                                               r'\d+ bytes is not a whole number of 2-byte tokens; the file is truncated'):
        open_stage(config, 0, BYTES, Schedule.from_config(config))

    ds.write_bytes(good[:-2])                        # one token short of what the index says
    with pytest.raises(TokenFolderError, match=r'stage "pretrain".*00001_unshuffled.ds: its index does not match it'):
        open_stage(config, 0, BYTES, Schedule.from_config(config))

    ds.write_bytes(good)
    (folder / "00001_unshuffled.ds.metadata").unlink()
    with pytest.raises(TokenFolderError, match=r"00001_unshuffled.ds: no 00001_unshuffled.ds.metadata beside it"):
        open_stage(config, 0, BYTES, Schedule.from_config(config))

    (folder / "00001_unshuffled.ds.metadata").write_text("gpt2|2\n1\n")
    with pytest.raises(TokenFolderError, match="mixes tokenizers or token sizes"):
        open_stage(config, 0, BYTES, Schedule.from_config(config))


def test_missing_and_empty_folders_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r'data_stages\[0\] \(stage "pretrain"\)\.data\.dataset: dataset_folder: '
                                          r'.*nowhere does not exist'):
        load(tmp_path, [folder_stage(tmp_path / "nowhere")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r'stage "pretrain"\)\.data\.dataset: dataset_folder: .*empty holds no token '
                                          r'files \(\*\.ds\); write them with bin/prepare'):
        load(tmp_path, [folder_stage(tmp_path / "empty")])


@pytest.mark.parametrize("weights, message", [
    ([1.0, -0.5], r"dataset_weights: the weight of .*b is -0.5; weights must be finite and >= 0"),
    ([0, 0.0], "dataset_weights: every weight is zero"),
    ([1.0], "dataset_weights: 1 weights for 2 folders"),
])
def test_bad_weights_are_config_errors(tmp_path, weights, message):
    for name in "ab":
        write_folder(tmp_path / name, documents(np.random.default_rng(0), 20, 0, 200))
    dataset = {"dataset_folder": [str(tmp_path / "a"), str(tmp_path / "b")], "dataset_weights": weights}
    with pytest.raises(ConfigError, match=r'stage "pretrain"\)\.data\.dataset: ' + message):
        load(tmp_path, [stage("pretrain", 1, dataset)])


def test_bad_hf_table_weights_are_config_errors(tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 50)
    with pytest.raises(ConfigError, match=r"hf_dataset_or_datasets: the weight of .*a.txt is -1.0"):
        load(tmp_path, [stage("pretrain", 1, {"hf_dataset_or_datasets": {"a.txt": -1}})])
    with pytest.raises(ConfigError, match=r"hf_dataset_or_datasets: every weight is zero"):
        load(tmp_path, [stage("pretrain", 1, {"hf_dataset_or_datasets": {"a.txt": 0}})])
    with pytest.raises(ConfigError, match=r"data\.dataset\.hf_dataset_or_datasets: expected a number as the weight "
                                          r"of '.*a.txt', got 'x'"):
        load(tmp_path, [stage("pretrain", 1, {"hf_dataset_or_datasets": {"a.txt": "x"}})])


def test_a_folder_smaller_than_one_batch_is_refused(tmp_path):
    write_folder(tmp_path / "small", [np.append(np.arange(40), EOS)])          # 41 tokens: 2 windows of 16
    config = load(tmp_path, [folder_stage(tmp_path / "small")])                  # global batch 4
    with pytest.raises(ValueError, match=r'stage "pretrain" \(dataset_folder .*small\): 2 samples of sequence_length '
                                         r"16, fewer than the 4 that each global batch of 4 reads from it"):
        open_stage(config, 0, BYTES, Schedule.from_config(config))


def test_continue_from_mistakes_are_config_errors(tmp_path, folder):
    dataset = {"dataset_folder": str(folder)}
    (tmp_path / "a.txt").write_text("text " * 100)
    other = {"hf_dataset_or_datasets": "text", "hf_data_files": str(tmp_path / "a.txt")}
    cases = [
        ([stage("a", 1, dataset), stage("b", 5, dataset, data={"continue_from": "zzz"})],
         r'stage "b"\)\.data\.continue_from: "zzz" is not a stage that starts before stage "b" \(earlier stages: "a"\)'),
        ([stage("a", 1, dataset, data={"continue_from": "b"}), stage("b", 5, dataset)],
         r'stage "a"\)\.data\.continue_from: "b" is not a stage that starts before'),
        ([stage("a", 1, dataset), stage("b", 5, dataset, sequence_length=8, data={"continue_from": "a"})],
         r'continue_from: continuing stage "a" needs its sequence_length \(16\), but this stage has 8'),
        ([stage("a", 1, dataset), stage("b", 5, other, data={"continue_from": "a"})],
         r'continue_from: stage "b" reads none of the sources of stage "a"'),
    ]
    for stages, message in cases:
        with pytest.raises(ConfigError, match=message):
            load(tmp_path, stages)


def test_batched_gathers_equal_one_sample_at_a_time(tmp_path):
    from nanoflow.data.sources import SFTExamples

    rng = np.random.default_rng(3)
    write_folder(tmp_path / "f", documents(rng, 40, 0, 250, length=(1, 30)), files=5)   # many file boundaries
    stream = TokenFolder(tmp_path / "f")
    table = np.full((6, 9 + 2), EOS, np.int32)
    for row in range(6):
        text = rng.integers(0, 250, rng.integers(2, 10))
        table[row, :len(text)] = text
        table[row, 9:] = rng.integers(0, len(text)), len(text)
    for source in (PackedText(stream, 7), PackedText(stream[0:len(stream)], 7), SFTExamples.from_table(table)):
        indices = rng.integers(0, len(source), 50)
        inputs, labels, _ = source.samples(indices)
        for row, i in enumerate(indices):
            one = source.sample(int(i))
            assert inputs[row].tolist() == one[0].tolist() and labels[row].tolist() == one[1].tolist()
