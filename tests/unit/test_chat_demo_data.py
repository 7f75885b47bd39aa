"""The chat demo's generated data and tokenizer: reproducible byte for byte, its held-out words in no training file,
and the tokenizer folder one that transformers renders the conversations with."""

from __future__ import annotations

import importlib.util
import json
import re

import transformers
from helpers import REPO

from nanoflow.data import load_tokenizer
from nanoflow.data.chat import ChatTemplate

CHAT = REPO / "schedules" / "data" / "chat"


def generator():
    spec = importlib.util.spec_from_file_location("make_chat", CHAT.parent / "make_chat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_files_are_what_the_generator_writes():
    written = generator().files()
    assert {str(p.relative_to(CHAT)) for p in CHAT.rglob("*") if p.is_file()} == set(written)
    for name, text in written.items():
        assert (CHAT / name).read_bytes() == text.encode(), f"{name} differs: run schedules/data/make_chat.py"


def words_of(path) -> set[str]:
    return set(re.findall(r"[a-z]+", path.read_text().lower()))


def test_no_held_out_word_is_in_a_training_file():
    rows = [json.loads(line)["messages"] for line in (CHAT / "chat_heldout.jsonl").read_text().splitlines()]
    held_out = {w for row in rows for m in row if m["role"] == "assistant" for w in m["content"].split()[1:]}
    training = words_of(CHAT / "chat.jsonl") | words_of(CHAT.parent / "words" / "pretrain.txt")
    assert len(held_out) > 300 and not held_out & training


def test_the_tokenizer_renders_the_conversations_as_transformers_does():
    hf = transformers.AutoTokenizer.from_pretrained(str(CHAT / "tokenizer"))
    ours = ChatTemplate(load_tokenizer(CHAT / "tokenizer"))
    for line in (CHAT / "chat_heldout.jsonl").read_text().splitlines()[:20]:
        messages = json.loads(line)["messages"]
        ids, targets = ours.tokens(messages)
        assert ids == list(hf.apply_chat_template(messages, tokenize=True)["input_ids"])
        answers = [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
        assert "".join(hf.decode([t for t, m in zip(ids, targets, strict=True) if m])) == "".join(answers)
