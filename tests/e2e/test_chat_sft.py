"""Chat SFT end to end: a chat stage trains and exports a folder whose AutoTokenizer renders conversations as the
run did and whose generate() stops at the end of a turn; bin/preview shows a packed chat window with its
samples and their assistant turns marked; the chat demo (schedules/chat.toml) learns its skill."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import transformers
from chat_helpers import CHATML, CONVERSATIONS, LLAMA3, chat_tokenizer
from data_helpers import stage, write_config
from helpers import REPO, quiet
from process_helpers import run_command, train_args

from nanoflow import load_config
from nanoflow.data import load_tokenizer
from nanoflow.data.chat import ChatTemplate, as_messages
from nanoflow.interop.export import export_hf
from nanoflow.observe.metrics import read_eval
from nanoflow.training.loop import train

ROWS = [[{"role": "user", "content": f"reverse {w}"}, {"role": "assistant", "content": w[::-1]}]
        + ([{"role": "user", "content": "again"}, {"role": "assistant", "content": w}] if i % 2 else [])
        for i, w in enumerate(["abc", "qhm", "word", "xyz", "system", "reverse"] * 4)]


def chat_run(tmp_path, folder, *, steps=2, **dataset):
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": row}) + "\n" for row in ROWS))
    path = write_config(tmp_path, [stage("sft", 1, {"hf_dataset_or_datasets": "json",
                                                    "hf_data_files": str(tmp_path / "chat.jsonl"),
                                                    "messages_column_name": "messages", **dataset})],
                        tokenizer=str(folder), vocab_size=416, sequence_length=64, micro_batch_size=2,
                        accumulation=1, train_steps=steps)
    return load_config(path)


@pytest.mark.parametrize("jinja_file", [True, False], ids=["chat_template_jinja", "in_tokenizer_config"])
def test_an_exported_chat_model_renders_as_the_run_did_and_stops_at_the_end_of_a_turn(tmp_path, jinja_file):
    folder = chat_tokenizer(tmp_path / "tok", LLAMA3, jinja_file=jinja_file)
    config = chat_run(tmp_path, folder)
    train(config, out=quiet(), progress=False)
    export_hf(str(tmp_path / "checkpoints"), str(tmp_path / "hf"))
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    source = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = ChatTemplate(load_tokenizer(folder))
    assert (tmp_path / "hf" / "chat_template.jinja").exists() == jinja_file
    assert ("chat_template" in json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())) != jinja_file
    for conversation in CONVERSATIONS:
        for prompt in (False, True):
            text = exported.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
            assert text == source.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
            assert text == ours.render(as_messages(conversation), add_generation_prompt=prompt)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [exported.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|eot_id|>")]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert model.generation_config.eos_token_id == generation["eos_token_id"]


@pytest.mark.slow
def test_preview_shows_a_packed_chat_window_its_samples_and_their_assistant_turns(tmp_path):
    folder = chat_tokenizer(tmp_path / "tok", CHATML)
    config = chat_run(tmp_path, folder, packing=True)
    shown = subprocess.run([sys.executable, str(REPO / "bin" / "preview"), str(tmp_path / "run.toml"), "--rows", "1"],
                           capture_output=True, text=True, timeout=600)
    assert shown.returncode == 0, shown.stderr
    body = shown.stdout.split("\n\nrow ")[1]
    text = "".join(line[4:] if line.startswith("    ") else line for line in body.splitlines()[1:])
    documents = text.split("‖")
    assert len(documents) >= 3 and "documents" in body.splitlines()[0]   # several samples in the window
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    rendered = {hf.apply_chat_template(row, tokenize=False).replace("\n", "↵") for row in ROWS}
    answers = {hf.decode(hf.encode(m["content"], add_special_tokens=False)) + "<|im_end|>↵"
               for row in ROWS for m in row if m["role"] == "assistant"}
    for k, document in enumerate(documents):
        plain = document.replace("⟦", "").replace("⟧", "")
        if k == len(documents) - 1:
            plain = plain.split("<|endoftext|>")[0]   # the window's padding follows its last sample
        assert plain in rendered, document
        # the targets: each assistant answer and its end of turn; the rest (system, user, headers) in ⟦⟧
        outside = [piece.split("⟦")[0] for piece in document.split("⟧")[1:]]
        assert outside and all(piece in answers for piece in outside if piece), document
    assert config.data_stages[0].data.dataset.packing


@pytest.mark.slow
def test_the_chat_demo_learns_its_skill_through_the_chat_format(tmp_path):
    # schedules/chat.toml shortened to a smoke run (the full run and its exact match: docs/data.md): 40 steps of
    # prose, then 100 of the chat stage, too few for the swapping itself (exact match appears after ~400 chat
    # steps) but enough for the format: the held-out answers' loss falls by ~half (measured 5.64 → 2.89)
    overrides = ["tokens.train_steps=140", "data_stages.chat.start_training_step=41", "evaluation.interval=1000",
                 "evaluation.datasets.swap.max_samples=64"]
    done = run_command("train", *train_args(tmp_path / "run", *overrides, config=REPO / "schedules" / "chat.toml"),
                       cwd=None, timeout=3600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["step"]: r for r in read_eval(tmp_path / "run")}
    assert sorted(rows) == [40, 140] and rows[40]["stage"] == "pretrain" and rows[140]["stage"] == "chat"
    before, after = rows[40], rows[140]
    assert before["accuracy"] == 0.0 and before["tokens"] == after["tokens"] > 64 * 5
    assert after["loss"] < 0.6 * before["loss"], (before, after)
