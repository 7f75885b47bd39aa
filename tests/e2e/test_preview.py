"""bin/preview: the rows it shows are the rows train_step receives, for every kind of stage; and what it marks (no
loss, a new document) is what the data says."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from data_helpers import BYTES, EOS, documents, stage, write_config, write_folder
from helpers import REPO, quiet

import nanoflow.training.loop
from nanoflow import load_config

PARAGRAPHS = "\n\n".join(f"p{i}: " + "lorem ipsum " * (i % 3) for i in range(200))
SFT_ROWS = [{"prompt": f"Q{i}: reverse {w}\nA:", "completion": f" {w[::-1]}"}
            for i, w in enumerate(["abc", "hello", "xyz", "flow", "plan", "stage"] * 4)]


def four_kinds(tmp_path):
    """A run with a stage of each kind: text (by paragraph, masked), a token folder, SFT, a blend of two folders."""
    (tmp_path / "text.txt").write_text(PARAGRAPHS)
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in SFT_ROWS))
    rng = np.random.default_rng(0)
    for name in "abc":
        write_folder(tmp_path / name, documents(rng, 200, 97, 123, length=(1, 40)))
    return write_config(tmp_path, [
        stage("text", 1, {"hf_dataset_or_datasets": "text", "hf_data_files": str(tmp_path / "text.txt"),
                          "sample_by": "paragraph"}, document_masking=True),
        stage("folder", 3, {"dataset_folder": str(tmp_path / "a")}),
        stage("sft", 5, {"hf_dataset_or_datasets": "json", "hf_data_files": str(tmp_path / "sft.jsonl"),
                         "prompt_column_name": "prompt", "completion_column_name": "completion"}),
        stage("blend", 7, {"dataset_folder": [str(tmp_path / "b"), str(tmp_path / "c")], "dataset_weights": [0.3, 0.7]},
              document_masking=True),
    ], sequence_length=32, train_steps=8)


def preview(config, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bin" / "preview"), str(config), *args], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_json_rows_are_what_train_step_receives_at_each_step_of_every_kind_of_stage(tmp_path, monkeypatch):
    config = four_kinds(tmp_path)
    received = {}
    real = nanoflow.training.loop.train_step

    def recording(state, batch):
        received[state.step + 1] = {key: value.clone() for key, value in batch.items()}
        return real(state, batch)

    monkeypatch.setattr(nanoflow.training.loop, "train_step", recording)
    nanoflow.training.loop.train(load_config(config), out=quiet())
    assert sorted(received) == list(range(1, 9))
    for step in (1, 4, 5, 8):   # text (masked), token folder, SFT, blend (masked)
        shown = preview(config, "--json", "--step", str(step))
        assert shown.returncode == 0, shown.stderr
        rows = [json.loads(line) for line in shown.stdout.splitlines()]
        batch = received[step]
        assert [r["row"] for r in rows] == list(range(len(batch["input_ids"]))) and {r["step"] for r in rows} == {step}
        for key in ("input_ids", "labels"):
            assert torch.equal(torch.tensor([r[key] for r in rows]), batch[key]), (step, key)
        positions = torch.tensor([r["position_ids"] for r in rows])
        expected = batch.get("position_ids", torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"]))
        assert torch.equal(positions, expected), step
        assert ("position_ids" in batch) == (step in (1, 8))


@pytest.mark.slow
def test_the_text_marks_the_prompt_and_the_documents_as_the_data_has_them(tmp_path):
    config = four_kinds(tmp_path)
    shown = preview(config, "--stage", "sft", "--rows", "4")
    assert shown.returncode == 0, shown.stderr
    rows = [line.strip() for line in shown.stdout.split("\n\nrow ")[1:]]
    assert len(rows) == 4
    # an SFT row: the prompt (no loss) in ⟦⟧, then the completion and its end-of-text (the targets), then padding
    marked = {f"⟦{r['prompt'].replace(chr(10), '↵ ')}⟧{r['completion']}<|endoftext|>" for r in SFT_ROWS}
    for row in rows:
        text = " ".join(line.strip() for line in row.splitlines()[1:])
        assert any(text.startswith(m) for m in marked), text
    # masked text rows: ‖ where a document starts (position 0), after an end-of-text token, before a first token
    # that has no loss
    boundaries = 0
    for step in ("1", "2"):
        shown = preview(config, "--step", step, "--rows", "4")
        assert shown.returncode == 0, shown.stderr
        rows = [json.loads(line) for line in preview(config, "--json", "--step", step).stdout.splitlines()]
        for body, row in zip(shown.stdout.split("\n\nrow ")[1:], rows, strict=True):
            starts = sum(p == 0 for p in row["position_ids"][1:])
            assert body.count("‖") == starts and body.count("<|endoftext|>‖⟦") == starts, body
            boundaries += starts
    assert boundaries > 0


def test_a_bad_step_or_stage_is_one_line_and_exit_2(tmp_path):
    config = write_config(tmp_path, [stage("a", 1, {"dataset_folder": str(tmp_path / "a")})], train_steps=3)
    write_folder(tmp_path / "a", documents(np.random.default_rng(1), 100, 97, 123))
    for args, said in [(["--step", "9"], "--step 9: the run trains steps 1 to 3"),
                       (["--stage", "b"], '--stage b: no such stage (stages: a)')]:
        result = preview(config, *args)
        assert result.returncode == 2 and said in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert EOS == BYTES.eos_id


def test_a_reader_that_stops_reading_ends_it_quietly(tmp_path):
    """`bin/preview … | head`: the closed pipe is the reader's choice, not an error (as a C tool ends on SIGPIPE)."""
    config = four_kinds(tmp_path)
    process = subprocess.Popen([sys.executable, str(REPO / "bin" / "preview"), str(config), "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.read(10) == '{"step": 1'
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=600) == 0 and stderr == ""
