"""train_step: one optimizer step on one global batch, whatever its split into micro-batches."""

import pytest
import torch
from helpers import TINY, assert_same_steps

import nanoflow
from nanoflow import StaleStateError, init_state, load_config, train_step


def tiny(*overrides: str):
    return load_config(TINY, list(overrides))


def random_batch(rows: int, seq: int, *, seed: int = 0, masked: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 257, (rows, seq), generator=g)
    labels = torch.randint(0, 257, (rows, seq), generator=g)
    if masked:
        # Uneven masks: whole rows, prefixes and scattered tokens, so micro-batches hold different token counts.
        labels[0] = -100
        labels[1, : seq // 2] = -100
        labels[torch.rand((rows, seq), generator=g) < 0.3] = -100
    return {"input_ids": input_ids, "labels": labels}


def test_loss_falls_on_a_fixed_batch():
    state = init_state(tiny("tokens.train_steps=30", "data_stages.sft.start_training_step=31"))
    batch = random_batch(4, 32)
    losses = []
    for _ in range(30):
        state, metrics = train_step(state, batch)
        losses.append(metrics["loss"])
    assert losses[-1] < 0.5 * losses[0]
    assert state.step == 30


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "sft-masked"])
def test_micro_batch_split_does_not_change_loss_or_update(masked):
    batch = random_batch(8, 32, seed=1, masked=masked)
    results = []
    for micro, accumulation in [(8, 1), (4, 2), (1, 8)]:
        config = tiny(f"tokens.micro_batch_size={micro}", "tokens.global_batch_size=8")
        assert config.stage_tokens(0).batch_accumulation_per_replica == accumulation
        state, metrics = train_step(init_state(config), batch)
        results.append((metrics["loss"], metrics["grad_norm"], dict(state.model.named_parameters())))
    assert_same_steps(results)
    params = results[0][2]
    for *_, other_params in results[1:]:
        for name, p in params.items():
            # AdamW's first update is lr·g/(|g|+eps) ≈ lr·sign(g): where |g| is within rounding of 0,
            # a different summation order may flip the sign. Everywhere else the update must agree.
            settled = p.grad.abs() > 1e-6
            torch.testing.assert_close(other_params[name][settled], p[settled], rtol=0, atol=1e-6, msg=name)


def test_gradient_is_the_mean_over_all_target_tokens():
    # With masks, the mean over the batch's target tokens differs from the mean of per-micro-batch
    # means (HF's 2024 gradient-accumulation bug): check against the former, computed by hand.
    config = tiny("tokens.micro_batch_size=2", "tokens.global_batch_size=4")
    batch = random_batch(4, 32, seed=2, masked=True)
    state = init_state(config)
    logits = state.model(batch["input_ids"])
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    _, metrics = train_step(state, batch)
    assert metrics["loss"] == pytest.approx(expected.item(), abs=1e-6)
    assert metrics["target_tokens"] == int((batch["labels"] != -100).sum())


def test_two_runs_from_the_same_seed_are_bitwise_identical():
    finals = []
    for _ in range(2):
        state = init_state(tiny())
        for step in range(3):
            state, _ = train_step(state, random_batch(4, 32, seed=step))
        finals.append(state)
    for (name, a), b in zip(finals[0].model.state_dict().items(), finals[1].model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(finals[0].optimizer.state.values(), finals[1].optimizer.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_a_consumed_state_cannot_be_stepped_again():
    state0 = init_state(tiny())
    batch = random_batch(4, 32)
    state1, _ = train_step(state0, batch)
    with pytest.raises(StaleStateError, match="step 0"):
        train_step(state0, batch)
    state2, metrics = train_step(state1, batch)  # the returned state stays usable
    assert (state0.step, state1.step, state2.step) == (0, 1, 2)
    assert metrics["step"] == 2


def test_state_records_per_stage_consumed_samples():
    state = init_state(tiny())
    assert state.consumed_samples == (0, 0)
    state, _ = train_step(state, random_batch(4, 32))
    assert state.consumed_samples == (4, 0)


def test_wrong_batch_shape_names_the_stage():
    state = init_state(tiny())
    with pytest.raises(ValueError, match='stage "pretrain".*\\[4, 32\\]'):
        train_step(state, random_batch(4, 24))


def test_metrics_report_lr_from_the_closed_form():
    config = tiny()
    state, metrics = train_step(init_state(config), random_batch(4, 32))
    args = config.optimizer.learning_rate_scheduler
    assert metrics["lr"] == pytest.approx(args.learning_rate / args.lr_warmup_steps)
    assert state.optimizer.param_groups[0]["lr"] == metrics["lr"]
    assert set(metrics) >= {"loss", "lr", "grad_norm", "tokens"}


def test_bfloat16_autocast_keeps_float32_master_weights():
    state = init_state(tiny("model.dtype=bfloat16"))
    state, metrics = train_step(state, random_batch(4, 32))
    assert all(p.dtype == torch.float32 for p in state.model.parameters())
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_no_weight_decay_on_norms():
    state = init_state(tiny())
    groups = state.optimizer.param_groups
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in state.model.named_parameters():
        assert (id(p) in decayed) == (p.ndim >= 2), name


def test_top_level_api():
    assert nanoflow.train_step is train_step and nanoflow.init_state is init_state


@pytest.mark.parametrize("clip", ["false", "1e-3", "1e6"])
def test_clip_grad_false_leaves_gradients_unclipped(clip):
    state, metrics = train_step(init_state(tiny(f"optimizer.clip_grad={clip}")), random_batch(4, 32))
    norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in state.model.parameters()])))
    assert metrics["grad_norm"] > 1e-2   # so that clipping to 1e-3 shows
    expected = 1e-3 if clip == "1e-3" else metrics["grad_norm"]
    assert norm == pytest.approx(expected, rel=1e-4)
