"""The fused linear cross-entropy (nanoflow/loss.py) against the plain full-logits path: value and
gradients (tied and untied heads, masks, chunks that do not divide the positions, bfloat16 autocast,
gradient accumulation in train_step), no full logits ever made, and the choice between them."""

import pytest
import torch
from helpers import TINY, assert_same_steps
from support.largest import LargestTensor

import nanoflow.loss
from nanoflow import init_state, load_config, train_step
from nanoflow.loss import cross_entropy_sum, describe, lm_loss, plain_cross_entropy_sum, token_scores
from nanoflow.model import Llama


def leaves(*shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=generator).requires_grad_() for s in shapes]


def masked_labels(shape, vocab, seed=1):
    labels = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
    labels[0, :5] = -100
    labels[-1] = -100   # a fully masked row
    return labels


@pytest.mark.parametrize("scaled", [False, True], ids=["no-grad-scale", "grad-scale"])
@pytest.mark.parametrize("chunk_logits", [97, 97 * 7, 97 * 24 * 3, 10**9])   # 1 and 7 positions a chunk (72 positions) … all
def test_fused_value_and_gradients_equal_the_plain_path(chunk_logits, scaled):
    hidden, weight = leaves((3, 24, 16), (97, 16))
    labels = masked_labels((3, 24), 97)
    count = (labels != -100).sum()
    expected = plain_cross_entropy_sum(hidden, weight, labels, -100)
    expected_grads = torch.autograd.grad(expected / count, (hidden, weight))
    scale = torch.ones(()) / count if scaled else None
    loss = cross_entropy_sum(hidden, weight, labels, -100, chunk_logits=chunk_logits, grad_scale=scale)
    grads = torch.autograd.grad(loss / count, (hidden, weight))
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.all(grads[0][-1] == 0) and torch.all(grads[0][0, :5] == 0)   # masked positions: no gradient


def test_a_grad_scale_other_than_the_incoming_gradient_still_gives_the_right_gradients():
    hidden, weight = leaves((2, 30, 16), (50, 16))
    labels = masked_labels((2, 30), 50)
    expected = torch.autograd.grad(plain_cross_entropy_sum(hidden, weight, labels, -100) * 3.5, (hidden, weight))
    loss = cross_entropy_sum(hidden, weight, labels, -100, chunk_logits=50 * 8, grad_scale=torch.tensor(0.01))
    for got, want in zip(torch.autograd.grad(loss * 3.5, (hidden, weight)), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fused_under_bfloat16_autocast_rounds_the_logits_as_the_plain_path_does():
    hidden, weight = leaves((2, 32, 64), (300, 64))
    labels = masked_labels((2, 32), 300)
    count = (labels != -100).sum()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = plain_cross_entropy_sum(hidden, weight, labels, -100)
        loss = cross_entropy_sum(hidden, weight, labels, -100, chunk_logits=300 * 5, grad_scale=torch.ones(()) / count)
    expected_grads = torch.autograd.grad(expected / count, (hidden, weight))
    grads = torch.autograd.grad(loss / count, (hidden, weight))
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-4)   # the same bf16 logits, summed in float32
    torch.testing.assert_close(grads[0], expected_grads[0], rtol=0, atol=1e-6)
    # The head's gradient: bf16 products summed per chunk, not over all positions at once.
    scale = expected_grads[1].abs().max()
    torch.testing.assert_close(grads[1], expected_grads[1], rtol=0, atol=float(scale) * 2**-8)
    assert grads[0].dtype == grads[1].dtype == torch.float32


def test_without_gradients_only_the_value_is_computed():
    hidden, weight = leaves((2, 16, 8), (40, 8))
    labels = masked_labels((2, 16), 40)
    with torch.no_grad():
        loss = cross_entropy_sum(hidden, weight, labels, -100, chunk_logits=40 * 3)
    torch.testing.assert_close(loss, plain_cross_entropy_sum(hidden, weight, labels, -100), rtol=1e-6, atol=0)
    assert not loss.requires_grad


def test_a_second_backward_is_refused_not_silently_wrong():
    hidden, weight = leaves((1, 8, 8), (20, 8))
    loss = cross_entropy_sum(hidden, weight, torch.randint(0, 20, (1, 8)), -100)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_the_fused_path_never_makes_more_than_a_chunk_of_logits():
    positions, vocab, hidden_size, chunk = 256, 1000, 8, 10_000   # 256,000 logits; 10 positions a chunk
    hidden, weight = leaves((4, 64, hidden_size), (vocab, hidden_size))
    labels = masked_labels((4, 64), vocab)
    sizes = {}
    for name, loss_of in (("plain", lambda: plain_cross_entropy_sum(hidden, weight, labels, -100)),
                          ("fused", lambda: cross_entropy_sum(hidden, weight, labels, -100, chunk_logits=chunk))):
        hidden.grad = weight.grad = None
        with LargestTensor() as mode:
            loss_of().backward()
        sizes[name] = mode.largest
    assert sizes["plain"] >= positions * vocab                       # the measure sees full logits where they are
    assert sizes["fused"] <= max(chunk, vocab * hidden_size), sizes   # a chunk of logits, or the head's gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_logits", [97, 97 * 7, 10**9])   # 1 and 7 positions a chunk (72 positions), all
def test_token_scores_are_cross_entropy_and_argmax_of_the_whole_logits_position_by_position(chunk_logits, dtype):
    hidden, weight = (t.detach() for t in leaves((3, 24, 16), (97, 16)))
    labels = masked_labels((3, 24), 97)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        logits = torch.nn.functional.linear(hidden, weight).float()   # what the model's lm_head gives evaluation
        labels[1, ::2] = logits[1, ::2].argmax(dim=-1)   # positions whose label is the argmax
        nll, right = token_scores(hidden, weight, labels, -100, chunk_logits=chunk_logits)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                 reduction="none").view(labels.shape)
    assert nll.dtype == torch.float32 and nll.shape == right.shape == labels.shape
    assert torch.allclose(nll, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(nll == 0, labels == -100)   # ignored positions: nothing
    assert torch.equal(right, logits.argmax(dim=-1) == labels)
    assert right[1, ::2].all()


def test_lm_loss_takes_the_path_it_is_asked_for_and_the_header_says_it(monkeypatch):
    hidden, weight = leaves((2, 10, 8), (30, 8))
    labels = masked_labels((2, 10), 30)
    taken = []
    monkeypatch.setattr(nanoflow.loss, "plain_cross_entropy_sum", lambda *a: taken.append("plain") or a[0].sum())
    monkeypatch.setattr(nanoflow.loss, "cross_entropy_sum", lambda *a, **k: taken.append("fused") or a[0].sum())
    for method in ("fused", "plain"):
        lm_loss(hidden, weight, labels, -100, method=method)
    lm_loss(hidden, weight, labels, -100)
    assert taken == ["fused", "plain", "fused"]
    with pytest.raises(ValueError, match="loss method 'auto': expected one of fused, plain"):
        lm_loss(hidden, weight, labels, -100, method="auto")
    assert Llama.loss_method == "fused"
    assert describe(50_304) == ("fused linear cross-entropy, chunks of 667 positions on a CPU (128 MiB of float32 "
                                "logits), up to 10,672 on a GPU")
    assert describe(288, "plain") == "plain cross-entropy over the whole micro-batch's logits"


def model_gradients(model, ids, labels, method, dtype=None):
    model.zero_grad(set_to_none=True)
    model.loss_method = method
    count = (labels != -100).sum()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        loss = model(ids, labels, grad_scale=torch.ones(()) / count) / count
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_model_gradients_fused_equal_the_plain_path(tied, monkeypatch):
    config = load_config(TINY, [f"model.tie_word_embeddings={'true' if tied else 'false'}"])
    model = Llama(config.model)
    model.reset_parameters(torch.Generator().manual_seed(0))
    vocab = config.model.vocab_size
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (3, 20), generator=generator)
    labels = masked_labels((3, 20), vocab)
    monkeypatch.setattr(nanoflow.loss, "CPU_CHUNK_BYTES", 4 * vocab * 7)   # 7 positions a chunk: 60 is no multiple
    loss, reference = model_gradients(model, ids, labels, "plain")
    got_loss, got = model_gradients(model, ids, labels, "fused")
    torch.testing.assert_close(got_loss, loss, rtol=0, atol=1e-6)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    for name in reference:
        torch.testing.assert_close(got[name], reference[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "sft-masked"])
def test_train_step_fused_with_accumulation_equals_plain_in_one_micro_batch(masked, monkeypatch):
    from test_step import random_batch

    monkeypatch.setattr(nanoflow.loss, "CPU_CHUNK_BYTES", 4 * 288 * 10)   # several chunks a micro-batch
    batch = random_batch(8, 32, seed=1, masked=masked)
    results = []
    for micro, method in [(8, "plain"), (8, "fused"), (4, "fused"), (1, "fused")]:
        state = init_state(load_config(TINY, [f"tokens.micro_batch_size={micro}", "tokens.global_batch_size=8"]))
        state.model.loss_method = method
        state, metrics = train_step(state, batch)
        results.append((metrics["loss"], metrics["grad_norm"], dict(state.model.named_parameters())))
    assert_same_steps(results)


def test_with_the_step_s_grad_scale_the_gradients_are_the_former_chunked_loss_s_bit_for_bit():
    # The former loss computed each chunk's logits again in backward and scaled their gradient by the
    # incoming one before the matmuls; the default curriculum's SFT skill is chaotic in the last bits
    # of the gradients, so the fused loss keeps that order exactly when told the incoming gradient.
    hidden, weight = leaves((8, 256, 128), (288, 128))   # the curriculum's micro-batch: one chunk
    labels = masked_labels((8, 256), 288)
    count = (labels != -100).sum()
    scale = torch.ones(()) / count
    total = cross_entropy_sum(hidden, weight, labels, -100, grad_scale=scale)
    incoming = []
    total.register_hook(incoming.append)
    (total / count).backward()
    assert torch.equal(incoming[0], scale)   # train_step's grad_scale is what `loss / count` hands back
    with torch.no_grad():
        h, targets = hidden.flatten(0, 1), labels.flatten()
        is_target = targets != -100
        grad_total = incoming[0]
        logits = (h @ weight.t()).float()
        grad = logits.sub_(torch.logsumexp(logits, dim=-1)[:, None]).exp_()
        grad.scatter_add_(1, torch.where(is_target, targets, 0)[:, None], torch.full((h.shape[0], 1), -1.0))
        grad *= (grad_total * is_target)[:, None]
        assert torch.equal(hidden.grad.flatten(0, 1), grad @ weight)
        assert torch.equal(weight.grad, torch.zeros(weight.shape) + grad.t() @ h)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_blocked_logsumexp_is_torch_s_bit_for_bit_whatever_the_blocks(threads, monkeypatch):
    # Above torch's grain size (32,768 elements) a one-row reduction is split across threads and sums in
    # another order; the blocks keep at least two rows, so each row is summed as torch.logsumexp sums it.
    vocab = 40_000
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(0)) * 4
    logits[3] = -torch.inf   # a row of -inf: torch's max of it is taken as 0
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for block_rows in (2, 3, 5, 11, 12, 64):   # 12 rows in blocks of 11: the last row joins the block before it
            monkeypatch.setattr(nanoflow.loss, "SCRATCH_BYTES", 4 * vocab * block_rows)
            for rows in (12, 7, 1):
                buffers = nanoflow.loss._ChunkBuffers(rows, torch.Size((vocab, 8)), torch.float32, torch.device("cpu"))
                assert torch.equal(buffers.logsumexp(logits[:rows]), torch.logsumexp(logits[:rows], dim=-1))
    finally:
        torch.set_num_threads(before)


def test_the_fused_forward_makes_its_chunk_sized_tensors_once_a_call():
    # A chunk-sized tensor made per chunk is memory mapped and zeroed anew each time (it is above what
    # malloc keeps for reuse): the loss makes them once and every chunk writes into them.
    vocab, positions = 1000, 64
    hidden, weight = leaves((positions, 8), (vocab, 8))
    labels = torch.randint(0, vocab, (positions,), generator=torch.Generator().manual_seed(2))
    made = []

    class CountLarge(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):   # new memory: not a view of, or written into, an input
                if isinstance(t, torch.Tensor) and t.numel() >= 4 * vocab \
                        and t.untyped_storage().data_ptr() not in inputs:
                    made.append((str(func), t.numel()))
            return out

    with CountLarge():
        cross_entropy_sum(hidden, weight, labels, -100, chunk_logits=4 * vocab).backward()   # 16 chunks
    # the logits' buffer and logsumexp's block, then the head's gradient (the first chunk's product)
    assert made == [("aten.empty.memory_format", 4 * vocab)] * 2 + [("aten.mm.default", vocab * 8)], made


def test_logsumexp_takes_the_whole_chunk_on_a_gpu_and_blocks_of_rows_on_a_cpu():
    from nanoflow.loss import SCRATCH_BYTES, logsumexp_block_rows

    assert logsumexp_block_rows(4_186, 128_256, torch.device("cuda")) == 4_186
    assert logsumexp_block_rows(261, 128_256, torch.device("cpu")) == SCRATCH_BYTES // (4 * 128_256) == 65
    assert logsumexp_block_rows(261, 20_000_000, torch.device("cpu")) == 2   # never one row: see the block test
