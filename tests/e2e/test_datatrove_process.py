"""datatrove reads bin/prepare's output token for token (tests/e2e/test_datatrove.py: in-process)."""

from __future__ import annotations

import json

import numpy as np
from data_helpers import eot_tokenizer
from process_helpers import run_command
from support.datatrove import documents, encode


def test_datatrove_reads_bin_prepare_output_token_for_token(tmp_path):
    from datatrove.utils.dataset import DatatroveFolderDataset

    tokenizer = eot_tokenizer(tmp_path / "tok" / "tokenizer.json")
    texts = documents(50, seed=1)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    result = run_command("prepare", docs, "--output", tmp_path / "out", "--tokenizer", tokenizer, "--eos-token", "<EOT>",
                         "--docs-per-shard", "20", "--num-proc", "2", timeout=600)
    assert result.returncode == 0, result.stderr

    seq = 8
    dataset = DatatroveFolderDataset(str(tmp_path / "out"), seq_len=seq, token_size=2, return_positions=True)
    encoded = encode(tokenizer, texts)
    windows, positions = [], []
    for first in range(0, len(texts), 20):          # datatrove cuts each file on its own, at stride seq + 1
        shard = encoded[first:first + 20]
        stream = sum(shard, [])
        starts = np.repeat(np.cumsum([0] + [len(d) for d in shard[:-1]]), [len(d) for d in shard])
        for k in range(len(stream) // (seq + 1)):
            lo = k * (seq + 1)
            windows.append(stream[lo:lo + seq + 1])
            positions.append([g - max(lo, int(starts[g])) for g in range(lo, lo + seq + 1)])
    assert len(dataset) == len(windows) > 0
    read = [dataset[i] for i in range(len(dataset))]
    assert [r["input_ids"].tolist() for r in read] == windows
    assert [r["positions"].tolist() for r in read] == positions     # from the .index files bin/prepare wrote
