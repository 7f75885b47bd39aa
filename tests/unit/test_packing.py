"""Packed SFT: best-fit decreasing never splits a sample nor overfills a window, a packed window's loss is its
samples' losses in transformers' model run on each alone, the windows are a pure function of the data (a resume
reads what an unbroken run read), and over-long samples are cut or left out as the key says, never silently."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from chat_helpers import CHATML_GENERATION, chat_tokenizer
from data_helpers import BYTES, stage, write_config
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoflow.commands.plan import render_plan
from nanoflow.config import load_config
from nanoflow.data import StageDataError, load_tokenizer, open_stage
from nanoflow.data.packing import best_fit_decreasing
from nanoflow.data.sft import PackedSFT, SFTExamples
from nanoflow.data.sources import IGNORE_INDEX
from nanoflow.model import Llama
from nanoflow.run import open_run
from nanoflow.schedule import Schedule


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), max_size=120), capacity=st.integers(40, 100))
def test_best_fit_decreasing_never_splits_never_overfills_and_is_a_pure_function(sizes, capacity):
    members, bounds = best_fit_decreasing(np.array(sizes, dtype=np.int64), capacity)
    assert sorted(members.tolist()) == list(range(len(sizes)))                   # each sample in one window, whole
    windows = [members[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    loads = [sum(sizes[i] for i in window) for window in windows]
    assert all(windows) and all(load <= capacity for load in loads)
    assert sum(load <= capacity / 2 for load in loads) <= 1    # a new window only when no open one has room
    again = best_fit_decreasing(np.array(sizes, dtype=np.int64), capacity)
    assert np.array_equal(again[0], members) and np.array_equal(again[1], bounds)


def test_best_fit_decreasing_takes_the_tightest_window():
    members, bounds = best_fit_decreasing(np.array([6, 5, 4, 3]), 10)   # 6 opens, 5 opens, 4 → with 6, 3 → with 5
    assert [members[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)] == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="sample 1 has size 11, outside 0..10"):
        best_fit_decreasing(np.array([1, 11]), 10)


# ---------------------------------------------------------------------------------------------
# Packed stages

def rows_of(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = ["abc", "reverse", "qhm", "x", "the word", "mhq", "  ", "zyx!"]
    return [{"prompt": " ".join(rng.choice(words, rng.integers(1, 5))), "completion": " ".join(
        rng.choice(words, rng.integers(1, 4)))} for _ in range(n)]


def sft_config(tmp_path, rows, seq=48, tokenizer="bytes", vocab_size=288, name="run.toml", batch=4, **dataset):
    data = tmp_path / "sft.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    columns = {"messages_column_name": "messages"} if "messages" in rows[0] else \
        {"prompt_column_name": "prompt", "completion_column_name": "completion"}
    path = write_config(tmp_path, [stage("sft", 1, {"hf_dataset_or_datasets": "json", "hf_data_files": str(data),
                                                    **columns, **dataset})],
                        sequence_length=seq, micro_batch_size=batch, accumulation=1, train_steps=6, tokenizer=tokenizer,
                        vocab_size=vocab_size, name=name)
    return load_config(path)


def loader_of(config, tmp_path):
    tokenizer = load_tokenizer(config.tokenizer.tokenizer_name_or_path)
    return open_stage(config, 0, tokenizer, Schedule.from_config(config), cache_dir=str(tmp_path / "cache"))


def hf_and_ours(vocab: int):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      rope_theta=10000.0, initializer_range=0.1, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).float().eval()
    fields = ("vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
              "max_position_embeddings rms_norm_eps initializer_range tie_word_embeddings").split()
    ours = Llama(SimpleNamespace(**{f: getattr(config, f) for f in fields}, rope_theta=10000.0))
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


CHAT_ROWS = [{"messages": [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
              + ([{"role": "user", "content": "and?"}, {"role": "assistant", "content": row["prompt"][::-1]}] if i % 3
                 else [])} for i, row in enumerate(rows_of(30, seed=4))]


@pytest.mark.parametrize("kind", ["prompt_completion", "chat"])
def test_a_packed_windows_loss_and_gradients_are_its_samples_run_alone_in_transformers(tmp_path, kind):
    if kind == "chat":
        folder = chat_tokenizer(tmp_path / "tok", CHATML_GENERATION)
        config = sft_config(tmp_path, CHAT_ROWS, seq=96, tokenizer=str(folder), vocab_size=416, packing=True)
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        alone = [hf_tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                                  return_assistant_tokens_mask=True) for row in CHAT_ROWS]
        alone = [(list(a["input_ids"]), list(a["assistant_masks"])) for a in alone]
    else:
        rows = rows_of(30)
        config = sft_config(tmp_path, rows, packing=True)
        alone = [(BYTES.encode(r["prompt"]) + BYTES.encode(r["completion"]) + [BYTES.eos_id],
                  [0] * len(BYTES.encode(r["prompt"])) + [1] * (len(BYTES.encode(r["completion"])) + 1)) for r in rows]
    with loader_of(config, tmp_path) as loader:
        source = loader.parts[0].source
        assert isinstance(source, PackedSFT) and len(source) < len(alone) / 2    # several samples a window
        ids, labels, positions = (torch.from_numpy(x) for x in source.samples(np.arange(len(source))))
    hf, ours = hf_and_ours(config.model.vocab_size)
    hf_loss = torch.zeros(())
    for tokens, mask in alone:   # each sample alone, as transformers trains it: its targets predicted from their past
        tokens = tokens[:config.tokens.sequence_length + 1]
        targets = torch.tensor([t if m else IGNORE_INDEX for t, m in zip(tokens[1:], mask[1:], strict=False)])
        logits = hf(input_ids=torch.tensor(tokens[:-1])[None]).logits[0]
        hf_loss = hf_loss + F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    our_loss = ours(ids, labels, position_ids=positions)
    assert int((positions == 0).sum()) == len(alone)   # every sample starts a document, in exactly one window
    torch.testing.assert_close(our_loss, hf_loss, rtol=1e-5, atol=1e-4)
    hf_loss.backward()
    our_loss.backward()
    ours_grads = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        torch.testing.assert_close(ours_grads[name].grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_windows_are_what_the_order_permutes_the_same_on_every_open_and_hold_each_sample_once(tmp_path):
    rows = rows_of(60, seed=1)
    packed = sft_config(tmp_path, rows, packing=True)
    with loader_of(packed, tmp_path) as first:
        batches = [first.batch_at(step) for step in range(1, 7)]
        source = first.parts[0].source
        windows = [source.sample(w) for w in range(len(source))]
    with loader_of(packed, tmp_path) as again:   # a resume: the cache read back, the windows packed again
        for step in (6, 3, 1):
            assert all(torch.equal(again.batch_at(step)[k], batches[step - 1][k]) for k in batches[step - 1])
    unpacked = sft_config(tmp_path, rows, name="unpacked.toml")
    with loader_of(unpacked, tmp_path) as loader:
        one_a_row = loader.parts[0].source
        samples = sorted(_documents(*one_a_row.sample(i)) for i in range(len(one_a_row)))
    assert sorted(d for w in windows for d in _window_documents(*w)) == samples


def _documents(ids, labels, positions=None):
    """A row's sample as (its inputs up to its last target, its labels there)."""
    last = int(np.flatnonzero(labels != IGNORE_INDEX)[-1]) + 1
    return tuple(ids[:last].tolist()), tuple(labels[:last].tolist())


def _window_documents(ids, labels, positions):
    starts = np.flatnonzero(positions == 0).tolist() + [len(ids)]
    return [_documents(ids[a:b], labels[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True)
            if (labels[a:b] != IGNORE_INDEX).any()]


@pytest.mark.parametrize("packing", [False, True])
def test_overlong_samples_are_cut_keeping_their_start_or_left_out_and_counted_in_the_plan(tmp_path, packing, capsys):
    rows = [{"prompt": "p" * p, "completion": "c" * c} for p, c in ((3, 4), (10, 4), (12, 8), (13, 10), (5, 4))]
    seq = 16   # a sample fits in 17 tokens: 12 + 8 + 1 and 13 + 10 + 1 do not
    cut = sft_config(tmp_path, rows, seq=seq, packing=packing, name="cut.toml", batch=1)
    dropped = sft_config(tmp_path, rows, seq=seq, packing=packing, overlong_samples="drop", name="drop.toml", batch=1)
    with loader_of(cut, tmp_path) as a, loader_of(dropped, tmp_path) as b:
        kept, left = ([d for w in range(len(x.parts[0].source)) for d in (
            _window_documents(*x.parts[0].source.sample(w)) if packing else [_documents(*x.parts[0].source.sample(w))])]
            for x in (a, b))
        assert isinstance(a.parts[0].source, PackedSFT if packing else SFTExamples)
    # a sample's inputs up to its last target: n − 1 tokens; the long ones cut to 17 tokens, so 16
    assert sorted(len(ids) for ids, _ in kept) == [7, 9, 14, 16, 16]
    assert all(ids[:3] == (ord("p"),) * 3 for ids, _ in kept)            # the prompt's start kept
    assert sorted(len(ids) for ids, _ in left) == [7, 9, 14]
    print(render_plan(open_run(dropped, join=False)))
    plan = capsys.readouterr().out
    assert "3 prompt/completion rows trained on; 2 longer than sequence_length + 1 = 17 tokens, left out " \
           '(overlong_samples = "drop")' in plan
    # 7 + 14 + 9 = 30 predictions: 30 of 3 × 16 positions one a row; packed (14 | 9 + 7), 30 of 2 × 16
    if packing:
        assert "padding 6.2% packed into 2 windows (packing = true), 37.5% one a row" in plan
    else:
        assert "padding 37.5% one a row, 6.2% packed into 2 windows with packing = true" in plan


def test_every_sample_too_long_to_keep_is_an_error_naming_the_stage(tmp_path):
    config = sft_config(tmp_path, [{"prompt": "p" * 40, "completion": "c"}] * 3, seq=16, overlong_samples="drop")
    with pytest.raises(StageDataError, match=r'stage "sft" \(json files .*sft.jsonl\): every sample is longer than '
                                             r'sequence_length \+ 1 = 17 tokens, and overlong_samples = "drop"'):
        loader_of(config, tmp_path)


def test_held_out_rows_are_left_out_of_the_packing_and_evaluated_one_a_row(tmp_path):
    from nanoflow.evaluation import load_eval_set

    rows = rows_of(40, seed=2)
    config = sft_config(tmp_path, rows, packing=True, held_out_samples=8)
    text = (tmp_path / "run.toml").read_text() + \
        '\n[evaluation]\n[[evaluation.datasets]]\nname = "held"\nheld_out_of = "sft"\n'
    (tmp_path / "run.toml").write_text(text)
    config = load_config(tmp_path / "run.toml")
    with loader_of(config, tmp_path) as loader:
        source = loader.parts[0].source
        trained = sorted(d for w in range(len(source)) for d in _window_documents(*source.sample(w)))
    held = load_eval_set(config, config.evaluation.datasets[0], BYTES)
    assert held.position_ids is None and len(held.input_ids) == 8
    held_docs = [_documents(i.numpy(), l.numpy()) for i, l in zip(held.input_ids, held.labels, strict=True)]
    unpacked = sft_config(tmp_path, rows, name="all.toml")
    with loader_of(unpacked, tmp_path) as loader:
        every = [_documents(*loader.parts[0].source.sample(i)) for i in range(40)]
    assert trained == sorted(every[:32]) and held_docs == every[32:]
