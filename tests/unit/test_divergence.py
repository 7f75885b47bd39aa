"""Non-finite numbers: refused in the config, and a non-finite loss or gradient norm stops the step before the
update (a diverging run: tests/e2e/test_divergence_runs.py)."""

import pytest
import torch
from helpers import TINY

from nanoflow import ConfigError, init_state, load_config, train_step
from nanoflow.errors import EXIT_DIVERGED
from nanoflow.step import DivergedError

HUGE_LR = ("optimizer.learning_rate_scheduler.learning_rate=1e30", "optimizer.learning_rate_scheduler.lr_warmup_steps=0")


def tiny(*overrides: str):
    return load_config(TINY, list(overrides))


def batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 257, (4, 32), generator=g), "labels": torch.randint(0, 257, (4, 32), generator=g)}


def snapshot(state) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in state.model.parameters()]
    return tensors + [v.clone() for moments in state.optimizer.state.values() for v in moments.values()]


@pytest.mark.parametrize("key", ["optimizer.learning_rate_scheduler.learning_rate", "optimizer.optimizer_factory.adam_eps",
                                 "optimizer.weight_decay", "model.rms_norm_eps", "optimizer.clip_grad"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_config_numbers_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"{key}: expected a finite number, got {value.lstrip('-')}|{key}: .*-inf"):
        tiny(f"{key}={value}")


def test_an_update_that_overflows_stops_the_next_step_before_its_update():
    state = init_state(tiny(*HUGE_LR))
    state, metrics = train_step(state, batch(0))   # finite, but it throws the weights out to ~1e30
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    before = snapshot(state)
    with pytest.raises(DivergedError, match=r'step 2 \(stage "pretrain"\): the (loss|gradient norm) is (nan|inf)') as error:
        train_step(state, batch(1))
    assert error.value.exit_status == EXIT_DIVERGED == 3
    after = snapshot(state)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert state.step == 1 and all(p.grad is None for p in state.model.parameters())


def test_weights_set_to_inf_stop_the_first_step_with_parameters_untouched():
    state = init_state(tiny())
    with torch.no_grad():
        state.model.model.norm.weight.fill_(float("inf"))
    before = snapshot(state)
    with pytest.raises(DivergedError, match="step 1 "):
        train_step(state, batch())
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(state), strict=True))
    assert not state.optimizer.state   # AdamW never stepped: no moments were created


