"""AdamW's state restored from a checkpoint (nanoflow/parallel/shards.py load_moments) is what torch's own
load_state_dict makes of the same state — dtype, device and values, entry by entry, for the fused, foreach
and for-loop implementations — and training goes on from it bit for bit; fused AdamW is the default."""

from __future__ import annotations

import io as text_io

import pytest
import torch
from helpers import TINY, tiny

from nanoflow import init_state, load_config
from nanoflow.build import build_optimizer
from nanoflow.checkpoint.checkpointer import Checkpointer
from nanoflow.io import open_checkpoint
from nanoflow.model import Llama
from nanoflow.parallel.shards import load_moments, step_form
from nanoflow.state import TrainState

FLAVOURS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


def adamw(model: torch.nn.Module, flavour: str) -> torch.optim.AdamW:
    decayed = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                             lr=3e-3, betas=(0.9, 0.95), eps=1e-8, **FLAVOURS[flavour])


def steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, count: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for step in range(count):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator) * 10.0 ** (step % 3 - 3)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def model_like(model: torch.nn.Module, config) -> Llama:
    twin = Llama(config.model)
    twin.load_state_dict(model.state_dict())
    return twin


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_restored_adamw_state_is_what_torchs_own_load_state_dict_gives_and_training_goes_on_bit_for_bit(
        tmp_path, flavour):
    config = tiny(tmp_path / "run")
    state = init_state(config)
    optimizer = adamw(state.model, flavour)
    steps(state.model, optimizer, 3, seed=0)
    folder = Checkpointer(config, out=text_io.StringIO()).save(
        TrainState.create(step=3, model=state.model, optimizer=optimizer, lr_origin=0, run=state.run))

    by_torch_model = model_like(state.model, config)
    by_torch = adamw(by_torch_model, flavour)
    by_torch.load_state_dict(optimizer.state_dict())
    restored_model = model_like(state.model, config)
    restored = adamw(restored_model, flavour)
    load_moments(restored_model, restored, open_checkpoint(folder))

    pairs = list(zip(restored_model.parameters(), by_torch_model.parameters(), strict=True))
    for mine, theirs in pairs:
        got, want = restored.state[mine], by_torch.state[theirs]
        assert got.keys() == want.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in want:
            assert (got[key].dtype, got[key].device, got[key].shape) == \
                (want[key].dtype, want[key].device, want[key].shape), key
            assert torch.equal(got[key], want[key]), key
    steps(restored_model, restored, 2, seed=1)
    steps(by_torch_model, by_torch, 2, seed=1)
    for mine, theirs in pairs:
        assert torch.equal(mine, theirs)
        assert all(torch.equal(restored.state[mine][k], by_torch.state[theirs][k]) for k in by_torch.state[theirs])


def test_the_step_goes_where_each_implementation_keeps_it():
    saved = torch.tensor(7.0, dtype=torch.float64)   # whatever a file held: the optimizer's own form is made of it
    param = torch.zeros(2, dtype=torch.bfloat16)
    for group in ({"fused": True}, {"capturable": True}, {"fused": True, "capturable": True}):
        step = step_form(saved, param, group)
        assert (step.dtype, step.device, step.item()) == (torch.float32, param.device, 7.0)
    kept = step_form(saved, param, {"fused": None, "capturable": False})
    assert kept.dtype == torch.float64 and kept.device.type == "cpu" and kept is not saved   # as saved, a copy


def test_fused_adamw_is_the_default_and_false_leaves_the_choice_to_torch(tmp_path):
    state = init_state(tiny(tmp_path))
    assert all(group["fused"] for group in state.optimizer.param_groups)
    unfused = build_optimizer(state.model, tiny(tmp_path, "optimizer.optimizer_factory.torch_adam_is_fused=false")
                              .optimizer)
    assert all(group["fused"] is None and group["foreach"] is None for group in unfused.param_groups)


def test_fused_adamw_on_a_cpu_is_the_for_loops_update_to_within_a_rounding(tmp_path):
    # torch's fused CPU kernel orders the update's arithmetic its own way: not the for-loop's bits in every
    # element (here about 0.5 % of them differ), never by more than a few float32 roundings of the weights' size.
    config = load_config(TINY)
    runs = {}
    for flavour in ("fused", "for-loop"):
        model = Llama(config.model)
        model.reset_parameters(torch.Generator().manual_seed(0))
        steps(model, adamw(model, flavour), 5, seed=2)
        runs[flavour] = dict(model.named_parameters())
    for name, p in runs["fused"].items():
        rounding = torch.finfo(torch.float32).eps * p.detach().abs().max().item()   # float32's at the largest weight
        torch.testing.assert_close(p, runs["for-loop"][name], rtol=0, atol=4 * rounding, msg=name)
