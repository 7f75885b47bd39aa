"""Evaluation: fixed eval sets, held-out windows never trained on, exact match, the [evaluation] checks
(whole runs evaluated: tests/e2e/test_evaluation_runs.py; bin/eval, kill -9 and torchrun: test_evaluation_process.py)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import attrs
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from data_helpers import BYTES
from support.evaluation import SUMS, write_run
from support.largest import LargestTensor

import nanoflow.loss
from nanoflow.build import build_model
from nanoflow.config import ConfigError, load_config
from nanoflow.data import write_token_file
from nanoflow.data.loader import StageLoader
from nanoflow.data.sources import IGNORE_INDEX
from nanoflow.evaluation import EvalSet, choice_loglikelihoods, load_eval_set, pick, score
from nanoflow.model import Llama
from nanoflow.parallel.mesh import SINGLE
from nanoflow.schedule import Schedule

PYTHON = sys.executable


# ---------------------------------------------------------------------------------------------
# Held-out samples


def test_held_out_windows_are_never_in_a_training_batch(tmp_path):
    # One document of distinct tokens: a token's value is its position in the stream, so targets name windows.
    stream = np.arange(250)
    write_token_file(tmp_path / "tokens", "00000_unshuffled", [np.append(stream, BYTES.eos_id)],
                     tokenizer_name="bytes", token_size=2)
    path = write_run(tmp_path)
    text = path.read_text().replace('hf_dataset_or_datasets = "text"\nhf_data_files = "corpus.txt"\n'
                                    "held_out_samples = 10",
                                    f'dataset_folder = "{tmp_path / "tokens"}"\nheld_out_samples = 5')
    text = text.replace("sequence_length = 32\ntrain", "sequence_length = 8\ntrain")
    path.write_text(text)
    config = load_config(path, ["tokens.train_steps=40", "data_stages.sft.start_training_step=40"])
    windows = (len(stream) + 1 - 1) // 8                       # 31 windows of 8 targets; the last 5 held out
    trained = set()
    with StageLoader(config, 0, BYTES, Schedule.from_config(config)) as loader:             # every sample of the stage: 39 steps × 4, 6 epochs
        for step in loader.steps:
            for rank in range(2):
                trained.update(loader.batch_at(step, rank, 2)["labels"].flatten().tolist())
    held = load_eval_set(config, config.evaluation.datasets[0], BYTES)
    evaluated = set(held.labels.flatten().tolist())
    assert len(held.labels) == 5
    assert trained.isdisjoint(evaluated)
    assert trained == set(range(1, (windows - 5) * 8 + 1))    # training reads all the rest, and nothing else
    assert evaluated == set(range((windows - 5) * 8 + 1, windows * 8 + 1))


def test_held_out_sft_rows_are_the_last_rows_and_never_trained(tmp_path):
    path = write_run(tmp_path)
    path.write_text(path.read_text().replace('completion_column_name = "completion"\n',
                                             'completion_column_name = "completion"\nheld_out_samples = 3\n', 1)
                    + '[[evaluation.datasets]]\nname = "sums-held"\nheld_out_of = "sft"\nmetric = "exact_match"\n')
    config = load_config(path, ["tokens.train_steps=20"])
    held = load_eval_set(config, config.evaluation.datasets[2], BYTES)
    prompts = {bytes(row[:4].tolist()).decode() for row in held.input_ids}
    assert prompts == {row["prompt"] for row in SUMS[-3:]}
    with StageLoader(config, 1, BYTES, Schedule.from_config(config)) as loader:
        seen = {bytes(row[:4].tolist()).decode() for step in loader.steps for row in loader.batch_at(step)["input_ids"]}
    assert seen == {row["prompt"] for row in SUMS[:-3]}


def test_held_out_samples_enters_the_data_fingerprint(tmp_path):
    from nanoflow.data.fingerprint import fingerprint_changes, stage_fingerprint

    path = write_run(tmp_path)
    config, other = load_config(path), load_config(path, ["data_stages.pretrain.data.dataset.held_out_samples=20"])
    with_held = stage_fingerprint(config, 0, BYTES, Schedule.from_config(config))
    without = stage_fingerprint(other, 0, BYTES, Schedule.from_config(other))
    assert fingerprint_changes({"pretrain": with_held}, {"pretrain": without}) == [
        'stage "pretrain": held_out_samples: was 10, now 20']


def test_fixed_samples_are_evenly_spread_and_all_of_a_small_set():
    assert pick(5, 128).tolist() == [0, 1, 2, 3, 4]
    assert pick(100, 4).tolist() == [0, 25, 50, 75]


# ---------------------------------------------------------------------------------------------
# Exact match


def greedy(model, prompt: list[int], length: int) -> list[int]:
    """Token-by-token greedy decoding, the definition exact match is taken against."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(length):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


def test_exact_match_counts_the_answers_greedy_decoding_gets_right(tmp_path):
    config = load_config(write_run(tmp_path))
    model = build_model(config)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, 5).tolist() for _ in range(6)]
    answers = [greedy(model, p, 3) for p in prompts]
    # Right: the model's own greedy answer. Wrong: its first, middle or last token changed.
    cases = [(answers[0], True), (answers[1], True), (answers[2], True),
             ([(answers[3][0] + 1) % 256, *answers[3][1:]], False),
             ([answers[4][0], (answers[4][1] + 1) % 256, answers[4][2]], False),
             ([*answers[5][:2], (answers[5][2] + 1) % 256], False)]
    width = 12
    inputs = torch.zeros(len(cases), width, dtype=torch.long)
    labels = torch.full((len(cases), width), IGNORE_INDEX, dtype=torch.long)
    for row, (prompt, (answer, _)) in enumerate(zip(prompts, cases, strict=True)):
        sequence = torch.tensor(prompt + answer)
        inputs[row, :len(sequence) - 1] = sequence[:-1]
        labels[row, len(prompt) - 1:len(sequence) - 1] = sequence[len(prompt):]
    result = score(model, EvalSet("hand", "exact_match", inputs, labels, micro_batch_size=4), SINGLE)
    assert result["correct"] == 3 and result["accuracy"] == 0.5
    assert result["tokens"] == 18
    for (answer, right), prompt in zip(cases, prompts, strict=True):   # the verdict is the decoder's, case by case
        alone = score(model, EvalSet("one", "exact_match", *_row(prompt, answer, width), 1), SINGLE)
        assert alone["correct"] == right == (greedy(model, prompt, 3) == answer)


def _row(prompt, answer, width):
    sequence = torch.tensor(prompt + answer)
    inputs = torch.zeros(1, width, dtype=torch.long)
    labels = torch.full((1, width), IGNORE_INDEX, dtype=torch.long)
    inputs[0, :len(sequence) - 1] = sequence[:-1]
    labels[0, len(prompt) - 1:len(sequence) - 1] = sequence[len(prompt):]
    return inputs, labels


@pytest.mark.parametrize("metric", ["loss", "exact_match", "multiple_choice"])
def test_scoring_holds_a_chunk_of_logits_never_the_whole_batchs(monkeypatch, metric):
    vocab, rows, width = 4096, 4, 64   # a micro-batch of 256 positions: 1,048,576 logits
    monkeypatch.setattr(nanoflow.loss, "CPU_CHUNK_BYTES", 4 * vocab * 8)   # 8 positions a chunk
    cfg = SimpleNamespace(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=width,
                          rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False, initializer_range=0.5)
    model = Llama(cfg)
    model.reset_parameters(torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, width), generator=generator)
    labels = torch.randint(0, vocab, (rows, width), generator=generator)
    labels[:, :width // 2] = IGNORE_INDEX
    with torch.inference_mode(), LargestTensor() as whole:   # what the old scoring ran: the micro-batch's logits
        logits = model(ids).float()
    assert whole.largest == rows * width * vocab   # the detector sees them
    with torch.inference_mode():
        nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                              reduction="none").view(rows, width)
    eval_set = EvalSet("big", metric, ids, labels, micro_batch_size=rows)
    if metric == "multiple_choice":   # each row a choice of one example; the first is right
        eval_set = attrs.evolve(eval_set, choices=SimpleNamespace())
        with LargestTensor() as mode:
            found = choice_loglikelihoods(model, eval_set, SINGLE)
        assert np.allclose(found, -nll.double().sum(dim=1).numpy(), rtol=1e-6)
    else:
        with LargestTensor() as mode:
            result = score(model, eval_set, SINGLE)
        assert result["loss"] == pytest.approx(float(nll.double().sum()) / result["tokens"], rel=1e-6)
    assert mode.largest <= max(8 * vocab, vocab * cfg.hidden_size)   # a chunk of logits, or the head itself


# ---------------------------------------------------------------------------------------------
# In the loop


# ---------------------------------------------------------------------------------------------
# An eval set's data across a resume


# ---------------------------------------------------------------------------------------------
# Resume, and bin/eval: real processes


# ---------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize("override, expected", [
    ("evaluation.datasets.text.held_out_of=nope", 'held_out_of: no stage is named "nope"'),
    ("data_stages.pretrain.data.dataset.held_out_samples=0", "held_out_samples"),
    ("evaluation.datasets.text.metric=exact_match", 'metric = "exact_match" needs prompt/completion data'),
    ("evaluation.datasets.sums.name=text", 'names must be unique'),
    ("evaluation.datasets.text.sequence_length=16", 'cuts its windows (and so the held-out ones) at 32'),
    ("evaluation.datasets.sums.sequence_length=128", "exceeds model.max_position_embeddings = 64"),
    ("evaluation.datasets.text.dataset={hf_dataset_or_datasets='text', hf_data_files='corpus.txt'}",
     "give exactly one of"),
    ("evaluation.datasets.sums.dataset.held_out_samples=2", "an eval set reads all of its dataset"),
    ("evaluation.datasets.sums.dataset.hf_data_files=missing.jsonl", "missing.jsonl matches no file"),
    ("evaluation.datasets=[]", "no [[evaluation.datasets]]"),
])
def test_bad_evaluation_config_names_the_key(tmp_path, override, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(write_run(tmp_path), [override])
    assert expected in str(caught.value)
    assert "run.toml" in str(caught.value)


def test_stages_sharing_a_source_must_hold_out_the_same(tmp_path):
    path = write_run(tmp_path)
    sft = ('hf_dataset_or_datasets = "json"\nhf_data_files = "sums.jsonl"\nprompt_column_name = "prompt"\n'
           'completion_column_name = "completion"\n')
    assert sft in path.read_text()
    path.write_text(path.read_text().replace(sft, 'hf_dataset_or_datasets = "text"\nhf_data_files = "corpus.txt"\n', 1))
    with pytest.raises(ConfigError, match='stage "pretrain" reads the same source with held_out_samples = 10'):
        load_config(path)
    assert load_config(path, ["data_stages.sft.data.dataset.held_out_samples=10"])   # the same reservation: fine


def test_no_held_out_stage_reserves_nothing(tmp_path):
    path = write_run(tmp_path)
    path.write_text(path.read_text().replace("held_out_samples = 10\n", ""))
    with pytest.raises(ConfigError, match='stage "pretrain" reserves nothing; set its data.dataset.held_out_samples'):
        load_config(path)
