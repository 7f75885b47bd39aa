"""Tokenizers nobody here wrote the spelling of: an end-of-text token outside the built-in list (`<EOT>`), named by
[tokenizer] eos_token or by an HF folder's tokenizer_config.json, used by bin/prepare, by training and by export;
and a tokenizer the model cannot embed, refused by --plan."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import transformers
from data_helpers import EOT_TEXTS, stage, write_config
from helpers import REPO
from process_helpers import run_in_process
from support.tokenizers import raw

from nanoflow.config import load_config
from nanoflow.data import TokenizerError, load_run_tokenizer, load_tokenizer, open_stage
from nanoflow.interop.export import export_hf
from nanoflow.schedule import Schedule
from nanoflow.training.loop import train

TEXTS = EOT_TEXTS


def test_a_non_standard_eos_is_an_error_until_named(eot_json):
    with pytest.raises(TokenizerError, match=r'tokenizer.json: found no end-of-text token among the special tokens '
                                             r"\['<BOT>', '<EOT>'\].*eos_token"):
        load_tokenizer(eot_json)
    tokenizer = load_tokenizer(eot_json, eos_token="<EOT>")
    assert (tokenizer.eos_token, tokenizer.eos_id) == ("<EOT>", raw(eot_json).token_to_id("<EOT>")) == ("<EOT>", 1)
    assert (tokenizer.bos_token, tokenizer.bos_id) == (None, None)       # <BOT> is no spelling nanoflow knows
    assert tokenizer.vocab_size == 280 and tokenizer.name == str(eot_json)
    assert load_tokenizer(eot_json, eos_token="<EOT>", bos_token="<BOT>").bos_id == 0
    with pytest.raises(TokenizerError, match=r'tokenizer.eos_token = "<\|endoftext\|>" is not in the vocabulary of '
                                             r".*tokenizer.json \(280 ids; its special tokens: <BOT>, <EOT>\)"):
        load_tokenizer(eot_json, eos_token="<|endoftext|>")
    with pytest.raises(TokenizerError, match=r'tokenizer.bos_token = "<s>" is not in the vocabulary'):
        load_tokenizer(eot_json, eos_token="<EOT>", bos_token="<s>")
    with pytest.raises(TokenizerError, match="byte tokenizer has one special token"):
        load_tokenizer("bytes", eos_token="<EOT>")


def hf_folder_by_transformers(folder: Path, eot_json: Path) -> Path:
    """An HF tokenizer folder as transformers itself writes one (tokenizer.json + tokenizer_config.json + ...)."""
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(eot_json), eos_token="<EOT>", bos_token="<BOT>")
    fast.save_pretrained(folder)
    return folder


def test_an_hf_tokenizer_folder_names_its_special_tokens(tmp_path, eot_json):
    folder = hf_folder_by_transformers(tmp_path / "hf-tokenizer", eot_json)
    assert json.loads((folder / "tokenizer_config.json").read_text())["eos_token"] == "<EOT>"
    tokenizer = load_tokenizer(folder)
    assert (tokenizer.eos_token, tokenizer.eos_id, tokenizer.bos_token, tokenizer.bos_id) == ("<EOT>", 1, "<BOT>", 0)
    assert tokenizer.name == str(folder) and tokenizer.vocab_size == 280
    assert tokenizer.encode("1+2=3") == raw(eot_json).encode("1+2=3", add_special_tokens=False).ids
    # [tokenizer] wins over the folder.
    assert load_tokenizer(folder, eos_token="<BOT>").eos_id == 0

    # Older transformers writes the specials as AddedToken tables.
    older = tmp_path / "older"
    older.mkdir()
    shutil.copy(eot_json, older / "tokenizer.json")
    added = {"__type": "AddedToken", "content": "<EOT>", "lstrip": False, "normalized": False, "rstrip": False,
             "single_word": False}
    (older / "tokenizer_config.json").write_text(json.dumps({"eos_token": added, "bos_token": None}))
    tokenizer = load_tokenizer(older)
    assert (tokenizer.eos_token, tokenizer.eos_id, tokenizer.bos_token) == ("<EOT>", 1, None)

    (older / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(TokenizerError, match=r'older/tokenizer_config.json: eos_token = "</s>" is not in the '
                                             r"vocabulary of .*older/tokenizer.json"):
        load_tokenizer(older)
    (older / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="older: a folder without a tokenizer.json"):
        load_tokenizer(older)


def eot_config(tmp_path: Path, tokenizer: Path, *extra: str, stages=None, name="run.toml"):
    readme = {"hf_dataset_or_datasets": "text", "hf_data_files": str(REPO / "README.md")}
    stages = stages or [stage("pretrain", 1, readme)]
    path = write_config(tmp_path, stages, tokenizer=str(tokenizer), train_steps=2, name=name)
    path.write_text(path.read_text().replace("[tokenizer]\n", "[tokenizer]\n" + "".join(f"{e}\n" for e in extra)))
    return path


def test_a_training_stage_ends_documents_with_the_named_eos(tmp_path, eot_json):
    config = load_config(eot_config(tmp_path, eot_json, 'eos_token = "<EOT>"'))
    tokenizer = load_run_tokenizer(config)
    assert tokenizer.eos_id == 1
    # README.md is one document: the stage's token stream is its text, then <EOT>.
    stream = raw(eot_json).encode(Path(REPO / "README.md").read_text(), add_special_tokens=False).ids + [1]
    with open_stage(config, 0, tokenizer, Schedule.from_config(config), cache_dir=str(tmp_path / "cache")) as loader:
        assert np.asarray(loader.parts[0].source.tokens).tolist() == stream
    out = io.StringIO()
    state = train(config, out=out, progress=False)
    assert state.step == 2

    # Without the key, training stops before step 1 with the tokenizer named (a ConfigError: exit status 2).
    plain = load_config(eot_config(tmp_path, eot_json, name="plain.toml"))
    with pytest.raises(TokenizerError, match="found no end-of-text token"):
        train(plain, out=io.StringIO(), progress=False)


def test_export_declares_the_real_special_tokens(tmp_path, eot_json):
    folder = hf_folder_by_transformers(tmp_path / "hf-tokenizer", eot_json)
    config = load_config(eot_config(tmp_path, folder))
    train(config, out=io.StringIO(), progress=False)
    export_hf(str(tmp_path / "checkpoints"), str(tmp_path / "hf"))
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (0, 1)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (loaded.eos_token, loaded.eos_token_id, loaded.bos_token, loaded.bos_token_id) == ("<EOT>", 1, "<BOT>", 0)
    assert loaded("1+2=3", add_special_tokens=False)["input_ids"] == raw(eot_json).encode("1+2=3").ids

    # A bare tokenizer.json with [tokenizer] eos_token: the exported folder says <EOT> too.
    (tmp_path / "bare").mkdir()
    config = load_config(eot_config(tmp_path / "bare", eot_json, 'eos_token = "<EOT>"'))
    train(config, out=io.StringIO(), progress=False)
    export_hf(str(tmp_path / "bare" / "checkpoints"), str(tmp_path / "hf-bare"))
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf-bare")
    assert (loaded.eos_token, loaded.eos_token_id) == ("<EOT>", 1)
    assert json.loads((tmp_path / "hf-bare" / "config.json").read_text())["eos_token_id"] == 1


def test_accept_recorded_names_is_a_list_of_names(tmp_path, eot_json):
    from nanoflow.config import ConfigError

    path = eot_config(tmp_path, eot_json, 'eos_token = "<EOT>"', 'accept_recorded_names = "gpt2"')
    with pytest.raises(ConfigError, match=r'tokenizer.accept_recorded_names: expected a list of names, got \'gpt2\' '
                                          r'\(write \["gpt2"\]\)'):
        load_config(path)
    listed = eot_config(tmp_path, eot_json, 'eos_token = "<EOT>"', 'accept_recorded_names = ["gpt2"]', name="ok.toml")
    assert load_config(listed).tokenizer.accept_recorded_names == ["gpt2"]


def test_plan_loads_the_tokenizer_and_refuses_a_too_small_vocabulary(tmp_path, eot_json, capsys):
    tiny = str(REPO / "schedules" / "tiny.toml")
    small = run_in_process("train", tiny, "--plan", "--set", "model.vocab_size=200", capsys=capsys)
    assert small.returncode == 2 and "Traceback" not in small.stderr, small.stderr
    assert "model.vocab_size = 200 is smaller than the tokenizer's vocabulary (257 ids, bytes)" in small.stderr
    assert small.stdout == ""

    path = json.dumps(str(eot_json))
    named = run_in_process("train", tiny, "--plan", "--set", f"tokenizer.tokenizer_name_or_path={path}",
                           "--set", 'tokenizer.eos_token="<EOT>"', capsys=capsys)
    assert named.returncode == 0, named.stderr
    assert "280 ids, eos <EOT> = 1" in named.stdout
    unnamed = run_in_process("train", tiny, "--plan", "--set", f"tokenizer.tokenizer_name_or_path={path}", capsys=capsys)
    assert unnamed.returncode == 2 and "Traceback" not in unnamed.stderr and "eos_token" in unnamed.stderr
