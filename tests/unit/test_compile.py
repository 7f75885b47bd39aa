"""`[model] compile = true` on one process: the whole forward, loss included, one graph (fullgraph), HF's names."""

import pytest
import torch
from helpers import tiny

from nanoflow.build import build_model


def test_the_whole_forward_is_compiled_and_keeps_hf_names(tmp_path):
    eager = build_model(tiny(tmp_path / "run"))
    compiled = build_model(tiny(tmp_path / "run", "model.compile=true"))
    assert compiled._compiled_body is not None
    assert all(not layer._compiled_call_impl for layer in compiled.model.layers)   # not layer by layer as well
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert [name for name, _ in compiled.named_parameters()] == [name for name, _ in eager.named_parameters()]


def test_compiled_loss_and_gradients_match_the_eager_ones(tmp_path):
    eager = build_model(tiny(tmp_path / "run"))
    compiled = build_model(tiny(tmp_path / "run", "model.compile=true"))
    ids = torch.randint(0, 288, (2, 32), generator=torch.Generator().manual_seed(0))
    scale = torch.tensor(1 / 64)
    losses = []
    for model in (eager, compiled):
        loss = model(ids, ids.roll(-1, 1), grad_scale=scale) * scale
        loss.backward()
        losses.append(loss.item())
    with torch.compiler.set_stance("fail_on_recompile"):   # the same shapes again: the graph is reused
        compiled(ids, ids.roll(-1, 1), grad_scale=scale)
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6 * p.grad.abs().max().item(), msg=name)


def test_packed_documents_run_the_body_eagerly_and_whole_rows_compiled(tmp_path, monkeypatch):
    model = build_model(tiny(tmp_path / "run", "model.compile=true"))
    ids = torch.randint(0, 288, (2, 32), generator=torch.Generator().manual_seed(0))
    packed = torch.cat([torch.arange(20), torch.arange(12)]).repeat(2, 1)
    calls = []
    monkeypatch.setattr(model, "_compiled_body", lambda *args: calls.append("compiled") or model._body(*args))
    model(ids, position_ids=packed)
    assert calls == []   # their attention follows each batch's documents: traced, it would recompile per batch
    model(ids, position_ids=torch.arange(32).repeat(2, 1))
    assert calls == ["compiled"]
