"""bin/prepare with a non-standard EOS, with two worker processes (tests/e2e/test_tokenizers.py: in-process)."""

from __future__ import annotations

import json

from data_helpers import EOT_TEXTS
from process_helpers import run_command
from support.tokenizers import raw

from nanoflow.data import TokenFolder

TEXTS = EOT_TEXTS


def test_bin_prepare_with_a_non_standard_eos(tmp_path, eot_json):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    failed = run_command("prepare", str(docs), "--output", str(tmp_path / "no"), "--tokenizer",
                     str(eot_json), "--num-proc", "1")
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr
    assert "found no end-of-text token" in failed.stderr and "--eos-token" in failed.stderr
    assert not (tmp_path / "no").exists()              # refused before anything was written

    done = run_command("prepare", str(docs), "--output", str(tmp_path / "tokens"), "--tokenizer",
                   str(eot_json), "--eos-token", "<EOT>", "--num-proc", "2", "--docs-per-shard", "2")
    assert done.returncode == 0, done.stderr
    tok = raw(eot_json)
    expected = [i for t in TEXTS for i in tok.encode(t, add_special_tokens=False).ids + [1]]
    folder = TokenFolder(tmp_path / "tokens")
    assert folder[0:len(folder)].tolist() == expected
    assert json.loads((tmp_path / "tokens" / "prepare.json").read_text())["eos_id"] == 1


