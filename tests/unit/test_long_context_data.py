"""The long-context demo's generated data: reproducible byte for byte, held-out documents never trained on, and
each file's documents of the lengths its stage or eval set needs."""

from __future__ import annotations

import importlib.util
import json
import re

from helpers import REPO

PASSKEY = REPO / "schedules" / "data" / "passkey"


def generator():
    spec = importlib.util.spec_from_file_location("make_passkeys", PASSKEY.parent / "make_passkeys.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documents(name: str) -> list[str]:
    text = (PASSKEY / name).read_text()
    if name.endswith(".txt"):
        return text.splitlines()
    return [row["prompt"] + row["completion"] for row in map(json.loads, text.splitlines())]


def test_the_committed_files_are_what_the_generator_writes():
    written = generator().files()
    assert {p.name for p in PASSKEY.iterdir()} == set(written)
    for name, text in written.items():
        assert (PASSKEY / name).read_bytes() == text.encode(), f"{name} differs: run schedules/data/make_passkeys.py"
    assert sum(len(text.encode()) for text in written.values()) < 1_000_000


def test_each_document_says_its_key_and_asks_for_it_and_no_held_out_document_is_trained_on():
    for name in ("short.txt", "long.txt", "passkey_short.jsonl", "passkey_long.jsonl", "beyond_heldout.jsonl"):
        for doc in documents(name):
            first, second = re.fullmatch(r"the pass key is ([A-Z])\. [a-z. ]*pass key=([A-Z])\.", doc).groups()
            assert first == second, doc
    trained = set(documents("short.txt") + documents("long.txt"))
    for name in ("passkey_short.jsonl", "passkey_long.jsonl", "beyond_heldout.jsonl"):
        assert not set(documents(name)) & trained, name


def test_the_lengths_fit_the_stages_and_the_long_keys_lie_beyond_pretraining():
    # + 1: the end-of-text token each document ends with
    assert max(len(d) + 1 for d in documents("short.txt") + documents("passkey_short.jsonl")) <= 64
    assert min(len(d) + 1 for d in documents("long.txt")) > 64
    assert max(len(d) + 1 for d in documents("long.txt") + documents("passkey_long.jsonl")) <= 256
    for line in (PASSKEY / "passkey_long.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert row["completion"] == row["prompt"][16] + "." and len(row["prompt"]) > 16 + 160   # the key 160+ bytes back
    for line in (PASSKEY / "beyond_heldout.jsonl").read_text().splitlines():
        assert len(json.loads(line)["prompt"]) == 64
