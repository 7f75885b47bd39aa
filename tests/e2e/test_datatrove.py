"""datatrove, for real, both ways: a folder its own DocumentTokenizer writes trains in a nanoflow stage, and its own
DatatroveFolderDataset reads what bin/prepare writes, token for token. And the identity of a token folder's
tokenizer: decided by what the tokenizer is (a byte-identical copy elsewhere is the same tokenizer), an
explicit, logged way to accept a recorded name that cannot be resolved, and every affected stage in one error."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from data_helpers import eot_tokenizer, stage, write_config
from support.datatrove import documents, encode

from nanoflow.config import load_config
from nanoflow.data import TokenFolder, TokenFolderError, write_token_file
from nanoflow.training.loop import train


def datatrove_tokenize(output: Path, tokenizer_json: Path, texts: list[str]) -> Path:
    """Run datatrove's DocumentTokenizer in this process on local documents, with a local tokenizer.json."""
    from datatrove.data import Document
    from datatrove.pipeline.tokens import DocumentTokenizer

    step = DocumentTokenizer(output_folder=str(output), tokenizer_name_or_path=str(tokenizer_json), eos_token="<EOT>",
                             shuffle_documents=False)
    step.run(iter(Document(text=t, id=str(i)) for i, t in enumerate(texts)), rank=0, world_size=1)
    return output


def folder_config(tmp_path: Path, tokenizer: Path, stages: list[dict], *extra: str, train_steps: int = 3,
                  name: str = "run.toml") -> Path:
    path = write_config(tmp_path, stages, tokenizer=str(tokenizer), train_steps=train_steps, name=name,
                        sequence_length=8, micro_batch_size=2, accumulation=1)
    tokenizer_lines = "".join(f"{line}\n" for line in ('eos_token = "<EOT>"', *extra))
    path.write_text(path.read_text().replace("[tokenizer]\n", "[tokenizer]\n" + tokenizer_lines))
    return path


def test_a_folder_datatrove_tokenized_trains_with_a_copy_of_its_tokenizer(tmp_path):
    original = eot_tokenizer(tmp_path / "made-here" / "tokenizer.json")
    texts = documents()
    folder = datatrove_tokenize(tmp_path / "datatrove", original, texts)
    # What datatrove wrote: the documents with <EOT>, its metadata naming the path it was given.
    assert TokenFolder(folder)[0:len(TokenFolder(folder))].tolist() == sum(encode(original, texts), [])
    metadata = next(folder.glob("*.ds.metadata")).read_text().splitlines()
    assert metadata[0] == f"{original}|2"

    # A byte-identical copy elsewhere is the same tokenizer.
    copy = tmp_path / "elsewhere" / "tokenizer.json"
    copy.parent.mkdir()
    shutil.copy(original, copy)
    config = load_config(folder_config(tmp_path, copy, [stage("pretrain", 1, {"dataset_folder": str(folder)})]))
    state = train(config, out=io.StringIO(), progress=False)
    assert state.step == 3

    # Another tokenizer at the path the run names, with the same specials: refused, by content.
    eot_tokenizer(copy, vocab_size=270)
    with pytest.raises(TokenFolderError, match=rf'tokenized with "{original}" \({original}: content sha256:.*\), '
                                               rf"which is not this run's tokenizer {copy}"):
        train(load_config(folder_config(tmp_path, copy, [stage("pretrain", 1, {"dataset_folder": str(folder)})],
                                        name="other.toml")), fresh=True, out=io.StringIO(), progress=False)


def test_a_recorded_name_that_cannot_be_resolved_is_refused_unless_accepted(tmp_path):
    tokenizer = eot_tokenizer(tmp_path / "gone" / "tokenizer.json")
    folder = datatrove_tokenize(tmp_path / "datatrove", tokenizer, documents())
    here = tmp_path / "here" / "tokenizer.json"
    here.parent.mkdir()
    shutil.move(tokenizer, here)                    # the recorded path is gone: tokenized on another machine
    stages = [stage("pretrain", 1, {"dataset_folder": str(folder)})]
    with pytest.raises(TokenFolderError, match=rf'tokenized with "{tokenizer}", a name that cannot be resolved on '
                                               rf'this machine.*accept_recorded_names = \["{tokenizer}"\]'):
        train(load_config(folder_config(tmp_path, here, stages)), out=io.StringIO(), progress=False)
    run = tmp_path / "checkpoints"   # nothing but the released lock: no step, no metrics
    assert not run.exists() or [p.name for p in run.iterdir()] in ([], ["nanoflow.lock"])

    accepting = folder_config(tmp_path, here, stages, f"accept_recorded_names = [{json.dumps(str(tokenizer))}]",
                              name="accepting.toml")
    out = io.StringIO()
    state = train(load_config(accepting), out=out, progress=False)
    assert state.step == 3
    assert (f'note: stage "pretrain" (dataset_folder {folder}): tokenized with "{tokenizer}", which cannot be '
            f"resolved here; taken as this run's tokenizer {here} because tokenizer.accept_recorded_names lists it"
            in out.getvalue())


def test_a_hub_name_resolves_through_the_local_hf_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    tokenizer = eot_tokenizer(tmp_path / "tok" / "tokenizer.json")
    docs = encode(tokenizer, documents())
    write_token_file(tmp_path / "hub", "00000_unshuffled", [np.array(d) for d in docs], tokenizer_name="someorg/eot",
                     token_size=2)
    cache = tmp_path / "hub-cache"
    snapshot = cache / "models--someorg--eot" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (cache / "models--someorg--eot" / "refs").mkdir()
    (cache / "models--someorg--eot" / "refs" / "main").write_text("0123abcd")
    shutil.copy(tokenizer, snapshot / "tokenizer.json")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    stages = [stage("pretrain", 1, {"dataset_folder": str(tmp_path / "hub")})]
    assert train(load_config(folder_config(tmp_path, tokenizer, stages)), out=io.StringIO(), progress=False).step == 3

    eot_tokenizer(snapshot / "tokenizer.json", vocab_size=270)   # the cached hub tokenizer is another one
    with pytest.raises(TokenFolderError, match=r'tokenized with "someorg/eot" \(.*models--someorg--eot.*\), which is '
                                               r"not this run's tokenizer"):
        train(load_config(folder_config(tmp_path, tokenizer, stages)), fresh=True, out=io.StringIO(), progress=False)


def test_one_error_names_every_stage_whose_folder_is_refused(tmp_path, capsys):
    from nanoflow.commands.cli import train_main

    tokenizer = eot_tokenizer(tmp_path / "tok" / "tokenizer.json")
    docs = [np.array(d) for d in encode(tokenizer, documents())]
    write_token_file(tmp_path / "a", "00000", docs, tokenizer_name="someone/else", token_size=2)
    write_token_file(tmp_path / "b", "00000", docs, tokenizer_name="bytes", token_size=2)
    stages = [stage("pretrain", 1, {"dataset_folder": str(tmp_path / "a")}),
              stage("anneal", 3, {"dataset_folder": str(tmp_path / "b")})]
    code = train_main([str(folder_config(tmp_path, tokenizer, stages, train_steps=4))])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "2 stages cannot train on their data" in err
    assert f'stage "pretrain" (dataset_folder {tmp_path / "a"}): tokenized with "someone/else"' in err
    assert (f'stage "anneal" (dataset_folder {tmp_path / "b"}): tokenized with "bytes" (the built-in byte '
            "tokenizer), which is not this run's tokenizer") in err
    assert not (tmp_path / "checkpoints" / "1").exists()
