"""Non-finite numbers: refused in the config, and a non-finite loss or gradient norm stops the run before the update."""

import hashlib
import io as text_io
from pathlib import Path

import pytest
import torch
from helpers import TINY
from process_helpers import run_in_process

from nanoflow import ConfigError, init_state, io, load_config, train_step
from nanoflow.errors import EXIT_DIVERGED
from nanoflow.step import DivergedError
from nanoflow.training.loop import train

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


def _checkpoint_files(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != "metrics.jsonl" and not p.name.startswith("events.")}


def test_a_diverging_run_saves_nothing_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    train(tiny(f'checkpoints.checkpoints_path="{tmp_path}"'), until_step=4, out=text_io.StringIO())
    before = _checkpoint_files(tmp_path)
    assert "4/checkpoint_metadata.json" in before
    # Resumed with a huge LR: step 5 throws the weights out, step 6 is non-finite.
    sets = [a for o in (f'checkpoints.checkpoints_path="{tmp_path}"', "checkpoints.checkpoint_interval=1",
                        "optimizer.learning_rate_scheduler.learning_rate=1e30",
                        "checkpoints.ignore_lr_schedule_change=true") for a in ("--set", o)]  # the LR edit is the point
    result = run_in_process("train", TINY, *sets, capsys=capsys)
    assert result.returncode == EXIT_DIVERGED, result.stdout + result.stderr
    assert 'step 6 (stage "pretrain")' in result.stderr and "Traceback" not in result.stderr
    after = _checkpoint_files(tmp_path)
    assert set(after) - set(before) == {f for f in after if f.startswith("5/")}   # step 5 (finite) was saved
    assert {f: after[f] for f in before if f != "latest.txt"} == {f: before[f] for f in before if f != "latest.txt"}
    assert io.read_metadata(str(tmp_path))["step"] == 5 and not (tmp_path / "6").exists()
    steps = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 5 and "NaN" not in steps[-1]
