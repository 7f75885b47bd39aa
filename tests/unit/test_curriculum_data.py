"""The default curriculum's generated data: reproducible byte for byte, and its held-out sets never trained on."""

from __future__ import annotations

import importlib.util
import json
import re

from helpers import REPO

WORDS = REPO / "schedules" / "data" / "words"
TRAINING = ("pretrain.txt", "anneal.txt", "reverse.jsonl")
HELD_OUT = ("pretrain_heldout.txt", "anneal_heldout.txt", "reverse_heldout.jsonl")


def generator():
    spec = importlib.util.spec_from_file_location("make_words", WORDS.parent / "make_words.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_files_are_what_the_generator_writes():
    written = generator().files()
    assert {p.name for p in WORDS.iterdir()} == set(written) == set(TRAINING + HELD_OUT)
    for name, text in written.items():
        assert (WORDS / name).read_bytes() == text.encode(), f"{name} differs: run schedules/data/make_words.py"
    assert sum(len(text.encode()) for text in written.values()) < 1_000_000


def test_no_held_out_word_is_in_a_training_file():
    shares = generator().shares()
    training = " ".join((WORDS / name).read_text() for name in TRAINING)
    tokens = set(re.findall(r"[a-z]+", training.lower()))
    for name in HELD_OUT:
        words = shares[name]
        assert words and all(w in (WORDS / name).read_text().lower() for w in words)
        clashes = [w for w in words if w in tokens or w[::-1] in tokens]
        assert not clashes, f"{name}: {clashes[:5]} also in a training file"


def test_sft_rows_are_reversals_that_fit_the_stage():
    prompts = {}
    for name in ("reverse.jsonl", "reverse_heldout.jsonl"):
        prompts[name] = set()
        for line in (WORDS / name).read_text().splitlines():
            row = json.loads(line)
            word = row["prompt"].removeprefix("Q: reverse ").removesuffix("\nA:")
            assert row["completion"] == " " + word[::-1] and len(set(word)) == len(word) and 3 <= len(word) <= 6
            assert len((row["prompt"] + row["completion"]).encode()) + 1 <= 32   # + end-of-text: the sft sequence_length
            prompts[name].add(row["prompt"])
    assert len(prompts["reverse_heldout.jsonl"]) == 200 and not prompts["reverse.jsonl"] & prompts["reverse_heldout.jsonl"]
