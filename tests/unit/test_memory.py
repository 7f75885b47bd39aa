"""Memory features: the chunked loss (nanoflow/loss.py) and recompute_layer equal the plain path's value
and gradients; the step reads device values once. Multi-process layouts run under torchrun in
tests/e2e/test_memory_process.py."""

import pytest
import torch
import torch.nn.functional as F
from memory_worker import batch, config_for, gradients

import nanoflow
from nanoflow.loss import cross_entropy_sum
from nanoflow.model import Llama
from nanoflow.parallel.mesh import SINGLE
from nanoflow.parallel.plan import parallelize


def plain_loss(hidden, weight, labels):
    return F.cross_entropy((hidden @ weight.t()).float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                           reduction="sum")


def leaves(*shapes, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=generator, dtype=dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("chunk_logits", [1, 97 * 50, 97 * 24 * 3, 10**9])  # one position a chunk … all at once
def test_chunked_loss_value_and_gradients_equal_the_plain_path(chunk_logits):
    hidden, weight = leaves((3, 24, 16), (97, 16))
    labels = torch.randint(0, 97, (3, 24), generator=torch.Generator().manual_seed(1))
    labels[0, :5] = -100
    labels[2] = -100   # a fully masked row
    expected = plain_loss(hidden, weight, labels)
    count = (labels != -100).sum()   # the step's mean over target tokens
    expected_grads = torch.autograd.grad(expected / count, (hidden, weight))
    loss = cross_entropy_sum(hidden, weight, labels, -100, chunk_logits=chunk_logits)
    grads = torch.autograd.grad(loss / count, (hidden, weight))
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)   # a float32 sum of ≈ 50 terms: relative
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.all(grads[0][2] == 0) and torch.all(grads[0][0, :5] == 0)   # masked positions: no gradient


def test_a_fully_masked_batch_has_zero_loss_and_zero_gradients():
    hidden, weight = leaves((2, 8, 16), (50, 16))
    loss = cross_entropy_sum(hidden, weight, torch.full((2, 8), -100), -100, chunk_logits=100)
    loss.backward()
    assert loss.item() == 0 and torch.all(hidden.grad == 0) and torch.all(weight.grad == 0)


def test_chunked_loss_under_bfloat16_autocast_rounds_the_logits_as_the_plain_path_does():
    hidden, weight = leaves((2, 32, 64), (300, 64))
    labels = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.cross_entropy(F.linear(hidden, weight).float().flatten(0, 1), labels.flatten(), reduction="sum")
        loss = cross_entropy_sum(hidden, weight, labels, -100, chunk_logits=300 * 7)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    grads = torch.autograd.grad(loss, (hidden, weight))
    # The same bf16 logits, so the same float32 loss up to the order of the sum.
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(grads[0], expected_grads[0], rtol=0, atol=1e-6)   # bf16 products, float32 kept
    # The head's gradient: bf16 partial sums per chunk instead of one bf16 sum over all positions: equal
    # within bf16's resolution (8 bits) of the gradient's scale.
    scale = expected_grads[1].abs().max()
    torch.testing.assert_close(grads[1], expected_grads[1], rtol=0, atol=float(scale) * 2**-8)
    assert grads[0].dtype == grads[1].dtype == torch.float32


def build(config, compile: bool = False) -> Llama:
    """The model as the run builds it: drawn from the seed, each layer compiled in place (`[model] compile`), the plan."""
    model = Llama(config.model)
    model.reset_parameters(torch.Generator().manual_seed(config.general.seed))
    if compile:
        for layer in model.model.layers:
            layer.compile()
    return parallelize(model, SINGLE, config)


def saved_bytes(function) -> int:
    """Bytes autograd saves for backward while `function()` runs (each storage once, leaves excluded)."""
    storages = {}

    def pack(tensor):
        if not (tensor.is_leaf and tensor.requires_grad):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        function()
    return sum(storages.values())


def test_chunked_loss_saves_one_float_a_position_not_the_logits():
    hidden, weight = leaves((4, 64, 32), (5000, 32))
    labels = torch.randint(0, 5000, (4, 64))
    plain = saved_bytes(lambda: plain_loss(hidden, weight, labels))
    chunked = saved_bytes(lambda: cross_entropy_sum(hidden, weight, labels, -100, chunk_logits=5000 * 16))
    assert plain >= 4 * 64 * 5000 * 4          # at least the float32 log-softmax of every position
    assert chunked <= 4 * 64 * (32 * 4 + 8 + 4)  # hidden (a view of the caller's), labels, log-sum-exp


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_model_gradients_chunked_and_recomputed_equal_the_plain_path(tied):
    config = config_for(tied=tied)
    ids, labels = batch(config)
    loss, reference = gradients(config, SINGLE, "plain", ids, labels)
    for variant, cfg in (("chunked", config), ("recompute", config_for(recompute=True, tied=tied))):
        got_loss, got = gradients(cfg, SINGLE, variant, ids, labels)
        torch.testing.assert_close(got_loss, loss, rtol=0, atol=1e-6, msg=variant)
        assert got.keys() == reference.keys()
        for name in reference:
            torch.testing.assert_close(got[name], reference[name], rtol=0, atol=1e-6, msg=f"{variant}: {name}")


def test_recompute_keeps_only_each_layer_s_input_and_the_parameter_names():
    plain_config, recompute_config = config_for(layers=4), config_for(recompute=True, layers=4)
    models = [build(config) for config in (plain_config, recompute_config)]
    ids, labels = batch(plain_config)
    plain, recomputed = (saved_bytes(lambda m=m: m(ids, labels)) for m in models)
    assert recomputed < plain / 3, (recomputed, plain)
    assert [n for n, _ in models[0].named_parameters()] == [n for n, _ in models[1].named_parameters()]
    assert models[0].state_dict().keys() == models[1].state_dict().keys()


@pytest.mark.slow
def test_recompute_composes_with_per_layer_compile():
    config = config_for(recompute=True)
    ids, labels = batch(config)
    _, reference = gradients(config_for(), SINGLE, "plain", ids, labels)
    model = build(config, compile=True)
    loss = model(ids, labels) / (labels != -100).sum()
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[name], rtol=0, atol=1e-6, msg=name)


HOST_READS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__", "__array__")


def test_a_step_reads_device_values_once_the_finite_check_with_the_metrics(monkeypatch):
    """docs/parallelism.md: the step's one read of device values is a 3-element tolist after the backward
    (loss, gradient norm, target tokens). AdamW's step counters are CPU tensors by torch's design (their
    .item() is no device read) and are not counted."""
    config = config_for()
    state = nanoflow.init_state(config)
    ids, labels = batch(config)
    state, _ = nanoflow.train_step(state, {"input_ids": ids, "labels": labels})   # AdamW's state exists now
    counters = {id(s["step"]) for s in state.optimizer.state.values()}
    reads = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            if id(self) not in counters:
                reads.append((_name, tuple(self.shape)))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    state, metrics = nanoflow.train_step(state, {"input_ids": ids, "labels": labels})
    monkeypatch.undo()
    assert reads == [("tolist", (3,))]
    assert metrics["target_tokens"] == int((labels != -100).sum()) and isinstance(metrics["target_tokens"], int)
    assert isinstance(metrics["loss"], float) and isinstance(metrics["grad_norm"], float)
