"""bin/prepare's plan (nanoflow.data.prepare.plan_shards), from a folder's listing and its prepare.json, without a
file: it keeps only the recorded shards whose files are whole, redoes the rest, deletes only what a killed run left
half written, and refuses a folder that holds another preparation or token files it did not record. The doing
(tokenizing, writing, verifying) is tested on real folders in test_data_prepare.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanoflow.data.prepare import plan_shards
from nanoflow.data.tokens import SUFFIX
from nanoflow.errors import PrepareError


def identity(documents: int = 5, docs_per_shard: int = 2, token_size: int = 2) -> dict:
    return {"format": "nanoflow-prepare-1", "inputs": [["/data/a.txt", 10, 1]], "tokenizer": "bytes",
            "documents": documents, "docs_per_shard": docs_per_shard, "token_size": token_size}


def recorded(name: str, tokens: int) -> dict:
    return {name: {"documents": 2, "tokens": tokens, "blake2b": "00"}}


def test_a_fresh_folder_tokenizes_every_shard_in_order():
    plan = plan_shards(identity(), "out", None, {})
    assert plan.shards == plan.todo == [("00000", 0, 2), ("00001", 2, 4), ("00002", 4, 5)]
    assert plan.done == {} and plan.leftovers == []


def test_a_rerun_keeps_the_whole_shards_and_redoes_the_rest():
    previous = {**identity(), "shards": {**recorded("00000", 7), **recorded("00001", 9), **recorded("00002", 3)}}
    listing = {"00000.ds": 14, "00000.ds.metadata": 40,        # whole: 7 tokens of 2 bytes, and its metadata
               "00001.ds": 17, "00001.ds.metadata": 40,        # cut short
               "00002.ds": 6,                                  # its metadata lost
               "00001.ds.tmp-123": 5, "notes.tmp-x": 1, "prepare.json": 100}
    plan = plan_shards(identity(), "out", previous, listing)
    assert plan.done == recorded("00000", 7)
    assert plan.todo == [("00001", 2, 4), ("00002", 4, 5)]
    assert plan.leftovers == ["00001.ds.tmp-123"]   # what write_atomically leaves; nothing else


def test_a_dangling_file_is_redone():
    previous = {**identity(), "shards": recorded("00000", 7)}
    plan = plan_shards(identity(), "out", previous, {"00000.ds": None, "00000.ds.metadata": 40})
    assert plan.done == {} and plan.todo[0] == ("00000", 0, 2)


def test_another_preparation_is_refused_naming_what_differs():
    previous = {**identity(docs_per_shard=3), "shards": {}}
    with pytest.raises(PrepareError, match=r"out holds another preparation \(it differs in docs_per_shard\)"):
        plan_shards(identity(), "out", previous, {"prepare.json": 100})


def test_token_files_without_a_record_are_refused():
    with pytest.raises(PrepareError, match="out already holds token files that bin/prepare did not record"):
        plan_shards(identity(), "out", None, {"00000.ds": 14})


@given(st.integers(1, 40), st.integers(1, 9), st.dictionaries(st.integers(0, 12), st.integers(0, 30), max_size=8),
       st.sets(st.integers(0, 12)), st.sets(st.integers(0, 12)))
def test_the_plan_redoes_exactly_what_is_not_whole(documents, per_shard, tokens, present, with_metadata):
    # Whatever the folder holds, every shard is either kept or redone, and kept only with its recorded size and
    # its metadata; the shards cover the documents once, in order.
    token_size = 2
    names = {k: f"{k:05d}" for k in range(13)}
    previous = {**identity(documents, per_shard, token_size),
                "shards": {names[k]: {"documents": 1, "tokens": n} for k, n in tokens.items()}}
    listing = {names[k] + SUFFIX: tokens.get(k, 0) * token_size if k % 3 else 1 for k in present}
    listing |= {names[k] + SUFFIX + ".metadata": 10 for k in with_metadata}
    plan = plan_shards(identity(documents, per_shard, token_size), "out", previous, listing)
    assert [start for _, start, _ in plan.shards] == list(range(0, documents, per_shard))
    assert plan.shards[-1][2] == documents
    assert [s for s in plan.shards if s[0] not in plan.done] == plan.todo
    for name, stats in plan.done.items():
        assert listing[name + SUFFIX] == stats["tokens"] * token_size and name + SUFFIX + ".metadata" in listing
    assert plan.leftovers == []
