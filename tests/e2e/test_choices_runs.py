"""Multiple-choice eval sets in a whole run: rows in eval.jsonl and a progress line, and the in-loop numbers equal
to lm-eval's own on the same rows and model (tests/unit/test_choices.py: reading, asking and counting)."""

from __future__ import annotations

import io as text_io
import json

import pytest
from support.choices import ROWS, write_choice_run, write_task
from support.evaluation import rows_of

from nanoflow.config import load_config


def test_rows_in_eval_jsonl_and_a_progress_line(tmp_path):
    from nanoflow.training.loop import train

    out = text_io.StringIO()
    train(load_config(write_choice_run(tmp_path)), fresh=True, out=out)
    rows = rows_of(tmp_path / "run" / "eval.jsonl")
    assert [r["step"] for r in rows] == [2, 4]
    assert all(set(r) == {"step", "stage", "dataset", "loss", "tokens", "accuracy", "correct", "accuracy_norm",
                          "correct_norm", "examples", "data_fingerprint"} for r in rows)
    assert all(r["examples"] == len(ROWS) and r["accuracy"] == r["correct"] / len(ROWS) for r in rows)
    assert [line for line in out.getvalue().splitlines() if line.startswith("eval step 4")] == [
        f"eval step 4 (pretrain): choices loss {rows[1]['loss']:.4f} acc {rows[1]['accuracy']:.1%} "
        f"acc_norm {rows[1]['accuracy_norm']:.1%}"]


def bpe_with_bos(folder) -> list[str]:
    """--set overrides for a BPE tokenizer.json whose post-processor puts its BOS before every text, as a Llama
    tokenizer's does: lm-eval's requests then begin with it, and so must the in-loop ones."""
    from data_helpers import eot_tokenizer
    from tokenizers import Tokenizer, processors

    path = eot_tokenizer(folder / "bpe" / "tokenizer.json")
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.post_processor = processors.TemplateProcessing(single="<BOT> $A", special_tokens=[("<BOT>", 0)])
    tokenizer.save(str(path))
    return [f"tokenizer.tokenizer_name_or_path='{path}'", "tokenizer.eos_token='<EOT>'", "tokenizer.bos_token='<BOT>'"]


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe with a BOS"])
def test_the_in_loop_numbers_equal_lm_evals_on_the_same_rows_and_model(tmp_path, tokenizer):
    """The conformance test: lm-eval (its HF model on the export, its task over the same JSON lines) and the
    in-loop set give each choice the same log-likelihood, and so the same acc and acc_norm."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    overrides = [] if tokenizer == "bytes" else bpe_with_bos(tmp_path)
    from nanoflow.data.tokenizer import load_run_tokenizer
    from nanoflow.evaluation import choice_loglikelihoods, load_checkpoint_weights, load_eval_sets
    from nanoflow.interop.harness import run_lm_eval
    from nanoflow.io import read_init_weights
    from nanoflow.parallel.mesh import SINGLE
    from nanoflow.training.loop import train

    config = load_config(write_choice_run(tmp_path), overrides)
    train(config, fresh=True, out=text_io.StringIO())
    row = rows_of(tmp_path / "run" / "eval.jsonl")[-1]

    lm_rows, results = run_lm_eval(str(tmp_path / "run"), str(write_task(tmp_path)), batch_size=5, device="cpu",
                                   log_samples=True)
    assert [(r["task"], r["step"], r["samples"]) for r in lm_rows] == [("nanoflow_choices", 4, len(ROWS))]
    assert (lm_rows[0]["acc"], lm_rows[0]["acc_norm"]) == (row["accuracy"], row["accuracy_norm"])

    samples = sorted(results["samples"]["nanoflow_choices"], key=lambda s: s["doc_id"])
    theirs = [float(response[0][0]) for s in samples for response in s["resps"]]
    (eval_set,) = load_eval_sets(config, load_run_tokenizer(config))
    if overrides:   # every request begins with the BOS: the empty context's alone, the others' by the post-processor
        assert (eval_set.input_ids[:, 0] == 0).all()
    else:
        assert row["accuracy"] != row["accuracy_norm"]   # the case tells the two apart
    model = load_checkpoint_weights(config, SINGLE, read_init_weights(str(tmp_path / "run")), str(tmp_path / "run"))
    ours = choice_loglikelihoods(model, eval_set, SINGLE)
    assert len(ours) == len(theirs) == sum(len(r["options"]) for r in ROWS)
    assert ours == pytest.approx(theirs, abs=1e-4)
    assert json.dumps(lm_rows)   # plain JSON, as bin/eval prints them

