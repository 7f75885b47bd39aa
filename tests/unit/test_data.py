"""nanoflow.data: tokenizers, the O(1) sample order, HF-datasets sources and per-stage loaders."""

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from data_helpers import BYTES, write_word_level_tokenizer
from helpers import REPO, SMALL_MODEL_TOML
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoflow.config import load_config
from nanoflow.data import IGNORE_INDEX, ByteTokenizer, TokenizerError, load_tokenizer, open_stage, sample_order
from nanoflow.data.hf_datasets import expand_data_files
from nanoflow.data.sources import PackedText, SFTExamples
from nanoflow.data.tokenizer import HFTokenizer
from nanoflow.schedule import Schedule

# ---------------------------------------------------------------------------------------------
# Tokenizers

def test_byte_tokenizer_round_trips_utf8_and_skips_special_ids():
    text = "naïve café — 日本語 ✓ 🙂\n\ttabs"
    ids = BYTES.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert BYTES.decode(ids) == text
    assert BYTES.decode(ids[:3] + [BYTES.eos_id] + ids[3:]) == text
    assert (BYTES.eos_id, BYTES.vocab_size) == (256, 257)
    assert [a.tolist() for a in BYTES.encode_batch([text, ""])] == [ids, []]


def test_hf_tokenizer_finds_eos_and_round_trips(tmp_path):
    path = write_word_level_tokenizer(tmp_path / "tokenizer.json", ["<|endoftext|>"])
    tokenizer = load_tokenizer(path)
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.eos_id == 1                  # trainer ids: [UNK] = 0, then the specials
    assert tokenizer.vocab_size == 2 + len({"the", "cat", "sat", "on", "mat", "a", "dog", "log", "end"})
    ids = tokenizer.encode("the dog sat")
    assert len(ids) == 3 and tokenizer.eos_id not in ids
    assert tokenizer.decode(ids + [tokenizer.eos_id]) == "the dog sat"
    assert [a.tolist() for a in tokenizer.encode_batch(["the dog sat", "mat"])] == [ids, tokenizer.encode("mat")]
    assert load_tokenizer(tmp_path).eos_id == 1   # a folder holding tokenizer.json


def test_hf_tokenizer_without_eos_names_the_file(tmp_path):
    path = write_word_level_tokenizer(tmp_path / "no_eos.json", ["<pad>"])
    with pytest.raises(TokenizerError, match=r"no_eos.json.*end-of-text.*tokenizer\] eos_token"):
        HFTokenizer(path)


def test_load_tokenizer_bytes_and_missing_path(tmp_path):
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)
    with pytest.raises(TokenizerError, match="nowhere.json"):     # a ConfigError: exit status 2, no traceback
        load_tokenizer(tmp_path / "nowhere.json")


# ---------------------------------------------------------------------------------------------
# Sample order

@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 2000), seed=st.integers(0, 2**63), epoch=st.integers(0, 10**6), stage=st.text(max_size=8))
def test_sample_order_is_a_permutation_in_every_epoch(n, seed, epoch, stage):
    order = sample_order(seed, stage, n)
    epoch_indices = order.take(range(epoch * n, (epoch + 1) * n))
    assert sorted(epoch_indices.tolist()) == list(range(n))


def test_sample_order_is_deterministic_and_take_agrees_with_indexing():
    a, b = sample_order(5, "pretrain", 1000), sample_order(5, "pretrain", 1000)
    g = np.array([0, 1, 999, 1000, 123_456, 10**12 + 7])
    assert a.take(g).tolist() == b.take(g).tolist() == [a[int(i)] for i in g]
    assert a.take(range(990, 1010)).tolist() == [b[i] for i in range(990, 1010)]


def test_sample_order_depends_on_seed_stage_and_epoch():
    n = 1000
    first_epoch = sample_order(5, "pretrain", n).take(range(n)).tolist()
    assert sample_order(6, "pretrain", n).take(range(n)).tolist() != first_epoch
    assert sample_order(5, "anneal", n).take(range(n)).tolist() != first_epoch
    assert sample_order(5, "pretrain", n).take(range(n, 2 * n)).tolist() != first_epoch
    assert first_epoch != list(range(n))


def test_sample_order_rejects_empty_sources_and_negative_indices():
    with pytest.raises(ValueError, match='"empty"'):
        sample_order(0, "empty", 0)
    with pytest.raises(IndexError):
        sample_order(0, "s", 10).take([3, -1])
    assert sample_order(0, "one", 1).take(range(5)).tolist() == [0] * 5


# ---------------------------------------------------------------------------------------------
# A small curriculum written under tmp_path

DOCUMENTS = {
    # Deliberately not in sorted order on disk: the source must sort files.
    "b.txt": "second document: " + "lorem ipsum dolor sit amet " * 4,
    "a.txt": "first document, with ünïcödé: " + "the quick brown fox " * 5,
    "sub/c.txt": "third document in a sub folder " * 3,
}
SFT_ROWS = [
    {"question": "ab", "answer": "cd"},                 # short: padded
    {"question": "abc", "answer": "defghijk"},          # long: truncated, no eos
    {"question": "Q: 2+2=", "answer": " 4"},
    {"question": "", "answer": "xyz"},                  # no prompt: every target is a completion token
    *({"question": f"Q{i}:", "answer": f" {i * i}"} for i in range(9)),
]


def write_curriculum(tmp_path: Path) -> Path:
    for name, text in DOCUMENTS.items():
        (tmp_path / "corpus" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "corpus" / name).write_text(text)
    with open(tmp_path / "sft.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in SFT_ROWS)
    toml = SMALL_MODEL_TOML + textwrap.dedent("""\
        [general]
        seed = 3
        [tokens]
        sequence_length = 16
        train_steps = 20
        micro_batch_size = 2
        batch_accumulation_per_replica = 2
        [optimizer.learning_rate_scheduler]
        learning_rate = 1e-3

        [[data_stages]]
        name = "pretrain"
        start_training_step = 1
        [data_stages.data.dataset]
        hf_dataset_or_datasets = "text"
        hf_data_files = ["corpus/*.txt", "corpus/**/*.txt"]

        [[data_stages]]
        name = "sft"
        start_training_step = 9
        sequence_length = 8
        [data_stages.data]
        seed = 11
        [data_stages.data.dataset]
        hf_dataset_or_datasets = "json"
        hf_data_files = "sft.jsonl"
        prompt_column_name = "question"
        completion_column_name = "answer"
        """)
    (tmp_path / "run.toml").write_text(toml)
    return tmp_path / "run.toml"


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    # Keep the datasets cache out of ~/.cache during tests.
    return str(tmp_path_factory.mktemp("hf-cache"))


@pytest.fixture(scope="module")
def curriculum(tmp_path_factory):
    config = load_config(write_curriculum(tmp_path_factory.mktemp("curriculum")))
    return config, Schedule.from_config(config)


def open_loader(curriculum, index, hf_cache):
    config, schedule = curriculum
    return open_stage(config, index, BYTES, schedule, cache_dir=hf_cache)


def test_expand_data_files_sorts_and_deduplicates(tmp_path):
    write_curriculum(tmp_path)
    (tmp_path / "corpus" / "folder.txt").mkdir()       # a directory that matches: not a file
    found = expand_data_files([str(tmp_path / "corpus/**/*.txt"), str(tmp_path / "corpus/*.txt")])
    assert found == sorted(str(tmp_path / "corpus" / name) for name in DOCUMENTS)


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_a_fresh_loader_seeks_to_any_step(curriculum, hf_cache, index, k):
    walker, fresh = open_loader(curriculum, index, hf_cache), open_loader(curriculum, index, hf_cache)
    steps = walker.steps
    walked = {step: walker.batch_at(step) for step in steps[: k + 2]}
    for step in steps[k - 1: k + 2]:                   # steps k..k+2 of the stage, in its global numbering
        sought = fresh.batch_at(step)
        assert torch.equal(sought["input_ids"], walked[step]["input_ids"])
        assert torch.equal(sought["labels"], walked[step]["labels"])
    rows = {key: torch.cat([walked[s][key] for s in steps[: k + 2]]) for key in ("input_ids", "labels")}
    skip = k * 3 + 1                                  # any sample index, not only a step boundary
    from_k = fresh.samples(skip, len(rows["input_ids"]) - skip)
    assert torch.equal(from_k["input_ids"], rows["input_ids"][skip:])
    assert torch.equal(from_k["labels"], rows["labels"][skip:])


def test_batches_differ_between_steps_and_wrap_around_epochs(curriculum, hf_cache):
    loader = open_loader(curriculum, 0, hf_cache)
    batch = loader.stage.global_batch_size
    first, second = loader.batch_at(1), loader.batch_at(2)
    assert not torch.equal(first["input_ids"], second["input_ids"])
    n = len(loader.parts[0].source)
    assert n < batch * len(loader.steps)              # the stage reads more than one epoch
    one_epoch = loader.samples(0, n)["input_ids"]
    assert len({tuple(row.tolist()) for row in one_epoch}) == n   # each window once per epoch


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_ranks_split_the_global_batch(curriculum, hf_cache, index, world):
    loader = open_loader(curriculum, index, hf_cache)
    for step in loader.steps[:3]:
        whole = loader.batch_at(step)
        parts = [loader.batch_at(step, rank, world) for rank in range(world)]
        assert all(p["input_ids"].shape[0] == loader.stage.global_batch_size // world for p in parts)
        for key in ("input_ids", "labels"):
            assert torch.equal(torch.cat([p[key] for p in parts]), whole[key])


def test_loader_rejects_foreign_steps_and_uneven_splits(curriculum, hf_cache):
    with open_loader(curriculum, 1, hf_cache) as loader:
        with pytest.raises(ValueError, match='step 8 is not a step of stage "sft".*9..20'):
            loader.batch_at(8)
        with pytest.raises(ValueError, match="does not split over 3 ranks"):
            loader.batch_at(9, 0, 3)
    with pytest.raises(RuntimeError, match="closed"):
        loader.batch_at(9)


def test_packed_text_windows(curriculum, hf_cache):
    source = open_loader(curriculum, 0, hf_cache).parts[0].source
    seq = source.sequence_length
    expected_stream = []
    for name in sorted(DOCUMENTS, key=lambda name: str(Path("corpus") / name)):
        expected_stream += BYTES.encode(DOCUMENTS[name]) + [BYTES.eos_id]
    assert source.tokens.tolist() == expected_stream
    assert len(source) == (len(expected_stream) - 1) // seq
    for i in range(len(source)):
        inputs, labels, _ = source.sample(i)
        assert inputs.dtype == labels.dtype == np.int64 and inputs.shape == labels.shape == (seq,)
        assert inputs.tolist() == expected_stream[i * seq: (i + 1) * seq]
        assert labels.tolist() == expected_stream[i * seq + 1: (i + 1) * seq + 1]   # the next token
        if i + 1 < len(source):
            assert source.sample(i + 1)[0][0] == labels[-1]                          # windows share one token


def test_packed_text_needs_one_window():
    PackedText(np.arange(9), 8)                       # exactly sequence_length + 1 tokens: one window
    with pytest.raises(ValueError, match='stage "tiny".*8 tokens are fewer than one window'):
        PackedText(np.arange(8), 8, where='stage "tiny"')


def test_too_little_text_names_the_stage_and_files(tmp_path, hf_cache):
    overrides = ["model.max_position_embeddings=512", "data_stages.pretrain.sequence_length=500"]
    config = load_config(write_curriculum(tmp_path), overrides)
    with pytest.raises(ValueError, match=r'stage "pretrain" \(text files .*a\.txt.*fewer than one window'):
        open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=hf_cache)


def test_sft_labels_by_hand(curriculum, hf_cache):
    source = open_loader(curriculum, 1, hf_cache).parts[0].source
    assert isinstance(source, SFTExamples) and len(source) == len(SFT_ROWS)
    eos, x = BYTES.eos_id, IGNORE_INDEX
    a, b, c, d = (ord(ch) for ch in "abcd")
    inputs, labels, _ = source.sample(0)                 # "ab" + "cd" + eos, padded to 9 tokens
    assert inputs.tolist() == [a, b, c, d, eos, eos, eos, eos]
    assert labels.tolist() == [x, c, d, eos, x, x, x, x]
    inputs, labels, _ = source.sample(1)                 # "abc" + "defghijk" + eos, truncated to 9 tokens
    assert inputs.tolist() == BYTES.encode("abcdefgh")
    assert labels.tolist() == [x, x] + BYTES.encode("defghi")


def test_sft_targets_are_exactly_completion_and_one_eos(curriculum, hf_cache):
    source = open_loader(curriculum, 1, hf_cache).parts[0].source
    seq = source.sequence_length
    for i, row in enumerate(SFT_ROWS):
        prompt, completion = BYTES.encode(row["question"]), BYTES.encode(row["answer"])
        full = (prompt + completion + [BYTES.eos_id])[: seq + 1]
        inputs, labels, _ = source.sample(i)
        assert inputs.tolist() == (full + [BYTES.eos_id] * seq)[:seq]
        targets = labels[labels != IGNORE_INDEX].tolist()
        # Token 0 has no predecessor, so with an empty prompt the first completion token is no target.
        first_target = max(len(prompt), 1)
        assert targets == full[first_target:]
        first_target -= 1                             # label j is the target for token j + 1
        assert (labels[:first_target] == IGNORE_INDEX).all()
        assert (labels[first_target: first_target + len(targets)] != IGNORE_INDEX).all()


@pytest.mark.parametrize("stage, key", [("pretrain", "text_column_name"), ("sft", "prompt_column_name")])
def test_missing_column_names_the_column_and_stage(tmp_path, hf_cache, stage, key):
    config = load_config(write_curriculum(tmp_path), [f"data_stages.{stage}.data.dataset.{key}=nonesuch"])
    schedule = Schedule.from_config(config)
    with pytest.raises(ValueError, match=f'stage "{stage}".*no column "nonesuch"'):
        open_stage(config, schedule.index(stage), BYTES, schedule, cache_dir=hf_cache)


def test_tiny_schedule_batches(hf_cache):
    config = load_config(REPO / "schedules" / "tiny.toml")
    schedule = Schedule.from_config(config)
    tokenizer = load_tokenizer(config.tokenizer.tokenizer_name_or_path)
    for index, shape in [(0, (4, 32)), (1, (8, 24))]:
        with open_stage(config, index, tokenizer, schedule, cache_dir=hf_cache) as loader:
            batch = loader.batch_at(loader.steps.start)
            assert batch["input_ids"].shape == batch["labels"].shape == shape
            assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
            assert int(batch["input_ids"].max()) < tokenizer.vocab_size <= config.model.vocab_size
    assert (batch["labels"] == IGNORE_INDEX).any() and (batch["labels"] == tokenizer.eos_id).any()
