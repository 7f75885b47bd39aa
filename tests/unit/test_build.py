"""build_model makes the modules on the meta device and draws the weights once, on the process's device: the
weights a run is seeded with are those of a model built on the CPU and drawn there (what nanoflow did before),
bit for bit, tied or not; an init_from start draws nothing."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny

import nanoflow.model
from nanoflow import init_state
from nanoflow.build import build_model
from nanoflow.model import Llama


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_meta_built_model_has_the_weights_of_one_built_and_drawn_on_the_cpu(tmp_path, tied):
    config = tiny(tmp_path, f"model.tie_word_embeddings={'true' if tied else 'false'}", "general.seed=7")
    reference = Llama(config.model)   # nn.Linear's own init first, then HF's draw from the seed over it
    reference.reset_parameters(torch.Generator().manual_seed(7))
    model = build_model(config)
    names = dict(model.named_parameters())
    assert names.keys() == dict(reference.named_parameters()).keys()
    for name, p in reference.named_parameters():
        assert names[name].device.type == "cpu" and torch.equal(names[name], p), name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_without_init_nothing_is_drawn_and_no_tensor_is_left_on_meta(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("drawn")

    monkeypatch.setattr(nanoflow.model.Llama, "reset_parameters", refuse)
    model = build_model(tiny(tmp_path), init=False)
    assert all(not p.is_meta for p in model.parameters())


def test_an_init_from_start_reads_its_weights_without_drawing_first(tmp_path, monkeypatch):
    from helpers import quiet

    from nanoflow.checkpoint.checkpointer import Checkpointer

    source = init_state(tiny(tmp_path / "source", "general.seed=3"))
    folder = Checkpointer(source.run, out=quiet()).save(source)
    monkeypatch.setattr(nanoflow.model.Llama, "reset_parameters", lambda *a, **k: pytest.fail("drawn"))
    state = init_state(tiny(tmp_path / "new", f'model.init_from="{folder}"'))
    for (name, p), q in zip(state.model.named_parameters(), source.model.parameters(), strict=True):
        assert torch.equal(p, q), name
