"""Document masking: the attention kernel against a boolean-mask reference, a packed window's loss against
transformers' LlamaForCausalLM run on each of its documents alone, and the data's position ids and label mask
against transformers' DataCollatorWithFlattening and datatrove's own positions."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from data_helpers import BYTES, EOS, documents, load, stage, write_folder
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoflow.attention import Documents, causal_attention
from nanoflow.data import open_stage
from nanoflow.data.sources import IGNORE_INDEX, PackedText, mark_documents
from nanoflow.model import Llama
from nanoflow.schedule import Schedule


def position_ids_of(lengths_per_row: list[list[int]], first: int = 0) -> torch.Tensor:
    """Each row's documents of these lengths; the first document of each row begins at position `first` (a
    document cut by the row's left edge keeps its positions)."""
    return torch.tensor([[p + first * (d == 0) for d, n in enumerate(row) for p in range(n)] for row in lengths_per_row])


def reference_attention(q, k, v, position_ids):
    """Causal attention within documents through an explicit [rows, seq, seq] boolean mask (the slow, obvious way)."""
    starts = position_ids == 0
    starts[:, 0] = True
    document = starts.cumsum(1)
    seq = position_ids.shape[1]
    mask = (document[:, :, None] == document[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          attn_mask=mask[:, None])


rows_of_documents = st.integers(1, 24).flatmap(
    lambda seq: st.lists(st.lists(st.integers(1, seq), min_size=1, max_size=seq)
                         .map(lambda lengths, seq=seq: _fill(lengths, seq)), min_size=1, max_size=5))


def _fill(lengths: list[int], seq: int) -> list[int]:
    """Lengths cut or extended so that they sum to seq: one row's documents."""
    out, total = [], 0
    for n in lengths:
        n = min(n, seq - total)
        if n:
            out.append(n)
            total += n
    return out + ([seq - total] if total < seq else [])


@settings(max_examples=40, deadline=None)
@given(rows_of_documents, st.integers(0, 3), st.integers(0, 2**16))
def test_attention_within_documents_equals_the_boolean_mask_reference_with_its_gradients(rows, first, seed):
    position_ids = position_ids_of(rows, first)
    generator = torch.Generator().manual_seed(seed)
    shape = lambda heads: (len(rows), heads, position_ids.shape[1], 8)  # noqa: E731
    q, k, v = (torch.randn(shape(h), generator=generator, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    ours = causal_attention(q, k, v, Documents.from_position_ids(position_ids))
    reference = reference_attention(q, k, v, position_ids)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    upstream = torch.randn(ours.shape, generator=generator, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), upstream), torch.autograd.grad(reference, (q, k, v), upstream),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_documents_are_read_from_position_ids_and_rows_of_one_document_take_plain_causal_sdpa():
    documents_ = Documents.from_position_ids(torch.tensor([[0, 1, 0, 1, 2, 0], [3, 4, 5, 0, 1, 2], [2, 3, 4, 5, 6, 7]]))
    assert documents_.lengths == ((2, 3, 1), (3, 3), (6,)) and documents_.count == 6   # a row's start is a start
    whole = Documents.from_position_ids(torch.arange(6).expand(3, 6))
    assert whole.whole_rows and whole.lengths == ((6,),) * 3
    q, k, v = (torch.randn(3, 2, 6, 4) for _ in range(3))
    assert torch.equal(causal_attention(q, k, v, whole), F.scaled_dot_product_attention(q, k, v, is_causal=True))


# ---- the model: a packed window against transformers on each document alone ----

FIELDS = ("vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
          "max_position_embeddings rms_norm_eps initializer_range tie_word_embeddings").split()


def hf_and_ours(vocab: int = 300, max_positions: int = 64):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                                      rope_theta=10000.0, initializer_range=0.1, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).float().eval()
    ours = Llama(SimpleNamespace(**{f: getattr(config, f) for f in FIELDS}, rope_theta=10000.0))
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def test_a_packed_windows_loss_and_gradients_are_its_documents_run_alone_in_transformers():
    rng = np.random.default_rng(3)
    docs = documents(rng, 12, 97, 123, length=(1, 14))     # some of one token: a lone end-of-text
    stream = np.concatenate(docs)
    seq = 40
    source = PackedText(stream, seq, eos_id=EOS)
    read = source.samples(np.arange(len(source)))
    hf, ours = hf_and_ours()
    # Each window's documents, run alone in transformers: a document cut by the window's left edge from its part
    # inside; the window's last document predicts the token after the window, as the window's last label does.
    hf_loss = torch.zeros(())
    for w in range(len(source)):
        window = stream[w * seq:w * seq + seq + 1]
        ends = [0] + [i + 1 for i in range(seq) if window[i] == EOS] + [seq]
        for a, b in zip(ends[:-1], ends[1:], strict=True):
            if a == b:
                continue
            inputs, targets = torch.tensor(window[a:b])[None], torch.tensor(window[a + 1:b + 1])
            if window[b - 1] == EOS:
                targets = targets[:-1]       # an end-of-text token predicts nothing: the next document is another's
            logits = hf(input_ids=inputs).logits[0, :len(targets)]
            hf_loss = hf_loss + F.cross_entropy(logits, targets, reduction="sum")
    ids, labels, positions = (torch.from_numpy(x) for x in read)
    our_loss = ours(ids, labels, position_ids=positions)
    assert int((labels != IGNORE_INDEX).sum()) > 0 and (positions == 0).sum() > len(source)   # packed, masked
    torch.testing.assert_close(our_loss, hf_loss, rtol=1e-5, atol=1e-5)
    hf_loss.backward()
    our_loss.backward()
    ours_grads = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        torch.testing.assert_close(ours_grads[name].grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_packed_windows_logits_are_each_documents_logits_alone_in_transformers():
    hf, ours = hf_and_ours()
    lengths = [5, 1, 9, 3, 14]
    ids = torch.randint(0, 300, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        packed = ours(ids, position_ids=position_ids_of([lengths]))
        alone = torch.cat([hf(input_ids=part).logits for part in ids.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_position_ids_of_one_document_a_row_change_nothing_bit_for_bit():
    _, ours = hf_and_ours()
    ids = torch.randint(0, 300, (3, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(ours(ids, position_ids=torch.arange(32).expand(3, 32)), ours(ids))


# ---- the data: position ids and label masks as transformers and datatrove make them ----

def test_marked_windows_equal_transformers_data_collator_with_flattening():
    rng = np.random.default_rng(5)
    docs = documents(rng, 6, 97, 123, length=(1, 8))
    stream = np.concatenate(docs)
    flat = transformers.DataCollatorWithFlattening(return_position_ids=True)([{"input_ids": d.tolist()} for d in docs])
    # transformers' labels are unshifted (label t is token t; -100 at each document's first token): the label of
    # our prediction from token t is its label t + 1
    input_ids, labels = stream[None, :-1].copy(), stream[None, 1:].copy()
    positions = mark_documents(input_ids, labels, EOS)
    assert positions[0].tolist() == flat["position_ids"][0, :-1].tolist()
    assert labels[0].tolist() == flat["labels"][0, 1:].tolist()


def test_position_ids_equal_datatroves_positions_from_the_end_of_text_token(tmp_path):
    from datatrove.utils.dataset import DatatroveFileDataset

    rng = np.random.default_rng(7)
    seq = 16
    docs = documents(rng, 40, 97, 123, length=(1, 20))
    write_folder(tmp_path / "tokens", docs)
    # datatrove cuts its file at stride seq + 1; read those windows here from the same stream to compare
    datatrove = DatatroveFileDataset(str(tmp_path / "tokens" / "00000_unshuffled.ds"), seq, token_size=2,
                                     return_positions=True, positions_from_eos_token_id=EOS)
    stream = np.concatenate(docs)
    for item in range(len(datatrove)):
        theirs = datatrove[item]
        window = stream[item * (seq + 1):(item + 1) * (seq + 1)]
        assert theirs["input_ids"].tolist() == window.tolist()
        input_ids, labels = window[None, :-1].copy(), window[None, 1:].copy()
        positions = mark_documents(input_ids, labels, EOS)
        assert positions[0].tolist() == theirs["positions"][:-1].tolist()
        # nanotron's DataCollatorForCLMWithPositionIds: no loss where the next token's position is 0
        assert ((labels[0] == IGNORE_INDEX) == (theirs["positions"][1:] == 0).numpy()).all()


def test_a_stage_with_document_masking_gives_position_ids_and_one_without_gives_todays_batch(tmp_path):
    rng = np.random.default_rng(11)
    write_folder(tmp_path / "tokens", documents(rng, 300, 97, 123, length=(1, 30)))
    dataset = {"dataset_folder": str(tmp_path / "tokens")}
    plain = load(tmp_path, [stage("pretrain", 1, dataset)])
    masked = load(tmp_path, [stage("pretrain", 1, dataset, document_masking=True)], name="masked.toml")
    with open_stage(plain, 0, BYTES, Schedule.from_config(plain)) as a, \
            open_stage(masked, 0, BYTES, Schedule.from_config(masked)) as b:
        before, after = a.batch_at(3), b.batch_at(3)
    assert set(before) == {"input_ids", "labels"} and set(after) == {"input_ids", "labels", "position_ids"}
    assert torch.equal(before["input_ids"], after["input_ids"])
    crossing = before["input_ids"] == EOS
    assert crossing.any() and (after["labels"][crossing] == IGNORE_INDEX).all()
    assert torch.equal(after["labels"][~crossing], before["labels"][~crossing])
    expected = mark_documents(before["input_ids"].numpy(), before["labels"].numpy().copy(), EOS)
    assert after["position_ids"].tolist() == expected.tolist()


def test_a_source_that_packs_documents_itself_gives_position_ids_in_a_stage_without_masking(tmp_path):
    # The contract for packed sources of their own (packed SFT samples): a source whose Samples carry position ids
    # has them passed on, the other rows of the batch at 0..seq-1, whatever the stage's document_masking says.
    rng = np.random.default_rng(17)
    write_folder(tmp_path / "tokens", documents(rng, 300, 97, 123, length=(1, 30)))
    config = load(tmp_path, [stage("pretrain", 1, {"dataset_folder": str(tmp_path / "tokens")})])
    with open_stage(config, 0, BYTES, Schedule.from_config(config)) as loader:
        assert "position_ids" not in loader.batch_at(2)
        loader.parts[0].source.eos_id = EOS    # as if the source packed its samples itself
        batch = loader.batch_at(2)
    expected = mark_documents(batch["input_ids"].numpy(), batch["labels"].numpy().copy(), EOS)
    assert batch["position_ids"].tolist() == expected.tolist()


def test_document_masking_is_overridden_per_stage_and_per_eval_set(tmp_path):
    rng = np.random.default_rng(11)
    write_folder(tmp_path / "tokens", documents(rng, 300, 97, 123))
    dataset = {"dataset_folder": str(tmp_path / "tokens"), "held_out_samples": 8}
    config = load(tmp_path, [stage("a", 1, dataset), stage("b", 5, dataset, document_masking=False)],
                  overrides=["tokens.document_masking=true",
                             'evaluation.datasets=[{name = "held", held_out_of = "b"}, {name = "own", held_out_of = '
                             '"a", document_masking = false}, {name = "a", held_out_of = "a"}]'])
    assert [config.stage_tokens(i).document_masking for i in range(2)] == [True, False]
    assert [config.eval_document_masking(e) for e in config.evaluation.datasets] == [False, False, True]


def test_sft_rows_under_document_masking_are_one_document_each(tmp_path):
    (tmp_path / "sft.jsonl").write_text('{"p": "ab", "c": "cd"}\n{"p": "x", "c": "yz"}\n' * 4)
    dataset = {"hf_dataset_or_datasets": "json", "hf_data_files": str(tmp_path / "sft.jsonl"),
               "prompt_column_name": "p", "completion_column_name": "c"}
    config = load(tmp_path, [stage("sft", 1, dataset, document_masking=True)], sequence_length=8, micro_batch_size=2,
                  accumulation=1)
    with open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=str(tmp_path / "cache")) as loader:
        batch = loader.batch_at(1)
    assert torch.equal(batch["position_ids"], torch.arange(8).expand(2, 8))


# ---- what a document is: the text builder's sample_by, as datasets reads it ----

TEXT = "first line\nsecond line\n\nnew paragraph\n\n\nthird paragraph, one line\nlast line without a newline"


@pytest.mark.parametrize("sample_by", ["document", "line", "paragraph"])
def test_sample_by_makes_datasets_own_rows_the_documents(tmp_path, sample_by):
    import datasets

    for name in "ab":
        (tmp_path / f"{name}.txt").write_text(f"{name}: {TEXT}")
    files = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    dataset = {"hf_dataset_or_datasets": "text", "hf_data_files": files, "sample_by": sample_by}
    config = load(tmp_path, [stage("pretrain", 1, dataset)], sequence_length=8, micro_batch_size=1, accumulation=1)
    cache = str(tmp_path / "cache")   # one cache for all three: a sample_by must never read another's tokens
    with open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=cache) as loader:
        tokens = loader.parts[0].source.tokens.tolist()
    rows = datasets.load_dataset("text", data_files=files, sample_by=sample_by, split="train", cache_dir=cache)["text"]
    assert tokens == [t for row in rows for t in BYTES.encode(row) + [EOS]]
    assert (len(rows) == 2) == (sample_by == "document")    # two files: two documents, or many lines or paragraphs


def test_sample_by_is_refused_where_rows_come_from_another_builder_and_shown_in_the_plan(tmp_path):
    from nanoflow.commands.plan import render_plan
    from nanoflow.config import ConfigError
    from nanoflow.run import open_run

    (tmp_path / "a.txt").write_text(TEXT * 20)
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n')
    text = {"hf_dataset_or_datasets": "text", "hf_data_files": str(tmp_path / "a.txt"), "sample_by": "paragraph"}
    with pytest.raises(ConfigError, match='sample_by = "line" splits text files .* the rows come from the json builder'):
        load(tmp_path, [stage("p", 1, {"hf_dataset_or_datasets": "json", "hf_data_files": str(tmp_path / "b.jsonl"),
                                       "sample_by": "line"})])
    config = load(tmp_path, [stage("p", 1, text), stage("q", 3, {**text, "sample_by": "document"},
                                                          document_masking=True)], train_steps=4)
    lines = render_plan(open_run(config, join=False)).splitlines()
    assert 'stage "p": sample_by = "paragraph" (each paragraph one document)' in lines
    assert 'stage "q": sample_by = "document" (each text file one document), document masking' in lines


# ---- train_step, recomputation and evaluation take the position ids through ----

def packed_batch(rows: int, seq: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    stream = np.concatenate(documents(rng, 4 * rows * seq // 5, 97, 123, length=(1, 12)))
    ids = stream[:rows * seq + 1]
    input_ids, labels = ids[:-1].reshape(rows, seq).copy(), ids[1:].reshape(rows, seq).copy()
    position_ids = mark_documents(input_ids, labels, EOS)
    return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(position_ids)}


def test_train_steps_loss_is_the_models_masked_loss_whatever_the_micro_batches():
    from helpers import TINY

    from nanoflow import init_state, load_config, train_step

    batch = packed_batch(8, 32)
    losses = []
    for micro in (8, 2):
        config = load_config(TINY, [f"tokens.micro_batch_size={micro}", "tokens.global_batch_size=8"])
        state = init_state(config)
        with torch.no_grad():
            expected = state.model(batch["input_ids"], batch["labels"], position_ids=batch["position_ids"])
            unmasked = state.model(batch["input_ids"], batch["labels"])
        targets = int((batch["labels"] != IGNORE_INDEX).sum())
        _, metrics = train_step(state, batch)
        assert metrics["loss"] == pytest.approx(expected.item() / targets, abs=1e-6)
        assert abs(metrics["loss"] - unmasked.item() / targets) > 1e-4    # the documents were masked
        losses.append(metrics["loss"])
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    state = init_state(load_config(TINY, ["tokens.micro_batch_size=8", "tokens.global_batch_size=8"]))
    with pytest.raises(ValueError, match=r"input_ids and labels and position_ids of shape \[8, 32\].*\[8, 31\]"):
        train_step(state, {**batch, "position_ids": batch["position_ids"][:, :-1]})


def test_recomputed_layers_give_the_same_gradients_with_documents():
    from nanoflow.parallel.plan import recompute

    _, plain = hf_and_ours()
    _, recomputed = hf_and_ours()
    for layer in recomputed.model.layers:
        recompute(layer)
    batch = packed_batch(2, 40, seed=3)
    for model in (plain, recomputed):
        model(batch["input_ids"], batch["labels"], position_ids=batch["position_ids"]).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_an_eval_set_with_document_masking_scores_its_windows_within_documents(tmp_path):
    from nanoflow.evaluation import load_eval_set, score
    from nanoflow.parallel.mesh import SINGLE

    rng = np.random.default_rng(13)
    write_folder(tmp_path / "tokens", documents(rng, 300, 97, 123, length=(1, 30)))
    config = load(tmp_path, [stage("a", 1, {"dataset_folder": str(tmp_path / "tokens")})],
                  overrides=[f'evaluation.datasets=[{{name = "m", document_masking = true, dataset = {{dataset_folder = '
                             f'"{tmp_path / "tokens"}"}}, max_samples = 6}}, {{name = "p", dataset = {{dataset_folder = '
                             f'"{tmp_path / "tokens"}"}}, max_samples = 6}}]'])
    masked, plain = (load_eval_set(config, entry, BYTES) for entry in config.evaluation.datasets)
    assert plain.position_ids is None and torch.equal(masked.input_ids, plain.input_ids)
    expected = mark_documents(plain.input_ids.numpy(), plain.labels.numpy().copy(), EOS)
    assert masked.position_ids.tolist() == expected.tolist()
    _, model = hf_and_ours()
    with torch.no_grad():
        summed = model(masked.input_ids, masked.labels, position_ids=masked.position_ids)
    result = score(model, masked, SINGLE)
    assert result["tokens"] == int((masked.labels != IGNORE_INDEX).sum())
    assert result["loss"] == pytest.approx(summed.item() / result["tokens"], rel=1e-5)
